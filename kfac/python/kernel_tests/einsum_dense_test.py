"""Dense layers whose weight has several input or output axes (EinsumDense,
MultiHeadAttention's projections): register_fully_connected(output_axes=k)
against float64 brute force.

The two layers of every model here are MultiHeadAttention's projections:
"abc,cde->abde" (W1 [D, H, K], bias [H, K], output_axes=2: the query / key /
value projections) and "abcd,cde->abe" (W2 [H, K, E], bias [E]: the output
projection, its inputs [N, T, H, K] flattened to [N, T, H*K] by the
registration). Each is the dense map [prod(in axes)] -> [prod(out axes)]
over the shared leading axes, the weight in row-major order.

References (never kfac code): the exact GGN (1/N) sum_n J_n^T 2I J_n of
tape Jacobians, in the flat order of the variables (W row-major, then b);
damped Kronecker inverses built with numpy. Tolerances: 1e-9 relative for
the exact identities (float64), 1e-8 for solves.
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref

TOL = dict(rtol=1e-9, atol=1e-12)
N, T, D, H, K, E = 4, 3, 3, 2, 2, 2
PROJ, OUT = "abc,cde->abde", "abcd,cde->abe"


def _inits(seed):
  rng = np.random.RandomState(seed)
  return [0.7 * rng.randn(D, H, K), 0.3 * rng.randn(H, K),
          0.7 * rng.randn(H, K, E), 0.3 * rng.randn(E)]


def _slices():
  sizes = [D * H * K + H * K, H * K * E + E]
  return [slice(0, sizes[0]), slice(sizes[0], sum(sizes))]


def attention_forward(vs, x, act=None, record=None):
  """Per-position projections [N, T, D] -> [N, T, H, K] -> [N, T, E]."""
  z1 = tf.einsum(PROJ, x, vs[0]) + vs[1]
  h = z1 if act is None else act(z1)
  z2 = tf.einsum(OUT, h, vs[2]) + vs[3]
  if record is not None:
    record.extend([((vs[0], vs[1]), x, z1, 2), ((vs[2], vs[3]), h, z2, 1)])
  return z2


def tanh_forward(vs, x, record=None):
  return attention_forward(vs, x, act=tf.tanh, record=record)


def reduce_forward(vs, x, record=None):
  """[N, T, D] -> projection -> mean over T -> "bcd,cde->be" -> [N, E]."""
  z1 = tf.einsum(PROJ, x, vs[0]) + vs[1]
  h = tf.reduce_mean(z1, axis=1)
  z2 = tf.einsum("bcd,cde->be", h, vs[2]) + vs[3]
  if record is not None:
    record.extend([((vs[0], vs[1]), x, z1, 2), ((vs[2], vs[3]), h, z2, 1)])
  return z2


def flat_forward(vs, x, act=None, record=None):
  """The same network with 2-d weights (W1 [D, H*K], W2 [H*K, E])."""
  z1 = tf.einsum("ntd,dj->ntj", x, vs[0]) + vs[1]
  h = z1 if act is None else act(z1)
  z2 = tf.einsum("ntj,je->nte", h, vs[2]) + vs[3]
  if record is not None:
    record.extend([((vs[0], vs[1]), x, z1, 1), ((vs[2], vs[3]), h, z2, 1)])
  return z2


def _flat_inits(inits):
  return [inits[0].reshape(D, H * K), inits[1].reshape(H * K),
          inits[2].reshape(H * K, E), inits[3]]


def _data(seed):
  rng = np.random.RandomState(seed)
  return rng.randn(N, T, D), rng


def _run(world, forward, inits, x, approxs, fetch, damping=1e-2,
         mode="exact_GGN", **fwd_kwargs):
  store = util.new_store()
  targets_rng = np.random.RandomState(99)

  def build(vs):
    lc = kfac.LayerCollection()
    record = []
    y = forward(vs, tf.constant(x), record=record, **fwd_kwargs)
    for (params, inputs, outputs, axes), approx in zip(record, approxs):
      lc.register_fully_connected(params, inputs, outputs, approx=approx,
                                  output_axes=axes)
    pred = tf.reshape(y, [x.shape[0], -1])
    lc.register_squared_error_loss(
        pred, targets=tf.constant(targets_rng.randn(*pred.shape)))
    est, ops = util.estimator_stages(store, lc, vs, mode, damping=damping)
    return ops + [fetch(est, vs)]

  return ref.run_stages(world, inits, build)[-1]


def _blocks(est, vs):
  del vs
  return [tf.identity(b.full_fisher_block()) for b in est.blocks]


def _exact_ggn(forward, inits, x):
  jacs = ref.per_example_jacobians(forward, inits, x)
  return ref.curvature(jacs, [2.0 * np.eye(j.shape[0]) for j in jacs])


@pytest.mark.parametrize("world", ref.WORLDS)
def test_kron_of_attention_projections_is_the_exact_ggn(world):
  """A per-position linear network: KFAC-expand is exact for any batch, so
  each block equals the brute-force GGN block of its weight (kernel axes
  in row-major order, then the bias)."""
  inits = _inits(1)
  x, _ = _data(2)
  blocks = _run(world, attention_forward, inits, x, ["kron", "kron"],
                _blocks)
  exact = _exact_ggn(attention_forward, inits, x)
  for block, sl in zip(blocks, _slices()):
    assert block.shape == (sl.stop - sl.start,) * 2
    np.testing.assert_allclose(block, exact[sl, sl], **TOL)


@pytest.mark.parametrize("world", ref.WORLDS)
def test_preconditioned_gradient_is_the_damped_kronecker_inverse(world):
  """Nonlinear network: the factors are E over examples and positions of
  [a, 1][a, 1]^T (a: the inputs flattened over their input axes) and of
  the output gradients flattened over the output axes; multiply_inverse
  is (T A (x) G + damping)^-1 with the pi-split damping, applied to the
  kernel reshaped to [in, out] and back to its shape."""
  inits = _inits(3)
  x, rng = _data(4)
  damping = 0.03
  vec = [rng.randn(*i.shape) for i in inits]

  def fetch(est, vs):
    pairs = [(tf.constant(v), var) for v, var in zip(vec, vs)]
    return ([[tf.identity(f.get_cov()) for f in b.factors()]
             for b in est.blocks],
            [r for r, _ in est.multiply_inverse(pairs)])

  factors, inv = _run(world, tanh_forward, inits, x, ["kron", "kron"], fetch,
                      damping=damping)
  inputs = [x.reshape(N * T, D),
            np.tanh(np.einsum(PROJ, x, inits[0]) + inits[1]).reshape(
                N * T, H * K)]
  for (a, g), layer_in, inv_w, inv_b, w, b in zip(
      factors, inputs, inv[0::2], inv[1::2], vec[0::2], vec[1::2]):
    ones = np.concatenate([layer_in, np.ones((N * T, 1))], axis=1)
    np.testing.assert_allclose(a, ones.T @ ones / (N * T), **TOL)
    dense = T * ref.pi_damped_kron(a, g, damping / T)
    want = np.linalg.solve(dense, np.concatenate([w.ravel(), b.ravel()]))
    assert inv_w.shape == w.shape and inv_b.shape == b.shape
    np.testing.assert_allclose(
        np.concatenate([inv_w.ravel(), inv_b.ravel()]), want,
        rtol=1e-8, atol=1e-11)


@pytest.mark.parametrize("world", ref.WORLDS)
def test_kron_reduce_and_diagonal_are_exact_where_they_should_be(world):
  """KFAC-reduce on the projection followed by a mean over positions, and
  the output projection on [N, H, K] inputs with no positions: exact GGN
  blocks; the diagonal approximation: the exact diagonal (tanh network)."""
  inits = _inits(5)
  x, _ = _data(6)
  blocks = _run(world, reduce_forward, inits, x, ["kron_reduce", "kron"],
                _blocks)
  exact = _exact_ggn(reduce_forward, inits, x)
  for block, sl in zip(blocks, _slices()):
    np.testing.assert_allclose(block, exact[sl, sl], **TOL)
  blocks = _run(world, tanh_forward, inits, x, ["diagonal", "diagonal"],
                _blocks)
  exact = _exact_ggn(tanh_forward, inits, x)
  for block, sl in zip(blocks, _slices()):
    np.testing.assert_allclose(np.diag(block), np.diag(exact[sl, sl]), **TOL)


@pytest.mark.parametrize("approx", ["kron", "kron_in_diag", "kron_out_diag",
                                    "diagonal", "kron_reduce", "ekfac",
                                    "ekfac_reduce"])
def test_every_approximation_equals_the_flattened_dense_layer(approx):
  """The einsum weights give what the same network with 2-d weights gives
  (the dense layer the reshape stands for), for every dense approximation:
  the inverse applied to a vector, reshaped."""
  inits = _inits(7)
  x, rng = _data(8)
  vec = [rng.randn(*i.shape) for i in inits]

  def fetch(vectors):
    def run(est, vs):
      pairs = [(tf.constant(v), var) for v, var in zip(vectors, vs)]
      return [r for r, _ in est.multiply_inverse(pairs)]
    return run

  got = _run("graph", attention_forward, inits, x, [approx, approx],
             fetch(vec), mode="exact", act=tf.tanh)
  want = _run("graph", flat_forward, _flat_inits(inits), x, [approx, approx],
              fetch(_flat_inits(vec)), mode="exact", act=tf.tanh)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g.ravel(), w.ravel(), rtol=1e-10, atol=1e-13)


def test_bad_shapes_name_the_weight():
  with tf.Graph().as_default():
    w = tf.Variable(np.ones((D, H, K)), name="proj_kernel")
    b = tf.Variable(np.ones((H, K)), name="proj_bias")
    x = tf.constant(np.ones((N, T, D)))
    y = tf.einsum(PROJ, x, w) + b
    lc = kfac.LayerCollection()
    for bad in (0, 2.0, True, "2"):
      with pytest.raises(ValueError, match="output_axes.*proj_kernel"):
        lc.register_fully_connected((w, b), x, y, output_axes=bad)
    with pytest.raises(ValueError, match="proj_kernel.*rank"):
      lc.register_fully_connected(w, x, y, output_axes=3)
    with pytest.raises(ValueError, match="Outputs.*proj_kernel"):
      lc.register_fully_connected((w, b), x, tf.reshape(y, [N, T, H * K]),
                                  output_axes=2)
    with pytest.raises(ValueError, match="Inputs.*proj_kernel"):
      lc.register_fully_connected((w, b), x[..., :2], y, output_axes=2)
    b_bad = tf.Variable(np.ones((H * K, 1)), name="bad_bias")
    with pytest.raises(ValueError, match="bad_bias.*proj_kernel"):
      lc.register_fully_connected((w, b_bad), x, y, output_axes=2)
    with pytest.raises(ValueError, match="output_axes.*embedding"):
      lc.register_fully_connected(w, x, y, output_axes=2,
                                  dense_inputs=False)
    lc.register_fully_connected(w, x, tf.einsum(PROJ, x, w), output_axes=2)
    x2 = tf.constant(np.ones((N, D, H)))
    with pytest.raises(ValueError, match="same number of output axes"):
      lc.register_fully_connected(w, x2, tf.einsum("ndh,dhk->nk", x2, w),
                                  output_axes=1, reuse=True)


def test_which_einsum_equations_are_dense_maps():
  from kfac.python.keras import einsum_equation  # pylint: disable=g-import-not-at-top
  axes = einsum_equation.dense_axes
  assert axes("abc,cde->abde") == (1, 2)     # query / key / value
  assert axes("abcd,cde->abe") == (2, 1)     # attention output
  assert axes("ab,bc->ac") == (1, 1)
  assert axes("...b,bc->...c") == (1, 1)
  assert axes("...bc,bcd->...d") == (2, 1)
  assert axes("bcd,cde->be") == (2, 1)
  assert axes("abc,bcd->ad") == (2, 1)     # [N, T, D] flattened: a dense map
  for not_dense in ("abc,dc->abd",      # kernel axes [out, in]
                    "abc,cd->abdc",     # output keeps the contracted axis
                    "ab,bc->ca",        # output axes before shared ones
                    "abc,cd->bd",       # the batch axis dropped
                    "ab,ab->ab", "ab,bc", "a,b,c->d", None, "ab,bc->...c"):
    assert axes(not_dense) is None, not_dense
  bias = einsum_equation.bias_is_dense
  assert bias("abc,cde->abde", "de", (2, 3), (4, 2, 3))
  assert not bias("abc,cde->abde", "e", (3,), (4, 2, 3))


def test_keras_einsum_dense_plans():
  """Dense maps plan as "dense"; others keep the generic fallback, with
  the reason."""
  from kfac.python.keras import keras_flavor  # pylint: disable=g-import-not-at-top
  from kfac.python.keras import layer_registration  # pylint: disable=g-import-not-at-top
  keras = keras_flavor.keras_module()
  cases = [("abc,cde->abde", (None, 2, 3), "de", "dense", None),
           ("abcd,cde->abe", (None, 4), "e", "dense", None),
           ("abc,cde->abde", (None, 2, 3), "e", "generic", "bias axes"),
           ("abc,cd->abdc", (None, 4, 3), None, "generic", "dense map")]
  for equation, out_shape, bias_axes, kind, reason in cases:
    layer = keras.layers.EinsumDense(equation, output_shape=out_shape,
                                     bias_axes=bias_axes)
    layer.build((2, 3, 3) if equation.startswith("abc,") else (2, 3, 2, 2))
    plan = layer_registration.plan_layer(layer)
    assert plan.kind == kind, (equation, plan)
    if reason:
      assert reason in plan.reason, plan.reason
