"""CurvatureOptions (kfac 0.2.x's set_global_constants of fisher_blocks and
fisher_factors, as explicit configuration) against float64 references.

References are written out with numpy from kfac 0.2.x's definitions, not
from kfac code: a Kronecker block shared over c positions is
c (A + pi s I) (x) (G + s / pi I) with s = sqrt(damping / c^p) and
pi = sqrt((tr A / dim A) / (tr G / dim G)) (pi = 1 with pi_type "off"); the
exact diagonal of a conv layer over L locations gets damping * L^(1-p);
eigenvalue clipping raises the eigenvalues of a factor's statistic to the
threshold before the damping is added; sub_sample_inputs=True keeps
ceil(0.2 N) of N examples, drawn without replacement, and the statistic is
the mean over the kept examples' patches. Every check runs in a TF1
Session graph and in a tf.function. Tolerances: 1e-9 relative / 1e-11
absolute (float64 products of a few 4x4 matrices), except the Monte Carlo
checks of sub-sampling (6 standard errors estimated from the draws).
"""

import math

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref
from kfac.python.ops.layers.base import curvature_options
from kfac.python.ops.compat_utils import legacy_constants

WORLDS = ref.WORLDS
TOL = dict(rtol=1e-9, atol=1e-11)
Options = curvature_options.CurvatureOptions


@pytest.fixture(autouse=True)
def _old_defaults():
  """set_global_constants changes process-wide defaults: undo them."""
  legacy_constants.restore_defaults()
  yield
  legacy_constants.restore_defaults()


def _damped_kron(a, g, damping, pi_type="tracenorm", coeff=1.0, power=1.0,
                 clip=None):
  """kfac 0.2.x's damped Kronecker block, dense (module docstring)."""
  pi = 1.0
  if pi_type == "tracenorm":
    pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
  if clip is not None:  # eigenvalues raised to `clip` (pi from the raw ones)
    a, g = (_clip(m, clip) for m in (a, g))
  root = np.sqrt(damping / coeff**power)
  return coeff * np.kron(a + pi * root * np.eye(len(a)),
                         g + root / pi * np.eye(len(g)))


def _clip(mat, threshold):
  evals, evecs = np.linalg.eigh(mat)
  return (evecs * np.maximum(evals, threshold)) @ evecs.T


def _block_products(world, inits, register, exps, damping, options=None,
                    batch=6, seed=0, make_lc=None):
  """[(A, G), ...] per block, the random vectors and their products with
  each power in `exps` (1 included), from an estimator in exact mode."""
  x, labels = util.data(batch, seed=seed)
  store = util.new_store()

  def build(vs):
    lc = (make_lc() if make_lc else
          kfac.LayerCollection(curvature_options=options))
    logits = register(vs, tf.constant(x), lc)
    util.categorical_loss(lc, logits, labels)
    est, ops = util.estimator_stages(store, lc, vs, "exact", damping=damping,
                                     exps=tuple(e for e in exps if e != 1))
    rng = np.random.RandomState(seed + 1)
    vecs = [tf.constant(rng.randn(*v.shape)) for v in vs]
    pairs = list(zip(vecs, vs))
    fetch = {"factors": [[tf.identity(f.get_cov()) for f in b.factors()]
                         for b in est.blocks], "vecs": vecs}
    for e in exps:
      fetch["pow%s" % e] = [r for r, _ in est.multiply_matpower(e, pairs)]
    return ops + [fetch]

  return ref.run_stages(world, inits, build)[-1]


def _check_mlp_products(out, dense_of, exps):
  v = out["vecs"]
  for layer, (a, g) in enumerate(out["factors"]):
    dense = dense_of(a, g)
    vec = ref.flat(v[2 * layer:2 * layer + 2])
    for e in exps:
      got = ref.flat(out["pow%s" % e][2 * layer:2 * layer + 2])
      np.testing.assert_allclose(got, ref.sym_matpower(dense, e) @ vec, **TOL,
                                 err_msg="layer %d, power %s" % (layer, e))


# ------------------------------------------------------------- pi_type
@pytest.mark.parametrize("world", WORLDS)
def test_pi_type_off_splits_the_damping_evenly(world):
  inits = ref.mlp_inits(util.SIZES, seed=1)
  exps = (1, -1, -0.5)
  out = _block_products(world, inits, util.register_mlp, exps, 0.03,
                        options=Options(pi_type="off"))
  _check_mlp_products(out, lambda a, g: _damped_kron(a, g, 0.03, "off"), exps)
  # The factors' traces differ: "tracenorm" would give other products.
  a, g = out["factors"][0]
  assert abs(np.trace(a) / len(a) - np.trace(g) / len(g)) > 0.1


def test_set_global_constants_sets_the_default_of_new_collections():
  kfac.fisher_blocks.set_global_constants(pi_type="off",
                                          normalize_damping_power=0.5)
  assert kfac.LayerCollection().curvature_options == Options(
      pi_type="off", normalize_damping_power=0.5)
  explicit = Options(eigenvalue_clipping_threshold=0.1)
  assert kfac.LayerCollection(
      curvature_options=explicit).curvature_options is explicit
  inits = ref.mlp_inits(util.SIZES, seed=1)
  out = _block_products("graph", inits, util.register_mlp, (1, -1), 0.03,
                        make_lc=kfac.LayerCollection)
  _check_mlp_products(out, lambda a, g: _damped_kron(a, g, 0.03, "off"),
                      (1, -1))
  # A collection keeps the options it was made with.
  made_before = kfac.LayerCollection()
  kfac.fisher_blocks.set_global_constants(pi_type="tracenorm")
  assert made_before.curvature_options.pi_type == "off"
  assert kfac.LayerCollection().curvature_options.pi_type == "tracenorm"
  legacy_constants.restore_defaults()
  assert kfac.LayerCollection().curvature_options == Options()


def test_options_are_validated():
  for kwargs, match in ((dict(pi_type="trace"), "pi_type"),
                        (dict(normalize_damping_power=-1), "normalize_damp"),
                        (dict(eigenvalue_clipping_threshold=float("nan")),
                         "eigenvalue_clipping_threshold"),
                        (dict(inputs_to_extract_patches_factor=0),
                         "inputs_to_extract_patches_factor"),
                        (dict(sub_sample_inputs=1), "sub_sample_inputs")):
    with pytest.raises(ValueError, match=match):
      Options(**kwargs)
  with pytest.raises(ValueError, match="pi_type"):
    kfac.fisher_blocks.set_global_constants(pi_type="trace")
  with pytest.raises(TypeError, match="CurvatureOptions"):
    kfac.LayerCollection(curvature_options={"pi_type": "off"})


# ------------------------------------------------------- damping power
def _register_multi_use(vs, x, lc):
  """The first layer applied to x, 2x and -x (3 uses of (W0, b0)), summed
  and fed to the second layer (one use)."""
  w0, b0, w1, b1 = vs
  xs = [x, 2.0 * x, -x]
  zs = [tf.matmul(u, w0) + b0 for u in xs]
  lc.register_fully_connected_multi((w0, b0), xs, zs)
  h = tf.tanh(tf.add_n(zs))
  logits = tf.matmul(h, w1) + b1
  lc.register_fully_connected((w1, b1), h, logits)
  return logits


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("power", [0.0, 0.5])
def test_normalize_damping_power_of_a_multi_use_block(world, power):
  inits = ref.mlp_inits(util.SIZES, seed=2)
  exps = (1, -1)
  out = _block_products(world, inits, _register_multi_use, exps, 0.05,
                        options=Options(normalize_damping_power=power))
  coeffs = (3.0, 1.0)  # uses of each layer
  v = out["vecs"]
  for layer, (a, g) in enumerate(out["factors"]):
    dense = _damped_kron(a, g, 0.05, coeff=coeffs[layer], power=power)
    vec = ref.flat(v[2 * layer:2 * layer + 2])
    for e in exps:
      got = ref.flat(out["pow%s" % e][2 * layer:2 * layer + 2])
      np.testing.assert_allclose(got, ref.sym_matpower(dense, e) @ vec, **TOL)


def _conv_stages(world, approx, options, damping):
  """A conv layer (filter [2, 2, 1, 2], VALID: L = 9 locations) on x
  [3, 4, 4, 1]; returns its undamped block, a vector and the product of
  the damped block with it."""
  rng = np.random.RandomState(3)
  x = rng.randn(3, 4, 4, 1)
  filt = rng.randn(2, 2, 1, 2) * 0.5
  store = util.new_store()

  def build(vs):
    (w,) = vs
    lc = kfac.LayerCollection(curvature_options=options)
    out = tf.nn.conv2d(tf.constant(x), w, [1, 1, 1, 1], "VALID")
    block = lc.register_conv2d(w, [1, 1, 1, 1], "VALID", tf.constant(x), out,
                               approx=approx)
    lc.register_squared_error_loss(tf.reshape(out, [3, -1]))
    _, ops = util.estimator_stages(store, lc, vs, "exact", damping=damping)
    vec = tf.constant(rng.randn(2, 2, 1, 2))
    factors = [tf.identity(f.get_cov()) for f in block.factors()]
    return ops + [[tf.identity(block.full_fisher_block()), vec,
                   block.multiply(vec), factors]]

  return ref.run_stages(world, [filt], build)[-1]


@pytest.mark.parametrize("world", WORLDS)
def test_normalize_damping_power_of_conv_blocks(world):
  power, damping, locations = 0.5, 0.07, 9.0
  options = Options(normalize_damping_power=power)
  # Exact diagonal: damping * L^(1 - p) on the diagonal (kfac 0.2.x).
  block, vec, prod, _ = _conv_stages(world, "diagonal", options, damping)
  np.testing.assert_allclose(
      prod.ravel(),
      (np.diag(block) + damping * locations**(1 - power)) * vec.ravel(), **TOL)
  # KFC: L (A + pi s I) (x) (G + s / pi I), s = sqrt(damping / L^p).
  _, vec, prod, (a, g) = _conv_stages(world, "kron", options, damping)
  dense = _damped_kron(a, g, damping, coeff=locations, power=power)
  np.testing.assert_allclose(prod.ravel(), dense @ vec.ravel(), **TOL)


# ----------------------------------------------------- eigenvalue clipping
@pytest.mark.parametrize("world", WORLDS)
def test_eigenvalue_clipping_of_eigendecomposition_powers(world):
  """A batch of 2 makes the first layer's A (4x4) rank 2: its zero
  eigenvalues are raised to the threshold in the inverse and the inverse
  square root (both from the eigendecomposition, as another power than -1
  is registered); the product with the block itself is not clipped."""
  inits = ref.mlp_inits(util.SIZES, seed=4)
  exps = (1, -1, -0.5)
  clip, damping = 0.05, 0.01
  out = _block_products(world, inits, util.register_mlp, exps, damping,
                        options=Options(eigenvalue_clipping_threshold=clip),
                        batch=2, seed=5)
  a, _ = out["factors"][0]
  assert np.sum(np.linalg.eigvalsh(a) < clip) >= 2
  _check_mlp_products(out, lambda a, g: _damped_kron(a, g, damping,
                                                     clip=clip), (-1, -0.5))
  _check_mlp_products(out, lambda a, g: _damped_kron(a, g, damping), (1,))


@pytest.mark.parametrize("world", WORLDS)
def test_inverses_alone_are_clipped_from_the_decomposition_threshold(world):
  """kfac 0.2.x: with inverses only, they use Cholesky (unclipped) unless a
  factor has at least eigenvalue_decomposition_threshold of them."""
  inits = ref.mlp_inits(util.SIZES, seed=4)
  clip, damping = 0.05, 0.01
  for threshold, clipped in ((4, False), (1, True)):
    out = _block_products(
        world, inits, util.register_mlp, (-1,), damping, batch=2, seed=5,
        options=Options(eigenvalue_clipping_threshold=clip,
                        eigenvalue_decomposition_threshold=threshold))
    _check_mlp_products(out, lambda a, g, c=clipped: _damped_kron(  # pylint: disable=g-long-lambda
        a, g, damping, clip=clip if c else None), (-1,))


# ------------------------------------------------------- sub-sampling
def _patches(x):
  """[N, 9, 4] patches of x [N, 4, 4, 1] for a 2x2 VALID filter."""
  rows = []
  for n in range(x.shape[0]):
    rows.append([x[n, i:i + 2, j:j + 2, 0].ravel()
                 for i in range(3) for j in range(3)])
  return np.array(rows)


def _mean_outer(rows):
  return rows.T @ rows / len(rows)


def _sampled_input_statistic(world, x, options, dynamic=False, draws=1,
                             sub_sample_inputs=None):
  """[(statistic, example indices, row indices)] of the input factor of a
  conv layer registered with `options` (x of a static or, with `dynamic`,
  run-time batch size), over `draws` statistics updates."""
  filt = np.ones((2, 2, 1, 2))
  store = util.new_store()

  def build(vs):
    (w,) = vs
    lc = kfac.LayerCollection(curvature_options=options)
    inputs = tf.constant(x)
    if dynamic:  # the batch dimension is unknown while building
      inputs = tf.compat.v1.placeholder_with_default(
          inputs, [None] + list(x.shape[1:]))
    out = tf.nn.conv2d(inputs, w, [1, 1, 1, 1], "VALID")
    block = lc.register_conv2d(w, [1, 1, 1, 1], "VALID", inputs, out,
                               sub_sample_inputs=sub_sample_inputs)
    lc.register_squared_error_loss(tf.reshape(out, [-1, 18]))
    util.estimator_stages(store, lc, vs, "exact")
    factor = block.factors()[0]
    fetch = []
    for _ in range(draws):
      cov, ex, rows = factor.compute_sampled_statistic()
      none = tf.constant([-1], tf.int64)
      fetch.append([cov, none if ex is None else ex,
                    none if rows is None else rows])
    return [fetch]

  return ref.run_stages(world, [filt], build)[-1]


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
@pytest.mark.parametrize("dynamic", [False, True])
def test_sub_sample_inputs_keeps_a_fifth_of_the_examples(world, dynamic):
  rng = np.random.RandomState(6)
  x = rng.randn(7, 4, 4, 1)
  patches = _patches(x)
  options = Options(sub_sample_inputs=True)
  [(cov, ex, _)] = _sampled_input_statistic(world, x, options, dynamic)
  assert len(ex) == math.ceil(0.2 * 7) == 2 and len(set(ex)) == 2
  np.testing.assert_allclose(cov, _mean_outer(patches[ex].reshape(-1, 4)),
                             **TOL)
  # The fraction is inputs_to_extract_patches_factor; an explicit
  # per-layer value wins over the collection's default.
  options = Options(sub_sample_inputs=True,
                    inputs_to_extract_patches_factor=0.5)
  [(cov, ex, _)] = _sampled_input_statistic(world, x, options, dynamic)
  assert len(ex) == 4 and len(set(ex)) == 4
  np.testing.assert_allclose(cov, _mean_outer(patches[ex].reshape(-1, 4)),
                             **TOL)
  [(cov, ex, _)] = _sampled_input_statistic(world, x, options, dynamic,
                                            sub_sample_inputs=3)
  assert len(ex) == 3


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_sub_sampled_inputs_statistic_is_unbiased():
  """The mean over draws of the sub-sampled statistic converges to the
  full-batch one: within 6 standard errors of the draws, and the draws
  really differ from it."""
  x = np.random.RandomState(8).randn(10, 4, 4, 1)
  full = _mean_outer(_patches(x).reshape(-1, 4))
  draws = 300
  results = _sampled_input_statistic("graph", x,
                                     Options(sub_sample_inputs=True),
                                     draws=draws)
  stats = np.stack([cov for cov, _, _ in results])
  stderr = stats.std(0) / np.sqrt(draws)
  assert np.all(np.abs(stats.mean(0) - full) <= 6 * stderr + 1e-12)
  assert np.max(np.abs(stats[0] - full)) > 1e-2
  # Without replacement: each draw keeps 2 distinct examples; uniform: each
  # example is kept in about 2/10 of the draws (binomial, 6 sigma).
  assert all(len(set(ex)) == 2 for _, ex, _ in results)
  counts = np.bincount(np.concatenate([ex for _, ex, _ in results]),
                       minlength=10)
  sigma = np.sqrt(draws * 0.2 * 0.8)
  assert np.all(np.abs(counts - draws * 0.2) <= 6 * sigma)
