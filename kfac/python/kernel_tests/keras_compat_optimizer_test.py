"""kfac 0.2.x's Keras optimizer contract (kfac.keras.optimizers.Kfac).

TF1 graph mode: inside a tf.compat.v1.Graph (as with v2 behaviour
disabled), the tf_keras `Kfac(...)` is the graph-mode optimizer of
graph_optimizer.py: tf_keras's v1 engine trains with it through
get_updates, custom Session loops call minimize(loss_tensor, var_list).
Checked: a fit step equals the core PeriodicInvCovUpdateKfacOpt's step on
the same registrations (exact Fisher, so no sampling; rtol 1e-5), the
hyperparameter rules (mutable_hyperparameters, setting a number, the
errors for tensors), name, config round trip, loss_tensor, the
train_batch / batch_size rules, callbacks driving a hyperparameter in fit.

TF2: minimize(loss_tensor) inside a tf.function (no tape) makes the same
step as apply_gradients with the tape's gradients, in Keras 3 and tf_keras;
optimizer / mutable_hyperparameters / register_layers; clear errors where
an old usage cannot work (eager minimize of a tensor, loss_tensor=,
register_layers(layer_collection=), Keras 3 in a TF1 graph).
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.keras import callbacks
from kfac.python.keras import optimizers
from kfac.python.keras.optimizer import classes as kfac_classes
from kfac.python.ops.optimizers import kfac_optimizer

# tf_keras is required (make venv installs it): missing, collection fails.
import tf_keras  # pylint: disable=g-import-not-at-top,g-bad-import-order
import tf_keras.src.backend  # pylint: disable=g-import-not-at-top,g-bad-import-order  (get_session)

RNG = np.random.RandomState(0)
X = RNG.rand(32, 3).astype(np.float32)
Y = (X @ np.array([[1.0], [-2.0], [0.5]], np.float32) + 0.3).astype(
    np.float32)
STEPS = 4


def _graph():
  """A TF1 graph with a fixed seed (the layers' initial weights)."""
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.set_random_seed(0)
  return graph.as_default()


def _legacy_kfac(**kwargs):
  return kfac_classes.kfac_class(legacy=True)(**kwargs)


def _init(shape, seed):
  """A constant initializer of fixed random values (no seed dependence)."""
  values = np.random.RandomState(seed).uniform(-0.5, 0.5, shape)
  return tf_keras.initializers.Constant(values.tolist())


def _dense_model():
  return tf_keras.Sequential([tf_keras.layers.Dense(
      1, input_shape=(3,), kernel_initializer=_init((3, 1), 1))])


def _register(layer):
  """A LayerCollection of one Dense layer (no activation) and its mse."""
  lc = kfac.LayerCollection()
  lc.register_fully_connected((layer.kernel, layer.bias), layer.input,
                              layer.output)
  lc.register_squared_error_loss(layer.output)
  return lc


# -- TF1 graph mode -----------------------------------------------------------


def test_graph_mode_class_is_a_legacy_keras_optimizer():
  with _graph():
    opt = _legacy_kfac(learning_rate=0.1, damping=0.01)
    assert isinstance(opt, tf_keras.optimizers.legacy.Optimizer)
    assert type(opt).__name__ == "Kfac"
    assert isinstance(opt, kfac_classes.kfac_class(legacy=True))
  # Outside a TF1 graph the TF2 class.
  opt = _legacy_kfac(learning_rate=0.1, damping=0.01)
  assert isinstance(opt, tf_keras.optimizers.Optimizer)


def test_graph_fit_equals_core_optimizer_steps():
  with _graph():
    model = _dense_model()
    layer = model.layers[0]
    opt = _legacy_kfac(learning_rate=0.2, damping=0.05,
                       layer_collection=_register(layer),
                       estimation_mode="exact", invert_every=1)
    model.compile(opt, "mse")
    sess = tf_keras.src.backend.get_session()
    # The reference: the core optimizer on a copy of the layer.
    x_in = tf.compat.v1.placeholder(tf.float32, [None, 3])
    y_in = tf.compat.v1.placeholder(tf.float32, [None, 1])
    ref = tf_keras.layers.Dense(1)
    ref_out = ref(x_in)
    lc = kfac.LayerCollection()
    lc.register_fully_connected((ref.kernel, ref.bias), x_in, ref_out)
    lc.register_squared_error_loss(ref_out)
    core = kfac_optimizer.PeriodicInvCovUpdateKfacOpt(
        learning_rate=0.2, damping=0.05, layer_collection=lc,
        estimation_mode="exact", invert_every=1, name="reference")
    ref_loss = tf.reduce_mean(tf.square(ref_out - y_in))
    train = core.minimize(ref_loss, var_list=[ref.kernel, ref.bias])
    sess.run(tf.compat.v1.variables_initializer(
        [v for v in tf.compat.v1.global_variables()
         if v not in model.weights]))
    ref.set_weights(model.get_weights())
    history = model.fit(X, Y, batch_size=len(X), epochs=STEPS, shuffle=False,
                        verbose=0)
    ref_losses = []
    for _ in range(STEPS):
      ref_losses.append(sess.run([train, ref_loss], {x_in: X, y_in: Y})[1])
    np.testing.assert_allclose(history.history["loss"], ref_losses,
                               rtol=1e-5)
    for got, want in zip(model.get_weights(), ref.get_weights()):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert tf_keras.backend.get_value(opt.iterations) == STEPS
    # The K-FAC state is in the optimizer's weights after the first step.
    assert len(opt.weights) > 1 + len(opt.mutable_hyperparameters)
    assert isinstance(opt.optimizer, kfac_optimizer.PeriodicInvCovUpdateKfacOpt)
    assert opt.layers is opt.optimizer.layers


def test_graph_custom_session_loop_minimize_loss_tensor():
  with _graph():
    model = _dense_model()
    layer = model.layers[0]
    x_in = tf.constant(X)
    pred = model(x_in)
    lc = kfac.LayerCollection()
    lc.register_fully_connected((layer.kernel, layer.bias), x_in, pred)
    lc.register_squared_error_loss(pred)
    loss = tf.reduce_mean(tf.square(pred - Y))
    opt = _legacy_kfac(learning_rate=0.2, damping=0.05, layer_collection=lc)
    train_op = opt.minimize(loss, var_list=model.trainable_weights)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      losses = [sess.run([train_op, loss])[1] for _ in range(STEPS)]
      assert losses[-1] < losses[0]
      assert sess.run(opt.iterations) == STEPS


def test_graph_hyperparameters():
  with _graph():
    opt = _legacy_kfac(learning_rate=0.1, damping=0.01)
    assert opt.mutable_hyperparameters == {
        "learning_rate", "damping", "momentum", "weight_decay_coeff"}
    assert optimizers._MUTABLE_HYPER_PARAMS == {
        "learning_rate", "damping", "momentum", "weight_decay_coeff",
        "norm_constraint"}
    get = tf_keras.backend.get_value
    opt.lr = 0.3
    assert get(opt.learning_rate) == pytest.approx(0.3)
    opt.damping = 0.5
    assert get(opt.damping) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="Dynamic reassignment only"):
      opt.damping = tf.constant(2.0)
    opt.momentum = 0.7  # after the variables exist: assigned
    assert get(opt.momentum) == pytest.approx(0.7)
    tensor_lr = _legacy_kfac(learning_rate=tf.constant(0.1), damping=0.01,
                             norm_constraint=2.0)
    assert "norm_constraint" in tensor_lr.mutable_hyperparameters
    assert get(tensor_lr.learning_rate) == pytest.approx(0.1)
    with pytest.raises(AttributeError, match="Can't set attribute: "
                       "learning_rate"):
      tensor_lr.learning_rate = 0.2
    qmodel = _legacy_kfac(damping=0.01, momentum_type="qmodel")
    assert qmodel.mutable_hyperparameters == {"damping",
                                              "weight_decay_coeff"}
    adapt = _legacy_kfac(learning_rate=0.1, damping=0.01, adapt_damping=True)
    assert "damping" not in adapt.mutable_hyperparameters


def test_graph_argument_errors():
  with _graph():
    with pytest.raises(ValueError, match="Do not pass positional"):
      kfac_classes.kfac_class(legacy=True)(0.1, 0.1)
    with pytest.raises(ValueError, match="damping"):
      _legacy_kfac(learning_rate=0.1)
    with pytest.raises(ValueError, match="norm_constraint"):
      _legacy_kfac(learning_rate=0.1, damping=0.1, clipnorm=1.0)
    with pytest.raises(ValueError, match="clipvalue"):
      _legacy_kfac(learning_rate=0.1, damping=0.1, clipvalue=1.0)
    for kwargs in ({"adaptive": True}, {"momentum_type": "qmodel"}):
      with pytest.raises(ValueError, match="learning_rate must be None"):
        _legacy_kfac(learning_rate=0.1, damping=0.1, **kwargs)
    opt = _legacy_kfac(learning_rate=0.1, damping=0.1)
    with pytest.raises(ValueError, match="provide a model with a loss"):
      _ = opt.optimizer
    with pytest.raises(ValueError, match="provide a model with a loss"):
      opt.register_layers(model=_dense_model())  # not compiled: no loss
    # train_batch: a tuple of tensors with a known batch size.
    batch = (tf.compat.v1.placeholder(tf.float32, [None, 3]),
             tf.compat.v1.placeholder(tf.float32, [None, 1]))
    with pytest.raises(ValueError, match="Could not infer batch_size"):
      _legacy_kfac(damping=1.0, adaptive=True, train_batch=batch)
    with pytest.raises(ValueError, match="train_batch tuple"):
      _legacy_kfac(damping=1.0, adaptive=True, train_batch=[X, Y])
    ok = _legacy_kfac(damping=1.0, adaptive=True,
                      train_batch=(tf.constant(X), tf.constant(Y)))
    assert ok._kfac_kwargs["batch_size"] == len(X)


def test_graph_name_config_and_loss_tensor():
  with _graph():
    model = _dense_model()
    opt = _legacy_kfac(learning_rate=0.1, damping=0.01, momentum=0.8,
                       invert_every=3, fisher_approx={
                           tf_keras.layers.Dense: "kron_in_diag"},
                       loss="mse", seed=5)
    opt.name = "renamed"
    config = opt.get_config()
    assert config["name"] == "renamed" and config["invert_every"] == 3
    assert config["momentum"] == pytest.approx(0.8)
    assert config["seed"] == 5 and config["loss"] == "mse"
    assert list(config["fisher_approx"].values()) == ["kron_in_diag"]
    copy = type(opt).from_config(config)
    assert copy.get_config() == config
    loss_tensor = tf.constant(2.0)
    plain = _legacy_kfac(learning_rate=0.1, damping=0.01,
                         loss_tensor=loss_tensor,
                         layer_collection=_register(model.layers[0]))
    assert plain.loss_tensor is loss_tensor
    # Kept by the core as kfac 0.2.x did (its tests read _loss_tensor); only
    # the damping rule uses it, so the core says it is unused.
    with pytest.warns(UserWarning, match="used by the damping adaptation"):
      core = plain.optimizer
    assert core._loss is loss_tensor and core._loss_tensor is loss_tensor
    adapt = _legacy_kfac(learning_rate=0.1, damping=0.01, adapt_damping=True,
                         loss_tensor=loss_tensor,
                         layer_collection=_register(model.layers[0]),
                         train_batch=(tf.constant(X), tf.constant(Y)),
                         loss_fn=lambda batch: loss_tensor)
    assert adapt.optimizer._loss is loss_tensor
    assert adapt.loss_tensor is loss_tensor
    with pytest.raises(ValueError, match="after the variables are created"):
      adapt.name = "other"


@pytest.mark.parametrize("kwargs", [dict(adaptive=True),
                                    dict(adapt_damping=True,
                                         learning_rate=0.1)])
def test_graph_adaptive_fit_adapts_the_damping(kwargs):
  with _graph():
    model = _dense_model()
    opt = _legacy_kfac(damping=1.0, model=model, loss="mse",
                       layer_collection=_register(model.layers[0]),
                       train_batch=(tf.constant(X), tf.constant(Y)), **kwargs)
    assert opt._kfac_kwargs["batch_size"] == len(X)
    model.compile(opt, "mse")
    history = model.fit(X, Y, batch_size=len(X), epochs=10, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.5 * losses[0]
    # Adapted every 5 steps (the old default interval): no longer 1.0.
    assert tf_keras.backend.get_value(opt.optimizer.damping) != 1.0
    assert "damping" not in opt.mutable_hyperparameters


def test_graph_callback_schedules_damping_in_fit():
  with _graph():
    model = _dense_model()
    opt = _legacy_kfac(learning_rate=0.05, damping=0.1,
                       layer_collection=_register(model.layers[0]))
    model.compile(opt, "mse")
    seen = []

    class Record(tf_keras.callbacks.Callback):

      def on_train_batch_end(self, batch, logs=None):
        seen.append(float(tf_keras.backend.get_value(opt.damping)))

    schedule = callbacks.ExponentialDecay("damping", init_value=0.1,
                                          decay_rate=0.5, num_decay_steps=2)
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0, shuffle=False,
              callbacks=[schedule, Record()])
    np.testing.assert_allclose(seen, [0.1, 0.05, 0.025, 0.025], rtol=1e-6)


# -- TF2 ----------------------------------------------------------------------


def _keras(legacy):
  if legacy:
    return tf_keras
  import keras  # pylint: disable=g-import-not-at-top
  return keras


def _tf2_model(keras):
  return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])


def test_tf2_minimize_loss_tensor_equals_apply_gradients():
  keras = _keras(False)
  cls = kfac_classes.kfac_class(legacy=False)
  keras.utils.set_random_seed(1)
  a = _tf2_model(keras)
  b = _tf2_model(keras)
  b.set_weights(a.get_weights())
  opt_a = cls(learning_rate=0.1, damping=0.01, model=a, loss="mse", seed=3)
  opt_b = cls(learning_rate=0.1, damping=0.01, model=b, loss="mse", seed=3)
  x, y = tf.constant(X), tf.constant(Y)

  @tf.function
  def step_a():
    loss = tf.reduce_mean(tf.square(a(x, training=True) - y))
    opt_a.minimize(loss, a.trainable_variables)  # no tape
    return loss

  @tf.function
  def step_b():
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(b(x, training=True) - y))
    grads = tape.gradient(loss, b.trainable_variables)
    opt_b.apply_gradients(zip(grads, b.trainable_variables))
    return loss

  losses = [(float(step_a()), float(step_b())) for _ in range(STEPS)]
  np.testing.assert_allclose(*zip(*losses), rtol=1e-6)
  for wa, wb in zip(a.get_weights(), b.get_weights()):
    np.testing.assert_allclose(wa, wb, rtol=1e-6, atol=1e-7)
  assert losses[-1][0] < losses[0][0]
  with pytest.raises(RuntimeError, match="inside a tf.function"):
    opt_a.minimize(tf.constant(1.0), a.trainable_variables)


@pytest.mark.slow  # the Keras 3 test's mixin code, traced by tf_keras
def test_tf2_tf_keras_minimize_loss_tensor():
  # The same mixin code as Keras 3 above; one trace (tf_keras traces slowly).
  cls = kfac_classes.kfac_class(legacy=True)
  model = _tf2_model(tf_keras)
  opt = cls(learning_rate=0.1, damping=0.01, model=model, loss="mse")
  x, y = tf.constant(X), tf.constant(Y)

  @tf.function
  def step():
    loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
    opt.minimize(loss)  # no tape; var_list: the model's
    return loss

  losses = [float(step()) for _ in range(STEPS)]
  assert losses[-1] < losses[0]
  assert int(opt.iterations.numpy()) == STEPS


@pytest.mark.parametrize("legacy", [False, True])
def test_tf2_old_names_and_errors(legacy):
  keras = _keras(legacy)
  cls = kfac_classes.kfac_class(legacy=legacy)
  model = _tf2_model(keras)
  opt = cls(learning_rate=0.1, damping=0.01)
  assert isinstance(opt.optimizer, kfac_optimizer.PeriodicInvCovUpdateKfacOpt)
  assert opt.optimizer is opt.kfac_optimizer
  assert opt.mutable_hyperparameters == {
      "learning_rate", "damping", "momentum", "weight_decay_coeff"}
  with pytest.raises(ValueError, match="provide a model"):
    opt.register_layers()
  with pytest.raises(ValueError, match="rebuilt from the model"):
    opt.register_layers(layer_collection=kfac.LayerCollection())
  opt.register_layers(model=model, loss="mse")
  assert opt.model is model
  with pytest.raises(ValueError, match="disagrees"):
    opt.register_layers(model=model, loss="binary_crossentropy")
  with pytest.raises(ValueError, match="minimize"):
    cls(learning_rate=0.1, damping=0.01, loss_tensor=tf.constant(1.0))
  with pytest.raises(ValueError, match="learning_rate must be None"):
    cls(learning_rate=0.1, damping=0.01, adaptive=True)
  adaptive = cls(learning_rate=None, damping=0.01, adaptive=True)
  assert adaptive.mutable_hyperparameters == {"weight_decay_coeff"}


def test_keras3_in_a_tf1_graph_names_tf_keras():
  with _graph():
    with pytest.raises(RuntimeError, match="TF_USE_LEGACY_KERAS=1"):
      kfac_classes.kfac_class(legacy=False)(learning_rate=0.1, damping=0.01)


# -- TF1 graph mode with model= (registration from the layers' graph nodes) ---


def _mlp():
  return tf_keras.Sequential([
      tf_keras.layers.Dense(8, input_shape=(3,), activation="tanh",
                            kernel_initializer=_init((3, 8), 2)),
      tf_keras.layers.Dense(1, kernel_initializer=_init((8, 1), 3))])


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_graph_model_fit_and_session_loop():
  with _graph():
    model = _mlp()
    opt = _legacy_kfac(learning_rate=0.2, damping=0.05, model=model,
                       loss="mse", seed=1)
    model.compile(opt, "mse")
    history = model.fit(X, Y, batch_size=len(X), epochs=STEPS, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    registered = {v.ref() for v in opt.layers.registered_variables}
    assert registered == {v.ref() for v in model.trainable_weights}
  with _graph():
    # kfac 0.2.x's custom loop: the optimizer made before the model is
    # called on the data tensors, then minimize(loss_tensor), no tape.
    model = _mlp()
    opt = _legacy_kfac(learning_rate=0.1, damping=0.05, model=model,
                       loss="mse", seed=1)
    pred = model(tf_keras.Input(tensor=tf.constant(X)))
    loss = tf.reduce_mean(tf.square(pred - Y))
    train_op = opt.minimize(loss, var_list=model.trainable_weights)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      losses = [sess.run([train_op, loss])[1] for _ in range(STEPS)]
    assert losses[-1] < losses[0]


@pytest.mark.slow  # end to end: HDF5 save / load
def test_graph_hdf5_save_and_load_continue_alike(tmp_path):
  from kfac.python.keras import saving_utils  # pylint: disable=g-import-not-at-top
  path = str(tmp_path / "model.h5")
  with _graph():
    model = _mlp()
    opt = _legacy_kfac(learning_rate=0.1, damping=0.05, model=model,
                       loss="mse", estimation_mode="exact", invert_every=1)
    model.compile(opt, "mse")
    model.fit(X, Y, batch_size=len(X), epochs=2, verbose=0)
    model.save(path)
    loaded = saving_utils.load_model(path, optimizer_name="new")
    assert isinstance(loaded.optimizer, kfac_classes.kfac_class(legacy=True))
    assert loaded.optimizer.name == "new"
    for a, b in zip(opt.get_weights(), loaded.optimizer.get_weights()):
      np.testing.assert_allclose(a, b)
    model.train_on_batch(X, Y)
    loaded.train_on_batch(X, Y)
    for a, b in zip(model.get_weights(), loaded.get_weights()):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
