"""Inverses computed once per factor across replicas ("replica_round_robin").

By default every replica computes every factor's inverse itself (no
communication: the replicas hold the same statistics, so they get the same
inverses). With `placement_strategy="replica_round_robin"` each factor's
inverse update (its inverses, eigendecomposition, Cholesky factors or
series quantities) is computed on one replica only, its *owner*, and sent to
the others: the owner contributes the values, every other replica zeros,
and one SUM all-reduce per dtype delivers them to all (x + 0 + ... + 0 = x,
so the result is bit-identical to replicated inverses).

Owners are assigned greedily by cost: factors in decreasing order of the
work of their inverse update (n^3 per n x n matrix it writes), each to the
replica with the least work so far (ties: the lower replica id, the earlier
factor). The assignment depends only on the factors' shapes and the number
of replicas, so every replica computes the same one.

The inverse updates then contain collectives, so a conditional around them
must be a `collective.cross_replica_cond` (PeriodicInvCovUpdateKfacOpt does
this). With one replica this placement is the default one.

`ReplicaRoundRobin` is the placement policy of the estimator
(estimation/placement.py describes the interface); the estimator gets it
from the table of estimation/strategies.py.
"""

import threading

import numpy as np
import tensorflow as tf

from kfac.python.ops.distribute import collective
from kfac.python.ops.distribute import replicas
from kfac.python.ops.reliability import nonfinite


def _cost(shape):
  shape = [int(d) for d in shape]
  if len(shape) >= 2 and shape[-1] == shape[-2]:
    return float(np.prod(shape[:-2] or [1])) * float(shape[-1])**3
  return float(np.prod(shape or [1]))


def assign_owners(costs, num_replicas):
  """Greedy owner of each item of `costs` (largest first, to the least
  loaded replica); returns a list of replica ids."""
  load = [0.0] * num_replicas
  owners = [0] * len(costs)
  for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
    owner = min(range(num_replicas), key=lambda r: (load[r], r))
    owners[i] = owner
    load[owner] += costs[i]
  return owners


class ReplicaRoundRobin:
  """The placement policy (estimation/placement.py) computing each
  factor's inverse update on one replica and broadcasting it to the others
  (module docstring)."""

  def __init__(self, distribute_transformations=True):
    """`distribute_transformations` is accepted for compatibility with the
    old library; the products with the inverses (one matmul per layer,
    cheaper than sending their results) stay on every replica."""
    self.distribute_transformations = bool(distribute_transformations)
    self._inverse_ops = {}

  def place_statistics(self, thunks):
    return thunks

  def place_inverses(self, thunks):
    return thunks

  def per_factor_inverses(self):
    return collective.is_distributed()

  def uses_collectives(self):
    return collective.is_distributed()

  def inverse_owners(self, factors, num_replicas=None):
    """{factor name: replica id} of the factors with inverse updates."""
    num_replicas = num_replicas or replicas.num_replicas_in_sync()
    for factor in factors:
      factor.instantiate_cov_variables()
      factor.instantiate_inv_variables()
    names, costs = [], []
    for factor in factors:
      shapes = [var.shape for var in factor.inverse_variables()]
      if shapes:
        names.append(factor.name)
        costs.append(sum(_cost(s) for s in shapes))
    return dict(zip(names, assign_owners(costs, num_replicas)))

  def inverse_thunks(self, factors, thunks, open_scope):
    """Under several replicas, every factor's thunk returns the one op that
    updates them all (built once per graph and replica thread, under
    open_scope()): the broadcast is one collective per dtype."""
    if not collective.is_distributed():
      return thunks

    def thunk():
      key = (tf.compat.v1.get_default_graph(), threading.get_ident())
      if key not in self._inverse_ops:
        with open_scope():
          self._inverse_ops[key] = self._broadcast_inverses(factors)
      return self._inverse_ops[key]
    return [thunk for _ in factors]

  def _broadcast_inverses(self, factors):
    owners = self.inverse_owners(factors)
    me = tf.get_static_value(collective.replica_id())
    variables, values = [], []
    with tf.name_scope("replica_round_robin_inverses"):
      for factor in factors:
        if factor.name not in owners:
          continue
        owner = owners[factor.name]
        for var, value in factor.inverse_values():
          value = tf.cast(value, var.dtype)
          zeros = tf.zeros(var.shape, var.dtype)
          if me is None:  # A replica id known only when the step runs.
            value = tf.where(
                tf.equal(collective.replica_id(), owner), value, zeros)
          elif int(me) != owner:
            value = zeros  # The value's ops are never run here.
          variables.append(var)
          values.append(value)
      summed = collective.all_reduce(values, collective.SUM)
      return tf.group(*[nonfinite.assign_if_finite(var, value)
                        for var, value in zip(variables, summed)])
