"""Lazy statistics sync: factor statistics reduced across replicas only
when the inverses are recomputed (`lazy_statistics_sync=True`).

The eager sync (the default) all-reduces every factor's mini-batch
statistics at every statistics update. The moving average is linear in the
statistics, so the replicas may instead fold their *local* statistics into a
local accumulator and reduce the accumulator once, right before the
inverses are recomputed. With decay d, k local folds since the last sync
give

    acc = sum_j d^(k-j) (1 - d) x_j,     w = 1 - d^k,

(acc and w both start at zero after a sync; w needs no reduction, it is
the same everywhere), and folding the replicas' mean of acc into the shared
average with decay d^k = 1 - w,

    S <- (1 - w) S + mean_r(acc_r),

is exactly what k eager folds of the reduced statistics give (S is the
zero-debiased sum, cov * weight; the weighted mean uses each replica's
batch size at its last fold, exact when the shard sizes do not change
between syncs). The traffic falls by the number of statistics updates per
inversion (`invert_every / cov_update_every`).

Between syncs the shared moving averages are not updated: whatever reads
them directly at a step sees the average of the last inversion step
(diagonal blocks, the quadratic model's and the damping rule's curvature
products, `get_cov_vars()`). The replicas still agree, but such a model
takes different steps from the eager sync; models whose blocks use only
inverses (Kronecker factors with the default momentum types) take the same
steps up to rounding.

State per factor (replica-local, in the optimizer's StateStore):
`<factor>/local_stat<i>` (one per statistic), `<factor>/local_weight` and
`<factor>/local_examples` (the replica's batch size at its last fold).
"""

import tensorflow as tf

from kfac.python.ops.tensors import utils
from kfac.python.ops.distribute import collective


def fold_op(factor, ema_decay, examples, pairs=None):
  """Folds this replica's statistics (`pairs`, default the factor's
  covariance_statistics()) into its local accumulator (no communication);
  `examples` is the replica's batch size, its weight in the reduction."""
  if pairs is None:
    pairs = factor.covariance_statistics()
  stats = [stat for stat, _ in pairs]
  store = factor.state_store
  accs = [store.get_or_create("%s/local_stat%d" % (factor.name, i),
                              stat.shape, stat.dtype)
          for i, stat in enumerate(stats)]
  weight = store.get_or_create(factor.name + "/local_weight", [],
                               stats[0].dtype)
  count = store.get_or_create(factor.name + "/local_examples", [],
                              tf.float64)
  # For sync_op, which may run in a conditional branch (another replica's
  # closure) and must not touch this step's tensors.
  factor.lazy_sync_state = (accs, weight, count, [sym for _, sym in pairs])
  decay = utils.cast(ema_decay, stats[0].dtype)
  ops = [acc.assign(decay * tf.convert_to_tensor(acc) + (1.0 - decay) * stat)
         for acc, stat in zip(accs, stats)]
  ops.append(weight.assign(decay * tf.convert_to_tensor(weight) +
                           (1.0 - decay)))
  ops.append(count.assign(tf.cast(examples, tf.float64)))
  return tf.group(*ops)


def sync_op(factors):
  """Reduces every factor's accumulator across the replicas (one
  collective per dtype, weighted by the replicas' batch sizes at their last
  fold), folds it into the shared moving averages and resets the
  accumulators. Call in a replica context, outside a plain tf.cond
  (collective.cross_replica_cond)."""
  entries, tensors, symmetric = [], [], []
  for factor in factors:
    state = getattr(factor, "lazy_sync_state", None)
    if state is None:
      raise ValueError(
          "Lazy statistics sync: the inverse update of factor %s was built "
          "before its statistics update; build the statistics (cov) update "
          "ops first." % factor.name)
    accs, weight, count, sym = state
    entries.append((factor, accs, weight))
    tensors.extend(tf.convert_to_tensor(acc) for acc in accs)
    symmetric.extend(sym)
  with tf.name_scope("lazy_statistics_sync"):
    reduced = collective.all_reduce(tensors, collective.MEAN, symmetric,
                                    weight=tf.convert_to_tensor(count))
  ops, start = [], 0
  for factor, accs, weight in entries:
    mine = reduced[start:start + len(accs)]
    start += len(accs)
    w = tf.convert_to_tensor(weight)

    def fold(factor=factor, mine=mine, w=w):
      return factor.make_covariance_assign_op([m / w for m in mine], 1.0 - w)

    # Nothing folded since the last sync: nothing to add.
    folded = utils.cond_op(w > 0, fold)
    with tf.control_dependencies([folded]):
      resets = [acc.assign(tf.zeros_like(acc)) for acc in accs]
      resets.append(weight.assign(tf.zeros_like(weight)))
    ops.append(tf.group(*resets))
  return tf.group(*ops)
