"""How many replicas run the current step, and per-replica attributes of
objects shared by the replica threads of a MirroredStrategy step.
"""

import threading

import tensorflow as tf


def num_replicas_in_sync():
  """Replicas of the enclosing tf.distribute strategy (1 without one)."""
  if not tf.distribute.has_strategy():
    return 1
  return int(tf.distribute.get_strategy().num_replicas_in_sync)


class PerReplicaAttribute:
  """A data descriptor for per-step attributes of an object shared by the
  replica threads of a MirroredStrategy step (the optimizer's layer
  collection, estimator and passed loss): a value set in a replica thread
  is seen by that thread only; a value set outside any replica thread is
  shared (and seen by threads that have not set their own)."""

  def __set_name__(self, owner, name):
    self._name = "_per_replica" + name

  def _local(self, obj):
    local = obj.__dict__.get(self._name + "_local")
    if local is None:
      local = threading.local()
      obj.__dict__[self._name + "_local"] = local
    return local

  def __get__(self, obj, objtype=None):
    if obj is None:
      return self
    local = self._local(obj)
    if hasattr(local, "value"):
      return local.value
    return obj.__dict__.get(self._name + "_shared")

  def __set__(self, obj, value):
    self._local(obj).value = value
    if not _in_replica_thread():
      obj.__dict__[self._name + "_shared"] = value


def _in_replica_thread():
  """Whether this code runs for one of several replicas."""
  return (num_replicas_in_sync() > 1 and
          tf.distribute.get_replica_context() is not None)
