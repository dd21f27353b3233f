"""numerics/batched_inverse.py: the damped inverses of many factors at once.

* every value equals linalg.damped_inverse of its own matrix (float32
  matrices: 1e-6 relative to the largest entry; the float64 references of
  the inverses themselves are in fisher_factors_test.py and
  xla_linalg_test.py), for mixed shapes and dtypes, matrices wider than
  linalg.CPU_BLOCKED_MIN (blocked route), in a TF1 Session graph and in a
  tf.function;
* one matrix needing the float64 fallback (damping below the float32 bound)
  gets damped_inverse's float64 value while the others keep their float32
  ones; a matrix with a non-finite entry gives a non-finite value;
* the graph holds two Cholesky ops per distinct shape (float32, and the
  float64 fallback of the matrices that need it) and no conditional,
  however many matrices there are; under XLA (jit_compile) the values are
  the same;
* bad shapes are refused.
"""

import numpy as np
import pytest
import tensorflow as tf

from kfac.python.kernel_tests import reference
from kfac.python.ops.numerics import batched_inverse
from kfac.python.ops.numerics import linalg


def _spd(n, seed, scale=1.0):
  rng = np.random.RandomState(seed)
  a = rng.randn(n, n + 3)
  return scale * a @ a.T / n


SHAPES = (3, 3, 5, 3, 300, 5, 300)


def _inputs():
  mats = [_spd(n, i).astype(np.float32) for i, n in enumerate(SHAPES)]
  mats.append(_spd(4, 99))  # float64
  # Damping far below the float32 bound of this matrix: float64 fallback.
  mats.append(_spd(6, 7, scale=1e4).astype(np.float32))
  dampings = [0.1 * (i + 1) for i in range(len(SHAPES))] + [0.2, 1e-6]
  return mats, dampings


def _build(_):
  mats, dampings = _inputs()
  tensors = [tf.constant(m) for m in mats]
  pairs = list(zip(tensors, dampings))
  batched = batched_inverse.damped_inverses(pairs)
  single = [linalg.damped_inverse(m, d) for m, d in pairs]
  unsafe = linalg._float32_is_unsafe(tensors[-1], dampings[-1])  # pylint: disable=protected-access
  return [{"batched": batched, "single": single, "unsafe": unsafe}]


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("world", ["graph", "function"])
def test_values_equal_damped_inverse_of_each(world):
  (out,) = reference.run_stages(world, [], _build)
  assert bool(out["unsafe"])  # the last matrix takes the float64 route
  mats, dampings = _inputs()
  for got, want, mat, damping in zip(out["batched"], out["single"], mats,
                                     dampings):
    assert got.shape == mat.shape and got.dtype == mat.dtype
    tol = 1e-12 if mat.dtype == np.float64 else 1e-6
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err <= tol, (mat.shape, err)
    exact = np.linalg.inv(mat.astype(np.float64) + damping * np.eye(len(mat)))
    err = np.max(np.abs(got - exact)) / np.max(np.abs(exact))
    assert err <= 1e-3, (mat.shape, err)


@pytest.mark.slow  # XLA compiles the batched recursion: ~20 s
def test_under_xla_values_equal_damped_inverse_of_each():
  mats, dampings = _inputs()

  @tf.function(jit_compile=True)
  def both():
    pairs = [(tf.constant(m), d) for m, d in zip(mats, dampings)]
    return (batched_inverse.damped_inverses(pairs),
            [linalg.damped_inverse(m, d) for m, d in pairs])
  batched, single = both()
  for got, want in zip(batched, single):
    err = np.max(np.abs(got.numpy() - want.numpy())) / np.max(
        np.abs(want.numpy()))
    assert err <= 1e-6, err


def test_nonfinite_matrix_gives_nonfinite_value_only_there():
  bad = _spd(3, 0).astype(np.float32)
  bad[1, 1] = np.nan
  good = _spd(3, 1).astype(np.float32)
  got = batched_inverse.damped_inverses(
      [(tf.constant(bad), 0.1), (tf.constant(good), 0.1)])
  assert not np.all(np.isfinite(got[0].numpy()))
  np.testing.assert_allclose(
      got[1].numpy(), linalg.damped_inverse(tf.constant(good), 0.1).numpy(),
      rtol=1e-6, atol=1e-7)


def _count_ops(num_matrices):
  graph = tf.Graph()
  with graph.as_default():
    pairs = [(tf.constant(_spd(n, i).astype(np.float32)), 0.1)
             for i, n in enumerate([3, 5] * num_matrices)]
    batched_inverse.damped_inverses(pairs)
  ops = graph.get_operations()
  return (sum(op.type == "Cholesky" for op in ops),
          sum(op.type in ("If", "StatelessIf") for op in ops), len(ops))


def test_graph_grows_with_shapes_not_matrices():
  chol_2, conds_2, ops_2 = _count_ops(2)
  chol_40, conds_40, ops_40 = _count_ops(40)
  # One Cholesky per shape in float32 and one for the gathered float64
  # fallback; no conditional.
  assert chol_2 == chol_40 == 4
  assert conds_2 == conds_40 == 0
  # What grows: each matrix's constant and damping (measured: 2 ops per
  # matrix; linalg.damped_inverse alone builds some 30 per matrix).
  assert ops_40 - ops_2 <= 3 * 76, (ops_2, ops_40)


def test_bad_shapes_are_refused():
  with pytest.raises(ValueError, match="square matrices of static shape"):
    batched_inverse.damped_inverses([(tf.zeros([3, 4]), 0.1)])
  assert batched_inverse.damped_inverses([]) == []
