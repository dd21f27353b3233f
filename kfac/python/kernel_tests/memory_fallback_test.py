"""over_budget="fallback" (collection/memory_fallback.py): the layers that
do not fit are trained exactly as if registered with the cheaper
approximation by hand, and the state allocated is the predicted one."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.ops.collection import memory
from kfac.python.kernel_tests import reference as ref


@pytest.fixture(autouse=True)
def state_only_budget(monkeypatch):
  """These tests pin the budget's accounting of the state; the working
  memory of inversions (memory.working_bytes) is tested on its own in
  memory_test.py."""
  monkeypatch.setattr(memory, "WORKING_BYTES_PER_ENTRY", 0)


# The tf.function run repeats the TF1 run's math at a higher tracing cost.
WORLDS = ref.WORLDS_TF2_SLOW
# A wide dense layer: A is 41 x 41 (with the bias), 6.6 KiB in float32 (and
# as much for its inverse); the conv layer's A is 18 x 18.
D_IN, D_HID, STEPS = 40, 3, 3


def _inits():
  rng = np.random.RandomState(0)
  shapes = [[D_IN, D_HID], [D_HID], [3, 3, 2, 2], [D_HID + 2, 2]]
  return [(rng.randn(*s) * 0.3).astype(np.float32) for s in shapes]


def _data():
  rng = np.random.RandomState(1)
  return (rng.randn(8, D_IN).astype(np.float32),
          rng.randn(8, 5, 5, 2).astype(np.float32),
          rng.randint(0, 2, size=8))


def _model(vs, lc, approx_dense=None, approx_conv=None, approx_last=None):
  w1, b1, k, w2 = vs
  x, img, labels = (tf.constant(a) for a in _data())
  pre = tf.matmul(x, w1) + b1
  lc.register_fully_connected((w1, b1), x, pre, approx=approx_dense)
  conv = tf.nn.conv2d(img, k, strides=1, padding="VALID")
  lc.register_conv2d(k, 1, "VALID", img, conv, approx=approx_conv)
  h = tf.concat([tf.tanh(pre), tf.reduce_mean(conv, [1, 2])], axis=1)
  logits = tf.matmul(h, w2)
  lc.register_fully_connected(w2, h, logits, approx=approx_last)
  lc.register_softmax_cross_entropy_loss(logits)
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))


def _opt(lc=None, **kwargs):
  return kfac.PeriodicInvCovUpdateKfacOpt(
      invert_every=1, learning_rate=0.1, damping=0.05, momentum=0.5,
      layer_collection=lc, estimation_mode="exact", **kwargs)


def _factor_bytes(opt, lc):
  names = [f.name + "/" for f in lc.get_factors()]
  return sum(int(np.prod(v.shape)) * v.dtype.size
             for key, v in opt._store.variables_by_name.items()
             if any(key.startswith(n) for n in names))


def _train(world, model_kwargs=None, **opt_kwargs):
  """(losses, final weights, layer collection, allocated factor bytes)."""
  model_kwargs = model_kwargs or {}
  if world == "graph":
    with tf.Graph().as_default():
      vs = [tf.Variable(v) for v in _inits()]
      lc = kfac.LayerCollection()
      loss = _model(vs, lc, **model_kwargs)
      opt = _opt(lc, **opt_kwargs)
      train_op = opt.minimize(loss, var_list=vs)
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        losses = [sess.run([loss, train_op])[0] for _ in range(STEPS)]
        return losses, sess.run(vs), lc, _factor_bytes(opt, lc)
  vs = [tf.Variable(v) for v in _inits()]
  opt = _opt(**opt_kwargs)
  seen = {}

  @tf.function
  def step():
    lc = kfac.LayerCollection()
    loss = _model(vs, lc, **model_kwargs)
    opt.minimize(loss, var_list=vs, layer_collection=lc)
    seen["lc"] = lc
    return loss

  losses = [step().numpy() for _ in range(STEPS)]
  return losses, [v.numpy() for v in vs], seen["lc"], _factor_bytes(
      opt, seen["lc"])


@pytest.mark.parametrize("world", WORLDS)
def test_fallback_trains_as_the_cheaper_registration(world):
  _, _, full_lc, full_bytes = _train(world, memory_budget=None)
  # The budget leaves room for everything but the wide layer's A (and its
  # inverse), so only that layer falls back, to a diagonal A.
  budget = full_bytes - 2 * 41 * 41 * 4 + 2 * 41 * 4 + 100
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    losses, weights, lc, allocated = _train(
        world, memory_budget=budget, over_budget="fallback")
  ref_losses, ref_weights, ref_lc, ref_bytes = _train(
      world, dict(approx_dense="kron_in_diag"), memory_budget=None)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, atol=0)
  for got, want in zip(weights, ref_weights):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  assert losses[-1] < losses[0]
  assert allocated == ref_bytes == lc.memory_usage()[1]
  assert allocated <= budget < full_bytes
  (fallback,) = lc.memory_fallbacks
  assert (fallback.old, fallback.new) == ("kron", "kron_in_diag")
  assert fallback.old_bytes == (2 * 41 * 41 + 2 * 9 + 2) * 4
  assert fallback.new_bytes == (41 + 1 + 2 * 9 + 1) * 4
  assert full_lc.memory_fallbacks == [] and ref_lc.memory_fallbacks == []
  messages = [str(w.message) for w in caught]
  assert any("registered with kron_in_diag instead of kron" in m
             for m in messages), messages


def test_fallback_reaches_the_conv_layer_and_both_sides():
  # In floats: dense w1 kron 2*41*41 + 2*3*3 + 2 = 3382, conv k kron
  # 2*18*18 + 2*2*2 + 2 = 658, last layer w2 (5 -> 2) 2*25 + 2*4 + 2 = 60.
  # Largest first, one side: w1 -> kron_in_diag (41 + 1 + 18 + 1 = 61),
  # k -> diagonal (36 + 1 = 37), w2 -> kron_in_diag (5 + 1 + 8 + 1 = 15):
  # 113 floats = 452 B; then both sides: w1 -> kron_both_diag (41 + 1 + 3
  # + 1 = 46): 392 B; w2 -> kron_both_diag (5 + 1 + 2 + 1 = 9): 368 B.
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with pytest.raises(ValueError, match=r"\(368 bytes\), over the memory "
                       "budget of 300 B"):
      _train("graph", memory_budget=300, over_budget="fallback")
    losses, weights, lc, allocated = _train(
        "graph", memory_budget=400, over_budget="fallback")
  assert [(f.old, f.new) for f in lc.memory_fallbacks] == [
      ("kron", "kron_both_diag"), ("kron", "diagonal"),
      ("kron", "kron_in_diag")]
  assert [f.new_bytes for f in lc.memory_fallbacks] == [46 * 4, 37 * 4,
                                                        15 * 4]
  ref_losses, ref_weights, _, ref_bytes = _train(
      "graph", dict(approx_dense="kron_both_diag", approx_conv="diagonal",
                    approx_last="kron_in_diag"), memory_budget=None)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  for got, want in zip(weights, ref_weights):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  assert allocated == ref_bytes == 392


def test_bad_over_budget_is_named():
  with pytest.raises(ValueError, match="over_budget"):
    _opt(over_budget="shrink")
