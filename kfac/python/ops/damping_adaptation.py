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
"""

import tensorflow as tf

from kfac.python.ops import utils


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


def adapted_damping(damping, rho, decay, interval, lower, upper, min_damping):
  """The new damping after one application of the rule (float64)."""
  damping = utils.cast(damping, tf.float64)
  rho = utils.cast(rho, tf.float64)
  omega = tf.constant(float(decay) ** int(interval), tf.float64)
  finite = tf.math.is_finite(rho)
  increase = tf.logical_or(tf.logical_not(finite), rho < lower)
  decrease = tf.logical_and(finite, rho > upper)
  new = tf.where(decrease, damping * omega,
                 tf.where(increase, damping / omega, damping))
  return tf.maximum(new, tf.constant(float(min_damping), tf.float64))
