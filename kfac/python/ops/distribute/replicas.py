"""How many replicas run the current step, and the single-replica guard.

K-FAC state (factor statistics, inverses, damping, velocities, counters) is
only correct when every replica holds the same values: each replica must
precondition with statistics gathered over the global batch and apply the
same update. This version does not reduce the statistics across replicas,
so a step built under a tf.distribute strategy with more than one replica
(TF1 `call_for_each_replica`, TF2 `strategy.run`, or a cross-replica
`strategy.scope()`) would let the replicas' weights drift apart with no
error. `require_single_replica` turns that into a clear error.
"""

import tensorflow as tf


def num_replicas_in_sync():
  """Replicas of the enclosing tf.distribute strategy (1 without one)."""
  if not tf.distribute.has_strategy():
    return 1
  return int(tf.distribute.get_strategy().num_replicas_in_sync)


def require_single_replica(what):
  """Raises NotImplementedError when `what` is built for several replicas.

  Args:
    what: the operation being built, for the message (e.g.
      "KfacOptimizer.apply_gradients").
  """
  replicas = num_replicas_in_sync()
  if replicas > 1:
    strategy = type(tf.distribute.get_strategy()).__name__
    raise NotImplementedError(
        "%s under %s with %d replicas: this version of kfac does not reduce "
        "the factor statistics across replicas, so each replica would "
        "precondition with its own statistics and the replicas' weights "
        "would drift apart. Run K-FAC with one replica (no strategy, "
        "OneDeviceStrategy, or a strategy over one device); for several "
        "devices in one graph, use placement_strategy='round_robin' with "
        "cov_devices / inv_devices." % (what, strategy, replicas))
