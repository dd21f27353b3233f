"""Kronecker factors kept as their diagonal blocks (CurvatureOptions
`factor_block_size`).

A dense or convolution layer's factor A = E[a a^T] (n x n, a the layer's
input with its bias entry, or its output gradient) costs n^2 to keep, r n^2
to estimate from r rows, n^3 to invert and n^2 per column of every product.
With a block size b < n the factor is replaced by its k = ceil(n / b)
diagonal blocks of m = ceil(n / k) rows each (the last one padded with
zero rows and columns up to k m):

    A ~= blockdiag(A_11, ..., A_kk),   A_ii = E[a_i a_i^T],

a_i the i-th slice of m entries of a. The blocks are estimated from the
same rows as the whole factor (r n m), kept as one [k, m, m] statistic,
inverted as a batch (k m^3) and applied as a batched product (n m per
column). The damping is added to every block as to the whole factor
(the padded rows get only the damping: their inverse is 1 / damping on
entries that multiply zero padding). The trace-norm damping split (pi)
reads trace(blockdiag) / n = trace(A) / n, the same as the full factor's.

`BlockDiagonalFactor(factor_cls, factor_args, block_size)` wraps the factor
`factor_cls(*factor_args)` that the block would have made: that factor
keeps no state of its own and only gives its statistic's rows
(`statistic_rows()`: [(rows [r, n], weight)], the factor being sum_s
weight_s rows_s^T rows_s / r_s) and their weights (`row_weights`).
`block_diagonal_factor(block, cls, args, role)` is what the Kronecker
blocks call: the plain factor when the option is off or the factor has at
most b rows, else this one.
"""

import tensorflow as tf

from kfac.python.ops.layers.base.batched_factors import BatchedSquareFactor
from kfac.python.ops.layers.base.factors import weighted_sum
from kfac.python.ops.numerics import linalg
from kfac.python.ops.tensors import utils

__all__ = ["BlockDiagonalFactor", "block_diagonal_factor", "block_layout",
           "blocked_second_moments"]


def block_layout(n, block_size):
  """(k, m): k = ceil(n / block_size) blocks of m = ceil(n / k) rows (k m
  >= n; k m - n < k rows of padding)."""
  k = -(-n // block_size)
  return k, -(-n // k)


def _padded(x, axis, width):
  """x with zeros appended along `axis` (0 or 1 of a matrix) up to
  `width` entries."""
  pad = width - int(x.shape[axis])
  if not pad:
    return x
  paddings = [[0, 0], [0, 0]]
  paddings[axis][1] = pad
  return tf.pad(x, paddings)


def blocked_second_moments(rows, k, m):
  """[k, m, m]: the diagonal m x m blocks of rows^T rows / r for rows
  [r, n] (n <= k m; columns beyond n are zeros)."""
  rows = _padded(rows, 1, k * m)
  count = tf.cast(tf.shape(rows)[0], rows.dtype)
  by_block = tf.transpose(tf.reshape(rows, [-1, k, m]), [1, 0, 2])
  return tf.matmul(by_block, by_block, transpose_a=True) / count


class BlockDiagonalFactor(BatchedSquareFactor):
  """A Kronecker factor approximated by its diagonal blocks (the module
  docstring): a [k, m, m] statistic; products act on the factor's [n, c]
  (left) or [c, n] (right) operands."""

  def __init__(self, factor_cls, factor_args, block_size):
    self._full = factor_cls(*factor_args)
    self._dim = int(self._full.cov_shape[0])
    self._batch, self._n = block_layout(self._dim, int(block_size))
    self._row_weights = tuple(self._full.row_weights)
    super().__init__(weights=self._row_weights)

  @property
  def dim(self):
    """n: the rows of the factor these blocks approximate."""
    return self._dim

  @property
  def num_blocks(self):
    return self._batch

  @property
  def block_rows(self):
    return self._n

  @property
  def _dtype(self):
    return self._full.dtype

  def set_curvature_options(self, options):
    super().set_curvature_options(options)
    self._full.set_curvature_options(options)

  def _compute_new_cov(self):
    terms = [blocked_second_moments(rows, self._batch, self._n)
             for rows in self._full.statistic_rows()]
    return weighted_sum(terms, self._row_weights)

  def get_cov(self):
    """The block-diagonal [n, n] matrix (tests, full_fisher_block)."""
    blocks = tf.convert_to_tensor(self.get_cov_var())
    dense = tf.linalg.LinearOperatorBlockDiag(
        [tf.linalg.LinearOperatorFullMatrix(blocks[i])
         for i in range(self._batch)]).to_dense()
    return dense[:self._dim, :self._dim]

  def normalized_trace(self):
    cov = tf.convert_to_tensor(self.get_cov_var())
    return tf.math.truediv(tf.reduce_sum(tf.linalg.trace(cov)),
                           utils.shared_constant(self._dim, cov.dtype))

  def inverse_values(self):
    """The registered powers of every block: inverses of a positive
    semi-definite factor by a batched Cholesky (as the full factor's,
    with its float64 fallback), the other powers (and inverses under
    eigenvalue clipping) from one batched eigendecomposition, eigenvalues
    clipped at the CurvatureOptions' threshold."""
    self.instantiate_inv_variables()
    cov = linalg.symmetrize(tf.convert_to_tensor(self.get_cov_var()))
    threshold = self.curvature_options.eigenvalue_clipping_threshold
    ops, eig = [], None
    for kind, exp, dfunc in self._registered:
      var = self._vars[(kind, exp, dfunc.key)]
      scales, damping = self._scales_and_damping(dfunc, cov.dtype)
      scaled = scales[:, tf.newaxis, tf.newaxis] * cov
      if kind == "matpow" and (exp != -1 or not self._psd or threshold > 0):
        if eig is None:
          eig = tf.linalg.eigh(cov)
        evals = eig[0]
        if self._psd:
          evals = tf.maximum(evals, utils.cast(threshold, evals.dtype))
        powered = tf.pow(scales[:, tf.newaxis] * evals + damping,
                         utils.cast(exp, cov.dtype))
        value = tf.matmul(eig[1] * powered[:, tf.newaxis, :], eig[1],
                          transpose_b=True)
      elif kind == "matpow":
        value = linalg.damped_inverse(scaled, damping)
      elif kind == "chol":
        value = linalg.damped_cholesky(scaled, damping)
      else:
        value = linalg.damped_cholesky_inverse(scaled, damping)
      ops.append((var, utils.cast(value, self._dtype)))
    return ops

  # Products: the [n, c] (left) or [c, n] (right) operand is split into its
  # k slices of m rows (columns), zero-padded, and multiplied by the blocks
  # as one batched matmul.
  def _left(self, mat, x, transpose=False):
    stacked = tf.reshape(_padded(x, 0, self._batch * self._n),
                         [self._batch, self._n, -1])
    out = tf.matmul(mat, stacked, transpose_a=transpose)
    return tf.reshape(out, [self._batch * self._n, -1])[:self._dim]

  def _right(self, mat, x, transpose=False):
    stacked = tf.transpose(
        tf.reshape(_padded(x, 1, self._batch * self._n),
                   [-1, self._batch, self._n]), [1, 0, 2])
    out = tf.matmul(stacked, mat, transpose_b=transpose)
    out = tf.reshape(tf.transpose(out, [1, 0, 2]),
                     [-1, self._batch * self._n])
    return out[:, :self._dim]

  def left_multiply_matpower(self, x, exp, damping_func):
    return self._left(self.get_matpower(exp, damping_func), x)

  def right_multiply_matpower(self, x, exp, damping_func):
    return self._right(self.get_matpower(exp, damping_func), x)

  def left_multiply_cholesky(self, x, damping_func, transpose=False,
                             inverse=False):
    mat = (self.get_cholesky_inverse(damping_func) if inverse else
           self.get_cholesky(damping_func))
    return self._left(mat, x, transpose=transpose)

  def right_multiply_cholesky(self, x, damping_func, transpose=False,
                              inverse=False):
    mat = (self.get_cholesky_inverse(damping_func) if inverse else
           self.get_cholesky(damping_func))
    return self._right(mat, x, transpose=transpose)


def block_diagonal_factor(block, factor_cls, factor_args, role):
  """The factor of `block` (a Kronecker block of a dense or convolution
  layer) for `role`: `factor_cls(*factor_args)` from the block's
  collection, or, when its CurvatureOptions set factor_block_size b and
  the factor has more than b rows, a BlockDiagonalFactor of it."""
  size = block.curvature_options.factor_block_size
  if size:
    probe = factor_cls(*factor_args)  # (no state: only its shape is read)
    if int(probe.cov_shape[0]) > size:
      return block._make_factor(  # pylint: disable=protected-access
          BlockDiagonalFactor, (factor_cls, tuple(factor_args), size),
          role + "_blocks")
  return block._make_factor(factor_cls, factor_args, role)  # pylint: disable=protected-access
