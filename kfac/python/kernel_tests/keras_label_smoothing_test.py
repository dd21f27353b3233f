"""Keras losses with label_smoothing under kfac.keras.optimizers.Kfac.

Keras has label_smoothing on CategoricalCrossentropy and BinaryCrossentropy
(SparseCategoricalCrossentropy has none). What is checked (float64 models,
Keras floatx float64; tolerance 1e-12):
* the gradient K-FAC preconditions (the one the core optimizer's update is
  computed from, captured in the step) equals tf.GradientTape's gradient
  of the compiled smoothed loss, and differs from the unsmoothed one;
* the curvature statistics (exact mode) equal those of the unsmoothed loss
  (the Fisher of a softmax / sigmoid output does not depend on the
  targets);
* adaptive=True: the damping rule's loss before the update is the smoothed
  loss of the batch;
* estimation_mode="empirical": the registered loss's targets are the
  smoothed ones, so the empirical Fisher is that of the smoothed loss (its
  statistics equal the brute-force per-example gradients' of Keras's
  smoothed loss);
* a Kfac(loss=...) that differs from the compiled loss only in its
  smoothing is an error; a smoothing outside [0, 1] is an error.
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
import kfac.keras
from kfac.python.kernel_tests import keras_optimizer_test as base
from kfac.python.kernel_tests import kfac_test_util

keras = base.keras
LEGACY = base.LEGACY

N, D_IN, D_H, K = 10, 3, 4, 3
SMOOTHING, TOL = 0.1, 1e-12


@pytest.fixture(autouse=True)
def float64_keras():
  with kfac_test_util.keras_float64(keras):
    yield


def _case(kind, smoothing):
  """(model, loss, x, y) of a tiny softmax or sigmoid model."""
  rng = np.random.RandomState(0)
  x = rng.randn(N, D_IN)
  if kind == "categorical":
    y = np.eye(K)[rng.randint(0, K, size=N)]
    loss = keras.losses.CategoricalCrossentropy(label_smoothing=smoothing)
    activation = "softmax"
  else:
    y = rng.randint(0, 2, size=(N, K)).astype(np.float64)
    loss = keras.losses.BinaryCrossentropy(label_smoothing=smoothing)
    activation = "sigmoid"
  model = keras.Sequential([
      keras.Input((D_IN,)),
      keras.layers.Dense(D_H, activation="tanh", name="hidden"),
      keras.layers.Dense(K, activation=activation, name="out")])
  wrng = np.random.RandomState(1)
  model.set_weights([wrng.randn(*w.shape) * 0.5
                     for w in model.get_weights()])
  return model, loss, x, y


def _spy(opt, model):
  """Variables that receive, in the step, the gradients the core
  optimizer's update is computed from."""
  core = opt.kfac_optimizer
  captured = [tf.Variable(np.zeros(v.shape), dtype=tf.float64)
              for v in model.trainable_variables]
  compute = core._compute_update  # pylint: disable=protected-access

  def spy(grads_and_vars):
    for var, (grad, _) in zip(captured, grads_and_vars):
      var.assign(tf.convert_to_tensor(grad))
    return compute(grads_and_vars)

  core._compute_update = spy  # pylint: disable=protected-access
  return captured


def _tape_gradient(model, loss, x, y):
  with tf.GradientTape() as tape:
    value = loss(y, model(x, training=True))
  return [g.numpy() for g in tape.gradient(value, model.trainable_variables)]


def _one_step(kind, smoothing, **kwargs):
  model, loss, x, y = _case(kind, smoothing)
  options = dict(learning_rate=0.1, damping=0.05, momentum=0.0,
                 invert_every=1, estimation_mode="exact")
  options.update(kwargs)
  opt = kfac.keras.optimizers.Kfac(model=model, **options)
  model.compile(optimizer=opt, loss=loss)
  captured = _spy(opt, model)
  want = _tape_gradient(model, loss, x, y)
  model.fit(x, y, batch_size=N, epochs=1, shuffle=False, verbose=0)
  return model, opt, loss, x, y, [c.numpy() for c in captured], want


def _factors(opt):
  return {k: v for k, v in opt.state_store.numpy_state().items()
          if "/cov" in k or k.endswith("cov")}


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("kind", ["categorical", "binary"])
def test_preconditioned_gradient_is_the_smoothed_one(kind):
  _, opt, _, _, _, got, want = _one_step(kind, SMOOTHING)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=0, atol=TOL)
  _, plain_opt, _, _, _, plain, _ = _one_step(kind, 0.0)
  assert max(np.max(np.abs(g - p)) for g, p in zip(got, plain)) > 1e-3
  # The curvature statistics do not depend on the targets.
  factors, plain_factors = _factors(opt), _factors(plain_opt)
  assert factors and sorted(factors) == sorted(plain_factors)
  for key in factors:
    np.testing.assert_allclose(factors[key], plain_factors[key], rtol=0,
                               atol=TOL, err_msg=key)


@pytest.mark.parametrize("kind", ["categorical", "binary"])
def test_damping_rule_evaluates_the_smoothed_loss(kind):
  model, loss, x, y = _case(kind, SMOOTHING)
  want = float(loss(y, model(x, training=True)))
  unsmoothed = float(type(loss)()(y, model(x, training=True)))
  opt = kfac.keras.optimizers.Kfac(
      model=model, damping=0.05, adaptive=True, invert_every=1,
      damping_adaptation_interval=1, estimation_mode="exact")
  model.compile(optimizer=opt, loss=loss)
  model.fit(x, y, batch_size=N, epochs=1, shuffle=False, verbose=0)
  before = opt.state_store.numpy_state()["adaptive/loss_before"]
  assert abs(before - want) < TOL
  assert abs(want - unsmoothed) > 1e-3


def _empirical_factors_of_out(model, loss, x, y):
  """The output layer's statistics (A: inputs with a ones column, G:
  pre-activation gradients) of the empirical Fisher of `loss`, from
  per-example gradients (brute force, float64). Without adaptive=True the
  registered loss is summed over an example's outputs (kfac 0.2.x's
  coefficient, docs/keras.md "Coefficients"): the binary loss, which Keras
  averages over the K outputs, counts K times."""
  hidden = model.get_layer("hidden")
  out = model.get_layer("out")
  a = hidden(x).numpy()
  a1 = np.concatenate([a, np.ones([N, 1])], axis=1)
  pre = tf.constant(a @ out.kernel.numpy() + out.bias.numpy())
  categorical = isinstance(loss, keras.losses.CategoricalCrossentropy)
  # The same Keras loss on the logits (tf_keras adds an epsilon inside the
  # logarithm of probabilities; K-FAC registers the logits, as Keras does
  # behind a softmax / sigmoid output).
  on_logits = type(loss)(from_logits=True,
                         label_smoothing=loss.get_config()["label_smoothing"])
  with tf.GradientTape() as tape:
    tape.watch(pre)
    # Keras's per-example losses of the batch, summed.
    per_example = tf.stack([on_logits(y[i:i + 1], pre[i:i + 1])
                            for i in range(N)])
    total = tf.reduce_sum(per_example) * (1 if categorical else K)
  d = tape.gradient(total, pre).numpy()
  return a1.T @ a1 / N, d.T @ d / N


@pytest.mark.parametrize("kind", ["categorical", "binary"])
def test_empirical_fisher_uses_the_smoothed_targets(kind):
  # learning_rate=0: the weights stay those the statistics were taken at.
  model, opt, loss, x, y, _, _ = _one_step(
      kind, SMOOTHING, estimation_mode="empirical", learning_rate=0.0)
  want_a, want_g = _empirical_factors_of_out(model, loss, x, y)
  state = opt.state_store.numpy_state()
  prefix = "keras/02_Dense/kernel/"  # the output layer
  # After one step the (debiased) moving average is the batch's statistic.
  got_a, got_g = [state[prefix + f + "/cov"] for f in ("A", "G")]
  np.testing.assert_allclose(got_a, want_a, rtol=1e-10, atol=TOL)
  np.testing.assert_allclose(got_g, want_g, rtol=1e-10, atol=TOL)
  _, plain_g = _empirical_factors_of_out(
      model, type(loss)(label_smoothing=0.0), x, y)
  assert np.max(np.abs(got_g - plain_g)) > 1e-3


def test_smoothing_must_agree_and_be_in_range():
  model, loss, _, _ = _case("categorical", SMOOTHING)
  opt = kfac.keras.optimizers.Kfac(
      learning_rate=0.1, damping=0.05, model=model,
      loss=keras.losses.CategoricalCrossentropy())
  model.compile(optimizer=opt, loss=loss)
  x, y = np.zeros([2, D_IN]), np.eye(K)[[0, 1]]
  with pytest.raises(ValueError, match="label_smoothing=0.1.* disagrees|"
                     "disagrees.*label_smoothing=0.1"):
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)
  with pytest.raises(ValueError, match="label_smoothing=1.5"):
    kfac.keras.optimizers.Kfac(
        learning_rate=0.1, damping=0.05,
        loss=keras.losses.CategoricalCrossentropy(label_smoothing=1.5))


@pytest.mark.slow  # subprocess: the file again under tf_keras
def test_tf_keras():
  if LEGACY:
    return  # this is the run under tf_keras
  base.run_file_under_tf_keras(__file__, "not tf_keras")
