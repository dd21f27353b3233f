"""Damping functions with stable identities (layer 1).

A factor caches one inverse per (exponent, damping function). Damping values
are often computed (the pi-adjusted split of factored Tikhonov damping), so a
damping function carries a hashable `key` that names what it computes; two
functions with equal keys share cached inverses.
"""

import tensorflow as tf

from kfac.python.ops.tensors import utils


class DampingFunc:
  """A callable returning a damping value, with a hashable identity `key`.

  With `scale_fn`, the damped matrix of a factor is scale * cov + damping * I
  instead of cov + damping * I (see `pi_adjusted_damping_funcs`).
  """

  def __init__(self, fn, key, scale_fn=None):
    self._fn = fn
    self.key = key
    self._scale_fn = scale_fn

  def __call__(self):
    return self._fn()

  def scale(self, cov):
    """The factor's statistic times this function's scale (if any)."""
    if self._scale_fn is None:
      return cov
    return cov * tf.cast(self._scale_fn(), cov.dtype)

  def __repr__(self):
    return "DampingFunc(%r)" % (self.key,)


def as_damping_func(damping):
  """Wraps a number, tensor, variable or DampingFunc into a DampingFunc."""
  if isinstance(damping, DampingFunc):
    return damping
  if callable(damping) and not utils.is_tensor_or_variable(damping):
    return DampingFunc(damping, ("callable", id(damping)))
  return DampingFunc(lambda: damping, utils.scalar_identity(damping))


def compute_pi(left_trace_ratio, right_trace_ratio):
  """pi = sqrt((tr(A)/dim_A) / (tr(G)/dim_G)), computed in float64.

  Falls back to 1 when either normalized trace is not positive (e.g. before
  any statistics were collected, or when all units of a layer saturated).
  """
  left = tf.cast(left_trace_ratio, tf.float64)
  right = tf.cast(right_trace_ratio, tf.float64)
  zero = utils.shared_constant(0.0, tf.float64)
  ok = tf.logical_and(left > zero, right > zero)
  one = (utils.shared_constant(1.0, tf.float64) if left.shape.rank == 0
         else tf.ones_like(left))
  return tf.where(ok, tf.sqrt(tf.where(ok, left, one)) /
                  tf.sqrt(tf.where(ok, right, one)), one)


def compute_pi_adjusted_damping(left_trace_ratio, right_trace_ratio, damping):
  """Splits `damping` between two Kronecker factors with the pi rule.

  A gets pi*sqrt(damping) and G gets sqrt(damping)/pi (Martens & Grosse
  2015, section 6.3). Returns (damping_left, damping_right) in the dtype of
  the traces.
  """
  dtype = left_trace_ratio.dtype
  pi = compute_pi(left_trace_ratio, right_trace_ratio)
  root = tf.sqrt(utils.cast(damping, tf.float64))
  return tf.cast(pi * root, dtype), tf.cast(root / pi, dtype)


def pi_adjusted_damping_funcs(left_factor, right_factor, damping_func,
                              pi_type="tracenorm"):
  """DampingFuncs for the two factors of a Kronecker block (pi-adjusted).

  pi_type "off" (kfac 0.2.x's option) gives both factors sqrt(damping),
  pi = 1; "tracenorm" (the default) splits it as follows.

  The damped block is (A + pi s I) (x) (G + s/pi I) with s = sqrt(damping).
  Since the Kronecker product of c X and Y / c is X (x) Y, it equals
  (A/pi + s I) (x) (pi G + s I): the functions return damping s with scales
  1/pi and pi. The block's products are unchanged, but each factor's damped
  matrix and its inverse stay bounded when a trace goes to zero (a layer
  whose units all saturated): with the unscaled split, G's damping s/pi
  tends to zero and its inverse overflows float32 long before the product
  of the two inverses (about 1/damping) does.
  """
  def root():
    return tf.sqrt(utils.cast(damping_func(), tf.float64))

  if pi_type == "off":
    key = ("pi_off", damping_func.key)  # the same for both factors
    return DampingFunc(root, key), DampingFunc(root, key)
  if pi_type != "tracenorm":
    raise ValueError("pi_type must be 'tracenorm' or 'off', got %r." %
                     (pi_type,))
  key = ("pi_adjusted", left_factor.name, right_factor.name, damping_func.key)

  def pi():
    return compute_pi(left_factor.normalized_trace(),
                      right_factor.normalized_trace())

  return (DampingFunc(root, key + ("left",), scale_fn=lambda: 1.0 / pi()),
          DampingFunc(root, key + ("right",), scale_fn=pi))


def scaled_damping_func(damping_func, scale):
  """damping * scale, e.g. sqrt(damping) shares or normalisation by uses.

  `scale` is a Python number or a scalar tensor (keyed by identity). A
  tensor damping is scaled in float64 (a float32 damping variable divided by
  3 would otherwise carry a 1e-8 relative error into a float64 model)."""
  key = ("scaled", utils.scalar_identity(scale), damping_func.key)

  def fn():
    value = damping_func()
    if not utils.is_tensor_or_variable(value) and utils.is_python_number(
        scale):
      return value * float(scale)
    return utils.cast(value, tf.float64) * utils.cast(scale, tf.float64)

  return DampingFunc(fn, key)
