"""Registration of the losses (predictive distributions) on the
LayerCollection, and their evaluation.

The mixin's methods run on a `LayerCollection`: the core sets up
`self._loss_dict` (name -> [loss per tower]), `self.loss_coeffs` and
`self.loss_colocation_ops`, and provides `self._check_not_finalized()` and
`self._unique(base, used)`.
"""

import math

import tensorflow as tf

from kfac.python.ops import losses as lf
from kfac.python.ops.layers.base import registration as registration_base
from kfac.python.ops.layers.base.registration import RegistrationKeyError
from kfac.python.ops.layers.base.registration import VARIABLE_SCOPE
from kfac.python.ops.tensors import utils


class LossRegistrationMixin:
  """LayerCollection methods; see the module docstring."""

  @property
  def losses(self):
    return [loss for towers in self._loss_dict.values() for loss in towers]

  @property
  def towers_by_loss(self):
    return [tuple(towers) for towers in self._loss_dict.values()]

  def losses_with_coeffs(self):
    return [(loss, self.loss_coeffs[loss])
            for towers in self._loss_dict.values() for loss in towers]

  @property
  def loss_names(self):
    return list(self._loss_dict)

  # ------------------------------------------------------------ losses
  def _register_loss(self, loss, base_name, name, coeff, reuse,
                     colocation=None):
    self._check_not_finalized()
    mode = registration_base.reuse_mode(reuse)
    if name is None:
      if mode is True:
        raise RegistrationKeyError(
            "reuse=True adds a tower to a loss registered before: pass that "
            "loss's name= too (reuse may also come from a reusing "
            "tf.compat.v1.variable_scope).")
      name = self._unique(base_name, set(self._loss_dict))
    if name in self._loss_dict:
      if not mode:
        raise RegistrationKeyError(
            "A loss named %r is already registered. Pass reuse=True to add "
            "a tower to it, or use another name." % name)
      towers = self._loss_dict[name]
      first = self.loss_coeffs[towers[0]]
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
      self._loss_dict[name] = [loss]
    self.loss_coeffs[loss] = coeff
    self.loss_colocation_ops[loss] = colocation
    return loss

  @staticmethod
  def _check_coeff(coeff):
    if utils.is_python_number(coeff) and coeff < 0:
      raise ValueError("Loss coeff must be non-negative, got %s." % coeff)

  def register_categorical_predictive_distribution(
      self, logits, seed=None, targets=None, name=None, coeff=1.0,
      reuse=VARIABLE_SCOPE):
    """Categorical over the last axis of `logits`. `targets` are integer
    labels, or one-hot rows (same shape as logits)."""
    return self._register_categorical(
        logits, seed, targets, name, coeff, reuse,
        "categorical_predictive_distribution")

  # The base names of unnamed losses are kfac 0.2.x's, per method.
  def _register_categorical(self, logits, seed, targets, name, coeff, reuse,
                            base_name):
    self._check_coeff(coeff)
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
      loss = lf.OnehotCategoricalLogitsNegativeLogProbLoss(logits, targets,
                                                           seed)
    else:
      loss = lf.CategoricalLogitsNegativeLogProbLoss(logits, targets, seed)
    return self._register_loss(loss, base_name, name, coeff, reuse, logits)

  def register_softmax_cross_entropy_loss(self, logits, seed=None,
                                          targets=None, name=None, coeff=1.0,
                                          reuse=VARIABLE_SCOPE):
    """Softmax cross-entropy: the categorical predictive distribution."""
    return self._register_categorical(logits, seed, targets, name, coeff,
                                      reuse,
                                      "sparse_softmax_cross_entropy_loss")

  def register_normal_predictive_distribution(self, mean, var=0.5, seed=None,
                                              targets=None, name=None,
                                              coeff=1.0,
                                              reuse=VARIABLE_SCOPE):
    """Gaussian with mean `mean` and fixed variance `var`."""
    return self._register_normal(mean, var, seed, targets, name, coeff,
                                 reuse, "normal_predictive_distribution")

  def _register_normal(self, mean, var, seed, targets, name, coeff, reuse,
                       base_name):
    self._check_coeff(coeff)
    if utils.is_python_number(var) and var <= 0:
      raise ValueError("var must be positive, got %s." % var)
    self._check_targets_like(targets, mean)
    loss = lf.NormalMeanNegativeLogProbLoss(mean, var, targets, seed)
    return self._register_loss(loss, base_name, name, coeff, reuse, mean)

  def register_squared_error_loss(self, prediction, seed=None, targets=None,
                                  name=None, coeff=1.0,
                                  reuse=VARIABLE_SCOPE):
    """||t - y||^2 summed over outputs (a Gaussian with variance 0.5, whose
    Fisher 2 I is the Hessian of the squared error). If your loss is
    0.5 ||t - y||^2, pass coeff=0.5."""
    return self._register_normal(prediction, 0.5, seed, targets, name, coeff,
                                 reuse, "squared_error_loss")

  def register_multi_bernoulli_predictive_distribution(
      self, logits, seed=None, targets=None, name=None, coeff=1.0,
      reuse=VARIABLE_SCOPE):
    """Independent Bernoullis with `logits` (targets in [0, 1])."""
    return self._register_bernoulli(
        logits, seed, targets, name, coeff, reuse,
        "multi_bernoulli_predictive_distribution")

  def _register_bernoulli(self, logits, seed, targets, name, coeff, reuse,
                          base_name):
    self._check_coeff(coeff)
    self._check_targets_like(targets, logits)
    loss = lf.MultiBernoulliNegativeLogProbLoss(logits, targets, seed)
    return self._register_loss(loss, base_name, name, coeff, reuse, logits)

  def register_sigmoid_cross_entropy_loss(self, logits, seed=None,
                                          targets=None, name=None, coeff=1.0,
                                          reuse=VARIABLE_SCOPE):
    """Sigmoid cross-entropy: the multi-Bernoulli predictive distribution."""
    return self._register_bernoulli(logits, seed, targets, name, coeff, reuse,
                                    "sigmoid_cross_entropy_loss")

  def register_normal_mean_variance_predictive_distribution(
      self, mean, variance, seed=None, targets=None, name=None, coeff=1.0,
      reuse=VARIABLE_SCOPE):
    """Gaussian with learned mean and variance (both network outputs)."""
    self._check_coeff(coeff)
    self._check_targets_like(targets, mean)
    loss = lf.NormalMeanVarianceNegativeLogProbLoss(mean, variance, targets,
                                                    seed)
    return self._register_loss(loss, "normal_mean_variance", name, coeff,
                               reuse, mean)

  @staticmethod
  def _check_targets_like(targets, prediction):
    if targets is not None and not targets.shape.is_compatible_with(
        prediction.shape):
      raise ValueError("Targets of shape %s do not match predictions of "
                       "shape %s." % (targets.shape, prediction.shape))

  # ------------------------------------------------------------ evaluation
  def eval_losses(self, target_mode="data", coeff_mode="regular",
                  seeds=None):
    """The registered losses (one entry per loss tower), each summed over
    its batch.

    target_mode: "data" (the registered targets) or "sample" (targets drawn
    from the model). coeff_mode: "regular" (times coeff), "sqrt" (times
    sqrt(coeff)) or "off". seeds: None, or a function of the loss's index
    giving the sampling seed of a loss registered without one.
    """
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

  def total_loss(self, coeff_mode="regular"):
    return tf.add_n(self.eval_losses("data", coeff_mode))

  def total_sampled_loss(self, coeff_mode="regular", seeds=None):
    return tf.add_n(self.eval_losses("sample", coeff_mode, seeds))


def sqrt_coeff(coeff, dtype):
  if utils.is_python_number(coeff):
    return tf.constant(math.sqrt(coeff), dtype)
  return tf.sqrt(utils.cast(coeff, dtype))
