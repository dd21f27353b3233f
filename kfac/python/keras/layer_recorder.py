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
The model's `compute_loss` is wrapped too, to record `y`, `y_pred` and
`sample_weight` of a `fit` step.
"""

import collections
import contextlib
import functools
import weakref

import tensorflow as tf

from kfac.python.keras import keras_flavor

# Layers whose `activation` attribute is applied to the pre-activations
# that K-FAC registers.
FUSED_ACTIVATION_LAYERS = ("Dense", "EinsumDense", "Conv", "Conv1D", "Conv2D",
                           "Conv3D", "DepthwiseConv2D", "DepthwiseConv1D",
                           "SeparableConv2D", "SeparableConv1D")

Call = collections.namedtuple(
    "Call", ["inputs", "preactivations", "outputs", "training", "mask"])

_RECORDERS = weakref.WeakKeyDictionary()


def recorder_for(model):
  """The model's recorder, installed on first use (one per model)."""
  recorder = _RECORDERS.get(model)
  if recorder is None:
    recorder = ModelRecorder(model)
    _RECORDERS[model] = recorder
  return recorder


def _tracing_graph():
  """The graph being built, or None when executing eagerly."""
  if tf.executing_eagerly():
    return None
  return tf.compat.v1.get_default_graph()


def _first_input(args, kwargs):
  if args:
    return args[0]
  return kwargs.get("inputs")


class ModelRecorder:
  """Wraps the layers of one model; see the module docstring."""

  def __init__(self, model):
    self._model_ref = weakref.ref(model)
    self._calls = {}  # id(layer) -> (graph, [Call, ...])
    self._loss_args = None  # (graph, {"y": ..., "y_pred": ..., ...})
    self._model_outputs = None  # (graph, outputs of the model's last call)
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

    @functools.wraps(original)
    def call(*args, **kwargs):
      graph = recorder._recording_graph()
      if graph is None:
        return original(*args, **kwargs)
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
      outputs = original_call(*args, **kwargs)
      graph = recorder._recording_graph()
      if graph is not None:
        recorder._model_outputs = (graph, outputs)
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
        recorder._loss_args = (graph, recorded)
      return original_loss(*args, **kwargs)

    object.__setattr__(model, "compute_loss", compute_loss)
    self._wrapped.add(id(model))

  def _add_call(self, layer, graph, call):
    graph_and_calls = self._calls.get(id(layer))
    if graph_and_calls is None or graph_and_calls[0] is not graph:
      graph_and_calls = (graph, [])
      self._calls[id(layer)] = graph_and_calls
    graph_and_calls[1].append(call)

  # ------------------------------------------------------------ reading
  def calls(self, layer, graph=None):
    """The recorded calls of `layer` in `graph` (default: the current one)."""
    graph = graph or _tracing_graph()
    graph_and_calls = self._calls.get(id(layer))
    if graph is None or graph_and_calls is None:
      return []
    if graph_and_calls[0] is not graph:
      return []
    return list(graph_and_calls[1])

  def loss_args(self, graph=None):
    """{"y", "y_pred", "sample_weight", "x"} of the model's compute_loss in
    `graph`, or None."""
    graph = graph or _tracing_graph()
    if self._loss_args is None or self._loss_args[0] is not graph:
      return None
    return self._loss_args[1]

  def model_outputs(self, graph=None):
    """The outputs of the model's last call in `graph`, or None."""
    graph = graph or _tracing_graph()
    if self._model_outputs is None or self._model_outputs[0] is not graph:
      return None
    return self._model_outputs[1]
