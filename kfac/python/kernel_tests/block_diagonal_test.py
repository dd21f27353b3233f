"""Kronecker factors kept as their diagonal blocks (CurvatureOptions
factor_block_size, layers/base/block_diagonal.py) against float64
references.

The reference is written out with numpy: the same model run with full
factors gives A and G; a factor of n > b rows is replaced by the matrix
that keeps its k = ceil(n / b) diagonal blocks of m = ceil(n / k) rows (the
last one shorter) and zeroes the rest; the damped block is kfac 0.2.x's
c (A + pi s I) (x) (G + s / pi I) of those matrices, pi from their traces
(which the blocks keep). Products with the block's powers 1, -1 (batched
Cholesky) and -1/2 (batched eigendecomposition) and its Cholesky factor
are checked in a TF1 Session graph and in a tf.function, at 1e-9 relative
/ 1e-11 absolute (float64 products of matrices of at most 6 rows).
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import curvature_options_test as cot
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref
from kfac.python.ops.layers.base import block_diagonal
from kfac.python.ops.layers.base import curvature_options
from kfac.python.ops.tensors import state

WORLDS = ref.WORLDS
TOL = dict(rtol=1e-9, atol=1e-11)
Options = curvature_options.CurvatureOptions


def _blocks_of(mat, size):
  """mat with only its diagonal blocks kept (the module docstring)."""
  n = len(mat)
  if n <= size:
    return mat
  k = -(-n // size)
  m = -(-n // k)
  out = np.zeros_like(mat)
  for i in range(k):
    sl = slice(i * m, min((i + 1) * m, n))
    out[sl, sl] = mat[sl, sl]
  return out


def test_block_layout():
  assert block_diagonal.block_layout(4609, 1024) == (5, 922)
  assert block_diagonal.block_layout(4608, 512) == (9, 512)
  assert block_diagonal.block_layout(5, 2) == (3, 2)
  assert block_diagonal.block_layout(1001, 1000) == (2, 501)


def test_option_is_validated():
  for bad in (-1, 1, 2.5, True, "4"):
    with pytest.raises(ValueError, match="factor_block_size"):
      Options(factor_block_size=bad)
  assert Options().factor_block_size == 0
  assert Options(factor_block_size=2).factor_block_size == 2


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("size", [2, 3])
def test_dense_blocks_against_float64_reference(world, size):
  """The MLP (A of 4 and 5 rows, G of 4 and 3): block size 2 splits every
  factor (5 rows: 3 blocks of 2, one padding row), 3 all but the last G."""
  inits = ref.mlp_inits(util.SIZES, seed=1)
  exps = (1, -1, -0.5)
  damping = 0.03
  full = cot._block_products(world, inits, util.register_mlp, (1,), damping)  # pylint: disable=protected-access
  out = cot._block_products(world, inits, util.register_mlp, exps, damping,  # pylint: disable=protected-access
                            options=Options(factor_block_size=size))
  for (a, g), (ba, bg) in zip(full["factors"], out["factors"]):
    np.testing.assert_allclose(ba, _blocks_of(a, size), **TOL)
    np.testing.assert_allclose(bg, _blocks_of(g, size), **TOL)
    # What the blocks drop is not nothing.
    assert np.abs(a - _blocks_of(a, size)).max() > 1e-3
  np.testing.assert_array_equal(ref.flat(out["vecs"]), ref.flat(full["vecs"]))
  cot._check_mlp_products(  # pylint: disable=protected-access
      dict(out, factors=full["factors"]),
      lambda a, g: cot._damped_kron(_blocks_of(a, size), _blocks_of(g, size),  # pylint: disable=protected-access
                                    damping), exps)


@pytest.mark.parametrize("world", WORLDS)
def test_conv_blocks_against_float64_reference(world):
  """A conv layer over 9 locations: A (4 rows) in 2 blocks of 2, G (2 rows)
  whole; L (A_bd + pi s I) (x) (G + s / pi I)."""
  damping, locations = 0.07, 9.0
  _, vec, _, (a, g) = cot._conv_stages(world, "kron", Options(), damping)  # pylint: disable=protected-access
  _, bvec, prod, (ba, bg) = cot._conv_stages(  # pylint: disable=protected-access
      world, "kron", Options(factor_block_size=3), damping)
  np.testing.assert_array_equal(vec, bvec)
  np.testing.assert_allclose(ba, _blocks_of(a, 3), **TOL)
  np.testing.assert_allclose(bg, g, **TOL)
  dense = cot._damped_kron(_blocks_of(a, 3), g, damping, coeff=locations)  # pylint: disable=protected-access
  np.testing.assert_allclose(prod.ravel(), dense @ vec.ravel(), **TOL)


@pytest.mark.parametrize("world", WORLDS)
def test_cholesky_products(world):
  """multiply_cholesky(_inverse) of a blocked dense block: C C^T is the
  damped block, C^-1 C = I."""
  inits = ref.mlp_inits(util.SIZES, seed=2)
  x, labels = util.data(6, seed=3)
  store = util.new_store()
  damping = 0.05

  def build(vs):
    lc = kfac.LayerCollection(
        curvature_options=Options(factor_block_size=2))
    logits = util.register_mlp(vs, tf.constant(x), lc)
    util.categorical_loss(lc, logits, labels)
    est, ops = util.estimator_stages(store, lc, vs, "exact", damping=damping,
                                     exps=(), compute_cholesky=True,
                                     compute_cholesky_inverse=True)
    block = est.blocks[1]
    rng = np.random.RandomState(4)
    vec = [tf.constant(rng.randn(*v.shape)) for v in vs[2:]]
    c_ct = block.multiply_cholesky(block.multiply_cholesky(vec,
                                                           transpose=True))
    back = block.multiply_cholesky_inverse(block.multiply_cholesky(vec))
    back_t = block.multiply_cholesky_inverse(
        block.multiply_cholesky(vec, transpose=True), transpose=True)
    return ops + [[vec, block.multiply(vec), c_ct, back, back_t]]

  vec, prod, c_ct, back, back_t = ref.run_stages(world, inits, build)[-1]
  np.testing.assert_allclose(ref.flat(c_ct), ref.flat(prod), **TOL)
  np.testing.assert_allclose(ref.flat(back), ref.flat(vec), **TOL)
  np.testing.assert_allclose(ref.flat(back_t), ref.flat(vec), **TOL)


def test_memory_is_the_blocks():
  """The memory prediction counts the blocks' state, and is what the
  factors allocate: a Dense layer of 1,000 inputs with a bias (A: 1,001
  rows) at block size 256 keeps 4 blocks of 251 rows (statistic and
  inverse), its G (3 rows) whole."""
  with tf.Graph().as_default():
    x = tf.zeros([8, 1000])
    w = tf.Variable(tf.zeros([1000, 3]), name="w")
    b = tf.Variable(tf.zeros([3]), name="b")
    lc = kfac.LayerCollection(
        curvature_options=Options(factor_block_size=256))
    out = tf.matmul(x, w) + b
    lc.register_fully_connected((w, b), x, out)
    lc.register_categorical_predictive_distribution(out)
    store = state.StateStore("s")
    est = kfac.estimator.FisherEstimator([w, b], 0.95, 0.1, lc,
                                         state_store=store)
    est.factors  # pylint: disable=pointless-statement
    (row,), total = lc.memory_usage()
    kinds = row.by_kind()
    assert kinds["cov"] == (4 * 251 * 251 + 3 * 3) * 4, kinds
    assert kinds["matpow"] == (4 * 251 * 251 + 3 * 3) * 4, kinds
    est.make_vars_and_create_op_thunks()
    names = [f.name + "/" for f in lc.get_factors()]
    allocated = sum(
        int(np.prod(var.shape)) * var.dtype.size
        for key, var in store.variables_by_name.items()
        if any(key.startswith(n) for n in names))
    assert allocated == total

