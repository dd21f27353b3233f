"""Device placement of the statistics and inverse update ops.

"replica_round_robin" (`ReplicaRoundRobinPlacementMixin`, in
distribute/inverse_placement.py) computes each factor's inverses on one
replica of a tf.distribute strategy and broadcasts them.

`RoundRobinPlacementMixin` puts the covariance update op of factor i on
`cov_devices[i % len(cov_devices)]` and its inverse update op on
`inv_devices[i % len(inv_devices)]`; `trans_devices` is accepted for
compatibility (this version has no separate transformation ops). Devices
are ordinary TensorFlow device strings ("/cpu:0", "/gpu:1", ...).
"""

import tensorflow as tf

from kfac.python.ops import estimator as estimator_lib
from kfac.python.ops.distribute import inverse_placement

ReplicaRoundRobinPlacementMixin = (
    inverse_placement.ReplicaRoundRobinPlacementMixin)

PLACEMENT_KWARGS = ("cov_devices", "inv_devices", "trans_devices")


def _round_robin(thunks, devices):
  if not devices:
    return thunks

  def wrap(thunk, device):
    def placed():
      with tf.device(device):
        return thunk()
    return placed

  return [wrap(t, devices[i % len(devices)]) for i, t in enumerate(thunks)]


class RoundRobinPlacementMixin:
  """Places each factor's update ops on devices in round-robin order."""

  def __init__(self, cov_devices=None, inv_devices=None, trans_devices=None,
               **kwargs):
    self._cov_devices = list(cov_devices or [])
    self._inv_devices = list(inv_devices or [])
    self._trans_devices = list(trans_devices or [])
    super().__init__(**kwargs)

  def _cov_update_thunks(self, scope=None):
    return _round_robin(super()._cov_update_thunks(scope), self._cov_devices)

  def _inv_update_thunks(self, scope=None):
    return _round_robin(super()._inv_update_thunks(scope), self._inv_devices)


class RoundRobinFisherEstimator(RoundRobinPlacementMixin,
                                estimator_lib.FisherEstimator):
  """FisherEstimator with round-robin placement of its update ops."""


class ReplicaRoundRobinFisherEstimator(ReplicaRoundRobinPlacementMixin,
                                       estimator_lib.FisherEstimator):
  """FisherEstimator whose inverses are computed once across replicas
  (distribute/inverse_placement.py)."""


_STRATEGIES = {"round_robin": RoundRobinFisherEstimator,
               "replica_round_robin": ReplicaRoundRobinFisherEstimator}


def estimator_class(placement_strategy):
  if placement_strategy not in _STRATEGIES:
    raise ValueError("Unknown placement_strategy %r; expected None, "
                     "'round_robin' or 'replica_round_robin'." %
                     (placement_strategy,))
  return _STRATEGIES[placement_strategy]
