"""Registers a Keras loss as K-FAC predictive distributions.

A Keras loss (a string, a loss function or a loss object) maps to:
  mean_squared_error / mse         register_squared_error_loss
  categorical_crossentropy,
  sparse_categorical_crossentropy  register_categorical_predictive_distribution
  binary_crossentropy              register_sigmoid_cross_entropy_loss
The coefficient: K-FAC sums a registered loss over the non-batch entries
of an example and averages its statistics over the batch. Keras averages
the elementwise squared error / Bernoulli losses over every non-batch axis
and the categorical losses over every non-batch axis but the last, then
averages over the batch ("sum_over_batch_size"). With
average_over_outputs=False (kfac 0.2.x, the default of the 0.2.x API) the
coefficient is the loss weight: the loss summed over an example's outputs,
whose curvature is k times Keras's for k outputs per example. With
average_over_outputs=True (the default recipe, Kfac(adaptive=True)) it is
the weight / k: the registered loss is Keras's per-example loss.

The cross-entropies are registered on the logits Keras computes them from
(see `find_logits`): behind a softmax / sigmoid output (the tensor Keras
records on it as `_keras_logits`, or the input of the Softmax / Sigmoid op),
whatever from_logits says, as Keras does; else the prediction itself when
from_logits=True; else (from_logits=False on another output, e.g. an
average of sigmoid outputs) the logits of the probabilities Keras's loss
uses (see probabilities.py), unless the output's ops show that it can
leave [0, 1] (a linear output): that is an error.
"""

import warnings

import numpy as np
import tensorflow as tf

from kfac.python.keras import probabilities
from kfac.python.keras.registration_keys import RegistrationError

_ALIASES = {
    "mse": "mean_squared_error",
    "mean_squared_error": "mean_squared_error",
    "meansquarederror": "mean_squared_error",
    "categorical_crossentropy": "categorical_crossentropy",
    "categoricalcrossentropy": "categorical_crossentropy",
    "sparse_categorical_crossentropy": "sparse_categorical_crossentropy",
    "sparsecategoricalcrossentropy": "sparse_categorical_crossentropy",
    "binary_crossentropy": "binary_crossentropy",
    "binarycrossentropy": "binary_crossentropy",
    "bce": "binary_crossentropy",
}
_ACTIVATION_OP = {
    "categorical_crossentropy": "Softmax",
    "sparse_categorical_crossentropy": "Softmax",
    "binary_crossentropy": "Sigmoid",
}
# Reductions that average the per-element losses over the batch (without
# sample weights, "mean_with_sample_weight" is the mean too). None / "none"
# (Keras then sums the unreduced losses) and "sum" are not: their curvature
# is N times larger.
_REDUCTIONS = ("auto", "sum_over_batch_size", "mean",
               "mean_with_sample_weight")


class LossSpec:
  """What kfac needs to know about one Keras loss."""

  def __init__(self, kind, from_logits=False, reduction="sum_over_batch_size",
               description="", label_smoothing=0.0):
    self.kind = kind
    self.from_logits = from_logits
    self.reduction = reduction
    self.description = description or kind
    self.label_smoothing = label_smoothing


def loss_spec(loss):
  """The LossSpec of a Keras loss, or a RegistrationError naming it."""
  if isinstance(loss, LossSpec):
    return loss
  config = {}
  if isinstance(loss, str):
    name = loss
  elif hasattr(loss, "get_config") and not isinstance(loss, type):
    name = type(loss).__name__
    config = loss.get_config() or {}
    fn = getattr(loss, "fn", None)
    if name == "LossFunctionWrapper" and fn is not None:
      name = getattr(fn, "__name__", name)
  elif callable(loss):
    name = getattr(loss, "__name__", repr(loss))
  else:
    raise RegistrationError("Unsupported loss function: %r (expected a Keras "
                            "loss name, function or object)." % (loss,))
  kind = _ALIASES.get(name.lower())
  if kind is None:
    raise RegistrationError(
        "Unsupported loss function: kfac cannot register the loss %r: "
        "supported losses are mse, "
        "categorical_crossentropy, sparse_categorical_crossentropy and "
        "binary_crossentropy (strings, functions or loss objects). For "
        "another loss, register its predictive distribution yourself on a "
        "LayerCollection (register_*_predictive_distribution) in a custom "
        "training loop." % name)
  reduction = config.get("reduction", "sum_over_batch_size")
  if reduction not in _REDUCTIONS:
    raise RegistrationError(
        "Loss %s has reduction=%r; kfac supports the batch mean "
        "('sum_over_batch_size'), whose curvature scale it knows." %
        (name, reduction))
  axis = config.get("axis", -1)
  if axis not in (-1, None):
    raise RegistrationError("Loss %s with axis=%r: kfac needs the class axis "
                            "to be the last one." % (name, axis))
  if config.get("ignore_class") is not None:
    raise RegistrationError("Loss %s with ignore_class is not supported." %
                            name)
  smoothing = float(config.get("label_smoothing", 0.0) or 0.0)
  if not 0.0 <= smoothing <= 1.0:
    raise RegistrationError("Loss %s has label_smoothing=%r; it must be in "
                            "[0, 1]." % (name, smoothing))
  return LossSpec(kind, bool(config.get("from_logits", False)), reduction,
                  name, smoothing)


def _static_size(shape, what):
  dims = shape.as_list()
  if any(d is None for d in dims):
    raise RegistrationError(
        "kfac needs the non-batch shape of %s to be static, got %s." %
        (what, shape))
  return int(np.prod(dims)) if dims else 1


# How find_logits found the logits (for the registration report).
AS_GIVEN, BEHIND_ACTIVATION, OF_PROBABILITIES = "as given", "behind", "probs"


def find_logits(spec, prediction, lenient=False):
  """(logits, how): the logits the Keras loss `spec` computes its value
  from, and how they were found.

  Keras's cross-entropies (both flavours, backend `_get_logits`) take the
  logits behind a prediction that carries `_keras_logits` (set by Keras's
  softmax / sigmoid) or comes out of a Softmax / Sigmoid op, whatever
  from_logits says (from_logits=True on such a prediction only warns);
  otherwise from_logits=True uses the prediction itself, and
  from_logits=False takes it as probabilities (clipped; normalised over
  the classes by the categorical losses). kfac registers the same logits:
  for probabilities, the logits of the clipped probabilities. A prediction
  whose ops show that it can leave [0, 1] is not a probability: an error;
  `lenient` (kfac 0.2.x's functions, kfac.keras.utils and the graph-mode
  Kfac) registers it as the logits, as kfac 0.2.x did, with a warning."""
  if spec.kind == "mean_squared_error":
    return prediction, AS_GIVEN
  keras_logits = getattr(prediction, "_keras_logits", None)
  if keras_logits is not None:
    return tf.convert_to_tensor(keras_logits), BEHIND_ACTIVATION
  expected = _ACTIVATION_OP[spec.kind]
  op_type = getattr(getattr(prediction, "op", None), "type", None)
  if op_type == expected:
    return prediction.op.inputs[0], BEHIND_ACTIVATION
  if spec.from_logits:
    return prediction, AS_GIVEN
  bounds = probabilities.value_range(prediction)
  if bounds is not None and not probabilities.is_within_probabilities(
      bounds):
    problem = (
        "Loss %s with from_logits=False takes the model output %s as "
        "probabilities, but it comes from a %s op and can take values in "
        "[%g, %g], outside [0, 1] (kfac follows the output's ops back to "
        "find that out)." % (spec.description, getattr(prediction, "name", ""),
                             op_type, bounds[0], bounds[1]))
    right = ("Use from_logits=True with a linear last layer, or end the "
             "model with a %s activation." % expected.lower())
    if not lenient:
      raise RegistrationError(problem + " " + right)
    warnings.warn(
        problem + " kfac registers that output as the logits, as kfac "
        "0.2.x did, so the curvature is of another loss than the one Keras "
        "trains on. " + right, UserWarning, stacklevel=2)
    return prediction, AS_GIVEN
  return (probabilities.probability_logits(spec.kind, prediction),
          OF_PROBABILITIES)


def _targets(spec, targets, logits):
  """Targets in the form the registered loss expects (for empirical).

  With label_smoothing the targets are smoothed as Keras smooths them
  (categorical: y (1 - s) + s / classes, registered as soft one-hot
  targets; binary: y (1 - s) + s / 2), so that the registered loss on its
  targets is the loss Keras trains on. (The Fisher and the GGN of a
  softmax / sigmoid output do not depend on the targets; only
  estimation_mode="empirical" and evaluations of the registered loss on
  the data use them.)"""
  if targets is None:
    return None
  targets = tf.convert_to_tensor(targets)
  if spec.kind == "sparse_categorical_crossentropy":
    if targets.shape.rank == logits.shape.rank:
      targets = tf.squeeze(targets, -1)
    return tf.cast(targets, tf.int32)
  smoothing = spec.label_smoothing
  if spec.kind == "categorical_crossentropy":
    if not smoothing:
      return tf.argmax(targets, axis=-1, output_type=tf.int32)
    targets = tf.cast(targets, logits.dtype)
    classes = tf.cast(tf.shape(logits)[-1], logits.dtype)
    return targets * (1.0 - smoothing) + smoothing / classes
  targets = tf.cast(targets, logits.dtype)
  if smoothing and spec.kind == "binary_crossentropy":
    targets = targets * (1.0 - smoothing) + 0.5 * smoothing
  return targets


def register_keras_loss(lc, loss, prediction, targets=None,
                        coeff=1.0, seed=None, name=None,
                        average_over_outputs=False, lenient=False,
                        **register_kwargs):
  """Registers `loss` applied to `prediction` (the model output) on lc.

  The registered coefficient is `coeff`, divided by the number of outputs
  per example Keras averages the loss over when `average_over_outputs`
  (see the module doc). `lenient`: as find_logits's. `register_kwargs`
  (e.g. reuse) go to the LayerCollection's register method. Returns a one-line description for
  the registration report."""
  spec = loss_spec(loss)
  prediction = tf.convert_to_tensor(prediction)
  if prediction.shape.rank is None or prediction.shape.rank < 2:
    raise RegistrationError(
        "kfac needs model outputs of shape [batch, ...] (rank >= 2) for loss "
        "%s, got %s." % (spec.description, prediction.shape))
  logits, how = find_logits(spec, prediction, lenient=lenient)
  targets = _targets(spec, targets, logits)
  if spec.kind in ("mean_squared_error", "binary_crossentropy"):
    # Elementwise losses: one distribution per output entry, averaged by
    # Keras over the entries of an example.
    mse = spec.kind == "mean_squared_error"
    size = _static_size(logits.shape[1:],
                        "the prediction" if mse else "the logits")
    # [batch, size] predictions are registered as they are (the tensor of
    # the model, as kfac 0.2.x did); others flattened to [batch, size].
    flat = (logits if logits.shape.rank == 2 else
            tf.reshape(logits, [-1, size]))
    if targets is not None:
      targets = tf.reshape(targets, [-1, size])
    register = (lc.register_squared_error_loss if mse else
                lc.register_sigmoid_cross_entropy_loss)
    coeff = coeff / size if average_over_outputs else coeff
    register(flat, seed=seed, targets=targets, coeff=coeff, name=name,
             **register_kwargs)
    what = "%s %s, coeff %g" % (
        "squared error on" if mse else "sigmoid cross-entropy on logits",
        logits.shape, coeff)
  else:
    positions = _static_size(logits.shape[1:-1], "the logits")
    coeff = coeff / positions if average_over_outputs else coeff
    lc.register_softmax_cross_entropy_loss(
        logits, seed=seed, targets=targets, coeff=coeff, name=name,
        **register_kwargs)
    what = "categorical on logits %s, coeff %g" % (logits.shape, coeff)
  if how == BEHIND_ACTIVATION:
    source = " (logits found behind the %s)" % (
        _ACTIVATION_OP[spec.kind].lower())
  elif how == OF_PROBABILITIES:
    source = " (logits of the output's probabilities)"
  else:
    source = ""
  return "%s: %s%s" % (spec.description, what, source)


def flatten_outputs(loss, loss_weights, y_pred, output_names=None):
  """Pairs (loss, weight, prediction, index) for single or multi outputs."""
  if isinstance(y_pred, dict):
    keys = sorted(y_pred)
    preds = [y_pred[k] for k in keys]
    losses = ([loss[k] for k in keys] if isinstance(loss, dict)
              else [loss] * len(keys))
    weights = ([loss_weights.get(k, 1.0) for k in keys]
               if isinstance(loss_weights, dict) else
               [1.0] * len(keys) if loss_weights is None else loss_weights)
  elif isinstance(y_pred, (list, tuple)):
    preds = list(y_pred)
    if isinstance(loss, dict):
      if output_names is None:
        raise RegistrationError("A dict of losses needs the model's output "
                                "names.")
      losses = [loss[n] for n in output_names]
    elif isinstance(loss, (list, tuple)):
      losses = list(loss)
    else:
      losses = [loss] * len(preds)
    if isinstance(loss_weights, dict):
      weights = [loss_weights.get(n, 1.0) for n in output_names]
    else:
      weights = [1.0] * len(preds) if loss_weights is None else list(
          loss_weights)
  else:
    preds = [y_pred]
    losses = [loss[0] if isinstance(loss, (list, tuple)) and len(loss) == 1
              else loss]
    weights = [1.0 if loss_weights is None else (
        loss_weights[0] if isinstance(loss_weights, (list, tuple))
        else loss_weights)]
  if not len(losses) == len(preds) == len(weights):
    raise RegistrationError(
        "The model has %d outputs but %d losses and %d loss weights were "
        "given." % (len(preds), len(losses), len(weights)))
  return list(zip(losses, weights, preds))
