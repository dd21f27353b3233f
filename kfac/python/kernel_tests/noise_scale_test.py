"""The gradient noise scale (ops/adaptive/noise_scale.py) and its
measurement in the Keras optimizer.

Checked:
* the two-part estimates of tr(Sigma) and |G|^2, averaged over every split
  of a batch of 6 examples into two parts of 3 (all 20), equal the sample
  covariance's trace (1 / (B - 1) normalisation) and |mean|^2 - tr(S) / B
  computed from the per-example gradients in float64 (1e-12): on the
  gradients TensorFlow takes of a least-squares model, in a tf.function and
  in a TF1 Session graph;
* NoiseScale sums the estimates over the measured steps and reports the
  ratio of the sums (a TF1 Session and eager), ignores non-finite steps,
  and reports NaN before any step and +inf for a non-positive |G|^2 sum;
* NoiseScale measures the first steps, then one in `every`, decaying the
  sums before each later measurement;
* Kfac(adaptive=True) measures exactly its first noise_scale_steps steps of
  `fit` (the recipe's NOISE_SCALE_STEPS by default), then one in
  noise_scale_every (and those at the weights before them, folded in with
  the decay: rtol 1e-5), on the two halves of
  each batch at the step's weights: with one measured step the value equals
  the estimate recomputed from the halves of the first batch at the initial
  weights (rtol 1e-5, float32); the registration report and the logs carry
  it; the measurement leaves the training itself unchanged (the same
  weights as noise_scale_steps=0 after the fit, bit for bit);
* bad noise_scale_steps raise a ValueError that names it;
* the Keras checks again under tf_keras (slow).
"""

import itertools

import numpy as np
import pytest
import tensorflow as tf

import kfac.keras
from kfac.python.kernel_tests import keras_optimizer_test as base
from kfac.python.keras import keras_flavor
from kfac.python.ops.adaptive import noise_scale
from kfac.python.ops.adaptive import recipe
from kfac.python.ops.tensors import state

keras = keras_flavor.keras_module()

B, DIM = 6, 4


def _problem():
  rng = np.random.RandomState(3)
  x = rng.randn(B, DIM)
  y = rng.randn(B)
  w = rng.randn(DIM)
  return x, y, w


def _per_example_grads(x, y, w):
  """Gradients of 0.5 (w.x_i - y_i)^2, one row per example (float64)."""
  return (x @ w - y)[:, None] * x


def _reference(x, y, w):
  """(tr(S), |mean|^2 - tr(S) / B) from the per-example gradients."""
  g = _per_example_grads(x, y, w)
  mean = g.mean(axis=0)
  trace_s = ((g - mean)**2).sum() / (B - 1)
  return trace_s, mean @ mean - trace_s / B


def _splits():
  for first in itertools.combinations(range(B), B // 2):
    second = [i for i in range(B) if i not in first]
    yield list(first), second


def _part_grad(x, y, w_var):
  with tf.GradientTape() as tape:
    loss = tf.reduce_mean(0.5 * tf.square(
        tf.linalg.matvec(x, w_var) - y))
  return tape.gradient(loss, [w_var])


def test_estimates_are_exact_over_all_splits_tf_function():
  x, y, w = _problem()
  w_var = tf.Variable(w)

  @tf.function
  def one(xa, ya, xb, yb):
    return noise_scale.estimates(_part_grad(xa, ya, w_var),
                                 _part_grad(xb, yb, w_var), B // 2)
  traces, inners = [], []
  for a, b in _splits():
    t, g = one(x[a], y[a], x[b], y[b])
    traces.append(float(t))
    inners.append(float(g))
  assert len(traces) == 20
  trace_s, grad_sq = _reference(x, y, w)
  np.testing.assert_allclose(np.mean(traces), trace_s, rtol=1e-12)
  np.testing.assert_allclose(np.mean(inners), grad_sq, rtol=1e-12)


def test_estimates_and_sums_in_a_tf1_session():
  x, y, w = _problem()
  with tf.Graph().as_default():
    w_var = tf.compat.v1.get_variable(
        "w", initializer=tf.constant(w), use_resource=True)
    xa = tf.compat.v1.placeholder(tf.float64, [None, DIM])
    ya = tf.compat.v1.placeholder(tf.float64, [None])
    xb = tf.compat.v1.placeholder(tf.float64, [None, DIM])
    yb = tf.compat.v1.placeholder(tf.float64, [None])
    size = noise_scale.part_size(tf.shape(xa)[0] + tf.shape(xb)[0])
    t, g = noise_scale.estimates(_part_grad(xa, ya, w_var),
                                 _part_grad(xb, yb, w_var), size)
    noise = noise_scale.NoiseScale(state.StateStore(), steps=3)
    add = noise.add(t, g, 2 * size)
    b_simple = noise.b_simple()
    # One first measurement, then decaying ones.
    later = noise_scale.NoiseScale(state.StateStore(), steps=1, every=1,
                                   decay=0.5)
    add_later = later.add(t, g, 2 * size)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      assert np.isnan(sess.run(b_simple))
      splits = list(_splits())
      numbers = []
      for a, b in splits:
        numbers.append(sess.run(
            (t, g), {xa: x[a], ya: y[a], xb: x[b], yb: y[b]}))
      trace_s, grad_sq = _reference(x, y, w)
      np.testing.assert_allclose(np.mean([n[0] for n in numbers]), trace_s,
                                 rtol=1e-12)
      np.testing.assert_allclose(np.mean([n[1] for n in numbers]), grad_sq,
                                 rtol=1e-12)
      # Three steps (three splits) summed, then their ratio.
      for a, b in splits[:3]:
        sess.run([add, add_later], {xa: x[a], ya: y[a], xb: x[b], yb: y[b]})
      expected = (sum(n[0] for n in numbers[:3]) /
                  sum(n[1] for n in numbers[:3]))
      np.testing.assert_allclose(sess.run(b_simple), expected, rtol=1e-12)
      weights = (0.25, 0.5, 1.0)
      expected = (sum(w * n[0] for w, n in zip(weights, numbers)) /
                  sum(w * n[1] for w, n in zip(weights, numbers)))
      np.testing.assert_allclose(sess.run(later.b_simple()), expected,
                                 rtol=1e-12)
      assert sess.run(noise.measured) == 3
      assert sess.run(noise.batch_size) == B


def test_sums_skip_non_finite_steps_and_edge_values():
  noise = noise_scale.NoiseScale(state.StateStore(), steps=5)
  assert bool(noise.measuring())
  assert np.isnan(noise.b_simple().numpy())
  noise.add(2.0, 0.5, 8)
  noise.add(float("nan"), 1.0, 16)   # skipped
  noise.add(1.0, float("inf"), 16)   # skipped
  noise.add(0.0, 0.0, 0)             # skipped: an empty batch
  noise.add(0.0, 0.0, 1)             # skipped: one half empty
  assert noise.measured.numpy() == 1 and noise.batch_size.numpy() == 8
  assert noise.b_simple().numpy() == 4.0
  noise.add(1.0, -0.5, 8)
  assert noise.b_simple().numpy() == np.inf  # no signal above the noise
  for _ in range(3):
    noise.add(1.0, 1.0, 8)
  assert not bool(noise.measuring())


def test_periodic_measurements_decay_the_sums():
  noise = noise_scale.NoiseScale(state.StateStore(), steps=2, every=4,
                                 decay=0.5)
  assert noise.enabled
  # The first 2 measurements, whatever the step; then multiples of 4.
  assert bool(noise.measuring(1)) and bool(noise.measuring(3))
  noise.add(1.0, 1.0, 8)
  noise.add(3.0, 1.0, 8)                    # sums 4, 2
  assert [bool(noise.measuring(k)) for k in (5, 6, 7, 8, 12)] == [
      False, False, False, True, True]
  noise.add(10.0, 2.0, 8)                   # 0.5 * (4, 2) + (10, 2)
  assert noise.b_simple().numpy() == 12.0 / 3.0
  noise.add(float("nan"), 2.0, 8)           # skipped: no decay either
  assert noise.b_simple().numpy() == 12.0 / 3.0
  assert noise.measured.numpy() == 3
  off = noise_scale.NoiseScale(state.StateStore(), steps=0)
  assert not off.enabled
  with pytest.raises(ValueError, match="noise_scale_every"):
    noise_scale.NoiseScale(state.StateStore(), steps=1, every=-2)
  with pytest.raises(ValueError, match="decay"):
    noise_scale.NoiseScale(state.StateStore(), steps=1, decay=1.0)


def test_estimates_need_a_gradient():
  with pytest.raises(ValueError, match="at least one variable"):
    noise_scale.estimates([None], [None], 2)


# ---------------------------------------------------------------- Keras
def _keras_run(steps, batch=32, n=192, callbacks=(), **kwargs):
  keras.utils.set_random_seed(1)
  rng = np.random.RandomState(0)
  x = rng.randn(n, 6).astype("float32")
  y = (x[:, 0] + x[:, 1] > 0).astype("int32") + 2 * (x[:, 2] > 0)
  model = keras.Sequential([keras.Input((6,)),
                            keras.layers.Dense(8, activation="tanh"),
                            keras.layers.Dense(4)])
  initial = [w.copy() for w in model.get_weights()]
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  if steps is not None:
    kwargs["noise_scale_steps"] = steps
  opt = kfac.keras.optimizers.Kfac(model=model, loss=loss, adaptive=True,
                                   **kwargs)
  model.compile(optimizer=opt, loss=loss)
  model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
            callbacks=list(callbacks))
  return model, opt, x, y, initial, loss


def test_keras_measures_the_first_steps_on_the_batch_halves(capfd):
  model, opt, x, y, initial, loss = _keras_run(steps=1)
  assert int(opt._kfac_engine.noise.measured.numpy()) == 1  # pylint: disable=protected-access
  # The same estimate from the first batch's halves at the initial weights.
  model.set_weights(initial)
  grads = []
  for part in (slice(0, 16), slice(16, 32)):
    with tf.GradientTape() as tape:
      part_loss = loss(y[part], model(x[part], training=True))
    grads.append(tape.gradient(part_loss, model.trainable_variables))
  t, g = noise_scale.estimates(grads[0], grads[1], 16)
  np.testing.assert_allclose(float(opt.noise_scale), float(t) / float(g),
                             rtol=1e-5)
  report = opt.registration_report
  assert ("gradient noise scale: B_simple = %.4g at batch size 32 "
          "(1 measurements; measured on the first 1 steps, then one step in "
          "%d)" % (float(opt.noise_scale), recipe.NOISE_SCALE_EVERY)
          in report)
  err = capfd.readouterr().err
  assert "kfac: gradient noise scale B_simple =" in err
  assert "at batch size 32 (measured over 1 steps)" in err


def test_keras_periodic_measurements_at_the_steps_weights():
  """noise_scale_steps=1, noise_scale_every=3 over 7 steps: steps 0, 3 and
  6 are measured, each at the weights before it, on its batch's halves;
  the later two fold into the sums after a decay."""
  seen = {}

  class Weights(keras.callbacks.Callback):

    def on_train_batch_begin(self, batch, logs=None):
      seen[batch] = [w.copy() for w in self.model.get_weights()]

  model, opt, x, y, _, loss = _keras_run(
      steps=1, n=224, noise_scale_every=3, callbacks=[Weights()])
  noise = opt._kfac_engine.noise  # pylint: disable=protected-access
  assert int(noise.measured.numpy()) == 3
  trace_sum = grad_sum = 0.0
  for step in (0, 3, 6):
    model.set_weights(seen[step])
    grads = []
    for part in (slice(32 * step, 32 * step + 16),
                 slice(32 * step + 16, 32 * step + 32)):
      with tf.GradientTape() as tape:
        part_loss = loss(y[part], model(x[part], training=True))
      grads.append(tape.gradient(part_loss, model.trainable_variables))
    t, g = noise_scale.estimates(grads[0], grads[1], 16)
    keep = 1.0 if step == 0 else noise.decay
    trace_sum = keep * trace_sum + float(t)
    grad_sum = keep * grad_sum + float(g)
  np.testing.assert_allclose(float(opt.noise_scale), trace_sum / grad_sum,
                             rtol=1e-5)
  assert ("(3 measurements; measured on the first 1 steps, then one step "
          "in 3)" in opt.registration_report)


def test_keras_defaults_and_no_change_to_training():
  """Off by default with adaptive=True (the exact recipe does not use it);
  asked for with noise_scale_steps alone, one step in NOISE_SCALE_EVERY
  after those; recipe="auto" measures 5, then one in 10. Measuring leaves
  training as it was."""
  off_model, off, _, _, _, _ = _keras_run(steps=None)
  noise = off._kfac_engine.noise  # pylint: disable=protected-access
  assert (noise.steps, noise.every, noise.enabled) == (0, 0, False)
  before = sorted(off.state_store.numpy_state())
  assert np.isnan(float(off.noise_scale))
  # Reading it adds no state (Keras's saving reads every property).
  assert sorted(off.state_store.numpy_state()) == before
  assert not [k for k in before if k.startswith("noise_scale/")]
  assert "gradient noise scale" not in off.registration_report
  assert off.get_config()["noise_scale_steps"] == 0
  assert off.get_config()["noise_scale_every"] == 0
  model, opt, _, _, _, _ = _keras_run(steps=recipe.NOISE_SCALE_STEPS)
  noise = opt._kfac_engine.noise  # pylint: disable=protected-access
  assert noise.every == recipe.NOISE_SCALE_EVERY
  assert int(noise.measured.numpy()) == recipe.NOISE_SCALE_STEPS
  assert np.isfinite(float(opt.noise_scale)) and float(opt.noise_scale) > 0
  for a, b in zip(model.get_weights(), off_model.get_weights()):
    np.testing.assert_array_equal(a, b)
  auto = kfac.keras.optimizers.Kfac(adaptive=True, recipe="auto")
  assert (auto._kfac_engine.noise.steps,  # pylint: disable=protected-access
          auto._kfac_engine.noise.every) == (  # pylint: disable=protected-access
              recipe.NOISE_SCALE_STEPS, recipe.AUTO_NOISE_SCALE_EVERY)


@pytest.mark.parametrize("name", ["noise_scale_steps", "noise_scale_every"])
@pytest.mark.parametrize("steps", [-1, 1.5, True, "5"])
def test_keras_bad_noise_scale_steps(name, steps):
  with pytest.raises(ValueError, match=name):
    kfac.keras.optimizers.Kfac(adaptive=True, **{name: steps})


@pytest.mark.slow  # subprocess: the file again under tf_keras
def test_tf_keras():
  """This file again under tf_keras (TF_USE_LEGACY_KERAS=1)."""
  if keras_flavor.legacy_keras_active():
    return  # this is the run under tf_keras
  base.run_file_under_tf_keras(__file__)
