"""Tests of kfac.keras.optimizers.Kfac in model.fit and custom loops.

Runs under the Keras of `tf.keras` (Keras 3 by default); `test_tf_keras`
runs most of this file again in a subprocess with TF_USE_LEGACY_KERAS=1
(tf_keras).

What is checked, and how tightly (float32 models, so the tolerances are a
few float32 ulps of the accumulated steps):
* the weights after 3 `fit` steps equal 3 steps of
  kfac.PeriodicInvCovUpdateKfacOpt on the same model written with raw TF
  ops in a TF1 Session graph and registered by hand (rtol 2e-5), in the
  "exact" mode and in the sampled "gradients" mode (the same stateless
  (seed, step) samples);
* Sequential, functional, subclassed and nested models give the same steps
  (atol 1e-6);
* model.save + kfac.keras.saving_utils.load_model and tf.train.Checkpoint
  resume on exactly the same trajectory (losses and weights bit-identical);
* get_config / from_config round trip, and the rebuilt optimizer takes the
  same steps;
* jit_compile=True gives the same steps as jit_compile=False (rtol 1e-5);
* a custom tf.function loop (with and without XLA) takes the same steps as
  fit;
* a damping change between steps takes effect without retracing;
* TensorBoard scalars are written when a summary writer is active;
* bad input raises clear errors.
"""

import glob
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import kfac
import kfac.keras
from kfac.python.keras import keras_flavor

keras = keras_flavor.keras_module()
LEGACY = keras_flavor.legacy_keras_active()

N, D_IN, D_H, D_OUT, BATCH = 48, 6, 8, 3, 16
LR, DAMPING, SEED = 0.05, 0.01, 7


def _data():
  rng = np.random.RandomState(0)
  x = rng.randn(N, D_IN).astype(np.float32)
  y = rng.randint(0, D_OUT, size=N).astype(np.int32)
  return x, y


def _weights():
  rng = np.random.RandomState(1)
  return [(rng.randn(D_IN, D_H) * 0.5).astype(np.float32),
          (rng.randn(D_H) * 0.1).astype(np.float32),
          (rng.randn(D_H, D_OUT) * 0.5).astype(np.float32),
          (rng.randn(D_OUT) * 0.1).astype(np.float32)]


def _layers():
  return (keras.layers.Dense(D_H, activation="tanh", name="hidden"),
          keras.layers.Dense(D_OUT, activation="softmax", name="out"))


def sequential_model():
  hidden, out = _layers()
  return keras.Sequential([keras.Input((D_IN,)), hidden, out], name="seq")


def functional_model():
  hidden, out = _layers()
  inputs = keras.Input((D_IN,))
  return keras.Model(inputs, out(hidden(inputs)), name="func")


class Subclassed(keras.Model):

  def __init__(self):
    super().__init__(name="sub")
    self.hidden, self.out = _layers()

  def call(self, inputs):
    return self.out(self.hidden(inputs))


def subclassed_model():
  model = Subclassed()
  model(np.zeros((1, D_IN), np.float32))
  return model


def nested_model():
  hidden, out = _layers()
  inner = keras.Sequential([keras.Input((D_IN,)), hidden], name="inner")
  inputs = keras.Input((D_IN,))
  return keras.Model(inputs, out(inner(inputs)), name="outer")


def _compile(model, jit_compile=False, **kwargs):
  model.set_weights(_weights())
  options = dict(learning_rate=LR, damping=DAMPING, model=model,
                 loss="sparse_categorical_crossentropy", invert_every=1,
                 momentum=0.9, seed=SEED)
  options.update(kwargs)
  opt = kfac.keras.optimizers.Kfac(**options)
  compile_kwargs = {} if LEGACY and not jit_compile else {
      "jit_compile": jit_compile}
  model.compile(optimizer=opt, loss="sparse_categorical_crossentropy",
                **compile_kwargs)
  return model, opt


class _Losses(keras.callbacks.Callback):

  def __init__(self):
    super().__init__()
    self.values = []

  def on_train_batch_end(self, batch, logs=None):
    self.values.append(float(logs["loss"]))


def _fit(model, first, last):
  """Steps first..last-1 (one fit call per batch: logs hold that batch's
  loss, not a running mean)."""
  x, y = _data()
  losses = []
  for i in range(first, last):
    cb = _Losses()
    model.fit(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH],
              batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[cb])
    losses.extend(cb.values)
  return losses


def _tf1_reference(steps, estimation_mode, dampings=None, approx=None):
  """Weights after `steps` K-FAC steps of the same model in a TF1 graph
  (both layers registered with `approx`, default: the collection's)."""
  x_all, y_all = _data()
  dampings = dampings or [DAMPING] * steps
  graph = tf.Graph()
  with graph.as_default():
    w1, b1, w2, b2 = [tf.compat.v1.Variable(w) for w in _weights()]
    x = tf.compat.v1.placeholder(tf.float32, [BATCH, D_IN])
    y = tf.compat.v1.placeholder(tf.int32, [BATCH])
    step = tf.compat.v1.placeholder(tf.int64, [])
    damping = tf.compat.v1.Variable(DAMPING, trainable=False)
    pre1 = tf.matmul(x, w1) + b1
    hidden = tf.tanh(pre1)
    logits = tf.matmul(hidden, w2) + b2
    loss = tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                       logits=logits))
    lc = kfac.LayerCollection()
    lc.register_fully_connected((w1, b1), x, pre1, approx=approx)
    lc.register_fully_connected((w2, b2), hidden, logits, approx=approx)
    lc.register_categorical_predictive_distribution(
        logits, seed=tf.stack([tf.constant(SEED, tf.int64), step]))
    opt = kfac.PeriodicInvCovUpdateKfacOpt(
        learning_rate=LR, damping=damping, layer_collection=lc,
        invert_every=1, momentum=0.9, estimation_mode=estimation_mode)
    train = opt.minimize(loss, var_list=[w1, b1, w2, b2])
    with tf.compat.v1.Session(graph=graph) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      for i in range(steps):
        damping.load(dampings[i], sess)
        sess.run(train, {x: x_all[i * BATCH:(i + 1) * BATCH],
                         y: y_all[i * BATCH:(i + 1) * BATCH], step: i})
      return sess.run([w1, b1, w2, b2])


def _assert_weights(actual, expected, rtol=2e-5, atol=1e-6):
  assert len(actual) == len(expected)
  for a, e in zip(actual, expected):
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


@pytest.mark.parametrize("mode", ["exact", "gradients"])
def test_fit_equals_tf1_graph_steps(mode):
  model, _ = _compile(sequential_model(), estimation_mode=mode)
  _fit(model, 0, 3)
  expected = _tf1_reference(3, mode)
  _assert_weights(model.get_weights(), expected)
  # The steps moved the weights well beyond the tolerance.
  assert max(np.max(np.abs(a - b)) for a, b in
             zip(expected, _weights())) > 0.05


@pytest.mark.parametrize("make", [
    functional_model,
    pytest.param(subclassed_model, marks=pytest.mark.slow),  # more styles:
    pytest.param(nested_model, marks=pytest.mark.slow)])  # end to end
def test_model_styles_take_the_same_steps(make):
  reference, _ = _compile(sequential_model())
  _fit(reference, 0, 2)
  model, opt = _compile(make())
  _fit(model, 0, 2)
  _assert_weights(model.get_weights(), reference.get_weights(), rtol=0,
                  atol=1e-6)
  report = opt.registration_report
  assert report.count("FullyConnectedKFACBasicFB") == 2, report
  assert "categorical on logits" in report, report


@pytest.mark.slow  # end to end: custom loops, with XLA
def test_custom_loop_takes_the_same_steps_as_fit():
  reference, _ = _compile(sequential_model())
  _fit(reference, 0, 3)
  x_all, y_all = _data()
  for jit in (False, True):
    model = sequential_model()
    model.set_weights(_weights())
    opt = kfac.keras.optimizers.Kfac(
        learning_rate=LR, damping=DAMPING, model=model,
        loss="sparse_categorical_crossentropy", invert_every=1,
        momentum=0.9, seed=SEED)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    @tf.function(jit_compile=jit)
    def step(x, y):
      with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))  # pylint: disable=cell-var-from-loop
      grads = tape.gradient(loss, model.trainable_variables)  # pylint: disable=cell-var-from-loop
      opt.apply_gradients(zip(grads, model.trainable_variables))  # pylint: disable=cell-var-from-loop
      return loss

    for i in range(3):
      step(x_all[i * BATCH:(i + 1) * BATCH], y_all[i * BATCH:(i + 1) * BATCH])
    _assert_weights(model.get_weights(), reference.get_weights(), rtol=1e-5)


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("how", ["get_layer_collection", "register_layer"])
def test_core_optimizer_with_keras_registration(how):
  """kfac.keras.utils registrations drive the core optimizer in a custom
  loop to the same steps as fit."""
  reference, _ = _compile(sequential_model())
  _fit(reference, 0, 3)
  x_all, y_all = _data()
  model = sequential_model()
  model.set_weights(_weights())
  kfac.keras.utils.watch(model)
  variables = [keras_flavor.unwrap_variable(v)
               for v in model.trainable_variables]
  opt = kfac.PeriodicInvCovUpdateKfacOpt(
      learning_rate=LR, damping=DAMPING, invert_every=1, momentum=0.9)
  loss_fn = keras.losses.SparseCategoricalCrossentropy()

  @tf.function
  def step(x, y, i):
    with tf.GradientTape() as tape:
      probs = model(x, training=True)
      loss = loss_fn(y, probs)
    seed = tf.stack([tf.constant(SEED, tf.int64), i])
    if how == "get_layer_collection":
      lc, _ = kfac.keras.utils.register_model(
          model, "sparse_categorical_crossentropy", seed=seed)
    else:
      lc = kfac.LayerCollection()
      for layer in model.layers:
        kfac.keras.utils.register_layer(lc, layer)
      kfac.keras.utils.register_loss(lc, "sparse_categorical_crossentropy",
                                     probs, seed=seed)
    grads = tape.gradient(loss, variables)
    opt.apply_gradients(list(zip(grads, variables)), layer_collection=lc)

  for i in range(3):
    step(x_all[i * BATCH:(i + 1) * BATCH], y_all[i * BATCH:(i + 1) * BATCH],
         tf.constant(i, tf.int64))
  _assert_weights(model.get_weights(), reference.get_weights(), rtol=1e-5)


@pytest.mark.slow  # end to end: XLA compile of the fit step
def test_xla_gives_the_same_steps():
  plain, _ = _compile(sequential_model(), jit_compile=False)
  _fit(plain, 0, 3)
  xla, _ = _compile(sequential_model(), jit_compile=True)
  _fit(xla, 0, 3)
  _assert_weights(xla.get_weights(), plain.get_weights(), rtol=1e-5)


@pytest.mark.slow  # end to end: save / load round trip
def test_save_load_resumes_exactly(tmp_path):
  full, _ = _compile(functional_model())
  full_losses = _fit(full, 0, 3)
  first, _ = _compile(functional_model())
  losses = _fit(first, 0, 2)
  path = str(tmp_path / "model.keras")
  first.save(path)
  loaded = kfac.keras.saving_utils.load_model(path)
  assert isinstance(loaded.optimizer, kfac.keras.optimizers.Kfac)
  assert loaded.optimizer.model is loaded
  # All K-FAC state came back: factors, inverses, velocities, counter.
  saved = first.optimizer.state_store.numpy_state()
  restored = loaded.optimizer.state_store.numpy_state()
  assert sorted(saved) == sorted(restored) and len(saved) > 10
  for key in saved:
    np.testing.assert_array_equal(saved[key], restored[key], err_msg=key)
  losses += _fit(loaded, 2, 3)
  assert losses == full_losses
  for a, b in zip(loaded.get_weights(), full.get_weights()):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_checkpoint_resumes_exactly(tmp_path):
  full, _ = _compile(sequential_model())
  full_losses = _fit(full, 0, 3)
  first, opt = _compile(sequential_model())
  losses = _fit(first, 0, 2)
  path = tf.train.Checkpoint(model=first, optimizer=opt).save(
      str(tmp_path / "ckpt"))
  second, opt2 = _compile(sequential_model())
  tf.train.Checkpoint(model=second, optimizer=opt2).restore(
      path).assert_existing_objects_matched()
  losses += _fit(second, 2, 3)
  assert losses == full_losses
  for a, b in zip(second.get_weights(), full.get_weights()):
    np.testing.assert_array_equal(a, b)
  assert int(opt2.kfac_optimizer.counter.numpy()) == 3


def _unnamed_model():
  return keras.Sequential([keras.Input((D_IN,)),
                           keras.layers.Dense(D_H, activation="tanh"),
                           keras.layers.Dense(D_OUT, activation="softmax")])


@pytest.mark.slow  # end to end: resume
def test_checkpoint_resumes_into_a_rebuilt_model_with_other_names(tmp_path):
  """K-FAC state is keyed by layer position, so a model rebuilt in the same
  process (other automatic layer names) gets all of it back."""
  full, _ = _compile(_unnamed_model())
  full_losses = _fit(full, 0, 3)
  first, opt = _compile(_unnamed_model())
  losses = _fit(first, 0, 2)
  path = tf.train.Checkpoint(model=first, optimizer=opt).save(
      str(tmp_path / "ckpt"))
  second, opt2 = _compile(_unnamed_model())
  assert second.layers[0].name != first.layers[0].name
  tf.train.Checkpoint(model=second, optimizer=opt2).restore(path)
  losses += _fit(second, 2, 3)
  assert losses == full_losses
  saved = opt.state_store.numpy_state()
  assert sorted(saved) == sorted(opt2.state_store.numpy_state())


@pytest.mark.slow  # end to end: rebuilt from its config, trained again
def test_config_round_trip():
  model, opt = _compile(sequential_model(), cov_ema_decay=0.9,
                        norm_constraint=1.0,
                        fisher_approx={"hidden": "kron_in_diag",
                                       keras.layers.Dense: "kron"})
  config = opt.get_config()
  assert config["fisher_approx"] == {"hidden": "kron_in_diag",
                                     "__class__:Dense": "kron"}
  assert config["cov_ema_decay"] == 0.9 and config["seed"] == SEED
  rebuilt = kfac.keras.optimizers.Kfac.from_config(config)
  assert rebuilt.get_config() == config
  # The rebuilt optimizer, given the model, takes the same steps.
  other = sequential_model()
  other.set_weights(_weights())
  rebuilt.register_model(other)
  other.compile(optimizer=rebuilt, loss="sparse_categorical_crossentropy")
  _fit(other, 0, 2)
  _fit(model, 0, 2)
  _assert_weights(other.get_weights(), model.get_weights(), rtol=0, atol=0)
  assert "FullyConnectedKFACBasicFB" in rebuilt.registration_report


def test_hyperparameter_change_takes_effect_without_retracing():
  model, opt = _compile(sequential_model(), estimation_mode="exact")
  _fit(model, 0, 1)
  train_function = model.train_function
  opt.damping = 0.3
  _fit(model, 1, 3)
  assert model.train_function is train_function
  assert float(opt.damping.numpy()) == pytest.approx(0.3)
  _assert_weights(model.get_weights(),
                  _tf1_reference(3, "exact", [DAMPING, 0.3, 0.3]))


def fit_with_summaries(model, directory, steps):
  """Fits `steps` batches with a summary writer on `directory`; returns the
  scalars written, {tag: [(step, value), ...]}."""
  writer = tf.summary.create_file_writer(str(directory))
  with writer.as_default():
    _fit(model, 0, steps)
  writer.flush()
  seen = {}
  for path in glob.glob(os.path.join(str(directory), "events.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        seen.setdefault(value.tag, []).append(
            (event.step, float(tf.make_ndarray(value.tensor))))
  return seen


def test_tensorboard_scalars(tmp_path):
  model, opt = _compile(sequential_model())
  opt.damping = 0.02
  seen = fit_with_summaries(model, tmp_path, 2)
  assert sorted(seen) == ["kfac/damping", "kfac/learning_rate",
                          "kfac/momentum", "kfac/skipped_steps"], seen
  assert seen["kfac/skipped_steps"] == [(0, 0), (1, 0)]
  assert seen["kfac/damping"] == [(0, pytest.approx(0.02)),
                                  (1, pytest.approx(0.02))]
  assert seen["kfac/learning_rate"][0][1] == pytest.approx(LR)


def test_errors():
  model = sequential_model()
  make = kfac.keras.optimizers.Kfac
  with pytest.raises(ValueError, match="learning_rate"):
    make(damping=0.1, model=model)
  with pytest.raises(ValueError, match="damping"):
    make(learning_rate=0.1, model=model)
  with pytest.raises(ValueError, match="adaptive"):
    make(learning_rate=0.1, damping=0.1, adaptive=True)
  with pytest.raises(ValueError, match="clipnorm"):
    make(learning_rate=0.1, damping=0.1, clipnorm=1.0)
  with pytest.raises(ValueError, match="layer_collection"):
    make(learning_rate=0.1, damping=0.1,
         layer_collection=kfac.LayerCollection())
  with pytest.raises(ValueError, match="huber"):
    make(learning_rate=0.1, damping=0.1, loss="huber")
  with pytest.raises(ValueError, match="momentum_type"):
    make(learning_rate=0.1, damping=0.1, momentum_type="nesterov")
  with pytest.raises(ValueError, match="no_such_layer"):
    make(learning_rate=0.1, damping=0.1, model=model,
         fisher_approx={"no_such_layer": "diagonal"})
  opt = make(learning_rate=0.1, damping=0.1, model=model)
  with pytest.raises(ValueError, match="norm_constraint"):
    opt.norm_constraint = 1.0
  with pytest.raises(ValueError, match="already serves"):
    opt.register_model(sequential_model())


def test_run_eagerly_is_rejected():
  model, _ = _compile(sequential_model())
  model.compile(optimizer=model.optimizer,
                loss="sparse_categorical_crossentropy", run_eagerly=True)
  with pytest.raises(RuntimeError, match="traced"):
    _fit(model, 0, 1)


def test_optimizer_without_model_says_how_to_fix():
  model = sequential_model()
  opt = kfac.keras.optimizers.Kfac(learning_rate=0.1, damping=0.1,
                                   loss="sparse_categorical_crossentropy")
  model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
  with pytest.raises(ValueError, match="register_model"):
    _fit(model, 0, 1)


def run_file_under_tf_keras(path, select=None):
  """Runs the tests of `path` (those matching `select`, a pytest -k
  expression) in a subprocess with TF_USE_LEGACY_KERAS=1."""
  env = dict(os.environ, TF_USE_LEGACY_KERAS="1")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__)))))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  args = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
  if select:
    args += ["-k", select]
  result = subprocess.run(args + [os.path.abspath(path)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
  assert " passed" in result.stdout


@pytest.mark.slow  # subprocess: the file again under tf_keras
def test_tf_keras():
  """The fit, model-style, resume, config and error tests of this file
  again under tf_keras (TF_USE_LEGACY_KERAS=1)."""
  if LEGACY:
    return  # this is the run under tf_keras
  run_file_under_tf_keras(
      __file__, "fit_equals or model_styles or resumes or config or errors "
      "or without_model")


@pytest.mark.slow  # end to end: save, load
def test_restored_state_that_matches_nothing_is_reported():
  model, opt = _compile(sequential_model())
  _fit(model, 0, 1)
  store = {}
  opt.save_own_variables(store)
  assert any(k.startswith("kfac_state:") for k in store)
  # State saved from a model whose first Dense sat elsewhere.
  assert any("01_Dense" in k for k in store), sorted(store)
  renamed = {(k.replace("01_Dense", "07_Dense") if k.startswith("kfac_state:")
              else k): v for k, v in store.items()}
  other, opt2 = _compile(sequential_model())
  opt2.load_own_variables(renamed)
  with pytest.warns(UserWarning, match="match no variable"):
    _fit(other, 0, 1)
  with pytest.raises(ValueError, match="Keras variables"):
    opt2.load_own_variables({"0": np.zeros(())})


_STRATEGY_SCRIPT = """
import sys
import numpy as np, tensorflow as tf
R = int(sys.argv[1])
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * R)
import kfac.keras
from kfac.python.keras import keras_flavor
keras = keras_flavor.keras_module()
rng = np.random.RandomState(0)
data = {"dense": (rng.randn(16, 4).astype(np.float32), rng.randint(0, 3, 16)),
        "conv": (rng.randn(16, 6, 6, 2).astype(np.float32),
                 rng.randint(0, 3, 16)),
        "gru": (rng.randn(16, 5, 3).astype(np.float32),
                rng.randint(0, 3, 16))}

def build(kind):
  keras.utils.set_random_seed(1)
  if kind == "dense":
    return keras.Sequential([keras.Input((4,)),
                             keras.layers.Dense(5, activation="tanh"),
                             keras.layers.Dense(3)])
  if kind == "gru":  # the recorded formulation of recurrent.py per replica
    return keras.Sequential([keras.Input((5, 3)), keras.layers.GRU(4),
                             keras.layers.Dense(3)])
  return keras.Sequential([keras.Input((6, 6, 2)),
                           keras.layers.Conv2D(3, 3, activation="tanh"),
                           keras.layers.Flatten(), keras.layers.Dense(3)])

def fit(strategy, kind, **kwargs):
  args = dict(learning_rate=0.05, damping=0.1, estimation_mode="exact",
              momentum=0.9, invert_every=2)
  args.update(kwargs)
  with strategy.scope():
    m = build(kind)
    opt = kfac.keras.optimizers.Kfac(model=m, **args)
    m.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
  x, y = data[kind]
  m.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0)
  return m

# One strategy per process (a second one over the same devices would reuse
# its collective keys).
mirrored = tf.distribute.MirroredStrategy(["/cpu:%d" % i for i in range(R)])
# "options": the dense model with the lazy statistics sync and the inverses
# placed round robin over the replicas.
OPTIONS = dict(lazy_statistics_sync=True,
               placement_strategy="replica_round_robin")
# "blocks": the conv model with its factors wider than 4 rows as their
# diagonal blocks (both runs).
BLOCKS = dict(factor_block_size=4)
for label in ("dense", "conv", "gru", "options", "blocks"):
  kind = {"options": "dense", "blocks": "conv"}.get(label, label)
  extra = {"options": OPTIONS, "blocks": BLOCKS}.get(label, {})
  many = fit(mirrored, kind, **extra)
  if extra:  # the options reached the K-FAC core
    names = list(many.optimizer.state_store.variables_by_name)
    assert any(("/A_blocks/" if label == "blocks" else "/local_stat") in n
               for n in names), names
  one = fit(tf.distribute.get_strategy(), kind,
            **(BLOCKS if label == "blocks" else {}))
  init = build(kind)
  rel = moved = 0.0
  identical = True
  for w_many, w_one, w0 in zip(many.weights, one.weights, init.weights):
    copies = [c.numpy() for c in
              mirrored.experimental_local_results(w_many.value)]
    ref = w_one.numpy()
    rel = max(rel, float(np.abs(copies[0] - ref).max() / np.abs(ref).max()))
    moved = max(moved, float(np.abs(ref - w0.numpy()).max()))
    identical &= all(np.array_equal(c, copies[0]) for c in copies)
  print("RESULT", label, rel, moved, identical)
try:
  fit(mirrored, "dense", adaptive=True, learning_rate=None, momentum=None)
except NotImplementedError as e:
  print("ADAPTIVE", e)
"""


@pytest.mark.slow  # subprocesses with 2 and 4 logical CPUs
@pytest.mark.parametrize("replicas", [2, 4])
def test_fit_under_mirrored_strategy_equals_one_replica(replicas):
  """model.fit under MirroredStrategy over R logical CPUs (each replica on
  its shard of the batch of 16) gives the one-replica weights after 4
  steps (a dense, a conv and a GRU model): 1e-5 relative (measured
  1.7e-7 / 2.5e-7; the GRU 2.1e-7 on 2 replicas), every replica's copy
  bit-identical, also with lazy_statistics_sync and replica_round_robin
  inverses, and with block-diagonal factors (factor_block_size); adaptive=True is refused with a clear error. Subprocess:
  logical devices must be set before TensorFlow starts."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__)))))
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  result = subprocess.run(
      [sys.executable, "-c", _STRATEGY_SCRIPT, str(replicas)], env=env,
      capture_output=True, text=True, timeout=600)
  out = result.stdout
  assert result.returncode == 0, out + result.stderr[-3000:]
  rows = [l.split() for l in out.splitlines() if l.startswith("RESULT ")]
  assert [r[1] for r in rows] == ["dense", "conv", "gru", "options",
                                  "blocks"], out
  for _, kind, rel, moved, identical in rows:
    assert float(rel) <= 1e-5, (kind, rel)
    assert float(moved) > 0.01, (kind, moved)
    assert identical == "True", kind
  assert "ADAPTIVE Kfac(adaptive=True) under a tf.distribute strategy with " \
      "%d replicas is not supported yet" % replicas in out, out


def _conv_fit(**kfac_kwargs):
  """Two fit steps of a small conv model (exact mode); its weights."""
  rng = np.random.RandomState(3)
  x = rng.randn(8, 6, 6, 2).astype(np.float32)
  y = rng.randint(0, 3, size=8)
  model = keras.Sequential([
      keras.Input((6, 6, 2)),
      keras.layers.Conv2D(3, 3, activation="relu", name="conv"),
      keras.layers.Flatten(), keras.layers.Dense(3, name="logits")])
  model.set_weights([np.random.RandomState(i).randn(*w.shape).astype(
      np.float32) * 0.3 for i, w in enumerate(model.get_weights())])
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  opt = kfac.keras.optimizers.Kfac(learning_rate=0.1, damping=0.05,
                                   model=model, loss=loss, invert_every=1,
                                   estimation_mode="exact", **kfac_kwargs)
  model.compile(optimizer=opt, loss=loss)
  model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
  return model.get_weights(), opt


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_conv_registration_options_reach_the_registration():
  plain, _ = _conv_fit()
  # A patch budget above the number of patches keeps them all: same steps.
  everything, opt = _conv_fit(registration_options={
      keras.layers.Conv2D: {"sub_sample_patches": 10**6}})
  _assert_weights(everything, plain, rtol=1e-5)
  assert "sub_sample_patches=1000000" in opt.registration_report
  assert opt.get_config()["registration_options"] == {
      "__class__:Conv2D": {"sub_sample_patches": 10**6}}
  # A budget of 8 of the 128 patches changes the statistic and the steps.
  sampled, _ = _conv_fit(registration_options={
      "conv": {"sub_sample_patches": 8}})
  assert max(np.max(np.abs(a - b)) for a, b in zip(sampled, plain)) > 1e-3
  with pytest.raises(ValueError, match="only Conv1D/2D/3D"):
    _conv_fit(registration_options={"logits": {"sub_sample_patches": 8}})
  with pytest.raises(ValueError, match="keys among"):
    _conv_fit(registration_options={"conv": {"bogus": 1}})
