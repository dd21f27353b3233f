"""Cholesky factorizations and inverses that XLA compiles well on CPU (layer 1).

Under `tf.function(jit_compile=True)` on CPU, XLA expands `tf.linalg.cholesky`
into a column loop that is 5-10x slower than TensorFlow's own kernel at
n = 250-1000, and `tf.linalg.cholesky_solve` / `triangular_solve` are slow on
small blocks. The functions here instead split the matrix in halves,
recursively, at trace time (the shape must be static), so that almost all the
work is matrix products, which XLA compiles as fast as TensorFlow runs them;
only blocks of at most `BASE_SIZE` rows go to `tf.linalg.cholesky` and
`tf.linalg.triangular_solve`. Nothing here depends on XLA: the same ops run
without it (and are exact algebra), they are only *chosen* under XLA
(`numerics/linalg.py`). No stored state; float32 and float64 alike.

With A = [[A11, A21^T], [A21, A22]], L = chol(A) and M = L^-1:

  L11 = chol(A11), M11 = L11^-1                      (recursion)
  L21 = A21 M11^T
  L22 = chol(A22 - L21 L21^T), M22 = L22^-1          (recursion)
  M21 = -M22 L21 M11

and A^-1 = M^T M is formed from the triangular blocks of M (`lower_gram`).

Every function also takes a batch of matrices [..., n, n] (a static batch
shape; numerics/batched_inverse.py inverts equal-shaped factors at once):
each matrix of the batch gets the same ops as it would alone.
"""

import tensorflow as tf

# Blocks of at most this many rows are factored by tf.linalg.cholesky (and
# inverted by triangular_solve). Measured on 2 CPU cores, TF 2.21, float32,
# XLA: 16 and 32 are equally fast at n = 256-1000 (32 builds fewer ops), 64
# is 1.5-2.5x slower, because XLA's own Cholesky is slow from about 64 rows.
BASE_SIZE = 32
# lower_gram multiplies blocks of at most this many rows directly (64, 128
# and 256 measured equally fast at n = 256-1000).
GRAM_BASE_SIZE = 128


def _rows(mat):
  """The static number of rows as a Python int (or None), also where the
  shape holds v1 `Dimension`s (tf.compat.v1.disable_v2_behavior)."""
  return tf.compat.dimension_value(mat.shape[-2])


def _batch(mat):
  """The static batch shape (a list, [] for a matrix)."""
  return [tf.compat.dimension_value(d) for d in mat.shape[:-2]]


def _static_order(mat, what):
  """The static number of rows of a square matrix, or a ValueError."""
  shape = mat.shape
  rows = cols = None
  if shape.rank is not None and shape.rank >= 2 and None not in _batch(mat):
    rows, cols = _rows(mat), tf.compat.dimension_value(shape[-1])
  if rows is None or cols is None or rows != cols:
    raise ValueError("%s needs a square matrix of static shape (or a batch "
                     "of them), got shape %s." % (what, shape))
  return rows


def _blocks(m11, m21, m22, upper_right=None):
  """[[m11, upper_right or 0], [m21, m22]]."""
  if upper_right is None:
    upper_right = tf.zeros(_batch(m11) + [_rows(m11), _rows(m22)], m11.dtype)
  return tf.concat([tf.concat([m11, upper_right], -1),
                    tf.concat([m21, m22], -1)], -2)


def _chol_and_inverse(mat, base_size, want_chol=True):
  """(L, L^-1); L is None unless `want_chol` (not assembled: fewer graph
  nodes where only L^-1 is used)."""
  n = _rows(mat)
  if n <= base_size:
    chol = tf.linalg.cholesky(mat)
    eye = tf.eye(n, batch_shape=_batch(mat) or None, dtype=mat.dtype)
    return chol, tf.linalg.triangular_solve(chol, eye, lower=True)
  k = n // 2
  l11, m11 = _chol_and_inverse(mat[..., :k, :k], base_size, want_chol)
  l21 = tf.matmul(mat[..., k:, :k], m11, transpose_b=True)
  schur = mat[..., k:, k:] - tf.matmul(l21, l21, transpose_b=True)
  l22, m22 = _chol_and_inverse(schur, base_size, want_chol)
  m21 = -tf.matmul(m22, tf.matmul(l21, m11))
  chol = _blocks(l11, l21, l22) if want_chol else None
  return chol, _blocks(m11, m21, m22)


def cholesky_and_inverse(mat, base_size=BASE_SIZE, want_chol=True):
  """(L, L^-1) with L the lower Cholesky factor of the SPD matrix `mat`
  (only its lower triangle is read); (None, L^-1) with want_chol=False. A
  matrix that is not positive definite gives non-finite values, as
  tf.linalg.cholesky does on CPU."""
  mat = tf.convert_to_tensor(mat)
  _static_order(mat, "cholesky_and_inverse")
  if int(base_size) < 1:
    raise ValueError("base_size must be at least 1, got %r." % (base_size,))
  return _chol_and_inverse(mat, int(base_size), want_chol)


def cholesky(mat, base_size=BASE_SIZE):
  """Lower Cholesky factor L of the SPD matrix `mat`: L L^T = mat."""
  return cholesky_and_inverse(mat, base_size)[0]


def cholesky_inverse(mat, base_size=BASE_SIZE):
  """L^-1 for the lower Cholesky factor L of the SPD matrix `mat`."""
  return cholesky_and_inverse(mat, base_size, want_chol=False)[1]


def _gram(m, base_size):
  n = _rows(m)
  if n <= base_size:
    return tf.matmul(m, m, transpose_a=True)
  k = n // 2
  m21, m22 = m[..., k:, :k], m[..., k:, k:]
  p11 = (_gram(m[..., :k, :k], base_size) +
         tf.matmul(m21, m21, transpose_a=True))
  p21 = tf.matmul(m22, m21, transpose_a=True)
  return _blocks(p11, p21, _gram(m22, base_size),
                 upper_right=tf.linalg.matrix_transpose(p21))


def lower_gram(m, base_size=GRAM_BASE_SIZE):
  """m^T m for a lower-triangular matrix m (its upper triangle is ignored),
  in about a third of a full product's multiplications."""
  m = tf.convert_to_tensor(m)
  _static_order(m, "lower_gram")
  if int(base_size) < 1:
    raise ValueError("base_size must be at least 1, got %r." % (base_size,))
  return _gram(tf.linalg.band_part(m, -1, 0), int(base_size))


def spd_inverse(mat, base_size=BASE_SIZE, gram_base_size=GRAM_BASE_SIZE):
  """mat^-1 = L^-T L^-1 of the SPD matrix `mat` (lower triangle read)."""
  return lower_gram(cholesky_inverse(mat, base_size), gram_base_size)
