"""The registry of layers and losses that K-FAC approximates (layer 5).

A `LayerCollection` records, for one model, which parameters belong to which
layer (with the layer's inputs and outputs), which approximation each layer
uses, and which losses (predictive distributions) the model is trained on.
It holds symbolic tensors of one graph; in a TF2 program build a fresh one
inside every trace of the training step (its state lives elsewhere, see
tensors/state.py). Variables are never used as dict keys: they are keyed by `ref()`.
"""

import collections
import collections.abc
import contextlib
import math
import threading

import tensorflow as tf

from kfac.python.ops.layers.conv import registration as conv_registration
from kfac.python.ops.layers.base import curvature_options as options_lib
from kfac.python.ops.layers.embedding import registration as embedding_registration
from kfac.python.ops import fisher_blocks as fb
from kfac.python.ops import loss_functions as lf
from kfac.python.ops.layers.multi_use import registration as multi_use_registration
from kfac.python.ops.layers.scale_shift import registration as scale_shift_registration
from kfac.python.ops.layers.base import registration as registration_base
from kfac.python.ops.tensors import utils
from kfac.python.ops.ekfac import blocks as ekfac_blocks
from kfac.python.ops.compat_utils import legacy_constants
from kfac.python.ops.compat_utils.subgraph import SubGraph
from kfac.python.ops.ekfac import scalings as ekfac_scalings
from kfac.python.ops.tensors.layer_params_dict import LayerParametersDict
from kfac.python.ops.layers.base.registration import RegistrationKeyError
from kfac.python.ops.layers.base.registration import VARIABLE_SCOPE
from kfac.python.ops.layers.base.registration import describe as _describe

# Approximation names.
APPROX_KRONECKER_NAME = "kron"
APPROX_KRONECKER_IN_DIAG_NAME = "kron_in_diag"
APPROX_KRONECKER_OUT_DIAG_NAME = "kron_out_diag"
APPROX_KRONECKER_BOTH_DIAG_NAME = "kron_both_diag"
APPROX_DIAGONAL_NAME = "diagonal"
APPROX_FULL_NAME = "full"
APPROX_KRONECKER_INDEP_NAME = "kron_indep"
APPROX_KRONECKER_INDEP_IN_DIAG_NAME = "kron_indep_in_diag"
APPROX_KRONECKER_INDEP_OUT_DIAG_NAME = "kron_indep_out_diag"
APPROX_KRONECKER_INDEP_BOTH_DIAG_NAME = "kron_indep_both_diag"
APPROX_KRONECKER_SERIES_1_NAME = "kron_series_1"
APPROX_KRONECKER_SERIES_2_NAME = "kron_series_2"
APPROX_KRONECKER_SUA_NAME = "kron_sua"
APPROX_EKFAC_NAME = "ekfac"
APPROX_KRONECKER_REDUCE_NAME = "kron_reduce"
APPROX_EKFAC_REDUCE_NAME = "ekfac_reduce"

_FULLY_CONNECTED_APPROX_TO_BLOCK = {
    APPROX_KRONECKER_NAME: lambda lc, bias: fb.FullyConnectedKFACBasicFB(
        lc, has_bias=bias),
    APPROX_KRONECKER_IN_DIAG_NAME: lambda lc, bias: fb.FullyConnectedKFACBasicFB(
        lc, has_bias=bias, diagonal_approx_for_input=True),
    APPROX_KRONECKER_OUT_DIAG_NAME:
        lambda lc, bias: fb.FullyConnectedKFACBasicFB(
            lc, has_bias=bias, diagonal_approx_for_output=True),
    APPROX_KRONECKER_BOTH_DIAG_NAME:
        lambda lc, bias: fb.FullyConnectedKFACBasicFB(
            lc, has_bias=bias, diagonal_approx_for_input=True,
            diagonal_approx_for_output=True),
    APPROX_DIAGONAL_NAME: lambda lc, bias: fb.FullyConnectedDiagonalFB(
        lc, has_bias=bias),
    APPROX_KRONECKER_REDUCE_NAME:
        lambda lc, bias: fb.FullyConnectedKFACReduceFB(lc, has_bias=bias),
    APPROX_EKFAC_NAME:
        lambda lc, bias: ekfac_blocks.FullyConnectedEKFACFB(lc, has_bias=bias),
    APPROX_EKFAC_REDUCE_NAME:
        lambda lc, bias: ekfac_blocks.FullyConnectedEKFACReduceFB(
            lc, has_bias=bias),
}

_GENERIC_APPROX_TO_BLOCK = {
    APPROX_FULL_NAME: fb.NaiveFullFB,
    APPROX_DIAGONAL_NAME: fb.NaiveDiagonalFB,
}

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


_default_collections = threading.local()


def _stack():
  if not hasattr(_default_collections, "stack"):
    _default_collections.stack = []
  return _default_collections.stack


def get_default_layer_collection():
  """The innermost LayerCollection made default by `as_default()`."""
  stack = _stack()
  if not stack:
    raise ValueError("No default LayerCollection: use `with "
                     "layer_collection.as_default():` or "
                     "set_default_layer_collection(...).")
  return stack[-1]


def set_default_layer_collection(layer_collection):
  """Makes `layer_collection` the default; None clears the default.

  Raises:
    ValueError: if a default is already set (clear it with None first), as
      in kfac 0.2.x.
  """
  stack = _stack()
  if layer_collection is not None and stack:
    raise ValueError("Default LayerCollection is already set (%s); call "
                     "set_default_layer_collection(None) first." %
                     stack[-1].name)
  del stack[:]
  if layer_collection is not None:
    stack.append(layer_collection)


# kfac 0.2.x's name of the blocks-by-parameters view (now the mapping
# itself).
BlocksByParams = LayerParametersDict


@utils.exclude_from_autograph
class LayerCollection(conv_registration.ConvRegistrationMixin,
                      embedding_registration.EmbeddingRegistrationMixin,
                      multi_use_registration.MultiUseRegistrationMixin,
                      scale_shift_registration.ScaleShiftRegistrationMixin):
  """Registry of layers (parameters and their approximations) and losses."""

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

  def set_default_generic_approximation(self, value):
    self._set_default("generic", value, _GENERIC_APPROX_TO_BLOCK)

  def set_default_fully_connected_approximation(self, value):
    self._set_default("fully_connected", value,
                      _FULLY_CONNECTED_APPROX_TO_BLOCK)

  @property
  def default_generic_approximation(self):
    return self._defaults["generic"]

  @property
  def default_fully_connected_approximation(self):
    return self._defaults["fully_connected"]

  # ------------------------------------------------------------ defaults
  @contextlib.contextmanager
  def as_default(self):
    stack = _stack()
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

  @property
  def losses(self):
    return [loss for towers in self._loss_dict.values() for loss in towers]

  @property
  def towers_by_loss(self):
    return [tuple(towers) for towers in self._loss_dict.values()]

  def losses_with_coeffs(self):
    return [(loss, self.loss_coeffs[loss])
            for towers in self._loss_dict.values() for loss in towers]

  @property
  def loss_names(self):
    return list(self._loss_dict)

  # ------------------------------------------------------------ factors
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

  def _add_uses(self, params, uses):
    """Records `uses` more uses of each variable of `params` in the graph
    (checked by check_registration; float("inf") for registrations that
    cover any number of uses)."""
    for var in utils.ensure_sequence(params):
      self._uses[utils.hashable_key(var)] = (
          self._uses.get(utils.hashable_key(var), 0) + uses)

  def _get_use_count_map(self):
    """{var.ref(): registered uses} (kfac 0.2.x helper)."""
    return dict(self._uses)

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

  def register_fully_connected(self, params, inputs, outputs, approx=None,
                               dense_inputs=True, reuse=VARIABLE_SCOPE):
    """Registers a dense layer outputs = inputs @ W (+ b).

    Args:
      params: W of shape [in, out], or a tuple (W, b) with b of shape [out].
      inputs: Tensor [batch, in], the layer inputs. A layer applied at
        several positions (a sequence, a grid) may take [batch, ..., in]
        inputs: the weight sharing is handled by KFAC-expand (kron and its
        diagonal variants, the default) or KFAC-reduce (kron_reduce).
      outputs: Tensor [batch, out] (or [batch, ..., out]), the
        pre-activations.
      approx: one of kron, kron_in_diag, kron_out_diag, kron_both_diag,
        diagonal, kron_reduce, ekfac, ekfac_reduce (default: the
        collection's fully-connected default).
      dense_inputs: False registers an embedding lookup: `inputs` are integer
        ids into the rows of W (see register_embedding in
        layers/embedding/registration.py).
      reuse: True adds a tower to an existing registration of `params`.
    """
    if not dense_inputs:
      return self._register_embedding(params, inputs, outputs, approx=approx,
                                      reuse=reuse)
    self._check_dense_shapes(params, inputs, outputs)
    approx = self._resolve_approx(params, approx, "fully_connected",
                                  _FULLY_CONNECTED_APPROX_TO_BLOCK)
    has_bias = isinstance(params, (list, tuple))
    block = _FULLY_CONNECTED_APPROX_TO_BLOCK[approx](self, has_bias)
    block = self.register_block(params, block, reuse=reuse)
    block.register_additional_tower(inputs, outputs)
    self._block_params_set(block, params)
    self._add_uses(params, 1)
    return block

  @staticmethod
  def _block_params_set(block, params):
    if block.params is None:
      block._params = params  # pylint: disable=protected-access

  @staticmethod
  def _check_dense_shapes(params, inputs, outputs):
    seq = utils.ensure_sequence(params)
    if len(seq) not in (1, 2):
      raise ValueError("Dense layer params must be W or (W, b), got %d "
                       "variables (%s)." % (len(seq), _describe(params)))
    w = seq[0]
    # W is [in, out]; as in kfac 0.2.x a higher-rank W [..., out] (e.g. a
    # 1x1 convolution kernel) stands for its [prod(...), out] reshape.
    if w.shape.rank is None or w.shape.rank < 2 or not (
        w.shape[:-1].is_fully_defined()):
      raise ValueError("Dense layer weight %s must have rank 2 [in, out] (or "
                       "[..., out], used reshaped to [in, out]), got shape "
                       "%s." % (utils.variable_name(w), w.shape))
    d_in = int(w.shape[:-1].num_elements())
    d_out = w.shape[-1]
    if len(seq) == 2:
      b_shape = seq[1].shape
      if not (b_shape.rank == 1 or (b_shape.rank == 2 and b_shape[0] == 1)) \
          or b_shape[-1] != d_out:
        raise ValueError("Bias %s must have shape [%s] (or [1, %s]) to match "
                         "weight %s, got %s." %
                         (utils.variable_name(seq[1]), d_out, d_out,
                          utils.variable_name(w), b_shape))
    rank = inputs.shape.rank
    if rank is None or rank < 2 or inputs.shape[-1] != d_in:
      raise ValueError("Inputs of the layer with weight %s must have shape "
                       "[batch, %s] (or [batch, ..., %s] for a layer shared "
                       "over positions), got %s." %
                       (utils.variable_name(w), d_in, d_in, inputs.shape))
    if (outputs.shape.rank != rank or outputs.shape[-1] != d_out or
        not outputs.shape[:-1].is_compatible_with(inputs.shape[:-1])):
      raise ValueError("Outputs of the layer with weight %s must have shape "
                       "%s, matching inputs %s, got %s." %
                       (utils.variable_name(w),
                        inputs.shape[:-1].concatenate([d_out]),
                        inputs.shape, outputs.shape))

  def register_generic(self, params, batch_size, approx=None,
                       reuse=VARIABLE_SCOPE):
    """Registers arbitrary parameters with a full or diagonal block of the
    Fisher of their flattened gradient (batch_size: examples per tower)."""
    approx = self._resolve_approx(params, approx, "generic",
                                  _GENERIC_APPROX_TO_BLOCK)
    block = _GENERIC_APPROX_TO_BLOCK[approx](self, params)
    block = self.register_block(params, block, reuse=reuse)
    block.register_additional_tower(batch_size)
    self._add_uses(params, float("inf"))  # any number of uses
    return block

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

  @property
  def subgraph(self):
    """The `SubGraph` (kfac.utils.SubGraph) of the registered losses' inputs (the ops
    the losses depend on); None before a loss is registered or outside a
    graph."""
    inputs = []
    for loss in self.losses:
      inputs.extend(utils.ensure_sequence(loss.inputs))
    if not inputs or not all(hasattr(t, "op") for t in inputs):
      return None
    return SubGraph(inputs)

  def _use_problems(self, variables):
    """kfac 0.2.x's check that each variable is registered as many times as
    the losses' graph uses it (an RNN cell used at 3 time steps needs 3
    uses: register_fully_connected_multi, or 3 towers); generic
    registrations cover any number. A use is an op of the losses' graph
    that reads the variable (a gather counts as one use however many ops
    consume the rows it gathered). More registered uses than ops are fine
    when every registered output leads to the losses: the uses were folded
    into one op and split after it. Only in TF1 graphs: in a tf.function
    trace (and under several replicas) variables are read differently, and
    graph search registers the uses it finds."""
    if not _in_tf1_graph() or tf.distribute.has_strategy():
      return []
    candidates = [v for v in variables if isinstance(v, tf.Variable) and
                  not math.isinf(self._uses.get(utils.hashable_key(v), 0))]
    if not candidates:
      return []
    subgraph = self.subgraph
    if subgraph is None:
      return []
    problems = []
    for var in candidates:
      registered = self._uses.get(utils.hashable_key(var), 0)
      if not registered:
        continue  # reported as not registered
      found = subgraph.variable_uses(var)
      if registered == found:
        continue
      stray = self._outputs_off_the_losses(var, subgraph)
      if registered > found and found and not stray:
        continue  # uses folded into fewer ops, outputs split after them
      problem = ("%s is registered with %d use(s) but the graph of the "
                 "registered losses uses it %d time(s)" %
                 (utils.variable_name(var), registered, found))
      if stray:
        problem += (", and its registered output(s) %s do not lead to the "
                    "losses" % ", ".join(stray))
      problems.append(
          problem + " (register every use: towers with reuse=True, or "
          "register_*_multi for a layer used several times; or register it "
          "with register_generic)")
    return problems

  def _outputs_off_the_losses(self, var, subgraph):
    """Names of the registered outputs of var's layer that the registered
    losses do not depend on."""
    key = self._fisher_blocks.owner_of(var)
    block = None if key is None else self._fisher_blocks.get(key)
    if block is None or not hasattr(block, "tensors_to_compute_grads"):
      return []
    stray = []
    for tensor in tf.nest.flatten(block.tensors_to_compute_grads()):
      if hasattr(tensor, "op") and not subgraph.is_member(tensor):
        stray.append(tensor.name)
    return stray

  def check_registration(self, variables, check_uses=True):
    """Raises ValueError unless `variables` and the registered variables are
    the same set, naming the ones that differ; with check_uses, also
    unless each variable is registered as many times as the losses' graph
    uses it (kfac 0.2.x's check, TF1 graphs only, see _use_problems). The
    estimator (and so the optimizers) runs it, with check_uses, when it
    sets up its blocks, as kfac 0.2.x did."""
    wanted = collections.OrderedDict(
        (v.ref(), v) for v in utils.ensure_sequence(variables))
    registered = collections.OrderedDict(
        (v.ref(), v) for v in self.registered_variables)
    missing = [v for r, v in wanted.items() if r not in registered]
    extra = [v for r, v in registered.items() if r not in wanted]
    problems = []
    if missing:
      problems.append(
          "not registered with the LayerCollection: %s (register their layers, "
          "e.g. register_fully_connected or register_generic)" %
          ", ".join(utils.variable_name(v) for v in missing))
    if extra:
      problems.append(
          "registered but not in the list of variables to optimize: %s" %
          ", ".join(utils.variable_name(v) for v in extra))
    if problems:
      raise ValueError("Variables " + "; ".join(problems) + ".")
    if check_uses:
      problems = self._use_problems(list(wanted.values()))
      if problems:
        raise ValueError("Variable registration does not match the graph: " +
                         "; ".join(problems) + ".")

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

  # ------------------------------------------------------------ losses
  def _register_loss(self, loss, base_name, name, coeff, reuse,
                     colocation=None):
    self._check_not_finalized()
    mode = registration_base.reuse_mode(reuse)
    if name is None:
      if mode is True:
        raise RegistrationKeyError(
            "reuse=True adds a tower to a loss registered before: pass that "
            "loss's name= too (reuse may also come from a reusing "
            "tf.compat.v1.variable_scope).")
      name = self._unique(base_name, set(self._loss_dict))
    if name in self._loss_dict:
      if not mode:
        raise RegistrationKeyError(
            "A loss named %r is already registered. Pass reuse=True to add "
            "a tower to it, or use another name." % name)
      towers = self._loss_dict[name]
      first = self.loss_coeffs[towers[0]]
      if (utils.is_python_number(first) and utils.is_python_number(coeff)
          and first != coeff):
        raise ValueError("The loss %r was registered with coeff=%s; a tower "
                         "added with reuse must use the same coeff, got %s."
                         % (name, first, coeff))
      towers.append(loss)
    elif mode is True:
      raise RegistrationKeyError(
          "reuse=True adds a tower to the loss named %r, but no loss of that "
          "name was registered. Register it without reuse first (reuse may "
          "also come from a reusing tf.compat.v1.variable_scope)." % name)
    else:
      self._loss_dict[name] = [loss]
    self.loss_coeffs[loss] = coeff
    self.loss_colocation_ops[loss] = colocation
    return loss

  @staticmethod
  def _check_coeff(coeff):
    if utils.is_python_number(coeff) and coeff < 0:
      raise ValueError("Loss coeff must be non-negative, got %s." % coeff)

  def register_categorical_predictive_distribution(
      self, logits, seed=None, targets=None, name=None, coeff=1.0,
      reuse=VARIABLE_SCOPE):
    """Categorical over the last axis of `logits`. `targets` are integer
    labels, or one-hot rows (same shape as logits)."""
    return self._register_categorical(
        logits, seed, targets, name, coeff, reuse,
        "categorical_predictive_distribution")

  # The base names of unnamed losses are kfac 0.2.x's, per method.
  def _register_categorical(self, logits, seed, targets, name, coeff, reuse,
                            base_name):
    self._check_coeff(coeff)
    if targets is not None and not utils.is_tensor_or_variable(targets):
      targets = tf.convert_to_tensor(targets)  # numpy arrays, lists
    onehot = targets is not None and targets.shape.rank == logits.shape.rank
    if targets is not None:
      expected = logits.shape if onehot else logits.shape[:-1]
      if not targets.shape.is_compatible_with(expected):
        raise ValueError("Targets of shape %s do not fit logits of shape %s "
                         "(expected integer labels of shape %s or one-hot "
                         "rows of shape %s)." % (targets.shape, logits.shape,
                                                 logits.shape[:-1],
                                                 logits.shape))
    if onehot:
      loss = lf.OnehotCategoricalLogitsNegativeLogProbLoss(logits, targets,
                                                           seed)
    else:
      loss = lf.CategoricalLogitsNegativeLogProbLoss(logits, targets, seed)
    return self._register_loss(loss, base_name, name, coeff, reuse, logits)

  def register_softmax_cross_entropy_loss(self, logits, seed=None,
                                          targets=None, name=None, coeff=1.0,
                                          reuse=VARIABLE_SCOPE):
    """Softmax cross-entropy: the categorical predictive distribution."""
    return self._register_categorical(logits, seed, targets, name, coeff,
                                      reuse,
                                      "sparse_softmax_cross_entropy_loss")

  def register_normal_predictive_distribution(self, mean, var=0.5, seed=None,
                                              targets=None, name=None,
                                              coeff=1.0,
                                              reuse=VARIABLE_SCOPE):
    """Gaussian with mean `mean` and fixed variance `var`."""
    return self._register_normal(mean, var, seed, targets, name, coeff,
                                 reuse, "normal_predictive_distribution")

  def _register_normal(self, mean, var, seed, targets, name, coeff, reuse,
                       base_name):
    self._check_coeff(coeff)
    if utils.is_python_number(var) and var <= 0:
      raise ValueError("var must be positive, got %s." % var)
    self._check_targets_like(targets, mean)
    loss = lf.NormalMeanNegativeLogProbLoss(mean, var, targets, seed)
    return self._register_loss(loss, base_name, name, coeff, reuse, mean)

  def register_squared_error_loss(self, prediction, seed=None, targets=None,
                                  name=None, coeff=1.0,
                                  reuse=VARIABLE_SCOPE):
    """||t - y||^2 summed over outputs (a Gaussian with variance 0.5, whose
    Fisher 2 I is the Hessian of the squared error). If your loss is
    0.5 ||t - y||^2, pass coeff=0.5."""
    return self._register_normal(prediction, 0.5, seed, targets, name, coeff,
                                 reuse, "squared_error_loss")

  def register_multi_bernoulli_predictive_distribution(
      self, logits, seed=None, targets=None, name=None, coeff=1.0,
      reuse=VARIABLE_SCOPE):
    """Independent Bernoullis with `logits` (targets in [0, 1])."""
    return self._register_bernoulli(
        logits, seed, targets, name, coeff, reuse,
        "multi_bernoulli_predictive_distribution")

  def _register_bernoulli(self, logits, seed, targets, name, coeff, reuse,
                          base_name):
    self._check_coeff(coeff)
    self._check_targets_like(targets, logits)
    loss = lf.MultiBernoulliNegativeLogProbLoss(logits, targets, seed)
    return self._register_loss(loss, base_name, name, coeff, reuse, logits)

  def register_sigmoid_cross_entropy_loss(self, logits, seed=None,
                                          targets=None, name=None, coeff=1.0,
                                          reuse=VARIABLE_SCOPE):
    """Sigmoid cross-entropy: the multi-Bernoulli predictive distribution."""
    return self._register_bernoulli(logits, seed, targets, name, coeff, reuse,
                                    "sigmoid_cross_entropy_loss")

  def register_normal_mean_variance_predictive_distribution(
      self, mean, variance, seed=None, targets=None, name=None, coeff=1.0,
      reuse=VARIABLE_SCOPE):
    """Gaussian with learned mean and variance (both network outputs)."""
    self._check_coeff(coeff)
    self._check_targets_like(targets, mean)
    loss = lf.NormalMeanVarianceNegativeLogProbLoss(mean, variance, targets,
                                                    seed)
    return self._register_loss(loss, "normal_mean_variance", name, coeff,
                               reuse, mean)

  @staticmethod
  def _check_targets_like(targets, prediction):
    if targets is not None and not targets.shape.is_compatible_with(
        prediction.shape):
      raise ValueError("Targets of shape %s do not match predictions of "
                       "shape %s." % (targets.shape, prediction.shape))

  # ------------------------------------------------------------ evaluation
  def eval_losses(self, target_mode="data", coeff_mode="regular",
                  seeds=None):
    """The registered losses (one entry per loss tower), each summed over
    its batch.

    target_mode: "data" (the registered targets) or "sample" (targets drawn
    from the model). coeff_mode: "regular" (times coeff), "sqrt" (times
    sqrt(coeff)) or "off". seeds: None, or a function of the loss's index
    giving the sampling seed of a loss registered without one.
    """
    if target_mode not in ("data", "sample"):
      raise ValueError("Unknown target_mode %r; expected 'data' or 'sample'."
                       % (target_mode,))
    if coeff_mode not in ("regular", "sqrt", "off"):
      raise ValueError("Unknown coeff_mode %r; expected 'regular', 'sqrt' or "
                       "'off'." % (coeff_mode,))
    out = []
    for i, (loss, coeff) in enumerate(self.losses_with_coeffs()):
      seed = None
      if seeds is not None and getattr(loss, "_default_seed", 0) is None:
        seed = seeds(i)
      value = loss.evaluate() if target_mode == "data" else (
          loss.evaluate_on_sample(seed))
      if coeff_mode == "regular":
        value = value * utils.cast(coeff, value.dtype)
      elif coeff_mode == "sqrt":
        value = value * tf.sqrt(utils.cast(coeff, value.dtype))
      out.append(value)
    return out

  def total_loss(self, coeff_mode="regular"):
    return tf.add_n(self.eval_losses("data", coeff_mode))

  def total_sampled_loss(self, coeff_mode="regular", seeds=None):
    return tf.add_n(self.eval_losses("sample", coeff_mode, seeds))


def _in_tf1_graph():
  if tf.executing_eagerly():
    return False
  return not getattr(tf.compat.v1.get_default_graph(), "building_function",
                     False)


def sqrt_coeff(coeff, dtype):
  if utils.is_python_number(coeff):
    return tf.constant(math.sqrt(coeff), dtype)
  return tf.sqrt(utils.cast(coeff, dtype))
