"""Layer calls read from a built tf_keras model's graph (no trace needed).

In a TF1 graph (tf_keras with v2 behaviour disabled, or a model built
inside `tf.compat.v1.Graph().as_default()`), tf_keras builds a model by
calling its layers on graph tensors and keeps each call as a node of the
layer (`layer.inbound_nodes`). Those tensors are the ones a v1 training
function (`fit`, `train_on_batch`, `model.total_loss`) computes the loss
from, so K-FAC can register the layers from them without recording a call:
this is how kfac 0.2.x's `get_layer_collection(model, loss)` worked.

`NodeCalls(model)` answers `calls(layer)` like a `ModelRecorder` does, from
the layer's latest node (a model called several times is registered for
its latest call, as kfac 0.2.x did). Keras 3 models and tf_keras models
built eagerly keep symbolic KerasTensors there, which no training step
computes: `graph_nodes_usable` says whether a model's nodes can be used.
"""

import tensorflow as tf

from kfac.python.keras import keras_flavor
from kfac.python.keras import layer_recorder
from kfac.python.keras.layer_registration import RegistrationError

_LINEAR_NAMES = ("linear", "identity")


def _node_tensors(value):
  return [t for t in tf.nest.flatten(value) if t is not None]


def _is_graph_tensor(value):
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
    if not tensors or not all(_is_graph_tensor(t) for t in tensors):
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
              for n in layer_recorder.FUSED_ACTIVATION_LAYERS)
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
    return [layer_recorder.Call(inputs, _preactivations(layer, outputs),
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
