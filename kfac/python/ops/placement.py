"""kfac 0.2.4's module path of the device placement strategies
(kfac.placement).

The placement policies live in estimation/placement.py (and
distribute/inverse_placement.py) and the estimator classes of the
strategies in estimation/strategies.py; this module keeps the old import
path (and the other names of the estimator classes) for users.

kfac 0.2.4 placed the update ops through mixins of the estimator;
`RoundRobinPlacementMixin` and `ReplicaRoundRobinPlacementMixin` are kept
for code that writes `class E(RoundRobinPlacementMixin, FisherEstimator)`:
each takes its strategy's keyword arguments and gives the estimator that
strategy's placement policy.
"""

import tensorflow as tf

from kfac.python.ops.estimation import placement as _placement
from kfac.python.ops.estimation.placement import PLACEMENT_KWARGS
from kfac.python.ops.estimation.strategies import (
    FisherEstimatorReplicaRoundRobin)
from kfac.python.ops.estimation.strategies import FisherEstimatorRoundRobin
from kfac.python.ops.estimation.strategies import estimator_class

RoundRobinFisherEstimator = FisherEstimatorRoundRobin
ReplicaRoundRobinFisherEstimator = FisherEstimatorReplicaRoundRobin


class RoundRobinPlacementMixin:
  """kfac 0.2.4's mixin of a FisherEstimator: each factor's update ops on
  `cov_devices` / `inv_devices` in round-robin order (the
  estimation/placement.RoundRobin policy)."""

  def __init__(self, cov_devices=None, inv_devices=None, trans_devices=None,
               **kwargs):
    policy = _placement.RoundRobin(cov_devices, inv_devices, trans_devices)
    super().__init__(**kwargs)
    self._set_placement(policy)


class ReplicaRoundRobinPlacementMixin:
  """kfac 0.2.4's mixin of a FisherEstimator: each factor's inverses
  computed on one replica and broadcast (the
  estimation/placement.ReplicaRoundRobin policy)."""

  def __init__(self, distribute_transformations=True, **kwargs):
    policy = _placement.ReplicaRoundRobin(distribute_transformations)
    super().__init__(**kwargs)
    self._set_placement(policy)

  def inverse_owners(self, num_replicas=None):
    """{factor name: replica id} of the factors with inverse updates."""
    return self._placement.inverse_owners(self.factors, num_replicas)
