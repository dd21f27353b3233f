"""The curvature scale: the mean eigenvalue of the K-FAC curvature matrix.

For a Kronecker block A (x) G the eigenvalues are the products of the
factors' eigenvalues, so their mean is (tr A / dim A) (tr G / dim G) times
the block's renormalisation coefficient; for a diagonal or full block it is
trace / dim of its one factor. The curvature scale averages these block
means weighted by the blocks' parameter counts, which is trace(B) / dim(B)
of the whole block-diagonal matrix B (exactly, for the blocks whose
eigenvalue count equals their parameter count). It costs a sum of diagonals
per factor: no decomposition.

The damping rule's floor relative to it (`relative_min_damping` r: the
damping never falls below r * curvature_scale) is measured in
docs/recipe.md: a fixed floor cannot serve losses whose curvature differs by
orders of magnitude (a mean cross-entropy and a cross-entropy summed over
784 pixels), a relative one can.
"""

import numpy as np
import tensorflow as tf

from kfac.python.ops.tensors import utils


def _mean_of(trace):
  return tf.reduce_mean(utils.cast(trace, tf.float64))


def _param_count(block):
  params = utils.ensure_sequence(block.params)
  return sum(int(np.prod(p.shape.as_list())) for p in params)


def block_mean_eigenvalue(block):
  """(mean eigenvalue of the block's undamped curvature as a float64
  scalar, or None when the block's kind is not known here)."""
  # pylint: disable=protected-access
  left = getattr(block, "_input_factor", None)
  right = getattr(block, "_output_factor", None)
  if left is not None and right is not None:
    mean = _mean_of(left.normalized_trace()) * _mean_of(
        right.normalized_trace())
    coeff = getattr(block, "_renorm_coeff", 1.0)
    return mean * utils.cast(coeff, tf.float64)
  factor = getattr(block, "_factor", None)
  if factor is not None and hasattr(factor, "normalized_trace"):
    return _mean_of(factor.normalized_trace())
  return None


def _block_terms(block):
  """(factors whose mean normalized traces multiply, coefficient) of a
  block of a known kind (as block_mean_eigenvalue), or None."""
  # pylint: disable=protected-access
  left = getattr(block, "_input_factor", None)
  right = getattr(block, "_output_factor", None)
  if left is not None and right is not None:
    return [left, right], getattr(block, "_renorm_coeff", 1.0)
  factor = getattr(block, "_factor", None)
  if factor is not None and hasattr(factor, "normalized_trace"):
    return [factor], 1.0
  return None


def curvature_scale(blocks):
  """trace / dim of the block-diagonal K-FAC curvature over `blocks`
  (float64 scalar; 0 when no block is of a known kind).

  The sum over blocks of block_mean_eigenvalue * parameter count, built
  as a few vector ops: one normalized trace per distinct factor, stacked,
  and the blocks' products gathered from it (per block ops made this a
  few thousand graph nodes on ResNet50, built on each use)."""
  traces, index = [], {}
  rows = []  # ([trace indices], coefficient, parameter count)
  for block in blocks:
    terms = _block_terms(block)
    if terms is None:
      continue
    factors, coeff = terms
    ids = []
    for factor in factors:
      if id(factor) not in index:
        index[id(factor)] = len(traces)
        traces.append(factor.normalized_trace())
      ids.append(index[id(factor)])
    rows.append((ids, coeff, _param_count(block)))
  if not rows:
    return tf.constant(0.0, tf.float64)
  count = float(sum(size for _, _, size in rows))
  means = _stacked_means(traces)
  one = len(traces)  # the index of a 1 appended for one-factor blocks
  means = tf.concat([means, tf.ones([1], tf.float64)], axis=0)
  left = tf.gather(means, [ids[0] for ids, _, _ in rows])
  right = tf.gather(means, [ids[1] if len(ids) > 1 else one
                            for ids, _, _ in rows])
  products = left * right
  if all(utils.is_python_number(c) for _, c, _ in rows):
    weights = np.array([float(c) * size for _, c, size in rows], np.float64)
    return tf.reduce_sum(products * weights) / count
  coeffs = tf.stack([utils.cast(c, tf.float64) for _, c, _ in rows])
  sizes = np.array([float(size) for _, _, size in rows], np.float64)
  return tf.reduce_sum(products * coeffs * sizes) / count


def _stacked_means(traces):
  """The float64 means of `traces` as one vector: scalars stacked per dtype
  and cast once, the others (per-channel traces) reduced one by one."""
  out = [None] * len(traces)
  groups = {}
  for i, trace in enumerate(traces):
    trace = tf.convert_to_tensor(trace)
    if trace.shape.rank == 0:
      groups.setdefault(trace.dtype, []).append((i, trace))
    else:
      out[i] = _mean_of(trace)
  positions = []
  parts = []
  for members in groups.values():
    positions.extend(i for i, _ in members)
    parts.append(utils.cast(tf.stack([t for _, t in members]), tf.float64))
  others = [i for i in range(len(traces)) if out[i] is not None]
  if others:
    positions.extend(others)
    parts.append(tf.stack([out[i] for i in others]))
  values = tf.concat(parts, axis=0) if len(parts) > 1 else parts[0]
  order = np.argsort(np.array(positions))
  if np.array_equal(order, np.arange(len(traces))):
    return values
  return tf.gather(values, order)
