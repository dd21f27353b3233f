"""Damping functions with stable identities (layer 1).

A factor caches one inverse per (exponent, damping function). Damping values
are often computed (the pi-adjusted split of factored Tikhonov damping), so a
damping function carries a hashable `key` that names what it computes; two
functions with equal keys share cached inverses.
"""

import tensorflow as tf

from kfac.python.ops import utils


class DampingFunc:
  """A callable returning a damping value, with a hashable identity `key`."""

  def __init__(self, fn, key):
    self._fn = fn
    self.key = key

  def __call__(self):
    return self._fn()

  def __repr__(self):
    return "DampingFunc(%r)" % (self.key,)


def as_damping_func(damping):
  """Wraps a number, tensor, variable or DampingFunc into a DampingFunc."""
  if isinstance(damping, DampingFunc):
    return damping
  if callable(damping) and not utils.is_tensor_or_variable(damping):
    return DampingFunc(damping, ("callable", id(damping)))
  return DampingFunc(lambda: damping, utils.scalar_identity(damping))


def compute_pi_adjusted_damping(left_trace_ratio, right_trace_ratio, damping):
  """Splits `damping` between two Kronecker factors with the pi rule.

  pi = sqrt((tr(A)/dim_A) / (tr(G)/dim_G)); A gets pi*sqrt(damping) and G
  gets sqrt(damping)/pi (Martens & Grosse 2015, section 6.3). Returns
  (damping_left, damping_right). When either normalized trace is 0 (e.g.
  before any statistics were collected) pi falls back to 1.
  """
  dtype = left_trace_ratio.dtype
  damping = utils.cast(damping, dtype)
  ok = tf.logical_and(left_trace_ratio > 0, right_trace_ratio > 0)
  safe_left = tf.where(ok, left_trace_ratio, tf.ones_like(left_trace_ratio))
  safe_right = tf.where(ok, right_trace_ratio, tf.ones_like(right_trace_ratio))
  pi = tf.sqrt(safe_left / safe_right)
  root = tf.sqrt(damping)
  return pi * root, root / pi


def pi_adjusted_damping_funcs(left_factor, right_factor, damping_func):
  """DampingFuncs for the two factors of a Kronecker block (pi-adjusted)."""
  key = ("pi_adjusted", left_factor.name, right_factor.name, damping_func.key)

  def both():
    return compute_pi_adjusted_damping(left_factor.normalized_trace(),
                                       right_factor.normalized_trace(),
                                       damping_func())

  return (DampingFunc(lambda: both()[0], key + ("left",)),
          DampingFunc(lambda: both()[1], key + ("right",)))


def scaled_damping_func(damping_func, scale):
  """damping * scale, e.g. sqrt(damping) shares or normalisation by uses."""
  key = ("scaled", float(scale), damping_func.key)
  return DampingFunc(lambda: damping_func() * float(scale), key)
