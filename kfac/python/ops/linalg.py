"""Dense linear algebra for curvature factors (layer 1).

Everything here builds ops in the current graph (a `tf.Graph` under a
Session or a `FuncGraph` while `tf.function` traces) and holds no state.

Precision: factors are usually float32. Cholesky-based routines switch to a
float64 computation when the damped matrix is too badly conditioned for
float32 (see `_float32_is_unsafe`). The switch is decided *before* the
decomposition from a cheap bound: an ill-conditioned factor then costs one
float64 factorisation instead of a float32 one plus a retry, and the result
does not depend on how a device reports a failed Cholesky (TensorFlow 2.21's
CPU kernel returns NaNs; other kernels and versions raise an error).
"""

import tensorflow as tf

from kfac.python.ops import utils


def symmetrize(mat):
  return 0.5 * (mat + tf.linalg.matrix_transpose(mat))


def add_to_diagonal(mat, value):
  """mat + value * I for a square matrix (value a scalar)."""
  diag = tf.linalg.diag_part(mat)
  value = utils.cast(value, mat.dtype)
  return tf.linalg.set_diag(mat, diag + value)


def _float32_is_unsafe(mat, damping):
  """True when `mat + damping*I` may not factor reliably in `mat.dtype`.

  Cholesky is backward stable: it succeeds when the smallest eigenvalue
  exceeds about n * eps * ||M||. The damped matrix's smallest eigenvalue is at
  least `damping` (mat is PSD up to rounding) and ||M|| <= trace(M).
  """
  if mat.dtype == tf.float64:
    return tf.constant(False)
  n = tf.cast(tf.shape(mat)[-1], mat.dtype)
  eps = tf.constant(1.1920929e-07, mat.dtype)  # float32 machine epsilon
  scale = tf.reduce_sum(tf.abs(tf.linalg.diag_part(mat)))
  return utils.cast(damping, mat.dtype) <= 10.0 * n * eps * scale


def _with_float64_fallback(fn, mat, damping):
  """Runs fn(mat, damping) in mat's dtype, or in float64 when that is unsafe."""
  if mat.dtype == tf.float64:
    return fn(mat, utils.cast(damping, tf.float64))

  def in_float64():
    out = fn(tf.cast(mat, tf.float64), utils.cast(damping, tf.float64))
    return tf.cast(out, mat.dtype)

  def in_native():
    return fn(mat, utils.cast(damping, mat.dtype))

  return tf.cond(_float32_is_unsafe(mat, damping), in_float64, in_native)


def damped_cholesky(mat, damping):
  """Lower Cholesky factor L of (mat + damping*I): L L^T = mat + damping*I."""
  return _with_float64_fallback(
      lambda m, d: tf.linalg.cholesky(add_to_diagonal(symmetrize(m), d)),
      mat, damping)


def damped_inverse(mat, damping):
  """(mat + damping*I)^-1 through a Cholesky factorization."""
  def fn(m, d):
    chol = tf.linalg.cholesky(add_to_diagonal(symmetrize(m), d))
    eye = tf.eye(tf.shape(m)[-1], dtype=m.dtype)
    return symmetrize(tf.linalg.cholesky_solve(chol, eye))
  return _with_float64_fallback(fn, mat, damping)


def damped_cholesky_inverse(mat, damping):
  """L^-1 where L is the lower Cholesky factor of (mat + damping*I)."""
  def fn(m, d):
    chol = tf.linalg.cholesky(add_to_diagonal(symmetrize(m), d))
    eye = tf.eye(tf.shape(m)[-1], dtype=m.dtype)
    return tf.linalg.triangular_solve(chol, eye, lower=True)
  return _with_float64_fallback(fn, mat, damping)


def eigh(mat):
  """Eigendecomposition (eigenvalues, eigenvectors) of a symmetric matrix."""
  return tf.linalg.eigh(symmetrize(mat))


def matpower_from_eigh(evals, evecs, exp, damping, clip_negative=True):
  """V diag((e + damping)^exp) V^T from a precomputed eigendecomposition.

  With `clip_negative`, eigenvalues below zero (rounding noise of a PSD
  matrix) are set to zero before damping is added.
  """
  if clip_negative:
    evals = tf.maximum(evals, 0.0)
  shifted = evals + utils.cast(damping, evals.dtype)
  powered = tf.pow(shifted, utils.cast(exp, evals.dtype))
  return tf.matmul(evecs * powered[tf.newaxis, :], evecs, transpose_b=True)


def damped_matpower(mat, exp, damping):
  """(mat + damping*I)^exp for a symmetric PSD matrix, any real exponent."""
  if exp == 1:
    return add_to_diagonal(mat, damping)
  if exp == -1:
    return damped_inverse(mat, damping)
  evals, evecs = eigh(mat)
  return matpower_from_eigh(evals, evecs, exp, damping)


def diagonal_matpower(diag, exp, damping):
  """Elementwise (diag + damping)^exp: the power of a damped diagonal matrix."""
  shifted = diag + utils.cast(damping, diag.dtype)
  if exp == 1:
    return shifted
  if exp == -1:
    return 1.0 / shifted
  return tf.pow(shifted, utils.cast(exp, diag.dtype))


def kronecker_product(mat1, mat2):
  """Dense Kronecker product (for tests and `full_fisher_block`)."""
  m1, n1 = tf.unstack(tf.shape(mat1))
  m2, n2 = tf.unstack(tf.shape(mat2))
  prod = mat1[:, tf.newaxis, :, tf.newaxis] * mat2[tf.newaxis, :, tf.newaxis, :]
  return tf.reshape(prod, [m1 * m2, n1 * n2])
