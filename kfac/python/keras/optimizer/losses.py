"""The losses the Keras Kfac optimizer registers: those given to model.compile,
and whether two loss (or loss-weight) structures say the same thing."""

from kfac.python.keras import loss_registration


def compiled_loss(model):
  """(loss, loss_weights) given to model.compile, None where none was."""
  loss = getattr(model, "loss", None)
  if isinstance(loss, dict) and not loss:  # tf_keras: compiled without one
    loss = None
  container = (getattr(model, "_compile_loss", None) or  # Keras 3
               getattr(model, "compiled_loss", None))    # tf_keras
  weights = getattr(container, "_user_loss_weights", None)
  return loss, weights


def describe(loss):
  if isinstance(loss, str):
    return repr(loss)
  if isinstance(loss, (list, tuple)):
    return "[%s]" % ", ".join(describe(l) for l in loss)
  if isinstance(loss, dict):
    return "{%s}" % ", ".join("%r: %s" % (k, describe(v))
                              for k, v in sorted(loss.items()))
  try:
    spec = loss_registration.loss_spec(loss)
  except Exception:  # pylint: disable=broad-except
    return repr(loss)
  smoothing = (", label_smoothing=%g" % spec.label_smoothing
               if spec.label_smoothing else "")
  return "%s(from_logits=%s%s)" % (spec.description, spec.from_logits,
                                   smoothing)


def same_losses(a, b):
  """Whether two loss structures name the same losses (spellings aside:
  "mse", "mean_squared_error" and keras.losses.MeanSquaredError() agree)."""
  if isinstance(a, dict) or isinstance(b, dict):
    if not (isinstance(a, dict) and isinstance(b, dict)) or (
        sorted(a) != sorted(b)):
      return False
    return all(same_losses(a[k], b[k]) for k in a)
  if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
    a = list(a) if isinstance(a, (list, tuple)) else [a]
    b = list(b) if isinstance(b, (list, tuple)) else [b]
    return len(a) == len(b) and all(same_losses(x, y) for x, y in zip(a, b))
  if a is b:
    return True
  try:
    sa, sb = loss_registration.loss_spec(a), loss_registration.loss_spec(b)
  except Exception:  # pylint: disable=broad-except
    return False
  return ((sa.kind, sa.from_logits, sa.reduction, sa.label_smoothing) ==
          (sb.kind, sb.from_logits, sb.reduction, sb.label_smoothing))


def same_weights(a, b):
  if isinstance(a, dict) or isinstance(b, dict):
    return (isinstance(a, dict) and isinstance(b, dict) and
            sorted(a) == sorted(b) and
            all(float(a[k]) == float(b[k]) for k in a))
  a = list(a) if isinstance(a, (list, tuple)) else [a]
  b = list(b) if isinstance(b, (list, tuple)) else [b]
  return len(a) == len(b) and all(float(x) == float(y) for x, y in zip(a, b))
