"""The non-finite guard: a bad batch must not destroy the K-FAC state.

A step whose loss, gradients or new curvature statistics hold a NaN or an
Inf changes nothing: not the factor statistics, inverses, velocities,
damping or counters, and not the model's variables. It is counted instead
(`skipped_steps`, and `consecutive_skipped_steps` since the last good step).
A step whose inputs are finite but whose update of a variable is not (an
overflow: a learning rate far too large) is not applied either; the
statistics and inverses it computed from finite values are kept. The
first skipped step prints a warning that lists what was not finite, and
after `max_consecutive` skipped steps in a row the step raises
`tf.errors.InvalidArgumentError` with the same list (a run that only
produces NaNs has diverged: more skipping would hide it).

Everything is built into the step's graph (one `session.run` / one traced
call per step): the flags are a few reductions over tensors the step
computes anyway. Under XLA (`jit_compile=True`), which compiles neither
prints nor assertions, the guard still skips and counts but neither warns
nor raises; read `skipped_steps`.

Several replicas: the guard's decision must be the same on every replica,
so it is taken on reduced values (the summed gradients, the reduced
statistics), never on one replica's loss alone.
"""

import sys

import tensorflow as tf

from kfac.python.ops.tensors import utils


def _float_values(tensors):
  for t in tensors:
    if t is None:
      continue
    if isinstance(t, tf.IndexedSlices):
      t = t.values
    t = tf.convert_to_tensor(t)
    if t.dtype.is_floating or t.dtype.is_complex:
      yield t


def _all(flags):
  """tf.reduce_all over every axis, with the axes a shared constant (one
  per graph and rank: a model's hundreds of checked tensors share them)."""
  rank = flags.shape.rank
  if rank is None:
    return tf.reduce_all(flags)
  if rank == 0:
    return flags
  return tf.raw_ops.All(input=flags, axis=utils.shared_constant(
      list(range(rank)), tf.int32), keep_dims=False)


def finite_flag(tensors):
  """A boolean scalar: every entry of every (floating) tensor is finite."""
  flags = [_all(tf.math.is_finite(t))
           for t in _float_values(utils.ensure_sequence(tensors))]
  if not flags:
    return tf.constant(True)
  if len(flags) == 1:
    return flags[0]
  return tf.reduce_all(tf.stack(flags))


def guarded_op(tensors, make_op):
  """An op that runs make_op() only when every entry of `tensors` is
  finite."""
  return tf.group(utils.cond_op(finite_flag(tensors), make_op))


def assign_if_finite(var, value):
  """var.assign(value) when every entry of value is finite; otherwise the
  variable keeps its value (an inverse that failed keeps the previous one).
  Returns the assign op."""
  value = tf.cast(value, var.dtype)
  keep = tf.logical_not(finite_flag([value]))
  return var.assign(tf.where(keep, tf.convert_to_tensor(var), value),
                    read_value=False)


class Checks:
  """Named groups of tensors whose finiteness decides a step."""

  def __init__(self):
    self._labels = []
    self._flags = []

  def add(self, label, tensors):
    """Adds a group; `label` names it in messages ("loss", "gradient of
    dense/kernel", ...). A flag tensor may be added as is with
    add_flag."""
    self.add_flag(label, finite_flag(tensors))

  def add_flag(self, label, flag):
    self._labels.append(label)
    self._flags.append(tf.convert_to_tensor(flag))

  def __bool__(self):
    return bool(self._flags)

  def stacked(self):
    """The groups' flags as one boolean vector (made once per set of
    groups and graph: a conditional that reads it captures one tensor,
    not one per group)."""
    graph = tf.compat.v1.get_default_graph()
    key = (len(self._flags), graph,
           graph._get_control_flow_context())  # pylint: disable=protected-access
    if getattr(self, "_stacked", (None,))[0] != key:
      self._stacked = (key, tf.stack(self._flags))
    return self._stacked[1]

  def ok(self):
    """True when every group is finite."""
    if not self._flags:
      return tf.constant(True)
    return tf.reduce_all(self.stacked())

  def describe_failures(self, stacked=None):
    """A string tensor listing the groups that are not finite (`stacked`:
    the flags as `stacked()` made them, e.g. outside a conditional)."""
    if not self._flags:
      return tf.constant("")
    bad = tf.logical_not(self.stacked() if stacked is None else stacked)
    return tf.strings.reduce_join(
        tf.boolean_mask(tf.constant(self._labels), bad), separator=", ")


class NonFiniteGuard:
  """The guard's counters (in a StateStore, so checkpoints keep them) and
  the bookkeeping op of a step."""

  def __init__(self, store, max_consecutive, name="KFAC"):
    if (not isinstance(max_consecutive, int) or
        isinstance(max_consecutive, bool) or max_consecutive < 1):
      raise ValueError(
          "max_consecutive_skipped_steps must be an integer >= 1, got %r." %
          (max_consecutive,))
    self._store = store
    self._max = max_consecutive
    self._name = name

  @property
  def skipped_steps(self):
    """How many steps were skipped in all."""
    return self._store.get_or_create("skipped_steps", [], tf.int64)

  @property
  def consecutive_skipped_steps(self):
    """How many steps were skipped since the last step that was taken."""
    return self._store.get_or_create("consecutive_skipped_steps", [],
                                     tf.int64)

  @property
  def max_consecutive(self):
    return self._max

  def record(self, ok, checks, step):
    """The op that counts this step (skipped unless `ok`), warns at the
    first skipped step and raises after `max_consecutive` in a row. `step`
    is the optimizer's counter (the step that was or would have been
    taken)."""
    skipped = self.skipped_steps
    consecutive = self.consecutive_skipped_steps
    ok = tf.convert_to_tensor(ok)
    bad = tf.logical_not(ok)
    # Read before the assignments (a TF1 graph does not order them).
    prev_total = tf.identity(tf.convert_to_tensor(skipped))
    new_run = tf.where(ok, tf.constant(0, tf.int64),
                       tf.convert_to_tensor(consecutive) + 1)
    with tf.control_dependencies([prev_total, new_run]):
      ops = [skipped.assign_add(tf.cast(bad, tf.int64), read_value=False),
             consecutive.assign(new_run, read_value=False)]
    if utils.in_xla_context():
      return tf.group(*ops)
    # The flags read by the messages' conditionals: one tensor.
    flags = checks.stacked() if checks else None

    def message():
      return tf.strings.join([
          "%s: skipped step " % self._name,
          tf.strings.as_string(tf.cast(step, tf.int64)),
          " (not applied): not finite: ", checks.describe_failures(flags)])

    def warn():
      return tf.print(
          "WARNING: kfac:", message(),
          "- skipped steps are counted in skipped_steps; the run stops "
          "after %d in a row." % self._max, output_stream=sys.stderr)

    def stop():
      return tf.debugging.Assert(
          tf.constant(False),
          ["kfac: %d consecutive steps had non-finite values; the run has "
           "diverged (or its data is bad). Last:" % self._max, message(),
           "Lower the learning rate, raise the damping, or check the input "
           "pipeline."], summarize=1)

    # The messages are built only when they are needed.
    ops.append(utils.cond_op(tf.logical_and(bad, tf.equal(prev_total, 0)),
                             warn))
    with tf.control_dependencies(ops):
      stopped = utils.cond_op(tf.greater_equal(new_run, self._max), stop)
    return tf.group(stopped, *ops)
