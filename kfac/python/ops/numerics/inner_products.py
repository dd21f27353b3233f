"""Inner products of lists of tensors in float64 (layer 1).

The quadratic model's coefficients (adaptive/quadratic_model.py) come from inner
products of the gradient g, the preconditioned gradient p and the previous
update d, one list of tensors per vector (a tensor per variable). They are
taken in float64: a float32 input's products are then exact and the sums
keep 53 bits, so the 2 x 2 solve is not spoiled by the cancellation of
nearly parallel p and d.

`gram64` takes every pair of k vectors at once. For a small variable it
stacks the k flattened entries and takes one [k, n] x [n, k] product (k + 3
graph ops per variable, where a product per pair would take 4 per pair). A
float64 product with k = 3 rows runs far below the machine's rate, though:
from 16,384 entries on (SEPARATE_PAIRS_MIN) each pair's elementwise product
and sum is faster (one thread, k = 3: 221,184 entries 0.75 against 1.91 ms,
409,600 entries 1.23 against 3.55 ms; equal at 4,096), at k(k+1)/2 + k more
ops. EfficientNetB0's 4 M parameters took 31 ms of a 728 ms K-FAC step in
the stacked product alone.
"""

import tensorflow as tf

from kfac.python.ops.tensors import utils

# Variables with at least this many entries (static) take the per-pair path.
SEPARATE_PAIRS_MIN = 16384


def inner64(a, b):
  """sum(a * b) in float64."""
  return tf.reduce_sum(utils.cast(a, tf.float64) * utils.cast(b, tf.float64))


def sum_inner64(xs, ys):
  """sum_i <xs[i], ys[i]> in float64."""
  return tf.add_n([inner64(x, y) for x, y in zip(xs, ys)])


def _size(parts):
  """The static number of entries of each of `parts` (None if unknown)."""
  sizes = {t.shape.num_elements() for t in parts}
  return sizes.pop() if len(sizes) == 1 else None


def gram64(vectors):
  """[[<u, v> for v in vectors] for u in vectors] in float64, where each
  vector is a list of tensors aligned with the others (one per variable)."""
  k = len(vectors)
  flat = tf.constant([-1], tf.int32)
  stacked = []                                   # [k, k] per small variable
  pairs = {(i, j): [] for i in range(k) for j in range(i, k)}
  for parts in zip(*vectors):
    parts = [tf.convert_to_tensor(t) for t in parts]
    size = _size(parts)
    if size is not None and size >= SEPARATE_PAIRS_MIN:
      rows = [utils.cast(tf.reshape(t, flat), tf.float64) for t in parts]
      for (i, j), sums in pairs.items():
        sums.append(tf.reduce_sum(rows[i] * rows[j]))
      continue
    if len({t.dtype for t in parts}) > 1:
      parts = [tf.cast(t, tf.float64) for t in parts]
    rows = tf.cast(tf.stack([tf.reshape(t, flat) for t in parts]),
                   tf.float64)
    stacked.append(tf.matmul(rows, rows, transpose_b=True))
  total = tf.add_n(stacked) if stacked else None

  def entry(i, j):
    lo, hi = min(i, j), max(i, j)
    terms = list(pairs[(lo, hi)])
    if total is not None:
      terms.append(total[i, j])
    return tf.add_n(terms) if len(terms) > 1 else terms[0]

  sums = {}
  for i in range(k):
    for j in range(i, k):
      sums[(i, j)] = entry(i, j)
  return [[sums[(min(i, j), max(i, j))] for j in range(k)] for i in range(k)]
