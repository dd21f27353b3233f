"""The estimator classes of the device placement strategies, and the
factory that picks one by name (`make_fisher_estimator`).
"""

from kfac.python.ops.estimation import placement
from kfac.python.ops.estimation.estimator import FisherEstimator


class FisherEstimatorRoundRobin(placement.RoundRobinPlacementMixin,
                                FisherEstimator):
  """FisherEstimator placing each factor's update ops on `cov_devices` /
  `inv_devices` in round-robin order (placement.py); without devices, the
  plain estimator."""


class FisherEstimatorReplicaRoundRobin(
    placement.ReplicaRoundRobinPlacementMixin, FisherEstimator):
  """FisherEstimator whose inverses are computed once across replicas
  (distribute/inverse_placement.py)."""


_STRATEGIES = {None: FisherEstimatorRoundRobin,
               "round_robin": FisherEstimatorRoundRobin,
               "replica_round_robin": FisherEstimatorReplicaRoundRobin}


def estimator_class(placement_strategy):
  """The estimator class of a placement strategy (None, "round_robin" or
  "replica_round_robin")."""
  try:
    return _STRATEGIES[placement_strategy]
  except (KeyError, TypeError):
    raise ValueError("Unknown placement_strategy %r; expected None, "
                     "'round_robin' or 'replica_round_robin'." %
                     (placement_strategy,))


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
