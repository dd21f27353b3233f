"""The damping rule of kfac.keras.optimizers.Kfac under dropout (Keras 3).

The rule's reduction ratio rho = (L(theta + delta) - L(theta)) /
qmodel_change must judge the update on the function the step optimised:
the loss of the training forward pass, with its dropout masks, whose
gradient and curvature define delta and the predicted change. Checked:

* float64 brute force on a tiny Dense-Dropout-Dense model, in `fit` (also
  with jit_compile=True) and in a custom tf.function loop: with the training pass's mask (taken from a
  call of the Dropout layer with the seed state it had before the step),
  the gradient, the exact Fisher and the loss before and after the update
  reproduce the recorded qmodel_change (rtol 1e-12; 1e-7 in fit, whose
  gradient is that of Keras's float32 compiled loss), the kept loss before
  the update (rtol 1e-7: Keras's compute_loss returns float32) and rho
  (rtol 1e-6); rho with the next mask (what the rule used before
  the fix) differs by more than 0.05;
* the loss the rule evaluates before the update equals the training
  pass's loss (float32, rtol 1e-6) for every kind of Keras 3 random layer:
  Dropout inside a nested functional model, SpatialDropout1D,
  GaussianNoise, GaussianDropout, the attention dropout of
  MultiHeadAttention and a stochastic-depth layer of its own;
* a `fit` with Dropout(0.5) under the default recipe keeps the damping
  bounded and lowers the loss within a step budget.

* which dropout is replayed: Keras 3's, and tf_keras's on a
  tf.random.Generator (force_generator=True, or
  enable_tf_random_generator()); tf_keras's default dropout draws from
  stateful random ops, which cannot be replayed: there the evaluations'
  masks differ from the training pass's (docs/keras.md). `test_tf_keras`
  runs that check and the fit again under tf_keras; the brute-force and
  layer-kind checks use Keras 3's seed generators.
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
import kfac.keras
from kfac.python.keras import keras_flavor
from kfac.python.kernel_tests import keras_optimizer_test as base

keras = keras_flavor.keras_module()
LEGACY = keras_flavor.legacy_keras_active()

N, D_IN, D_H, D_OUT, RATE = 8, 3, 5, 3, 0.5
F64 = "float64"


def _tiny_model():
  inputs = keras.Input((D_IN,), dtype=F64)
  h = keras.layers.Dense(D_H, activation="tanh", dtype=F64,
                         name="hidden")(inputs)
  h = keras.layers.Dropout(RATE, seed=11, dtype=F64, name="drop")(h)
  out = keras.layers.Dense(D_OUT, dtype=F64, name="logits")(h)
  model = keras.Model(inputs, out)
  rng = np.random.RandomState(3)
  model.set_weights([rng.randn(*w.shape) * 0.8 for w in model.get_weights()])
  return model


def _tiny_data():
  rng = np.random.RandomState(5)
  return rng.randn(N, D_IN), rng.randint(0, D_OUT, size=N).astype(np.int32)


def _logits(params, x, mask):
  w1, b1, w2, b2 = params
  return tf.matmul(tf.tanh(tf.matmul(x, w1) + b1) * mask, w2) + b2


def _loss(params, x, y, mask):
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=y, logits=_logits(params, x, mask)))


def _mask(drop, state, xla=False):
  """The mask (0 or 1 / (1 - rate)) the Dropout layer draws from the seed
  state `state` on a [N, D_H] input: a call of the layer itself (XLA
  compiled for an XLA step: its stateless random numbers are not the same
  as TensorFlow's kernels')."""
  saved = drop.seed_generator.state.numpy()
  drop.seed_generator.state.assign(state)
  call = tf.function(lambda ones: drop(ones, training=True), jit_compile=xla)
  mask = call(tf.ones((N, D_H), tf.float64)).numpy()
  drop.seed_generator.state.assign(saved)
  return mask


def _predicted_change(params, delta, x, y, mask, l2_reg):
  """1/2 delta^T (C + l2_reg I) delta + g^T delta: C the exact Fisher of
  the mean loss and g its gradient, with `mask`."""
  params = [tf.constant(p) for p in params]
  with tf.GradientTape(persistent=True) as tape:
    tape.watch(params)
    logits = _logits(params, x, mask)
    loss = _loss(params, x, y, mask)
  grads = tape.gradient(loss, params)
  jacobians = tape.jacobian(logits, params)  # each [N, D_OUT, *shape]
  j_delta = sum(tf.reshape(j, [N, D_OUT, -1]) @ tf.reshape(d, [-1, 1])
                for j, d in zip(jacobians, delta))[..., 0]  # [N, D_OUT]
  probs = tf.nn.softmax(logits)
  fisher_quad = tf.reduce_mean(
      tf.reduce_sum(probs * j_delta**2, -1) -
      tf.reduce_sum(probs * j_delta, -1)**2)
  sq = sum(float(np.sum(d * d)) for d in delta)
  return (0.5 * (float(fisher_quad) + l2_reg * sq) +
          sum(float(np.sum(g.numpy() * d)) for g, d in zip(grads, delta)))


def _read(store, key):
  var = store.get(key)
  assert var.dtype == tf.float64
  return float(var.numpy())


def _one_adaptive_step(model, how):
  x, y = _tiny_data()
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                    dtype=F64)
  opt = kfac.keras.optimizers.Kfac(
      damping=0.1, model=model, loss=loss, adaptive=True, invert_every=1,
      damping_adaptation_interval=1, estimation_mode="exact", seed=2)
  # The loss the rule evaluates.
  model.compile(optimizer=opt, loss=loss, jit_compile=how == "fit_xla")
  if how.startswith("fit"):
    model.fit(x, y, batch_size=N, epochs=1, shuffle=False, verbose=0)
    return opt

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      value = loss(y, model(x, training=True))
    grads = tape.gradient(value, model.trainable_variables)
    opt.set_train_batch((x, y))
    opt.apply_gradients(zip(grads, model.trainable_variables))
  step(tf.constant(x), tf.constant(y))
  return opt


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("how", [
    "fit", pytest.param("fit_xla", marks=pytest.mark.slow),  # XLA compile
    "custom_loop"])
def test_rho_judges_the_update_with_the_training_mask(how):
  model = _tiny_model()
  drop = model.get_layer("drop")
  state0 = drop.seed_generator.state.numpy()
  before = [w.copy() for w in model.get_weights()]
  opt = _one_adaptive_step(model, how)
  core = opt.kfac_optimizer
  after = model.get_weights()
  delta = [a - b for a, b in zip(after, before)]
  assert max(np.max(np.abs(d)) for d in delta) > 1e-2  # the step moved
  x, y = _tiny_data()
  xla = how == "fit_xla"
  mask = _mask(drop, state0, xla)  # the training pass's mask
  assert 0 < np.mean(mask == 0) < 1
  l2_reg = float(core._l2_reg)  # pylint: disable=protected-access
  change = _predicted_change(before, delta, x, y, mask, l2_reg)
  # The gradient and curvature of the quadratic model are the training
  # pass's (the recorded predicted change is theirs).
  store = core.state_store  # the float64 records
  # fit differentiates Keras's compiled loss, which is float32 also for
  # this float64 model: its gradient agrees to 1.5e-8 (measured, with or
  # without dropout); the custom loop's float64 loss to the last digits.
  assert _read(store, "records/qmodel_change") == pytest.approx(
      change, rel=1e-7 if how.startswith("fit") else 1e-12)
  loss_before = float(_loss(before, x, y, mask))
  kept = _read(store, "adaptive/loss_before")
  # model.compute_loss returns float32 (Keras 3's compiled loss), also
  # for this float64 model: the rule's losses are float32-rounded.
  assert kept == pytest.approx(loss_before, rel=1e-7)
  rho = (float(_loss(after, x, y, mask)) - loss_before) / change
  # rtol 1e-6: the two float32-rounded losses' difference (about 0.3).
  assert _read(store, "records/rho") == pytest.approx(rho, rel=1e-6)
  # The mask the evaluations drew before the fix (the seed state after the
  # training pass) gives another ratio: the check above can fail.
  next_mask = _mask(drop, state0 + np.array([0, 1], state0.dtype), xla)
  assert np.any(next_mask != mask)
  rho_next = (float(_loss(after, x, y, next_mask)) -
              float(_loss(before, x, y, next_mask))) / change
  assert abs(rho_next - rho) > 0.05, (rho, rho_next)
  # The step left the seed state advanced once, as a step without the rule.
  np.testing.assert_array_equal(drop.seed_generator.state.numpy(),
                                state0 + np.array([0, 1], state0.dtype))


class StochasticDepth(keras.layers.Layer):
  """x + residual(x), the residual dropped per example with probability
  `rate` in training (scaled by 1 / (1 - rate) otherwise)."""

  def __init__(self, residual, rate, **kwargs):
    super().__init__(**kwargs)
    self.residual = residual
    self.rate = rate
    self.seed_generator = keras.random.SeedGenerator(5)

  def call(self, x, training=False):
    branch = self.residual(x)
    if training:
      keep = keras.random.uniform(
          (keras.ops.shape(x)[0], 1, 1), seed=self.seed_generator)
      keep = keras.ops.cast(keep >= self.rate, x.dtype) / (1.0 - self.rate)
      branch = branch * keep
    return x + branch


def _noisy_sequence_model():
  """Every kind of Keras 3 random layer, some inside a nested model."""
  t, d = 4, 6
  inner_in = keras.Input((t, d))
  h = keras.layers.Dense(d, activation="tanh", name="inner_dense")(inner_in)
  h = keras.layers.Dropout(0.4, seed=1, name="inner_drop")(h)
  inner = keras.Model(inner_in, h, name="inner")
  inputs = keras.Input((t, d))
  h = inner(inputs)
  h = keras.layers.SpatialDropout1D(0.3, seed=2, name="spatial")(h)
  h = keras.layers.GaussianNoise(0.3, seed=3, name="noise")(h)
  h = keras.layers.GaussianDropout(0.3, seed=4, name="gdrop")(h)
  h = keras.layers.MultiHeadAttention(2, 3, dropout=0.4, seed=6,
                                      name="mha")(h, h)
  h = StochasticDepth(keras.layers.Dense(d, name="res"), 0.4,
                      name="depth")(h)
  h = keras.layers.GlobalAveragePooling1D()(h)
  out = keras.layers.Dense(3, name="logits")(h)
  return keras.Model(inputs, out)


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_every_random_layer_replays_the_training_pass():
  keras.utils.set_random_seed(0)
  model = _noisy_sequence_model()
  states = keras_flavor.random_state_variables(model)
  # inner_drop, spatial, noise, gdrop, the attention's dropout, depth
  assert len(states) == 6, [v.name for v in states]
  rng = np.random.RandomState(0)
  x = rng.randn(16, 4, 6).astype(np.float32)
  y = rng.randint(0, 3, size=16)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  opt = kfac.keras.optimizers.Kfac(
      damping=0.1, model=model, loss=loss, adaptive=True, invert_every=1,
      damping_adaptation_interval=1, seed=2)
  model.compile(optimizer=opt, loss=loss)

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      value = loss(y, model(x, training=True))
    grads = tape.gradient(value, model.trainable_variables)
    opt.set_train_batch((x, y))
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return value

  kept = opt.kfac_optimizer.state_store
  for i in range(2):
    value = float(step(x, y))
    before = float(kept.get("adaptive/loss_before").numpy())
    assert before == pytest.approx(value, rel=1e-6), i
  # Each layer's noise moves the loss well beyond that tolerance: another
  # seed state of any one of them gives another loss.
  saved = [var.numpy() for var in states]

  def loss_with(shifted):
    for i, (var, value) in enumerate(zip(states, saved)):
      var.assign(value + np.array([0, int(i == shifted)], value.dtype))
    return float(loss(y, model(x, training=True)))
  base_loss = loss_with(None)
  for i, var in enumerate(states):
    assert abs(loss_with(i) - base_loss) > 1e-4 * base_loss, var.name


def test_fit_with_dropout_keeps_the_damping_bounded_and_learns():
  """The default recipe (burn-in calibration, then the rule every 5 steps)
  on a Dense(64)-Dropout(0.5) classifier: over 25 steps of batch 64 the
  damping never exceeds its initial value and the loss on the whole set
  (inference mode) falls by 40% (measured with Keras 3: 1.49 -> 0.81, the
  damping 0.1 after the burn-in, 0.005 at the end). Under tf_keras, whose
  default dropout is not replayed, rho is measured on other masks than
  the training pass's and the rule may raise the damping now and then:
  there it stays within 10 times its initial value (measured: 1.66 ->
  0.71, one raise to 1.29 at step 15; the random stream, and so that
  path, changed when the calibration and the rule came to share one
  evaluation)."""
  steps, batch = 25, 64
  keras.utils.set_random_seed(0)
  rng = np.random.RandomState(0)
  x = rng.randn(steps * batch, 20).astype(np.float32)
  y = (np.tanh(x @ rng.randn(20, 16)) @ rng.randn(16, 4)).argmax(1)
  model = keras.Sequential([
      keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
      keras.layers.Dropout(0.5, seed=1), keras.layers.Dense(4)])
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  opt = kfac.keras.optimizers.Kfac(model=model, loss=loss, adaptive=True)
  model.compile(optimizer=opt, loss=loss)
  dampings = []
  log = keras.callbacks.LambdaCallback(on_batch_end=lambda *_, **__: dampings.append(
      float(opt.damping.numpy())))
  first = float(loss(y, model(x, training=False)))
  model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
            callbacks=[log])
  last = float(loss(y, model(x, training=False)))
  assert len(dampings) == steps
  # The recipe's initial damping is 1.
  assert max(dampings) <= (10.0 if LEGACY else 1.0), dampings
  assert last < 0.6 * first, (first, last)
  assert np.isfinite(float(opt.kfac_optimizer.rho))


class _NoTrainingArgument(keras.Model):

  def __init__(self):
    super().__init__(name="no_training_argument")
    self.hidden = keras.layers.Dense(8, activation="tanh")
    self.drop = keras.layers.Dropout(0.5, seed=3)
    self.out = keras.layers.Dense(3)

  def call(self, x):
    return self.out(self.drop(self.hidden(x)))


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_which_dropout_is_replayed_in_each_flavour():
  """The rule's loss before the update equals the training loss (float32,
  rtol 1e-6) for Keras 3's Dropout (also in a subclassed model whose call
  has no `training` argument) and for tf_keras's Dropout on a
  tf.random.Generator (force_generator=True); tf_keras's default Dropout
  draws from stateful random ops, which are not replayed: there the loss
  differs (docs/keras.md)."""
  if LEGACY:
    kinds = [("stateful ops", {}),
             ("generator", dict(force_generator=True))]
  else:
    kinds = [("seed generator", {}), ("subclassed", {})]
  rng = np.random.RandomState(0)
  x = rng.randn(16, 6).astype(np.float32)
  y = rng.randint(0, 3, size=16)
  for kind, kwargs in kinds:
    if kind == "subclassed":  # a call without `training`: Keras 3 passes
      model = _NoTrainingArgument()  # the mode in its call context
      model(x[:1])
    else:
      inputs = keras.Input((6,))
      h = keras.layers.Dense(8, activation="tanh")(inputs)
      h = keras.layers.Dropout(0.5, seed=3, **kwargs)(h)
      model = keras.Model(inputs, keras.layers.Dense(3)(h))
    replayed = kind != "stateful ops"
    assert len(keras_flavor.random_state_variables(model)) == int(replayed)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = kfac.keras.optimizers.Kfac(
        damping=0.1, model=model, loss=loss, adaptive=True, invert_every=1,
        damping_adaptation_interval=1, seed=2)
    model.compile(optimizer=opt, loss=loss)

    @tf.function
    def step(x, y, model=model, opt=opt, loss=loss):
      with tf.GradientTape() as tape:
        value = loss(y, model(x, training=True))
      grads = tape.gradient(value, model.trainable_variables)
      opt.set_train_batch((x, y))
      opt.apply_gradients(zip(grads, model.trainable_variables))
      return value

    for _ in range(2):
      value = float(step(x, y))
      kept = float(opt.kfac_optimizer.state_store.get(
          "adaptive/loss_before").numpy())
      if replayed:
        assert kept == pytest.approx(value, rel=1e-6), kind
      else:
        assert abs(kept - value) > 1e-3 * value, kind


@pytest.mark.slow  # subprocess: tests of this file under tf_keras
def test_tf_keras():
  """Under tf_keras (TF_USE_LEGACY_KERAS=1): which dropout is replayed, and
  the fit above keeps the damping bounded and learns also where the masks
  are not replayed (its default dropout)."""
  if LEGACY:
    return  # this is the run under tf_keras
  base.run_file_under_tf_keras(
      __file__, "keeps_the_damping_bounded or replayed_in_each_flavour")
