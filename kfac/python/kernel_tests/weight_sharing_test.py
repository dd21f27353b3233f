"""Dense layers shared over positions in one call ([batch, T, in] inputs):
KFAC-expand ("kron" and its diagonal variants), KFAC-reduce ("kron_reduce")
and the exact diagonal, against float64 brute force.

References: the exact GGN of the per-example loss averaged over the N
examples, (1/N) sum_n J_n^T Lambda_n J_n, with J_n the tape Jacobian of all
of example n's outputs (every position) and Lambda_n = 2 I (squared error);
never computed with kfac code. Tolerances: 1e-9 relative (float64) for the
identities; "not exact" means a relative Frobenius difference above 5%.

Settings (Eschenhagen et al. 2023):
* expand: a deep linear network applied per position, a squared error per
  position. "kron" (factors averaged over batch and positions, coefficient
  T) is the exact block for any batch.
* reduce: dense on [N, T, d] -> mean over T -> dense -> squared error.
  "kron_reduce" (A from position-averaged inputs, G from position-summed
  gradients, coefficient 1) is exact for any batch.
The losses are registered on [N, T * out] (one row per example): the exact
modes loop over the columns of the registered loss inputs, so an example
whose outputs span several rows would get cross-position terms in its
per-example gradients (harmless for the kron factors, wrong for the
diagonal).
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref

WORLDS = ref.WORLDS
TOL = dict(rtol=1e-9, atol=1e-12)
N, T = 5, 3
SIZES = (3, 4, 2)


def _inits(seed):
  return ref.mlp_inits(SIZES, seed=seed, scale=0.8)


def _dense(x, w, b):
  return tf.einsum("...i,ij->...j", x, w) + b


def expand_forward(vs, x, act=None, record=None):
  """Per-position network: [N, T, d0] -> [N, T, d2]."""
  z1 = _dense(x, vs[0], vs[1])
  h = z1 if act is None else act(z1)
  z2 = _dense(h, vs[2], vs[3])
  if record is not None:
    record.extend([((vs[0], vs[1]), x, z1), ((vs[2], vs[3]), h, z2)])
  return z2


def expand_tanh_forward(vs, x, record=None):
  return expand_forward(vs, x, act=tf.tanh, record=record)


def reduce_forward(vs, x, record=None):
  """[N, T, d0] -> dense -> mean over T -> dense -> [N, d2]."""
  z1 = _dense(x, vs[0], vs[1])
  h = tf.reduce_mean(z1, axis=1)
  z2 = _dense(h, vs[2], vs[3])
  if record is not None:
    record.extend([((vs[0], vs[1]), x, z1), ((vs[2], vs[3]), h, z2)])
  return z2


def _data(seed, n=N, t=T):
  rng = np.random.RandomState(seed)
  return rng.randn(n, t, SIZES[0]), rng


def exact_ggn(forward, inits, x):
  key = (forward, tuple(i.tobytes() for i in inits), x.tobytes())
  if key not in _GGN_CACHE:
    jacs = ref.per_example_jacobians(forward, inits, x)
    _GGN_CACHE[key] = ref.curvature(
        jacs, [2.0 * np.eye(j.shape[0]) for j in jacs])
  return _GGN_CACHE[key]


_GGN_CACHE = {}


def _run(world, forward, inits, x, approxs, loss_layout="flat", mode="exact_GGN",
         damping=1e-2, fetch_fn=None, **fwd_kwargs):
  """Registers `forward` with per-layer `approxs`, runs cov + inverse
  updates and returns [block matrices] (or fetch_fn(est, vs))."""
  store = util.new_store()
  targets_rng = np.random.RandomState(99)

  def build(vs):
    lc = kfac.LayerCollection()
    record = []
    y = forward(vs, tf.constant(x), record=record, **fwd_kwargs)
    for (params, inputs, outputs), approx in zip(record, approxs):
      lc.register_fully_connected(params, inputs, outputs, approx=approx)
    if loss_layout == "flat":
      pred = tf.reshape(y, [x.shape[0], -1])
    else:  # one row per (example, position)
      pred = tf.reshape(y, [-1, y.shape[-1]])
    targets = tf.constant(targets_rng.randn(*pred.shape))
    lc.register_squared_error_loss(pred, targets=targets)
    est, ops = util.estimator_stages(store, lc, vs, mode, damping=damping)
    if fetch_fn is not None:
      return ops + [fetch_fn(est, vs)]
    return ops + [[tf.identity(b.full_fisher_block()) for b in est.blocks]]

  return ref.run_stages(world, inits, build)[-1]


def _rel_diff(a, b):
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("loss_layout", ["flat", "rows"])
def test_expand_kron_equals_exact_ggn_of_a_per_position_linear_network(
    world, loss_layout):
  inits = _inits(1)
  x, _ = _data(2)
  blocks = _run(world, expand_forward, inits, x, ["kron", "kron"],
                loss_layout=loss_layout)
  exact = exact_ggn(expand_forward, inits, x)
  for block, sl in zip(blocks, util.layer_slices(SIZES)):
    np.testing.assert_allclose(block, exact[sl, sl], **TOL)


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_equals_exact_ggn_when_positions_are_averaged(world):
  inits = _inits(3)
  x, _ = _data(4)
  blocks = _run(world, reduce_forward, inits, x, ["kron_reduce", "kron"])
  exact = exact_ggn(reduce_forward, inits, x)
  for block, sl in zip(blocks, util.layer_slices(SIZES)):
    np.testing.assert_allclose(block, exact[sl, sl], **TOL)


def test_expand_is_not_exact_in_the_reduce_setting():
  inits = _inits(3)
  x, _ = _data(4)
  expand, _ = _run("graph", reduce_forward, inits, x, ["kron", "kron"])
  reduce_, _ = _run("graph", reduce_forward, inits, x, ["kron_reduce", "kron"])
  sl = util.layer_slices(SIZES)[0]
  exact = exact_ggn(reduce_forward, inits, x)[sl, sl]
  assert _rel_diff(reduce_, exact) < 1e-9
  assert _rel_diff(expand, exact) > 0.05


def test_reduce_is_not_exact_in_the_expand_setting():
  inits = _inits(1)
  x, _ = _data(2)
  reduce_, _ = _run("graph", expand_forward, inits, x, ["kron_reduce", "kron"])
  expand, _ = _run("graph", expand_forward, inits, x, ["kron", "kron"])
  sl = util.layer_slices(SIZES)[0]
  exact = exact_ggn(expand_forward, inits, x)[sl, sl]
  assert _rel_diff(expand, exact) < 1e-9
  assert _rel_diff(reduce_, exact) > 0.05


@pytest.mark.parametrize("world", WORLDS)
def test_diagonal_is_the_exact_diagonal_with_shared_positions(world):
  """Nonlinear per-position network and the reduce network: the diagonal
  block squares the per-example gradient summed over positions."""
  inits = _inits(5)
  x, _ = _data(6)
  for forward in (expand_tanh_forward, reduce_forward):
    blocks = _run(world, forward, inits, x, ["diagonal", "diagonal"])
    exact = exact_ggn(forward, inits, x)
    for block, sl in zip(blocks, util.layer_slices(SIZES)):
      np.testing.assert_allclose(np.diag(block), np.diag(exact[sl, sl]),
                                 **TOL)
      assert np.count_nonzero(block - np.diag(np.diag(block))) == 0


def test_diagonal_does_not_treat_positions_as_examples():
  """Rows-as-examples (E over batch*positions of a^2 g^2, times T) differs
  from the exact diagonal in the reduce setting; ours does not."""
  inits = _inits(5)
  x, _ = _data(6)
  diag = np.diag(_run("graph", reduce_forward, inits, x,
                      ["diagonal", "kron"])[0])
  exact = np.diag(exact_ggn(reduce_forward, inits, x)[
      util.layer_slices(SIZES)[0], util.layer_slices(SIZES)[0]])

  def fetch(est, vs):
    del vs
    return [tf.identity(f.get_cov()) for f in est.blocks[0].factors()]

  a, g = _run("graph", reduce_forward, inits, x, ["kron", "kron"],
              fetch_fn=fetch)
  rows_as_examples = T * np.kron(np.diag(a), np.diag(g))
  np.testing.assert_allclose(diag, exact, **TOL)
  assert _rel_diff(rows_as_examples, exact) > 0.05


@pytest.mark.parametrize("approx", ["kron_in_diag", "kron_out_diag",
                                    "kron_both_diag"])
def test_kron_diagonal_variants_are_expand_with_diagonal_factors(approx):
  inits = _inits(7)
  x, _ = _data(8)

  def fetch(est, vs):
    del vs
    return [[tf.identity(f.get_cov()) for f in b.factors()] +
            [tf.identity(b.full_fisher_block())] for b in est.blocks]

  full = _run("graph", expand_forward, inits, x, ["kron", "kron"],
              fetch_fn=fetch, act=tf.tanh)
  diag = _run("graph", expand_forward, inits, x, [approx, approx],
              fetch_fn=fetch, act=tf.tanh)
  for (a, g, _), (da, dg, block) in zip(full, diag):
    want_a = np.diag(np.diag(a)) if approx != "kron_out_diag" else a
    want_g = np.diag(np.diag(g)) if approx != "kron_in_diag" else g
    np.testing.assert_allclose(da, want_a, **TOL)
    np.testing.assert_allclose(dg, want_g, **TOL)
    np.testing.assert_allclose(block, T * np.kron(want_a, want_g), **TOL)


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
def test_inverses_use_the_coefficient_and_normalised_damping(world):
  """expand: (T A (x) G + damping) ~ T (A + pi s I) (x) (G + s/pi I) with
  s = sqrt(damping / T); reduce: coefficient 1, s = sqrt(damping)."""
  inits = _inits(9)
  x, rng = _data(10)
  damping = 0.03
  vec = [rng.randn(*i.shape) for i in inits]

  def fetch(est, vs):
    pairs = [(tf.constant(v), var) for v, var in zip(vec, vs)]
    return ([[tf.identity(f.get_cov()) for f in b.factors()]
             for b in est.blocks],
            [r for r, _ in est.multiply_inverse(pairs)])

  for approx, coeff in (("kron", T), ("kron_reduce", 1)):
    factors, inv = _run(world, expand_forward, inits, x, [approx, "kron"],
                        damping=damping, fetch_fn=fetch, act=tf.tanh)
    a, g = factors[0]
    dense = coeff * ref.pi_damped_kron(a, g, damping / coeff)
    np.testing.assert_allclose(ref.flat(inv[:2]),
                               np.linalg.solve(dense, ref.flat(vec[:2])),
                               rtol=1e-8, atol=1e-11)


def test_kron_reduce_equals_kron_on_rank2_inputs():
  inits = ref.mlp_inits(util.SIZES, seed=11)
  x, labels = util.data(6, seed=12)
  rng = np.random.RandomState(13)
  vec = [rng.randn(*i.shape) for i in inits]
  out = {}
  for approx in ("kron", "kron_reduce"):
    store = util.new_store()

    def build(vs, approx=approx, store=store):
      lc = kfac.LayerCollection()
      logits = util.register_mlp(vs, tf.constant(x), lc, approx=approx)
      util.categorical_loss(lc, logits, labels)
      est, ops = util.estimator_stages(store, lc, vs, "exact", damping=0.02)
      pairs = [(tf.constant(v), var) for v, var in zip(vec, vs)]
      return ops + [([tf.identity(b.full_fisher_block()) for b in est.blocks],
                     [r for r, _ in est.multiply_inverse(pairs)])]

    out[approx] = ref.run_stages("graph", inits, build)[-1]
  for got, want in zip(out["kron_reduce"][0] + out["kron_reduce"][1],
                       out["kron"][0] + out["kron"][1]):
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_kron_reduce_is_registered_as_a_fully_connected_approximation():
  with tf.Graph().as_default():
    w = tf.Variable(np.ones((3, 2)))
    x = tf.constant(np.ones((4, 5, 3)))
    lc = kfac.LayerCollection()
    block = lc.register_fully_connected(w, x, tf.einsum("ntd,de->nte", x, w),
                                        approx="kron_reduce")
    assert isinstance(block, kfac.fisher_blocks.FullyConnectedKFACReduceFB)
    lc.set_default_fully_connected_approximation("kron_reduce")
    assert lc.default_fully_connected_approximation == "kron_reduce"


def test_towers_with_different_numbers_of_positions_are_rejected():
  with tf.Graph().as_default():
    w = tf.Variable(np.ones((3, 2)), name="shared_w")
    lc = kfac.LayerCollection()
    for t, reuse in ((4, False), (5, True)):
      x = tf.constant(np.ones((2, t, 3)))
      y = tf.einsum("ntd,de->nte", x, w)
      if reuse:
        with pytest.raises(ValueError, match="shared_w.*same number"):
          lc.register_fully_connected(w, x, y, reuse=reuse)
      else:
        lc.register_fully_connected(w, x, y, reuse=reuse)
