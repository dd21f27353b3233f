"""Records what K-FAC needs from a Keras forward pass.

K-FAC's statistics need, for each layer, its inputs and its pre-activations
(the tensor a fused activation is applied to), as tensors of the traced
training step. Keras has no forward hooks, so `ModelRecorder` wraps each
layer's `call` (an instance attribute; the class is untouched, and
`get_config` / saving do not see the wrapper). During a call of a layer
with a fused activation, `layer.activation` is swapped for a function that
records its argument and is restored when the call returns.

Calls are recorded only while tracing (a `tf.function`, which is where
`model.fit` runs its train step and where a Keras 3 optimizer's `apply`
runs, in the same graph). Records are kept per graph: a new trace starts a
new set, and the optimizer reads the set of the graph it is building.
Under a tf.distribute strategy with several replicas, whose replicas trace
into one graph, they are kept per replica as well.
The model's `compute_loss` is wrapped too, to record `y`, `y_pred` and
`sample_weight` of a `fit` step, and the loss it returns. At the start of
each call of the model in training mode (`training=True` or a tensor, as
an argument or, for a Keras 3 `call` without one, in Keras's call
context) the random states of its random layers
(keras_flavor.random_state_variables) are read;
`random_states` gives those of the latest such call in the graph, which
the damping rule sets back to replay that forward pass's dropout masks.
"""

import collections
import contextlib
import functools
import weakref

import tensorflow as tf

from kfac.python.keras import keras_flavor
from kfac.python.keras import recurrent

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
