"""kfac.keras.optimizers.Kfac(adaptive=True) and calibrate_damping.

Checked:
* fit with adaptive=True (qmodel learning rate and momentum, damping rule
  every 2 steps; also with damping calibration during a burn-in step)
  takes the same steps as kfac.PeriodicInvCovUpdateKfacOpt in a TF1
  Session graph on the same model written with raw TF ops, with loss_fn the
  same loss on the step's batch: weights (rtol 1e-4, float32), damping, the
  chosen learning rate (shown as optimizer.learning_rate) and rho;
* a custom tf.function loop with set_train_batch takes the same steps as
  fit; jit_compile=True takes the same steps (rtol 1e-5); model.save and
  saving_utils.load_model resume on bit-identical weights and damping;
* qmodel_batch_fraction (the quadratic model's curvature on the batch's
  first rows) takes the steps of the core's qmodel_layer_collection;
* the loss evaluations of the damping rule (and qmodel_batch_fraction's
  forward pass) leave the model's state as one training step leaves it: BatchNorm moving statistics and the Keras 3
  dropout seed state equal those of a non-adaptive run (so dropout draws
  the same masks before and after the update);
* TensorBoard gets rho and qmodel_change; the config round-trips;
* convolutions get the recipe's sub-sampled patch statistics
  (recipe.conv_registration_options()) and batch norms its approximation
  (recipe.keras_default_approx()) unless the user's options say otherwise;
* learning_rate / damping / momentum cannot be set (nor scheduled) while
  they are adapted, and bad arguments raise clear errors;
* adaptive=True with momentum_type="regular" and a learning_rate (the
  recipe at a fixed rate and momentum, only the damping adapted) takes the
  steps of the core optimizer in a TF1 Session graph with the same
  arguments; it starts from the recipe's initial damping without the
  calibration, and its learning rate and momentum can be set while the
  damping cannot.
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.ops.adaptive import recipe
import kfac.keras
from kfac.python.kernel_tests import keras_optimizer_test as base
from kfac.python.keras import keras_flavor

keras = base.keras
LEGACY = base.LEGACY
N_STEPS, INTERVAL, DAMPING = 3, 2, 0.05


def _adaptive(model, **kwargs):
  model.set_weights(base._weights())  # pylint: disable=protected-access
  options = dict(damping=DAMPING, model=model, adaptive=True,
                 loss="sparse_categorical_crossentropy", invert_every=1,
                 damping_adaptation_interval=INTERVAL,
                 estimation_mode="exact", seed=base.SEED)
  options.update(kwargs)
  opt = kfac.keras.optimizers.Kfac(**options)
  model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
  return model, opt


def _tf1_adaptive_reference(steps, qmodel_rows=None, curvature_options=None,
                            **core_kwargs):
  """Weights, damping, learning rate and rho after `steps` adaptive steps
  of the core optimizer on the same model in a TF1 graph (qmodel_rows: the
  quadratic model's curvature on the batch's first rows, through a
  qmodel_layer_collection; curvature_options: the LayerCollection's)."""
  x_all, y_all = base._data()  # pylint: disable=protected-access
  batch = base.BATCH
  graph = tf.Graph()
  with graph.as_default():
    variables = [tf.compat.v1.Variable(w) for w in base._weights()]  # pylint: disable=protected-access
    w1, b1, w2, b2 = variables
    x = tf.compat.v1.placeholder(tf.float32, [batch, base.D_IN])
    y = tf.compat.v1.placeholder(tf.int32, [batch])

    def forward(inputs):
      pre1 = tf.matmul(inputs, w1) + b1
      hidden = tf.tanh(pre1)
      return pre1, hidden, tf.matmul(hidden, w2) + b2

    def mean_loss(labels, logits):
      return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=labels, logits=logits))

    pre1, hidden, logits = forward(x)
    lc = kfac.LayerCollection(curvature_options=curvature_options)
    lc.register_fully_connected((w1, b1), x, pre1)
    lc.register_fully_connected((w2, b2), hidden, logits)
    lc.register_categorical_predictive_distribution(logits)
    # Keras's adaptive=True applies the default recipe's damping floor and
    # statistics interval.
    kwargs = dict(
        learning_rate=None, momentum=None, momentum_type="qmodel",
        damping=DAMPING, layer_collection=lc, invert_every=1,
        estimation_mode="exact", adapt_damping=True, use_passed_loss=False,
        damping_adaptation_interval=INTERVAL, train_batch=(x, y),
        loss_fn=lambda b: mean_loss(b[1], forward(b[0])[2]),
        relative_min_damping=recipe.RELATIVE_MIN_DAMPING,
        cov_update_every=recipe.COV_UPDATE_EVERY)
    if qmodel_rows is not None:
      rows = kfac.LayerCollection()
      rows.register_categorical_predictive_distribution(
          forward(x[:qmodel_rows])[2])
      kwargs.update(qmodel_layer_collection=rows)
    kwargs.update(core_kwargs)
    opt = kfac.PeriodicInvCovUpdateKfacOpt(**kwargs)
    train = opt.minimize(mean_loss(y, logits), var_list=variables)
    with tf.compat.v1.Session(graph=graph) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      for i in range(steps):
        sess.run(train, {x: x_all[i * batch:(i + 1) * batch],
                         y: y_all[i * batch:(i + 1) * batch]})
      return sess.run(dict(weights=variables, damping=opt.damping,
                           learning_rate=opt.learning_rate, rho=opt.rho))


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("calibrate, fraction", [(False, None), (True, None),
                                                (False, 0.3)])
def test_adaptive_fit_equals_tf1_graph_steps(calibrate, fraction):
  """fraction: qmodel_batch_fraction, the quadratic model's curvature on
  the batch's first ceil(fraction * batch) rows in fit and through the
  core's qmodel_layer_collection in the TF1 graph."""
  extra = dict(num_burnin_steps=1, calibrate_damping=True) if calibrate \
      else {}
  rows = None
  if fraction is not None:
    extra_keras = dict(qmodel_batch_fraction=fraction)
    rows = int(np.ceil(fraction * base.BATCH))
    assert 0 < rows < base.BATCH
  else:
    extra_keras = {}
  model, opt = _adaptive(base.sequential_model(), **extra, **extra_keras)
  base._fit(model, 0, N_STEPS)  # pylint: disable=protected-access
  want = _tf1_adaptive_reference(N_STEPS, qmodel_rows=rows, **extra)
  if fraction is not None:  # the rows' curvature makes other steps
    whole = _tf1_adaptive_reference(N_STEPS, **extra)
    assert max(np.max(np.abs(a - b)) for a, b in
               zip(want["weights"], whole["weights"])) > 1e-3
  base._assert_weights(model.get_weights(), want["weights"], rtol=1e-4,  # pylint: disable=protected-access
                       atol=1e-6)
  core = opt.kfac_optimizer
  assert float(opt.damping.numpy()) == pytest.approx(want["damping"],
                                                     rel=1e-5)
  assert float(core.rho) == pytest.approx(want["rho"], rel=1e-3)
  # The chosen learning rate is shown as the Keras learning rate.
  assert float(np.asarray(opt.learning_rate)) == pytest.approx(
      want["learning_rate"], rel=1e-4)
  assert want["learning_rate"] > 0 and np.isfinite(want["rho"])
  if calibrate:  # one burn-in call (kfac 0.2.x: it advances no counter)
    assert int(core.burnin_counter) == 1
    assert int(core.counter) == N_STEPS - 1
  # The steps moved the weights well beyond the tolerance.
  assert max(np.max(np.abs(a - b)) for a, b in
             zip(want["weights"], base._weights())) > 0.05  # pylint: disable=protected-access


def test_default_recipe_first_fit_call_inverts_nothing():
  """The default recipe's first burn-in step only gathers statistics: after
  the first fit call no inverse has been computed and the damping is the
  initial one; the next burn-in steps compute them and calibrate."""
  model = base.sequential_model()
  model.set_weights(base._weights())  # pylint: disable=protected-access
  opt = kfac.keras.optimizers.Kfac(
      model=model, adaptive=True, loss="sparse_categorical_crossentropy",
      seed=base.SEED)
  model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
  core = opt.kfac_optimizer

  def inverses():
    values = [v.numpy() for k, v in core.state_store.variables_by_name.items()
              if "/matpow" in k or "/chol" in k]
    assert values
    return values
  base._fit(model, 0, 1)  # pylint: disable=protected-access
  assert int(core.burnin_counter) == 1
  assert not any(np.any(v) for v in inverses())
  assert float(opt.damping.numpy()) == recipe.INITIAL_DAMPING
  base._fit(model, 1, 2)  # pylint: disable=protected-access
  assert int(core.burnin_counter) == 2
  assert all(np.any(v) for v in inverses())
  assert float(opt.damping.numpy()) != recipe.INITIAL_DAMPING


def test_the_recipes_bound_the_quadratic_models_momentum():
  """The exact recipe (Kfac(adaptive=True), recipe.adaptive_kwargs())
  keeps the chosen momentum within +-recipe.QMODEL_MOMENTUM_BOUND; the
  recipes without the quadratic model, and a user's None, do not bound."""
  def bound(opt):
    return opt.kfac_optimizer.config.update.qmodel_momentum_bound
  assert recipe.QMODEL_MOMENTUM_BOUND == 1.0
  assert bound(kfac.keras.optimizers.Kfac(adaptive=True)) == 1.0
  assert bound(kfac.keras.optimizers.Kfac(adaptive=True, recipe="auto")) == 1.0
  assert bound(kfac.keras.optimizers.Kfac(
      adaptive=True, qmodel_momentum_bound=None)) is None
  assert bound(kfac.keras.optimizers.Kfac(
      adaptive=True, qmodel_momentum_bound=2.0)) == 2.0
  assert bound(kfac.keras.optimizers.Kfac(
      adaptive=True, recipe="minibatch", learning_rate=0.05)) is None
  assert bound(kfac.keras.optimizers.Kfac(
      adaptive=True, momentum_type="regular", learning_rate=0.05)) is None
  assert bound(kfac.keras.optimizers.Kfac(
      adaptive=True, momentum_type="qmodel_fixedmu", momentum=0.9)) is None
  assert bound(kfac.keras.optimizers.Kfac(learning_rate=0.1,
                                          damping=0.1)) is None
  assert recipe.adaptive_kwargs()["qmodel_momentum_bound"] == 1.0
  assert "qmodel_momentum_bound" not in recipe.adaptive_kwargs(
      momentum_type="qmodel_fixedmu", momentum=0.9)
  # The core's own default stays kfac 0.2.x's unbounded solve.
  core = kfac.PeriodicInvCovUpdateKfacOpt(
      learning_rate=None, momentum=None, momentum_type="qmodel",
      damping=0.1)
  assert core.config.update.qmodel_momentum_bound is None


@pytest.mark.slow  # the recipe's defaults (2 fits, as above)
def test_default_recipe_without_damping():
  """Kfac(adaptive=True) without damping is the default recipe: the same
  steps as the core optimizer with recipe.adaptive_kwargs() (initial damping
  1, 5 calibrated burn-in steps, relative damping floor)."""
  default = kfac.keras.optimizers.Kfac(adaptive=True)
  assert default.kfac_optimizer.num_burnin_steps == (
      recipe.NUM_BURNIN_STEPS)
  assert default.kfac_optimizer.num_calibration_steps == (
      recipe.NUM_CALIBRATION_STEPS) == recipe.NUM_BURNIN_STEPS - 1
  # A number of burn-in steps of the user's: all of them calibrate.
  user = kfac.keras.optimizers.Kfac(adaptive=True, num_burnin_steps=3)
  assert user.kfac_optimizer.num_calibration_steps == 3
  # Without the calibration: the recipe's burn-in steps, none calibrating.
  plain = kfac.keras.optimizers.Kfac(adaptive=True, calibrate_damping=False)
  assert plain.kfac_optimizer.num_burnin_steps == recipe.NUM_BURNIN_STEPS
  assert plain.kfac_optimizer.num_calibration_steps == 0
  steps, burnin = N_STEPS, 1  # the test data has three batches
  model, opt = _adaptive(base.sequential_model(), damping=None,
                         num_burnin_steps=burnin)
  base._fit(model, 0, steps)  # pylint: disable=protected-access
  want = _tf1_adaptive_reference(
      steps, **recipe.adaptive_kwargs(num_burnin_steps=burnin))
  base._assert_weights(model.get_weights(), want["weights"], rtol=1e-4,  # pylint: disable=protected-access
                       atol=1e-6)
  core = opt.kfac_optimizer
  assert int(core.burnin_counter) == burnin
  assert int(core.counter) == steps - burnin
  assert float(opt.damping.numpy()) == pytest.approx(want["damping"],
                                                     rel=1e-5)
  # calibrated away from the initial damping
  assert want["damping"] != pytest.approx(recipe.INITIAL_DAMPING, rel=0.01)


@pytest.mark.slow  # end to end: XLA compile and a save/load round trip
def test_adaptive_xla_and_exact_resume(tmp_path):
  """jit_compile=True takes the same steps; model.save + load_model resumes
  on exactly the same trajectory (damping, records and all state)."""
  plain, plain_opt = _adaptive(base.functional_model(),
                               damping_adaptation_interval=1)
  base._fit(plain, 0, 3)  # pylint: disable=protected-access
  if not LEGACY:  # tf_keras: Kfac always traces without XLA
    xla = base.functional_model()
    xla.set_weights(base._weights())  # pylint: disable=protected-access
    xla_opt = kfac.keras.optimizers.Kfac(
        damping=DAMPING, model=xla, adaptive=True, invert_every=1,
        loss="sparse_categorical_crossentropy", estimation_mode="exact",
        damping_adaptation_interval=1, seed=base.SEED)
    xla.compile(optimizer=xla_opt, loss="sparse_categorical_crossentropy",
                jit_compile=True)
    base._fit(xla, 0, 3)  # pylint: disable=protected-access
    # float32, and XLA orders the reductions its own way: three steps
    # agree to about 2e-6 (measured 1.7e-6 at most).
    base._assert_weights(xla.get_weights(), plain.get_weights(), rtol=1e-5,  # pylint: disable=protected-access
                         atol=3e-6)
    assert float(xla_opt.damping.numpy()) == pytest.approx(
        float(plain_opt.damping.numpy()), rel=1e-6)
  first, _ = _adaptive(base.functional_model(),
                       damping_adaptation_interval=1)
  base._fit(first, 0, 2)  # pylint: disable=protected-access
  path = str(tmp_path / "model.keras")
  first.save(path)
  loaded = kfac.keras.saving_utils.load_model(path)
  assert loaded.optimizer.get_config()["adaptive"] is True
  base._fit(loaded, 2, 3)  # pylint: disable=protected-access
  for a, b in zip(loaded.get_weights(), plain.get_weights()):
    np.testing.assert_array_equal(a, b)
  assert float(loaded.optimizer.damping.numpy()) == float(
      plain_opt.damping.numpy())


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_adaptive_custom_loop_with_set_train_batch():
  reference, _ = _adaptive(base.sequential_model())
  base._fit(reference, 0, 3)  # pylint: disable=protected-access
  model, opt = _adaptive(base.sequential_model())
  loss_fn = keras.losses.SparseCategoricalCrossentropy()
  x_all, y_all = base._data()  # pylint: disable=protected-access

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.set_train_batch((x, y))
    opt.apply_gradients(zip(grads, model.trainable_variables))

  b = base.BATCH
  for i in range(3):
    step(x_all[i * b:(i + 1) * b], y_all[i * b:(i + 1) * b])
  base._assert_weights(model.get_weights(), reference.get_weights(),  # pylint: disable=protected-access
                       rtol=1e-5)

  # Without the batch, the error says what to do.
  other, other_opt = _adaptive(base.sequential_model())

  @tf.function
  def bare_step(x, y):
    with tf.GradientTape() as tape:
      loss = loss_fn(y, other(x, training=True))
    grads = tape.gradient(loss, other.trainable_variables)
    other_opt.apply_gradients(zip(grads, other.trainable_variables))

  with pytest.raises(ValueError, match="set_train_batch"):
    bare_step(x_all[:b], y_all[:b])


def _noisy_model():
  inputs = keras.Input((base.D_IN,))
  h = keras.layers.Dense(base.D_H, activation="tanh", name="hidden")(inputs)
  if not LEGACY:  # tf_keras dropout is stateful: not comparable across runs
    h = keras.layers.Dropout(0.3, seed=3, name="drop")(h)
  h = keras.layers.BatchNormalization(name="bn")(h)
  out = keras.layers.Dense(base.D_OUT, activation="softmax", name="out")(h)
  return keras.Model(inputs, out)


def _state(model):
  return [v.numpy() for v in keras_flavor.state_variables(model)
          if "moving" in v.name or "seed" in v.name]


@pytest.mark.slow  # end to end: 3 runs of 2 fits, BatchNorm and dropout
def test_loss_evaluations_leave_the_model_state_as_one_step():
  """BatchNorm statistics after the first step (same weights before its
  forward pass) and the dropout seed state after 3 steps equal those of a
  run without the damping rule; also with qmodel_batch_fraction (its extra
  forward pass of the batch's first rows leaves the state alone too)."""
  x_all, y_all = base._data()  # pylint: disable=protected-access
  b = base.BATCH
  states = {}
  weights = _noisy_model().get_weights()
  for run in ("fixed", "adaptive", "fraction"):
    model = _noisy_model()
    model.set_weights(weights)
    kwargs = dict(damping=DAMPING, model=model, invert_every=1,
                  loss="sparse_categorical_crossentropy", seed=1)
    if run == "fixed":
      kwargs.update(learning_rate=0.01)
    else:
      kwargs.update(adaptive=True, damping_adaptation_interval=1)
    if run == "fraction":
      kwargs.update(qmodel_batch_fraction=0.5)
    opt = kfac.keras.optimizers.Kfac(**kwargs)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(x_all[:b], y_all[:b], batch_size=b, verbose=0, shuffle=False)
    first = _state(model)
    model.fit(x_all[b:3 * b], y_all[b:3 * b], batch_size=b, verbose=0,
              shuffle=False)
    states[run] = (first, _state(model), opt)
  first0, last0, _ = states["fixed"]
  for run in ("adaptive", "fraction"):
    first1, last1, opt = states[run]
    assert len(first0) == len(first1) >= 2
    for a, c in zip(first0, first1):
      np.testing.assert_allclose(a, c, rtol=1e-6, err_msg=run)
    if not LEGACY:  # Keras 3: the seed generator advanced once per step
      seeds = [(a, c) for a, c, v in zip(
          last0, last1, keras_flavor.state_variables(model)) if "seed" in
               v.name]
      assert seeds
      for a, c in seeds:
        np.testing.assert_array_equal(a, c, err_msg=run)
    assert np.isfinite(float(opt.kfac_optimizer.rho))


def test_tensorboard_scalars_and_config(tmp_path):
  # (The noise scale is measured when asked: noise_scale_steps.)
  model, opt = _adaptive(base.sequential_model(), noise_scale_steps=5)
  seen = {tag: [value for _, value in points] for tag, points in
          base.fit_with_summaries(model, tmp_path, 2).items()}
  assert sorted(seen) == ["kfac/damping", "kfac/learning_rate",
                          "kfac/momentum", "kfac/noise_scale",
                          "kfac/qmodel_change", "kfac/rho",
                          "kfac/skipped_steps"], seen
  assert all(q < 0 for q in seen["kfac/qmodel_change"])
  # The gradient noise scale after each of the first two measured steps.
  assert all(np.isfinite(b) and b > 0 for b in seen["kfac/noise_scale"])
  assert np.isfinite(seen["kfac/rho"][0])
  config = opt.get_config()
  assert config["adaptive"] is True and config["learning_rate"] is None
  rebuilt = kfac.keras.optimizers.Kfac.from_config(config)
  assert rebuilt.get_config() == config


def test_adapted_hyperparameters_cannot_be_set():
  model, opt = _adaptive(base.sequential_model())
  for name in ("learning_rate", "damping"):
    with pytest.raises(ValueError, match="chooses the %s" % name):
      setattr(opt, name, 0.1)
  callback = kfac.keras.callbacks.ExponentialDecay(
      "damping", init_value=1.0, final_value=0.1, decay_rate=0.9)
  x, y = base._data()  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="chooses the damping"):
    model.fit(x, y, batch_size=base.BATCH, verbose=0, callbacks=[callback])


FIXED = dict(momentum_type="regular", learning_rate=0.05, momentum=0.9)


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_fixed_rate_fit_equals_tf1_graph_steps():
  model, opt = _adaptive(base.sequential_model(), **FIXED)
  base._fit(model, 0, N_STEPS)  # pylint: disable=protected-access
  want = _tf1_adaptive_reference(N_STEPS, **FIXED)
  base._assert_weights(model.get_weights(), want["weights"], rtol=1e-4,  # pylint: disable=protected-access
                       atol=1e-6)
  core = opt.kfac_optimizer
  assert float(opt.damping.numpy()) == pytest.approx(want["damping"],
                                                     rel=1e-5)
  assert want["damping"] != pytest.approx(DAMPING, rel=1e-3)  # adapted
  assert float(core.rho) == pytest.approx(want["rho"], rel=1e-3)
  assert np.isfinite(want["rho"])
  # The learning rate is the user's, not the quadratic model's.
  assert float(np.asarray(opt.learning_rate)) == pytest.approx(0.05)
  assert max(np.max(np.abs(a - b)) for a, b in
             zip(want["weights"], base._weights())) > 0.05  # pylint: disable=protected-access


def test_fixed_rate_defaults_and_hyperparameters():
  opt = kfac.keras.optimizers.Kfac(adaptive=True, momentum_type="regular",
                                   learning_rate=0.05)
  core = opt.kfac_optimizer
  assert float(opt.damping.numpy()) == recipe.INITIAL_DAMPING
  assert not core.calibrate_damping and core.num_burnin_steps == 0
  assert float(np.asarray(opt.momentum)) == pytest.approx(0.9)
  assert opt.mutable_hyperparameters >= {"learning_rate", "momentum"}
  assert "damping" not in opt.mutable_hyperparameters
  opt.learning_rate = 0.01
  opt.momentum = 0.5
  assert float(np.asarray(opt.learning_rate)) == pytest.approx(0.01)
  assert float(np.asarray(opt.momentum)) == pytest.approx(0.5)
  with pytest.raises(ValueError, match="chooses the damping"):
    opt.damping = 0.1
  config = opt.get_config()
  assert config["learning_rate"] == pytest.approx(0.01)
  assert config["momentum_type"] == "regular"
  assert kfac.keras.optimizers.Kfac.from_config(config).get_config() == (
      config)


def _recipe_fit(layers, channels, seed, kfac_kwargs):
  """Two fit steps (batch of 8 examples of 12x12xchannels) of a Sequential
  model of `layers` followed by a dense head of 3 logits."""
  rng = np.random.RandomState(seed)
  x = rng.randn(8, 12, 12, channels).astype(np.float32)
  y = rng.randint(0, 3, size=8)
  model = keras.Sequential([keras.Input((12, 12, channels))] + layers + [
      keras.layers.Flatten(), keras.layers.Dense(3, name="logits")])
  model.set_weights([np.random.RandomState(i).randn(*w.shape).astype(
      np.float32) * 0.3 for i, w in enumerate(model.get_weights())])
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  options = dict(model=model, loss=loss, invert_every=1, seed=base.SEED,
                 damping=0.05)  # no burn-in: the weights move
  options.update(kfac_kwargs)
  opt = kfac.keras.optimizers.Kfac(**options)
  model.compile(optimizer=opt, loss=loss)
  model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
  return model.get_weights(), opt


def _conv_recipe_fit(**kfac_kwargs):
  """A conv model whose 800 patches (8 examples, 10x10 locations) exceed
  the recipe's patch budget (8 * dim(A) = 80 rows)."""
  return _recipe_fit([
      keras.layers.Conv2D(3, 3, activation="tanh", name="conv"),
      keras.layers.BatchNormalization(name="norm")], 1, 4, kfac_kwargs)


def _report_row(opt, layer):
  rows = [l for l in opt.registration_report.splitlines()
          if l.split()[:1] and l.split()[0].split("/")[-1] == layer]
  assert len(rows) == 1, opt.registration_report
  return rows[0]


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_recipe_registration_defaults_unless_told_otherwise():
  """adaptive=True registers kron convolutions with the recipe's
  sub_sample_patches (recipe.conv_registration_options()) and batch norms
  with the recipe's approximation (recipe.keras_default_approx()); a
  layer's own registration_options / fisher_approx replace them, and
  adaptive=False keeps kfac 0.2.x's registration."""
  assert recipe.conv_registration_options() == {"sub_sample_patches": True}
  assert recipe.keras_default_approx() == {"batch_norm": "per_channel"}
  sampled, opt = _conv_recipe_fit(adaptive=True)
  assert "sub_sample_patches=True" in _report_row(opt, "conv")
  assert "ScaleAndShiftPerChannelFB" in _report_row(opt, "norm")
  assert "fallback" not in opt.registration_report
  everything, opt = _conv_recipe_fit(
      adaptive=True, registration_options={
          keras.layers.Conv2D: {"sub_sample_patches": False}},
      fisher_approx={keras.layers.BatchNormalization: "full"})
  assert "sub_sample_patches=False" in _report_row(opt, "conv")
  assert "sub_sample_patches=True" not in opt.registration_report
  assert "ScaleAndShiftFullFB" in _report_row(opt, "norm")
  # The subset changes the input statistic, hence the steps.
  assert max(np.max(np.abs(a - b))
             for a, b in zip(sampled, everything)) > 1e-4
  _, opt = _conv_recipe_fit(learning_rate=0.1)
  assert "sub_sample_patches" not in opt.registration_report
  assert "ScaleAndShiftFullFB" in _report_row(opt, "norm")
  # Another approximation than kron gets no default options.
  _, opt = _conv_recipe_fit(adaptive=True, fisher_approx={"conv": "diagonal"})
  assert "sub_sample_patches" not in opt.registration_report


def _depthwise_recipe_fit(**kfac_kwargs):
  """A depthwise conv model whose 800 patch rows (8 examples, 10x10
  locations) exceed the recipe's budget for a depthwise kron factor
  (8 * (9 taps + bias) = 80 rows)."""
  return _recipe_fit([
      keras.layers.DepthwiseConv2D(3, activation="tanh", name="dw")], 2, 5,
                     kfac_kwargs)


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_recipe_sub_samples_depthwise_patch_rows_unless_told_otherwise():
  """adaptive=True gives a depthwise conv's per-channel kron block the
  recipe's sub_sample_patches too; registration_options of the layer
  replace it, adaptive=False and the diagonal approximation get none, and
  an option a depthwise registration does not take is an error naming the
  layer."""
  sampled, opt = _depthwise_recipe_fit(adaptive=True)
  assert "sub_sample_patches=True" in _report_row(opt, "dw")
  assert "DepthwiseConvKFCBasicFB" in _report_row(opt, "dw")
  everything, opt = _depthwise_recipe_fit(
      adaptive=True, registration_options={
          keras.layers.DepthwiseConv2D: {"sub_sample_patches": False}})
  assert "sub_sample_patches=False" in _report_row(opt, "dw")
  assert max(np.max(np.abs(a - b))
             for a, b in zip(sampled, everything)) > 1e-4
  _, opt = _depthwise_recipe_fit(
      adaptive=True, registration_options={"dw": {"sub_sample_patches": 20}})
  assert "sub_sample_patches=20" in _report_row(opt, "dw")
  _, opt = _depthwise_recipe_fit(learning_rate=0.1)
  assert "sub_sample_patches" not in opt.registration_report
  _, opt = _depthwise_recipe_fit(adaptive=True,
                                 fisher_approx={"dw": "diagonal"})
  assert "sub_sample_patches" not in opt.registration_report
  # Found when the optimizer is built, before anything is traced.
  with pytest.raises(ValueError, match="layer .*dw .DepthwiseConv2D.: a "
                     "depthwise convolution takes only sub_sample_patches"):
    _depthwise_recipe_fit(adaptive=True, registration_options={
        keras.layers.DepthwiseConv2D: {"sub_sample_inputs": 2}})


@pytest.mark.parametrize("kwargs, match", [
    (dict(adaptive=True, learning_rate=0.1), "pass learning_rate=None"),
    (dict(adaptive=True, momentum=0.9), "drop momentum"),
    (dict(adaptive=True, momentum_type="adam"), "momentum_type 'qmodel'"),
    (dict(adaptive=True, momentum_type="regular"),
     "pass learning_rate=<a number>"),
    (dict(adaptive=True, momentum_type="regular", learning_rate=-1.0),
     "learning_rate"),
    (dict(adaptive=True, momentum_type="regular", learning_rate=0.1,
          qmodel_batch_fraction=0.5), "quadratic model only"),
    (dict(learning_rate=0.1, damping=None), "needs damping"),
    (dict(adaptive=True, loss_fn=lambda b: 0.0), "sets loss_fn itself"),
    (dict(adaptive=True, update_damping_immediately=False),
     "sets update_damping_immediately"),
    (dict(learning_rate=0.1, train_batch=(1, 2)), "needs adaptive=True"),
    (dict(learning_rate=0.1, calibrate_damping=True), "num_burnin_steps"),
    (dict(adaptive=True, qmodel_batch_fraction=0), "in \\(0, 1\\]"),
    (dict(adaptive=True, qmodel_batch_fraction=1.5), "in \\(0, 1\\]"),
    (dict(adaptive=True, qmodel_batch_fraction="half"), "in \\(0, 1\\]"),
    (dict(learning_rate=0.1, qmodel_batch_fraction=0.5),
     "quadratic model only"),
    (dict(adaptive=True, qmodel_layer_collection=kfac.LayerCollection()),
     "pass qmodel_batch_fraction"),
])
def test_errors(kwargs, match):
  options = dict(damping=0.1)
  options.update(kwargs)
  with pytest.raises(ValueError, match=match):
    kfac.keras.optimizers.Kfac(**options)


@pytest.mark.slow  # subprocess: the file again under tf_keras
def test_tf_keras():
  """This file again under tf_keras (TF_USE_LEGACY_KERAS=1)."""
  if LEGACY:
    return  # this is the run under tf_keras
  base.run_file_under_tf_keras(__file__)


# ------------------------------------------------------------ recipe="minibatch"
MINIBATCH = dict(recipe="minibatch", learning_rate=0.05)


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_minibatch_recipe_fit_equals_tf1_graph_steps():
  """Kfac(adaptive=True, recipe="minibatch") in fit and the core optimizer
  in a TF1 Session with recipe.minibatch_kwargs(): the same weights, damping
  and rho (the recipe's momentum, norm constraint and statistics period;
  the inverses every step and the damping rule every INTERVAL steps, as
  the other equivalence tests take them, so that they act in 3 steps)."""
  model, opt = _adaptive(base.sequential_model(), **MINIBATCH)
  core = opt.kfac_optimizer
  assert float(np.asarray(core.config.update.norm_constraint)) == (
      pytest.approx(recipe.MINIBATCH_NORM_CONSTRAINT))
  base._fit(model, 0, N_STEPS)  # pylint: disable=protected-access
  want = _tf1_adaptive_reference(N_STEPS, **recipe.minibatch_kwargs(
      learning_rate=0.05, damping=DAMPING, invert_every=1,
      damping_adaptation_interval=INTERVAL))
  base._assert_weights(model.get_weights(), want["weights"], rtol=1e-4,  # pylint: disable=protected-access
                       atol=1e-6)
  assert float(opt.damping.numpy()) == pytest.approx(want["damping"],
                                                     rel=1e-5)
  assert float(core.rho) == pytest.approx(want["rho"], rel=1e-3)
  assert max(np.max(np.abs(a - b)) for a, b in
             zip(want["weights"], base._weights())) > 0.01  # pylint: disable=protected-access


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_minibatch_recipe_is_its_arguments():
  """recipe="minibatch" is exactly the arguments it stands for: its fit
  equals, bit for bit, a fit with those arguments given one by one (the
  ones the user gives win over the recipe's); the config keeps the recipe
  and round-trips."""
  runs = {}
  for name, kwargs in (
      ("recipe", MINIBATCH),
      # (_adaptive gives the inverse and damping periods itself.)
      ("spelled", dict(learning_rate=0.05, **{
          k: v for k, v in recipe.keras_minibatch_defaults().items()
          if k not in ("invert_every", "damping_adaptation_interval")}))):
    model, opt = _adaptive(base.sequential_model(), **kwargs)
    base._fit(model, 0, N_STEPS)  # pylint: disable=protected-access
    runs[name] = (model.get_weights(), opt)
  for a, c in zip(runs["recipe"][0], runs["spelled"][0]):
    np.testing.assert_array_equal(a, c)
  opt = runs["recipe"][1]
  core = opt.kfac_optimizer
  assert core.config.update.momentum_type == "regular"
  assert core.config.curvature.periods.cov_update_every == (
      recipe.MINIBATCH_COV_UPDATE_EVERY)
  assert float(np.asarray(opt.momentum)) == pytest.approx(
      recipe.MINIBATCH_MOMENTUM)
  assert not core.calibrate_damping and core.num_burnin_steps == 0
  config = opt.get_config()
  assert config["recipe"] == "minibatch"
  assert config["learning_rate"] == pytest.approx(0.05)
  assert kfac.keras.optimizers.Kfac.from_config(config).get_config() == (
      config)


def test_minibatch_recipe_defaults():
  opt = kfac.keras.optimizers.Kfac(adaptive=True, recipe="minibatch",
                                   learning_rate=0.05)
  core = opt.kfac_optimizer
  periods = core.config.curvature.periods
  assert (periods.invert_every, periods.cov_update_every) == (
      recipe.MINIBATCH_INVERT_EVERY, recipe.MINIBATCH_COV_UPDATE_EVERY)
  assert core.config.damping.damping_adaptation_interval == (
      recipe.MINIBATCH_INVERT_EVERY)
  assert core.config.damping.adapt_damping
  assert core.config.damping.damping_adaptation_decay == (
      recipe.MINIBATCH_DAMPING_DECAY)
  assert float(opt.damping.numpy()) == recipe.INITIAL_DAMPING
  # The user's values win over the recipe's.
  opt = kfac.keras.optimizers.Kfac(adaptive=True, recipe="minibatch",
                                   learning_rate=0.05, invert_every=20,
                                   momentum=0.5)
  assert opt.kfac_optimizer.config.curvature.periods.invert_every == 20
  assert float(np.asarray(opt.momentum)) == pytest.approx(0.5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(adaptive=True, recipe="fast", learning_rate=None),
     "recipe must be one of 'exact', 'minibatch', 'auto', got 'fast'"),
    (dict(adaptive=True, recipe="minibatch", learning_rate=None),
     "recipe='minibatch'.*takes the learning rate from you"),
    (dict(adaptive=False, recipe="minibatch", learning_rate=0.05,
          damping=0.1), "pass adaptive=True too"),
    (dict(adaptive=True, recipe="minibatch", learning_rate=0.05,
          momentum_type="qmodel"), "uses momentum_type 'regular'"),
    (dict(adaptive=True, recipe="exact", learning_rate=0.05,
          momentum_type="regular"), "momentum_type='regular' is "
     "recipe='minibatch'"),
    (dict(adaptive=True, recipe="minibatch", learning_rate=0.05,
          qmodel_batch_fraction=0.5), "used by the quadratic model only"),
    (dict(adaptive=True, recipe="auto", learning_rate=None,
          momentum_type="regular"), "recipe='auto' chooses the learning "
     "rate with the quadratic model"),
    (dict(adaptive=True, recipe="exact", learning_rate=None,
          minibatch_learning_rate=0.1), "minibatch_learning_rate is the "
     "learning rate recipe='auto' uses.*got recipe='exact'"),
    (dict(adaptive=True, recipe="auto", learning_rate=None,
          minibatch_learning_rate=-0.1), "minibatch_learning_rate must be a "
     "number > 0, got -0.1"),
    (dict(adaptive=True, recipe="minibatch", learning_rate=0.1,
          auto_switch_ratio=0.1), "auto_switch_ratio is recipe='auto''s "
     "threshold.*got recipe='minibatch'"),
    (dict(adaptive=True, recipe="auto", learning_rate=None,
          auto_switch_ratio="1"), "auto_switch_ratio must be a number > 0"),
    (dict(adaptive=True, recipe="auto", learning_rate=None,
          noise_scale_steps=0), "noise_scale_steps=0 measures none"),
    (dict(adaptive=True, recipe="auto", learning_rate=0.1),
     "learning_rate must be None with adaptive=True"),
])
def test_recipe_argument_errors_name_the_culprit(kwargs, match):
  with pytest.raises(ValueError, match=match):
    kfac.keras.optimizers.Kfac(**kwargs)


def test_minibatch_kwargs_of_the_core_optimizer():
  """recipe.minibatch_kwargs() for kfac.PeriodicInvCovUpdateKfacOpt: one
  argument set with the Keras recipe (and the user's overrides)."""
  kwargs = recipe.minibatch_kwargs(learning_rate=0.1)
  keras_side = recipe.keras_minibatch_defaults()
  assert {k: kwargs[k] for k in keras_side} == keras_side
  assert kwargs["learning_rate"] == 0.1 and kwargs["adapt_damping"]
  assert recipe.minibatch_kwargs(invert_every=7)["invert_every"] == 7


# recipe="auto" (adaptive/recipe/switch.py; the core's switch is tested in
# recipe_switch_test.py): the noise measurement sets the switch.
def _auto_data(noise, n=256, seed=0):
  """Two-class data whose labels flip with probability `noise`."""
  rng = np.random.RandomState(seed)
  x = rng.randn(n, 6).astype("float32")
  y = (x[:, 0] + x[:, 1] > 0).astype("int32")
  return x, np.where(rng.rand(n) < noise, 1 - y, y).astype("int32")


def _auto_compiled(recipe_name, **kwargs):
  """A small softmax network compiled with Kfac(recipe=recipe_name)."""
  keras.utils.set_random_seed(1)
  model = keras.Sequential([keras.Input((6,)),
                            keras.layers.Dense(8, activation="tanh"),
                            keras.layers.Dense(2)])
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  opt = kfac.keras.optimizers.Kfac(model=model, loss=loss, adaptive=True,
                                   recipe=recipe_name, seed=3, **kwargs)
  model.compile(optimizer=opt, loss=loss)
  return model, opt


def _auto_fit(recipe_name, noise, batch_size, epochs, **kwargs):
  model, opt = _auto_compiled(recipe_name, **kwargs)
  x, y = _auto_data(noise)
  model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False,
            verbose=0)
  return model, opt


def _recipe_now(opt):
  value = opt.recipe_in_use
  return value if isinstance(value, str) else value.numpy().decode()


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_auto_recipe_below_the_noise_scale_is_the_exact_recipe():
  """With noiseless labels on whole batches of 256 the noise scale stays
  below the batch: recipe="auto" takes the exact recipe's steps (its
  curvature products on a forward pass of their own: float32 rounding)."""
  model, opt = _auto_fit("auto", 0.0, 256, 12)
  assert float(opt.noise_scale) < 256
  assert _recipe_now(opt) == "exact"
  assert int(opt.recipe_switched_at) == -1
  assert opt.kfac_optimizer.config.update.momentum_type == "qmodel"
  want_model, want_opt = _auto_fit("exact", 0.0, 256, 12)
  base._assert_weights(model.get_weights(), want_model.get_weights(),  # pylint: disable=protected-access
                       rtol=1e-4, atol=1e-6)
  assert float(opt.damping.numpy()) == pytest.approx(
      float(want_opt.damping.numpy()), rel=1e-4)
  assert float(np.asarray(opt.learning_rate)) == pytest.approx(
      float(np.asarray(want_opt.learning_rate)), rel=1e-4)
  assert _recipe_now(want_opt) == "exact"


def test_auto_recipe_switches_when_the_noise_scale_passes_the_batch(capfd):
  """With 45% flipped labels on batches of 8 the noise scale, measured
  on the first 5 steps, is larger than the batch: the step switches to the
  minibatch recipe, says so once, and reports it."""
  model, opt = _auto_fit("auto", 0.45, 8, 1, minibatch_learning_rate=0.07)
  assert float(opt.noise_scale) > 8
  assert _recipe_now(opt) == "minibatch"
  assert float(np.asarray(opt.learning_rate)) == pytest.approx(0.07)
  assert float(np.asarray(opt.kfac_optimizer.momentum)) == pytest.approx(
      recipe.MINIBATCH_MOMENTUM)
  err = capfd.readouterr().err
  assert err.count("switches to the minibatch recipe") == 1, err
  assert "at step 4 " in err  # after the 5 measurements
  assert int(opt.recipe_switched_at) == 4
  report = opt.registration_report
  assert "recipe: auto" in report and "now: minibatch" in report
  core = opt.kfac_optimizer
  assert core.recipe_switch.phase == recipe.minibatch_phase(0.07)
  # The config keeps the recipe and its rate.
  config = opt.get_config()
  assert config["recipe"] == "auto"
  assert config["minibatch_learning_rate"] == pytest.approx(0.07)
  again = kfac.keras.optimizers.Kfac.from_config(config)
  assert again.kfac_optimizer.recipe_switch.phase == recipe.minibatch_phase(
      0.07)
  del model


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_auto_recipe_switch_is_saved_state(tmp_path):
  """The switch is K-FAC state: a checkpoint restores it, and the restored
  optimizer's first step runs the minibatch recipe (a fresh one runs the
  exact recipe's burn-in)."""
  model, opt = _auto_fit("auto", 0.45, 8, 1)
  assert _recipe_now(opt) == "minibatch"
  path = tf.train.Checkpoint(model=model, optimizer=opt).save(
      str(tmp_path / "ckpt"))
  for restore in (True, False):
    model2, opt2 = _auto_compiled("auto")
    if restore:
      tf.train.Checkpoint(model=model2, optimizer=opt2).restore(path)
    x, y = _auto_data(0.45)
    model2.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)
    assert _recipe_now(opt2) == ("minibatch" if restore else "exact")


def test_auto_switch_ratio_moves_the_threshold(capfd):
  """The noiseless run that stays exact (noise scale below its batch of
  256) switches at its first check when the threshold is 0.001 x batch."""
  _, opt = _auto_fit("auto", 0.0, 256, 6, auto_switch_ratio=1e-3)
  assert 0.256 < float(opt.noise_scale) < 256
  assert _recipe_now(opt) == "minibatch"
  assert int(opt.recipe_switched_at) == 4
  assert "> 0.001 x batch size 256" in capfd.readouterr().err
