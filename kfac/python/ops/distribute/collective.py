"""Cross-replica reductions and updates of K-FAC under tf.distribute.

K-FAC under a synchronous strategy (MirroredStrategy, MultiWorkerMirrored,
TPUStrategy) keeps one invariant: **every replica holds the same K-FAC
state**. Each replica computes its statistics on its share of the global
batch; before any of them reaches a variable it is reduced across the
replicas (`all_reduce`), so every replica then folds the same value into
its (replica-local) moving averages, computes the same inverses and the
same update. State variables are replica-local (`SyncOnRead`, read from the
first replica in cross-replica context, see tensors/state.py): replicas update
their own copies inside conditionals without talking to each other. The
model's (mirrored) variables change only through `apply_updates`, a
`merge_call` outside any conditional.

Collectives inside a `tf.cond` branch fail under MirroredStrategy
("merge_call called while defining a new graph"), so they are built
unconditionally, every step, except through `cross_replica_cond`, which
leaves the replicas (merge_call), branches once for all of them and runs
the branch's work on every replica again (call_for_each_replica), where
collectives work.
"""

import numpy as np
import tensorflow as tf

from kfac.python.ops.tensors import utils
from kfac.python.ops.distribute import replicas

MEAN = "mean"
SUM = "sum"


def replica_context():
  """The replica context of a step built for several replicas, else None.

  Raises NotImplementedError for strategies whose replicas do not run in
  sync (ParameterServerStrategy), and for K-FAC ops built in a
  cross-replica context (`strategy.scope()` without `strategy.run`).
  """
  if not tf.distribute.has_strategy():
    return None
  strategy = tf.distribute.get_strategy()
  name = type(strategy).__name__
  if "ParameterServer" in name:
    raise NotImplementedError(
        "K-FAC under %s: parameter servers update the variables "
        "asynchronously, one replica at a time, so the replicas cannot "
        "share K-FAC statistics. Use MirroredStrategy or "
        "MultiWorkerMirroredStrategy (synchronous)." % name)
  if strategy.num_replicas_in_sync <= 1:
    return None
  ctx = tf.distribute.get_replica_context()
  if ctx is None:
    raise NotImplementedError(
        "K-FAC ops built in the cross-replica context of %s with %d "
        "replicas: build the training step inside strategy.run(...) (TF2) "
        "or strategy.extended.call_for_each_replica(...) (TF1), so that "
        "each replica computes its own statistics and gradients." %
        (name, strategy.num_replicas_in_sync))
  return ctx


def is_distributed():
  return replica_context() is not None


def num_replicas():
  return replicas.num_replicas_in_sync()


def _pack(tensor, symmetric):
  """A flat vector of `tensor` (the upper triangle of a symmetric matrix)."""
  if symmetric:
    n = int(tensor.shape[-1])
    rows, cols = np.triu_indices(n)
    flat = tf.reshape(tensor, [-1])
    return tf.gather(flat, tf.constant(rows * n + cols, tf.int32))
  return tf.reshape(tensor, [-1])


def _unpack(vector, shape, symmetric):
  if symmetric:
    n = int(shape[-1])
    rows, cols = np.triu_indices(n)
    upper = tf.scatter_nd(
        tf.constant(np.stack([rows, cols], 1), tf.int32), vector, [n, n])
    return upper + tf.transpose(upper) - tf.linalg.diag(
        tf.linalg.diag_part(upper))
  return tf.reshape(vector, shape)


def _size(shape, symmetric):
  n = int(np.prod(shape))
  if symmetric:
    d = int(shape[-1])
    return d * (d + 1) // 2
  return n


def packed_size(tensors, symmetric=None):
  """Elements sent by `all_reduce(tensors, symmetric)`."""
  symmetric = symmetric or [False] * len(tensors)
  return sum(_size(t.shape.as_list(), s) for t, s in zip(tensors, symmetric))


def all_reduce(tensors, op=MEAN, symmetric=None, weight=None):
  """Reduces `tensors` across the replicas with one collective per dtype.

  Args:
    tensors: a list of tensors with static shapes.
    op: MEAN or SUM.
    symmetric: optional list of bools: that tensor is a symmetric [n, n]
      matrix, of which only the upper triangle is sent.
    weight: with op=MEAN, an optional scalar per replica (its batch size):
      the result is sum_r weight_r x_r / sum_r weight_r.

  Returns:
    The reduced tensors, in order (the inputs when not distributed). Under
    several replicas no gradient flows back through the reduction.
  """
  ctx = replica_context()
  tensors = list(tensors)
  if ctx is None or not tensors:
    return tensors
  symmetric = list(symmetric or [False] * len(tensors))
  for t in tensors:
    if not t.shape.is_fully_defined():
      raise ValueError("Cross-replica reduction of %s needs a static shape, "
                       "got %s." % (t.name, t.shape))
  reduce_op = (tf.distribute.ReduceOp.SUM if op == SUM or weight is not None
               else tf.distribute.ReduceOp.MEAN)
  by_dtype = {}
  for i, t in enumerate(tensors):
    by_dtype.setdefault(t.dtype.base_dtype, []).append(i)
  out = [None] * len(tensors)
  for dtype, indices in by_dtype.items():
    parts = [_pack(tensors[i], symmetric[i]) for i in indices]
    if weight is not None:
      w = tf.cast(weight, dtype)
      parts = [p * w for p in parts] + [tf.reshape(w, [1])]
    vector = tf.concat(parts, 0) if len(parts) > 1 else parts[0]
    # K-FAC never differentiates a reduction. TensorFlow wraps a replica
    # context's all_reduce in tf.custom_gradient, whose graph-mode check
    # walks back from the result to find the variables it depends on;
    # under ReductionToOneDevice (a MirroredStrategy made in a TF1 graph or
    # under disable_v2_behavior) each replica's result depends on every
    # replica's input, so the walk entered the other replicas' gradient
    # graphs and failed on their variables ("grad_fn must accept keyword
    # argument 'variables'", or "Unsuccessful at finding variable
    # w/replica_1"). A StopGradient input ends the walk there.
    reduced = ctx.all_reduce(reduce_op, tf.stop_gradient(vector))
    if weight is not None:
      reduced = reduced[:-1] / reduced[-1]
    sizes = [_size(tensors[i].shape.as_list(), symmetric[i])
             for i in indices]
    for i, piece in zip(indices, tf.split(reduced, sizes)):
      out[i] = _unpack(piece, tensors[i].shape.as_list(), symmetric[i])
  return out


def all_reduce_one(tensor, op=MEAN):
  return all_reduce([tensor], op)[0]


def replica_id():
  """The replica's index in its sync group (an int32 tensor; 0 without a
  strategy)."""
  if not tf.distribute.has_strategy():
    return tf.constant(0, tf.int32)
  ctx = tf.distribute.get_replica_context()
  if ctx is None:
    return tf.constant(0, tf.int32)
  return tf.cast(ctx.replica_id_in_sync_group, tf.int32)


def is_distributed_variable(var):
  return isinstance(var, tf.distribute.DistributedValues)


def check_mirrored(variables):
  """Raises ValueError when a variable K-FAC updates under several replicas
  is not a distributed (mirrored) variable."""
  plain = [v.name for v in variables if not is_distributed_variable(v)]
  if plain:
    raise ValueError(
        "K-FAC under %s updates the model's variables on every replica, "
        "but %s %s created outside strategy.scope(): create the model "
        "(and the global step) under the strategy's scope." %
        (type(tf.distribute.get_strategy()).__name__, ", ".join(plain),
         "was" if len(plain) == 1 else "were"))


def apply_updates(updates):
  """Applies `updates`, a list of (fn, variable, args) meaning
  fn(variable, *args), to mirrored variables from the replica context.

  Each replica passes its own args (identical across replicas, as every
  value here has been reduced), and each replica's copy of a variable is
  updated with its own replica's value, so no collective is needed. Must
  not be called inside a tf.cond branch. Returns an op.
  """
  ctx = replica_context()
  if ctx is None:
    return tf.group(*[fn(var, *args) for fn, var, args in updates])
  check_mirrored([var for _, var, _ in updates])
  fns = [fn for fn, _, _ in updates]
  variables = [var for _, var, _ in updates]
  args = [tuple(a) for _, _, a in updates]

  def merge(strategy, variables, args):
    ops = []
    for fn, var, arg in zip(fns, variables, args):
      ops.extend(strategy.experimental_local_results(
          strategy.extended.update(var, fn, args=arg, group=True)))
    return tf.group(*ops)

  return ctx.merge_call(merge, args=(variables, args))


def _collectives_work_in_conditionals():
  """TPUStrategy reduces with cross-replica sums compiled into the step (no
  merge_call), which may sit inside a tf.cond. Not testable here (no TPU):
  the merge_call pattern below is what runs and is tested."""
  return "TPU" in type(tf.distribute.get_strategy()).__name__


def cross_replica_cond(pred, make_op, args=()):
  """An op that runs `make_op(*args)` on every replica when `pred` holds.

  `make_op` may use collectives (`all_reduce`). `pred` must have the same
  value on every replica (K-FAC's predicates come from the replica-local
  step counter, identical by the invariant above). `args`: a tuple of
  (nests of) this replica's tensors; each replica's `make_op` gets its own.
  Without several replicas this is `utils.cond_op`.

  Under a strategy the branch is taken in the cross-replica context
  (merge_call), on replica 0's predicate, and `make_op` runs once per
  replica inside it (call_for_each_replica): MirroredStrategy calls the
  merge function of replica 0 only, so `make_op` must not close over
  per-replica tensors or per-replica attributes: it gets them through
  `args`; it may read variables (a replica-local variable resolves to that
  replica's copy) and `replica_id()`, which is the id of the replica it
  runs for.
  """
  args = tuple(args)
  ctx = replica_context()
  if ctx is None or _collectives_work_in_conditionals():
    return utils.cond_op(pred, lambda: make_op(*args))

  def merge(strategy, pred, *args):
    first = strategy.experimental_local_results(pred)[0]

    def run_on_replicas():
      ops = strategy.extended.call_for_each_replica(make_op, args=args)
      return tf.group(*strategy.experimental_local_results(ops))

    return utils.cond_op(first, run_on_replicas)

  return ctx.merge_call(merge, args=(tf.convert_to_tensor(pred),) + args)
