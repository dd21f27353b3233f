"""The registry of layers and losses that K-FAC approximates (layer 5).

A `LayerCollection` records, for one model, which parameters belong to which
layer (with the layer's inputs and outputs), which approximation each layer
uses, and which losses (predictive distributions) the model is trained on.
It holds symbolic tensors of one graph; in a TF2 program build a fresh one
inside every trace of the training step (its state lives elsewhere, see
tensors/state.py). Variables are never used as dict keys: they are keyed by `ref()`.
"""

import collections
import contextlib

import tensorflow as tf

from kfac.python.ops.collection import default as default_lib
from kfac.python.ops.collection import layer_kinds
from kfac.python.ops.collection import losses as losses_lib
from kfac.python.ops.collection import memory as memory_lib
from kfac.python.ops.collection import use_check
from kfac.python.ops.compat_utils import legacy_constants
from kfac.python.ops.ekfac import scalings as ekfac_scalings
from kfac.python.ops.layers.base import curvature_options as options_lib
from kfac.python.ops.layers.base import registration as registration_base
from kfac.python.ops.layers.base.registration import VARIABLE_SCOPE
from kfac.python.ops.layers.base.registration import describe as _describe
from kfac.python.ops.layers.conv import registration as conv_registration
from kfac.python.ops.layers.conv import transpose_registration
from kfac.python.ops.layers.dense import registration as dense_registration
from kfac.python.ops.layers.embedding import registration as embedding_registration
from kfac.python.ops.layers.generic import registration as generic_registration
from kfac.python.ops.layers.multi_use import registration as multi_use_registration
from kfac.python.ops.layers.scale_shift import registration as scale_shift_registration
from kfac.python.ops.tensors import utils
from kfac.python.ops.tensors.layer_params_dict import LayerParametersDict

# The default approximation of each layer kind whose default can be changed
# (from the families' declarations, collection/layer_kinds.py).
_DEFAULT_APPROXIMATIONS = layer_kinds.DEFAULT_APPROXIMATIONS

# kfac 0.2.x's name of the blocks-by-parameters view (now the mapping
# itself).
BlocksByParams = LayerParametersDict


def _documented_by(function):
  """Gives a thin method the docstring of the function it calls."""
  def decorate(method):
    method.__doc__ = function.__doc__
    return method
  return decorate


class _UsesView:
  """`lc._vars_to_uses[var]`: the registered uses of `var` (0 if none)."""

  def __init__(self, uses):
    self._uses = uses

  def __getitem__(self, var):
    return self._uses.get(var)


@utils.exclude_from_autograph
class LayerCollection:
  """Registry of layers (parameters and their approximations) and losses.

  This class is the registry's core (layers, towers, factors, linked
  parameters, default approximations). Its parts: each layer family's
  declaration and registration functions (layers/<family>/registration.py,
  listed in collection/layer_kinds.py), which its register_* methods call
  with the collection; the losses (`collection/losses.LossRegistry`); the
  count of registered uses and the registration check
  (collection/use_check.py).

  The registry interface the families' registration functions use:
  `register_block`, `resolve_approximation`, `linked_approximation`,
  `default_approximation`, `record_uses`.
  """

  def __init__(self, graph=None, name="LayerCollection",
               curvature_options=None):
    """`curvature_options`: a CurvatureOptions (pi split, damping
    normalisation, eigenvalue clipping, sub-sampling of conv statistics;
    see layers/base/curvature_options.py); default: the old library's values, as
    changed by any set_global_constants call made before."""
    self._graph = graph
    self._name = name
    self._curvature_options = options_lib.check(
        legacy_constants.curvature_defaults() if curvature_options is None
        else curvature_options)
    self._fisher_blocks = LayerParametersDict()  # params -> block
    self._uses = use_check.UseCount()  # registered uses per variable
    self._factors = collections.OrderedDict()  # factor key -> factor
    self._factor_names = set()
    # Layers re-registered to fit the memory budget (memory_fallback.py).
    self.memory_fallbacks = []
    self._block_names = set()
    self._losses = losses_lib.LossRegistry()
    self._linked = collections.OrderedDict()  # frozenset(refs) -> approx
    self._linked_params = collections.OrderedDict()  # same key -> params
    self._defaults = dict(_DEFAULT_APPROXIMATIONS)
    self._finalized = False
    self._ekfac_strategy = "auto"
    # Registrations kfac 0.2.x accepted unchecked and this one cannot use
    # (record_unusable): their errors, raised when factors are made.
    self._unusable = []

  @property
  def ekfac_strategy(self):
    """How EKFAC blocks of layers sharing weights over positions compute
    their scalings: "auto" (per layer, the way needing less memory),
    "per_example" or "gramian" (see ekfac/scalings.py)."""
    return self._ekfac_strategy

  @ekfac_strategy.setter
  def ekfac_strategy(self, value):
    self._ekfac_strategy = ekfac_scalings.check_strategy(value)

  @property
  def name(self):
    return self._name

  @property
  def curvature_options(self):
    """The CurvatureOptions of this collection's blocks and factors."""
    return self._curvature_options

  @property
  def graph(self):
    return self._graph

  # ------------------------------------------------------------ defaults
  def _set_default(self, kind, approx):
    valid = layer_kinds.KINDS[kind].blocks
    if approx not in valid:
      raise ValueError("Unknown %s approximation %r; expected one of %s." %
                       (kind, approx, sorted(valid)))
    self._defaults[kind] = approx

  def default_approximation(self, kind):
    """The approximation of a `kind` layer registered without one: the
    collection's default for the kinds whose default can be changed, else
    the kind's own (collection/layer_kinds.py)."""
    if kind in self._defaults:
      return self._defaults[kind]
    return layer_kinds.KINDS[kind].default

  def set_default_generic_approximation(self, value):
    self._set_default("generic", value)

  @property
  def default_generic_approximation(self):
    return self._defaults["generic"]

  def set_default_fully_connected_approximation(self, value):
    self._set_default("fully_connected", value)

  @property
  def default_fully_connected_approximation(self):
    return self._defaults["fully_connected"]

  def set_default_fully_connected_multi_approximation(self, value):
    self._set_default("fully_connected_multi", value)

  @property
  def default_fully_connected_multi_approximation(self):
    return self._defaults["fully_connected_multi"]

  def set_default_conv2d_approximation(self, value):
    self._set_default("conv2d", value)

  @property
  def default_conv2d_approximation(self):
    return self._defaults["conv2d"]

  def set_default_conv2d_multi_approximation(self, value):
    self._set_default("conv2d_multi", value)

  @property
  def default_conv2d_multi_approximation(self):
    return self._defaults["conv2d_multi"]

  def set_default_scale_and_shift_approximation(self, value):
    self._set_default("scale_and_shift", value)

  @property
  def default_scale_and_shift_approximation(self):
    return self._defaults["scale_and_shift"]

  # ------------------------------------------------------------ default
  @contextlib.contextmanager
  def as_default(self):
    stack = default_lib.current_stack()
    stack.append(self)
    try:
      yield self
    finally:
      stack.pop()

  def record_unusable(self, message):
    """Records a registration that kfac 0.2.x accepted without checking
    (e.g. scalar constants as a dense layer's weights): registering goes on
    as it did there, with a warning; `check_usable` raises `message` when
    an estimator or optimizer sets up its blocks (check_registration) and
    when the factors are made."""
    self._unusable.append(message)

  def check_usable(self):
    """Raises ValueError naming every registration record_unusable kept."""
    if self._unusable:
      raise ValueError(
          "The LayerCollection has registrations K-FAC cannot compute "
          "factors for (registered with a warning, as kfac 0.2.x accepted "
          "them): " + " ".join(self._unusable))

  @property
  def _vars_to_uses(self):
    """kfac 0.2.x's private map variable -> registered uses, read by code
    written for it (its own tests): a read-only view of the use count."""
    return _UsesView(self._uses)

  # ------------------------------------------------------------ queries
  def get_blocks(self):
    return list(self._fisher_blocks.values())

  @property
  def fisher_blocks(self):
    """The blocks keyed by their parameters: a LayerParametersDict (look a
    block up by its variable, or its tuple / list of variables)."""
    return self._fisher_blocks

  @fisher_blocks.setter
  def fisher_blocks(self, blocks):
    """Replaces the registered blocks (kfac 0.2.x allowed assigning a dict
    of params -> block); the keys may not share variables."""
    self._check_not_finalized()
    if isinstance(blocks, LayerParametersDict):
      self._fisher_blocks = blocks
    else:
      # As assigned (kfac 0.2.x did not check an assigned dict either);
      # registrations after it are checked against all of its keys.
      self._fisher_blocks = LayerParametersDict.unchecked(
          blocks.items() if hasattr(blocks, "items") else blocks)

  @property
  def fisher_factors(self):
    """The factors made so far, keyed by (class, arguments)."""
    return self._factors

  def get_factors(self):
    return list(self._factors.values())

  def blocks_and_params(self):
    return list(self._fisher_blocks.items())

  @property
  def registered_variables(self):
    out = []
    for params in self._fisher_blocks:
      out.extend(utils.ensure_sequence(params))
    return tuple(out)

  @property
  def linked_parameters(self):
    return {k: (self._linked_params[k], a) for k, a in self._linked.items()}


  # ------------------------------------------------------------ factors
  def reset_factors(self):
    """Forgets the factors made so far (before any has state), so that the
    blocks make them again (the memory fallback, memory_fallback.py)."""
    self._factors.clear()
    self._factor_names.clear()

  def make_or_get_factor(self, cls, args, name=None):
    """Returns the factor `cls(*args)`, sharing one instance per distinct
    (cls, args) in this collection."""
    key = (cls, utils.hashable_key(tuple(args)))
    try:
      factor = self._factors.get(key)
    except TypeError as e:
      raise TypeError("Arguments of factor %s must be hashable (tensors and "
                      "variables are fine): %s" % (cls.__name__, e))
    if factor is None:
      factor = cls(*self._full_precision(args))
      factor.set_name(registration_base.unique_name(name or cls.__name__,
                                                    self._factor_names))
      if hasattr(factor, "set_curvature_options"):
        factor.set_curvature_options(self._curvature_options)
      self._factors[key] = factor
    return factor

  def _full_precision(self, value):
    """`value` (a nest of factor arguments) with float16 / bfloat16 tensors
    cast to float32, once per tensor: the statistics, their averages and
    inverses of a mixed-precision model are kept in float32 (products of
    half-precision activations overflow, and there are no half-precision
    Cholesky or eigh kernels)."""
    if isinstance(value, (list, tuple)):
      return type(value)(self._full_precision(v) for v in value)
    if not tf.is_tensor(value) or isinstance(value, tf.IndexedSlices):
      return value
    if value.dtype not in (tf.float16, tf.bfloat16):
      return value
    cache = self.__dict__.setdefault("_casts", {})
    key = value.ref()
    if key not in cache:
      cache[key] = tf.cast(value, tf.float32)
    return cache[key]

  # ------------------------------------------------------------ blocks
  def _check_not_finalized(self):
    if self._finalized:
      raise ValueError("LayerCollection %s is finalized (an estimator was "
                       "built on it); register everything before creating "
                       "the optimizer." % self._name)

  def register_block(self, layer_key, fisher_block, reuse=VARIABLE_SCOPE):
    """Registers `fisher_block` for the parameters `layer_key` (a variable,
    or a tuple / list of variables).

    With reuse (True, or VARIABLE_SCOPE inside a reusing variable scope)
    the parameters must have been registered before, with a block of the
    same type: that block is returned (the caller adds a tower to it). With
    tf.compat.v1.AUTO_REUSE an existing block is reused, else `fisher_block`
    is registered. Without reuse, registering the same parameters again is
    an error, and so is a key sharing a variable with another one.

    Raises:
      ValueError: for the conflicts above, naming the variables.
    """
    self._check_not_finalized()
    registration_base.check_params(layer_key)
    layer_key = (tuple(layer_key) if isinstance(layer_key, list)
                 else layer_key)
    mode = registration_base.reuse_mode(reuse)
    present = layer_key in self._fisher_blocks
    if mode is True or (mode == registration_base.AUTO and present):
      if not present:
        raise ValueError(
            "reuse=True for the registration of %s, but no layer with these "
            "parameters was registered before (reuse adds a tower to an "
            "existing registration). Register it first without reuse; reuse "
            "may also come from a reusing tf.compat.v1.variable_scope." %
            _describe(layer_key))
      existing = self._fisher_blocks[layer_key]
      if type(existing) is not type(fisher_block):
        raise ValueError(
            "Variable(s) %s were registered as %s and now as %s; a reused "
            "registration must use the same approximation." %
            (_describe(layer_key), type(existing).__name__,
             type(fisher_block).__name__))
      return existing
    if present:
      raise ValueError(
          "A FisherBlock for %s is already in LayerCollection. Pass "
          "reuse=True (or register inside a reusing variable scope) to add "
          "a tower." % _describe(layer_key))
    for var in utils.ensure_sequence(layer_key):
      owner = self._fisher_blocks.owner_of(var)
      if owner is not None:
        raise ValueError(
            "Variable %s was already registered in the layer (%s); a "
            "variable can belong to one layer only." %
            (utils.variable_name(var), _describe(owner)))
    self._check_linked(layer_key)
    if hasattr(fisher_block, "set_name"):
      base = utils.state_name(utils.ensure_sequence(layer_key)[0])
      fisher_block.set_name(registration_base.unique_name(
          base, self._block_names))
    self._fisher_blocks[layer_key] = fisher_block
    return fisher_block

  # kfac 0.2.x's name.
  _register_block = register_block

  def _check_linked(self, params):
    refs = frozenset(utils.hashable_key(utils.ensure_sequence(params)))
    for linked in self._linked:
      if linked & refs and linked != refs:
        raise ValueError(
            "Parameters (%s) overlap the linked parameter group (%s) but are "
            "not equal to it; register the whole group together." %
            (_describe(params), _describe(self._linked_params[linked])))

  def linked_approximation(self, params):
    """The approximation define_linked_parameters gave the group `params`
    (None if none)."""
    refs = frozenset(utils.hashable_key(utils.ensure_sequence(params)))
    return self._linked.get(refs)

  # The name graph search (tensormatch/record_registration.py) reads.
  _linked_approx = linked_approximation

  def resolve_approximation(self, params, approx, kind):
    """The approximation of a `kind` (a layers/base LayerKind) layer with
    parameters `params`: `approx`, else the linked group's, else the
    collection's default; ValueError unless the kind has a block for it."""
    registration_base.check_params(params)
    if approx is None:
      approx = (self.linked_approximation(params) or
                self.default_approximation(kind.name))
    if approx not in kind.blocks:
      raise ValueError(
          "Unknown approximation %r for %s layer (%s); expected one of %s." %
          (approx, kind.label, _describe(params), sorted(kind.blocks)))
    return approx

  def record_uses(self, params, uses):
    """Records `uses` more uses of each variable of `params` in the graph
    (checked by check_registration; float("inf") for registrations that
    cover any number of uses)."""
    self._uses.add(params, uses)

  def define_linked_parameters(self, params, approximation=None):
    """Declares `params` one group: registrations must cover the whole group,
    and `approximation` (if given) is used when one is not passed."""
    self._check_not_finalized()
    params = utils.ensure_sequence(params)
    refs = frozenset(utils.hashable_key(params))
    for other in self._linked:
      if other & refs and other != refs:
        raise ValueError("Linked group (%s) overlaps the group (%s)." %
                         (_describe(params), _describe(
                             self._linked_params[other])))
    self._linked[refs] = approximation
    self._linked_params[refs] = params if len(params) > 1 else params[0]

  def auto_register_layers(self, var_list=None, batch_size=None):
    """Registers the layers not registered yet by searching the graph.

    Call it after registering the losses and any layers you want to
    register yourself. Graph search (kfac.python.ops.tensormatch.
    graph_search) finds the dense, convolution, embedding, scale-and-shift
    and batch-norm layers that use the variables, multi-use (RNN, tied)
    and folded layers, and towers; it registers them with the default
    approximations (or those given by define_linked_parameters). Variables
    it cannot place are registered with register_generic, with a warning.
    In a TF2 program call it inside the traced step, on the collection
    built in that trace.

    Args:
      var_list: the variables to register (default: the trainable
        variables of the TF1 graph, or inside a tf.function the trainable
        variables the trace has read).
      batch_size: the batch size per tower / replica; needed for generic
        registrations and to detect uses folded into the batch dimension.

    Returns:
      A mapping (by params) of the blocks registered by this call.
    """
    from kfac.python.ops.tensormatch import graph_search  # pylint: disable=g-import-not-at-top
    if var_list is None:
      var_list = graph_search.default_variables(self)
    return graph_search.register_layers(self, var_list, batch_size=batch_size)

  def finalize(self):
    if not self._loss_dict:
      raise ValueError("No losses registered with LayerCollection %s: "
                       "register the model's predictive distribution, e.g. "
                       "register_softmax_cross_entropy_loss(logits)." %
                       self._name)
    if not self._fisher_blocks:
      raise ValueError("No layers registered with LayerCollection %s." %
                       self._name)
    self._finalized = True

  @property
  def is_finalized(self):
    return self._finalized

  def memory_usage(self):
    """(rows, total bytes) of K-FAC's state for this collection: one
    collection/memory.BlockMemory per block (its parts: statistics and
    their moving averages, inverses, powers, eigendecompositions as the
    inverse method keeps them), predicted from static shapes before any of
    it is allocated. The factors must exist: call it after the estimator
    or optimizer was built on this collection (it checks the budget at
    that point)."""
    rows = memory_lib.memory_table(self.get_blocks())
    return rows, memory_lib.total_bytes(rows)

  # ------------------------------------------------------------ layers
  # One thin method per registration function of the families
  # (collection/layer_kinds.py), each with that function's docstring.
  @_documented_by(generic_registration.register_generic)
  def register_generic(self, params, batch_size, approx=None,
                       reuse=VARIABLE_SCOPE):
    return generic_registration.register_generic(
        self, params, batch_size, approx=approx, reuse=reuse)

  @_documented_by(dense_registration.register_fully_connected)
  def register_fully_connected(self, params, inputs, outputs, approx=None,
                               dense_inputs=True, reuse=VARIABLE_SCOPE,
                               output_axes=1):
    return dense_registration.register_fully_connected(
        self, params, inputs, outputs, approx=approx,
        dense_inputs=dense_inputs, reuse=reuse, output_axes=output_axes)

  @_documented_by(embedding_registration.register_embedding)
  def register_embedding(self, params, inputs, outputs, approx=None,
                         reuse=VARIABLE_SCOPE):
    return embedding_registration.register_embedding(
        self, params, inputs, outputs, approx=approx, reuse=reuse)

  @_documented_by(multi_use_registration.register_fully_connected_multi)
  def register_fully_connected_multi(self, params, inputs, outputs,
                                     num_uses=None, approx=None,
                                     dense_inputs=True,
                                     reuse=VARIABLE_SCOPE):
    return multi_use_registration.register_fully_connected_multi(
        self, params, inputs, outputs, num_uses=num_uses, approx=approx,
        dense_inputs=dense_inputs, reuse=reuse)

  @_documented_by(conv_registration.register_conv2d)
  def register_conv2d(self, params, strides, padding, inputs, outputs,
                      data_format=None, dilations=None, approx=None,
                      reuse=VARIABLE_SCOPE, sub_sample_inputs=None,
                      sub_sample_patches=None, patch_mask=None):
    return conv_registration.register_conv2d(
        self, params, strides, padding, inputs, outputs,
        data_format=data_format, dilations=dilations, approx=approx,
        reuse=reuse, sub_sample_inputs=sub_sample_inputs,
        sub_sample_patches=sub_sample_patches, patch_mask=patch_mask)

  @_documented_by(conv_registration.register_conv1d)
  def register_conv1d(self, params, strides, padding, inputs, outputs,
                      dilations=None, approx=None, reuse=VARIABLE_SCOPE,
                      sub_sample_inputs=None, sub_sample_patches=None,
                      patch_mask=None, data_format=None):
    return conv_registration.register_conv1d(
        self, params, strides, padding, inputs, outputs,
        dilations=dilations, approx=approx, reuse=reuse,
        sub_sample_inputs=sub_sample_inputs,
        sub_sample_patches=sub_sample_patches, patch_mask=patch_mask,
        data_format=data_format)

  @_documented_by(conv_registration.register_convolution)
  def register_convolution(self, params, inputs, outputs, padding,
                           strides=None, dilation_rate=None, data_format=None,
                           approx=None, reuse=VARIABLE_SCOPE,
                           sub_sample_inputs=None, sub_sample_patches=None,
                           patch_mask=None):
    return conv_registration.register_convolution(
        self, params, inputs, outputs, padding, strides=strides,
        dilation_rate=dilation_rate, data_format=data_format, approx=approx,
        reuse=reuse, sub_sample_inputs=sub_sample_inputs,
        sub_sample_patches=sub_sample_patches, patch_mask=patch_mask)

  @_documented_by(conv_registration.register_depthwise_conv2d)
  def register_depthwise_conv2d(self, params, inputs, outputs, strides,
                                padding, rate=None, data_format=None,
                                approx=None, reuse=VARIABLE_SCOPE,
                                sub_sample_patches=None):
    return conv_registration.register_depthwise_conv2d(
        self, params, inputs, outputs, strides, padding, rate=rate,
        data_format=data_format, approx=approx, reuse=reuse,
        sub_sample_patches=sub_sample_patches)

  @_documented_by(conv_registration.register_grouped_convolution)
  def register_grouped_convolution(self, params, inputs, outputs, padding,
                                   groups, strides=None, dilation_rate=None,
                                   data_format=None, approx=None,
                                   reuse=VARIABLE_SCOPE):
    return conv_registration.register_grouped_convolution(
        self, params, inputs, outputs, padding, groups, strides=strides,
        dilation_rate=dilation_rate, data_format=data_format, approx=approx,
        reuse=reuse)

  @_documented_by(conv_registration.register_separable_conv2d)
  def register_separable_conv2d(self, depthwise_params, pointwise_params,
                                inputs, depthwise_outputs, pointwise_outputs,
                                strides, padding, rate=None, data_format=None,
                                approx=None, reuse=VARIABLE_SCOPE):
    return conv_registration.register_separable_conv2d(
        self, depthwise_params, pointwise_params, inputs, depthwise_outputs,
        pointwise_outputs, strides, padding, rate=rate,
        data_format=data_format, approx=approx, reuse=reuse)

  @_documented_by(conv_registration.register_conv2d_multi)
  def register_conv2d_multi(self, params, strides, padding, inputs, outputs,
                            num_uses=None, data_format=None, dilations=None,
                            approx=None, reuse=VARIABLE_SCOPE):
    return conv_registration.register_conv2d_multi(
        self, params, strides, padding, inputs, outputs, num_uses=num_uses,
        data_format=data_format, dilations=dilations, approx=approx,
        reuse=reuse)

  @_documented_by(transpose_registration.register_conv_transpose)
  def register_conv_transpose(self, params, inputs, outputs, strides,
                              padding, data_format=None, dilations=None,
                              approx=None, reuse=VARIABLE_SCOPE,
                              num_spatial=None):
    return transpose_registration.register_conv_transpose(
        self, params, inputs, outputs, strides, padding,
        data_format=data_format, dilations=dilations, approx=approx,
        reuse=reuse, num_spatial=num_spatial)

  @_documented_by(transpose_registration.register_conv2d_transpose)
  def register_conv2d_transpose(self, params, inputs, outputs, strides,
                                padding, data_format=None, dilations=None,
                                approx=None, reuse=VARIABLE_SCOPE):
    return transpose_registration.register_conv2d_transpose(
        self, params, inputs, outputs, strides, padding,
        data_format=data_format, dilations=dilations, approx=approx,
        reuse=reuse)

  @_documented_by(transpose_registration.register_conv1d_transpose)
  def register_conv1d_transpose(self, params, inputs, outputs, strides,
                                padding, data_format=None, dilations=None,
                                approx=None, reuse=VARIABLE_SCOPE):
    return transpose_registration.register_conv1d_transpose(
        self, params, inputs, outputs, strides, padding,
        data_format=data_format, dilations=dilations, approx=approx,
        reuse=reuse)

  @_documented_by(scale_shift_registration.register_scale_and_shift)
  def register_scale_and_shift(self, params, inputs, outputs, approx=None,
                               reuse=VARIABLE_SCOPE):
    return scale_shift_registration.register_scale_and_shift(
        self, params, inputs, outputs, approx=approx, reuse=reuse)

  # ------------------------------------------------------------ losses
  # The losses are the LossRegistry part (collection/losses.py); each
  # method builds its loss (losses_lib.<kind>, with its checks) and
  # registers it. The base names of unnamed losses are kfac 0.2.x's, per
  # method.
  @property
  def _loss_dict(self):
    """name -> [loss per tower] (the LossRegistry's; kfac 0.2.x's name)."""
    return self._losses.by_name

  @property
  def loss_coeffs(self):
    """kfac 0.2.x's map: loss -> its coefficient."""
    return self._losses.coeffs

  @loss_coeffs.setter
  def loss_coeffs(self, value):
    self._losses.coeffs = value

  @property
  def loss_colocation_ops(self):
    """kfac 0.2.x's map: loss -> the tensor it was registered on (its
    logits / mean / prediction)."""
    return self._losses.colocation_ops

  @loss_colocation_ops.setter
  def loss_colocation_ops(self, value):
    self._losses.colocation_ops = value

  @property
  def losses(self):
    return self._losses.losses

  @property
  def towers_by_loss(self):
    return self._losses.towers_by_loss

  def losses_with_coeffs(self):
    return self._losses.losses_with_coeffs()

  @property
  def loss_names(self):
    return list(self._losses.by_name)

  def _register_loss(self, loss, base_name, name, coeff, reuse,
                     colocation=None):
    self._check_not_finalized()
    return self._losses.register(loss, base_name, name, coeff, reuse,
                                 colocation)

  def register_categorical_predictive_distribution(
      self, logits, seed=None, targets=None, name=None, coeff=1.0,
      reuse=VARIABLE_SCOPE):
    """Categorical over the last axis of `logits`. `targets` are integer
    labels, or one-hot rows (same shape as logits)."""
    return self._register_loss(
        losses_lib.categorical(logits, seed, targets, coeff),
        "categorical_predictive_distribution", name, coeff, reuse, logits)

  def register_softmax_cross_entropy_loss(self, logits, seed=None,
                                          targets=None, name=None, coeff=1.0,
                                          reuse=VARIABLE_SCOPE):
    """Softmax cross-entropy: the categorical predictive distribution."""
    return self._register_loss(
        losses_lib.categorical(logits, seed, targets, coeff),
        "sparse_softmax_cross_entropy_loss", name, coeff, reuse, logits)

  def register_normal_predictive_distribution(self, mean, var=0.5, seed=None,
                                              targets=None, name=None,
                                              coeff=1.0,
                                              reuse=VARIABLE_SCOPE):
    """Gaussian with mean `mean` and fixed variance `var`."""
    return self._register_loss(
        losses_lib.normal(mean, var, seed, targets, coeff),
        "normal_predictive_distribution", name, coeff, reuse, mean)

  def register_squared_error_loss(self, prediction, seed=None, targets=None,
                                  name=None, coeff=1.0,
                                  reuse=VARIABLE_SCOPE):
    """||t - y||^2 summed over outputs (a Gaussian with variance 0.5, whose
    Fisher 2 I is the Hessian of the squared error). If your loss is
    0.5 ||t - y||^2, pass coeff=0.5."""
    return self._register_loss(
        losses_lib.normal(prediction, 0.5, seed, targets, coeff),
        "squared_error_loss", name, coeff, reuse, prediction)

  def register_multi_bernoulli_predictive_distribution(
      self, logits, seed=None, targets=None, name=None, coeff=1.0,
      reuse=VARIABLE_SCOPE):
    """Independent Bernoullis with `logits` (targets in [0, 1])."""
    return self._register_loss(
        losses_lib.bernoulli(logits, seed, targets, coeff),
        "multi_bernoulli_predictive_distribution", name, coeff, reuse, logits)

  def register_sigmoid_cross_entropy_loss(self, logits, seed=None,
                                          targets=None, name=None, coeff=1.0,
                                          reuse=VARIABLE_SCOPE):
    """Sigmoid cross-entropy: the multi-Bernoulli predictive distribution."""
    return self._register_loss(
        losses_lib.bernoulli(logits, seed, targets, coeff),
        "sigmoid_cross_entropy_loss", name, coeff, reuse, logits)

  def register_normal_mean_variance_predictive_distribution(
      self, mean, variance, seed=None, targets=None, name=None, coeff=1.0,
      reuse=VARIABLE_SCOPE):
    """Gaussian with learned mean and variance (both network outputs)."""
    return self._register_loss(
        losses_lib.normal_mean_variance(mean, variance, seed, targets, coeff),
        "normal_mean_variance", name, coeff, reuse, mean)

  def eval_losses(self, target_mode="data", coeff_mode="regular",
                  seeds=None):
    """The registered losses (one entry per loss tower), each summed over
    its batch.

    target_mode: "data" (the registered targets) or "sample" (targets drawn
    from the model). coeff_mode: "regular" (times coeff), "sqrt" (times
    sqrt(coeff)) or "off". seeds: None, or a function of the loss's index
    giving the sampling seed of a loss registered without one.
    """
    return self._losses.evaluate(target_mode, coeff_mode, seeds)

  def total_loss(self, coeff_mode="regular"):
    return tf.add_n(self.eval_losses("data", coeff_mode))

  def total_sampled_loss(self, coeff_mode="regular", seeds=None):
    return tf.add_n(self.eval_losses("sample", coeff_mode, seeds))

  # ------------------------------------------------------------ use check
  def _get_use_count_map(self):
    """{var.ref(): registered uses} (kfac 0.2.x helper)."""
    return dict(self._uses.counts)

  @property
  def subgraph(self):
    """The `SubGraph` (kfac.utils.SubGraph) of the registered losses' inputs (the ops
    the losses depend on); None before a loss is registered or outside a
    graph."""
    return use_check.losses_subgraph(self.losses)

  def _use_problems(self, variables):
    """use_check.use_problems of this collection (kfac 0.2.x's use count;
    read by the estimator's docs and tests)."""
    return use_check.use_problems(self._uses, self._fisher_blocks,
                                  self.losses, variables)

  def check_registration(self, variables, check_uses=True):
    """Raises ValueError unless `variables` and the registered variables are
    the same set, naming the ones that differ; with check_uses, also
    unless each variable is registered as many times as the losses' graph
    uses it (kfac 0.2.x's check, TF1 graphs only, see
    collection/use_check.use_problems). The estimator (and so the
    optimizers) runs it, with check_uses, when it sets up its blocks, as
    kfac 0.2.x did. First, check_usable."""
    self.check_usable()
    use_check.check_registration(self._uses, self._fisher_blocks,
                                 self.losses, self.registered_variables,
                                 variables, check_uses)
