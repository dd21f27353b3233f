"""KfacOptimizer under several replicas (tf.distribute): what is not
supported yet, the cross-replica sum of the gradients, and the commit of a
step whose model variables are mirrored.

See distribute/collective.py and docs/distributed.md;
`lazy_statistics_sync=True` reduces the statistics only at inversion steps
(distribute/lazy_sync.py), and `placement_strategy="replica_round_robin"`
computes each factor's inverses on one replica
(distribute/inverse_placement.py).
"""

import tensorflow as tf

from kfac.python.ops.distribute import collective
from kfac.python.ops.optimizers import commit
from kfac.python.ops.optimizers import sparse
from kfac.python.ops.tensors import utils


class ReplicatedMixin:
  """The several-replica parts of KfacOptimizer."""

  def _check_distributable(self):
    """Raises NotImplementedError for what does not run on several
    replicas yet."""
    unsupported = []
    if self.config.damping.calibrate_damping:
      unsupported.append(
          "calibrate_damping=True (the calibration tries the update on the "
          "model's variables inside a conditional, where mirrored variables "
          "cannot change; use adapt_damping=True or choose the initial "
          "damping)")
    if self.config.damping.adapt_damping and not self._damping_is_stored:
      unsupported.append(
          "adapt_damping=True with the damping in your variable %s (the "
          "replicas would each adapt it; pass the initial damping as a "
          "number, and K-FAC keeps the adapted one per replica)" %
          utils.variable_name(self._damping))
    if self.config.placement.placement_strategy == "round_robin":
      unsupported.append(
          "placement_strategy='round_robin' (in-graph device placement; "
          "under a strategy each replica places its own ops on its device)")
    if unsupported:
      raise NotImplementedError(
          "%s with several replicas (%s): %s %s not supported yet." %
          (type(self).__name__, type(tf.distribute.get_strategy()).__name__,
           "; ".join(unsupported),
           "is" if len(unsupported) == 1 else "are"))

  def _reduce_gradients(self, grads_and_vars):
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

  def _commit_replicated(self, update, active):
    """`_commit` under several replicas: the K-FAC state (replica-local)
    changes inside the conditions; the model's mirrored variables through
    one merge_call outside them (a zero change when `active` is false).
    The damping rule's conditions include `active`."""
    self._commit_active = active
    with tf.control_dependencies(update.dependencies()):
      before = self._adaptation_before_update(update)
    with tf.control_dependencies(before):
      def state_ops():
        ops = [velocity.assign(value)
               for velocity, value in update.velocity_assigns]
        ops.extend(self._record_ops(update))
        return tf.group(*ops)
      if active is None:
        state_op = state_ops()
      else:
        state_op = utils.cond_op(active, state_ops)
    updates = []
    # (After the decay's reads of the variables, commit.py.)
    with tf.control_dependencies([state_op] + update.decay_inputs()):
      for delta, var in update.deltas:
        delta = tf.identity(sparse.dense(delta))
        if active is not None:
          delta = tf.where(active, delta, tf.zeros_like(delta))
        updates.append((commit.assign_add, var, (delta,)))
    with tf.name_scope("apply_to_replicas"):
      step_op = collective.apply_updates(updates)
    result = self._weight_decay.commit(
        update, self._adaptation_after_update(update, step_op), active)
    self._commit_active = None
    return result
