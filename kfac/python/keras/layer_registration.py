"""A Keras model on a LayerCollection: where its layers' calls come from,
what kind of layer each is, and their registration.

The module reads in the order a registration runs: the calls of the
model's layers, recorded during the traced forward pass (`ModelRecorder`,
`watch`) or read from a tf_keras model's TF1 graph nodes (`NodeCalls`);
the table of Keras layer kinds (`KINDS`); planning and registering the
layers (`plan_layers`, `register_layers`); the whole model with its losses
(`register_model_rows`, which kfac.keras.utils and the Kfac optimizer
call).

`plan_layers` decides, from the layers alone, how each one is registered
(the registration report users can print before training). `register_layers`
then registers them on a `LayerCollection` with the tensors a
`ModelRecorder` captured in the current trace. Both read the table of Keras
layer kinds (KINDS: how each kind is recognised, its
parameters, its registration, its family on the ops side).

Supported layers and what K-FAC sees:
  Dense, EinsumDense (when its equation is a dense map over shared leading
    axes, bias on the output axes: einsum_equation.py; e.g. the four
    projections of MultiHeadAttention, whose sublayers are recorded as
    layers of their own)  register_fully_connected, inputs [batch, ...,
    in axes...] (flattened to [batch, ..., in]) and the pre-activations
    [batch, ..., out axes...] (fused activations are skipped; the kernel's
    output axes are `output_axes`); called several times in one step on
    [batch, in] inputs (2-d kernels): register_fully_connected_multi
    (kron_indep)
  Conv1D/2D/3D (groups=1)   register_conv1d / register_convolution; a Conv2D
                            called several times: register_conv2d_multi
  Conv1D/2D/3D (groups>1)   register_grouped_convolution (KFC block-diagonal
                            over the groups)
  DepthwiseConv2D           register_depthwise_conv2d ("kron" unless
                            fisher_approx says "diagonal")
  SeparableConv2D (channels_last)  register_separable_conv2d: the depthwise
                            outputs are found in the traced graph as the
                            input of the pointwise Conv2D (conv_variants)
  Conv1D/2D/3DTranspose     register_conv_transpose (KFC, the patches on
                            the output-gradient side; conv_variants)
  Embedding                 register_embedding; called several times with
                            one id per example and call:
                            register_fully_connected_multi(dense_inputs=False);
                            a position embedding (ids without a batch axis,
                            added to [batch, ...] tensors): on the ids
                            tiled over the batch and the sum (see
                            position_embedding)
  LSTM, GRU (their cells)   register_fully_connected over time of the
                            input and recurrent kernels (recurrent.py)
  BatchNormalization (channel axis last), LayerNormalization (trailing
    normalised axes), GroupNormalization (channel axis last)
                            register_scale_and_shift on the normalised inputs
                            (recomputed from the layer's input as the layer
                            does) and the layer's outputs
Anything else with trainable weights (and any case above the layer's options
put out of reach: SeparableConv1D, masks, renorm,
BatchNormalization / GroupNormalization over another axis, norms without
scale, layers called several times on inputs
with positions, other layers called several times) falls back to
`register_generic` with the GENERIC_FALLBACK approximation, and a warning
names the layer and the reason. Every registered tensor is one the loss
depends on: K-FAC's output statistics are gradients w.r.t. them, and the
gradient w.r.t. a tensor off that path (a transpose or a slice made here)
would silently be zero.
"""

import collections
import contextlib
import dataclasses
import functools
import typing
import warnings
import weakref

import tensorflow as tf

from kfac.python.keras import conv_variants
from kfac.python.keras import einsum_equation
from kfac.python.keras import keras_flavor
from kfac.python.keras import loss_registration
from kfac.python.keras import model_args
from kfac.python.keras import normalized_inputs
from kfac.python.keras import position_embedding
from kfac.python.keras import recurrent
from kfac.python.keras.registration_keys import CLASS_KEY_PREFIX  # noqa: F401 pylint: disable=unused-import
from kfac.python.keras.registration_keys import CONV_OPTIONS  # noqa: F401 pylint: disable=unused-import
from kfac.python.keras.registration_keys import DEPTHWISE_OPTIONS
from kfac.python.keras.registration_keys import OLD_CLASS_KEY_PREFIX  # noqa: F401 pylint: disable=unused-import
from kfac.python.keras.registration_keys import RegistrationError
from kfac.python.keras.registration_keys import check_depthwise_options
from kfac.python.keras.registration_keys import check_fisher_approx  # noqa: F401 pylint: disable=unused-import
from kfac.python.keras.registration_keys import check_registration_options  # noqa: F401 pylint: disable=unused-import
from kfac.python.keras.registration_keys import class_key_name  # noqa: F401 pylint: disable=unused-import
from kfac.python.keras.registration_keys import resolve_fisher_approx
from kfac.python.keras.registration_report import Row  # pylint: disable=unused-import
from kfac.python.keras.registration_report import format_report  # pylint: disable=unused-import
from kfac.python.ops.collection import layer_collection as lc_lib
from kfac.python.ops.collection import layer_kinds as ops_layer_kinds




# --------------------------------------------------------------------------
# Records what K-FAC needs from a Keras forward pass.
#
# K-FAC's statistics need, for each layer, its inputs and its pre-activations
# (the tensor a fused activation is applied to), as tensors of the traced
# training step. Keras has no forward hooks, so `ModelRecorder` wraps each
# layer's `call` (an instance attribute; the class is untouched, and
# `get_config` / saving do not see the wrapper). During a call of a layer
# with a fused activation, `layer.activation` is swapped for a function that
# records its argument and is restored when the call returns.
#
# Calls are recorded only while tracing (a `tf.function`, which is where
# `model.fit` runs its train step and where a Keras 3 optimizer's `apply`
# runs, in the same graph). Records are kept per graph: a new trace starts a
# new set, and the optimizer reads the set of the graph it is building.
# Under a tf.distribute strategy with several replicas, whose replicas trace
# into one graph, they are kept per replica as well.
# The model's `compute_loss` is wrapped too, to record `y`, `y_pred` and
# `sample_weight` of a `fit` step, and the loss it returns. At the start of
# each call of the model in training mode (`training=True` or a tensor, as
# an argument or, for a Keras 3 `call` without one, in Keras's call
# context) the random states of its random layers
# (keras_flavor.random_state_variables) are read;
# `random_states` gives those of the latest such call in the graph, which
# the damping rule sets back to replay that forward pass's dropout masks.


# Layers whose `activation` attribute is applied to the pre-activations
# that K-FAC registers.
FUSED_ACTIVATION_LAYERS = ("Dense", "EinsumDense", "Conv", "Conv1D", "Conv2D",
                           "Conv3D", "DepthwiseConv2D", "DepthwiseConv1D",
                           "SeparableConv2D", "SeparableConv1D",
                           "Conv1DTranspose", "Conv2DTranspose",
                           "Conv3DTranspose")

# from_node: the call was read from a built tf_keras model's graph node
# (node_calls), not recorded; its `training` may be the learning-phase
# tensor, so BatchNormalization is undone from its outputs.
Call = collections.namedtuple(
    "Call", ["inputs", "preactivations", "outputs", "training", "mask",
             "from_node"])
Call.__new__.__defaults__ = (False,)

_RECORDERS = weakref.WeakKeyDictionary()


def recorder_for(model):
  """The model's recorder, installed on first use (one per model)."""
  recorder = _RECORDERS.get(model)
  if recorder is None:
    recorder = ModelRecorder(model)
    _RECORDERS[model] = recorder
  return recorder


def _tracing_graph():
  """Where records go: the graph being built (None when executing
  eagerly), and under a tf.distribute strategy with several replicas, the
  replica building it (all replicas of a MirroredStrategy step trace into
  one graph, each with its own layer calls)."""
  if tf.executing_eagerly():
    return None
  return _RecordKey(tf.compat.v1.get_default_graph(), _replica_index())


def _replica_index():
  if not tf.distribute.has_strategy():
    return None
  if tf.distribute.get_strategy().num_replicas_in_sync <= 1:
    return None
  ctx = tf.distribute.get_replica_context()
  if ctx is None:
    return None
  return int(tf.get_static_value(ctx.replica_id_in_sync_group))


class _RecordKey(collections.namedtuple("_RecordKey", ["graph", "replica"])):
  """(graph, replica); equal when both are the same (graphs by identity)."""

  def __eq__(self, other):
    return (isinstance(other, _RecordKey) and self.graph is other.graph and
            self.replica == other.replica)

  def __ne__(self, other):
    return not self == other

  def __hash__(self):
    return hash((id(self.graph), self.replica))


def _first_input(args, kwargs):
  if args:
    return args[0]
  return kwargs.get("inputs")


class ModelRecorder:
  """Wraps the layers of one model; see the module docstring."""

  def __init__(self, model):
    self._model_ref = weakref.ref(model)
    # Keyed by _RecordKey (graph, replica); only the latest graph's kept.
    self._calls = {}  # id(layer) -> {key: [Call, ...]}
    self._loss_args = {}  # key -> {"y": ..., "y_pred": ..., ...}
    self._model_outputs = {}  # key -> outputs of the model's last call
    # key -> [(seed state variable, its value before the first call)]
    self._random_states = {}
    self._wrapped = set()
    self._paused = False
    self.refresh()

  @contextlib.contextmanager
  def paused(self):
    """Calls made inside are not recorded (e.g. the optimizer's own
    re-evaluations of the loss)."""
    paused, self._paused = self._paused, True
    try:
      yield
    finally:
      self._paused = paused

  def _recording_graph(self):
    return None if self._paused else _tracing_graph()

  @property
  def model(self):
    return self._model_ref()

  def refresh(self):
    """Wraps layers not wrapped yet (e.g. created after the last call)."""
    model = self.model
    for layer in keras_flavor.leaf_layers(model):
      if id(layer) not in self._wrapped:
        self._wrap_layer(layer)
    if id(model) not in self._wrapped:
      self._wrap_model(model)

  # ------------------------------------------------------------ wrapping
  def _wrap_layer(self, layer):
    original = layer.call
    fused = (any(keras_flavor.is_instance_by_name(layer, n)
                 for n in FUSED_ACTIVATION_LAYERS)
             and getattr(layer, "activation", None) is not None)
    recorder = self
    rnn = recurrent.is_recurrent_layer(layer)

    @functools.wraps(original)
    def call(*args, **kwargs):
      graph = recorder._recording_graph()
      if graph is None:
        return original(*args, **kwargs)
      if rnn:
        return recorder._recurrent_call(layer, graph, original, args, kwargs)
      pre = []
      if fused:
        activation = layer.activation

        def recording_activation(x, *a, **k):
          pre.append(x)
          return activation(x, *a, **k)
        object.__setattr__(layer, "activation", recording_activation)
        try:
          outputs = original(*args, **kwargs)
        finally:
          object.__setattr__(layer, "activation", activation)
      else:
        outputs = original(*args, **kwargs)
      preactivations = pre[-1] if pre else outputs
      recorder._add_call(layer, graph, Call(
          _first_input(args, kwargs), preactivations, outputs,
          kwargs.get("training"), kwargs.get("mask")))
      return outputs

    call = tf.autograph.experimental.do_not_convert(call)
    call._kfac_recorder = weakref.ref(self)  # pylint: disable=protected-access
    object.__setattr__(layer, "call", call)
    self._wrapped.add(id(layer))

  def _wrap_model(self, model):
    original_call = model.call
    recorder = self

    @functools.wraps(original_call)
    def call(*args, **kwargs):
      graph = recorder._recording_graph()
      if graph is not None and _in_training(
          kwargs.get("training", keras_flavor.call_context_training())):
        # Read before this call draws from them (a tf.function orders the
        # reads before the layers' updates of the same variables).
        _put(recorder._random_states, graph, [
            (var, tf.identity(var.read_value()))
            for var in keras_flavor.random_state_variables(model)])
      outputs = original_call(*args, **kwargs)
      if graph is not None:
        _put(recorder._model_outputs, graph, outputs)
      return outputs

    object.__setattr__(model, "call",
                       tf.autograph.experimental.do_not_convert(call))
    original_loss = model.compute_loss

    @functools.wraps(original_loss)
    def compute_loss(*args, **kwargs):
      graph = recorder._recording_graph()
      if graph is not None:
        names = ("x", "y", "y_pred", "sample_weight")
        recorded = dict(zip(names, args))
        recorded.update({k: v for k, v in kwargs.items() if k in names})
        _put(recorder._loss_args, graph, recorded)
      loss = original_loss(*args, **kwargs)
      if graph is not None:
        recorded["loss"] = loss
      return loss

    object.__setattr__(model, "compute_loss", compute_loss)
    self._wrapped.add(id(model))

  def _recurrent_call(self, layer, graph, original, args, kwargs):
    """An LSTM / GRU layer computed by recurrent.call, recorded as a call of
    its cell (which owns the weights) whose preactivations are the Record
    (or the reason it is run as the layer runs)."""
    mask, training = kwargs.get("mask"), kwargs.get("training")
    record = recurrent.unsupported_reason(layer, args, mask, training)
    if record is None:
      outputs, record = recurrent.call(layer, args, kwargs)
    else:
      outputs = original(*args, **kwargs)
    self._add_call(layer.cell, graph, Call(
        _first_input(args, kwargs), record, outputs, training, mask))
    return outputs

  def _add_call(self, layer, graph, call):
    per_key = self._calls.setdefault(id(layer), {})
    if graph not in per_key:
      _put(per_key, graph, [])
    per_key[graph].append(call)

  # ------------------------------------------------------------ reading
  def calls(self, layer, graph=None):
    """The recorded calls of `layer` in `graph` (default: the current one,
    and the current replica's)."""
    graph = graph or _tracing_graph()
    if graph is None:
      return []
    return list(self._calls.get(id(layer), {}).get(graph, []))

  def loss_args(self, graph=None):
    """{"y", "y_pred", "sample_weight", "x"} of the model's compute_loss in
    `graph` and the "loss" it returned, or None."""
    graph = graph or _tracing_graph()
    return self._loss_args.get(graph) if graph is not None else None

  def random_states(self, graph=None):
    """[(variable, value)]: the random states of the model's random layers
    before its latest call in training mode in `graph` or a graph
    enclosing it (the damping rule evaluates the loss inside conditional
    branches); [] when there was none, or the model has no such layers."""
    key = graph or _tracing_graph()
    while key is not None:
      if key in self._random_states:
        return list(self._random_states[key])
      outer = getattr(key.graph, "outer_graph", None)
      key = None if outer is None else _RecordKey(outer, key.replica)
    return []

  def model_outputs(self, graph=None):
    """The outputs of the model's last call in `graph`, or None."""
    graph = graph or _tracing_graph()
    return self._model_outputs.get(graph) if graph is not None else None


def _in_training(training):
  """Whether a call's training mode may turn dropout on (True or a tensor;
  not False, and not None: Keras passes the mode it resolved to a model's
  call as `training`, or keeps it in its call context where `call` has no
  such argument)."""
  return training is not None and training is not False


def _put(records, key, value):
  """records[key] = value, dropping the records of other graphs (a new
  trace replaces the previous one's)."""
  for old in [k for k in records if k.graph is not key.graph]:
    del records[old]
  records[key] = value


# --------------------------------------------------------------------------
# Layer calls read from a built tf_keras model's graph (no trace needed).
#
# In a TF1 graph (tf_keras with v2 behaviour disabled, or a model built
# inside `tf.compat.v1.Graph().as_default()`), tf_keras builds a model by
# calling its layers on graph tensors and keeps each call as a node of the
# layer (`layer.inbound_nodes`). Those tensors are the ones a v1 training
# function (`fit`, `train_on_batch`, `model.total_loss`) computes the loss
# from, so K-FAC can register the layers from them without recording a call:
# this is how kfac 0.2.x's `get_layer_collection(model, loss)` worked.
#
# `NodeCalls(model)` answers `calls(layer)` like a `ModelRecorder` does, from
# the layer's latest node (a model called several times is registered for
# its latest call, as kfac 0.2.x did). Keras 3 models and tf_keras models
# built eagerly keep symbolic KerasTensors there, which no training step
# computes: `graph_nodes_usable` says whether a model's nodes can be used.


_LINEAR_NAMES = ("linear", "identity")


def _node_tensors(value):
  return [t for t in tf.nest.flatten(value) if t is not None]


def is_graph_tensor(value):
  """A tensor of a tf.Graph (not an eager tensor, not a KerasTensor)."""
  return (isinstance(value, tf.Tensor) and
          not isinstance(value, tf.__internal__.EagerTensor) and
          hasattr(value, "graph") and hasattr(value, "op"))


def latest_node(layer):
  """The node of the layer's latest call, or None."""
  nodes = getattr(layer, "_inbound_nodes", None)
  if nodes is None:
    nodes = getattr(layer, "inbound_nodes", None)
  return nodes[-1] if nodes else None


def node_outputs(layer):
  node = latest_node(layer)
  return None if node is None else node.output_tensors


def graph_nodes_usable(model):
  """True when the model's layers were called on tensors of the current
  default graph (tf_keras in a TF1 graph)."""
  if tf.executing_eagerly():
    return False
  graph = tf.compat.v1.get_default_graph()
  found = False
  for layer in keras_flavor.leaf_layers(model):
    node = latest_node(layer)
    if node is None:
      continue
    tensors = _node_tensors(getattr(node, "output_tensors", None))
    if not tensors or not all(is_graph_tensor(t) for t in tensors):
      return False
    if any(t.graph is not graph for t in tensors):
      return False
    found = True
  return found


def _is_linear(activation):
  name = getattr(activation, "__name__", None)
  return activation is None or name in _LINEAR_NAMES


def parent_tensor(tensor):
  """The single input tensor of the op producing `tensor`
  (kfac 0.2.x get_parent: the pre-activations behind an activation op)."""
  op = tensor.op
  inputs = [t for t in op.inputs]
  if not inputs:
    raise ValueError("%s has no input op (it is not computed from another "
                     "tensor)." % tensor.name)
  if len(inputs) != 1:
    raise ValueError(
        "%s has more than one parent tensor (op %s of type %s takes %d "
        "inputs)." % (tensor.name, op.name, op.type, len(inputs)))
  return inputs[0]


def _preactivations(layer, outputs):
  fused = any(keras_flavor.is_instance_by_name(layer, n)
              for n in FUSED_ACTIVATION_LAYERS)
  activation = getattr(layer, "activation", None)
  if not fused or _is_linear(activation):
    return outputs
  try:
    return parent_tensor(outputs)
  except ValueError as e:
    raise RegistrationError(
        "Cannot find the pre-activations of layer %s: its activation %s is "
        "not one op (%s). Use a linear layer followed by an Activation "
        "layer, or call the model inside a tf.function after "
        "kfac.keras.utils.watch(model) (the recorded path sees the "
        "pre-activations of any activation)." %
        (keras_flavor.layer_path(layer),
         getattr(activation, "__name__", activation), e))


class NodeCalls:
  """`calls(layer)` from the layers' latest graph nodes (see module doc)."""

  def __init__(self, model):
    self._model = model

  def calls(self, layer, graph=None):
    del graph
    node = latest_node(layer)
    if node is None:
      return []
    inputs, outputs = node.input_tensors, node.output_tensors
    if isinstance(inputs, (list, tuple)) and len(inputs) == 1:
      inputs = inputs[0]
    if isinstance(outputs, (list, tuple)) and len(outputs) == 1:
      outputs = outputs[0]
    if isinstance(inputs, (list, tuple, dict)) or isinstance(
        outputs, (list, tuple, dict)):
      raise RegistrationError(
          "Individual layers can only have 1 input tensor and 1 output "
          "tensor to be registered; layer %s (%s) has %d inputs and %d "
          "outputs." % (keras_flavor.layer_path(layer), type(layer).__name__,
                        len(tf.nest.flatten(inputs)),
                        len(tf.nest.flatten(outputs))))
    return [Call(inputs, _preactivations(layer, outputs),
                                outputs, None, None, True)]

  def loss_args(self, graph=None):
    del graph
    return None

  def model_outputs(self, graph=None):
    del graph
    return None


def output_tensors(model, loss_names):
  """{name: output tensor} of the layers named in `loss_names` (output
  layer names; a nested model's name stands for its single output layer),
  from their latest nodes."""
  by_name = {}
  stack = list(model.layers)[::-1]
  while stack:
    layer = stack.pop()
    by_name.setdefault(layer.name, layer)
    if hasattr(layer, "layers"):
      stack.extend(list(layer.layers)[::-1])
  out = {}
  for name in loss_names:
    layer = by_name.get(name)
    if layer is None:
      raise RegistrationError("No layer named %r in model %r." %
                              (name, model.name))
    while hasattr(layer, "layers"):
      names = list(getattr(layer, "output_names", []) or [])
      if len(names) != 1:
        raise RegistrationError(
            "Nested models with multiple outputs are unsupported.")
      inner = {l.name: l for l in layer.layers}
      layer = inner.get(names[0], layer.layers[-1])
    tensor = node_outputs(layer)
    if isinstance(tensor, (list, tuple)) and len(tensor) == 1:
      tensor = tensor[0]
    out[name] = tensor
  return out


# --------------------------------------------------------------------------
# The Keras layer kinds as one table: how each is recognised, its
# parameters and how it is registered.
#
# `KINDS` holds one `KerasLayerKind` per kind of Keras layer K-FAC has a
# block for, in the order `recognise` tries them. Each names the layer
# family of the ops side that registers it (collection/layer_kinds.FAMILIES:
# the family's kinds, approximations and blocks), declares how a Keras layer
# is recognised as one (`recognise(layer, class_names)`), which of its
# variables are the registered parameters, in the order the registration
# takes them (`params(layer)`), and the registration from the recorded calls
# (`register(lc, plan, calls, **options)`). layer_registration.py plans and
# registers layers from this table; a new Keras layer kind is one entry here.
#
# The table lives here, above the ops packages, so that the dependency
# direction stays ops -> integrations: the ops families know nothing of
# Keras, and this module reads their tables.


# Raised by a registration that must fall back to the generic block.
_Fallback = conv_variants.Fallback
_single_call = conv_variants.single_call
_conv_data_format = conv_variants.conv_data_format
_padding = conv_variants.padding_of


@dataclasses.dataclass(frozen=True, eq=False)
class KerasLayerKind:
  """One kind of Keras layer (see the module docstring).

  name: the kind (a Plan's `kind`; the keys of Kfac's default_approx).
  family: the ops family that registers it (a key of
    collection/layer_kinds.FAMILIES).
  recognise: (layer, class names) -> False (not this kind), True (this
    kind) or a string: a layer of this kind that some option puts out of
    reach, registered generically for that reason.
  params: layer -> its registered parameters (None entries are dropped).
  register: (lc, plan, calls, **options) -> the block(s); raises
    conv_variants.Fallback to fall back to the generic block.
  """
  name: str
  family: str
  recognise: typing.Callable
  params: typing.Callable
  register: typing.Callable


def param_arg(params):
  """The `params` argument of a registration: one variable or a tuple."""
  return params[0] if len(params) == 1 else tuple(params)


_CONV_CLASSES = ("Conv1D", "Conv2D", "Conv3D")


# ---------------------------------------------------------------- recognising
def _is_dense(layer, names):
  if "Dense" in names:
    return True
  if "EinsumDense" not in names:
    return False
  equation = getattr(layer, "equation", None)
  kernel = getattr(layer, "kernel", None)
  axes = einsum_equation.dense_axes(equation)
  if axes is None or kernel is None or (
      len(kernel.shape) != axes.input_axes + axes.output_axes):
    return ("EinsumDense equation %r is not a dense map over shared leading "
            "axes" % (equation,))
  bias = getattr(layer, "bias", None)
  if bias is not None and not einsum_equation.bias_is_dense(
      equation, getattr(layer, "bias_axes", None), bias.shape, kernel.shape):
    return ("EinsumDense bias axes %r of equation %r are not its output axes"
            % (layer.bias_axes, equation))
  return True


def _is_separable(layer, names):
  if not conv_variants.is_separable(layer):
    return False
  if "SeparableConv2D" not in names:
    return "%s has no K-FAC block (only SeparableConv2D)" % type(
        layer).__name__
  return True


def _is_conv(layer, names):
  return (any(n in names for n in _CONV_CLASSES) and
          getattr(layer, "groups", 1) == 1)


def _is_grouped_conv(layer, names):
  return (any(n in names for n in _CONV_CLASSES) and
          getattr(layer, "groups", 1) != 1)


def _is_batch_norm(layer, names):
  if "BatchNormalization" not in names:
    return False
  if getattr(layer, "renorm", False) or getattr(
      layer, "virtual_batch_size", None):
    return "BatchNormalization with renorm/virtual batches"
  axis = layer.axis
  if isinstance(axis, (list, tuple)) and len(axis) != 1:
    return "BatchNormalization over several axes %s" % (axis,)
  if not getattr(layer, "scale", True):
    return "BatchNormalization without scale"
  return True


def _is_layer_norm(layer, names):
  if "LayerNormalization" not in names:
    return False
  if not getattr(layer, "scale", True):
    return "LayerNormalization without scale"
  return True


def _is_group_norm(layer, names):
  if "GroupNormalization" not in names:
    return False
  if not getattr(layer, "scale", True):
    return "GroupNormalization without scale"
  if not isinstance(getattr(layer, "axis", -1), int):
    return "GroupNormalization over several axes %s" % (layer.axis,)
  return True


# ---------------------------------------------------------------- parameters
def _kernel_and_bias(layer):
  return [layer.kernel, getattr(layer, "bias", None)]


def _depthwise_params(layer):
  # tf_keras names the filter depthwise_kernel, Keras 3 kernel.
  kernel = getattr(layer, "depthwise_kernel", None)
  if kernel is None:
    kernel = layer.kernel
  return [kernel, getattr(layer, "bias", None)]


def _scale_and_shift_params(layer):
  return [layer.gamma, getattr(layer, "beta", None)]


def _layer_norm_params(layer):
  if getattr(layer, "rms_scaling", False):
    return [layer.gamma]
  return _scale_and_shift_params(layer)


# ---------------------------------------------------------------- registering
def _check_multi_use_positions(plan, calls, shapes):
  """Multi-use blocks take one [batch, ...] lookup / product per use: a
  layer called several times on inputs with positions ([batch, T, in]) has
  no multi-use registration (its outputs cannot be split per position
  without leaving the loss's graph)."""
  ranks = {s.rank for s in shapes}
  if ranks != {2}:
    raise _Fallback(
        "%s called %d times in one step on inputs with positions (outputs "
        "of rank %s); multi-use blocks take [batch, ...] outputs of rank 2 "
        "per call" % (type(plan.layer).__name__, len(calls),
                      "/".join(sorted(str(r) for r in ranks))))


def _register_dense(lc, plan, calls):
  params = param_arg(plan.params)
  axes = einsum_equation.dense_axes(getattr(plan.layer, "equation", None))
  if len(calls) == 1:
    # An EinsumDense kernel [in axes..., out axes...] is the dense weight
    # [prod(in), prod(out)]: its inputs are flattened over the input axes
    # by the registration, its outputs stay the layer's (the loss's).
    return lc.register_fully_connected(
        params, calls[0].inputs, calls[0].preactivations, approx=plan.approx,
        output_axes=axes.output_axes if axes else 1)
  if axes is not None and axes != (1, 1):
    raise _Fallback(
        "EinsumDense %r called %d times in one step; multi-use blocks take "
        "2-d kernels" % (plan.layer.equation, len(calls)))
  _check_multi_use_positions(
      plan, calls, [tf.convert_to_tensor(c.preactivations).shape
                    for c in calls])
  return lc.register_fully_connected_multi(
      params, [c.inputs for c in calls], [c.preactivations for c in calls],
      approx=plan.approx)


def _register_conv(lc, plan, calls, **options):
  layer = plan.layer
  rank = len(layer.kernel.shape) - 2
  params = param_arg(plan.params)
  data_format = _conv_data_format(layer, rank)
  if len(calls) > 1:
    if options:
      raise RegistrationError(
          "registration_options %s for %s: a convolution called several "
          "times in one step (register_conv2d_multi) takes no options." %
          (options, keras_flavor.layer_path(layer)))
    if rank != 2:
      raise _Fallback(
          "%s called %d times in one step; only Conv2D layers have a "
          "multi-use convolution block" % (type(layer).__name__, len(calls)))
    return lc.register_conv2d_multi(
        params, list(layer.strides), _padding(layer),
        [c.inputs for c in calls], [c.preactivations for c in calls],
        data_format=data_format, dilations=list(layer.dilation_rate),
        approx=plan.approx)
  call = calls[0]
  if rank == 1:
    return lc.register_conv1d(
        params, list(layer.strides), _padding(layer), call.inputs,
        call.preactivations, dilations=list(layer.dilation_rate),
        approx=plan.approx, data_format=data_format, **options)
  return lc.register_convolution(
      params, call.inputs, call.preactivations, _padding(layer),
      strides=list(layer.strides), dilation_rate=list(layer.dilation_rate),
      data_format=data_format, approx=plan.approx, **options)


def _register_depthwise(lc, plan, calls, **options):
  layer = plan.layer
  _single_call(plan, calls)
  return lc.register_depthwise_conv2d(
      param_arg(plan.params), calls[0].inputs, calls[0].preactivations,
      list(layer.strides), _padding(layer),
      rate=list(layer.dilation_rate),
      data_format=_conv_data_format(layer, 2),
      approx=plan.approx or conv_variants.DEPTHWISE_DEFAULT, **options)


def _register_embedding(lc, plan, calls):
  def ids(call):
    inputs = tf.convert_to_tensor(call.inputs)
    return inputs if inputs.dtype.is_integer else tf.cast(inputs, tf.int32)
  if len(calls) == 1:
    if position_embedding.example_independent(calls[0].inputs):
      # ids without a batch axis (see position_embedding).
      total, reason = position_embedding.broadcast_sum(
          tf.convert_to_tensor(calls[0].outputs))
      if total is None:
        raise _Fallback(reason)
      return lc.register_embedding(
          plan.params[0], position_embedding.tiled_ids(ids(calls[0]), total),
          total, approx=plan.approx)
    return lc.register_embedding(plan.params[0], ids(calls[0]),
                                 calls[0].outputs, approx=plan.approx)
  _check_multi_use_positions(
      plan, calls, [tf.convert_to_tensor(c.outputs).shape for c in calls])
  return lc.register_fully_connected_multi(
      plan.params[0], [ids(c) for c in calls], [c.outputs for c in calls],
      approx=plan.approx, dense_inputs=False)


def _register_batch_norm(lc, plan, calls):
  layer = plan.layer
  call = _single_call(plan, calls)
  if call.mask is not None:
    raise _Fallback("BatchNormalization called with a mask")
  x = tf.convert_to_tensor(call.inputs)
  axis = layer.axis
  axis = axis[0] if isinstance(axis, (list, tuple)) else axis
  axis = axis % x.shape.rank
  if axis != x.shape.rank - 1:
    # The scale-and-shift block broadcasts its [C] parameters over the last
    # axis. Transposing the outputs would not do: the statistics need the
    # loss's gradient w.r.t. them, and a transpose is not on the path from
    # the parameters to the loss (its gradient would be zero).
    raise _Fallback("BatchNormalization over axis %d, not the last axis "
                    "of its inputs %s" % (axis, x.shape))
  compute = x.dtype if x.dtype.size >= 4 else tf.float32
  if call.from_node and not isinstance(call.training, bool):
    # A tf_keras graph node: the layer ran in the learning phase's mode
    # (a tensor), so undo its scale and shift, which is exact in both.
    return lc.register_scale_and_shift(
        param_arg(plan.params), _undo_scale_and_shift(plan, call.outputs),
        call.outputs, approx=plan.approx)
  x = tf.cast(x, compute)
  if call.training and layer.trainable:
    reduce_axes = [i for i in range(x.shape.rank) if i != axis]
    mean, variance = tf.nn.moments(x, reduce_axes, keepdims=True)
  else:
    shape = [1] * x.shape.rank
    shape[axis] = -1
    mean = tf.reshape(tf.cast(layer.moving_mean, compute), shape)
    variance = tf.reshape(tf.cast(layer.moving_variance, compute), shape)
  normalized = tf.stop_gradient((x - mean) * tf.math.rsqrt(
      variance + layer.epsilon))
  outputs = tf.convert_to_tensor(call.outputs)
  normalized = tf.cast(normalized, outputs.dtype)
  return lc.register_scale_and_shift(param_arg(plan.params), normalized,
                                     outputs, approx=plan.approx)


def _register_layer_norm(lc, plan, calls):
  layer = plan.layer
  call = _single_call(plan, calls)
  x = tf.convert_to_tensor(call.inputs)
  rank = x.shape.rank
  axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
  axes = sorted(a % rank for a in axes)
  if axes != list(range(rank - len(axes), rank)):
    raise _Fallback("LayerNormalization over non-trailing axes %s" % (axes,))
  compute = x.dtype if x.dtype.size >= 4 else tf.float32
  x = tf.cast(x, compute)
  if getattr(layer, "rms_scaling", False):
    normalized = x * tf.math.rsqrt(
        tf.reduce_mean(tf.square(x), axes, keepdims=True) + layer.epsilon)
  else:
    mean, variance = tf.nn.moments(x, axes, keepdims=True)
    normalized = (x - mean) * tf.math.rsqrt(variance + layer.epsilon)
  outputs = tf.convert_to_tensor(call.outputs)
  normalized = tf.cast(tf.stop_gradient(normalized), outputs.dtype)
  return lc.register_scale_and_shift(param_arg(plan.params), normalized,
                                     outputs, approx=plan.approx)


def _register_group_norm(lc, plan, calls):
  layer = plan.layer
  call = _single_call(plan, calls)
  if call.mask is not None:
    raise _Fallback("GroupNormalization called with a mask")
  x = tf.convert_to_tensor(call.inputs)
  rank = x.shape.rank
  if rank is None or layer.axis % rank != rank - 1:
    # As for BatchNormalization: the block's [C] parameters broadcast over
    # the last axis, and a transpose of the outputs would be off the loss's
    # path.
    raise _Fallback("GroupNormalization over axis %d, not the last axis of "
                    "its inputs %s" % (layer.axis, x.shape))
  # Keras computes in float32 at least (float16 overflows).
  compute = x.dtype if x.dtype.size >= 4 else tf.float32
  normalized = normalized_inputs.group_normalized(
      tf.cast(x, compute), layer.groups, layer.epsilon)
  outputs = tf.convert_to_tensor(call.outputs)
  normalized = tf.cast(tf.stop_gradient(normalized), outputs.dtype)
  return lc.register_scale_and_shift(param_arg(plan.params), normalized,
                                     outputs, approx=plan.approx)


def _undo_scale_and_shift(plan, outputs):
  """The normalised inputs of a scale-and-shift layer recovered from its
  outputs: (outputs - beta) / gamma (kfac 0.2.x's registration)."""
  outputs = tf.convert_to_tensor(outputs)
  gamma = tf.cast(plan.params[0], outputs.dtype)
  shifted = outputs
  if len(plan.params) > 1:
    shifted = outputs - tf.cast(plan.params[1], outputs.dtype)
  return tf.stop_gradient(shifted / gamma)


KINDS = {kind.name: kind for kind in (
    KerasLayerKind(
        "conv_transpose", "conv_transpose",
        lambda layer, names: conv_variants.is_transpose(layer),
        _kernel_and_bias, conv_variants.register_transpose),
    KerasLayerKind("dense", "dense", _is_dense, _kernel_and_bias,
                   _register_dense),
    KerasLayerKind(
        "recurrent", "dense",
        lambda layer, names: recurrent.cell_kind(layer) is not None,
        recurrent.cell_params, recurrent.register),
    KerasLayerKind("separable_conv", "conv", _is_separable,
                   conv_variants.separable_params,
                   conv_variants.register_separable),
    KerasLayerKind(
        "depthwise_conv", "conv",
        lambda layer, names: "DepthwiseConv2D" in names,
        _depthwise_params, _register_depthwise),
    KerasLayerKind("conv", "conv", _is_conv, _kernel_and_bias,
                   _register_conv),
    KerasLayerKind("grouped_conv", "conv", _is_grouped_conv,
                   _kernel_and_bias, conv_variants.register_grouped),
    KerasLayerKind(
        "embedding", "embedding", lambda layer, names: "Embedding" in names,
        lambda layer: [layer.embeddings], _register_embedding),
    KerasLayerKind("batch_norm", "scale_shift", _is_batch_norm,
                   _scale_and_shift_params, _register_batch_norm),
    KerasLayerKind("layer_norm", "scale_shift", _is_layer_norm,
                   _layer_norm_params, _register_layer_norm),
    KerasLayerKind("group_norm", "scale_shift", _is_group_norm,
                   _scale_and_shift_params, _register_group_norm),
)}

assert all(kind.family in ops_layer_kinds.FAMILIES for kind in KINDS.values())


def recognise(layer):
  """(kind, reason): the kind of a layer (a key of KINDS), or "generic"
  with the reason it cannot have a specific one."""
  names = keras_flavor.class_names(layer)
  name = type(layer).__name__
  if getattr(layer, "lora_enabled", False) or getattr(
      layer, "quantization_mode", None):
    return "generic", "LoRA / quantized %s" % name
  for kind in KINDS.values():
    found = kind.recognise(layer, names)
    if found is True:
      return kind.name, None
    if found:
      return "generic", found
  return "generic", "no K-FAC block for layer class %s" % name


def layer_params(layer, kind):
  """The parameters of a `kind` layer in the order the registration takes
  them; a generic layer's own trainable variables."""
  if kind in KINDS:
    params = KINDS[kind].params(layer)
  else:
    params = keras_flavor.own_trainable_variables(layer)
  return [p for p in params if p is not None]


# --------------------------------------------------------------------------
GENERIC_FALLBACK = "diagonal"
# params: the tf.Variables; names: their Keras paths (for the report).
Plan = collections.namedtuple(
    "Plan", ["layer", "kind", "approx", "params", "reason", "names"])
Plan.__new__.__defaults__ = (None,)


def variable_name(var):
  """A variable's own path for reports: a Keras 3 variable's `path`
  ("outer/dense_1/kernel"; the tf.Variable behind it is named after the
  outermost model only: "outer/kernel:0"), else its name."""
  return getattr(var, "path", None) or keras_flavor.unwrap_variable(var).name


def param_names(plan):
  """The names of a plan's parameters for the report."""
  if plan.names is not None:
    return list(plan.names)
  return [p.name for p in plan.params]


# ---------------------------------------------------------------- planning
def plan_layer(layer, fisher_approx=None, trainable=None):
  """The Plan of one layer, or None if it has no trainable parameters
  (in `trainable`, a set of variable refs, when given)."""
  own = keras_flavor.own_trainable_variables(layer)
  if trainable is not None:
    own = [v for v in own
           if keras_flavor.unwrap_variable(v).ref() in trainable]
  if not own:
    return None
  kind, reason = recognise(layer)
  params = layer_params(layer, kind) if kind != "generic" else own
  own_refs = {keras_flavor.unwrap_variable(v).ref() for v in own}
  param_refs = {keras_flavor.unwrap_variable(v).ref() for v in params}
  if kind != "generic" and own_refs != param_refs:
    kind, reason = "generic", "only some of its parameters are trainable"
    params = own
  approx = resolve_fisher_approx(fisher_approx, layer)
  if kind == "generic" and approx is None:
    approx = GENERIC_FALLBACK
  return Plan(layer, kind, approx, [keras_flavor.unwrap_variable(p)
                                    for p in params], reason,
              [variable_name(p) for p in params])


def plan_layers(model, fisher_approx=None, trainable=None):
  plans = []
  for layer in keras_flavor.leaf_layers(model):
    plan = plan_layer(layer, fisher_approx, trainable)
    if plan is not None:
      plans.append(plan)
  return plans



# ---------------------------------------------------------------- registering
def register_layers(lc, plans, recorder, batch_size, warn=None,
                    registration_options=None, default_conv_options=None,
                    default_approx=None):
  """Registers every plan on `lc` from the calls `recorder` holds for the
  current graph. Returns the report rows. `warn(key, message)` reports a
  generic fallback (default: warnings.warn). `registration_options` maps
  layer names / classes to extra arguments of a convolution's registration
  (CONV_OPTIONS). The default recipe's (Kfac(adaptive=True)): options of
  single-call kron convolutions without registration_options
  (`default_conv_options`), {kind: approximation} of layers without
  fisher_approx (`default_approx`)."""
  warn = warn or (lambda key, message: warnings.warn(message, stacklevel=3))
  rows = []
  for plan in plans:
    layer = plan.layer
    calls = recorder.calls(layer)
    if default_approx and plan.approx is None and plan.kind in default_approx:
      plan = plan._replace(approx=default_approx[plan.kind])
    kind, approx, reason = plan.kind, plan.approx, plan.reason
    options = dict(resolve_fisher_approx(registration_options, layer) or {})
    if kind == "depthwise_conv":
      check_depthwise_options(layer, options, True)
    elif options and kind != "conv":
      raise RegistrationError(
          "registration_options %s for layer %s (%s): only Conv1D/2D/3D "
          "and DepthwiseConv2D layers take options (%s)." %
          (options, keras_flavor.layer_path(layer), type(layer).__name__,
           ", ".join(CONV_OPTIONS)))
    if kind != "generic" and not calls:
      kind, reason = "generic", (recurrent.no_call_reason(layer) if kind ==
                                 "recurrent" else "its parameters are used "
                                 "outside its call")
    if (default_conv_options and not options and len(calls) == 1 and
        (kind == "conv" and approx in (None, "kron") or
         kind == "depthwise_conv" and
         (approx or conv_variants.DEPTHWISE_DEFAULT) == "kron")):
      options = {k: v for k, v in default_conv_options.items()
                 if kind == "conv" or k in DEPTHWISE_OPTIONS}
    if kind != "generic":
      try:
        block = KINDS[kind].register(lc, plan, calls, **options)
      except _Fallback as e:
        kind, reason = "generic", str(e)
    if kind == "generic":
      approx = (plan.approx if plan.kind == "generic" and plan.approx
                else GENERIC_FALLBACK)
      block = lc.register_generic(param_arg(plan.params), batch_size,
                                  approx=approx)
      warn(keras_flavor.layer_path(layer),
           "kfac: layer %r (%s) is registered with the generic %r "
           "approximation: %s." % (keras_flavor.layer_path(layer),
                                   type(layer).__name__, approx, reason))
    rows.append(Row(keras_flavor.layer_path(layer), type(layer).__name__,
                    "+".join(type(b).__name__ for b in
                             (block if isinstance(block, tuple) else
                              (block,))), approx or "default",
                    ", ".join(param_names(plan)), len(calls),
                    "fallback: " + reason if kind == "generic" else
                    ", ".join("%s=%r" % kv for kv in sorted(options.items())),
                    block if isinstance(block, tuple) else (block,)))
  return rows


# --------------------------------------------------------------------------
# A model's registration: where its calls come from, its layers and losses.


def watch(model):
  """Installs the recording of layer inputs / pre-activations on `model`
  (idempotent). Calls of the model traced afterwards are usable."""
  recorder = recorder_for(model)
  recorder.refresh()
  return recorder


def name_state_by_structure(model):
  """Keys the K-FAC state of `model`'s variables by structure, not by name.

  Each trainable variable gets the state name "keras/<i>_<LayerClass>/<v>",
  with i the layer's position among the model's layers (nested ones
  included, in Keras's traversal order) and v the variable's own short name;
  weights of no layer get "keras/model/<v>". A model rebuilt with the same
  architecture (in the same process its automatic layer names differ) then
  finds the state a checkpoint saved for the first one."""
  used = set()

  def assign(var, name):
    var = keras_flavor.unwrap_variable(var)
    base, i = name, 1
    while name in used:
      name = "%s_%d" % (base, i)
      i += 1
    used.add(name)
    var._kfac_state_name = name  # pylint: disable=protected-access

  def short(var):
    return keras_flavor.unwrap_variable(var).name.split(":")[0].split("/")[-1]

  owned = set()
  for i, layer in enumerate(keras_flavor.leaf_layers(model)):
    for var in keras_flavor.own_trainable_variables(layer):
      owned.add(keras_flavor.unwrap_variable(var).ref())
      assign(var, "keras/%02d_%s/%s" % (i, type(layer).__name__, short(var)))
  for var in model.trainable_variables:
    if keras_flavor.unwrap_variable(var).ref() not in owned:
      assign(var, "keras/model/%s" % short(var))


def no_graph_error(what, model_name):
  return RuntimeError(
      "%s needs the tensors the training step computes. Outside a trace it "
      "reads them from the layers of a tf_keras model built in a TF1 graph "
      "(TF_USE_LEGACY_KERAS=1 with tf.compat.v1.disable_v2_behavior(), or "
      "inside tf.compat.v1.Graph().as_default()); model %r keeps symbolic "
      "Keras tensors instead (Keras 3, or tf_keras built eagerly). Use "
      "kfac.keras.optimizers.Kfac(model=..., loss=...) with model.fit, or "
      "in a custom loop call kfac.keras.utils.watch(model) once and then, "
      "inside the tf.function of the step, call the model and "
      "kfac.keras.utils.get_layer_collection(model, loss) (or "
      "register_model for the registration report)." % (what, model_name))


def _seed_for(seed, index):
  """A per-loss seed: None, an int, or a stateless [2] seed tensor."""
  if seed is None:
    return None
  if isinstance(seed, (tf.Tensor, tf.Variable)):
    return seed + tf.constant([index * 1000003, 0], seed.dtype)
  return seed + index


def _has_recorded_calls(recorder, model):
  if recorder.model_outputs() is not None:
    return True
  return any(recorder.calls(layer)
             for layer in keras_flavor.leaf_layers(model))


def forward_graph(model):
  """The graph of the model's recorded forward pass: the current graph, or
  the nearest graph enclosing it (when the current one is, e.g., a tf.cond
  branch: Keras's LossScaleOptimizer applies its optimizer in one); None
  when there is no such record."""
  if tf.executing_eagerly():
    return None
  recorder = watch(model)
  graph = tf.compat.v1.get_default_graph()
  while graph is not None:
    with graph.as_default():
      if _has_recorded_calls(recorder, model):
        return graph
    graph = getattr(graph, "outer_graph", None)
  return None


def _recorded_in_an_outer_graph(model):
  graph = forward_graph(model)
  return graph is not None and graph is not (
      tf.compat.v1.get_default_graph())


def _source_of_calls(model, what):
  """(calls source, recorded?): the calls recorded in the current trace /
  graph, else the layers' graph nodes of a tf_keras model built in this
  graph; raises when neither is available."""
  if tf.executing_eagerly():
    raise no_graph_error(what, model.name)
  recorder = watch(model)
  if _has_recorded_calls(recorder, model):
    return recorder, True
  if graph_nodes_usable(model):
    return NodeCalls(model), False
  if _recorded_in_an_outer_graph(model):
    raise RegistrationError(
        "The model's layers were called in a graph enclosing this one (this "
        "is a conditional branch of the training step): register them "
        "there, e.g. `with kfac.keras.utils.forward_graph(model)."
        "as_default():` (the Kfac optimizer does this itself).")
  raise RegistrationError(
      "No call of model %r was recorded in this graph, and its layers were "
      "not built on tensors of this graph. Call the model inside the traced "
      "step (or this tf.compat.v1 graph) after creating the Kfac optimizer "
      "or after kfac.keras.utils.watch(model); a tf_keras model built in "
      "this TF1 graph needs no watch." % model.name)


def _register_generic_orphans(lc, model, variables, tf_vars, plans,
                              batch_size, warn, rows):
  covered = {p.ref() for plan in plans for p in plan.params}
  names = {keras_flavor.unwrap_variable(v).ref():
           variable_name(v) for v in variables}
  orphans = [v for v in tf_vars if v.ref() not in covered]
  if not orphans:
    return
  orphan_names = ", ".join(names.get(v.ref(), v.name) for v in orphans)
  block = lc.register_generic(
      orphans[0] if len(orphans) == 1 else tuple(orphans), batch_size,
      approx=GENERIC_FALLBACK)
  message = ("kfac: variables %s belong to no layer of %r; registered with "
             "the generic %r approximation." %
             (orphan_names, model.name,
              GENERIC_FALLBACK))
  (warn or (lambda k, m: warnings.warn(m, stacklevel=3)))("orphans", message)
  rows.append(Row(
      model.name, "(model)", "NaiveDiagonalFB",
      GENERIC_FALLBACK,
      orphan_names, 0, "fallback: no owning layer", (block,)))


def register_model(model, loss=None, loss_weights=None, fisher_approx=None,
                   layer_collection=None, seed=None, y_pred=None,
                   targets=None, variables=None, warn=None,
                   registration_options=None, average_over_outputs=False,
                   default_conv_options=None, default_approx=None,
                   lenient=False):
  """Registers `model`'s layers and loss(es) on a LayerCollection and
  returns (layer_collection, report), report being the text of the
  registration report. Arguments as get_layer_collection's;
  `default_conv_options` and `default_approx` as
  register_layers's; `lenient` as loss_registration.find_logits's (kfac
  0.2.x's entry points pass True)."""
  lc, rows, loss_lines = register_model_rows(
      model, loss=loss, loss_weights=loss_weights,
      fisher_approx=fisher_approx, layer_collection=layer_collection,
      seed=seed, y_pred=y_pred, targets=targets, variables=variables,
      warn=warn, registration_options=registration_options,
      average_over_outputs=average_over_outputs,
      default_conv_options=default_conv_options,
      default_approx=default_approx, lenient=lenient)
  return lc, format_report(rows, loss_lines)


def register_model_rows(model, loss=None, loss_weights=None,
                        fisher_approx=None, layer_collection=None, seed=None,
                        y_pred=None, targets=None, variables=None, warn=None,
                        registration_options=None,
                        average_over_outputs=False,
                        default_conv_options=None, default_approx=None,
                        lenient=False):
  """register_model, returning (layer_collection, report rows, loss lines)
  (registration_report.format_report makes the text; with the memory
  column once an optimizer has made the collection's factors)."""
  what = "kfac.keras.utils.get_layer_collection"
  source, recorded = _source_of_calls(model, what)
  lc = layer_collection or lc_lib.LayerCollection()
  fisher_approx = model_args.fisher_approx_dict(fisher_approx, model)
  check_fisher_approx(fisher_approx, model)
  check_registration_options(registration_options, model)
  if variables is None:
    variables = model.trainable_variables
  tf_vars = [keras_flavor.unwrap_variable(v) for v in variables]
  trainable = {v.ref() for v in tf_vars}
  plans = plan_layers(model, fisher_approx, trainable)

  if recorded:
    pairs, targets, sample_weight = _recorded_losses(
        source, model, loss, loss_weights, y_pred, targets)
  else:
    pairs, sample_weight = _node_losses(model, loss, loss_weights, y_pred), None
  if pairs:
    first = tf.nest.flatten(pairs[0][2])[0]
  else:
    first = tf.nest.flatten(node_outputs(model.layers[-1]))[0]
  batch_size = tf.shape(first)[0]

  rows = register_layers(
      lc, plans, source, batch_size, warn,
      registration_options=registration_options,
      default_conv_options=default_conv_options,
      default_approx=default_approx)
  _register_generic_orphans(lc, model, variables, tf_vars, plans, batch_size,
                            warn, rows)

  loss_lines = register_loss_pairs(lc, pairs, targets, seed,
                                   average_over_outputs, lenient=lenient)
  if sample_weight is not None and warn is not None:
    warn("sample_weight", "kfac: sample weights weight the gradient but not "
         "the curvature statistics (K-FAC's Fisher is over the model's "
         "predictive distribution).")
  return lc, rows, loss_lines


def register_loss_pairs(lc, pairs, targets, seed=None,
                        average_over_outputs=False, lenient=False):
  """Registers each (loss, weight, prediction) of `pairs` on lc with its
  targets (a structure aligned with pairs, or None); returns the report's
  loss lines."""
  target_list = ([None] * len(pairs) if targets is None else
                 tf.nest.flatten(targets) if len(pairs) > 1 else [targets])
  if len(target_list) != len(pairs):
    target_list = [None] * len(pairs)
  loss_lines = []
  for i, ((one_loss, weight, pred), target) in enumerate(
      zip(pairs, target_list)):
    loss_lines.append(loss_registration.register_keras_loss(
        lc, one_loss, pred, targets=target, coeff=weight,
        seed=_seed_for(seed, i), average_over_outputs=average_over_outputs,
        lenient=lenient))
  return loss_lines


def loss_pairs(model, loss, loss_weights, y_pred):
  """(loss, weight, prediction) triples of the model's outputs y_pred."""
  return loss_registration.flatten_outputs(
      loss, loss_weights, y_pred, model_args.output_names(model) or None)


def _recorded_losses(recorder, model, loss, loss_weights, y_pred, targets):
  """(loss, weight, prediction) triples from the call recorded in this
  trace, the targets and the sample weights fit passed to compute_loss."""
  loss_args = recorder.loss_args() or {}
  if y_pred is None:
    y_pred = loss_args.get("y_pred")
  if y_pred is None:
    y_pred = recorder.model_outputs()
  if y_pred is None:
    raise RegistrationError(
        "The model %r itself was not called in this trace (only some of its "
        "layers were): call the model, or pass y_pred=..." % model.name)
  if targets is None:
    targets = loss_args.get("y")
  if loss is None:
    loss = getattr(model, "loss", None)
    if loss is None:
      raise RegistrationError(
          "No loss: pass loss=... to Kfac / get_layer_collection, or compile "
          "the model with a loss.")
  pairs = loss_pairs(model, loss, loss_weights, y_pred)
  return pairs, targets, loss_args.get("sample_weight")


def _node_losses(model, loss, loss_weights, y_pred):
  """(loss, weight, prediction) triples on the output layers' latest graph
  nodes (kfac 0.2.x: no loss registers none)."""
  if loss is None:
    loss = getattr(model, "loss", None)
  losses = model_args.losses_by_output(loss, model)
  weights = model_args.loss_weights_by_output(loss_weights, model)
  if not losses:
    return []
  if y_pred is not None:
    preds = dict(zip(losses, tf.nest.flatten(y_pred)))
  else:
    preds = output_tensors(model, list(losses))
  return [(one_loss, weights.get(name, 1.0), preds[name])
          for name, one_loss in losses.items()]
