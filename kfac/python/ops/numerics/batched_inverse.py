"""Damped inverses of many factors at once (layer 1).

`damped_inverses([(mat, damping), ...])` returns, for every pair, the value
`linalg.damped_inverse(mat, damping)` returns, with a graph whose size
grows with the number of distinct matrix shapes rather than with the
number of matrices:

* the matrices of one shape and dtype are stacked and factored as one batch
  (tf.linalg.cholesky / cholesky_solve, or the blocked recursion of
  xla_linalg where linalg.use_xla_blocked / use_cpu_blocked choose it for
  one matrix of that shape); each matrix of a batch gets the computation it
  would get alone;
* the float64 fallback (linalg._float32_is_unsafe, or a float32 result
  that is not finite: as damped_inverse decides per matrix) recomputes
  only the matrices that need it: they are gathered into a batch of
  run-time size (usually empty) and scattered back, with no conditional.
  Under XLA, which needs static shapes, it is one conditional for all
  matrices that recomputes them all in float64 when any needs it, each
  then taking its own result. A matrix whose float32 computation is
  skipped (unsafe) is replaced by the identity in the float32 batch, so a
  kernel that raises on a failed factorization is never given it.

A model with hundreds of factors (keras.applications.EfficientNetB0: 362
inverses, 156 of them wider than 256 rows) so builds one factorization per
distinct shape instead of one, and two conditionals, per factor.
"""

import collections

import tensorflow as tf

from kfac.python.ops.numerics import linalg
from kfac.python.ops.numerics import xla_linalg
from kfac.python.ops.tensors import utils


# A damped inverse (mat + damping*I)^-1 to be computed by damped_inverses
# with others (FisherFactor.deferred_inverse_values).
DeferredInverse = collections.namedtuple("DeferredInverse",
                                         ["mat", "damping"])


def _inverse_of_batch(mats, dampings, fallback):
  """(mats + dampings*I)^-1 for a stack [k, n, n] of one dtype, as
  linalg.damped_inverse's inner computation builds it for each matrix."""
  damped = linalg.symmetrize(mats)
  damped = tf.linalg.set_diag(
      damped, tf.linalg.diag_part(damped) + dampings[:, tf.newaxis])
  # The route is chosen as for one matrix (from its static shape).
  one = tf.TensorSpec(mats.shape[-2:], mats.dtype)
  if linalg.use_xla_blocked(one):
    return linalg.symmetrize(xla_linalg.spd_inverse(damped))
  if linalg.use_cpu_blocked(one) and not fallback:
    return linalg.symmetrize(xla_linalg.spd_inverse(
        damped, linalg.CPU_BLOCK_SIZE, linalg.CPU_BLOCK_SIZE))
  chol = tf.linalg.cholesky(damped)
  n = tf.shape(mats)[-1]
  eye = tf.eye(n, batch_shape=tf.shape(mats)[:1], dtype=mats.dtype)
  return linalg.symmetrize(tf.linalg.cholesky_solve(chol, eye))


def _group_key(mat):
  mat.shape.assert_has_rank(2)
  return (tuple(mat.shape.as_list()), mat.dtype.base_dtype)


def damped_inverses(pairs):
  """[(mat + damping*I)^-1 for (mat, damping) in pairs] (see the module
  docstring). Every mat must be a square matrix of static shape."""
  pairs = [(tf.convert_to_tensor(m), d) for m, d in pairs]
  if not pairs:
    return []
  for i, (mat, _) in enumerate(pairs):
    shape = mat.shape
    if not (shape.rank == 2 and shape.is_fully_defined() and
            shape[0] == shape[1]):
      raise ValueError("damped_inverses needs square matrices of static "
                       "shape, got shape %s for matrix %d." % (shape, i))
  groups = collections.OrderedDict()
  for i, (mat, _) in enumerate(pairs):
    groups.setdefault(_group_key(mat), []).append(i)

  stacks = []   # (indices, mats [k, n, n], dampings [k], native, use_native)
  for (_, dtype), idx in groups.items():
    mats = tf.stack([pairs[i][0] for i in idx])
    dampings = tf.stack([utils.cast(pairs[i][1], dtype) for i in idx])
    if dtype == tf.float64:
      stacks.append((idx, mats, dampings,
                     _inverse_of_batch(mats, dampings, False), None))
      continue
    unsafe = linalg._float32_is_unsafe(mats, dampings)  # pylint: disable=protected-access
    n = tf.compat.dimension_value(mats.shape[-1])
    eye = tf.eye(n, batch_shape=[len(idx)], dtype=dtype)
    zeros = tf.zeros([len(idx)], dtype)
    safe_mats = tf.where(unsafe[:, None, None], eye, mats)
    native = _inverse_of_batch(safe_mats, tf.where(unsafe, zeros, dampings),
                               False)
    finite = tf.reduce_all(tf.math.is_finite(native), axis=[-2, -1])
    use_native = tf.logical_and(tf.logical_not(unsafe), finite)
    stacks.append((idx, mats, dampings, native, use_native))

  if utils.in_xla_context():
    recomputed = _float64_in_one_cond(stacks)
  else:
    recomputed = iter([_float64_where_needed(mats, dampings, native, use)
                       for _, mats, dampings, native, use in stacks
                       if use is not None])

  out = [None] * len(pairs)
  for idx, _, _, native, use_native in stacks:
    value = native
    if use_native is not None:
      value = next(recomputed)
    for i, matrix in zip(idx, tf.unstack(value)):
      out[i] = matrix
  return out


def _float64_where_needed(mats, dampings, native, use_native):
  """native, with the matrices that need it recomputed in float64: those
  are gathered (a batch of run-time size, usually empty) and scattered
  back, so a step pays for the fallback of those matrices only."""
  where = tf.where(tf.logical_not(use_native))
  redo = _inverse_of_batch(tf.cast(tf.gather_nd(mats, where), tf.float64),
                           tf.cast(tf.gather_nd(dampings, where), tf.float64),
                           True)
  return tf.tensor_scatter_nd_update(native, where,
                                     tf.cast(redo, native.dtype))


def _float64_in_one_cond(stacks):
  """Under XLA (static shapes): every matrix recomputed in float64 in one
  conditional when any needs it, each taking its own result."""
  flags = [s[4] for s in stacks if s[4] is not None]
  if not flags:
    return iter([])
  need_float64 = tf.logical_not(tf.reduce_all(tf.concat(flags, 0)))

  def in_float64():
    return [tf.cast(_inverse_of_batch(tf.cast(mats, tf.float64),
                                      tf.cast(dampings, tf.float64), True),
                    mats.dtype)
            for _, mats, dampings, _, use in stacks if use is not None]

  def natives():
    return [native for _, _, _, native, use in stacks if use is not None]

  recomputed = tf.cond(need_float64, in_float64, natives)
  if not isinstance(recomputed, (list, tuple)):
    recomputed = [recomputed]
  return iter([tf.where(use[:, None, None], native, redo)
               for (_, _, _, native, use), redo in zip(
                   [s for s in stacks if s[4] is not None], recomputed)])
