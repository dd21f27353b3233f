"""A model's Keras loss as a function of a batch (kfac.keras.utils.get_loss_fn).

K-FAC's damping adaptation (and a custom training loop) needs the loss of a
batch `(x, y)` as a function: `get_loss_fn(model, loss)` returns
`loss_fn((x, y), prediction=None)`, the reduced Keras loss(es) of the model
on the batch (weighted per output) plus the model's regularisation losses
(`model.losses`). Works with Keras 3 and tf_keras, in a TF1 graph, in a
tf.function and eagerly. Masks and sample weights are not applied.

`serialize_loss` turns a loss argument (a name, a Keras loss function or
object, or a list / dict of them) into its JSON-able form (names for the
built-in loss functions, Keras configs for loss objects).
"""

import importlib

import tensorflow as tf

from kfac.python.keras import keras_flavor


def _losses_module(obj=None):
  """The `losses` module of the Keras flavour `obj` (a model, a loss) comes
  from, else of the active flavour."""
  module = getattr(type(obj), "__module__", "") or ""
  if obj is not None and not isinstance(obj, (str, dict)):
    if callable(obj) and not hasattr(obj, "get_config"):
      module = getattr(obj, "__module__", "") or ""
    root = module.split(".")[0]
    if root in ("tf_keras", "keras"):
      return importlib.import_module(root).losses
  return keras_flavor.keras_module().losses


def _serialize_one(loss):
  if isinstance(loss, str):
    return loss
  if not isinstance(loss, type) and not hasattr(loss, "get_config"):
    # A loss function: its registered name (what Keras deserialises).
    name = getattr(loss, "__name__", None)
    if name is not None:
      try:
        if _losses_module(loss).get(name) is not None:
          return name
      except (ValueError, TypeError):
        pass
  return _losses_module(loss).serialize(loss)


def serialize_loss(loss):
  """The serialised form of a Keras loss argument (see module doc). Empty
  values and strings are returned as they are."""
  if not loss or isinstance(loss, str):
    return loss
  if isinstance(loss, dict):
    return {k: _serialize_one(v) for k, v in loss.items()}
  if isinstance(loss, (list, tuple)):
    return [_serialize_one(v) for v in loss]
  return _serialize_one(loss)


def _deserialize_one(loss, model):
  if isinstance(loss, (str, dict)):
    return _losses_module(model).get(loss)
  if not callable(loss):
    raise ValueError("A loss must be a Keras loss name, function or object, "
                     "got %r." % (loss,))
  return loss


def _output_names(model):
  names = getattr(model, "output_names", None)
  if not names:
    raise ValueError("A dict of losses / loss weights needs the model's "
                     "output names; model %r has none (build it first)." %
                     model.name)
  return list(names)


def get_loss_fn(model, loss, training=None, loss_weights=None,
                reduce_fn=tf.reduce_mean, name="loss"):
  """A function computing the model's loss on a batch.

  Args:
    model: the Keras model (Keras 3 or tf_keras).
    loss: a Keras loss (name, function, object or serialised config), or for
      a model with several outputs a list of them in the order of
      `model.outputs` or a dict keyed by `model.output_names`.
    training: passed as `training=` to the model when it is called (None:
      the model is called without it).
    loss_weights: per-output weights (a list, or a dict keyed by output
      name where a missing output weighs 1.0).
    reduce_fn: reduces each per-example loss tensor (default: the mean; use
      the identity for losses that reduce themselves).
    name: name scope of the loss ops.

  Returns:
    loss_fn(inputs, prediction=None): `inputs` is (x, y); `prediction`, the
    model's output on x, is computed when not given. Returns the total
    loss: the weighted sum of the reduced losses plus `model.losses`.
  """
  if isinstance(loss, dict) and not _is_config(loss):
    loss = [loss[n] for n in _output_names(model)]
  if isinstance(loss, (list, tuple)):
    loss = [_deserialize_one(l, model) for l in loss]
  else:
    loss = _deserialize_one(loss, model)
  if isinstance(loss_weights, dict):
    loss_weights = [loss_weights.get(n, 1.0) for n in _output_names(model)]

  def loss_fn(inputs, prediction=None):
    """The total loss of the model on inputs = (x, y)."""
    with tf.name_scope(name):
      x, y = inputs
      if prediction is None:
        prediction = (model(x) if training is None else
                      model(x, training=training))
      if isinstance(prediction, dict):
        prediction = [prediction[n] for n in _output_names(model)]
      if isinstance(prediction, (list, tuple)):
        fns = loss if isinstance(loss, list) else [loss] * len(prediction)
        targets = list(y) if isinstance(y, (list, tuple)) else [
            y[n] for n in _output_names(model)]
        if not len(fns) == len(prediction) == len(targets):
          raise ValueError(
              "The model has %d outputs but %d losses and %d targets were "
              "given." % (len(prediction), len(fns), len(targets)))
        reduced = [reduce_fn(fn(y_true=t, y_pred=p))
                   for fn, p, t in zip(fns, prediction, targets)]
        if loss_weights:
          reduced = [l * w for l, w in zip(reduced, loss_weights)]
        total = tf.add_n(reduced)
      else:
        fn = loss[0] if isinstance(loss, list) and len(loss) == 1 else loss
        total = reduce_fn(fn(y_true=y, y_pred=prediction))
      extra = list(model.losses)
      if extra:
        total += tf.add_n([tf.cast(l, total.dtype) for l in extra])
    return total

  return loss_fn


def _is_config(loss):
  """A serialised Keras loss object ({"class_name": ..., "config": ...})."""
  return "class_name" in loss and "config" in loss
