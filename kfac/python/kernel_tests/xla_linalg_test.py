"""The blocked Cholesky routines of numerics/xla_linalg.py and their use under XLA.

* L, L^-1 and the inverse = numpy's in float64 (1e-10 relative, measured
  <= 1e-13), for sizes 1, 2, odd sizes, exactly the base size, base + 1 and
  a few hundred, eagerly and XLA-compiled; base sizes 1 (1x1 leaves) to 64;
* linalg.damped_* build the blocked recursion under jit_compile=True only
  (a spy on xla_linalg), and keep the float64 fallback there; without XLA,
  damped_inverse builds it (blocks of linalg.CPU_BLOCK_SIZE) for static
  matrices wider than linalg.CPU_BLOCKED_MIN, eagerly, in a tf.function and
  in a TF1 graph, with numpy's values (float64 1e-10, float32 1e-5); its
  float64 fallback there is cholesky_solve, as accurate;
* a TF2 K-FAC step whose factors exceed the base size takes the same steps
  with jit_compile=True as without (rtol 1e-5, float32), through the
  blocked path (distribute_options_test.py compares small factors);
* a batch [k, n, n] gives each matrix its own result (1e-14 of the
  matrix computed alone; numerics/batched_inverse.py stacks factors);
* bad shapes and base sizes are refused with a ValueError.
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.ops.numerics import linalg
from kfac.python.ops.numerics import xla_linalg

BASE = xla_linalg.BASE_SIZE
SIZES = (1, 2, 3, 7, BASE - 1, BASE, BASE + 1, 2 * BASE + 3, 257)


def _spd(n, seed=0, low=0.1, high=3.0):
  rng = np.random.RandomState(seed + n)
  q, _ = np.linalg.qr(rng.randn(n, n))
  return (q * np.linspace(low, high, n)) @ q.T


def _close(got, want, tol=1e-10):
  """Max-norm error relative to the largest entry of `want`."""
  err = np.max(np.abs(got - want)) / np.max(np.abs(want))
  assert err <= tol, err


def _check_against_numpy(n, chol, chol_inv, inverse):
  a = _spd(n)
  want_l = np.linalg.cholesky(a)
  _close(chol, want_l)
  _close(chol_inv, np.linalg.inv(want_l))
  _close(inverse, np.linalg.inv(a))
  np.testing.assert_array_equal(np.triu(chol, 1), 0.0)
  np.testing.assert_array_equal(np.triu(chol_inv, 1), 0.0)


@pytest.mark.parametrize("n", SIZES)
def test_blocked_cholesky_and_inverse_match_numpy_in_float64(n):
  a = tf.constant(_spd(n))
  chol, chol_inv = xla_linalg.cholesky_and_inverse(a)
  _check_against_numpy(n, chol.numpy(), chol_inv.numpy(),
                       xla_linalg.spd_inverse(a).numpy())
  np.testing.assert_array_equal(xla_linalg.cholesky(a).numpy(), chol.numpy())
  np.testing.assert_array_equal(xla_linalg.cholesky_inverse(a).numpy(),
                                chol_inv.numpy())


@pytest.mark.parametrize("n", (1, BASE, BASE + 1, 200))
def test_blocked_routines_compiled_by_xla_match_numpy(n):
  @tf.function(jit_compile=True)
  def run(a):
    chol, chol_inv = xla_linalg.cholesky_and_inverse(a)
    return chol, chol_inv, xla_linalg.spd_inverse(a)
  _check_against_numpy(n, *[t.numpy() for t in run(tf.constant(_spd(n)))])


@pytest.mark.parametrize("base_size", (1, 2, 5, 64))
def test_any_base_size_gives_the_same_factor(base_size):
  n = 45
  a = tf.constant(_spd(n))
  chol, chol_inv = xla_linalg.cholesky_and_inverse(a, base_size=base_size)
  inverse = xla_linalg.lower_gram(chol_inv, base_size=base_size)
  _check_against_numpy(n, chol.numpy(), chol_inv.numpy(), inverse.numpy())


def test_only_the_lower_triangles_are_read():
  n = 70
  a = _spd(n)
  noisy = a + np.triu(np.random.RandomState(1).randn(n, n), 1)
  chol = xla_linalg.cholesky(tf.constant(noisy)).numpy()
  _close(chol, np.linalg.cholesky(a))
  m = np.linalg.inv(np.linalg.cholesky(a))
  noisy_m = m + np.triu(np.random.RandomState(2).randn(n, n), 1)
  gram = xla_linalg.lower_gram(tf.constant(noisy_m), base_size=16).numpy()
  _close(gram, m.T @ m)


def test_not_positive_definite_gives_non_finite_values():
  a = _spd(40)
  a[30, 30] = -5.0  # a negative diagonal entry: indefinite
  chol = xla_linalg.cholesky(tf.constant(a)).numpy()
  assert not np.all(np.isfinite(chol))


@pytest.mark.parametrize("n", (BASE + 1, 2 * BASE + 3))
def test_a_batch_gets_each_matrix_own_result(n):
  mats = np.stack([_spd(n, seed) for seed in range(3)])
  chol, chol_inv = xla_linalg.cholesky_and_inverse(tf.constant(mats))
  inverse = xla_linalg.spd_inverse(tf.constant(mats)).numpy()
  for i in range(3):
    one_chol, one_inv = xla_linalg.cholesky_and_inverse(tf.constant(mats[i]))
    _close(chol[i].numpy(), one_chol.numpy(), 1e-14)
    _close(chol_inv[i].numpy(), one_inv.numpy(), 1e-14)
    _close(inverse[i], np.linalg.inv(mats[i]))


def test_bad_input_is_refused():
  with pytest.raises(ValueError, match="square matrix of static shape"):
    xla_linalg.cholesky(tf.zeros([3, 4]))
  with pytest.raises(ValueError, match="square matrix of static shape"):
    xla_linalg.cholesky(tf.zeros([2, 3, 4]))
  with pytest.raises(ValueError, match="square matrix of static shape"):
    xla_linalg.lower_gram(tf.zeros([5]))
  with pytest.raises(ValueError, match="base_size"):
    xla_linalg.cholesky(tf.eye(3), base_size=0)

  @tf.function(input_signature=[tf.TensorSpec([None, None], tf.float32)])
  def dynamic(a):
    return xla_linalg.cholesky(a)
  with pytest.raises(ValueError, match="static shape"):
    dynamic.get_concrete_function()


class _Spy(object):
  """Counts calls of xla_linalg.cholesky_and_inverse (graph builds)."""

  def __init__(self, monkeypatch):
    self.calls = 0
    real = xla_linalg.cholesky_and_inverse

    def spy(*args, **kwargs):
      self.calls += 1
      return real(*args, **kwargs)
    monkeypatch.setattr(xla_linalg, "cholesky_and_inverse", spy)


ROUTINES = {
    "damped_inverse": (linalg.damped_inverse,
                       lambda d: np.linalg.inv(d)),
    "damped_cholesky": (linalg.damped_cholesky, np.linalg.cholesky),
    "damped_cholesky_inverse": (linalg.damped_cholesky_inverse,
                                lambda d: np.linalg.inv(np.linalg.cholesky(d))),
    "posdef_inv": (lambda m, d: linalg.posdef_inv(m, d, "cholesky"),
                   lambda d: np.linalg.inv(d)),
    "cholesky": (linalg.cholesky, np.linalg.cholesky),
}


@pytest.mark.parametrize("name", sorted(ROUTINES))
def test_blocked_path_is_used_under_xla_only(name, monkeypatch):
  fn, want_fn = ROUTINES[name]
  n, damping = 2 * BASE + 5, 0.05
  mat = tf.constant(_spd(n))
  want = want_fn(_spd(n) + damping * np.eye(n))
  spy = _Spy(monkeypatch)
  for compiled, uses_blocked in ((None, False), (False, False), (True, True)):
    before = spy.calls
    if compiled is None:
      got = fn(mat, damping)
    else:
      got = tf.function(lambda m: fn(m, damping), jit_compile=compiled)(mat)
    assert (spy.calls > before) == uses_blocked, (name, compiled)
    _close(got.numpy(), want)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_wide_damped_inverse_is_blocked_without_xla(dtype, monkeypatch):
  n, damping = linalg.CPU_BLOCKED_MIN + 45, 0.05
  want = np.linalg.inv(_spd(n) + damping * np.eye(n))
  tol = 1e-10 if dtype == np.float64 else 1e-5  # float32 measured 6e-7
  spy = _Spy(monkeypatch)
  mat = tf.constant(_spd(n).astype(dtype))
  _close(linalg.damped_inverse(mat, damping).numpy(), want, tol)
  _close(tf.function(lambda m: linalg.damped_inverse(m, damping))(
      mat).numpy(), want, tol)
  with tf.Graph().as_default():
    out = linalg.damped_inverse(tf.constant(_spd(n).astype(dtype)), damping)
    with tf.compat.v1.Session() as sess:
      _close(sess.run(out), want, tol)
  # One blocked build per call: float32 graphs build their float64
  # fallback with cholesky_solve (fewer graph nodes), see below.
  assert spy.calls == 3, spy.calls
  # At the limit and with a run-time shape: the library kernels.
  before = spy.calls
  linalg.damped_inverse(tf.constant(_spd(linalg.CPU_BLOCKED_MIN)), damping)
  tf.function(lambda m: linalg.damped_inverse(m, damping),
              input_signature=[tf.TensorSpec([None, None], tf.float64)]
             ).get_concrete_function()
  assert spy.calls == before


def test_wide_float32_fallback_without_xla_is_cholesky_solve(monkeypatch):
  """Without XLA an ill-conditioned wide float32 factor is inverted in
  float64 by cholesky_solve (the blocked recursion is built for the float32
  attempt only), keeping float32 accuracy; in a TF1 graph too."""
  n = linalg.CPU_BLOCKED_MIN + 7
  rng = np.random.RandomState(22)
  q, _ = np.linalg.qr(rng.randn(n, n))
  m32 = ((q * np.logspace(6, 0, n)) @ q.T).astype(np.float32)
  damping = 1e-6
  assert linalg._float32_is_unsafe(tf.constant(m32), damping).numpy()
  want = np.linalg.inv(m32.astype(np.float64) + damping * np.eye(n))
  spy = _Spy(monkeypatch)
  inv = tf.function(lambda m: linalg.damped_inverse(m, damping))(
      tf.constant(m32))
  with tf.Graph().as_default():
    out = linalg.damped_inverse(tf.constant(m32), damping)
    with tf.compat.v1.Session() as sess:
      inv_tf1 = sess.run(out)
  assert spy.calls == 2, spy.calls  # the float32 attempt of each graph
  for got in (inv.numpy(), inv_tf1):
    assert got.dtype == np.float32
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 1e-6, err


def test_use_xla_blocked_decision():
  mat = tf.zeros([3, 3])
  assert not linalg.use_xla_blocked(mat)

  @tf.function(jit_compile=True)
  def decide(m):
    assert linalg.use_xla_blocked(m)
    assert not linalg.use_xla_blocked(tf.reshape(m, [9]))
    return m
  decide(mat)

  @tf.function
  def decide_plain(m):
    assert not linalg.use_xla_blocked(m)
    return m
  decide_plain(mat)


def test_float32_fallback_to_float64_is_kept_under_xla(monkeypatch):
  """An ill-conditioned float32 factor is inverted in float64 under XLA too
  (through the blocked code), keeping float32 accuracy."""
  n = 2 * BASE + 7
  rng = np.random.RandomState(22)
  q, _ = np.linalg.qr(rng.randn(n, n))
  m32 = ((q * np.logspace(6, 0, n)) @ q.T).astype(np.float32)
  damping = 1e-6
  assert linalg._float32_is_unsafe(tf.constant(m32), damping).numpy()
  spy = _Spy(monkeypatch)
  inv = tf.function(lambda m: linalg.damped_inverse(m, damping),
                    jit_compile=True)(tf.constant(m32))
  # Built twice: in float32 and in float64 (the branch taken here, and
  # the retry of a non-finite float32 result).
  assert inv.dtype == tf.float32 and spy.calls == 2
  want = np.linalg.inv(m32.astype(np.float64) + damping * np.eye(n))
  err = np.linalg.norm(inv.numpy() - want) / np.linalg.norm(want)
  assert err < 1e-6, err


def _mlp_run(jit, width=2 * BASE + 6):
  """4 TF2 K-FAC steps of a 2-layer MLP whose factors exceed the base size."""
  rng = np.random.RandomState(3)
  x = tf.constant(rng.randn(96, width).astype(np.float32))
  y = tf.constant(rng.randint(0, 5, 96).astype(np.int32))
  w1 = tf.Variable(rng.randn(width, BASE + 9).astype(np.float32) * 0.2)
  b1 = tf.Variable(np.zeros(BASE + 9, np.float32))
  w2 = tf.Variable(rng.randn(BASE + 9, 5).astype(np.float32) * 0.2)
  opt = kfac.PeriodicInvCovUpdateKfacOpt(
      invert_every=2, num_burnin_steps=1, learning_rate=0.1, damping=0.01,
      momentum=0.9, estimation_mode="exact")

  @tf.function(jit_compile=jit)
  def step():
    lc = kfac.LayerCollection()
    pre = tf.matmul(x, w1) + b1
    lc.register_fully_connected((w1, b1), x, pre)
    logits = tf.matmul(tf.tanh(pre), w2)
    lc.register_fully_connected(w2, tf.tanh(pre), logits)
    lc.register_softmax_cross_entropy_loss(logits, targets=y)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=logits))
    opt.minimize(loss, var_list=[w1, b1, w2], layer_collection=lc)
    return loss

  losses = [float(step()) for _ in range(4)]
  return losses, [v.numpy() for v in (w1, b1, w2)]


@pytest.mark.slow  # end to end: XLA-compiled steps
def test_kfac_step_with_large_factors_is_the_same_under_xla(monkeypatch):
  plain_losses, plain = _mlp_run(False)
  spy = _Spy(monkeypatch)
  xla_losses, xla = _mlp_run(True)
  assert spy.calls > 0
  assert plain_losses[-1] < plain_losses[0]
  np.testing.assert_allclose(xla_losses, plain_losses, rtol=1e-5)
  for a, b in zip(plain, xla):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
