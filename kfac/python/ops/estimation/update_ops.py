"""The Fisher estimator's update ops as a whole: the inverse update ops (after
the lazy statistics sync when there is one), the variables, and the thunks
and grouped ops of both kinds of updates that the optimizers run.

`UpdateOpsMixin` is a base of `estimator.FisherEstimator`; it reads the
estimator's `factors`, `_finalize()`, `_scope`, `_lazy`, `_lazy_sync_ops`
and the statistics thunks of statistics.StatisticsUpdateMixin.
"""

import collections
import threading

import tensorflow as tf

from kfac.python.ops.distribute import lazy_sync
from kfac.python.ops.numerics import batched_inverse
from kfac.python.ops.reliability import nonfinite


class UpdateOpsMixin:
  """The FisherEstimator's inverse update ops and op assembly (see module
  docstring)."""

  def _inv_variable_thunks(self):
    return [f.instantiate_inv_variables for f in self.factors]


  @property
  def inverse_update_uses_collectives(self):
    """Whether the inverse update ops talk to other replicas (then a
    conditional around them must be a collective.cross_replica_cond)."""
    return self._lazy()

  def _inv_update_thunks(self, scope=None):
    thunks = self._inverse_thunks(scope)
    if not self._lazy():
      return thunks

    def after_sync(thunk):
      def synced():
        # One sync of all factors per graph and replica thread, before
        # any inverse is computed.
        key = (tf.compat.v1.get_default_graph(), threading.get_ident())
        if key not in self._lazy_sync_ops:
          with self._scope(scope):
            self._lazy_sync_ops[key] = lazy_sync.sync_op(self.factors)
        with tf.control_dependencies([self._lazy_sync_ops[key]]):
          return tf.group(thunk())
      return synced
    return [after_sync(t) for t in thunks]

  def _inverse_thunks(self, scope=None):
    """One thunk per factor building its inverse update op."""
    def make(factor):
      def thunk():
        with self._scope(scope):
          return tf.group(*factor.make_inverse_update_ops())
      return thunk
    return [make(f) for f in self.factors]

  def _per_factor_inverses(self):
    """Whether each factor's inverse update must be built by its own thunk
    (estimators that place or distribute them per factor say True)."""
    return False

  def inverse_update_op(self, scope=None):
    """One op updating every factor's inverses, as the inverse update
    thunks do together: the damped Cholesky inverses of all factors are
    computed as batches of equal shapes with one float64 fallback
    (numerics/batched_inverse.py), so that the graph grows with the number
    of distinct factor shapes, not of factors. (The per-factor thunks where
    _per_factor_inverses says so.)"""
    if self._per_factor_inverses():
      return tf.group(*[t() for t in self._inv_update_thunks(scope)])
    self._finalize()
    sync = []
    if self._lazy():
      key = (tf.compat.v1.get_default_graph(), threading.get_ident())
      if key not in self._lazy_sync_ops:
        with self._scope(scope):
          self._lazy_sync_ops[key] = lazy_sync.sync_op(self.factors)
      sync = [self._lazy_sync_ops[key]]
    with tf.control_dependencies(sync), self._scope(scope):
      assigns, deferred = [], []
      for factor in self.factors:
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

  def create_ops_and_vars_thunks(self, scope=None):
    """Thunks that make variables and update ops, one per factor (in the
    order of `factors`); call a factor's variable thunks before its update
    thunks. A covariance update thunk takes `should_decay=True` (False: the
    statistic joins an arithmetic mean instead of the moving average).

    Returns:
      (cov_variable_thunks, cov_update_thunks, inv_variable_thunks,
       inv_update_thunks): four lists.
    """
    self._finalize()
    return (self._cov_variable_thunks(), self._cov_update_thunks(scope),
            self._inv_variable_thunks(), self._inv_update_thunks(scope))

  def make_vars_and_create_op_thunks(self, scope=None):
    """Makes all variables now and returns the update thunks (kfac 0.2.x).

    Returns:
      (cov_update_thunks, inv_update_thunks): two lists, one thunk per
      factor; each call builds that factor's update op.
    """
    (cov_var_thunks, cov_update_thunks, inv_var_thunks,
     inv_update_thunks) = self.create_ops_and_vars_thunks(scope)
    for thunk in cov_var_thunks + inv_var_thunks:
      thunk()
    return cov_update_thunks, inv_update_thunks

  def make_vars_and_create_ops(self, scope=None):
    """Makes all variables and builds every update op now.

    Returns:
      An `UpdateOps` namedtuple (cov_update_ops, cov_update_op,
      inv_update_ops, inv_update_op, cov_update_thunks, inv_update_thunks):
      the per-factor ops, one op grouping each kind, and the thunks (as
      make_vars_and_create_op_thunks returns them).
    """
    cov_update_thunks, inv_update_thunks = (
        self.make_vars_and_create_op_thunks(scope))
    cov_update_ops = [t() for t in cov_update_thunks]
    inv_update_ops = [t() for t in inv_update_thunks]
    with self._scope(scope):
      cov_update_op = tf.group(*cov_update_ops, name="cov_update_op")
      inv_update_op = tf.group(*inv_update_ops, name="inv_update_op")
    return UpdateOps(cov_update_ops, cov_update_op, inv_update_ops,
                     inv_update_op, cov_update_thunks, inv_update_thunks)

  def instantiate_variables(self):
    for factor in self.factors:
      factor.instantiate_cov_variables()
      factor.instantiate_inv_variables()

  def get_cov_vars(self):
    """The statistics' variables: a tuple with one list per factor (in the
    order of `factors`), as in kfac 0.2.x."""
    self.instantiate_variables()
    return tuple(_cov_vars_of(f) for f in self.factors)

  def get_inv_vars(self):
    """The inverse-related variables: a tuple with one list per factor
    (empty for factors without any, e.g. diagonal ones)."""
    self.instantiate_variables()
    return tuple(list(f.inverse_variables()) for f in self.factors)


UpdateOps = collections.namedtuple(
    "UpdateOps", ["cov_update_ops", "cov_update_op", "inv_update_ops",
                  "inv_update_op", "cov_update_thunks", "inv_update_thunks"])


def _cov_vars_of(factor):
  out = [factor.get_cov_var()]
  if hasattr(factor, "get_cov_dt1"):
    out.append(factor.get_cov_dt1())
  return out
