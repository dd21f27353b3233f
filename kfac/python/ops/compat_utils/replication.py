"""Cross-replica helpers of the old `kfac.utils`, for tf.distribute.

The old library also served TF-Replicator and TPU-rewrite (`tpu.shard`)
contexts; neither exists in TensorFlow 2, so here "replicated" means a
`tf.distribute` replica context with more than one replica in sync. Outside
one every helper acts as the identity (one replica, id 0).
"""

import tensorflow as tf

from kfac.python.ops.distribute import replicas


def _replica_context():
  """The replica context of a strategy's step, else None."""
  if not tf.distribute.has_strategy():
    return None
  return tf.distribute.get_replica_context()


def get_tf_replicator():
  """Always None: TF-Replicator does not exist in TensorFlow 2."""
  return None


def is_tpu_replicated():
  """Whether this runs in a replica context of a TPUStrategy."""
  if _replica_context() is None:
    return False
  return isinstance(tf.distribute.get_strategy(),
                    (tf.distribute.TPUStrategy,
                     tf.distribute.experimental.TPUStrategy))


def is_replicated():
  """Whether this runs in a replica context with more than one replica."""
  return _replica_context() is not None and get_num_replicas() > 1


def get_num_replicas():
  """Replicas in sync of the current strategy (1 without one)."""
  return replicas.num_replicas_in_sync()


def get_replica_id():
  """The id of the current replica (a tensor in a replica context, else 0)."""
  ctx = _replica_context()
  if ctx is None or get_num_replicas() <= 1:
    return 0
  return ctx.replica_id_in_sync_group


def preferred_int_dtype():
  """int32 on TPU replicas (int64 is slow there), else int64."""
  return tf.int32 if is_tpu_replicated() else tf.int64


def generate_random_signs(shape, dtype=tf.float32):
  """A tensor of `shape` with independent entries -1 or +1 (probability
  1/2 each)."""
  ints = tf.random.uniform(shape, maxval=2, dtype=preferred_int_dtype())
  return 2 * tf.cast(ints, dtype) - 1


def _all_reduce(op, structure):
  """`structure` reduced over the replicas, differentiable: the gradient of
  each replica's input is the same reduction of the replicas' gradients of
  the output (as TensorFlow's own all_reduce gradient).

  TensorFlow wraps a replica context's all_reduce in a tf.custom_gradient
  whose graph-mode check walks back from the result to the variables it
  depends on. Where it reduces by ReductionToOneDevice (a MirroredStrategy
  made in a tf.Graph, or after disable_v2_behavior) every replica's result
  depends on every replica's input, and that walk failed on the other
  replicas' variables ("grad_fn must accept keyword argument 'variables'").
  Here the reductions take StopGradient inputs, and the gradient is our own.
  """
  ctx = _replica_context()
  flat = tf.nest.flatten(structure)
  floating = [i for i, t in enumerate(flat)
              if tf.as_dtype(t.dtype).is_floating]
  out = list(flat)
  others = [i for i in range(len(flat)) if i not in floating]
  if others:
    reduced = ctx.all_reduce(op, [tf.stop_gradient(flat[i]) for i in others])
    for i, value in zip(others, reduced):
      out[i] = value

  @tf.custom_gradient
  def reduce_floating(*tensors):
    def grad(*upstream):
      return ctx.all_reduce(op, [
          tf.zeros_like(t) if g is None else tf.stop_gradient(g)
          for t, g in zip(tensors, upstream)])
    return ctx.all_reduce(op, [tf.stop_gradient(t) for t in tensors]), grad

  if floating:
    reduced = reduce_floating(*[flat[i] for i in floating])
    for i, value in zip(floating, tf.nest.flatten(reduced)):
      out[i] = value
  return tf.nest.pack_sequence_as(structure, out)


def all_sum(structure, name=None):
  """Sums a nested structure of tensors over the replicas (identity when
  not replicated)."""
  del name
  if not is_replicated():
    return structure
  return _all_reduce(tf.distribute.ReduceOp.SUM, structure)


def all_average(structure, name=None):
  """Averages a nested structure of tensors over the replicas (identity
  when not replicated)."""
  del name
  if not is_replicated():
    return structure
  return _all_reduce(tf.distribute.ReduceOp.MEAN, structure)


def map_gather(thunks, name=None):
  """Runs each zero-argument thunk and returns their results as a tuple.

  The old library spread the thunks over TPU / TF-Replicator replicas and
  gathered the results; under tf.distribute every replica computes every
  thunk (the results are the same)."""
  del name
  return tuple(thunk() for thunk in thunks)


def smart_assign(variable, value, assign_fn=None, force_cast=False,
                 force_sync=True):
  """`assign_fn(variable, value)`, entering the cross-replica context first
  when called in a replica context of a strategy.

  Args:
    variable: the variable (a distributed variable under a strategy).
    value: the new value; must already be the same on all replicas, except
      that with `force_sync` and a MirroredStrategy it is averaged over the
      replicas first.
    assign_fn: (variable, value) -> op; default `variable.assign`.
      `tf.compat.v1.assign_add` / `assign_sub` style functions work too.
    force_cast: cast `value` to the variable's dtype when they differ.
    force_sync: average `value` over the replicas of a MirroredStrategy.
  """
  if assign_fn is None:
    assign_fn = lambda var, val: var.assign(val)  # pylint: disable=g-long-lambda
  value = tf.convert_to_tensor(value) if not tf.is_tensor(value) else value
  if force_cast and variable.dtype.base_dtype != value.dtype.base_dtype:
    value = tf.cast(value, variable.dtype.base_dtype)
  ctx = _replica_context()
  if ctx is None:
    return assign_fn(variable, value)

  def merge_fn(strategy, var, val):
    if force_sync and isinstance(strategy, tf.distribute.MirroredStrategy):
      val = strategy.reduce(tf.distribute.ReduceOp.MEAN, val, axis=None)
    return strategy.extended.update(var, assign_fn, args=(val,))

  return ctx.merge_call(merge_fn, args=(variable, value))


def smart_cond(predicate, true_fn, false_fn, name=None):
  """`tf.cond(predicate, true_fn, false_fn)`, also where the branches
  synchronise replicas (MirroredStrategy replica context): there the
  condition is evaluated in the cross-replica context and each branch runs
  per replica; the result is then a constant 0.0 (the branches' ops run as
  control dependencies)."""
  ctx = _replica_context()
  if ctx is None or not isinstance(tf.distribute.get_strategy(),
                                   tf.distribute.MirroredStrategy):
    return tf.cond(predicate, true_fn, false_fn, name=name)

  def per_replica(fn):
    def run():
      with tf.control_dependencies([fn()]):
        return tf.constant(0.0)
    return run

  def cross_replica(fn):
    def run():
      return tf.distribute.get_strategy().extended.call_for_each_replica(
          per_replica(fn))
    return run

  def merge_fn(strategy):
    del strategy
    return tf.cond(predicate, cross_replica(true_fn), cross_replica(false_fn),
                   name=name)

  return ctx.merge_call(merge_fn)
