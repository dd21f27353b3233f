"""The Fisher estimator's inverses part: the ops that recompute each
factor's inverses (and eigendecompositions, Cholesky factors, ...) from its
statistics' moving average, after the lazy statistics sync when there is
one (distribute/lazy_sync.py), placed by the placement policy
(placement.py).

`Inverses` is made by `estimator.FisherEstimator` once its factors exist;
it gets them, the configuration and the placement policy in its
constructor. Its entry points: `variable_thunks`, `update_thunks` (one
per factor) and `update_op` (all factors at once, batched by shape).
"""

import threading

import tensorflow as tf

from kfac.python.ops.distribute import lazy_sync
from kfac.python.ops.numerics import batched_inverse
from kfac.python.ops.reliability import nonfinite


class Inverses:
  """The FisherEstimator's inverse updates (see module docstring)."""

  def __init__(self, factors, name, lazy_sync, placement):
    """Args:
      factors: the estimator's factors, in order.
      name: the default name scope.
      lazy_sync: a function saying whether the statistics are synchronised
        lazily (then the inverse updates first reduce them) where the ops
        are built.
      placement: the placement policy (placement.py).
    """
    self._factors = list(factors)
    self._name = name
    self._lazy = lazy_sync
    self._placement = placement
    self._sync_ops = {}  # (graph, replica thread) -> the lazy sync op

  def _scope(self, scope):
    return tf.name_scope(scope or self._name)

  def variable_thunks(self):
    """One thunk per factor making its inverses' variables."""
    return [f.instantiate_inv_variables for f in self._factors]

  def update_thunks(self, scope=None):
    """One thunk per factor building its inverse update op (placed)."""
    thunks = self._placement.inverse_thunks(
        self._factors, self._factor_thunks(scope), lambda: self._scope(scope))
    if self._lazy():
      thunks = [self._after_sync(t, scope) for t in thunks]
    return self._placement.place_inverses(thunks)

  def _factor_thunks(self, scope):
    def make(factor):
      def thunk():
        with self._scope(scope):
          return tf.group(*factor.make_inverse_update_ops())
      return thunk
    return [make(f) for f in self._factors]

  def _sync_op(self, scope):
    """One sync of all factors per graph and replica thread, before any
    inverse is computed."""
    key = (tf.compat.v1.get_default_graph(), threading.get_ident())
    if key not in self._sync_ops:
      with self._scope(scope):
        self._sync_ops[key] = lazy_sync.sync_op(self._factors)
    return self._sync_ops[key]

  def _after_sync(self, thunk, scope):
    def synced():
      with tf.control_dependencies([self._sync_op(scope)]):
        return tf.group(thunk())
    return synced

  def update_op(self, scope=None):
    """One op updating every factor's inverses, as the update thunks do
    together: the damped Cholesky inverses of all factors are computed as
    batches of equal shapes with one float64 fallback
    (numerics/batched_inverse.py), so that the graph grows with the number
    of distinct factor shapes, not of factors. (The per-factor thunks where
    the placement policy says so.)"""
    if self._placement.per_factor_inverses():
      return tf.group(*[t() for t in self.update_thunks(scope)])
    sync = [self._sync_op(scope)] if self._lazy() else []
    with tf.control_dependencies(sync), self._scope(scope):
      assigns, deferred = [], []
      for factor in self._factors:
        for var, value in factor.deferred_inverse_values():
          if isinstance(value, batched_inverse.DeferredInverse):
            deferred.append((var, value))
          else:
            assigns.append(nonfinite.assign_if_finite(var, value))
      values = batched_inverse.damped_inverses(
          [(d.mat, d.damping) for _, d in deferred])
      assigns.extend(nonfinite.assign_if_finite(var, value)
                     for (var, _), value in zip(deferred, values))
      return tf.group(*assigns)
