"""Carrying out a K-FAC step: the `Update` (optimizers/update.py) becomes
the ops that change the velocities and the variables (with the damping
rule's ops before and after, adaptive/), then the step counters.

A step is built in two halves: `_compute_update` makes the change of every
variable without touching any state, and `Commit.commit` applies it, only
when a boolean `active` holds if one is given (the non-finite guard's
verdict, optimizers/guarded_step.py). A sparse change (`tf.IndexedSlices`)
is applied with `scatter_add` to the touched rows only. Under several
replicas the model's variables change through a merge_call
(`Commit.commit_replicated`; optimizers/replicated.py). `Counters` counts
the steps.
"""

import tensorflow as tf

from kfac.python.ops.adaptive import shared_evaluation
from kfac.python.ops.distribute import collective
from kfac.python.ops.optimizers import sparse
from kfac.python.ops.tensors import utils


def assign_add(var, delta):
  return var.assign_add(delta)


class Commit:
  """The part of the step (optimizers/step.py) that carries out an
  `Update`: `commit` (with the damping rule's ops before and after it and
  the decoupled weight decay after them), `step_op` (one replica, the
  update alone) and `commit_replicated` (several replicas)."""

  def __init__(self, damping, weight_decay, records):
    """damping: the adaptive/damping_controller.DampingController;
    weight_decay: the optimizers/weight_decay.WeightDecay; records: the
    adaptive/records.Records."""
    self._damping = damping
    self._weight_decay = weight_decay
    self._records = records

  def commit(self, update, active=None):
    """The op that carries out `update` (plus the damping rule); with a
    boolean tensor `active`, only when it holds."""
    if collective.is_distributed():
      return self.commit_replicated(update, active)
    if active is not None:
      return utils.cond_op(active, lambda: self.commit(update))
    step_op = self.step_op(update)
    # The decoupled weight decay after the damping rule (weight_decay.py).
    return self._weight_decay.commit(
        update, self._damping.after_update(update, step_op))

  def step_op(self, update):
    """One replica: the damping rule's ops before the update, then the
    velocities' and the variables' changes (an op)."""
    # The damping rule may change the damping before the variables change:
    # only once everything this step computes from it is ready.
    with tf.control_dependencies(update.dependencies()):
      before = self._damping.before_update(update)
    # The decay is computed from the variables before the step: in a TF1
    # graph nothing else orders those reads before the assignments.
    with tf.control_dependencies(before + update.decay_inputs()):
      ops = [velocity.assign(value)
             for velocity, value in update.velocity_assigns]
      for delta, var in update.deltas:
        if sparse.is_slices(delta):
          ops.append(var.scatter_add(delta))
        else:
          ops.append(var.assign_add(delta))
      ops.extend(self._records.ops(update))
      return tf.group(*ops)

  def commit_sharing_evaluation(self, update, trial, active):
    """The commit whose damping rule shares one loss evaluation with the
    calibration's trial (adaptive/shared_evaluation.py)."""
    return shared_evaluation.commit_sharing_evaluation(
        self._damping, self.step_op, self._weight_decay.commit, update,
        trial, active)

  def commit_replicated(self, update, active):
    """`commit` under several replicas: the K-FAC state (replica-local)
    changes inside the conditions; the model's mirrored variables through
    one merge_call outside them (a zero change when `active` is false).
    The damping rule's conditions include `active`."""
    self._damping.commit_active = active
    with tf.control_dependencies(update.dependencies()):
      before = self._damping.before_update(update)
    with tf.control_dependencies(before):
      def state_ops():
        ops = [velocity.assign(value)
               for velocity, value in update.velocity_assigns]
        ops.extend(self._records.ops(update))
        return tf.group(*ops)
      if active is None:
        state_op = state_ops()
      else:
        state_op = utils.cond_op(active, state_ops)
    updates = []
    # (After the decay's reads of the variables, as in step_op.)
    with tf.control_dependencies([state_op] + update.decay_inputs()):
      for delta, var in update.deltas:
        delta = tf.identity(sparse.dense(delta))
        if active is not None:
          delta = tf.where(active, delta, tf.zeros_like(delta))
        updates.append((assign_add, var, (delta,)))
    with tf.name_scope("apply_to_replicas"):
      step_op = collective.apply_updates(updates)
    result = self._weight_decay.commit(
        update, self._damping.after_update(update, step_op), active)
    self._damping.commit_active = None
    return result


class Counters:
  """The step counters (part of the step, optimizers/step.py): `counter`
  (steps taken), `burnin_counter` (burn-in steps of the periodic
  optimizer) and `finish`, which advances them after a step."""

  def __init__(self, store, guard):
    """store: the optimizer's StateStore; guard: its guarded_step.StepGuard
    (which counts skipped steps)."""
    self._store = store
    self._guard = guard

  @property
  def counter(self):
    return self._store.get_or_create("counter", [], tf.int64)

  @property
  def burnin_counter(self):
    return self._store.get_or_create("burnin_counter", [], tf.int64)

  def finish(self, step_op, global_step, active=None, checks=None, ok=None):
    """After `step_op`: counter += 1 and global_step += 1 (with a boolean
    tensor `active`, only when it holds: burn-in steps and skipped steps
    count neither); with the guard's `checks`, the step is counted as
    skipped unless `ok` (nonfinite.NonFiniteGuard.record)."""
    if checks is not None:
      with tf.control_dependencies([step_op]):
        step_op = self._guard.record(ok, checks, self.counter)
    with tf.control_dependencies([step_op] + _global_step_reads(global_step)):
      def one(dtype):
        if active is None:
          return tf.ones([], dtype)
        return tf.cast(active, dtype)
      incs = [self.counter.assign_add(one(tf.int64))]
      if global_step is not None:
        inc = one(global_step.dtype.base_dtype)
        if collective.is_distributed():
          incs.append(collective.apply_updates(
              [(assign_add, global_step, (tf.identity(inc),))]))
        else:
          incs.append(global_step.assign_add(inc))
      return tf.group(*incs)


# tf.compat.v1.train's collection of the global step's cached read (the
# value Estimator's and MonitoredSession's hooks fetch).
_GLOBAL_STEP_READ_KEY = "global_step_read_op_cache"


def _global_step_reads(global_step):
  """The cached read of the graph's global step (TF1), to increment it
  after: the hooks that fetch it beside the training op then see the step
  before the increment in every run, as TensorFlow's own
  _increment_global_step orders it (unordered, either value could be
  read)."""
  if global_step is None or tf.executing_eagerly() or tf.inside_function():
    return []
  graph = tf.compat.v1.get_default_graph()
  if tf.compat.v1.train.get_global_step(graph) is not global_step:
    return []
  return [t for t in graph.get_collection(_GLOBAL_STEP_READ_KEY)
          if isinstance(t, tf.Tensor)]
