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
and the loss on the model's output; `register_layer` / `register_loss` do one
layer / one loss on a collection of your own.
"""

import warnings

import tensorflow as tf

from kfac.python.keras import keras_flavor
from kfac.python.keras import layer_recorder
from kfac.python.keras import layer_registration
from kfac.python.keras import loss_registration
from kfac.python.ops import layer_collection as lc_lib

RegistrationError = layer_registration.RegistrationError


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


def _require_trace(what):
  if tf.executing_eagerly():
    raise RuntimeError(
        "%s needs the tensors of a traced training step: call it inside a "
        "tf.function (model.fit traces its train step unless "
        "run_eagerly=True, which K-FAC does not support)." % what)


def _seed_for(seed, index):
  """A per-loss seed: None, an int, or a stateless [2] seed tensor."""
  if seed is None:
    return None
  if isinstance(seed, (tf.Tensor, tf.Variable)):
    return seed + tf.constant([index * 1000003, 0], seed.dtype)
  return seed + index


def get_layer_collection(model, loss=None, loss_weights=None,
                         layer_collection=None, fisher_approx=None, seed=None,
                         y_pred=None, targets=None, variables=None,
                         warn=None, registration_options=None):
  """Registers `model`'s layers and loss on a LayerCollection.

  Args:
    model: a Keras model (Keras 3 or tf_keras) whose call was traced in the
      current graph after `watch(model)` (the Kfac optimizer watches its
      model when it is created).
    loss: the Keras loss(es) of the model (default: `model.loss`).
    loss_weights: per-output coefficients of the losses.
    layer_collection: a collection to add to (default: a new one).
    fisher_approx: {layer name or class: approximation}.
    seed: seed of the sampled targets (an int, or a [2] tensor for
      stateless sampling).
    y_pred: the model output the loss is applied to (default: the output of
      the model's last call in this trace, or the y_pred of compute_loss).
    targets: the data targets (needed by estimation_mode="empirical";
      default: the y that model.fit passed to compute_loss).
    variables: register only the layers owning these variables (default:
      the model's trainable variables); every variable in it is registered,
      unowned ones with the generic fallback.
    warn: callable(key, message) for generic fallbacks (default: a
      UserWarning).
    registration_options: {layer name or class: {option: value}}, extra
      arguments of a convolution's registration: sub_sample_inputs,
      sub_sample_patches, patch_mask (see docs/convolutions.md).

  Returns:
    (layer_collection, report): report is the text of the registration
    report.
  """
  _require_trace("kfac.keras.utils.get_layer_collection")
  recorder = watch(model)
  lc = layer_collection or lc_lib.LayerCollection()
  layer_registration.check_fisher_approx(fisher_approx, model)
  layer_registration.check_registration_options(registration_options, model)
  if variables is None:
    variables = model.trainable_variables
  tf_vars = [keras_flavor.unwrap_variable(v) for v in variables]
  trainable = {v.ref() for v in tf_vars}
  plans = layer_registration.plan_layers(model, fisher_approx, trainable)

  loss_args = recorder.loss_args() or {}
  if y_pred is None:
    y_pred = loss_args.get("y_pred")
  if y_pred is None:
    y_pred = recorder.model_outputs()
  if y_pred is None:
    raise RegistrationError(
        "No call of model %r was recorded in this trace: call the model "
        "inside the traced step after creating the Kfac optimizer (or after "
        "kfac.keras.utils.watch(model))." % model.name)
  if targets is None:
    targets = loss_args.get("y")
  if loss is None:
    loss = getattr(model, "loss", None)
    if loss is None:
      raise RegistrationError(
          "No loss: pass loss=... to Kfac / get_layer_collection, or compile "
          "the model with a loss.")
  first = tf.nest.flatten(y_pred)[0]
  batch_size = tf.shape(first)[0]

  rows = layer_registration.register_layers(
      lc, plans, recorder, batch_size, warn,
      registration_options=registration_options)
  covered = {p.ref() for plan in plans for p in plan.params}
  orphans = [v for v in tf_vars if v.ref() not in covered]
  if orphans:
    lc.register_generic(orphans[0] if len(orphans) == 1 else tuple(orphans),
                        batch_size,
                        approx=layer_registration.GENERIC_FALLBACK)
    message = ("kfac: variables %s belong to no layer of %r; registered with "
               "the generic %r approximation." %
               (", ".join(v.name for v in orphans), model.name,
                layer_registration.GENERIC_FALLBACK))
    (warn or (lambda k, m: warnings.warn(m, stacklevel=2)))(
        "orphans", message)
    rows.append(layer_registration.Row(
        model.name, "(model)", "NaiveDiagonalFB",
        layer_registration.GENERIC_FALLBACK,
        ", ".join(v.name for v in orphans), 0, "fallback: no owning layer"))

  output_names = getattr(model, "output_names", None)
  pairs = loss_registration.flatten_outputs(loss, loss_weights, y_pred,
                                            output_names)
  target_list = ([None] * len(pairs) if targets is None else
                 tf.nest.flatten(targets) if len(pairs) > 1 else [targets])
  if len(target_list) != len(pairs):
    target_list = [None] * len(pairs)
  loss_lines = []
  for i, ((one_loss, weight, pred), target) in enumerate(
      zip(pairs, target_list)):
    loss_lines.append(loss_registration.register_keras_loss(
        lc, one_loss, pred, targets=target, coeff=weight,
        seed=_seed_for(seed, i)))
  sample_weight = loss_args.get("sample_weight")
  if sample_weight is not None and warn is not None:
    warn("sample_weight", "kfac: sample weights weight the gradient but not "
         "the curvature statistics (K-FAC's Fisher is over the model's "
         "predictive distribution).")
  report = layer_registration.format_report(rows, loss_lines)
  return lc, report


def register_layer(layer_collection, layer, fisher_approx=None,
                   model=None):
  """Registers one Keras layer from its call recorded in this trace.

  `fisher_approx` is an approximation name (or a {name/class: approx} map).
  The layer must be watched (through `watch(model)` on a model holding it,
  or `model` given here) and called in the current trace."""
  _require_trace("kfac.keras.utils.register_layer")
  if isinstance(fisher_approx, str):
    fisher_approx = {layer.name: fisher_approx}
  recorder = layer_recorder.recorder_for(model) if model is not None else (
      _recorder_of(layer))
  plan = layer_registration.plan_layer(layer, fisher_approx)
  if plan is None:
    raise RegistrationError("Layer %s has no trainable parameters." %
                            keras_flavor.layer_path(layer))
  calls = recorder.calls(layer)
  if not calls:
    raise RegistrationError("Layer %s was not called in this trace." %
                            keras_flavor.layer_path(layer))
  batch_size = tf.shape(tf.nest.flatten(calls[0].outputs)[0])[0]
  return layer_registration.register_layers(layer_collection, [plan],
                                            recorder, batch_size)[0]


def _recorder_of(layer):
  ref = getattr(layer.call, "_kfac_recorder", None)
  recorder = ref() if ref is not None else None
  if recorder is None:
    raise RegistrationError(
        "Layer %s is not watched: call kfac.keras.utils.watch(model) on its "
        "model before tracing, or pass model=..." %
        keras_flavor.layer_path(layer))
  return recorder


def register_loss(layer_collection, loss, prediction, targets=None,
                  coeff=1.0, seed=None, name=None):
  """Registers a Keras loss (string, function or object) applied to
  `prediction`; returns its report line."""
  return loss_registration.register_keras_loss(
      layer_collection, loss, prediction, targets=targets, coeff=coeff,
      seed=seed, name=name)
