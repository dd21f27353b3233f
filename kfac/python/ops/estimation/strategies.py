"""The placement strategies by name: the table from `placement_strategy` to
its placement policy (placement.py), the factory that builds an estimator
with one (`make_fisher_estimator`), and the estimator classes that name
each strategy's keyword arguments (`estimator_class`; kfac 0.2.x's
`FisherEstimatorRoundRobin` and `FisherEstimatorReplicaRoundRobin`).

A strategy's keyword arguments are those of its policy's constructor;
the class of a strategy takes them, with the FisherEstimator's, and only
sets the policy (optimizers/config.check_placement reads its
`__init__` to reject the arguments a strategy does not take).
"""

from kfac.python.ops.estimation import placement
from kfac.python.ops.estimation.estimator import FisherEstimator


class FisherEstimatorRoundRobin(FisherEstimator):
  """FisherEstimator placing each factor's update ops on `cov_devices` /
  `inv_devices` in round-robin order (placement.RoundRobin); without
  devices, the plain estimator."""

  def __init__(self, cov_devices=None, inv_devices=None, trans_devices=None,
               **kwargs):
    policy = placement.RoundRobin(cov_devices, inv_devices, trans_devices)
    super().__init__(**kwargs)
    self._set_placement(policy)


class FisherEstimatorReplicaRoundRobin(FisherEstimator):
  """FisherEstimator whose inverses are computed once across replicas
  (placement.ReplicaRoundRobin, distribute/inverse_placement.py)."""

  def __init__(self, distribute_transformations=True, **kwargs):
    policy = placement.ReplicaRoundRobin(distribute_transformations)
    super().__init__(**kwargs)
    self._set_placement(policy)

  def inverse_owners(self, num_replicas=None):
    """{factor name: replica id} of the factors with inverse updates."""
    return self._placement.inverse_owners(self.factors, num_replicas)


# placement_strategy -> (its placement policy, the estimator class taking
# the policy's keyword arguments).
STRATEGIES = {
    None: (placement.RoundRobin, FisherEstimatorRoundRobin),
    "round_robin": (placement.RoundRobin, FisherEstimatorRoundRobin),
    "replica_round_robin": (placement.ReplicaRoundRobin,
                            FisherEstimatorReplicaRoundRobin),
}


def _strategy(placement_strategy):
  try:
    return STRATEGIES[placement_strategy]
  except (KeyError, TypeError):
    raise ValueError("Unknown placement_strategy %r; expected None, "
                     "'round_robin' or 'replica_round_robin'." %
                     (placement_strategy,))


def estimator_class(placement_strategy):
  """The estimator class of a placement strategy (None, "round_robin" or
  "replica_round_robin")."""
  return _strategy(placement_strategy)[1]


def make_fisher_estimator(placement_strategy=None, **kwargs):
  """Creates a FisherEstimator with a device placement strategy.

  Args:
    placement_strategy: None or "round_robin" (a FisherEstimatorRoundRobin;
      kwargs cov_devices / inv_devices / trans_devices place its ops), or
      "replica_round_robin" (FisherEstimatorReplicaRoundRobin).
    **kwargs: FisherEstimator arguments, plus the strategy's.

  Raises:
    ValueError: for an unknown placement strategy.
  """
  return estimator_class(placement_strategy)(**kwargs)
