"""The losses (predictive distributions) of a LayerCollection: the
`LossRegistry` part (the registered losses by name, one per tower, with
their coefficients; their evaluation) and the functions that build each
kind of loss from a model's outputs, with their checks. LayerCollection's
register_*_loss / register_*_predictive_distribution methods combine the
two.
"""

import collections
import math

import tensorflow as tf

from kfac.python.ops import losses as lf
from kfac.python.ops.layers.base import registration as registration_base
from kfac.python.ops.layers.base.registration import RegistrationKeyError
from kfac.python.ops.tensors import utils


class LossRegistry:
  """The registered losses of one collection.

  `by_name`: name -> [loss per tower] (in registration order); `coeffs`:
  loss -> its coefficient; `colocation_ops`: loss -> the tensor it was
  registered on (kfac 0.2.x's LayerCollection.loss_coeffs and
  loss_colocation_ops).
  """

  def __init__(self):
    self.by_name = collections.OrderedDict()
    self.coeffs = {}
    self.colocation_ops = {}

  @property
  def losses(self):
    return [loss for towers in self.by_name.values() for loss in towers]

  @property
  def towers_by_loss(self):
    return [tuple(towers) for towers in self.by_name.values()]

  def losses_with_coeffs(self):
    return [(loss, self.coeffs[loss])
            for towers in self.by_name.values() for loss in towers]

  def register(self, loss, base_name, name, coeff, reuse, colocation=None):
    """Registers `loss` under `name` (default: `base_name`, made unique);
    with reuse, as a new tower of the loss of that name."""
    mode = registration_base.reuse_mode(reuse)
    if name is None:
      if mode is True:
        raise RegistrationKeyError(
            "reuse=True adds a tower to a loss registered before: pass that "
            "loss's name= too (reuse may also come from a reusing "
            "tf.compat.v1.variable_scope).")
      name = registration_base.unique_name(base_name, set(self.by_name))
    if name in self.by_name:
      if not mode:
        raise RegistrationKeyError(
            "A loss named %r is already registered. Pass reuse=True to add "
            "a tower to it, or use another name." % name)
      towers = self.by_name[name]
      first = self.coeffs[towers[0]]
      if (utils.is_python_number(first) and utils.is_python_number(coeff)
          and first != coeff):
        raise ValueError("The loss %r was registered with coeff=%s; a tower "
                         "added with reuse must use the same coeff, got %s."
                         % (name, first, coeff))
      towers.append(loss)
    elif mode is True:
      raise RegistrationKeyError(
          "reuse=True adds a tower to the loss named %r, but no loss of that "
          "name was registered. Register it without reuse first (reuse may "
          "also come from a reusing tf.compat.v1.variable_scope)." % name)
    else:
      self.by_name[name] = [loss]
    self.coeffs[loss] = coeff
    self.colocation_ops[loss] = colocation
    return loss

  def evaluate(self, target_mode="data", coeff_mode="regular", seeds=None):
    """LayerCollection.eval_losses."""
    if target_mode not in ("data", "sample"):
      raise ValueError("Unknown target_mode %r; expected 'data' or 'sample'."
                       % (target_mode,))
    if coeff_mode not in ("regular", "sqrt", "off"):
      raise ValueError("Unknown coeff_mode %r; expected 'regular', 'sqrt' or "
                       "'off'." % (coeff_mode,))
    out = []
    for i, (loss, coeff) in enumerate(self.losses_with_coeffs()):
      seed = None
      if seeds is not None and getattr(loss, "_default_seed", 0) is None:
        seed = seeds(i)
      value = loss.evaluate() if target_mode == "data" else (
          loss.evaluate_on_sample(seed))
      if coeff_mode == "regular":
        value = value * utils.cast(coeff, value.dtype)
      elif coeff_mode == "sqrt":
        value = value * tf.sqrt(utils.cast(coeff, value.dtype))
      out.append(value)
    return out


# ------------------------------------------------------------ the losses
def check_coeff(coeff):
  if utils.is_python_number(coeff) and coeff < 0:
    raise ValueError("Loss coeff must be non-negative, got %s." % coeff)


def _check_targets_like(targets, prediction):
  if targets is not None and not targets.shape.is_compatible_with(
      prediction.shape):
    raise ValueError("Targets of shape %s do not match predictions of "
                     "shape %s." % (targets.shape, prediction.shape))


def categorical(logits, seed, targets, coeff):
  """The categorical loss over the last axis of `logits`; `targets` are
  integer labels, or one-hot rows (same shape as logits)."""
  check_coeff(coeff)
  if targets is not None and not utils.is_tensor_or_variable(targets):
    targets = tf.convert_to_tensor(targets)  # numpy arrays, lists
  onehot = targets is not None and targets.shape.rank == logits.shape.rank
  if targets is not None:
    expected = logits.shape if onehot else logits.shape[:-1]
    if not targets.shape.is_compatible_with(expected):
      raise ValueError("Targets of shape %s do not fit logits of shape %s "
                       "(expected integer labels of shape %s or one-hot "
                       "rows of shape %s)." % (targets.shape, logits.shape,
                                               logits.shape[:-1],
                                               logits.shape))
  if onehot:
    return lf.OnehotCategoricalLogitsNegativeLogProbLoss(logits, targets,
                                                         seed)
  return lf.CategoricalLogitsNegativeLogProbLoss(logits, targets, seed)


def normal(mean, var, seed, targets, coeff):
  """The Gaussian loss with mean `mean` and fixed variance `var`."""
  check_coeff(coeff)
  if utils.is_python_number(var) and var <= 0:
    raise ValueError("var must be positive, got %s." % var)
  _check_targets_like(targets, mean)
  return lf.NormalMeanNegativeLogProbLoss(mean, var, targets, seed)


def bernoulli(logits, seed, targets, coeff):
  """Independent Bernoullis with `logits` (targets in [0, 1])."""
  check_coeff(coeff)
  _check_targets_like(targets, logits)
  return lf.MultiBernoulliNegativeLogProbLoss(logits, targets, seed)


def normal_mean_variance(mean, variance, seed, targets, coeff):
  """The Gaussian loss with learned mean and variance."""
  check_coeff(coeff)
  _check_targets_like(targets, mean)
  return lf.NormalMeanVarianceNegativeLogProbLoss(mean, variance, targets,
                                                  seed)


def sqrt_coeff(coeff, dtype):
  if utils.is_python_number(coeff):
    return tf.constant(math.sqrt(coeff), dtype)
  return tf.sqrt(utils.cast(coeff, dtype))
