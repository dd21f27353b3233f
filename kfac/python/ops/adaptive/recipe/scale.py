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


def curvature_scale(blocks):
  """trace / dim of the block-diagonal K-FAC curvature over `blocks`
  (float64 scalar; 0 when no block is of a known kind)."""
  total, count = [], 0
  for block in blocks:
    mean = block_mean_eigenvalue(block)
    if mean is None:
      continue
    size = _param_count(block)
    total.append(mean * float(size))
    count += size
  if not total:
    return tf.constant(0.0, tf.float64)
  return tf.add_n(total) / float(count)
