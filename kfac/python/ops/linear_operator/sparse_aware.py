"""tf.linalg operators that multiply from both sides and take sparse rows.

`op.matmul(x)` is A @ x and `op.matmul_right(x)` is x @ A (both with the
usual `adjoint` / `adjoint_arg` flags). Either accepts `tf.IndexedSlices`
for x: for matmul the slices index rows of x (so only A's matching columns
are touched: A[:, idx] @ values is returned dense), for matmul_right they
index rows of x and the result keeps the same indices (values @ A). This is
what the old library's linear_operator module offered to multiply embedding
gradients by factor inverses.
"""

import tensorflow as tf


def _adjoint(m):
  return tf.linalg.adjoint(m)


class LinearOperatorExtras(object):
  """Mixin: `matmul` and `matmul_right` that accept tf.IndexedSlices."""

  def matmul(self, x, adjoint=False, adjoint_arg=False, name="matmul"):
    if isinstance(x, tf.IndexedSlices):
      with tf.name_scope(name):
        if adjoint_arg:
          raise ValueError(
              "matmul of tf.IndexedSlices: adjoint_arg=True is not "
              "supported (the slices index rows of x).")
        return self._matmul_sparse(x, adjoint=adjoint)
    return super(LinearOperatorExtras, self).matmul(
        x, adjoint=adjoint, adjoint_arg=adjoint_arg, name=name)

  def matmul_right(self, x, adjoint=False, adjoint_arg=False,
                   name="matmul"):
    """x @ A (with A or x adjointed as asked)."""
    with tf.name_scope(name):
      if isinstance(x, tf.IndexedSlices):
        if adjoint_arg:
          raise ValueError(
              "matmul_right of tf.IndexedSlices: adjoint_arg=True is not "
              "supported (the slices index rows of x).")
        return tf.IndexedSlices(
            self._matmul_right_dense(x.values, adjoint=adjoint),
            x.indices, x.dense_shape)
      x = tf.convert_to_tensor(x, dtype=self.dtype, name="x")
      if adjoint_arg:
        x = _adjoint(x)
      return self._matmul_right_dense(x, adjoint=adjoint)

  def _matmul_right_dense(self, x, adjoint=False):
    # x @ A = (A^H @ x^H)^H.
    return _adjoint(super(LinearOperatorExtras, self).matmul(
        x, adjoint=not adjoint, adjoint_arg=True))


class LinearOperatorFullMatrix(LinearOperatorExtras,
                               tf.linalg.LinearOperatorFullMatrix):
  """A dense matrix operator with right and sparse multiplication."""

  def _matmul_sparse(self, x, adjoint=False):
    a = self.to_dense()
    if adjoint:
      a = _adjoint(a)
    return tf.matmul(tf.gather(a, x.indices, axis=-1), x.values)

  def _matmul_right_dense(self, x, adjoint=False):
    a = self.to_dense()
    return tf.matmul(x, a, adjoint_b=adjoint)


class LinearOperatorDiag(LinearOperatorExtras, tf.linalg.LinearOperatorDiag):
  """A diagonal operator with right and sparse multiplication."""

  def _diag_values(self, adjoint):
    d = self.diag_part()
    return tf.math.conj(d) if adjoint else d

  def _matmul_sparse(self, x, adjoint=False):
    # Rows idx of x scaled by d[idx], scattered into a dense result.
    d = self._diag_values(adjoint)
    scaled = x.values * tf.expand_dims(tf.gather(d, x.indices), -1)
    n = tf.shape(d, out_type=x.indices.dtype)[-1]
    return tf.math.unsorted_segment_sum(scaled, x.indices, n)

  def _matmul_right_dense(self, x, adjoint=False):
    return x * self._diag_values(adjoint)
