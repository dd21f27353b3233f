"""The Levenberg-Marquardt damping rule (Martens & Grosse 2015, sec. 6.5).

Every `interval` steps K-FAC compares the change of the objective that an
update actually produced with the change its quadratic model predicted,

    rho = (h(theta + delta) - h(theta)) / q(delta),

both on the same mini-batch, and moves the damping lambda:

    rho > upper  (the model was good):  lambda <- omega * lambda
    rho < lower  (the model was poor):  lambda <- lambda / omega
    otherwise:                          lambda unchanged

with omega = decay ** interval, then lambda <- max(lambda, min_damping).
A rho that is not a finite number (the loss became NaN or infinite, or the
model predicted no decrease, q(delta) >= 0, which makes the ratio
meaningless) counts as a poor model and increases the damping.

Calibration (`calibrated_damping`), for the burn-in steps: the same test of
rho against the thresholds, but the damping moves by a factor exp(s) that
starts at 10 (s = ln 10) and halves s (a square root of the factor) each
time the direction reverses, i.e. a bisection in log space. From a damping
that is off by k orders of magnitude, k steps in one direction find the
bracket and each further step halves it; a rho between the thresholds
leaves the damping (and s) as they are.
"""

import math

import tensorflow as tf

from kfac.python.ops.tensors import utils


class IgnoredArgumentWarning(UserWarning):
  """An optimizer argument that has no effect with the other arguments
  given (e.g. damping_adaptation_interval without adapt_damping)."""


def check_arguments(decay, interval, lower, upper, min_damping):
  """ValueErrors for rule parameters that make no sense."""
  if not 0.0 < decay <= 1.0:
    raise ValueError("damping_adaptation_decay must be in (0, 1], got %r." %
                     (decay,))
  if int(interval) != interval or interval < 1:
    raise ValueError("damping_adaptation_interval must be an integer >= 1, "
                     "got %r." % (interval,))
  if not lower < upper:
    raise ValueError(
        "damping_increase_rho_threshold (%r) must be below "
        "damping_decrease_rho_threshold (%r)." % (lower, upper))
  if min_damping < 0:
    raise ValueError("min_damping must be >= 0, got %r." % (min_damping,))


def reduction_ratio(loss_before, loss_after, model_change):
  """rho = (loss_after - loss_before) / model_change, in float64; NaN when
  the model predicted no decrease (model_change >= 0)."""
  before = utils.cast(loss_before, tf.float64)
  after = utils.cast(loss_after, tf.float64)
  change = utils.cast(model_change, tf.float64)
  decrease = change < 0
  ratio = (after - before) / tf.where(decrease, change, -tf.ones_like(change))
  return tf.where(decrease, ratio,
                  tf.constant(float("nan"), tf.float64) * tf.ones_like(ratio))


def _floor(min_damping):
  """The floor as a float64 tensor (a number or a tensor)."""
  if utils.is_python_number(min_damping):
    return tf.constant(float(min_damping), tf.float64)
  return utils.cast(min_damping, tf.float64)


def adapted_damping(damping, rho, decay, interval, lower, upper, min_damping):
  """The new damping after one application of the rule (float64)."""
  damping, rho = _read_once(damping, rho)
  if utils.is_python_number(decay) and utils.is_python_number(interval):
    omega = tf.constant(float(decay) ** int(interval), tf.float64)
  else:  # the automatic recipe's values of this step (recipe/switch.py)
    omega = tf.pow(utils.cast(decay, tf.float64),
                   utils.cast(interval, tf.float64))
  finite = tf.math.is_finite(rho)
  increase = tf.logical_or(tf.logical_not(finite), rho < lower)
  decrease = tf.logical_and(finite, rho > upper)
  new = tf.where(decrease, damping * omega,
                 tf.where(increase, damping / omega, damping))
  return tf.maximum(new, _floor(min_damping))


def _read_once(*values):
  """The values as float64 tensors, a variable read once: tf.cast of a
  float64 variable returns the variable, and each use of it would read it
  again. In a TF1 graph a read that feeds only some of the assignments
  that follow is not ordered before the others: the calibration's
  direction * last was read after `last` was assigned (about one run in
  six, two calibration steps, single-threaded sessions too)."""
  return [tf.convert_to_tensor(utils.cast(v, tf.float64)) for v in values]


# The first calibration move multiplies or divides the damping by 10.
CALIBRATION_INITIAL_LOG_STEP = math.log(10.0)


def calibrated_damping(damping, rho, log_step, last_direction, lower, upper,
                       min_damping):
  """One calibration step (module docstring), in float64.

  Args:
    damping: the current damping.
    rho: the reduction ratio of the trial update made with it.
    log_step: s, the size of the move in log space.
    last_direction: +1 / -1, the direction of the last move, 0 before any.
    lower, upper: the rho thresholds (increase below lower, decrease above
      upper).
    min_damping: the floor.

  Returns:
    (new damping, new log_step, new last_direction).
  """
  damping, rho, log_step, last = _read_once(damping, rho, log_step,
                                            last_direction)
  finite = tf.math.is_finite(rho)
  one = tf.ones_like(damping)
  direction = tf.where(
      tf.logical_or(tf.logical_not(finite), rho < lower), one,
      tf.where(tf.logical_and(finite, rho > upper), -one, 0.0 * one))
  reverses = direction * last < 0
  log_step = tf.where(reverses, log_step / 2.0, log_step)
  new = tf.maximum(damping * tf.exp(direction * log_step),
                   _floor(min_damping))
  return new, log_step, tf.where(direction != 0, direction, last)

