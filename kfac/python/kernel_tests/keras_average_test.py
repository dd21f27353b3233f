"""Kfac's moving average of the weights (Keras's `use_ema`).

Keras keeps the average in the optimizer base class and Kfac updates it
after each K-FAC step. Checked here, under the Keras of `tf.keras` (Keras 3
by default; `test_tf_keras` runs the file again under tf_keras):

* after each `fit` step the average equals a float64 moving average of the
  weights recorded after the steps (atol 1e-6: float32 arithmetic), with
  each flavour's start (Keras 3: the first step's weights; tf_keras: the
  initial weights), and it is not the weights themselves;
* `fit` ends with the weights set to the average (finalize_variable_values);
* ema_overwrite_frequency=k sets the weights to the average every k steps;
* ema_warmup=True (Kfac's own) decays with min(ema_momentum, (1 + t) /
  (10 + t)) at step t (checked against float64 as above);
* keras.callbacks.SwapEMAWeights evaluates at the average (Keras 3);
* the default recipe (adaptive=True) and the minibatch recipe average too;
* the config round trip keeps the options; a `.keras` file and a
  tf.train.Checkpoint restore the average, and training resumes on the same
  trajectory (bit-identical);
* two MirroredStrategy replicas on the global batch give one replica's
  average (exact Fisher; atol 1e-6), every replica's copy identical, with
  and without ema_overwrite_frequency and ema_warmup (which Keras 3's own optimizers
  cannot run under MirroredStrategy);
* bad options raise errors that name them; the graph-mode class of tf_keras's
  v1 engine rejects the options (that engine keeps no average).
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import kfac
import kfac.keras
from kfac.python.keras import keras_flavor
from kfac.python.kernel_tests import keras_optimizer_test

keras = keras_flavor.keras_module()
LEGACY = keras_flavor.legacy_keras_active()

N, D_IN, D_H, D_OUT, BATCH = 64, 4, 5, 3, 16
MOMENTUM = 0.9


def _data():
  rng = np.random.RandomState(0)
  return (rng.randn(N, D_IN).astype(np.float32),
          rng.randint(0, D_OUT, size=N).astype(np.int32))


def _model():
  rng = np.random.RandomState(1)
  model = keras.Sequential([
      keras.Input((D_IN,)),
      keras.layers.Dense(D_H, activation="tanh", name="hidden"),
      keras.layers.Dense(D_OUT, name="out")])
  model.set_weights([(rng.randn(*w.shape) * 0.5).astype(np.float32)
                     for w in model.get_weights()])
  return model


def _compile(model=None, **kwargs):
  model = model or _model()
  options = dict(learning_rate=0.1, damping=0.01, model=model, seed=3,
                 use_ema=True, ema_momentum=MOMENTUM)
  options.update(kwargs)
  opt = kfac.keras.optimizers.Kfac(**options)
  model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  return model, opt


class _Record(keras.callbacks.Callback):
  """The weights and the optimizer's average after each training batch."""

  def __init__(self):
    super().__init__()
    self.weights, self.averages = [], []

  def on_train_batch_end(self, batch, logs=None):
    opt = self.model.optimizer
    self.weights.append([w.numpy().astype(np.float64)
                         for w in self.model.trainable_weights])
    self.averages.append([a.numpy().astype(np.float64)
                          for a in opt._model_variables_moving_average])  # pylint: disable=protected-access


def _fit(model, steps, epochs=1):
  x, y = _data()
  record = _Record()
  model.fit(x[:steps * BATCH], y[:steps * BATCH], batch_size=BATCH,
            epochs=epochs, shuffle=False, verbose=0, callbacks=[record])
  return record


def _reference(initial, weights, warmup=False):
  """The flavour's moving average of the recorded weights, float64 (with
  warmup: Kfac's ema_warmup rule, the same in both flavours)."""
  average = (None if not LEGACY or warmup else
             [w.astype(np.float64) for w in initial])
  out = []
  for t, ws in enumerate(weights):
    decay = min(MOMENTUM, (1.0 + t) / (10.0 + t)) if warmup else MOMENTUM
    average = ([w.copy() for w in ws] if average is None else
               [decay * a + (1 - decay) * w for a, w in zip(average, ws)])
    out.append(average)
  return out


def _max_diff(a, b):
  return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def test_average_equals_float64_moving_average_and_fit_ends_on_it():
  model, _ = _compile()
  initial = model.get_weights()
  record = _fit(model, 4)
  reference = _reference(initial, record.weights)
  for step, (got, want) in enumerate(zip(record.averages, reference)):
    assert _max_diff(got, want) < 1e-6, step
  # The average is not the weights: the test sees a real average.
  assert _max_diff(record.averages[-1], record.weights[-1]) > 1e-3
  # fit ends with the weights set to the average.
  assert _max_diff([w.astype(np.float64) for w in model.get_weights()],
                   record.averages[-1]) == 0.0


def test_warmup_follows_the_num_updates_rule():
  """ema_warmup=True: decay min(0.9, (1 + t) / (10 + t)) at step t, the
  first average the first step's weights (both flavours)."""
  model, opt = _compile(ema_warmup=True)
  record = _fit(model, 4, epochs=2)
  reference = _reference(None, record.weights, warmup=True)
  for step, (got, want) in enumerate(zip(record.averages, reference)):
    assert _max_diff(got, want) < 1e-6, step
  # Not Keras's fixed decay: the two rules differ by more than that.
  plain = _reference(model.get_weights(), record.weights)
  assert _max_diff(plain[-1], reference[-1]) > 1e-3
  assert opt.get_config()["ema_warmup"] is True


def test_overwrite_frequency_sets_the_weights_to_the_average():
  model, _ = _compile(ema_overwrite_frequency=2)
  record = _fit(model, 4)
  for step in range(4):
    diff = _max_diff(record.weights[step], record.averages[step])
    if (step + 1) % 2 == 0:
      assert diff == 0.0, step
    elif step or LEGACY:  # (Keras 3's first average is the weights)
      assert diff > 1e-4, step


@pytest.mark.parametrize("recipe", ["exact", "minibatch"])
def test_the_recipes_average(recipe):
  kwargs = dict(learning_rate=None, damping=None, adaptive=True)
  if recipe == "minibatch":
    kwargs.update(recipe="minibatch", learning_rate=0.05)
  model, _ = _compile(**kwargs)
  initial = model.get_weights()
  record = _fit(model, 4, epochs=3)  # (past the exact recipe's burn-in)
  assert _max_diff(record.averages[-1],
                   _reference(initial, record.weights)[-1]) < 1e-6
  assert _max_diff(record.averages[-1], record.weights[-1]) > 1e-4


@pytest.mark.slow  # over 4 s in the fast tier (end to end)
def test_swap_ema_weights_evaluates_at_the_average():
  """(Keras 3's callback; test_tf_keras leaves this test out.)"""
  x, y = _data()
  logged = {}
  for swap in (False, True):
    model, _ = _compile()
    callbacks = [keras.callbacks.SwapEMAWeights()] if swap else []
    history = model.fit(x[:48], y[:48], batch_size=BATCH, epochs=1,
                        shuffle=False, verbose=0, callbacks=callbacks,
                        validation_data=(x[48:], y[48:]))
    # After fit the weights are the average (finalize_variable_values).
    at_average = model.evaluate(x[48:], y[48:], verbose=0)
    logged[swap] = (history.history["val_loss"][-1], at_average)
  assert logged[True][0] == pytest.approx(logged[True][1], rel=1e-6)
  # Without the callback fit evaluated at the last weights, not the average.
  assert abs(logged[False][0] - logged[False][1]) > 1e-4


def test_config_round_trip_keeps_the_options():
  _, opt = _compile(ema_overwrite_frequency=5, ema_warmup=True)
  config = opt.get_config()
  assert (config["use_ema"], config["ema_momentum"],
          config["ema_overwrite_frequency"],
          config["ema_warmup"]) == (True, MOMENTUM, 5, True)
  rebuilt = type(opt).from_config(config)
  assert (rebuilt.use_ema, rebuilt.ema_momentum,
          rebuilt.ema_overwrite_frequency,
          rebuilt.get_config()["ema_warmup"]) == (True, MOMENTUM, 5, True)
  _, plain = _compile(use_ema=False, ema_momentum=0.99)
  assert "use_ema" not in plain.get_config() or not plain.get_config().get(
      "use_ema")


def _resumed(save_and_restore):
  """The model after 2 steps, save_and_restore, 2 more steps (two fit
  calls: each ends with the weights set to the average)."""
  x, y = _data()
  first, _ = _compile()
  first.fit(x[:32], y[:32], batch_size=BATCH, epochs=1, shuffle=False,
            verbose=0)
  second = save_and_restore(first)
  second.fit(x[32:], y[32:], batch_size=BATCH, epochs=1, shuffle=False,
             verbose=0)
  return second


def _averages(model):
  return [a.numpy() for a in
          model.optimizer._model_variables_moving_average]  # pylint: disable=protected-access


def _assert_same_run(a, b):
  assert a.optimizer.use_ema and b.optimizer.use_ema
  assert int(a.optimizer.iterations.numpy()) == 4
  assert int(b.optimizer.iterations.numpy()) == 4
  for x, y in zip(_averages(a) + a.get_weights(),
                  _averages(b) + b.get_weights()):
    np.testing.assert_array_equal(x, y)


@pytest.mark.slow  # over 4 s in the fast tier (end to end)
def test_keras_file_restores_the_average(tmp_path):
  def save_and_restore(model):
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = kfac.keras.saving_utils.load_model(path)
    assert loaded.optimizer.use_ema
    for a, b in zip(_averages(model), _averages(loaded)):
      np.testing.assert_array_equal(a, b)
    return loaded
  _assert_same_run(_resumed(lambda model: model), _resumed(save_and_restore))


@pytest.mark.slow  # over 4 s in the fast tier (end to end)
def test_checkpoint_restores_the_average(tmp_path):
  def save_and_restore(model):
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        str(tmp_path / "ckpt"))
    second, opt = _compile()
    # (the optimizer's variables exist after its first build)
    opt.build(second.trainable_variables)
    tf.train.Checkpoint(model=second, optimizer=opt).restore(
        path).assert_existing_objects_matched()
    return second
  _assert_same_run(_resumed(lambda model: model), _resumed(save_and_restore))


def test_bad_options_name_themselves():
  model = _model()
  with pytest.raises(ValueError, match="ema_momentum=0.5.*use_ema=True"):
    kfac.keras.optimizers.Kfac(learning_rate=0.1, damping=0.01, model=model,
                               ema_momentum=0.5)
  with pytest.raises(ValueError, match="ema_overwrite_frequency=3"):
    kfac.keras.optimizers.Kfac(learning_rate=0.1, damping=0.01, model=model,
                               use_ema=False, ema_overwrite_frequency=3)
  with pytest.raises(ValueError, match="ema_warmup=True.*use_ema=True"):
    kfac.keras.optimizers.Kfac(learning_rate=0.1, damping=0.01, model=model,
                               ema_warmup=True)
  with pytest.raises(ValueError, match="ema_warmup must be True or False"):
    kfac.keras.optimizers.Kfac(learning_rate=0.1, damping=0.01, model=model,
                               use_ema=True, ema_warmup=1)
  with pytest.raises(ValueError, match="use_ema must be True or False"):
    kfac.keras.optimizers.Kfac(learning_rate=0.1, damping=0.01, model=model,
                               use_ema="yes")
  with pytest.raises(ValueError, match="ema_momentum"):
    kfac.keras.optimizers.Kfac(learning_rate=0.1, damping=0.01, model=model,
                               use_ema=True, ema_momentum=1.5)
  # Keras-only options that mean nothing for K-FAC stay rejected.
  with pytest.raises(ValueError, match="gradient_accumulation_steps"):
    kfac.keras.optimizers.Kfac(learning_rate=0.1, damping=0.01, model=model,
                               gradient_accumulation_steps=2)


def test_graph_mode_class_rejects_the_average():
  from kfac.python.keras import graph_optimizer  # pylint: disable=g-import-not-at-top
  for key, value in (("use_ema", True), ("ema_momentum", 0.9),
                     ("ema_overwrite_frequency", 2), ("ema_warmup", True)):
    with pytest.raises(ValueError, match="%s.*ExponentialMovingAverage" % key):
      graph_optimizer.Kfac(learning_rate=0.1, damping=0.01, **{key: value})


_STRATEGY_SCRIPT = """
import sys
import numpy as np, tensorflow as tf
R, FREQ, WARMUP = int(sys.argv[1]), int(sys.argv[2]) or None, sys.argv[4] == "1"
if R > 1:
  tf.config.set_logical_device_configuration(
      tf.config.list_physical_devices("CPU")[0],
      [tf.config.LogicalDeviceConfiguration()] * R)
import kfac.keras
from kfac.python.kernel_tests import keras_average_test as t
strategy = (tf.distribute.MirroredStrategy(["/cpu:%d" % i for i in range(R)])
            if R > 1 else tf.distribute.get_strategy())
with strategy.scope():
  # (exact Fisher: the sampled targets differ with the replica count)
  model, opt = t._compile(ema_overwrite_frequency=FREQ, ema_warmup=WARMUP,
                          estimation_mode="exact")
x, y = t._data()
model.fit(x, y, batch_size=t.BATCH, epochs=1, shuffle=False, verbose=0)
copies = []
for a in opt._model_variables_moving_average:
  a = getattr(a, "value", a)
  local = [c.numpy() for c in strategy.experimental_local_results(a)]
  assert all(np.array_equal(c, local[0]) for c in local), "replicas differ"
  copies.append(local[0])
np.savez(sys.argv[3], *copies)
"""


def _strategy_average(replicas, frequency, warmup, tmp_path):
  out = str(tmp_path / ("avg_%d_%d_%d.npz" % (replicas, frequency, warmup)))
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__)))))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep +
             os.environ.get("PYTHONPATH", ""))
  result = subprocess.run(
      [sys.executable, "-c", _STRATEGY_SCRIPT, str(replicas), str(frequency),
       out, str(int(warmup))], env=env, cwd=root, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-4000:]
  data = np.load(out)
  return [data["arr_%d" % i] for i in range(len(data.files))]


@pytest.mark.slow  # subprocesses with 1 and 2 logical CPUs
@pytest.mark.parametrize("frequency,warmup", [(0, False), (3, True)])
def test_two_replicas_average_like_one(frequency, warmup, tmp_path):
  one = _strategy_average(1, frequency, warmup, tmp_path)
  two = _strategy_average(2, frequency, warmup, tmp_path)
  assert _max_diff(one, two) < 1e-6


@pytest.mark.slow  # subprocess: the file again under tf_keras
def test_tf_keras():
  """This file's tests again under tf_keras (TF_USE_LEGACY_KERAS=1)."""
  if LEGACY:
    return  # this is the run under tf_keras
  keras_optimizer_test.run_file_under_tf_keras(
      __file__, "not two_replicas and not swap_ema")
