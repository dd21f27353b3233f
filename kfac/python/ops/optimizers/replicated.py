"""KfacOptimizer under several replicas (tf.distribute): what is not
supported yet, the cross-replica sum of the gradients, and the commit of a
step whose model variables are mirrored (its commit:
optimizers/step.Commit.commit_replicated).

See distribute/collective.py and docs/distributed.md;
`lazy_statistics_sync=True` reduces the statistics only at inversion steps
(distribute/lazy_sync.py), and `placement_strategy="replica_round_robin"`
computes each factor's inverses on one replica
(distribute/inverse_placement.py).
"""

import tensorflow as tf

from kfac.python.ops.distribute import collective
from kfac.python.ops.tensors import utils


def check_distributable(owner, settings, damping_variable=None):
  """Raises NotImplementedError for what does not run on several replicas
  yet. owner: the optimizer's class name; settings: its config.KfacConfig;
  damping_variable: the user's damping variable it adapts, if any."""
  unsupported = []
  if settings.damping.calibrate_damping:
    unsupported.append(
        "calibrate_damping=True (the calibration tries the update on the "
        "model's variables inside a conditional, where mirrored variables "
        "cannot change; use adapt_damping=True or choose the initial "
        "damping)")
  if settings.damping.adapt_damping and damping_variable is not None:
    unsupported.append(
        "adapt_damping=True with the damping in your variable %s (the "
        "replicas would each adapt it; pass the initial damping as a "
        "number, and K-FAC keeps the adapted one per replica)" %
        utils.variable_name(damping_variable))
  if settings.placement.placement_strategy == "round_robin":
    unsupported.append(
        "placement_strategy='round_robin' (in-graph device placement; "
        "under a strategy each replica places its own ops on its device)")
  if unsupported:
    raise NotImplementedError(
        "%s with several replicas (%s): %s %s not supported yet." %
        (owner, type(tf.distribute.get_strategy()).__name__,
         "; ".join(unsupported),
         "is" if len(unsupported) == 1 else "are"))


def reduce_gradients(grads_and_vars):
  """Sums the replicas' gradients (tf.compat.v1 Optimizer convention:
  each replica's loss is scaled so that the sum is the global one, e.g.
  by 1 / num_replicas for a mean loss; `compute_gradients` does this under
  an Estimator). Dense tensors: one collective per dtype."""
  if not collective.is_distributed():
    return grads_and_vars
  grads = [tf.convert_to_tensor(g) for g, _ in grads_and_vars]
  with tf.name_scope("cross_replica_gradients"):
    grads = collective.all_reduce(grads, collective.SUM)
  return [(g, v) for g, (_, v) in zip(grads, grads_and_vars)]
