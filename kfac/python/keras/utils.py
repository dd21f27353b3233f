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
recorded during the model's call in the current trace (see layer_recorder)
and the loss on the model's output. A tf_keras model built in a TF1 graph
(kfac 0.2.x's usage) needs neither watch nor trace: its layers' graph nodes
hold the tensors its training function uses (see node_calls). Keras 3 and
eagerly built tf_keras models keep symbolic tensors there, so outside a
trace they raise an error naming the traced usage.
`register_model` is get_layer_collection returning the registration report
too; `register_layer` / `register_loss` do one layer / one loss on a
collection of your own; `get_loss_fn` makes the model's loss a function of
a batch (for damping adaptation).
"""

import warnings

import tensorflow as tf

from kfac.python.keras import keras_flavor
from kfac.python.keras import keras_loss_fn
from kfac.python.keras import layer_recorder
from kfac.python.keras import layer_registration
from kfac.python.keras import loss_registration
from kfac.python.keras import model_args
from kfac.python.keras import node_calls
from kfac.python.ops.collection import layer_collection as lc_lib

RegistrationError = layer_registration.RegistrationError
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


def watch(model):
  """Installs the recording of layer inputs / pre-activations on `model`
  (idempotent). Calls of the model traced afterwards are usable."""
  recorder = layer_recorder.recorder_for(model)
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


def _no_graph_error(what, model_name):
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
    raise _no_graph_error(what, model.name)
  recorder = watch(model)
  if _has_recorded_calls(recorder, model):
    return recorder, True
  if node_calls.graph_nodes_usable(model):
    return node_calls.NodeCalls(model), False
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
           layer_registration.variable_name(v) for v in variables}
  orphans = [v for v in tf_vars if v.ref() not in covered]
  if not orphans:
    return
  orphan_names = ", ".join(names.get(v.ref(), v.name) for v in orphans)
  block = lc.register_generic(
      orphans[0] if len(orphans) == 1 else tuple(orphans), batch_size,
      approx=layer_registration.GENERIC_FALLBACK)
  message = ("kfac: variables %s belong to no layer of %r; registered with "
             "the generic %r approximation." %
             (orphan_names, model.name,
              layer_registration.GENERIC_FALLBACK))
  (warn or (lambda k, m: warnings.warn(m, stacklevel=3)))("orphans", message)
  rows.append(layer_registration.Row(
      model.name, "(model)", "NaiveDiagonalFB",
      layer_registration.GENERIC_FALLBACK,
      orphan_names, 0, "fallback: no owning layer", (block,)))


def register_model(model, loss=None, loss_weights=None, fisher_approx=None,
                   layer_collection=None, seed=None, y_pred=None,
                   targets=None, variables=None, warn=None,
                   registration_options=None, average_over_outputs=False,
                   default_conv_options=None, default_approx=None):
  """Registers `model`'s layers and loss(es) on a LayerCollection and
  returns (layer_collection, report), report being the text of the
  registration report. Arguments as get_layer_collection's;
  `default_conv_options` and `default_approx` as
  layer_registration.register_layers's."""
  lc, rows, loss_lines = register_model_rows(
      model, loss=loss, loss_weights=loss_weights,
      fisher_approx=fisher_approx, layer_collection=layer_collection,
      seed=seed, y_pred=y_pred, targets=targets, variables=variables,
      warn=warn, registration_options=registration_options,
      average_over_outputs=average_over_outputs,
      default_conv_options=default_conv_options,
      default_approx=default_approx)
  return lc, layer_registration.format_report(rows, loss_lines)


def register_model_rows(model, loss=None, loss_weights=None,
                        fisher_approx=None, layer_collection=None, seed=None,
                        y_pred=None, targets=None, variables=None, warn=None,
                        registration_options=None,
                        average_over_outputs=False,
                        default_conv_options=None, default_approx=None):
  """register_model, returning (layer_collection, report rows, loss lines)
  (registration_report.format_report makes the text; with the memory
  column once an optimizer has made the collection's factors)."""
  what = "kfac.keras.utils.get_layer_collection"
  source, recorded = _source_of_calls(model, what)
  lc = layer_collection or lc_lib.LayerCollection()
  fisher_approx = model_args.fisher_approx_dict(fisher_approx, model)
  layer_registration.check_fisher_approx(fisher_approx, model)
  layer_registration.check_registration_options(registration_options, model)
  if variables is None:
    variables = model.trainable_variables
  tf_vars = [keras_flavor.unwrap_variable(v) for v in variables]
  trainable = {v.ref() for v in tf_vars}
  plans = layer_registration.plan_layers(model, fisher_approx, trainable)

  if recorded:
    pairs, targets, sample_weight = _recorded_losses(
        source, model, loss, loss_weights, y_pred, targets)
  else:
    pairs, sample_weight = _node_losses(model, loss, loss_weights, y_pred), None
  if pairs:
    first = tf.nest.flatten(pairs[0][2])[0]
  else:
    first = tf.nest.flatten(node_calls.node_outputs(model.layers[-1]))[0]
  batch_size = tf.shape(first)[0]

  rows = layer_registration.register_layers(
      lc, plans, source, batch_size, warn,
      registration_options=registration_options,
      default_conv_options=default_conv_options,
      default_approx=default_approx)
  _register_generic_orphans(lc, model, variables, tf_vars, plans, batch_size,
                            warn, rows)

  loss_lines = register_loss_pairs(lc, pairs, targets, seed,
                                   average_over_outputs)
  if sample_weight is not None and warn is not None:
    warn("sample_weight", "kfac: sample weights weight the gradient but not "
         "the curvature statistics (K-FAC's Fisher is over the model's "
         "predictive distribution).")
  return lc, rows, loss_lines


def register_loss_pairs(lc, pairs, targets, seed=None,
                        average_over_outputs=False):
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
        seed=_seed_for(seed, i), average_over_outputs=average_over_outputs))
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
    preds = node_calls.output_tensors(model, list(losses))
  return [(one_loss, weights.get(name, 1.0), preds[name])
          for name, one_loss in losses.items()]


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

  Returns:
    The LayerCollection (`register_model` also returns the registration
    report).
  """
  return register_model(
      model, loss=loss, loss_weights=loss_weights,
      fisher_approx=fisher_approx, layer_collection=layer_collection,
      seed=seed, y_pred=y_pred, targets=targets, variables=variables,
      warn=warn, registration_options=registration_options,
      average_over_outputs=average_over_outputs)[0]


def _is_layer(obj):
  return keras_flavor.is_instance_by_name(obj, "Layer")


def _calls_of(layer, model, what):
  """The calls of `layer`: recorded in this trace, else its graph node."""
  if tf.executing_eagerly():
    raise _no_graph_error(what, getattr(model, "name", layer.name))
  recorder = None
  if model is not None:
    recorder = layer_recorder.recorder_for(model)
  else:
    ref = getattr(layer.call, "_kfac_recorder", None)
    recorder = ref() if ref is not None else None
  if recorder is not None and recorder.calls(layer):
    return recorder
  node = node_calls.latest_node(layer)
  if node is not None and all(
      node_calls._is_graph_tensor(t)  # pylint: disable=protected-access
      for t in tf.nest.flatten(node.output_tensors)):
    return node_calls.NodeCalls(model)
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
      **kwargs)


def get_parent(node):
  """The tensor the op producing `node` computes it from (the
  pre-activations behind an activation's output). Raises ValueError if that
  op has several inputs or `node` is not a graph tensor."""
  if not hasattr(node, "op"):
    raise ValueError("%r is not a graph tensor (eager tensors and Keras "
                     "symbolic tensors have no producing op)." % (node,))
  return node_calls.parent_tensor(node)


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
