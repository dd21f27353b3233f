"""Device placement of the statistics and inverse update ops.

"replica_round_robin" (`ReplicaRoundRobinPlacementMixin`, in
distribute/inverse_placement.py) computes each factor's inverses on one
replica of a tf.distribute strategy and broadcasts them.

`RoundRobinPlacementMixin` puts the covariance variables and update op of
factor i on `cov_devices[i % len(cov_devices)]` and its inverse update op on
`inv_devices[i % len(inv_devices)]` (the inverse variables stay where the
caller's device scope puts them, next to the preconditioning);
`trans_devices` is accepted for compatibility (this version has no separate
transformation ops). Devices are ordinary TensorFlow device strings
("/cpu:0", "/gpu:1", ...).

The estimator classes with these mixins are
`strategies.FisherEstimatorRoundRobin` and
`strategies.FisherEstimatorReplicaRoundRobin` (kfac.placement also names
them RoundRobinFisherEstimator and ReplicaRoundRobinFisherEstimator). This
module does not import the estimator: the strategies module puts the two
together.
"""

import tensorflow as tf

from kfac.python.ops.distribute import inverse_placement

ReplicaRoundRobinPlacementMixin = (
    inverse_placement.ReplicaRoundRobinPlacementMixin)

PLACEMENT_KWARGS = ("cov_devices", "inv_devices", "trans_devices")


def _round_robin(thunks, devices):
  if not devices:
    return thunks

  def wrap(thunk, device):
    def placed(*args, **kwargs):
      with tf.device(device):
        return thunk(*args, **kwargs)
    return placed

  return [wrap(t, devices[i % len(devices)]) for i, t in enumerate(thunks)]


def _device_list(devices, arg):
  if devices is None:
    return []
  if isinstance(devices, str):
    raise TypeError("%s must be a list of device strings, got the string %r "
                    "(write [%r])." % (arg, devices, devices))
  return list(devices)


class RoundRobinPlacementMixin:
  """Places each factor's statistics and update ops on devices in
  round-robin order."""

  def __init__(self, cov_devices=None, inv_devices=None, trans_devices=None,
               **kwargs):
    self._cov_devices = _device_list(cov_devices, "cov_devices")
    self._inv_devices = _device_list(inv_devices, "inv_devices")
    self._trans_devices = _device_list(trans_devices, "trans_devices")
    super().__init__(**kwargs)

  def _cov_variable_thunks(self):
    return _round_robin(super()._cov_variable_thunks(), self._cov_devices)

  def _cov_update_thunks(self, scope=None):
    return _round_robin(super()._cov_update_thunks(scope), self._cov_devices)

  def _inv_update_thunks(self, scope=None):
    return _round_robin(super()._inv_update_thunks(scope), self._inv_devices)

  def _per_factor_inverses(self):
    return bool(self._inv_devices) or super()._per_factor_inverses()

