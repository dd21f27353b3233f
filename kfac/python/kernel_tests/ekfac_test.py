"""EKFAC against float64 brute-force Fisher matrices.

For dense, weight-shared dense, multi-use dense, conv and embedding layers
(expand and reduce bases) in the exact, empirical and exact-GGN modes:
* the scalings equal the diagonal of the brute-force Fisher block in the
  Kronecker eigenbasis (rtol 1e-9);
* ||F - EKFAC||_F <= ||F - KFAC||_F (asserted; measured EKFAC / K-FAC
  error ratios: MLP exact mode 0.92 and 0.32 (two layers), empirical 0.88
  and 0.59; weight-shared dense expand 0.97, reduce 0.85; conv expand
  0.88, reduce 0.97; a dense layer used twice 0.97, as lists of uses or
  folded);
* with one example and no sharing, EKFAC equals K-FAC (undamped, 1e-9);
* the per-example and Gramian strategies agree to 1e-12 (relative);
* damped products, powers and Cholesky factors equal dense float64 algebra
  on the same block.
Each runs in a TF1 Session graph and in a tf.function; the tf.function runs
of the per-layer oracles are in the slow tier (reference.WORLDS_TF2_SLOW),
the damped products run in both worlds in the fast tier, and
ekfac_training_test checks that the two worlds train alike.
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref

TOL = dict(rtol=1e-9, atol=1e-12)
DAMPING = 0.03


def _xent(labels):
  def loss_fn(logits, n):
    return -tf.nn.log_softmax(tf.reshape(logits, [-1]))[labels[n]]
  return loss_fn


def _reference(forward, inits, x, labels, mode):
  """The brute-force curvature of the mean loss in `mode` (dense)."""
  if mode == "empirical":
    return ref.empirical_fisher(ref.per_example_loss_grads(
        forward, inits, x, _xent(labels)))
  jacs = ref.per_example_jacobians(forward, inits, x)
  logits = ref.outputs(forward, inits, x)
  return ref.curvature(jacs, [ref.categorical_fisher(z) for z in logits])


def _run(world, inits, forward_register, x, labels, mode, strategy="auto",
         fetch_products=False):
  """Builds the model with its EKFAC registrations, runs cov update,
  basis refresh, cov update (the scalings in the new basis) and fetches,
  per EKFAC block: A, G, Q_A (or I), Q_G, S, the undamped dense block, the
  K-FAC coefficient, and optionally damped products."""
  store = util.new_store()
  rng = np.random.RandomState(5)

  def build(vs):
    lc = kfac.LayerCollection()
    lc.ekfac_strategy = strategy
    logits = forward_register(vs, tf.constant(x), lc)
    util.categorical_loss(lc, logits, labels)
    est = kfac.estimator.FisherEstimator(
        variables=vs, cov_ema_decay=0.5, damping=DAMPING,
        layer_collection=lc, exps=(-1, 0.5), estimation_mode=mode,
        state_store=store, compute_cholesky=True,
        compute_cholesky_inverse=True)
    first = est.make_vars_and_create_ops()
    cov_again, _ = est.make_vars_and_create_op_thunks()
    second = tf.group(*[t() for t in cov_again])
    fetches = []
    for block in est.blocks:
      if not getattr(block, "is_ekfac", False):
        continue
      corr = block.correction_factor
      q_in, q_out = corr.bases()
      rows, cols = corr.get_cov_var().shape
      eye = lambda n: tf.eye(n, dtype=tf.float64)
      item = {
          "A": tf.identity(block._input_factor.get_cov()),
          "G": tf.identity(block._output_factor.get_cov()),
          "QA": eye(rows) if q_in is None else tf.identity(q_in),
          "QG": eye(cols) if q_out is None else tf.identity(q_out),
          "S": tf.identity(corr.get_cov_var()),
          "block": tf.identity(block.full_fisher_block()),
          "c": tf.cast(block._renorm_coeff, tf.float64),
      }
      if fetch_products:
        shapes = [p.shape for p in kfac.utils.ensure_sequence(block.params)]
        vec = tuple(tf.constant(rng.randn(*s)) for s in shapes)
        vec = vec if len(vec) > 1 else vec[0]
        flat = lambda v: tf.concat(
            [tf.reshape(t, [-1]) for t in kfac.utils.ensure_sequence(v)], 0)
        item["v"] = flat(vec)
        for name, fn in (
            ("mul", lambda v: block.multiply(v)),
            ("inv", lambda v: block.multiply_inverse(v)),
            ("sqrt", lambda v: block.multiply_matpower(v, 0.5)),
            ("chol", lambda v: block.multiply_cholesky(v)),
            ("cholT", lambda v: block.multiply_cholesky(v, transpose=True)),
            ("cholinv", lambda v: block.multiply_cholesky_inverse(v)),
            ("cholinvT", lambda v: block.multiply_cholesky_inverse(
                v, transpose=True))):
          item[name] = flat(fn(vec))
      fetches.append(item)
    return [first.cov_update_op, first.inv_update_op, second, fetches]

  return ref.run_stages(world, inits, build)[-1]


def _check_scalings(item, fisher_block):
  q = np.kron(item["QA"], item["QG"])
  # The basis diagonalises both factors.
  for name, basis in (("A", item["QA"]), ("G", item["QG"])):
    rotated = basis.T @ item[name] @ basis
    off = rotated - np.diag(np.diag(rotated))
    assert np.abs(off).max() <= 1e-9 * np.abs(rotated).max() + 1e-14, name
  expected = np.diag(q.T @ fisher_block @ q)
  np.testing.assert_allclose(item["S"].reshape(-1), expected, **TOL)
  # The dense EKFAC block is Q diag(S) Q^T.
  np.testing.assert_allclose(item["block"], (q * expected) @ q.T, **TOL)


def _errors(item, fisher_block):
  """(||F - EKFAC||_F, ||F - KFAC||_F) of one block."""
  kfac_block = item["c"] * np.kron(item["A"], item["G"])
  return (np.linalg.norm(fisher_block - item["block"]),
          np.linalg.norm(fisher_block - kfac_block))


# ------------------------------------------------------------------ models
def _mlp_register(approx):
  def forward_register(vs, x, lc):
    return util.register_mlp(vs, x, lc, approx=approx)
  return forward_register


SHARED = (3, 4, 3)  # in, hidden (shared over P positions), classes
POSITIONS = 4


def _shared_inits(seed):
  rng = np.random.RandomState(seed)
  return [0.6 * rng.randn(3, 4), 0.1 * rng.randn(4), 0.6 * rng.randn(4, 3),
          0.1 * rng.randn(3)]


def _shared_forward(params, x, lc=None, approx="ekfac"):
  """x [N, P, 3] -> tanh(x W0 + b0) [N, P, 4] -> (mean over P) W1 + b1."""
  w0, b0, w1, b1 = params
  pre = tf.einsum("npi,ij->npj", x, w0) + b0
  h = tf.reduce_mean(tf.tanh(pre * (1.0 + tf.range(
      POSITIONS, dtype=x.dtype)[tf.newaxis, :, tf.newaxis] / 3.0)), axis=1)
  logits = tf.matmul(h, w1) + b1
  if lc is not None:
    lc.register_fully_connected((w0, b0), x, pre, approx=approx)
    lc.register_fully_connected((w1, b1), h, logits, approx="ekfac")
  return logits


def _conv_inits(seed):
  rng = np.random.RandomState(seed)
  return [0.5 * rng.randn(3, 3, 2, 3), 0.1 * rng.randn(3),
          0.5 * rng.randn(3, 3), 0.1 * rng.randn(3)]


def _conv_forward(params, x, lc=None, approx="ekfac"):
  f, b, w1, b1 = params
  pre = tf.nn.conv2d(x, f, strides=1, padding="SAME") + b
  h = tf.reduce_mean(tf.tanh(pre), axis=[1, 2])
  logits = tf.matmul(h, w1) + b1
  if lc is not None:
    lc.register_conv2d((f, b), 1, "SAME", x, pre, approx=approx)
    lc.register_fully_connected((w1, b1), h, logits)
  return logits


def _embedding_inits(seed):
  rng = np.random.RandomState(seed)
  return [0.7 * rng.randn(5, 3), 0.6 * rng.randn(3, 3), 0.1 * rng.randn(3)]


def _embedding_forward(ids):
  def forward(params, x, lc=None):
    table, w1, b1 = params
    rows = tf.gather(table, ids[:x.shape[0]] if lc is None else ids)
    h = tf.reduce_mean(tf.tanh(rows), axis=1)
    logits = tf.matmul(h, w1) + b1
    if lc is not None:
      lc.register_embedding(table, tf.constant(ids), rows, approx="ekfac")
      lc.register_fully_connected((w1, b1), h, logits, approx="kron")
    return logits
  return forward


# ------------------------------------------------------------------- tests
@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
@pytest.mark.parametrize("mode", ["exact", "empirical", "exact_GGN"])
def test_dense_scalings_are_the_fisher_diagonal_in_the_eigenbasis(world,
                                                                  mode):
  inits = ref.mlp_inits(util.SIZES, seed=3)
  x, labels = util.data(7, seed=4)
  items = _run(world, inits, _mlp_register("ekfac"), x, labels, mode)
  fisher = _reference(ref.mlp_forward, inits, x, labels, mode)
  assert len(items) == 2
  for item, sl in zip(items, util.layer_slices()):
    _check_scalings(item, fisher[sl, sl])
    ekfac_err, kfac_err = _errors(item, fisher[sl, sl])
    assert ekfac_err <= kfac_err, (ekfac_err, kfac_err)


def test_ekfac_equals_kfac_for_one_example():
  inits = ref.mlp_inits(util.SIZES, seed=6)
  x, labels = util.data(1, seed=7)
  for item in _run("graph", inits, _mlp_register("ekfac"), x, labels,
                   "empirical"):
    kfac_block = np.kron(item["A"], item["G"])
    np.testing.assert_allclose(item["block"], kfac_block, rtol=1e-9,
                               atol=1e-12 * np.abs(kfac_block).max())


def _shared_case(world, approx, strategy="auto", mode="exact"):
  inits = _shared_inits(8)
  rng = np.random.RandomState(9)
  x = rng.randn(6, POSITIONS, 3)
  labels = rng.randint(0, 3, 6)
  fr = lambda vs, xt, lc: _shared_forward(vs, xt, lc, approx)
  items = _run(world, inits, fr, x, labels, mode, strategy)
  fisher = _reference(_shared_forward, inits, x, labels, mode)
  return items, fisher, [slice(0, 16), slice(16, 31)]


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
@pytest.mark.parametrize("approx", ["ekfac", "ekfac_reduce"])
def test_weight_shared_dense(world, approx):
  items, fisher, slices = _shared_case(world, approx)
  for item, sl in zip(items, slices):
    _check_scalings(item, fisher[sl, sl])
  ekfac_err, kfac_err = _errors(items[0], fisher[slices[0], slices[0]])
  # Measured: expand 0.156 vs 0.161; reduce 0.119 vs 0.140.
  assert ekfac_err <= kfac_err, (ekfac_err, kfac_err)


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_per_example_and_gramian_strategies_agree():
  out = {}
  for strategy in ("per_example", "gramian"):
    items, _, _ = _shared_case("graph", "ekfac", strategy)
    out[strategy] = items[0]["S"]
  scale = np.abs(out["per_example"]).max()
  np.testing.assert_allclose(out["gramian"], out["per_example"], rtol=0,
                             atol=1e-12 * scale)
  assert scale > 1e-3


def test_strategy_choice_follows_memory():
  choose = kfac.ekfac.choose_strategy
  budget = kfac.python.ops.ekfac.scalings.PER_EXAMPLE_BUDGET
  assert choose(1, 100, 100) == "factored"
  # Per-example gradients (faster) while they fit the budget ...
  assert choose(4, 100, 100) == "per_example"   # Gramian 16 * 200 < 10000
  assert choose(64, 10, 10) == "per_example"
  assert choose(None, 10, 10) == "per_example"
  # ... above it the Gramian when it needs less memory.
  assert 4096 * 4096 > budget
  assert choose(4, 4096, 4096) == "gramian"     # 16 * 8192 < 4096^2
  assert choose(2048, 4096, 4096) == "per_example"
  assert choose(None, 4096, 4096) == "per_example"
  assert choose(4, 100, 100, "gramian") == "gramian"
  with pytest.raises(ValueError, match="strategy 'bogus'"):
    choose(4, 3, 3, "bogus")
  with pytest.raises(ValueError, match="strategy 'x'"):
    kfac.LayerCollection().ekfac_strategy = "x"


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
@pytest.mark.parametrize("approx", ["ekfac", "ekfac_reduce"])
def test_conv(world, approx):
  inits = _conv_inits(10)
  rng = np.random.RandomState(11)
  x = rng.randn(4, 4, 4, 2)
  labels = rng.randint(0, 3, 4)
  fr = lambda vs, xt, lc: _conv_forward(vs, xt, lc, approx)
  items = _run(world, inits, fr, x, labels, "exact")
  fisher = _reference(_conv_forward, inits, x, labels, "exact")
  _check_scalings(items[0], fisher[:57, :57])
  ekfac_err, kfac_err = _errors(items[0], fisher[:57, :57])
  assert ekfac_err <= kfac_err, (ekfac_err, kfac_err)


def test_conv_strategies_agree():
  inits = _conv_inits(12)
  rng = np.random.RandomState(13)
  x = rng.randn(3, 3, 3, 2)
  labels = rng.randint(0, 3, 3)
  out = [_run("graph", inits, lambda vs, xt, lc: _conv_forward(vs, xt, lc),
              x, labels, "empirical", s)[0]["S"]
         for s in ("per_example", "gramian")]
  np.testing.assert_allclose(out[1], out[0], rtol=0,
                             atol=1e-12 * np.abs(out[0]).max())


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
def test_embedding(world):
  inits = _embedding_inits(14)
  rng = np.random.RandomState(15)
  ids = rng.randint(0, 5, size=(6, 3)).astype(np.int64)
  labels = rng.randint(0, 3, 6)
  x = np.zeros([6, 1])
  items = _run(world, inits, _embedding_forward(ids), x, labels, "exact")
  per_example = lambda params, xs: _embedding_forward(ids)(params, xs)
  # The reference runs one example at a time: give it that example's ids.
  jacs = []
  for n in range(6):
    fwd = _embedding_forward(ids[n:n + 1])
    jacs.append(ref.per_example_jacobians(fwd, inits, x[:1])[0])
  del per_example
  logits = ref.outputs(_embedding_forward(ids), inits, x)
  fisher = ref.curvature(np.stack(jacs),
                         [ref.categorical_fisher(z) for z in logits])
  _check_scalings(items[0], fisher[:15, :15])
  ekfac_err, kfac_err = _errors(items[0], fisher[:15, :15])
  assert ekfac_err <= kfac_err, (ekfac_err, kfac_err)


def _dense_products(item):
  q = np.kron(item["QA"], item["QG"])
  d = item["S"].reshape(-1) + DAMPING
  return q, d


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("world", ref.WORLDS)
def test_damped_products_powers_and_cholesky(world):
  inits = ref.mlp_inits(util.SIZES, seed=16)
  x, labels = util.data(5, seed=17)
  items = _run(world, inits, _mlp_register("ekfac"), x, labels, "exact",
               fetch_products=True)
  for item in items:
    q, d = _dense_products(item)
    v = item["v"]
    dense = (q * d) @ q.T
    np.testing.assert_allclose(dense, item["block"] + DAMPING * np.eye(
        len(d)), **TOL)
    np.testing.assert_allclose(item["mul"], dense @ v, **TOL)
    np.testing.assert_allclose(item["inv"], np.linalg.solve(dense, v),
                               **TOL)
    np.testing.assert_allclose(item["sqrt"], ref.sym_matpower(dense, 0.5) @ v,
                               **TOL)
    chol = q * np.sqrt(d)  # C with C C^T = dense
    np.testing.assert_allclose(chol @ chol.T, dense, **TOL)
    np.testing.assert_allclose(item["chol"], chol @ v, **TOL)
    np.testing.assert_allclose(item["cholT"], chol.T @ v, **TOL)
    np.testing.assert_allclose(item["cholinv"], np.linalg.solve(chol, v),
                               **TOL)
    np.testing.assert_allclose(item["cholinvT"],
                               np.linalg.solve(chol.T, v), **TOL)


def _multi_inits(seed):
  rng = np.random.RandomState(seed)
  return [0.6 * rng.randn(3, 3), 0.1 * rng.randn(3), 0.6 * rng.randn(3, 3)]


def _multi_forward(folded):
  """One weight (W, b) used twice in an example: on x and on sin(x) (as a
  list of uses, or folded into one [2 * N, 3] matmul), the uses' outputs
  combined by tanh(a1 * a2)."""
  def forward(params, x, lc=None):
    w, b, w2 = params
    uses = [x, tf.sin(2.0 * x)]
    if folded:
      folded_out = tf.matmul(tf.concat(uses, 0), w) + b
      a1, a2 = tf.split(folded_out, 2, axis=0)
    else:
      a1, a2 = [tf.matmul(u, w) + b for u in uses]
    h = tf.tanh(a1 * a2)
    logits = tf.matmul(h, w2)
    if lc is not None:
      if folded:
        lc.register_fully_connected_multi(
            (w, b), tf.concat(uses, 0), folded_out, num_uses=2,
            approx="ekfac")
      else:
        lc.register_fully_connected_multi((w, b), uses, [a1, a2],
                                          approx="ekfac")
      lc.register_fully_connected(w2, h, logits, approx="ekfac")
    return logits
  return forward


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
@pytest.mark.parametrize("folded", [False, True])
def test_multi_use_dense(world, folded):
  inits = _multi_inits(18)
  rng = np.random.RandomState(19)
  x = rng.randn(6, 3)
  labels = rng.randint(0, 3, 6)
  forward = _multi_forward(folded)
  items = _run(world, inits, forward, x, labels, "exact")
  fisher = _reference(forward, inits, x, labels, "exact")
  _check_scalings(items[0], fisher[:12, :12])
  _check_scalings(items[1], fisher[12:, 12:])
  ekfac_err, kfac_err = _errors(items[0], fisher[:12, :12])
  assert ekfac_err <= kfac_err, (ekfac_err, kfac_err)
