"""Dense linear algebra for curvature factors (layer 1).

Everything here builds ops in the current graph (a `tf.Graph` under a
Session or a `FuncGraph` while `tf.function` traces) and holds no state.

Precision: factors are usually float32. Cholesky-based routines switch to a
float64 computation when the damped matrix is too badly conditioned for
float32 (see `_float32_is_unsafe`). The switch is decided *before* the
decomposition from a cheap bound: an ill-conditioned factor then costs one
float64 factorisation instead of a float32 one plus a retry, and the result
does not depend on how a device reports a failed Cholesky (TensorFlow 2.21's
CPU kernel returns NaNs; other kernels and versions raise an error). A
float32 result that is not finite anyway is recomputed in float64; one
that is still not finite is not stored (the factor keeps its previous
inverse: FisherFactor.make_inverse_update_ops).

Under XLA (jit_compile=True) on CPU the Cholesky routines build
`xla_linalg`'s blocked recursion instead of tf.linalg.cholesky /
cholesky_solve, which XLA compiles into slow loops (`use_xla_blocked`); the
float64 fallback is the same. Without XLA, on CPU, damped inverses wider than
CPU_BLOCKED_MIN rows use the same recursion with blocks of up to
CPU_BLOCK_SIZE rows (`use_cpu_blocked`): TensorFlow's CPU triangular solves
(two per cholesky_solve) run far below its matrix products. Their rare
float64 fallback there is cholesky_solve (fewer graph nodes).
"""

import tensorflow as tf

from kfac.python.ops.tensors import utils
from kfac.python.ops.numerics import xla_linalg


def symmetrize(mat):
  """(mat + mat^T) / 2 (of the last two axes), with shared constants."""
  mat = tf.convert_to_tensor(mat)
  rank = mat.shape.rank
  if rank is None:
    return 0.5 * (mat + tf.linalg.matrix_transpose(mat))
  perm = list(range(rank - 2)) + [rank - 1, rank - 2]
  transposed = tf.raw_ops.Transpose(
      x=mat, perm=utils.shared_constant(perm, tf.int32))
  return utils.shared_constant(0.5, mat.dtype) * (mat + transposed)


def add_to_diagonal(mat, value):
  """mat + value * I for a square matrix (value a scalar)."""
  diag = tf.linalg.diag_part(mat)
  value = utils.cast(value, mat.dtype)
  return tf.linalg.set_diag(mat, diag + value)


def _float32_is_unsafe(mat, damping):
  """True when `mat + damping*I` may not factor reliably in `mat.dtype`.

  Cholesky is backward stable: it succeeds when the smallest eigenvalue
  exceeds about n * eps * ||M||_2. The damped matrix's smallest eigenvalue is
  at least `damping` (mat is PSD up to rounding), and ||M||_2 is at most both
  trace(M) (M PSD) and the largest absolute row sum (M symmetric). The row
  sum is the smaller one for factors whose units are weakly correlated
  (the deep autoencoder's output-gradient factors: 4-40x smaller than the
  trace; its activation factors, with their bias column: about the same),
  which then stay in float32.
  """
  if mat.dtype == tf.float64:
    return tf.constant(False)
  # (A batch [..., n, n] with dampings [...] gets one flag per matrix.)
  n = tf.cast(tf.shape(mat)[-1], mat.dtype)
  eps = tf.constant(1.1920929e-07, mat.dtype)  # float32 machine epsilon
  trace = tf.reduce_sum(tf.abs(tf.linalg.diag_part(mat)), axis=-1)
  row_sum = tf.reduce_max(tf.reduce_sum(tf.abs(mat), axis=-1), axis=-1)
  scale = tf.minimum(trace, row_sum)
  return utils.cast(damping, mat.dtype) <= 10.0 * n * eps * scale


def _with_float64_fallback(fn, mat, damping):
  """Runs fn(mat, damping) in mat's dtype, or in float64 when that is unsafe
  (then as fn(mat, damping, fallback=True))."""
  if mat.dtype == tf.float64:
    return fn(mat, utils.cast(damping, tf.float64))

  def in_float64():
    out = fn(tf.cast(mat, tf.float64), utils.cast(damping, tf.float64),
             fallback=True)
    return tf.cast(out, mat.dtype)

  # float32 when the bound passes, float64 otherwise, and also when the
  # float32 result is not finite anyway (e.g. a factor with entries near
  # float32's range). Each computation is built once (one float32 and one
  # float64 copy: XLA compiles every branch).
  unsafe = _float32_is_unsafe(mat, damping)
  if unsafe.shape.rank:  # a batch of matrices: all in float64 if one is
    unsafe = tf.reduce_any(unsafe)
  native = tf.cond(unsafe, lambda: tf.zeros_like(mat),
                   lambda: fn(mat, utils.cast(damping, mat.dtype)))
  use_native = tf.logical_and(tf.logical_not(unsafe),
                              tf.reduce_all(tf.math.is_finite(native)))
  return tf.cond(use_native, lambda: native, in_float64)


def _accelerator_visible():
  return bool(tf.config.list_logical_devices("GPU") or
              tf.config.list_logical_devices("TPU"))


def use_xla_blocked(mat):
  """Whether the Cholesky routines below build `xla_linalg`'s blocked
  factorization for `mat` instead of tf.linalg.cholesky / cholesky_solve:
  while XLA compiles the ops built now (jit_compile=True), on a machine
  without a GPU or TPU (XLA's own CPU Cholesky is 5-10x slower than
  TensorFlow's kernel from n = 250; on accelerators XLA calls the vendor
  solver), for a matrix whose shape is static. Decided at graph-build time."""
  return (mat.shape.rank == 2 and mat.shape.is_fully_defined() and
          utils.in_xla_context() and not _accelerator_visible())


# Measured on 2 CPU cores, TF 2.21, float32, best of 5 in a Session:
# cholesky + cholesky_solve against the recursion with blocks of 256 rows:
# n = 251: 1.4 / 1.3 ms, 501: 9.9 / 5.5, 785: 21.4 / 12.8, 1001: 41.2 /
# 21.2 (blocks of 128: 1.1-1.6x slower from n = 785; of 32, thousands of
# small ops, slowed a whole training step).
# The CPU path's lower_gram (A^-1 = M^T M) takes blocks of CPU_BLOCK_SIZE
# too: as fast as 128 (1 thread: 25.3 / 25.9 ms at n = 1000, 13.1 / 13.0 at
# 785, 4.1 / 4.3 at 500) with fewer graph nodes.
CPU_BLOCKED_MIN = 256
CPU_BLOCK_SIZE = 256


def use_cpu_blocked(mat):
  """Whether damped_inverse builds the blocked recursion (blocks of
  CPU_BLOCK_SIZE) without XLA: a static shape wider than CPU_BLOCKED_MIN and
  no GPU or TPU (whose vendor solvers are the fast path there)."""
  return (mat.shape.rank == 2 and mat.shape.is_fully_defined() and
          mat.shape[-1] > CPU_BLOCKED_MIN and not utils.in_xla_context() and
          not _accelerator_visible())


def damped_cholesky(mat, damping):
  """Lower Cholesky factor L of (mat + damping*I): L L^T = mat + damping*I."""
  def fn(m, d, fallback=False):
    del fallback
    damped = add_to_diagonal(symmetrize(m), d)
    if use_xla_blocked(damped):
      return xla_linalg.cholesky(damped)
    return tf.linalg.cholesky(damped)
  return _with_float64_fallback(fn, mat, damping)


def damped_inverse(mat, damping):
  """(mat + damping*I)^-1 through a Cholesky factorization."""
  def fn(m, d, fallback=False):
    damped = add_to_diagonal(symmetrize(m), d)
    if use_xla_blocked(damped):
      return symmetrize(xla_linalg.spd_inverse(damped))
    # The rare float64 fallback takes the few ops of cholesky_solve: the
    # blocked recursion is some 300 graph nodes per factor, which
    # TensorFlow prepares (grappler) on the first run of every fetch set.
    if use_cpu_blocked(damped) and not fallback:
      return symmetrize(xla_linalg.spd_inverse(damped, CPU_BLOCK_SIZE,
                                               CPU_BLOCK_SIZE))
    chol = tf.linalg.cholesky(damped)
    eye = tf.eye(tf.shape(m)[-1], dtype=m.dtype)
    return symmetrize(tf.linalg.cholesky_solve(chol, eye))
  return _with_float64_fallback(fn, mat, damping)


def damped_cholesky_inverse(mat, damping):
  """L^-1 where L is the lower Cholesky factor of (mat + damping*I)."""
  def fn(m, d, fallback=False):
    del fallback
    damped = add_to_diagonal(symmetrize(m), d)
    if use_xla_blocked(damped):
      return xla_linalg.cholesky_inverse(damped)
    chol = tf.linalg.cholesky(damped)
    eye = tf.eye(tf.shape(m)[-1], dtype=m.dtype)
    return tf.linalg.triangular_solve(chol, eye, lower=True)
  return _with_float64_fallback(fn, mat, damping)


def eigh(mat):
  """Eigendecomposition (eigenvalues, eigenvectors) of a symmetric matrix,
  retried in float64 when the result in mat's dtype is not finite."""
  if mat.dtype == tf.float64:
    return tf.linalg.eigh(symmetrize(mat))
  evals, evecs = tf.linalg.eigh(symmetrize(mat))
  finite = tf.logical_and(tf.reduce_all(tf.math.is_finite(evals)),
                          tf.reduce_all(tf.math.is_finite(evecs)))

  def in_float64():
    e, v = tf.linalg.eigh(symmetrize(tf.cast(mat, tf.float64)))
    return tf.cast(e, mat.dtype), tf.cast(v, mat.dtype)
  return tf.cond(finite, lambda: (evals, evecs), in_float64)


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
  """Dense Kronecker product of two matrices (the static shape is kept when
  both shapes are known)."""
  mat1 = tf.convert_to_tensor(mat1)
  mat2 = tf.convert_to_tensor(mat2, dtype=mat1.dtype)
  if mat1.shape.rank != 2 or mat2.shape.rank != 2:
    raise ValueError("kronecker_product needs two matrices, got shapes %s "
                     "and %s." % (mat1.shape, mat2.shape))
  prod = mat1[:, tf.newaxis, :, tf.newaxis] * mat2[tf.newaxis, :, tf.newaxis, :]
  if mat1.shape.is_fully_defined() and mat2.shape.is_fully_defined():
    (m1, n1), (m2, n2) = mat1.shape.as_list(), mat2.shape.as_list()
    return tf.reshape(prod, [m1 * m2, n1 * n2])
  m1, n1 = tf.unstack(tf.shape(mat1))
  m2, n2 = tf.unstack(tf.shape(mat2))
  return tf.reshape(prod, [m1 * m2, n1 * n2])


# ------------------------------------------------ the old utils.posdef_* API
# (mat + damping * I)^-1 by a chosen method, and eigendecompositions of PSD
# matrices; the factors themselves use damped_inverse / eigh above.

POSDEF_INV_METHODS = ("cholesky", "matrix_inverse", "eig")
POSDEF_EIG_METHODS = ("self_adjoint", "svd")


def _identity_like(tensor):
  n = tensor.shape[-1]
  if n is None:
    n = tf.shape(tensor)[-1]
  return tf.eye(n, dtype=tensor.dtype)


def posdef_inv_matrix_inverse(tensor, identity, damping):
  """inverse(tensor + damping * identity) by a general matrix inverse."""
  damping = utils.cast(damping, tensor.dtype)
  return tf.linalg.inv(tensor + damping * identity)


def posdef_inv_cholesky(tensor, identity, damping):
  """inverse(tensor + damping * identity) by a Cholesky factorization."""
  damping = utils.cast(damping, tensor.dtype)
  damped = tensor + damping * identity
  if use_xla_blocked(damped):
    return xla_linalg.spd_inverse(damped)
  chol = tf.linalg.cholesky(damped)
  return tf.linalg.cholesky_solve(chol, identity)


def posdef_inv_eig(tensor, identity, damping):
  """inverse(tensor + damping * identity) by an eigendecomposition."""
  damping = utils.cast(damping, tensor.dtype)
  evals, evecs = tf.linalg.eigh(tensor + damping * identity)
  return tf.matmul(evecs / evals[tf.newaxis, :], evecs, transpose_b=True)


posdef_inv_functions = {
    "cholesky": posdef_inv_cholesky,
    "matrix_inverse": posdef_inv_matrix_inverse,
    "eig": posdef_inv_eig,
}


def _check_method(method, table, what):
  if method not in table:
    raise ValueError("Unknown %s %r; expected one of %s." %
                     (what, method, ", ".join(sorted(table))))
  return table[method]


def posdef_inv(tensor, damping, method="cholesky"):
  """(tensor + damping * I)^-1 of a symmetric PSD matrix, by `method`
  ("cholesky", "matrix_inverse" or "eig")."""
  fn = _check_method(method, posdef_inv_functions, "posdef_inv method")
  tensor = tf.convert_to_tensor(tensor)
  return fn(tensor, _identity_like(tensor), damping)


def posdef_eig_svd(mat):
  """(singular values, left singular vectors) of a PSD matrix (equal to
  its eigendecomposition, eigenvalues in decreasing order)."""
  evals, evecs, _ = tf.linalg.svd(mat)
  return evals, evecs


def posdef_eig_self_adjoint(mat):
  """(|eigenvalues|, eigenvectors) of a symmetric PSD matrix by `eigh`
  (absolute values, as the SVD would give them)."""
  evals, evecs = tf.linalg.eigh(mat)
  return tf.abs(evals), evecs


posdef_eig_functions = {
    "self_adjoint": posdef_eig_self_adjoint,
    "svd": posdef_eig_svd,
}


def posdef_eig(mat, method="self_adjoint"):
  """Eigendecomposition (eigenvalues, eigenvectors) of a PSD matrix by
  `method` ("self_adjoint" or "svd")."""
  return _check_method(method, posdef_eig_functions,
                       "posdef_eig method")(mat)


def cholesky(tensor, damping):
  """Lower Cholesky factor of tensor + damping * I."""
  tensor = tf.convert_to_tensor(tensor)
  damping = utils.cast(damping, tensor.dtype)
  damped = tensor + damping * _identity_like(tensor)
  if use_xla_blocked(damped):
    return xla_linalg.cholesky(damped)
  return tf.linalg.cholesky(damped)
