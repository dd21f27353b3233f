"""Building a LayerCollection from a Keras model (kfac.keras.utils).

The optimizer does this on every trace of the training step; a custom
training loop can do it itself:

    kfac.keras.utils.watch(model)          # once, before the first trace
    @tf.function
    def step(x, y):
      with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
      lc = kfac.keras.utils.get_layer_collection(model, loss_fn)
      ...

`get_layer_collection` registers the layers of `model` from the tensors
recorded during the model's call in the current trace (see
layer_registration, which holds how a model is registered)
and the loss on the model's output. A tf_keras model built in a TF1 graph
(kfac 0.2.x's usage) needs neither watch nor trace: its layers' graph nodes
hold the tensors its training function uses (layer_registration.NodeCalls). Keras 3 and
eagerly built tf_keras models keep symbolic tensors there, so outside a
trace they raise an error naming the traced usage.
`register_model` is get_layer_collection returning the registration report
too; `register_layer` / `register_loss` do one layer / one loss on a
collection of your own; `get_loss_fn` makes the model's loss a function of
a batch (for damping adaptation).
"""

import tensorflow as tf

from kfac.python.keras import keras_flavor
from kfac.python.keras import keras_loss_fn
from kfac.python.keras import layer_registration
from kfac.python.keras import loss_registration
from kfac.python.keras import model_args
from kfac.python.ops.collection import layer_collection as lc_lib

RegistrationError = layer_registration.RegistrationError
# Building a collection from a model (layer_registration.py holds how).
watch = layer_registration.watch
name_state_by_structure = layer_registration.name_state_by_structure
forward_graph = layer_registration.forward_graph
register_model = layer_registration.register_model
register_model_rows = layer_registration.register_model_rows
register_loss_pairs = layer_registration.register_loss_pairs
loss_pairs = layer_registration.loss_pairs
# How serialize_fisher_approx writes a layer-class key (kfac 0.2.x).
_CLASS_NAME_PREFIX = layer_registration.OLD_CLASS_KEY_PREFIX
# kfac 0.2.x: the LayerCollection method each logits loss registers with
# (keys: Keras loss class names, lower case without underscores).
_KERAS_LOSS_TO_KFAC_REGISTER_FUNC = {
    "sparsecategoricalcrossentropy":
        lc_lib.LayerCollection.register_softmax_cross_entropy_loss,
    "categoricalcrossentropy":
        lc_lib.LayerCollection.register_softmax_cross_entropy_loss,
    "binarycrossentropy":
        lc_lib.LayerCollection.register_sigmoid_cross_entropy_loss,
}


def get_layer_collection(model, loss=None, loss_weights=None,
                         fisher_approx=None, layer_collection=None, seed=None,
                         y_pred=None, targets=None, variables=None, warn=None,
                         registration_options=None,
                         average_over_outputs=False):
  """Registers `model`'s layers and loss(es) on a LayerCollection.

  Where the tensors come from: the model's call recorded in the current
  trace (a tf.function, after `watch(model)`; the Kfac optimizer watches
  its model), else, for a tf_keras model built in the current TF1 graph,
  its layers' latest graph nodes (no watch needed; kfac 0.2.x's usage).

  Args:
    model: a Keras model (Keras 3 or tf_keras).
    loss: the Keras loss(es): one loss, a list in the order of the outputs
      or a dict keyed by output name (default: `model.loss`).
    loss_weights: per-output coefficients of the losses (a list, or a dict
      keyed by output name; missing ones weigh 1.0).
    fisher_approx: {layer name or class: approximation} (None: the
      default), or a list with one entry per layer with trainable weights
      (depth-first order of `model.layers`). A name must match a layer; a
      class need not (kfac 0.2.x).
    layer_collection: a collection to add to (default: a new one).
    seed: seed of the sampled targets (an int, or a [2] tensor for
      stateless sampling).
    y_pred: the model output the loss is applied to (default: the output of
      the model's last call).
    targets: the data targets (needed by estimation_mode="empirical";
      default: the y that model.fit passed to compute_loss).
    variables: register only the layers owning these variables (default:
      the model's trainable variables); every variable in it is registered,
      unowned ones with the generic fallback.
    warn: callable(key, message) for generic fallbacks (default: a
      UserWarning).
    registration_options: {layer name or class: {option: value}}, extra
      arguments of a convolution's registration: sub_sample_inputs,
      sub_sample_patches, patch_mask; of a DepthwiseConv2D's:
      sub_sample_patches (see docs/convolutions.md).
    average_over_outputs: False (kfac 0.2.x): each loss is registered with
      its loss weight as coefficient, i.e. summed over the outputs of an
      example. True: the coefficient is also divided by the outputs per
      example Keras averages the loss over (entries of an mse or binary
      cross-entropy output, positions of a categorical one), so the
      registered loss is the Keras loss per example (the scale
      Kfac(adaptive=True) uses).

  A cross-entropy with from_logits=False on an output that can leave
  [0, 1] (a linear layer, a pooling, an average) is registered with that
  output as the logits, as kfac 0.2.x did, with a warning that names the
  output and what would be right (the Keras 3 Kfac optimizer raises
  instead: docs/migration.md).

  Returns:
    The LayerCollection (`register_model` also returns the registration
    report).
  """
  return register_model(
      model, loss=loss, loss_weights=loss_weights,
      fisher_approx=fisher_approx, layer_collection=layer_collection,
      seed=seed, y_pred=y_pred, targets=targets, variables=variables,
      warn=warn, registration_options=registration_options,
      average_over_outputs=average_over_outputs, lenient=True)[0]


def _is_layer(obj):
  return keras_flavor.is_instance_by_name(obj, "Layer")


def _calls_of(layer, model, what):
  """The calls of `layer`: recorded in this trace, else its graph node."""
  if tf.executing_eagerly():
    raise layer_registration.no_graph_error(what, getattr(model, "name", layer.name))
  recorder = None
  if model is not None:
    recorder = layer_registration.recorder_for(model)
  else:
    ref = getattr(layer.call, "_kfac_recorder", None)
    recorder = ref() if ref is not None else None
  if recorder is not None and recorder.calls(layer):
    return recorder
  node = layer_registration.latest_node(layer)
  if node is not None and all(
      layer_registration.is_graph_tensor(t)
      for t in tf.nest.flatten(node.output_tensors)):
    return layer_registration.NodeCalls(model)
  if recorder is None:
    raise RegistrationError(
        "Layer %s is not watched and has no graph node: call "
        "kfac.keras.utils.watch(model) on its model before tracing, or pass "
        "model=..." % keras_flavor.layer_path(layer))
  raise RegistrationError("Layer %s was not called in this trace." %
                          keras_flavor.layer_path(layer))


def register_layer(layer_collection, layer, fisher_approx=None, model=None):
  """Registers one Keras layer on `layer_collection` from its call
  recorded in this trace (the layer's model watched, or `model` given) or,
  for tf_keras in a TF1 graph, from its latest graph node.

  `fisher_approx` is an approximation name (or a {name/class: approx} map).
  Returns the report row."""
  what = "kfac.keras.utils.register_layer"
  if isinstance(fisher_approx, str) or fisher_approx is None:
    fisher_approx = {layer.name: fisher_approx} if fisher_approx else None
  plan = layer_registration.plan_layer(layer, fisher_approx)
  if plan is None:
    # kfac 0.2.x: layers without trainable weights register nothing.
    return None
  source = _calls_of(layer, model, what)
  calls = source.calls(layer)
  batch_size = tf.shape(tf.nest.flatten(calls[0].outputs)[0])[0]
  return layer_registration.register_layers(layer_collection, [plan],
                                            source, batch_size)[0]


def register_layers(layer_collection, layers, fisher_approx=None,
                    model=None):
  """register_layer for each of `layers`; returns the report rows."""
  return [register_layer(layer_collection, layer, fisher_approx, model)
          for layer in layers]


# Keyword arguments register_loss forwards to the LayerCollection's method
# (kfac 0.2.x forwarded its **kwargs there).
_REGISTER_KWARGS = ("reuse",)


def register_loss(layer_collection, layer=None, loss=None, prediction=None,
                  targets=None, coeff=1.0, seed=None, name=None,
                  average_over_outputs=False, **kwargs):
  """Registers a Keras loss (name, function or object) on
  `layer_collection`; returns its report line.

  Two forms:
    register_loss(lc, layer, loss, coeff=..., seed=...)  (kfac 0.2.x, also
      with layer= and loss= as keywords) applies `loss` to the output of the
      Keras layer `layer` (its call recorded in this trace, or its latest
      node in a TF1 graph);
    register_loss(lc, loss, prediction) (or loss=..., prediction=...)
      applies it to the tensor `prediction`.
  coeff, seed, name, targets and `reuse` (kfac 0.2.x's keyword arguments of
  the LayerCollection's register methods) go to the registration;
  average_over_outputs as in get_layer_collection."""
  unknown = sorted(set(kwargs) - set(_REGISTER_KWARGS))
  if unknown:
    raise TypeError("register_loss() got unexpected keyword argument(s) %s "
                    "(it takes coeff, seed, name, targets, reuse and "
                    "average_over_outputs)." % ", ".join(unknown))
  if layer is not None and not _is_layer(layer):
    # register_loss(lc, loss, prediction): positions 1 and 2 hold them.
    if loss is not None and prediction is not None:
      raise TypeError("register_loss(layer_collection, loss, prediction): "
                      "prediction given twice (positionally and as "
                      "prediction=).")
    layer, loss, prediction = None, layer, (
        loss if prediction is None else prediction)
  if loss is None:
    raise TypeError("register_loss needs the loss: register_loss("
                    "layer_collection, layer, loss) or register_loss("
                    "layer_collection, loss, prediction).")
  if layer is not None:
    if prediction is not None:
      raise TypeError("register_loss: pass either a layer (its output is "
                      "the prediction) or prediction=, not both.")
    source = _calls_of(layer, None, "kfac.keras.utils.register_loss")
    prediction = source.calls(layer)[-1].outputs
  elif prediction is None:
    raise TypeError("register_loss(layer_collection, loss, prediction): "
                    "prediction is missing (or pass the output layer: "
                    "register_loss(layer_collection, layer, loss)).")
  return loss_registration.register_keras_loss(
      layer_collection, loss, prediction, targets=targets, coeff=coeff,
      seed=seed, name=name, average_over_outputs=average_over_outputs,
      lenient=True,
      **kwargs)


def get_parent(node):
  """The tensor the op producing `node` computes it from (the
  pre-activations behind an activation's output). Raises ValueError if that
  op has several inputs or `node` is not a graph tensor."""
  if not hasattr(node, "op"):
    raise ValueError("%r is not a graph tensor (eager tensors and Keras "
                     "symbolic tensors have no producing op)." % (node,))
  return layer_registration.parent_tensor(node)


def serialize_fisher_approx(fisher_approx):
  """fisher_approx with its layer-class keys as "kfac_class_<Name>" strings
  (a JSON-able form, as kfac 0.2.x stored it); lists are unchanged."""
  if isinstance(fisher_approx, dict):
    return {(k if isinstance(k, str) else _CLASS_NAME_PREFIX + k.__name__): v
            for k, v in fisher_approx.items()}
  return fisher_approx


def _get_verified_dict(container, container_name, layer_names):
  """A {layer name: value} dict from a dict or a list matched with
  `layer_names` (ValueError naming `container_name` when they do not
  match)."""
  return model_args.verified_dict(container, container_name, layer_names)


serialize_loss = keras_loss_fn.serialize_loss
get_loss_fn = keras_loss_fn.get_loss_fn
