"""numerics/inner_products.py: the quadratic model's float64 inner products.

* gram64 of three vectors (lists of tensors over variables of mixed sizes
  and dtypes, some below and some above SEPARATE_PAIRS_MIN entries, one
  with a shape known only when it runs) equals the float64 numpy Gram
  matrix to 1e-14 relative, in a TF1 Session graph and in a tf.function,
  and is exactly symmetric; with one vector it is the squared norm;
* the route per variable: one stacked [k, n] x [n, k] product per small
  variable, none for a large one (whose pairs are elementwise sums);
* inner64 / sum_inner64 equal numpy's float64 sums.
"""

import numpy as np
import pytest
import tensorflow as tf

from kfac.python.kernel_tests import reference
from kfac.python.ops.numerics import inner_products

SHAPES = ((3, 4), (7,), (130, 130), (2, 3, 5), (200, 100))


def _vectors():
  rng = np.random.RandomState(0)
  vectors = []
  for k in range(3):
    parts = [(rng.randn(*s) * (k + 1)).astype(np.float32) for s in SHAPES]
    parts[3] = parts[3].astype(np.float64)  # a float64 variable
    vectors.append(parts)
  return vectors


def _assert_gram(got, want):
  # Entries of mixed sign cancel: relative to the largest entry.
  np.testing.assert_allclose(got, want, rtol=1e-14,
                             atol=1e-14 * np.abs(want).max())


def _numpy_gram(vectors):
  flat = [np.concatenate([np.asarray(p, np.float64).ravel() for p in v])
          for v in vectors]
  return np.array([[u @ v for v in flat] for u in flat])


@pytest.mark.parametrize("world", ["graph", "function"])
def test_gram_equals_numpy_float64(world):
  vectors = _vectors()
  assert any(np.prod(s) >= inner_products.SEPARATE_PAIRS_MIN
             for s in SHAPES)
  assert any(np.prod(s) < inner_products.SEPARATE_PAIRS_MIN for s in SHAPES)

  def build(_):
    tensors = [[tf.constant(p) for p in v] for v in vectors]
    return [{"gram": inner_products.gram64(tensors),
             "one": inner_products.gram64(tensors[:1]),
             "inner": inner_products.inner64(tensors[0][2], tensors[1][2]),
             "sum": inner_products.sum_inner64(tensors[1], tensors[2])}]

  (out,) = reference.run_stages(world, [], build)
  want = _numpy_gram(vectors)
  got = np.array(out["gram"])
  _assert_gram(got, want)
  np.testing.assert_array_equal(got, got.T)
  np.testing.assert_allclose(np.array(out["one"]), want[:1, :1], rtol=1e-14)
  a = vectors[0][2].astype(np.float64).ravel()
  b = vectors[1][2].astype(np.float64).ravel()
  np.testing.assert_allclose(out["inner"], a @ b, rtol=1e-14)
  np.testing.assert_allclose(out["sum"], want[1, 2], rtol=1e-14)


def test_unknown_size_takes_the_stacked_product():
  vectors = _vectors()

  @tf.function(input_signature=[tf.TensorSpec(None, tf.float32)] * 3)
  def fn(a, b, c):
    rest = [[tf.constant(p) for p in v[1:]] for v in vectors]
    return inner_products.gram64([[a] + rest[0], [b] + rest[1],
                                  [c] + rest[2]])

  got = np.array(fn(*[v[0] for v in vectors]))
  _assert_gram(got, _numpy_gram(vectors))
  graph = fn.get_concrete_function().graph
  # The stack of the unknown-shaped variable and of the small ones.
  assert sum(op.type == "MatMul" for op in graph.get_operations()) == 3


@pytest.mark.parametrize("shape,matmuls", [((100, 200), 0), ((100, 100), 1)])
def test_route_per_variable(shape, matmuls):
  with tf.Graph().as_default() as graph:
    vectors = [[tf.ones(shape)] for _ in range(3)]
    gram = inner_products.gram64(vectors)
    ops = graph.get_operations()
    assert sum(op.type == "MatMul" for op in ops) == matmuls
    with tf.compat.v1.Session() as sess:
      got = sess.run(gram)
  np.testing.assert_array_equal(np.array(got),
                                np.full((3, 3), float(np.prod(shape))))
