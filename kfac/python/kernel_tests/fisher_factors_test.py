"""Factors, dense linear algebra, pi-adjusted damping and the state store.

Every statistic is compared with a float64 numpy formula. Stateful checks
run in both worlds (a TF1 Session graph and one tf.function, see
reference.run_stages) with the factor's variables in a `StateStore` created
outside the traced function.
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import reference as ref
from kfac.python.ops.layers.base import damping as damping_lib
from kfac.python.ops import fisher_factors as ff
from kfac.python.ops.numerics import linalg

WORLDS = ref.WORLDS
TOL = dict(rtol=1e-10, atol=1e-12)
N, D_IN, D_OUT = 6, 3, 2


def _rand(seed, *shape):
  return np.random.RandomState(seed).randn(*shape)


def _store():
  return kfac.state.StateStore("factor_test_state")


def _read(var):
  return tf.identity(tf.convert_to_tensor(var))


def _gram(x):
  return x.T @ x / x.shape[0]


def _with_ones(x):
  return np.concatenate([x, np.ones([x.shape[0], 1])], axis=1)


# ------------------------------------------------------------------ EMA
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("has_bias", [False, True])
def test_zero_debiased_moving_average_of_kronecker_factor(world, has_bias):
  x1, x2 = _rand(0, N, D_IN), _rand(1, N, D_IN)
  decay = 0.7
  store = _store()

  def build(vs):
    (x_var,) = vs
    factor = ff.FullyConnectedKroneckerFactor((x_var,), has_bias=has_bias)
    factor.attach_state_store(store)
    first = factor.make_covariance_update_op(decay)
    cov1 = _read(factor.get_cov())
    weight1 = _read(factor._cov_weight)  # pylint: disable=protected-access
    refill = tf.group(x_var.assign(x2, read_value=False))
    second = factor.make_covariance_update_op(decay)
    cov2 = _read(factor.get_cov())
    weight2 = _read(factor._cov_weight)  # pylint: disable=protected-access
    return [first, (cov1, weight1), refill, second, (cov2, weight2)]

  out = ref.run_stages(world, [x1], build)
  (cov1, weight1), (cov2, weight2) = out[1], out[4]
  a1, a2 = (_with_ones(x1), _with_ones(x2)) if has_bias else (x1, x2)
  c1, c2 = _gram(a1), _gram(a2)
  assert cov1.shape == (D_IN + has_bias,) * 2
  # First update: the average equals the first statistic exactly.
  np.testing.assert_allclose(cov1, c1, **TOL)
  np.testing.assert_allclose(weight1, 1 - decay, **TOL)
  # Second update: zero-initialised EMA divided by its total weight.
  w_old = decay * (1 - decay)
  want = (w_old * c1 + (1 - decay) * c2) / (w_old + (1 - decay))
  np.testing.assert_allclose(cov2, want, **TOL)
  np.testing.assert_allclose(weight2, w_old + (1 - decay), **TOL)
  if has_bias:
    np.testing.assert_allclose(cov1[-1, -1], 1.0, **TOL)
    np.testing.assert_allclose(cov1[-1, :-1], x1.mean(axis=0), **TOL)
  # The variables live in the store under the factor's name.
  assert "FullyConnectedKroneckerFactor/cov" in store
  assert "FullyConnectedKroneckerFactor/cov_weight" in store


# ------------------------------------------------------------ statistics
@pytest.mark.parametrize("world", WORLDS)
def test_statistics_of_every_factor_kind(world):
  a = _rand(2, N, D_IN)
  g = _rand(3, N, D_OUT)
  pw, pb = _rand(4, D_IN, D_OUT), _rand(5, D_OUT)
  batch = 4.0
  store = _store()

  def build(vs):
    del vs
    a_t, g_t = tf.constant(a), tf.constant(g)
    factors = {
        "full": ff.FullyConnectedKroneckerFactor((a_t,), has_bias=True),
        "diag_kron": ff.DiagonalKroneckerFactor((a_t,), has_bias=True),
        "fc_diag": ff.FullyConnectedDiagonalFactor((a_t,), [(g_t,)],
                                                   has_bias=True),
        "naive_full": ff.NaiveFullFactor(
            [(tf.constant(pw), tf.constant(pb))], batch),
        "naive_diag": ff.NaiveDiagonalFactor(
            [(tf.constant(pw), tf.constant(pb))], batch),
    }
    ops = []
    for name, factor in factors.items():
      factor.set_name(name)
      factor.attach_state_store(store)
      ops.append(factor.make_covariance_update_op(0.9))
    covs = {k: _read(f.get_cov_var()) for k, f in factors.items()}
    dense = {k: _read(f.get_cov()) for k, f in factors.items()}
    return [tf.group(*ops), (covs, dense)]

  covs, dense = ref.run_stages(world, [np.zeros(1)], build)[-1]
  a1 = _with_ones(a)
  full = _gram(a1)
  np.testing.assert_allclose(covs["full"], full, **TOL)
  np.testing.assert_allclose(covs["diag_kron"], np.diag(full), **TOL)
  np.testing.assert_allclose(dense["diag_kron"], np.diag(np.diag(full)), **TOL)
  np.testing.assert_allclose(covs["fc_diag"], (a1**2).T @ (g**2) / N, **TOL)
  assert covs["fc_diag"].shape == (D_IN + 1, D_OUT)
  flat = np.concatenate([pw.ravel(), pb.ravel()])[:, None]
  np.testing.assert_allclose(covs["naive_full"], flat @ flat.T / batch, **TOL)
  np.testing.assert_allclose(covs["naive_diag"], flat**2 / batch, **TOL)
  assert covs["naive_diag"].shape == (D_IN * D_OUT + D_OUT, 1)
  np.testing.assert_allclose(np.diag(dense["naive_diag"]), flat[:, 0]**2 / batch,
                             **TOL)


@pytest.mark.parametrize("world", WORLDS)
def test_weighted_sources_subtract(world):
  x1 = _rand(6, N, D_IN)
  x2 = 0.5 * _rand(7, N, D_IN)
  g1, g2 = _rand(8, N, D_OUT), _rand(9, N, D_OUT)
  dfunc = damping_lib.DampingFunc(lambda: 0.3, "k")
  store = _store()

  def build(vs):
    del vs
    srcs = [(tf.constant(x1),), (tf.constant(x2),)]
    full = ff.FullyConnectedKroneckerFactor(srcs, weights=(1, -1), name="fk")
    diag = ff.DiagonalKroneckerFactor(srcs, weights=(1, -1), name="dk")
    fcd = ff.FullyConnectedDiagonalFactor(
        (tf.constant(x1),), [(tf.constant(g1),), (tf.constant(g2),)],
        weights=(1, -1), name="fcd")
    for f in (full, diag, fcd):
      f.attach_state_store(store)
    full.register_matpower(-1, dfunc)
    full.register_matpower(2, dfunc)
    ops = [f.make_covariance_update_op(0.5) for f in (full, diag, fcd)]
    return [tf.group(*ops), tf.group(*full.make_inverse_update_ops()),
            [_read(full.get_cov()), _read(diag.get_cov_var()),
             _read(fcd.get_cov_var()), _read(full.get_matpower(-1, dfunc)),
             _read(full.get_matpower(2, dfunc))]]

  cov, diag, fcd, inv, sq = ref.run_stages(world, [np.zeros(1)], build)[-1]
  want = _gram(x1) - _gram(x2)
  np.testing.assert_allclose(cov, want, **TOL)
  np.testing.assert_allclose(diag, np.diag(want), **TOL)
  np.testing.assert_allclose(fcd, ((x1**2).T @ (g1**2) - (x1**2).T @ (g2**2)) / N,
                             **TOL)
  damped = want + 0.3 * np.eye(D_IN)
  np.testing.assert_allclose(inv, np.linalg.inv(damped), rtol=1e-9, atol=1e-12)
  np.testing.assert_allclose(sq, damped @ damped, rtol=1e-9, atol=1e-12)


def test_indefinite_factor_refuses_cholesky_and_fractional_powers():
  dfunc = damping_lib.DampingFunc(lambda: 0.1, "k")
  with tf.Graph().as_default():
    srcs = [(tf.constant(_rand(10, N, D_IN)),), (tf.constant(_rand(11, N, D_IN)),)]
    factor = ff.FullyConnectedKroneckerFactor(srcs, weights=(1.0, -1.0),
                                              name="indefinite")
    with pytest.raises(ValueError, match="Cholesky factor of factor indefinite"):
      factor.register_cholesky(dfunc)
    with pytest.raises(ValueError, match="inverse Cholesky.*indefinite"):
      factor.register_cholesky_inverse(dfunc)
    with pytest.raises(ValueError, match="only integer powers.*-0.5"):
      factor.register_matpower(-0.5, dfunc)
    naive = ff.NaiveFullFactor([(tf.constant(_rand(12, 3)),),
                                (tf.constant(_rand(13, 3)),)], 2.0,
                               weights=(1.0, -0.5), name="naive_indef")
    with pytest.raises(ValueError, match="naive_indef"):
      naive.register_cholesky(dfunc)
    with pytest.raises(ValueError, match="Got 1 source weights for 2 sources"):
      ff.FullyConnectedKroneckerFactor(srcs, weights=(1.0,))


# ------------------------------------------------------- inverse updates
@pytest.mark.parametrize("world", WORLDS)
def test_inverse_matpower_and_cholesky_variables(world):
  x = _rand(14, N, D_IN)
  v = _rand(15, D_IN + 1, 2)
  dfunc = damping_lib.DampingFunc(lambda: 0.1, "k")
  store = _store()

  def build(vs):
    del vs
    factor = ff.FullyConnectedKroneckerFactor((tf.constant(x),), has_bias=True)
    factor.attach_state_store(store)
    factor.register_matpower(-1, dfunc)
    factor.register_matpower(-0.5, dfunc)
    factor.register_matpower(-0.5, damping_lib.DampingFunc(lambda: 0.1, "k"))
    factor.register_cholesky(dfunc)
    factor.register_cholesky_inverse(dfunc)
    factor.instantiate_inv_variables()
    # Ops first: in the tf.function world stages run in program order.
    cov_op = factor.make_covariance_update_op(0.95)
    inv_op = tf.group(*factor.make_inverse_update_ops())
    vt = tf.constant(v)
    fetch = {
        "inv": _read(factor.get_inverse(dfunc)),
        "pow": _read(factor.get_matpower(-0.5, dfunc)),
        "chol": _read(factor.get_cholesky(dfunc)),
        "cholinv": _read(factor.get_cholesky_inverse(dfunc)),
        "left": factor.left_multiply_matpower(vt, -0.5, dfunc),
        "right": factor.right_multiply_matpower(tf.transpose(vt), -0.5, dfunc),
        "left1": factor.left_multiply_matpower(vt, 1, dfunc),
        "lchol": factor.left_multiply_cholesky(vt, dfunc),
        "lcholt": factor.left_multiply_cholesky(vt, dfunc, transpose=True),
        "lcholinv": factor.left_multiply_cholesky(vt, dfunc, inverse=True),
    }
    n_inv_vars = len(factor._vars)  # pylint: disable=protected-access
    return [cov_op, inv_op, (fetch, tf.constant(n_inv_vars))]

  fetch, n_inv_vars = ref.run_stages(world, [np.zeros(1)], build)[-1]
  # The repeated (-0.5, "k") registration is shared: 4 variables, not 5.
  assert n_inv_vars == 4
  damped = _gram(_with_ones(x)) + 0.1 * np.eye(D_IN + 1)
  chol = np.linalg.cholesky(damped)
  inv_sqrt = ref.sym_matpower(damped, -0.5)
  np.testing.assert_allclose(fetch["inv"], np.linalg.inv(damped), **TOL)
  np.testing.assert_allclose(fetch["pow"], inv_sqrt, **TOL)
  np.testing.assert_allclose(fetch["chol"], chol, **TOL)
  np.testing.assert_allclose(fetch["cholinv"], np.linalg.inv(chol), **TOL)
  np.testing.assert_allclose(fetch["left"], inv_sqrt @ v, **TOL)
  np.testing.assert_allclose(fetch["right"], v.T @ inv_sqrt, **TOL)
  np.testing.assert_allclose(fetch["right"], fetch["left"].T, **TOL)
  np.testing.assert_allclose(fetch["left1"], damped @ v, **TOL)
  np.testing.assert_allclose(fetch["lchol"], chol @ v, **TOL)
  np.testing.assert_allclose(fetch["lcholt"], chol.T @ v, **TOL)
  np.testing.assert_allclose(fetch["lcholinv"], np.linalg.solve(chol, v), **TOL)


def test_unregistered_power_or_damping_is_an_error():
  dfunc = damping_lib.DampingFunc(lambda: 0.1, "k")
  with tf.Graph().as_default():
    factor = ff.FullyConnectedKroneckerFactor((tf.constant(_rand(16, N, 2)),),
                                              name="fac")
    factor.register_matpower(-1, dfunc)
    x = tf.constant(np.eye(2))
    with pytest.raises(ValueError, match=r"exponent 2 .*factor fac; register"):
      factor.left_multiply_matpower(x, 2, dfunc)
    with pytest.raises(ValueError, match="register"):
      factor.right_multiply_matpower(x, -0.5, dfunc)
    other = damping_lib.DampingFunc(lambda: 0.1, "other")
    with pytest.raises(ValueError, match="'other'.*register"):
      factor.get_inverse(other)
    with pytest.raises(ValueError, match="register"):
      factor.get_cholesky(dfunc)
    with pytest.raises(ValueError, match="register"):
      factor.get_cholesky_inverse(dfunc)


@pytest.mark.parametrize("world", WORLDS)
def test_diagonal_factor_powers_need_no_registration(world):
  g = _rand(17, 5, 1)
  v = _rand(18, 5, 1)
  dfunc = damping_lib.DampingFunc(lambda: 0.2, "k")
  store = _store()

  def build(vs):
    del vs
    factor = ff.NaiveDiagonalFactor([(tf.constant(g),)], 2.0)
    factor.attach_state_store(store)
    vt = tf.constant(v)
    return [factor.make_covariance_update_op(0.9),
            [factor.left_multiply_matpower(vt, e, dfunc)
             for e in (1, -1, -0.5, 2)]]

  out = ref.run_stages(world, [np.zeros(1)], build)[-1]
  diag = g**2 / 2.0 + 0.2
  for got, e in zip(out, (1, -1, -0.5, 2)):
    np.testing.assert_allclose(got, diag**e * v, **TOL)


# ----------------------------------------------------------------- linalg
def _spd(seed, n, low=0.1, high=3.0):
  rng = np.random.RandomState(seed)
  q, _ = np.linalg.qr(rng.randn(n, n))
  return (q * np.linspace(low, high, n)) @ q.T


def test_damped_linalg_matches_numpy_in_float64():
  mat = _spd(20, 5)
  damping = 0.05
  damped = mat + damping * np.eye(5)
  chol = np.linalg.cholesky(damped)
  m = tf.constant(mat)
  np.testing.assert_allclose(linalg.damped_inverse(m, damping).numpy(),
                             np.linalg.inv(damped), rtol=1e-10, atol=1e-10)
  np.testing.assert_allclose(linalg.damped_cholesky(m, damping).numpy(), chol,
                             rtol=1e-10, atol=1e-10)
  np.testing.assert_allclose(
      linalg.damped_cholesky_inverse(m, damping).numpy(), np.linalg.inv(chol),
      rtol=1e-10, atol=1e-10)
  for exp in (1, -1, -0.5, 0.5, 2, -2, 1.5):
    np.testing.assert_allclose(
        linalg.damped_matpower(m, exp, damping).numpy(),
        ref.sym_matpower(damped, exp), rtol=1e-10, atol=1e-10,
        err_msg="exp=%s" % exp)
  # A damping given as a tensor works the same.
  np.testing.assert_allclose(
      linalg.damped_inverse(m, tf.constant(damping, tf.float64)).numpy(),
      np.linalg.inv(damped), rtol=1e-10, atol=1e-10)


def test_float32_is_unsafe_bound():
  well = _spd(21, 4, 0.1, 1.0).astype(np.float32)
  assert not linalg._float32_is_unsafe(tf.constant(well), 1.0).numpy()
  assert not linalg._float32_is_unsafe(tf.constant(well), 1e-3).numpy()
  assert linalg._float32_is_unsafe(tf.constant(well), 1e-7).numpy()
  # float64 never switches.
  assert not linalg._float32_is_unsafe(tf.constant(well, tf.float64),
                                       1e-12).numpy()


def _weakly_correlated(n=200):
  """A PSD matrix whose largest row sum (about 1.6) is far below its trace."""
  rng = np.random.RandomState(27)
  r = rng.randn(n, n)
  return np.diag(rng.uniform(0.5, 1.5, n)) + 1e-3 * r @ r.T / n


def test_float32_bound_uses_the_smaller_of_trace_and_row_sum():
  eps = 1.1920929e-07
  eye = tf.eye(100)  # trace 100, row sum 1: bound 10 * 100 * eps * 1
  assert not linalg._float32_is_unsafe(eye, 1.01 * 1000 * eps).numpy()
  assert linalg._float32_is_unsafe(eye, 0.99 * 1000 * eps).numpy()
  ones = tf.ones([64, 64])  # trace = row sum = 64
  bound = 10 * 64 * eps * 64
  assert not linalg._float32_is_unsafe(ones, 1.01 * bound).numpy()
  assert linalg._float32_is_unsafe(ones, 0.99 * bound).numpy()


@pytest.mark.parametrize("side", ["above", "below"])
def test_float32_at_the_edge_of_the_bound(side, monkeypatch):
  """Just above the bound the damped matrix factors in float32 (backward
  error ~eps, inverse error ~cond * eps); just below it goes through float64
  (inverse error: the float32 rounding of the result only). The trace bound
  alone (50x larger here) would have sent both to float64."""
  mat = _weakly_correlated()
  n = mat.shape[0]
  m32 = mat.astype(np.float32)
  mat = m32.astype(np.float64)
  row_sum = np.abs(mat).sum(1).max()
  bound = 10 * n * 1.1920929e-07 * row_sum
  assert 10 * n * 1.1920929e-07 * np.trace(mat) > 50 * bound
  damping = bound * (1.01 if side == "above" else 0.99)
  assert bool(linalg._float32_is_unsafe(tf.constant(m32), damping).numpy()) == (
      side == "below")
  dtypes = []  # what tf.linalg.cholesky factors (eagerly: the branch taken)
  real_cholesky = tf.linalg.cholesky
  monkeypatch.setattr(tf.linalg, "cholesky",
                      lambda a: dtypes.append(a.dtype) or real_cholesky(a))
  want = mat + damping * np.eye(n)
  chol = linalg.damped_cholesky(tf.constant(m32), damping).numpy()
  chol = chol.astype(np.float64)
  backward = np.linalg.norm(chol @ chol.T - want) / np.linalg.norm(want)
  want_inv = np.linalg.inv(want)
  inv = linalg.damped_inverse(tf.constant(m32), damping).numpy()
  inv_err = (np.linalg.norm(inv.astype(np.float64) - want_inv) /
             np.linalg.norm(want_inv))
  cond = np.linalg.cond(want)  # about 3: float32 is accurate here
  if side == "above":
    assert dtypes == [tf.float32, tf.float32]
    assert backward < 1e-6, backward  # measured 1.1e-7
    assert inv_err < cond * 1.2e-7, (inv_err, cond)  # measured 1.4e-7
  else:
    assert dtypes == [tf.float64, tf.float64]
    assert backward < 1e-7, backward  # measured 5.7e-8
    assert inv_err < 1e-7, inv_err  # measured 2.4e-8


def _ill_conditioned_float32(n=20):
  rng = np.random.RandomState(22)
  q, _ = np.linalg.qr(rng.randn(n, n))
  return ((q * np.logspace(6, 0, n)) @ q.T).astype(np.float32)


def test_float32_ill_conditioned_matrix_goes_through_float64():
  m32 = _ill_conditioned_float32()
  n = m32.shape[0]
  damping = 1e-6
  mt = tf.constant(m32)
  assert linalg._float32_is_unsafe(mt, damping).numpy()
  # bound = 10 * n * eps * trace(M) (about 46 here): well above it, safe.
  assert not linalg._float32_is_unsafe(mt, 100.0).numpy()
  want = m32.astype(np.float64) + damping * np.eye(n)

  chol = linalg.damped_cholesky(mt, damping)
  assert chol.dtype == tf.float32
  chol = chol.numpy().astype(np.float64)
  assert np.all(np.isfinite(chol))
  np.testing.assert_array_equal(np.triu(chol, 1), 0.0)
  assert np.linalg.norm(chol @ chol.T - want) / np.linalg.norm(want) < 1e-4

  # The inverse computed in float64 keeps full float32 accuracy, while the
  # plain float32 Cholesky solve loses about cond * eps (~1e-3 here).
  want_inv = np.linalg.inv(want)
  inv = linalg.damped_inverse(mt, damping)
  assert inv.dtype == tf.float32
  inv_err = (np.linalg.norm(inv.numpy().astype(np.float64) - want_inv) /
             np.linalg.norm(want_inv))
  plain_chol = tf.linalg.cholesky(mt + damping * tf.eye(n))
  plain_inv = tf.linalg.cholesky_solve(plain_chol, tf.eye(n)).numpy()
  plain_err = (np.linalg.norm(plain_inv.astype(np.float64) - want_inv) /
               np.linalg.norm(want_inv))
  assert inv_err < 1e-6
  assert plain_err > 1e-5

  # Same in a traced function (the switch is a tf.cond).
  traced = tf.function(linalg.damped_cholesky)(mt, damping).numpy()
  np.testing.assert_allclose(traced.astype(np.float64), chol, rtol=1e-6,
                             atol=1e-6)


def test_float32_singular_gram_matrix_factors_only_with_the_fallback():
  # An integer Gram matrix of rank 5 is exact in float32; damping 1e-6 is
  # lost against diagonal entries ~1e5 in float32 arithmetic.
  rng = np.random.RandomState(23)
  x = rng.randint(-30, 30, size=(5, 20)).astype(np.float64)
  gram = 100.0 * x.T @ x
  g32 = gram.astype(np.float32)
  np.testing.assert_array_equal(g32.astype(np.float64), gram)
  damping = 1e-6
  want = gram + damping * np.eye(20)
  try:
    plain = tf.linalg.cholesky(tf.constant(g32) + damping * tf.eye(20)).numpy()
    assert not np.all(np.isfinite(plain))
  except tf.errors.InvalidArgumentError:
    pass
  chol = linalg.damped_cholesky(tf.constant(g32), damping).numpy()
  assert np.all(np.isfinite(chol))
  chol = chol.astype(np.float64)
  assert np.linalg.norm(chol @ chol.T - want) / np.linalg.norm(want) < 1e-4


def test_kronecker_product_and_diagonal_matpower():
  a, b = _rand(24, 2, 3), _rand(25, 4, 2)
  np.testing.assert_allclose(
      linalg.kronecker_product(tf.constant(a), tf.constant(b)).numpy(),
      np.kron(a, b), **TOL)
  diag = np.abs(_rand(26, 5)) + 0.1
  for exp in (1, -1, 0.5, -0.5, 2, -3):
    np.testing.assert_allclose(
        linalg.diagonal_matpower(tf.constant(diag), exp, 0.3).numpy(),
        (diag + 0.3)**exp, **TOL)
  np.testing.assert_allclose(
      linalg.add_to_diagonal(tf.constant(a[:2, :2]), 0.5).numpy(),
      a[:2, :2] + 0.5 * np.eye(2), **TOL)


# ---------------------------------------------------------------- damping
def test_pi_adjusted_damping():
  a = _spd(27, 4)
  g = _spd(28, 3, 1.0, 7.0)
  lam = 0.03
  ta, tg = np.trace(a) / 4, np.trace(g) / 3
  left, right = damping_lib.compute_pi_adjusted_damping(
      tf.constant(ta), tf.constant(tg), lam)
  pi = np.sqrt(ta / tg)
  np.testing.assert_allclose(left.numpy(), pi * np.sqrt(lam), **TOL)
  np.testing.assert_allclose(right.numpy(), np.sqrt(lam) / pi, **TOL)
  np.testing.assert_allclose(left.numpy() * right.numpy(), lam, **TOL)
  for zero_left in (True, False):
    left, right = damping_lib.compute_pi_adjusted_damping(
        tf.constant(0.0 if zero_left else ta, tf.float64),
        tf.constant(tg if zero_left else 0.0, tf.float64), lam)
    np.testing.assert_allclose(left.numpy(), np.sqrt(lam), **TOL)
    np.testing.assert_allclose(right.numpy(), np.sqrt(lam), **TOL)


@pytest.mark.parametrize("world", WORLDS)
def test_pi_adjusted_damping_funcs_use_factor_traces(world):
  a, g = _rand(29, N, D_IN), 3.0 * _rand(30, N, D_OUT)
  store = _store()
  base = damping_lib.DampingFunc(lambda: 0.02, "base")

  def build(vs):
    del vs
    fa = ff.FullyConnectedKroneckerFactor((tf.constant(a),), name="A")
    fg = ff.FullyConnectedKroneckerFactor((tf.constant(g),), name="G")
    for f in (fa, fg):
      f.attach_state_store(store)
    before = damping_lib.pi_adjusted_damping_funcs(fa, fg, base)
    one = tf.ones([], tf.float64)

    def values(funcs):
      return [tf.identity(funcs[0]()), tf.identity(funcs[1]()),
              funcs[0].scale(one), funcs[1].scale(one)]

    fetch_before = values(before)
    ops = tf.group(fa.make_covariance_update_op(0.9),
                   fg.make_covariance_update_op(0.9))
    after = damping_lib.pi_adjusted_damping_funcs(fa, fg, base)
    assert after[0].key == before[0].key != after[1].key
    return [fetch_before, ops, values(after)]

  out = ref.run_stages(world, [np.zeros(1)], build)
  root = np.sqrt(0.02)
  # Before any statistics the traces are zero: pi = 1.
  np.testing.assert_allclose(out[0], [root, root, 1.0, 1.0], **TOL)
  # After: damping sqrt(l) on A / pi and on pi G ...
  a_cov, g_cov = _gram(a), _gram(g)
  pi = np.sqrt((np.trace(a_cov) / D_IN) / (np.trace(g_cov) / D_OUT))
  np.testing.assert_allclose(out[2], [root, root, 1 / pi, pi], **TOL)
  # ... whose Kronecker product is the pi-damped one of the paper.
  scaled = np.kron(a_cov / pi + root * np.eye(D_IN),
                   pi * g_cov + root * np.eye(D_OUT))
  paper = np.kron(a_cov + pi * root * np.eye(D_IN),
                  g_cov + root / pi * np.eye(D_OUT))
  np.testing.assert_allclose(scaled, paper, rtol=1e-12, atol=1e-14)


def test_as_damping_func_keys():
  assert damping_lib.as_damping_func(0.1).key == damping_lib.as_damping_func(
      0.1).key
  assert damping_lib.as_damping_func(0.1).key != damping_lib.as_damping_func(
      0.2).key
  assert damping_lib.as_damping_func(0.25)() == 0.25
  dfunc = damping_lib.DampingFunc(lambda: 3.0, "mine")
  assert damping_lib.as_damping_func(dfunc) is dfunc
  scaled = damping_lib.scaled_damping_func(dfunc, 0.5)
  assert scaled() == 1.5
  assert scaled.key == ("scaled", ("const", 0.5), "mine")
  assert damping_lib.scaled_damping_func(dfunc, 0.25).key != scaled.key


# ------------------------------------------------------------- StateStore
def test_state_store_get_or_create():
  store = kfac.state.StateStore("store_test")
  var = store.get_or_create("layer/cov", [2, 3], tf.float64, initial_value=1.5)
  np.testing.assert_array_equal(var.numpy(), np.full([2, 3], 1.5))
  assert var.dtype == tf.float64 and not var.trainable
  assert store.get_or_create("layer/cov", [2, 3], tf.float64) is var
  assert store.get("layer/cov") is var
  assert "layer/cov" in store and "other" not in store
  with pytest.raises(ValueError, match=r"'layer/cov'.*shape \(2, 3\)"):
    store.get_or_create("layer/cov", [3, 2], tf.float64)
  with pytest.raises(ValueError, match=r"'layer/cov'.*float32"):
    store.get_or_create("layer/cov", [2, 3], tf.float32)
  with pytest.raises(ValueError, match=r"'partial'.*fully defined"):
    store.get_or_create("partial", [None, 3], tf.float64)
  assert list(store.variables_by_name) == ["layer/cov"]
  # The tf.Module tracks the variable (so checkpoints save it).
  assert any(v is var for v in store.variables)


def test_state_store_creates_variables_once_outside_traces():
  store = kfac.state.StateStore("traced")
  created = []

  @tf.function
  def step(x):
    before = len(store.variables_by_name)
    var = store.get_or_create("acc", [], tf.float64)
    created.append(len(store.variables_by_name) - before)
    var.assign_add(tf.reduce_sum(x))
    return var.read_value()

  assert step(tf.constant([1.0, 2.0], tf.float64)).numpy() == 3.0
  # A different input shape retraces the function.
  assert step(tf.constant([[4.0]], tf.float64)).numpy() == 7.0
  assert step(tf.constant([[4.0]], tf.float64)).numpy() == 11.0
  # Traced at least twice (TF also retraces a function whose first trace
  # met a variable creation), yet only the first trace created the variable.
  assert step.experimental_get_tracing_count() >= 2
  assert len(created) == step.experimental_get_tracing_count()
  assert created[0] == 1 and sum(created) == 1
  var = store.get("acc")
  # Created eagerly (init_scope), so it lives outside the traces.
  assert var.numpy() == 11.0
  assert list(store.variables_by_name) == ["acc"]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 10])
def test_per_channel_second_moments_equal_the_einsum(n):
  """Batched factors' statistic: the sums of products (n <= 4) or the
  batched matmul equal tf.einsum("rim,rjm->mij") in float64, in eager mode
  and in a graph whose row count is known only at run time."""
  from kfac.python.ops.layers.base import batched_factors  # pylint: disable=g-import-not-at-top
  x = np.random.RandomState(n).randn(37, n, 6)
  want = np.einsum("rim,rjm->mij", x, x)
  got = batched_factors.per_channel_second_moments(tf.constant(x))
  assert got.shape == (6, n, n)
  np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
  fn = tf.function(batched_factors.per_channel_second_moments,
                   input_signature=[tf.TensorSpec([None, n, 6], tf.float64)])
  np.testing.assert_allclose(fn(tf.constant(x)), want, rtol=1e-13,
                             atol=1e-13)
