"""Where the Fisher estimator's update ops run: the placement policies.

A policy is an object the estimator's parts consult when they build the
update thunks (`Statistics`, `Inverses`: estimator.py); the estimator gets
one from the table of strategies.py by `placement_strategy`. Every policy answers

* `place_statistics(thunks)`: the statistics thunks (variables and
  updates, one per factor), placed;
* `inverse_thunks(factors, thunks, scope)`: the per-factor inverse update
  thunks, possibly replaced (computed elsewhere and sent here);
* `place_inverses(thunks)`: those thunks (after the lazy statistics sync),
  placed;
* `per_factor_inverses()`: whether the inverse update must be built factor
  by factor (not batched by shape, numerics/batched_inverse.py);
* `uses_collectives()`: whether the inverse updates talk to other replicas.

`Replicated` (the plain estimator) builds everything where the caller's
device scope puts it; every replica computes every inverse itself.

`RoundRobin` puts the covariance variables and update op of factor i on
`cov_devices[i % len(cov_devices)]` and its inverse update op on
`inv_devices[i % len(inv_devices)]` (the inverse variables stay where the
caller's device scope puts them, next to the preconditioning);
`trans_devices` is accepted for compatibility (this version has no separate
transformation ops). Devices are ordinary TensorFlow device strings
("/cpu:0", "/gpu:1", ...). Without devices it is `Replicated`.

`ReplicaRoundRobin` (distribute/inverse_placement.py) computes each
factor's inverses on one replica of a tf.distribute strategy and broadcasts
them.
"""

import tensorflow as tf

from kfac.python.ops.distribute import inverse_placement

ReplicaRoundRobin = inverse_placement.ReplicaRoundRobin

PLACEMENT_KWARGS = ("cov_devices", "inv_devices", "trans_devices")


class Replicated:
  """Every update op where the caller's device scope puts it."""

  def place_statistics(self, thunks):
    return thunks

  def inverse_thunks(self, factors, thunks, scope):  # pylint: disable=unused-argument
    return thunks

  def place_inverses(self, thunks):
    return thunks

  def per_factor_inverses(self):
    return False

  def uses_collectives(self):
    return False


class RoundRobin:
  """Each factor's statistics and inverse update ops on devices in
  round-robin order (module docstring)."""

  def __init__(self, cov_devices=None, inv_devices=None, trans_devices=None):
    self.cov_devices = _device_list(cov_devices, "cov_devices")
    self.inv_devices = _device_list(inv_devices, "inv_devices")
    self.trans_devices = _device_list(trans_devices, "trans_devices")

  def place_statistics(self, thunks):
    return _round_robin(thunks, self.cov_devices)

  def inverse_thunks(self, factors, thunks, scope):  # pylint: disable=unused-argument
    return thunks

  def place_inverses(self, thunks):
    return _round_robin(thunks, self.inv_devices)

  def per_factor_inverses(self):
    return bool(self.inv_devices)

  def uses_collectives(self):
    return False


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
