"""kfac.linear_operator: full-matrix and diagonal operators that multiply
from the right and take tf.IndexedSlices, against numpy in float64, eagerly,
in a tf.function and in a TF1 Session graph."""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.ops import linear_operator as lo

TOL = dict(rtol=1e-12, atol=1e-12)
RNG = np.random.RandomState(0)
A = RNG.randn(4, 4)
D = RNG.rand(4) + 0.5
X = RNG.randn(4, 3)
ROWS = RNG.randn(2, 3)    # rows 3 and 1 of a [4, 3] right-hand side
ROWS_R = RNG.randn(2, 4)  # rows 3 and 1 of a [5, 4] left-hand side
IDX = np.array([3, 1])


def _dense_slices(values, n_rows):
  out = np.zeros((n_rows, values.shape[1]))
  np.add.at(out, IDX, values)
  return out


def _products(op):
  """The operator's products of X and of the slices, as tensors."""
  xs = tf.IndexedSlices(tf.constant(ROWS), tf.constant(IDX),
                        tf.constant([4, 3]))
  xs_r = tf.IndexedSlices(tf.constant(ROWS_R), tf.constant(IDX),
                          tf.constant([5, 4]))
  out = {}
  for adj in (False, True):
    out["matmul", adj] = op.matmul(tf.constant(X), adjoint=adj)
    out["sparse", adj] = op.matmul(xs, adjoint=adj)
    out["right", adj] = op.matmul_right(tf.constant(X.T), adjoint=adj)
    out["right_adjarg", adj] = op.matmul_right(tf.constant(X), adjoint=adj,
                                               adjoint_arg=True)
    r = op.matmul_right(xs_r, adjoint=adj)
    assert isinstance(r, tf.IndexedSlices)
    out["right_sparse", adj] = tf.convert_to_tensor(r)
  return out


def _expected(m):
  out = {}
  for adj in (False, True):
    ma = m.T if adj else m
    out["matmul", adj] = ma @ X
    out["sparse", adj] = ma @ _dense_slices(ROWS, 4)
    out["right", adj] = X.T @ ma
    out["right_adjarg", adj] = X.T @ ma
    out["right_sparse", adj] = _dense_slices(ROWS_R, 5) @ ma
  return out


def _ops():
  return ((lambda: lo.LinearOperatorFullMatrix(tf.constant(A)), A),
          (lambda: lo.LinearOperatorDiag(tf.constant(D)), np.diag(D)))


@pytest.mark.parametrize("which", [0, 1], ids=["full", "diag"])
@pytest.mark.parametrize("world", ["eager", "tf_function", "tf1"])
def test_products_equal_numpy(which, world):
  make, m = _ops()[which]
  if world == "eager":
    got = {k: v.numpy() for k, v in _products(make()).items()}
  elif world == "tf_function":
    got = {k: v.numpy() for k, v in tf.function(
        lambda: _products(make()))().items()}
  else:
    with tf.Graph().as_default():
      products = _products(make())
      with tf.compat.v1.Session() as sess:
        got = sess.run(products)
  want = _expected(m)
  assert set(got) == set(want)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], err_msg=str(k), **TOL)


def test_is_a_tf_linalg_operator_and_public():
  op = kfac.linear_operator.LinearOperatorFullMatrix(tf.constant(A))
  assert isinstance(op, tf.linalg.LinearOperator)
  np.testing.assert_allclose(op.solve(tf.constant(X)).numpy(),
                             np.linalg.solve(A, X), **TOL)
  import kfac.linear_operator as imported  # pylint: disable=g-import-not-at-top
  assert imported is lo


def test_sparse_adjoint_arg_is_refused():
  op = lo.LinearOperatorDiag(tf.constant(D))
  xs = tf.IndexedSlices(tf.constant(ROWS), tf.constant(IDX),
                        tf.constant([4, 3]))
  with pytest.raises(ValueError, match="adjoint_arg=True"):
    op.matmul(xs, adjoint_arg=True)
  with pytest.raises(ValueError, match="adjoint_arg=True"):
    op.matmul_right(xs, adjoint_arg=True)
