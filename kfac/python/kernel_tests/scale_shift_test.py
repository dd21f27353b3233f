"""Scale-and-shift blocks against the exact Fisher from per-example Jacobians.

Model: x -> dense -> reshape -> normalise (layer-norm-like, no parameters)
-> * scale + shift -> flatten -> dense -> softmax, in two layouts: sequence
[N, T, D] with parameters [D], and image [N, H, W, C] with parameters [C],
[1, 1, C], [H, W, C] (and a shift of another shape, [W, 1]). In the "exact"
mode the full block is the exact Fisher block of (scale, shift) over the
batch, (1/N) sum_n J_n^T F_n J_n from tape Jacobians (reference.py), and
the diagonal block its diagonal. Float64; identities to rtol 1e-9, atol
1e-12; products through inverses to rtol 1e-8.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref

WORLDS = ref.WORLDS
TOL = dict(rtol=1e-9, atol=1e-12)
INV_TOL = dict(rtol=1e-8, atol=1e-11)
N, D_IN, CLASSES = 5, 3, 3
LAYOUTS = {"seq": (2, 3), "image": (2, 2, 3)}  # per-example shapes
CASES = [("seq", (3,), (3,)), ("image", (3,), (3,)),
         ("image", (1, 1, 3), None), ("image", (2, 2, 3), (2, 1))]


def _inits(layout, scale_shape, shift_shape, seed=0):
  rng = np.random.RandomState(seed)
  size = int(np.prod(LAYOUTS[layout]))
  out = [0.8 * rng.randn(D_IN, size), 1.0 + 0.3 * rng.randn(*scale_shape)]
  if shift_shape is not None:
    out.append(0.2 * rng.randn(*shift_shape))
  out.append(0.6 * rng.randn(size, CLASSES))
  return out


def _forward(layout, vs, x, record=None):
  w1, scale = vs[0], vs[1]
  shift = vs[2] if len(vs) == 4 else None
  w2 = vs[-1]
  shape = LAYOUTS[layout]
  h = tf.reshape(tf.matmul(x, w1), [-1] + list(shape))
  axes = [-1] if layout == "seq" else [1, 2]  # layer norm / instance norm
  mean = tf.reduce_mean(h, axis=axes, keepdims=True)
  var = tf.reduce_mean(tf.square(h - mean), axis=axes, keepdims=True)
  z = (h - mean) / tf.sqrt(var + 0.1)
  y = z * scale + (0.0 if shift is None else shift)
  logits = tf.matmul(tf.reshape(tf.tanh(y), [-1, int(np.prod(shape))]), w2)
  if record is not None:
    record.update(x=x, h=h, z=z, y=y, logits=logits)
  return logits


def _params(vs):
  return (vs[1], vs[2]) if len(vs) == 4 else vs[1]


def _build_model(lc, layout, vs, x, labels, approx=None, dense=True):
  """Registers the model (the dense layers too with `dense`); returns the
  scale-and-shift block and the registered variables."""
  rec = {}
  logits = _forward(layout, vs, tf.constant(x), rec)
  if dense:
    lc.register_fully_connected(vs[0], rec["x"],
                                tf.reshape(rec["h"], [tf.shape(x)[0], -1]))
  block = lc.register_scale_and_shift(_params(vs), rec["z"], rec["y"],
                                      approx=approx)
  if dense:
    lc.register_fully_connected(
        vs[-1], tf.reshape(tf.tanh(rec["y"]), [tf.shape(x)[0], -1]), logits)
  lc.register_softmax_cross_entropy_loss(logits, targets=tf.constant(labels))
  return block, (vs if dense else vs[1:-1])


def _data(seed):
  rng = np.random.RandomState(seed)
  return rng.randn(N, D_IN), rng.randint(0, CLASSES, N)


_EXACT = {}


def _exact_block(layout, inits, x):
  """The exact Fisher block of (scale, shift), cached per model (both
  worlds compare with the same numbers)."""
  key = (layout, tuple(np.asarray(a).tobytes() for a in inits), x.tobytes())
  if key not in _EXACT:
    _EXACT[key] = _compute_exact_block(layout, inits, x)
  return _EXACT[key]


def _compute_exact_block(layout, inits, x):
  jacs = ref.per_example_jacobians(lambda vs, xx: _forward(layout, vs, xx),
                                   inits, x)
  logits = ref.outputs(lambda vs, xx: _forward(layout, vs, xx), inits, x)
  fisher = ref.curvature(jacs, [ref.categorical_fisher(z) for z in logits])
  start = inits[0].size
  stop = start + sum(p.size for p in inits[1:-1])
  return fisher[start:stop, start:stop]


def _vector(inits, seed):
  rng = np.random.RandomState(seed)
  return [rng.randn(*p.shape) for p in inits[1:-1]]


def _as_vec(parts):
  return tuple(tf.constant(p) for p in parts) if len(parts) == 2 else (
      tf.constant(parts[0]))


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "%s-%s-%s" % c)
def test_full_equals_exact_fisher_block_and_its_damped_products(world, case):
  layout, scale_shape, shift_shape = case
  inits = _inits(layout, scale_shape, shift_shape, seed=1)
  x, labels = _data(2)
  damping = 0.03
  vec = _vector(inits, 3)
  store = util.new_store()

  def build(vs):
    lc = kfac.LayerCollection()
    block, registered = _build_model(lc, layout, vs, x, labels, dense=False)
    _, ops = util.estimator_stages(store, lc, registered, "exact",
                                   damping=damping, exps=(-1, -0.5),
                                   compute_cholesky=True)
    v = _as_vec(vec)
    fetch = {"full": block.full_fisher_block(),
             "inv": block.multiply_inverse(v), "mult": block.multiply(v),
             "pow": block.multiply_matpower(v, -0.5),
             "chol_t": block.multiply_cholesky(v, transpose=True),
             "type": tf.constant(type(block).__name__)}
    return ops + [fetch]

  out = ref.run_stages(world, inits, build)[-1]
  assert out["type"] == b"ScaleAndShiftFullFB"
  exact = _exact_block(layout, inits, x)
  assert np.abs(exact - np.diag(np.diag(exact))).max() > 1e-3  # not diagonal
  np.testing.assert_allclose(out["full"], exact, **TOL)
  damped = exact + damping * np.eye(len(exact))
  v = ref.flat(vec)
  np.testing.assert_allclose(ref.flat(out["inv"]), np.linalg.solve(damped, v),
                             **INV_TOL)
  np.testing.assert_allclose(ref.flat(out["mult"]), damped @ v, **INV_TOL)
  np.testing.assert_allclose(ref.flat(out["pow"]),
                             ref.sym_matpower(damped, -0.5) @ v, **INV_TOL)
  np.testing.assert_allclose(ref.flat(out["chol_t"]),
                             np.linalg.cholesky(damped).T @ v, **INV_TOL)


def _per_channel_mask(inits):
  """1 where the exact block's entry is kept by the per-channel
  approximation: (scale_i, scale_i), (scale_i, shift_i), (shift_i,
  shift_i), ... (the order concat(scale.flatten(), shift.flatten()))."""
  m = inits[1].size
  k = len(inits) - 2
  return np.kron(np.ones((k, k)), np.eye(m))


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: "%s-%s-%s" % c)
def test_per_channel_equals_exact_channel_blocks(world, case):
  """"per_channel": the [2, 2] blocks of the exact Fisher block pairing
  scale_i with shift_i (1x1 without a shift), the rest zero; its damped
  inverse, power, product and Cholesky products are those of that
  block-diagonal matrix (1e-8)."""
  layout, scale_shape, shift_shape = case
  inits = _inits(layout, scale_shape, shift_shape, seed=7)
  x, labels = _data(8)
  damping = 0.05
  vec = _vector(inits, 9)
  store = util.new_store()

  def build(vs):
    lc = kfac.LayerCollection()
    block, registered = _build_model(lc, layout, vs, x, labels,
                                     approx="per_channel")
    _, ops = util.estimator_stages(store, lc, registered, "exact",
                                   damping=damping, exps=(-1, -0.5),
                                   compute_cholesky=True)
    v = _as_vec(vec)
    fetch = {"full": block.full_fisher_block(),
             "inv": block.multiply_inverse(v), "mult": block.multiply(v),
             "pow": block.multiply_matpower(v, -0.5),
             "chol": block.multiply_cholesky(v),
             "chol_t": block.multiply_cholesky(v, transpose=True),
             "type": tf.constant(type(block).__name__)}
    return ops + [fetch]

  out = ref.run_stages(world, inits, build)[-1]
  assert out["type"] == b"ScaleAndShiftPerChannelFB"
  exact = _exact_block(layout, inits, x)
  kept = exact * _per_channel_mask(inits)
  if shift_shape is not None:  # the pairs are coupled, and so are channels
    assert np.abs(kept - np.diag(np.diag(kept))).max() > 1e-3
  assert np.abs(exact - kept).max() > 1e-3
  np.testing.assert_allclose(out["full"], kept, **TOL)
  damped = kept + damping * np.eye(len(kept))
  v = ref.flat(vec)
  chol = np.linalg.cholesky(damped)
  np.testing.assert_allclose(ref.flat(out["inv"]), np.linalg.solve(damped, v),
                             **INV_TOL)
  np.testing.assert_allclose(ref.flat(out["mult"]), damped @ v, **INV_TOL)
  np.testing.assert_allclose(ref.flat(out["pow"]),
                             ref.sym_matpower(damped, -0.5) @ v, **INV_TOL)
  np.testing.assert_allclose(ref.flat(out["chol"]), chol @ v, **INV_TOL)
  np.testing.assert_allclose(ref.flat(out["chol_t"]), chol.T @ v, **INV_TOL)


def test_per_channel_needs_scale_and_shift_of_one_shape():
  with tf.Graph().as_default():
    scale = tf.Variable(np.ones((2, 2, 3)), name="bn_scale")
    shift = tf.Variable(np.zeros((2, 1)), name="bn_shift")
    z = tf.ones([4, 2, 2, 3], tf.float64)
    lc = kfac.LayerCollection()
    with pytest.raises(ValueError, match="bn_scale.*bn_shift"):
      lc.register_scale_and_shift((scale, shift), z, z * scale + shift,
                                  approx="per_channel")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", [CASES[0], CASES[3]],
                         ids=lambda c: "%s-%s-%s" % c)
def test_diagonal_equals_exact_diagonal(world, case):
  layout, scale_shape, shift_shape = case
  inits = _inits(layout, scale_shape, shift_shape, seed=4)
  x, labels = _data(5)
  damping = 0.02
  vec = _vector(inits, 6)
  store = util.new_store()

  def build(vs):
    lc = kfac.LayerCollection()
    lc.set_default_scale_and_shift_approximation("diagonal")
    assert lc.default_scale_and_shift_approximation == "diagonal"
    block, registered = _build_model(lc, layout, vs, x, labels)
    _, ops = util.estimator_stages(store, lc, registered, "exact",
                                   damping=damping)
    return ops + [(block.full_fisher_block(),
                   block.multiply_inverse(_as_vec(vec)),
                   tf.constant(type(block).__name__))]

  block, inv, name = ref.run_stages(world, inits, build)[-1]
  assert name == b"ScaleAndShiftDiagonalFB"
  exact = np.diag(_exact_block(layout, inits, x))
  np.testing.assert_allclose(np.diag(block), exact, **TOL)
  assert np.count_nonzero(block - np.diag(np.diag(block))) == 0
  np.testing.assert_allclose(ref.flat(inv), ref.flat(vec) / (exact + damping),
                             **INV_TOL)


def test_towers_concatenate_like_one_batch():
  layout, scale_shape, shift_shape = CASES[1]
  inits = _inits(layout, scale_shape, shift_shape, seed=7)
  x, labels = _data(8)
  store = util.new_store()

  def build_towers(vs):
    lc = kfac.LayerCollection()
    blocks = []
    for half, reuse in ((slice(0, 2), False), (slice(2, N), True)):
      rec = {}
      logits = _forward(layout, vs, tf.constant(x[half]), rec)
      blocks.append(lc.register_scale_and_shift(
          _params(vs), rec["z"], rec["y"], reuse=reuse))
      lc.register_softmax_cross_entropy_loss(
          logits, targets=tf.constant(labels[half]), name="xent", reuse=reuse)
    assert blocks[0] is blocks[1] and blocks[0].num_registered_towers == 2
    est, ops = util.estimator_stages(store, lc, [vs[1], vs[2]], "exact")
    return ops + [est.blocks[0].full_fisher_block()]

  got = ref.run_stages("graph", inits, build_towers)[-1]
  np.testing.assert_allclose(got, _exact_block(layout, inits, x), **TOL)


@pytest.mark.parametrize("case,pattern", [
    ("scale_size", "does not broadcast against inputs"),
    ("shift_size", "shift my_shift\\w* of shape"),
    ("scale_rank", "does not broadcast over the batch"),
    ("per_example", "needs a leading 1"),
    ("outputs", "must have the inputs' shape"),
    ("dtype", "has dtype float32"),
    ("approx", "Unknown approximation 'kron'"),
    ("three", "scale or \\(scale, shift\\)"),
])
def test_bad_registrations_name_the_variable(case, pattern):
  with tf.Graph().as_default():
    z = tf.constant(np.random.RandomState(0).randn(4, 2, 2, 3))
    scale = tf.Variable(np.ones(3), name="my_scale")
    shift = tf.Variable(np.zeros(3), name="my_shift")
    args = dict(params=(scale, shift), inputs=z, outputs=z * scale + shift)
    if case == "scale_size":
      args["params"] = (tf.Variable(np.ones(2), name="my_scale"), shift)
    elif case == "shift_size":
      args["params"] = (scale, tf.Variable(np.zeros((3, 3)), name="my_shift"))
    elif case == "scale_rank":
      args["params"] = tf.Variable(np.ones((1, 1, 2, 2, 3)), name="my_scale")
    elif case == "per_example":
      args["params"] = tf.Variable(np.ones((4, 2, 2, 3)), name="my_scale")
    elif case == "outputs":
      args["outputs"] = args["outputs"][:, :1]
    elif case == "dtype":
      args["params"] = tf.Variable(np.ones(3, np.float32), name="my_scale")
    elif case == "approx":
      args["approx"] = "kron"
    elif case == "three":
      args["params"] = (scale, shift, tf.Variable(np.ones(3), name="my_x"))
    lc = kfac.LayerCollection()
    with pytest.raises(ValueError, match=pattern) as err:
      lc.register_scale_and_shift(**args)
    assert re.search("my_scale|my_shift", str(err.value))


def test_default_approximation_setter_and_broadcast_shapes_accepted():
  with tf.Graph().as_default():
    lc = kfac.LayerCollection()
    assert lc.default_scale_and_shift_approximation == "full"
    with pytest.raises(ValueError, match="Unknown scale_and_shift"):
      lc.set_default_scale_and_shift_approximation("kron")
    z = tf.compat.v1.placeholder(tf.float64, [None, None, None, 3])
    for i, shape in enumerate([(3,), (1, 1, 3), (1, 3), (), (1, 1, 1, 3)]):
      scale = tf.Variable(np.ones(shape), name="s%d" % i)
      block = lc.register_scale_and_shift(scale, z, z * scale)
      assert type(block).__name__ == "ScaleAndShiftFullFB"
    with pytest.raises(ValueError, match="leading 1"):
      scale = tf.Variable(np.ones((2, 1, 1, 3)), name="bad")
      lc.register_scale_and_shift(scale, z, z * scale)
