"""GroupNormalization's scale-and-shift block against a brute-force Fisher.

Model: x -> dense -> reshape [N, 2, 2, 4] -> group normalisation (2 groups
of 2 channels, moments per example over a group's channels and the spatial
axes) -> * gamma + beta -> tanh -> flatten -> dense -> softmax. The
registered inputs are kfac.keras's recomputation of the normalised inputs
(`normalized_inputs.group_normalized`, what the Keras registration of a
GroupNormalization layer registers); the model's own forward pass and the
reference are written here by hand, and checked to be the Keras layer's
outputs (1e-12). In the "exact" mode the full block equals the exact Fisher
block of (gamma, beta), (1/N) sum_n J_n^T F_n J_n from per-example tape
Jacobians (reference.py), and its damped products the dense solve / product;
the diagonal block is its diagonal. Float64; rtol 1e-9, atol 1e-12 for the
blocks, rtol 1e-8 for products through inverses; in a TF1 Session graph and
in a tf.function.
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.keras import keras_flavor
from kfac.python.keras import normalized_inputs
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref

TOL = dict(rtol=1e-9, atol=1e-12)
INV_TOL = dict(rtol=1e-8, atol=1e-11)
N, D_IN, CLASSES = 5, 3, 3
SHAPE = (2, 2, 4)   # per example: H, W, C
GROUPS, EPS = 2, 1e-3


def _inits(seed=0):
  rng = np.random.RandomState(seed)
  size = int(np.prod(SHAPE))
  return [0.8 * rng.randn(D_IN, size), 1.0 + 0.3 * rng.randn(SHAPE[-1]),
          0.2 * rng.randn(SHAPE[-1]), 0.6 * rng.randn(size, CLASSES)]


def _group_norm(h):
  """By hand: [N, H, W, G, C/G], moments over H, W and C/G."""
  grouped = tf.reshape(h, [-1, SHAPE[0], SHAPE[1], GROUPS,
                           SHAPE[2] // GROUPS])
  mean = tf.reduce_mean(grouped, axis=[1, 2, 4], keepdims=True)
  var = tf.reduce_mean(tf.square(grouped - mean), axis=[1, 2, 4],
                       keepdims=True)
  return tf.reshape((grouped - mean) / tf.sqrt(var + EPS), [-1] + list(SHAPE))


def _forward(vs, x, record=None):
  w1, gamma, beta, w2 = vs
  h = tf.reshape(tf.matmul(x, w1), [-1] + list(SHAPE))
  y = _group_norm(h) * gamma + beta
  logits = tf.matmul(tf.reshape(tf.tanh(y), [-1, int(np.prod(SHAPE))]), w2)
  if record is not None:
    record.update(h=h, y=y, logits=logits)
  return logits


def _data(seed):
  rng = np.random.RandomState(seed)
  return rng.randn(N, D_IN), rng.randint(0, CLASSES, N)


def _exact_block(inits, x):
  jacs = ref.per_example_jacobians(_forward, inits, x)
  logits = ref.outputs(_forward, inits, x)
  fisher = ref.curvature(jacs, [ref.categorical_fisher(z) for z in logits])
  start = inits[0].size
  stop = start + inits[1].size + inits[2].size
  return fisher[start:stop, start:stop]


def test_hand_written_group_norm_is_the_keras_layer():
  keras = keras_flavor.keras_module()
  inits = _inits(1)
  h = np.random.RandomState(2).randn(N, *SHAPE)
  layer = keras.layers.GroupNormalization(groups=GROUPS, epsilon=EPS,
                                          dtype="float64")
  layer.build((None,) + SHAPE)
  layer.gamma.assign(inits[1])
  layer.beta.assign(inits[2])
  keras_out = np.asarray(layer(h))
  by_hand = (_group_norm(tf.constant(h)) * inits[1] + inits[2]).numpy()
  recomputed = normalized_inputs.group_normalized(tf.constant(h), GROUPS,
                                                  EPS).numpy()
  np.testing.assert_allclose(keras_out, by_hand, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(recomputed * inits[1] + inits[2], keras_out,
                             rtol=1e-12, atol=1e-12)
  # Not layer normalisation: the groups matter.
  one_group = normalized_inputs.group_normalized(tf.constant(h), 1, EPS)
  assert np.abs(one_group.numpy() - recomputed).max() > 1e-2


@pytest.mark.parametrize("world", ref.WORLDS)
@pytest.mark.parametrize("approx", ["full", "diagonal"])
def test_group_norm_block_is_the_exact_fisher_block(world, approx):
  inits = _inits(3)
  x, labels = _data(4)
  damping = 0.03
  rng = np.random.RandomState(5)
  vec = [rng.randn(*inits[1].shape), rng.randn(*inits[2].shape)]
  store = util.new_store()

  def build(vs):
    lc = kfac.LayerCollection()
    rec = {}
    logits = _forward(vs, tf.constant(x), rec)
    normalized = tf.stop_gradient(normalized_inputs.group_normalized(
        rec["h"], GROUPS, EPS))
    block = lc.register_scale_and_shift((vs[1], vs[2]), normalized, rec["y"],
                                        approx=approx)
    lc.register_softmax_cross_entropy_loss(logits,
                                           targets=tf.constant(labels))
    _, ops = util.estimator_stages(store, lc, [vs[1], vs[2]], "exact",
                                   damping=damping)
    v = tuple(tf.constant(p) for p in vec)
    return ops + [{"block": block.full_fisher_block(),
                   "inv": block.multiply_inverse(v),
                   "type": tf.constant(type(block).__name__)}]

  out = ref.run_stages(world, inits, build)[-1]
  exact = _exact_block(inits, x)
  off_diagonal = exact - np.diag(np.diag(exact))
  assert np.abs(off_diagonal).max() > 1e-3   # a full block is not diagonal
  v = ref.flat(vec)
  if approx == "full":
    assert out["type"] == b"ScaleAndShiftFullFB"
    np.testing.assert_allclose(out["block"], exact, **TOL)
    damped = exact + damping * np.eye(len(exact))
    np.testing.assert_allclose(ref.flat(out["inv"]),
                               np.linalg.solve(damped, v), **INV_TOL)
  else:
    assert out["type"] == b"ScaleAndShiftDiagonalFB"
    np.testing.assert_allclose(out["block"], np.diag(np.diag(exact)), **TOL)
    np.testing.assert_allclose(ref.flat(out["inv"]),
                               v / (np.diag(exact) + damping), **INV_TOL)
