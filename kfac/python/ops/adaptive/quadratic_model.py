"""The quadratic model behind K-FAC's adaptive learning rate and momentum.

With g the gradient, p the preconditioned gradient (the new direction) and
d the previous update, K-FAC looks for the update x1 * p + x2 * d that
minimises the local quadratic model of the objective h,

    q(x) = 1/2 x^T M x + c^T x,        c = [g.p, g.d],
    M = [[p.C p, p.C d], [d.C p, d.C d]]

where C is the exact curvature of the mean loss plus (damping + l2_reg) I
when solving for x, and plus l2_reg I only when the model is used to
predict the change of the objective for the damping rule (Martens & Grosse
2015, sections 6.4, 6.5 and 7). Everything here is scalar float64
arithmetic on the five numbers M11, M12, M22, c1, c2, so it is cheap and
testable by hand.

Degenerate cases of the 2x2 solve, in order:
* M11 > 0, M22 > 0 and det(M) > DET_RTOL * M11 * M22: the exact minimiser
  x = -M^-1 c;
* otherwise, when M11 > 0: the best multiple of p alone, x = (-c1/M11, 0)
  (the first step, where d = 0, and p parallel to d land here);
* otherwise, when M22 > 0: the best multiple of d alone, (0, -c2/M22);
* otherwise (no curvature along either vector): x = (0, 0).
"""

import tensorflow as tf

from kfac.python.ops.tensors import utils

# Relative size below which det(M) counts as zero (p and d parallel).
DET_RTOL = 1e-12


def _f64(x):
  return utils.cast(x, tf.float64)


def solve_two_by_two(m11, m12, m22, c1, c2):
  """(x1, x2) minimising 1/2 x^T M x + c^T x; see the module docstring."""
  m11, m12, m22, c1, c2 = (_f64(v) for v in (m11, m12, m22, c1, c2))
  zero = tf.zeros_like(m11)
  one = tf.ones_like(m11)
  det = m11 * m22 - m12 * m12
  pos11 = m11 > 0
  pos22 = m22 > 0
  full = tf.logical_and(tf.logical_and(pos11, pos22),
                        det > DET_RTOL * m11 * m22)
  safe_det = tf.where(full, det, one)
  x1_full = -(m22 * c1 - m12 * c2) / safe_det
  x2_full = -(m11 * c2 - m12 * c1) / safe_det
  x1_p = -c1 / tf.where(pos11, m11, one)
  x2_d = -c2 / tf.where(pos22, m22, one)
  x1 = tf.where(full, x1_full, tf.where(pos11, x1_p, zero))
  x2 = tf.where(full, x2_full,
                tf.where(pos11, zero, tf.where(pos22, x2_d, zero)))
  return x1, x2


def solve_fixed_second(m11, m12, c1, x2):
  """x1 minimising q(x1, x2) for a fixed x2 (the fixed momentum):
  x1 = -(c1 + x2 M12) / M11, or 0 when M11 <= 0."""
  m11, m12, c1, x2 = (_f64(v) for v in (m11, m12, c1, x2))
  pos = m11 > 0
  return tf.where(pos, -(c1 + x2 * m12) / tf.where(pos, m11,
                                                   tf.ones_like(m11)),
                  tf.zeros_like(m11))


def model_value(x1, x2, m11, m12, m22, c1, c2):
  """q(x) = 1/2 x^T M x + c^T x (the predicted change of the objective)."""
  x1, x2, m11, m12, m22, c1, c2 = (
      _f64(v) for v in (x1, x2, m11, m12, m22, c1, c2))
  return (0.5 * (m11 * x1 * x1 + 2.0 * m12 * x1 * x2 + m22 * x2 * x2) +
          c1 * x1 + c2 * x2)
