"""Products of tf.IndexedSlices matrices with dense and diagonal matrices."""

import tensorflow as tf


def _check_sparse_matrix(a, what):
  if not isinstance(a, tf.IndexedSlices):
    raise ValueError("%s must be a tf.IndexedSlices, got %r." % (what, a))
  if a.indices.shape.rank != 1 or a.values.shape.rank != 2:
    raise ValueError("%s must represent a matrix. Found: %s." % (what, a))


def matmul_sparse_dense(A, B, name=None, transpose_a=False,  # pylint: disable=invalid-name
                        transpose_b=False):
  """matmul(A, B) for A a tf.IndexedSlices [m, n] (rows A.indices) and B a
  dense [n, k] matrix: a tf.IndexedSlices [m, k] with A's rows.

  `transpose_a` transposes A's value rows (only meaningful when they are
  square); `transpose_b` transposes B."""
  _check_sparse_matrix(A, "A")
  with tf.name_scope(name or "matmul_sparse_dense"):
    B = tf.convert_to_tensor(B)
    if B.shape.rank != 2:
      raise ValueError("B must be a matrix, got shape %s." % B.shape)
    values = tf.matmul(A.values, B, transpose_a=transpose_a,
                       transpose_b=transpose_b)
    dense_shape = None
    if A.dense_shape is not None:
      cols = tf.shape(values, out_type=A.dense_shape.dtype)[1]
      dense_shape = tf.stack([A.dense_shape[0], cols])
    return tf.IndexedSlices(values, A.indices, dense_shape=dense_shape)


def matmul_diag_sparse(A_diag, B, name=None):  # pylint: disable=invalid-name
  """matmul(diag(A_diag), B) for B a tf.IndexedSlices [m, n]: scales each
  of B's rows by the matching diagonal entry."""
  _check_sparse_matrix(B, "B")
  with tf.name_scope(name or "matmul_diag_sparse"):
    A_diag = tf.convert_to_tensor(A_diag)
    if A_diag.shape.rank != 1:
      raise ValueError("A_diag must be a rank-1 Tensor, got shape %s." %
                       A_diag.shape)
    scale = tf.gather(A_diag, B.indices)[:, tf.newaxis]
    return tf.IndexedSlices(scale * B.values, B.indices,
                            dense_shape=B.dense_shape)
