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
from kfac.python.ops.collection import losses as losses_lib
from kfac.python.ops.collection import memory as memory_lib
from kfac.python.ops.collection import use_check
from kfac.python.ops.compat_utils import legacy_constants
from kfac.python.ops.ekfac import scalings as ekfac_scalings
from kfac.python.ops.layers.base import curvature_options as options_lib
from kfac.python.ops.layers.base import registration as registration_base
from kfac.python.ops.layers.base.approximations import APPROX_DIAGONAL_NAME
from kfac.python.ops.layers.base.approximations import APPROX_FULL_NAME
from kfac.python.ops.layers.base.approximations import APPROX_KRONECKER_INDEP_NAME
from kfac.python.ops.layers.base.approximations import APPROX_KRONECKER_NAME
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

# Layer kinds whose default approximation can be changed. Kinds whose
# registration functions are not part of this version keep their documented
# defaults here so the setters accept them, but nothing uses them yet.
_DEFAULT_APPROXIMATIONS = {
    "generic": APPROX_DIAGONAL_NAME,
    "fully_connected": APPROX_KRONECKER_NAME,
    "conv2d": APPROX_KRONECKER_NAME,
    "fully_connected_multi": APPROX_KRONECKER_INDEP_NAME,
    "conv2d_multi": APPROX_KRONECKER_INDEP_NAME,
    "scale_and_shift": APPROX_FULL_NAME,
}

# kfac 0.2.x's name of the blocks-by-parameters view (now the mapping
# itself).
BlocksByParams = LayerParametersDict


@utils.exclude_from_autograph
class LayerCollection(dense_registration.DenseRegistrationMixin,
                      generic_registration.GenericRegistrationMixin,
                      conv_registration.ConvRegistrationMixin,
                      transpose_registration.ConvTransposeRegistrationMixin,
                      embedding_registration.EmbeddingRegistrationMixin,
                      multi_use_registration.MultiUseRegistrationMixin,
                      scale_shift_registration.ScaleShiftRegistrationMixin,
                      losses_lib.LossRegistrationMixin,
                      use_check.UseCheckMixin):
  """Registry of layers (parameters and their approximations) and losses.

  This class is the registry's core (layers, towers, factors, linked
  parameters, default approximations); the registration of each layer
  family comes from its mixin in layers/<family>/registration.py, the
  losses from collection/losses.py and the registration check from
  collection/use_check.py.
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
    self._uses = {}  # var.ref() -> registered uses (float: inf = any)
    self._factors = collections.OrderedDict()  # factor key -> factor
    self._factor_names = set()
    # Layers re-registered to fit the memory budget (memory_fallback.py).
    self.memory_fallbacks = []
    self._block_names = set()
    self._loss_dict = collections.OrderedDict()  # name -> [loss per tower]
    # kfac 0.2.x's public maps: loss -> its coefficient, and loss -> the
    # tensor it was registered on (its logits / mean / prediction).
    self.loss_coeffs = {}
    self.loss_colocation_ops = {}
    self._linked = collections.OrderedDict()  # frozenset(refs) -> approx
    self._linked_params = collections.OrderedDict()  # same key -> params
    self._defaults = dict(_DEFAULT_APPROXIMATIONS)
    self._finalized = False
    self._ekfac_strategy = "auto"

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
  def _set_default(self, kind, approx, valid):
    if approx not in valid:
      raise ValueError("Unknown %s approximation %r; expected one of %s." %
                       (kind, approx, sorted(valid)))
    self._defaults[kind] = approx

  # ------------------------------------------------------------ default
  @contextlib.contextmanager
  def as_default(self):
    stack = default_lib.current_stack()
    stack.append(self)
    try:
      yield self
    finally:
      stack.pop()

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
      factor.set_name(self._unique(name or cls.__name__, self._factor_names))
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

  @staticmethod
  def _unique(base, used):
    name, i = base, 1
    while name in used:
      name = "%s_%d" % (base, i)
      i += 1
    used.add(name)
    return name

  # ------------------------------------------------------------ blocks
  def _check_not_finalized(self):
    if self._finalized:
      raise ValueError("LayerCollection %s is finalized (an estimator was "
                       "built on it); register everything before creating "
                       "the optimizer." % self._name)

  @staticmethod
  def _check_params(params):
    for p in utils.ensure_sequence(params):
      if not (isinstance(p, tf.Variable) or tf.is_tensor(p)):
        raise TypeError("Registered parameters must be tf.Variables (or "
                        "tensors), got %r." % (p,))

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
    self._check_params(layer_key)
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
      fisher_block.set_name(self._unique(base, self._block_names))
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

  def _linked_approx(self, params):
    refs = frozenset(utils.hashable_key(utils.ensure_sequence(params)))
    return self._linked.get(refs)

  def _resolve_approx(self, params, approx, kind, table):
    self._check_params(params)
    if approx is None:
      approx = self._linked_approx(params) or self._defaults[kind]
    if approx not in table:
      raise ValueError(
          "Unknown approximation %r for %s layer (%s); expected one of %s." %
          (approx, kind.replace("_", " "), _describe(params), sorted(table)))
    return approx

  @staticmethod
  def _block_params_set(block, params):
    if block.params is None:
      block._params = params  # pylint: disable=protected-access

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
