"""Blocks against float64 brute-force Fisher / GGN matrices, in both worlds.

References: exact Fisher of the mean loss, (1/N) sum_n J_n^T F_n J_n, from
per-example Jacobians (reference.py). Tolerances: 1e-10 relative for exact
identities in float64.
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref

WORLDS = ref.WORLDS
TOL = dict(rtol=1e-9, atol=1e-12)


def _exact_fisher(inits, x):
  jacs = ref.per_example_jacobians(ref.mlp_forward, inits, x)
  logits = ref.outputs(ref.mlp_forward, inits, x)
  return ref.curvature(jacs, [ref.categorical_fisher(z) for z in logits])


@pytest.mark.parametrize("world", WORLDS)
def test_kron_equals_exact_fisher_block_for_one_example(world):
  inits = ref.mlp_inits(util.SIZES, seed=1)
  x, labels = util.data(1, seed=2)

  store = util.new_store()

  def build(vs):
    lc = kfac.LayerCollection()
    util.categorical_loss(lc, util.register_mlp(vs, tf.constant(x), lc), labels)
    est, ops = util.estimator_stages(store, lc, vs, "exact")
    return ops + [[tf.identity(b.full_fisher_block()) for b in est.blocks]]

  blocks = ref.run_stages(world, inits, build)[-1]
  exact = _exact_fisher(inits, x)
  for block, sl in zip(blocks, util.layer_slices()):
    np.testing.assert_allclose(block, exact[sl, sl], **TOL)


@pytest.mark.parametrize("world", WORLDS)
def test_diagonal_equals_exact_diagonal_over_a_batch(world):
  inits = ref.mlp_inits(util.SIZES, seed=3)
  x, labels = util.data(7, seed=4)

  store = util.new_store()

  def build(vs):
    lc = kfac.LayerCollection()
    logits = util.register_mlp(vs, tf.constant(x), lc, approx="diagonal")
    util.categorical_loss(lc, logits, labels)
    est, ops = util.estimator_stages(store, lc, vs, "exact")
    return ops + [[tf.identity(b.full_fisher_block()) for b in est.blocks]]

  blocks = ref.run_stages(world, inits, build)[-1]
  exact = _exact_fisher(inits, x)
  for block, sl in zip(blocks, util.layer_slices()):
    np.testing.assert_allclose(np.diag(block), np.diag(exact[sl, sl]), **TOL)
    assert np.count_nonzero(block - np.diag(np.diag(block))) == 0


def _random_vectors(vs, seed):
  rng = np.random.RandomState(seed)
  return [tf.constant(rng.randn(*v.shape)) for v in vs]


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
@pytest.mark.parametrize("approx", ["kron", "kron_in_diag", "kron_out_diag",
                                    "kron_both_diag"])
def test_kron_products_equal_dense_pi_damped_products(world, approx):
  inits = ref.mlp_inits(util.SIZES, seed=5)
  x, labels = util.data(6, seed=6)
  damping = 0.03
  exps = (-1, -0.5, 2)

  store = util.new_store()

  def build(vs):
    lc = kfac.LayerCollection()
    logits = util.register_mlp(vs, tf.constant(x), lc, approx=approx)
    util.categorical_loss(lc, logits, labels)
    est, ops = util.estimator_stages(store, lc, vs, "exact", damping=damping,
                                     exps=exps)
    vecs = _random_vectors(vs, 7)
    pairs = list(zip(vecs, vs))
    fetch = {
        "factors": [[tf.identity(f.get_cov()) for f in b.factors()]
                    for b in est.blocks],
        "vecs": vecs,
        "mult": [r for r, _ in est.multiply(pairs)],
    }
    for e in exps:
      fetch["pow%s" % e] = [r for r, _ in est.multiply_matpower(e, pairs)]
    return ops + [fetch]

  out = ref.run_stages(world, inits, build)[-1]
  v = out["vecs"]
  for layer, (a, g) in enumerate(out["factors"]):
    if approx in ("kron_in_diag", "kron_both_diag"):
      assert np.count_nonzero(a - np.diag(np.diag(a))) == 0
    if approx in ("kron_out_diag", "kron_both_diag"):
      assert np.count_nonzero(g - np.diag(np.diag(g))) == 0
    dense = ref.pi_damped_kron(a, g, damping)
    vec = ref.flat(v[2 * layer:2 * layer + 2])
    for e, key in ((1, "mult"), (-1, "pow-1"), (-0.5, "pow-0.5"), (2, "pow2")):
      got = ref.flat(out[key][2 * layer:2 * layer + 2])
      np.testing.assert_allclose(got, ref.sym_matpower(dense, e) @ vec,
                                 rtol=1e-8, atol=1e-11)


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
@pytest.mark.parametrize("approx", ["kron", "diagonal"])
def test_cholesky_products_reproduce_the_damped_block(world, approx):
  inits = ref.mlp_inits(util.SIZES, seed=8)
  x, labels = util.data(5, seed=9)
  n_params = [int(np.size(i)) for i in inits]

  def basis_vectors(vs, layer, k):
    w, b = vs[2 * layer], vs[2 * layer + 1]
    e = np.zeros(n_params[2 * layer] + n_params[2 * layer + 1])
    e[k] = 1.0
    cut = n_params[2 * layer]
    return (tf.constant(e[:cut].reshape(w.shape)),
            tf.constant(e[cut:].reshape(b.shape)))

  store = util.new_store()

  def build(vs):
    lc = kfac.LayerCollection()
    logits = util.register_mlp(vs, tf.constant(x), lc, approx=approx)
    util.categorical_loss(lc, logits, labels)
    est, ops = util.estimator_stages(store, lc, vs, "exact", damping=0.05,
                                     compute_cholesky=True,
                                     compute_cholesky_inverse=True)
    fetch = []
    for layer, block in enumerate(est.blocks):
      size = n_params[2 * layer] + n_params[2 * layer + 1]
      cols = {"chol": [], "chol_t": [], "chol_inv": [], "mult": []}
      for k in range(size):
        e = basis_vectors(vs, layer, k)
        cols["chol"].append(block.multiply_cholesky(e))
        cols["chol_t"].append(block.multiply_cholesky(e, transpose=True))
        cols["chol_inv"].append(block.multiply_cholesky_inverse(e))
        cols["mult"].append(block.multiply(e))
      fetch.append(cols)
    return ops + [fetch]

  for cols in ref.run_stages(world, inits, build)[-1]:
    mats = {k: np.stack([ref.flat(c) for c in v], axis=1)
            for k, v in cols.items()}
    np.testing.assert_allclose(mats["chol"] @ mats["chol"].T, mats["mult"],
                               rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(mats["chol_t"], mats["chol"].T, **TOL)
    np.testing.assert_allclose(mats["chol_inv"] @ mats["chol"],
                               np.eye(len(mats["chol"])), rtol=1e-9,
                               atol=1e-9)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("generic", ["full", "diagonal"])
def test_generic_blocks_equal_exact_fisher_for_one_example(world, generic):
  inits = ref.mlp_inits(util.SIZES, seed=10)
  x, labels = util.data(1, seed=11)
  damping = 0.02

  store = util.new_store()

  def build(vs):
    lc = kfac.LayerCollection()
    logits = util.register_mlp(vs, tf.constant(x), lc, generic=generic,
                               batch_size=1)
    util.categorical_loss(lc, logits, labels)
    est, ops = util.estimator_stages(store, lc, vs, "exact", damping=damping)
    vecs = _random_vectors(vs, 12)
    inv = [r for r, _ in est.multiply_inverse(list(zip(vecs, vs)))]
    return ops + [([b.full_fisher_block() for b in est.blocks], vecs, inv)]

  blocks, vecs, inv = ref.run_stages(world, inits, build)[-1]
  exact = _exact_fisher(inits, x)
  for layer, (block, sl) in enumerate(zip(blocks, util.layer_slices())):
    want = exact[sl, sl] if generic == "full" else np.diag(np.diag(exact[sl, sl]))
    np.testing.assert_allclose(block, want, **TOL)
    damped = want + damping * np.eye(len(want))
    np.testing.assert_allclose(
        ref.flat(inv[2 * layer:2 * layer + 2]),
        np.linalg.solve(damped, ref.flat(vecs[2 * layer:2 * layer + 2])),
        rtol=1e-8, atol=1e-10)


def test_towers_concatenate_like_one_big_batch():
  """Two towers through reuse equal one registration of both halves."""
  inits = ref.mlp_inits(util.SIZES, seed=13)
  x, labels = util.data(6, seed=14)

  store = util.new_store()

  def build_towers(vs):
    lc = kfac.LayerCollection()
    for half, reuse in ((slice(0, 3), False), (slice(3, 6), True)):
      record = []
      logits = ref.mlp_forward(vs, tf.constant(x[half]), record=record)
      for params, inputs, outputs in record:
        lc.register_fully_connected(params, inputs, outputs, reuse=reuse)
      lc.register_softmax_cross_entropy_loss(
          logits, targets=tf.constant(labels[half]), name="xent", reuse=reuse)
    assert [b.num_registered_towers for b in lc.get_blocks()] == [2, 2]
    assert len(lc.towers_by_loss[0]) == 2
    est, ops = util.estimator_stages(store, lc, vs, "exact")
    return ops + [[tf.identity(b.full_fisher_block()) for b in est.blocks]]

  blocks = ref.run_stages("graph", inits, build_towers)[-1]
  # Towers concatenate along the batch: A and G average over all 6 examples,
  # which for the diagonal of a 1-example... compare with one registration:
  store = util.new_store()

  def build_one(vs):
    lc = kfac.LayerCollection()
    util.categorical_loss(lc, util.register_mlp(vs, tf.constant(x), lc),
                          labels)
    est, ops = util.estimator_stages(store, lc, vs, "exact")
    return ops + [[tf.identity(b.full_fisher_block()) for b in est.blocks]]

  single = ref.run_stages("graph", inits, build_one)[-1]
  for a, b in zip(blocks, single):
    np.testing.assert_allclose(a, b, **TOL)


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
def test_kron_inverse_stays_bounded_when_output_gradients_vanish(world):
  """Saturated units: G ~ 1e-34 in float32, so pi ~ 1e17. Every stored
  inverse must stay below 1/sqrt(damping) (the split (A + pi s) (x)
  (G + s/pi) would store G's inverse ~ pi/s and overflow as G -> 0), and the
  block inverse must still equal the float64 dense pi-damped solve."""
  rng = np.random.RandomState(15)
  x = rng.randn(32, 4).astype(np.float32)
  grads = (1e-17 * rng.randn(32, 3)).astype(np.float32)
  damping = 1e-3
  store = util.new_store()

  def build(vs):
    (w,) = vs
    lc = kfac.LayerCollection()
    out = tf.matmul(tf.constant(x), w)
    block = lc.register_fully_connected(w, tf.constant(x), out)
    block.instantiate_factors([(tf.constant(grads),)], damping)
    for f in lc.get_factors():
      f.attach_state_store(store)
    block.register_inverse()
    cov_op = tf.group(*[f.make_covariance_update_op(0.0)
                        for f in lc.get_factors()])
    inv_op = tf.group(*[op for f in lc.get_factors()
                        for op in f.make_inverse_update_ops()])
    vec = tf.constant(rng.randn(4, 3).astype(np.float32))
    fetch = [[tf.identity(f.get_cov()) for f in block.factors()],
             [tf.identity(v) for f in block.factors()
              for v in f._vars.values()],  # pylint: disable=protected-access
             block.multiply_inverse(vec), vec]
    return [cov_op, inv_op, fetch]

  (a, g), inverses, got, vec = ref.run_stages(
      world, [np.zeros((4, 3), np.float32)], build)[-1]
  assert 0 < np.trace(g) < 1e-30  # the degenerate regime really is reached
  for inv in inverses:
    assert np.all(np.isfinite(inv))
    assert np.abs(inv).max() <= 1.0001 / np.sqrt(damping)
  dense = ref.pi_damped_kron(a.astype(np.float64), g.astype(np.float64),
                             damping)
  want = np.linalg.solve(dense, vec.astype(np.float64).reshape(-1))
  np.testing.assert_allclose(got.reshape(-1), want, rtol=2e-3, atol=1e-6)
