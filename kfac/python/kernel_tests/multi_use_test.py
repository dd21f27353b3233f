"""Layers used several times (`register_fully_connected_multi`): kron_indep
and its diagonal variants, the kron_series options, registration checks.

References, all float64 and never built with kfac code:
* the exact GGN of the per-example loss averaged over examples, from tape
  Jacobians (tied-weight deep linear network, a loss term per use: kron_indep
  is exact there);
* the kron_indep block built by hand, num_uses * (mean_{n,t} a a^T) (x)
  (mean_{n,t} g g^T), from numpy inputs and closed-form output gradients;
* the series approximations of Martens, Ba & Johnson (2018) evaluated from
  their *definition* with dense matrices: with V_0 = A_0 (x) G_0 (damped
  like kron_indep: pi rule on damping / T) and the lag-one moments A_1, G_1,
  option 1 is sum_{|d|<T} (T - |d|) V_0^{1/2} hatPsi^|d| V_0^{1/2}
  (hatPsi = V_0^{-1/2} (sym A_1 (x) sym G_1) V_0^{-1/2}) and option 2 is
  T times the sum over all lags of the autocovariances of the AR(1) process
  w_{t+1} = Psi w_t + e, Psi = A_1^T A_0^{-1} (x) G_1^T G_0^{-1} (summed
  until the terms are below 1e-15), then solved densely.
Tolerances: 1e-9 relative for exact identities, 1e-8 for the inverses.
"""

import functools
import math

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref

WORLDS = ref.WORLDS
TOL = dict(rtol=1e-9, atol=1e-12)
INV_TOL = dict(rtol=1e-8, atol=1e-11)


# ------------------------------------------------------------ dense refs
def _sym(m):
  return 0.5 * (m + m.T)


def _sym_power(m, exp):
  return ref.sym_matpower(m, exp)


def _damped(a0, g0, damping, num_uses):
  root = math.sqrt(damping / num_uses)
  pi = math.sqrt((np.trace(a0) / len(a0)) / (np.trace(g0) / len(g0)))
  return (a0 + pi * root * np.eye(len(a0)), g0 + root / pi * np.eye(len(g0)))


def _moments(x):
  """x: [T, N, n] -> (mean x_t x_t^T, mean x_t x_{t+1}^T)."""
  t, n = x.shape[0], x.shape[1]
  m0 = np.einsum("tni,tnj->ij", x, x) / (t * n)
  m1 = np.einsum("tni,tnj->ij", x[:-1], x[1:]) / ((t - 1) * n)
  return m0, m1


def series1_dense(c0_a, a1, c0_g, g1, num_uses, clip=False):
  v0 = np.kron(c0_a, c0_g)
  half, inv_half = _sym_power(v0, 0.5), _sym_power(v0, -0.5)
  hat_a = _sym_power(c0_a, -0.5) @ _sym(a1) @ _sym_power(c0_a, -0.5)
  hat_g = _sym_power(c0_g, -0.5) @ _sym(g1) @ _sym_power(c0_g, -0.5)
  if clip:  # the documented safety rule: psi in [0, 1]
    hat_a, hat_g = (_clip_sym(h, 0.0, 1.0) for h in (hat_a, hat_g))
  hat_psi = np.kron(hat_a, hat_g)
  total = num_uses * np.eye(len(v0))
  for d in range(1, num_uses):
    total += 2 * (num_uses - d) * np.linalg.matrix_power(hat_psi, d)
  # Sanity of the Kronecker form of hatPsi:
  np.testing.assert_allclose(
      hat_psi if clip else inv_half @ np.kron(_sym(a1), _sym(g1)) @ inv_half,
      hat_psi, rtol=1e-10, atol=1e-12)
  return half @ total @ half


def _clip_sym(m, low, high):
  evals, evecs = np.linalg.eigh(_sym(m))
  return (evecs * np.clip(evals, low, high)) @ evecs.T


def _transition(c0, c1, max_sv=None):
  """C_1^T C_0^{-1}, or its version with clipped whitened singular values."""
  if max_sv is None:
    return c1.T @ np.linalg.inv(c0)
  whitened = _sym_power(c0, -0.5) @ c1.T @ _sym_power(c0, -0.5)
  u, s, vt = np.linalg.svd(whitened)
  return _sym_power(c0, 0.5) @ (u * np.minimum(s, max_sv)) @ vt @ _sym_power(
      c0, -0.5)


def series2_dense(c0_a, a1, c0_g, g1, num_uses, max_sv=None):
  v0 = np.kron(c0_a, c0_g)
  psi = np.kron(_transition(c0_a, a1, max_sv), _transition(c0_g, g1, max_sv))
  rho = max(abs(np.linalg.eigvals(psi)))
  assert rho < 1
  steps = int(math.ceil(math.log(1e-16) / math.log(rho))) + 1
  total = v0.copy()
  lag = v0.copy()  # E[w_{t+d} w_t^T] = Psi^d V_0
  for _ in range(steps):
    lag = psi @ lag
    total += lag + lag.T
  return num_uses * total


def _whitened_spectra(c0, c1):
  inv_half = _sym_power(c0, -0.5)
  psi = np.linalg.eigvalsh(inv_half @ _sym(c1) @ inv_half)
  sv = np.linalg.svd(inv_half @ c1.T @ inv_half, compute_uv=False)
  return psi, sv


# ------------------------------------------------------------ models
T_USES = 3
SIZES = (2, 3, 2)


def tied_forward(vs, x, record=None, folded=False):
  """Two dense layers with tied weights applied to every use x[:, t] (a
  loss term per use). Returns the predictions [N, T * out]."""
  w1, b1, w2, b2 = vs
  uses = x.shape[1]
  if folded:
    xf = tf.reshape(tf.transpose(x, [1, 0, 2]), [-1, x.shape[-1]])
    z1 = tf.matmul(xf, w1) + b1
    z2 = tf.matmul(z1, w2) + b2
    if record is not None:
      record.extend([((w1, b1), xf, z1), ((w2, b2), z1, z2)])
    z2 = tf.reshape(z2, [uses, -1, z2.shape[-1]])
    return tf.reshape(tf.transpose(z2, [1, 0, 2]), [-1, uses * z2.shape[-1]])
  xs = [x[:, t] for t in range(uses)]
  z1 = [tf.matmul(v, w1) + b1 for v in xs]
  z2 = [tf.matmul(v, w2) + b2 for v in z1]
  if record is not None:
    record.extend([((w1, b1), xs, z1), ((w2, b2), z1, z2)])
  return tf.concat(z2, axis=1)


def _run_tied(world, inits, x, approx, folded, mode="exact_GGN",
              damping=1e-2, fetch_fn=None, targets_seed=21):
  store = util.new_store()
  targets = np.random.RandomState(targets_seed).randn(
      x.shape[0], x.shape[1] * SIZES[-1])

  def build(vs):
    lc = kfac.LayerCollection()
    record = []
    pred = tied_forward(vs, tf.constant(x), record=record, folded=folded)
    for params, inputs, outputs in record:
      lc.register_fully_connected_multi(
          params, inputs, outputs, approx=approx,
          num_uses=x.shape[1] if folded else None)
    lc.register_squared_error_loss(pred, targets=tf.constant(targets))
    est, ops = util.estimator_stages(store, lc, vs, mode, damping=damping)
    if fetch_fn is not None:
      return ops + [fetch_fn(est, vs)]
    return ops + [[tf.identity(b.full_fisher_block()) for b in est.blocks]]

  return ref.run_stages(world, inits, build)[-1]


@functools.lru_cache(maxsize=None)
def _tied_case(seed):
  inits = ref.mlp_inits(SIZES, seed=seed, scale=0.8)
  x = np.random.RandomState(seed + 1).randn(4, T_USES, SIZES[0])
  return inits, x, _exact_ggn(inits, x)


def _exact_ggn(inits, x):
  jacs = ref.per_example_jacobians(tied_forward, inits, x)
  return ref.curvature(jacs, [2.0 * np.eye(j.shape[0]) for j in jacs])


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("folded", [False, True])
def test_kron_indep_equals_exact_ggn_for_tied_linear_layers(world, folded):
  inits, x, exact = _tied_case(1)
  blocks = _run_tied(world, inits, x, "kron_indep", folded)
  for block, sl in zip(blocks, util.layer_slices(SIZES)):
    np.testing.assert_allclose(block, exact[sl, sl], **TOL)


@pytest.mark.parametrize("approx", ["kron_indep", "kron_indep_both_diag",
                                    "kron_series_1", "kron_series_2"])
def test_lists_and_folded_tensors_give_identical_blocks(approx):
  inits = ref.mlp_inits(SIZES, seed=3, scale=0.8)
  rng = np.random.RandomState(4)
  x = rng.randn(5, T_USES, SIZES[0])
  vec = [rng.randn(*i.shape) for i in inits]

  def fetch(est, vs):
    pairs = [(tf.constant(v), var) for v, var in zip(vec, vs)]
    return ([[tf.identity(f.get_cov()) for f in b.factors()]
             for b in est.blocks],
            [r for r, _ in est.multiply_inverse(pairs)])

  lists = _run_tied("graph", inits, x, approx, False, mode="empirical",
                    fetch_fn=fetch)
  folded = _run_tied("graph", inits, x, approx, True, mode="empirical",
                     fetch_fn=fetch)
  for got, want in zip(tf.nest.flatten(folded), tf.nest.flatten(lists)):
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


# ------------------------------------- kron_indep against a hand-built block
def _tanh_model_data(seed, n=5, uses=T_USES, d_in=3, d_out=2, d_y=2):
  rng = np.random.RandomState(seed)
  return dict(x=rng.randn(uses, n, d_in), w=0.7 * rng.randn(d_in, d_out),
              b=0.1 * rng.randn(d_out), v=rng.randn(d_out, d_y),
              targets=rng.randn(uses, n, d_y))


def _tanh_model_grads(d):
  """a_t (with ones) and g_t = dL/dz_t for L = sum_t ||tanh(z_t) V - y_t||^2."""
  z = d["x"] @ d["w"] + d["b"]
  resid = 2.0 * (np.tanh(z) @ d["v"] - d["targets"])
  g = (resid @ d["v"].T) * (1.0 - np.tanh(z)**2)
  a = np.concatenate([d["x"], np.ones(d["x"].shape[:2] + (1,))], axis=-1)
  return a, g


@pytest.mark.parametrize("world,approx", [
    ("graph", "kron_indep"), ("function", "kron_indep"),
    ("graph", "kron_indep_in_diag"), ("graph", "kron_indep_out_diag"),
    ("function", "kron_indep_both_diag")])
def test_kron_indep_is_num_uses_times_the_average_over_uses(world, approx):
  d = _tanh_model_data(5)
  a, g = _tanh_model_grads(d)
  uses, n = a.shape[:2]
  a_hand = np.einsum("tni,tnj->ij", a, a) / (uses * n)
  g_hand = np.einsum("tni,tnj->ij", g, g) / (uses * n)
  if approx in ("kron_indep_in_diag", "kron_indep_both_diag"):
    a_hand = np.diag(np.diag(a_hand))
  if approx in ("kron_indep_out_diag", "kron_indep_both_diag"):
    g_hand = np.diag(np.diag(g_hand))
  damping = 0.05
  rng = np.random.RandomState(6)
  vec = (rng.randn(*d["w"].shape), rng.randn(*d["b"].shape))
  store = util.new_store()

  def build(vs):
    w, b = vs
    lc = kfac.LayerCollection()
    xs = [tf.constant(d["x"][t]) for t in range(uses)]
    zs = [tf.matmul(x, w) + b for x in xs]
    lc.register_fully_connected_multi((w, b), xs, zs, approx=approx)
    pred = tf.stack([tf.matmul(tf.tanh(z), tf.constant(d["v"])) for z in zs])
    lc.register_squared_error_loss(tf.reshape(pred, [-1, d["v"].shape[1]]),
                                   targets=tf.constant(
                                       d["targets"].reshape(-1, 2)))
    est, ops = util.estimator_stages(store, lc, vs, "empirical",
                                     damping=damping)
    (block,) = est.blocks
    inv = block.multiply_inverse(tuple(tf.constant(v) for v in vec))
    return ops + [(tf.identity(block.full_fisher_block()), inv)]

  block, inv = ref.run_stages(world, [d["w"], d["b"]], build)[-1]
  np.testing.assert_allclose(block, uses * np.kron(a_hand, g_hand), **TOL)
  dense = uses * ref.pi_damped_kron(a_hand, g_hand, damping / uses)
  np.testing.assert_allclose(ref.flat(inv),
                             np.linalg.solve(dense, ref.flat(vec)), **INV_TOL)


# ------------------------------------------------------------ series
def _series_data(seed=0, uses=4, n=6, d_in=2, d_out=3, d_y=3):
  """Uses with temporally correlated inputs (AR(1)) and outputs mixed into
  predictions p_t = z_t M_t + 0.5 z_{t-1} M_{t-1} (so neighbouring uses'
  gradients are correlated)."""
  rng = np.random.RandomState(seed)
  x = np.zeros((uses, n, d_in))
  x[0] = rng.randn(n, d_in)
  for t in range(1, uses):
    x[t] = 0.5 * x[t - 1] + 0.8 * rng.randn(n, d_in)
  w, b = rng.randn(d_in, d_out), 0.1 * rng.randn(d_out)
  m0 = rng.randn(d_out, d_y)
  mix = np.stack([m0 + 0.3 * rng.randn(d_out, d_y) for _ in range(uses)])
  targets = rng.randn(uses, n, d_y)
  return dict(x=x, w=w, b=b, mix=mix, targets=targets)


def _series_grads(d):
  z = d["x"] @ d["w"] + d["b"]
  y = np.einsum("tno,toy->tny", z, d["mix"])
  pred = y.copy()
  pred[1:] += 0.5 * y[:-1]
  resid = 2.0 * (pred - d["targets"])
  back = resid.copy()
  back[:-1] += 0.5 * resid[1:]
  g = np.einsum("tny,toy->tno", back, d["mix"])
  a = np.concatenate([d["x"], np.ones(d["x"].shape[:2] + (1,))], axis=-1)
  return a, g


def _run_series(world, d, approx, damping, folded=False, towers=1):
  uses = d["x"].shape[0]
  rng = np.random.RandomState(7)
  vec = (rng.randn(*d["w"].shape), rng.randn(*d["b"].shape))
  store = util.new_store()

  def build(vs):
    w, b = vs
    lc = kfac.LayerCollection()
    preds = []
    n = d["x"].shape[1]
    for k, rows in enumerate(np.array_split(np.arange(n), towers)):
      xs = [tf.constant(d["x"][t][rows]) for t in range(uses)]
      zs = [tf.matmul(x, w) + b for x in xs]
      if folded:
        x_fold = tf.concat(xs, axis=0)
        z_fold = tf.matmul(x_fold, w) + b
        zs = tf.split(z_fold, uses, axis=0)
        lc.register_fully_connected_multi((w, b), x_fold, z_fold,
                                          num_uses=uses, approx=approx,
                                          reuse=k > 0)
      else:
        lc.register_fully_connected_multi((w, b), xs, zs, approx=approx,
                                          reuse=k > 0)
      ys = [tf.matmul(z, tf.constant(d["mix"][t])) for t, z in enumerate(zs)]
      preds.extend([(ys[t] + (0.5 * ys[t - 1] if t else 0.0), t, rows)
                    for t in range(uses)])
    pred = tf.concat([p for p, _, _ in preds], axis=0)
    targets = np.concatenate([d["targets"][t][rows] for _, t, rows in preds])
    lc.register_squared_error_loss(pred, targets=tf.constant(targets))
    est, ops = util.estimator_stages(store, lc, vs, "empirical",
                                     damping=damping)
    (block,) = est.blocks
    stats = [[tf.identity(f.get_cov()), tf.identity(f.get_cov_dt1())]
             for f in block.factors()] if approx.startswith("kron_series") else []
    inv = block.multiply_inverse(tuple(tf.constant(v) for v in vec))
    return ops + [(stats, inv)]

  stats, inv = ref.run_stages(world, [d["w"], d["b"]], build)[-1]
  return stats, ref.flat(inv), ref.flat(vec)


def _series_reference(d, option, damping, clip=False):
  a, g = _series_grads(d)
  uses = a.shape[0]
  a0, a1 = _moments(a)
  g0, g1 = _moments(g)
  c0_a, c0_g = _damped(a0, g0, damping, uses)
  if option == 1:
    dense = series1_dense(c0_a, a1, c0_g, g1, uses, clip=clip)
  else:
    dense = series2_dense(c0_a, a1, c0_g, g1, uses,
                          max_sv=0.999 if clip else None)
  return (a0, a1, g0, g1), (c0_a, c0_g), dense


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
@pytest.mark.parametrize("option", [1, 2])
def test_series_inverse_equals_the_papers_model(world, option):
  d = _series_data()
  damping = 2.0
  moments, (c0_a, c0_g), dense = _series_reference(d, option, damping)
  a0, a1, g0, g1 = moments
  # The data are in the regime where no safety clipping applies.
  for c0, c1 in ((c0_a, a1), (c0_g, g1)):
    psi, sv = _whitened_spectra(c0, c1)
    assert 0.0 < psi.min() and psi.max() < 1.0 and sv.max() < 0.99
  stats, got, vec = _run_series(world, d, "kron_series_%d" % option, damping)
  (k_a0, k_a1), (k_g0, k_g1) = stats
  for got_m, want_m in ((k_a0, a0), (k_a1, a1), (k_g0, g0), (k_g1, g1)):
    np.testing.assert_allclose(got_m, want_m, **TOL)
  np.testing.assert_allclose(got, np.linalg.solve(dense, vec), **INV_TOL)
  # The temporal model really differs from kron_indep here.
  indep = np.linalg.solve(d["x"].shape[0] * np.kron(c0_a, c0_g), vec)
  assert np.linalg.norm(got - indep) > 0.05 * np.linalg.norm(indep)


@pytest.mark.parametrize("option", [1, 2])
def test_series_clipping_follows_the_documented_rule(option):
  """Moments that are not those of a stationary process: option 1 clips
  psi to [0, 1], option 2 the whitened transition's singular values to
  0.999; the references apply the same rule to the definitions."""
  d = _series_data(seed=1)
  damping = 0.5
  moments, (c0_a, c0_g), dense = _series_reference(d, option, damping,
                                                   clip=True)
  _, a1, _, g1 = moments
  spectra = [_whitened_spectra(c0, c1) for c0, c1 in ((c0_a, a1),
                                                      (c0_g, g1))]
  if option == 1:
    assert min(p.min() for p, _ in spectra) < 0.0  # clipping is active
  else:
    assert max(s.max() for _, s in spectra) > 0.999
  _, got, vec = _run_series("graph", d, "kron_series_%d" % option, damping)
  np.testing.assert_allclose(got, np.linalg.solve(dense, vec), **INV_TOL)


@pytest.mark.parametrize("approx", ["kron_indep", "kron_series_2"])
def test_towers_and_folded_registration_equal_one_list_registration(approx):
  d = _series_data()
  _, want, _ = _run_series("graph", d, approx, 2.0)
  for folded, towers in ((False, 2), (True, 1), (True, 2)):
    _, got, _ = _run_series("graph", d, approx, 2.0, folded=folded,
                            towers=towers)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def _run_constant_block(world, approx, xs, gs, damping, vec):
  """Registers W (no bias) on constant per-use inputs and feeds constant
  per-use output gradients to the block directly."""
  store = util.new_store()
  w0 = np.zeros((xs[0].shape[1], gs[0].shape[1]))

  def build(vs):
    (w,) = vs
    lc = kfac.LayerCollection()
    ins = [tf.constant(x) for x in xs]
    block = lc.register_fully_connected_multi(
        w, ins, [tf.matmul(x, w) for x in ins], approx=approx)
    block.instantiate_factors([tuple(tf.constant(g) for g in gs)], damping)
    for f in lc.get_factors():
      f.attach_state_store(store)
    block.register_inverse()
    cov_op = tf.group(*[f.make_covariance_update_op(0.0)
                        for f in lc.get_factors()])
    inv_op = tf.group(*[op for f in lc.get_factors()
                        for op in f.make_inverse_update_ops()])
    return [cov_op, inv_op, block.multiply_inverse(tf.constant(vec))]

  return ref.run_stages(world, [w0], build)[-1]


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
def test_series_without_cross_moments_is_kron_indep(world):
  """Uses whose lag-one moments vanish exactly (x_1 = [u; u],
  x_2 = [v; -v], x_3 = [q; q], the same for gradients): both series options
  reduce to the kron_indep inverse with the same damping."""
  rng = np.random.RandomState(8)

  def pattern(shape, sign):
    half = rng.randn(*shape)
    return np.concatenate([half, sign * half])

  xs = [pattern((3, 3), s) for s in (1, -1, 1)]
  gs = [pattern((3, 2), s) for s in (1, -1, 1)]
  for x0, x1 in zip(xs[:-1], xs[1:]):
    assert np.abs(x0.T @ x1).max() < 1e-12
  vec = rng.randn(3, 2)
  indep = _run_constant_block(world, "kron_indep", xs, gs, 0.1, vec)
  # And kron_indep is the dense pi-damped solve.
  a0 = sum(x.T @ x for x in xs) / 18.0
  g0 = sum(g.T @ g for g in gs) / 18.0
  dense = 3 * ref.pi_damped_kron(a0, g0, 0.1 / 3)
  np.testing.assert_allclose(indep.reshape(-1),
                             np.linalg.solve(dense, vec.reshape(-1)),
                             **INV_TOL)
  for option in (1, 2):
    got = _run_constant_block(world, "kron_series_%d" % option, xs, gs, 0.1,
                              vec)
    np.testing.assert_allclose(got, indep, rtol=1e-10, atol=1e-12)


def test_series_1_ignores_negative_temporal_correlation():
  """x_2 = -x_1: hatPsi_A is negative definite, clipped to 0, so option 1
  is the kron_indep inverse."""
  rng = np.random.RandomState(9)
  x = rng.randn(6, 3)
  xs = [x, -x]
  gs = [rng.randn(6, 2), rng.randn(6, 2)]
  vec = rng.randn(3, 2)
  indep = _run_constant_block("graph", "kron_indep", xs, gs, 0.1, vec)
  got = _run_constant_block("graph", "kron_series_1", xs, gs, 0.1, vec)
  np.testing.assert_allclose(got, indep, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------ registration
def _graph_layer():
  w = tf.Variable(np.ones((3, 2)), name="rnn_w")
  b = tf.Variable(np.zeros(2), name="rnn_b")
  xs = [tf.constant(np.ones((4, 3))) * (t + 1.0) for t in range(3)]
  zs = [tf.matmul(x, w) + b for x in xs]
  return w, b, xs, zs


def test_defaults_and_setter():
  with tf.Graph().as_default():
    w, b, xs, zs = _graph_layer()
    lc = kfac.LayerCollection()
    assert lc.default_fully_connected_multi_approximation == "kron_indep"
    block = lc.register_fully_connected_multi((w, b), xs, zs)
    assert isinstance(block, kfac.fisher_blocks.FullyConnectedMultiIndepFB)
    assert block.num_uses == 3 and block.approximation == "kron_indep"
    lc2 = kfac.LayerCollection()
    lc2.set_default_fully_connected_multi_approximation("kron_series_1")
    assert lc2.default_fully_connected_multi_approximation == "kron_series_1"
    block = lc2.register_fully_connected_multi((w, b), xs, zs)
    assert isinstance(block, kfac.fisher_blocks.FullyConnectedSeriesFB)
    assert block.option == 1
    with pytest.raises(ValueError, match="kron_series_3"):
      lc2.set_default_fully_connected_multi_approximation("kron_series_3")


def test_reuse_adds_towers_with_the_same_uses():
  with tf.Graph().as_default():
    w, b, xs, zs = _graph_layer()
    lc = kfac.LayerCollection()
    block = lc.register_fully_connected_multi((w, b), xs, zs)
    again = lc.register_fully_connected_multi((w, b), xs, zs, reuse=True)
    assert again is block and block.num_registered_towers == 2
    with pytest.raises(ValueError, match="rnn_w.*3 uses.*2"):
      lc.register_fully_connected_multi((w, b), xs[:2], zs[:2], reuse=True)
    with pytest.raises(ValueError, match="rnn_w.*kron_indep.*kron_indep_in"):
      lc.register_fully_connected_multi((w, b), xs, zs, reuse=True,
                                        approx="kron_indep_in_diag")
    with pytest.raises(ValueError, match="rnn_w.*already in LayerCollection"):
      lc.register_fully_connected_multi((w, b), xs, zs, reuse=False)


def test_use_count_errors_name_the_variable():
  with tf.Graph().as_default():
    w, b, xs, zs = _graph_layer()
    lc = kfac.LayerCollection()
    with pytest.raises(ValueError, match="rnn_w.*3 input uses but 2 output"):
      lc.register_fully_connected_multi((w, b), xs, zs[:2])
    with pytest.raises(ValueError, match="rnn_w.*num_uses=2 but 3 uses"):
      lc.register_fully_connected_multi((w, b), xs, zs, num_uses=2)
    x_fold, z_fold = tf.concat(xs, 0), tf.concat(zs, 0)
    with pytest.raises(ValueError, match="rnn_w.*12 rows.*num_uses=5"):
      lc.register_fully_connected_multi((w, b), x_fold, z_fold, num_uses=5)
    with pytest.raises(ValueError, match="rnn_w.*need num_uses"):
      lc.register_fully_connected_multi((w, b), x_fold, z_fold)
    with pytest.raises(ValueError, match="rnn_w.*both be lists"):
      lc.register_fully_connected_multi((w, b), xs, z_fold, num_uses=3)
    with pytest.raises(ValueError, match="rnn_w.*positive Python int"):
      lc.register_fully_connected_multi((w, b), x_fold, z_fold, num_uses=0)
    with pytest.raises(ValueError, match="Unknown approximation 'kron'.*rnn_w"):
      lc.register_fully_connected_multi((w, b), xs, zs, approx="kron")
    with pytest.raises(ValueError, match="rnn_w.*shape"):
      lc.register_fully_connected_multi((w, b), [tf.ones((4, 5))] * 3, zs)
    with pytest.raises(ValueError, match="table W alone.*rnn_w"):
      lc.register_fully_connected_multi((w, b), xs, zs, dense_inputs=False)
    assert not lc.get_blocks()


def test_a_use_that_does_not_depend_on_the_params_is_rejected():
  with tf.Graph().as_default():
    w, b, xs, zs = _graph_layer()
    lc = kfac.LayerCollection()
    stray = tf.matmul(xs[1], tf.ones((3, 2), tf.float64)) + b
    with pytest.raises(ValueError, match="use 1.*does not depend on.*rnn_w"):
      lc.register_fully_connected_multi((w, b), xs, [zs[0], stray, zs[2]])

  @tf.function
  def in_a_function():
    w2 = tf.constant(np.ones((3, 2)))
    lc2 = kfac.LayerCollection()
    lc2.register_fully_connected_multi(v, [x_in], [tf.matmul(x_in, w2)])

  v = tf.Variable(np.ones((3, 2)), name="fn_w")
  x_in = tf.constant(np.ones((2, 3)))
  with pytest.raises(ValueError, match="use 0.*does not depend on.*fn_w"):
    in_a_function()


def test_series_blocks_are_inverse_only():
  with tf.Graph().as_default():
    w, b, xs, zs = _graph_layer()
    lc = kfac.LayerCollection()
    block = lc.register_fully_connected_multi((w, b), xs, zs,
                                              approx="kron_series_2")
    # Every registered use leads to the loss (the estimator checks it).
    lc.register_squared_error_loss(tf.add_n(zs), targets=tf.zeros(
        (4, 2), tf.float64))
    est = kfac.estimator.FisherEstimator(
        variables=[w, b], cov_ema_decay=0.9, damping=0.1,
        layer_collection=lc, exps=(-1,), estimation_mode="empirical")
    vec = (tf.ones((3, 2), tf.float64), tf.ones(2, tf.float64))
    # (P, K, mu) per factor are the estimator's inverse variables (the
    # estimator sets the blocks up on first use, as kfac 0.2.x's did).
    assert sorted(v.shape.rank for vs in est.get_inv_vars() for v in vs) == [
        1, 1, 2, 2, 2, 2]
    assert block.multiply_inverse(vec)[0].shape == (3, 2)
    for call in (lambda: block.multiply(vec),
                 lambda: block.multiply_matpower(vec, 0.5),
                 lambda: block.multiply_cholesky(vec),
                 lambda: block.register_cholesky(),
                 lambda: block.register_matpower(2),
                 lambda: block.full_fisher_block()):
      with pytest.raises(NotImplementedError, match="kron_series_2"):
        call()
    powers = kfac.estimator.FisherEstimator(
        variables=[w, b], cov_ema_decay=0.9, damping=0.1,
        layer_collection=lc, exps=(-1, 2), estimation_mode="empirical")
    with pytest.raises(NotImplementedError, match="kron_series_2"):
      powers.make_vars_and_create_op_thunks()  # sets the blocks up


def test_dependence_check_finds_the_variable_without_building_gradients(
    monkeypatch):
  """The check walks the graph: no tf.gradients for connected uses, with a
  resource variable in a graph and in a tf.function, and a ref variable."""
  from kfac.python.ops.layers.multi_use import registration as multi_use_registration  # pylint: disable=g-import-not-at-top

  def no_gradients(*args, **kwargs):
    raise AssertionError("tf.gradients called: %s %s" % (args, kwargs))

  monkeypatch.setattr(multi_use_registration.tf, "gradients", no_gradients)

  def register(w, b, steps=6):
    lc = kfac.LayerCollection()
    h = tf.zeros((2, 3), tf.float64)
    ins, outs = [], []
    for _ in range(steps):  # a recurrence: h_t = tanh(h_{t-1} W + b)
      ins.append(h)
      outs.append(tf.matmul(h, w) + b)
      h = tf.tanh(outs[-1])
    lc.register_fully_connected_multi((w, b), ins, outs)
    return lc

  with tf.Graph().as_default():
    register(tf.Variable(np.ones((3, 3))), tf.Variable(np.zeros(3)))
    register(tf.compat.v1.Variable(np.ones((3, 3)), use_resource=False),
             tf.compat.v1.Variable(np.zeros(3), use_resource=False))
  w, b = tf.Variable(np.ones((3, 3))), tf.Variable(np.zeros(3))
  tf.function(lambda: register(w, b) and None)()


def test_folded_uses_with_an_unknown_batch_dimension():
  """kfac 0.2.x accepted folded uses of unknown batch size: they train, and
  a feed whose rows do not divide into the uses is an error naming the
  layer, not a silently wrong statistic."""
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float64, [None, 3])
    w = tf.Variable(np.random.RandomState(0).randn(3, 2))
    out = tf.matmul(x, w)
    lc = kfac.LayerCollection()
    lc.register_fully_connected_multi(w, x, out, num_uses=3)
    lc.register_squared_error_loss(out)
    loss = tf.reduce_mean(tf.square(out))
    opt = kfac.PeriodicInvCovUpdateKfacOpt(
        learning_rate=0.1, damping=0.1, layer_collection=lc, invert_every=1)
    train = opt.minimize(loss, var_list=[w])
    data = np.random.RandomState(1).randn(6, 3)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      before = sess.run(loss, {x: data})
      for _ in range(3):
        sess.run(train, {x: data})
      assert sess.run(loss, {x: data}) < before
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match="Layer .*not a multiple of num_uses=3"):
        sess.run(train, {x: data[:5]})
