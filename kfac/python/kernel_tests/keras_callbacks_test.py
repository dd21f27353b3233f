"""kfac.keras.callbacks: hyperparameter schedules driven by optimizer steps.

What is checked:
- `value_at(t)` of PolynomialDecay and of each ExponentialDecay mode against
  numbers computed by hand (delay, mid-decay, end, after the end), exact to
  1e-12 relative; the argument errors.
- `applies_at(t)`: the callback sets the value for num_delay_steps < t <=
  num_delay_steps + num_decay_steps (kfac 0.2.x; no end for
  ExponentialDecay with decay_rate and final_value), checked against
  windows written by hand.
- A real `model.fit` (Keras 3 in this process; tf_keras and the crossed
  flavours in subprocesses with TF_USE_LEGACY_KERAS=1 / without): at every
  batch the optimizer attribute equals a sequence of values written by hand
  (the optimizer's own value until the delay has passed, as kfac 0.2.x left
  it; the schedule after), and the weight update the compiled train step
  made is the one that value implies. Two callbacks chained on one
  hyperparameter (a warm-up, then a delayed decay) each act in their own
  window. The model is linear, y = x w, with mean squared error, so the
  gradient of a batch is 2/B X^T (X w - y) (numpy float64); the float32
  update -lr * scale * grad is compared with rtol 1e-4, atol 1e-6.
- The errors and the warning about the optimizer's attribute.
"""

import inspect
import os
import pathlib
import subprocess
import sys
import types
import warnings

import numpy as np
import pytest
import tensorflow as tf

from kfac.python.keras import callbacks

ROOT = pathlib.Path(__file__).resolve().parents[3]
REL = 1e-12

# -- the schedules ------------------------------------------------------------

# (callback kwargs, {step: value computed by hand})
POLY_CASES = [
    # (1 - 0.1) * (1 - s/4)**2 + 0.1 with s = clip(t - 2, 0, 4)
    (dict(init_value=1.0, final_value=0.1, power=2.0, num_decay_steps=4,
          num_delay_steps=2),
     {0: 1.0, 2: 1.0, 3: 0.60625, 4: 0.325, 5: 0.15625, 6: 0.1, 100: 0.1}),
    # an increase, linear, no delay
    (dict(init_value=0.5, final_value=0.9, num_decay_steps=4),
     {0: 0.5, 1: 0.6, 2: 0.7, 3: 0.8, 4: 0.9, 10: 0.9}),
]

EXP_CASES = [
    # (a) decay_rate, final_value: 0.5**t, never below 0.2
    (dict(init_value=1.0, decay_rate=0.5, final_value=0.2),
     {0: 1.0, 1: 0.5, 2: 0.25, 3: 0.2, 50: 0.2}),
    # (a) decay_rate, num_decay_steps: stops after 2 steps
    (dict(init_value=1.0, decay_rate=0.5, num_decay_steps=2),
     {1: 0.5, 2: 0.25, 3: 0.25, 100: 0.25}),
    # (a) growth: 0.5 * 2**t, never above 3
    (dict(init_value=0.5, decay_rate=2.0, final_value=3.0),
     {0: 0.5, 1: 1.0, 2: 2.0, 3: 3.0, 9: 3.0}),
    # (a) rate 1: constant
    (dict(init_value=0.5, decay_rate=1.0, final_value=0.1), {0: 0.5, 10: 0.5}),
    # (b) final_value, num_decay_steps: rate 0.01**(1/4), delay 1
    (dict(init_value=1.0, final_value=0.01, num_decay_steps=4,
          num_delay_steps=1),
     {0: 1.0, 1: 1.0, 2: 0.31622776601683794, 3: 0.1,
      4: 0.031622776601683794, 5: 0.01, 9: 0.01}),
]


@pytest.mark.parametrize("kwargs,expected", POLY_CASES)
def test_polynomial_values(kwargs, expected):
  cb = callbacks.PolynomialDecay("damping", **kwargs)
  for step, value in expected.items():
    assert cb.value_at(step) == pytest.approx(value, rel=REL), step
  # The end value is exact, not a rounding of the formula.
  assert cb.value_at(10**6) == kwargs["final_value"]


@pytest.mark.parametrize("kwargs,expected", EXP_CASES)
def test_exponential_values(kwargs, expected):
  cb = callbacks.ExponentialDecay("learning_rate", **kwargs)
  for step, value in expected.items():
    assert cb.value_at(step) == pytest.approx(value, rel=REL), step


# (callback, steps where it sets the value) written by hand: after the
# delay, up to delay + num_decay_steps.
WINDOW_CASES = [
    (lambda: callbacks.PolynomialDecay("damping", 1.0, 0.1, num_decay_steps=4,
                                       num_delay_steps=2), {3, 4, 5, 6}),
    (lambda: callbacks.PolynomialDecay("damping", 1.0, 0.1, num_decay_steps=2),
     {1, 2}),
    (lambda: callbacks.ExponentialDecay("damping", 1.0, decay_rate=0.5,
                                        num_decay_steps=3, num_delay_steps=1),
     {2, 3, 4}),
    (lambda: callbacks.ExponentialDecay("damping", 1.0, final_value=0.1,
                                        num_decay_steps=2), {1, 2}),
    # decay_rate and final_value: no end
    (lambda: callbacks.ExponentialDecay("damping", 1.0, decay_rate=0.5,
                                        final_value=0.1, num_delay_steps=3),
     set(range(4, 40))),
]


@pytest.mark.parametrize("make,steps", WINDOW_CASES)
def test_applies_only_after_the_delay_until_the_end(make, steps):
  cb = make()
  assert {t for t in range(40) if cb.applies_at(t)} == steps


def test_exponential_reaches_final_exactly_in_mode_b():
  cb = callbacks.ExponentialDecay("damping", 0.3, final_value=0.007,
                                  num_decay_steps=7)
  assert cb.value_at(7) == 0.007 and cb.value_at(8) == 0.007
  values = [cb.value_at(t) for t in range(8)]
  ratios = np.array(values[1:]) / np.array(values[:-1])
  np.testing.assert_allclose(ratios, (0.007 / 0.3)**(1 / 7), rtol=1e-12)


def test_original_positional_order():
  # kfac 0.2.x: PolynomialDecay(hyperparameter, init, final, power, steps).
  a = callbacks.PolynomialDecay("damping", 1.0, 0.1, 2.0, 4)
  b = callbacks.PolynomialDecay("damping", init_value=1.0, final_value=0.1,
                                power=2.0, num_decay_steps=4)
  assert a.get_config() == b.get_config()
  c = callbacks.ExponentialDecay("damping", 1.0, 0.1, None, 4)
  assert c.get_config()["final_value"] == 0.1
  assert c.get_config()["num_decay_steps"] == 4


BAD_POLY = [
    (dict(hyperparameter=3), "hyperparameter"),
    (dict(hyperparameter=""), "hyperparameter"),
    (dict(init_value="a"), "init_value"),
    (dict(final_value=float("nan")), "final_value"),
    (dict(power=0.0), "power"),
    (dict(power=-1.0), "power"),
    (dict(num_decay_steps=None), "num_decay_steps"),
    (dict(num_decay_steps=0), "num_decay_steps"),
    (dict(num_decay_steps=2.5), "num_decay_steps"),
    (dict(num_decay_steps=True), "num_decay_steps"),
    (dict(num_delay_steps=-1), "num_delay_steps"),
    (dict(num_delay_steps=1.5), "num_delay_steps"),
]
BAD_EXP = [
    (dict(init_value=0.0), "init_value"),
    (dict(init_value=-1.0), "init_value"),
    (dict(final_value=0.0, decay_rate=0.5), "final_value"),
    (dict(decay_rate=0.0), "decay_rate"),
    (dict(decay_rate=-0.5), "decay_rate"),
    (dict(), "exactly two of"),
    (dict(final_value=0.1), "exactly two of"),
    (dict(num_decay_steps=3), "exactly two of"),
    # kfac 0.2.x: one or all three of them is an error
    (dict(decay_rate=0.5), "exactly two of"),
    (dict(decay_rate=0.5, final_value=0.3, num_decay_steps=3),
     "exactly two of"),
    (dict(decay_rate=0.5, final_value=2.0), "away from final_value"),
    (dict(decay_rate=2.0, final_value=0.5), "away from final_value"),
    (dict(final_value=0.1, num_decay_steps=0), "num_decay_steps"),
    (dict(decay_rate=0.5, num_decay_steps=2, num_delay_steps=-2),
     "num_delay_steps"),
]


@pytest.mark.parametrize("bad,match", BAD_POLY)
def test_polynomial_bad_arguments(bad, match):
  kwargs = dict(hyperparameter="damping", init_value=1.0, final_value=0.1,
                num_decay_steps=4)
  kwargs.update(bad)
  with pytest.raises(ValueError, match=match):
    callbacks.PolynomialDecay(**kwargs)


@pytest.mark.parametrize("bad,match", BAD_EXP)
def test_exponential_bad_arguments(bad, match):
  kwargs = dict(hyperparameter="damping", init_value=1.0)
  kwargs.update(bad)
  with pytest.raises(ValueError, match=match):
    callbacks.ExponentialDecay(**kwargs)


@pytest.mark.parametrize(
    "cls,kwargs",
    [(callbacks.PolynomialDecay, kw) for kw, _ in POLY_CASES] +
    [(callbacks.ExponentialDecay, kw) for kw, _ in EXP_CASES])
def test_get_config_round_trip(cls, kwargs):
  cb = cls("momentum", verbose=1, **kwargs)
  config = cb.get_config()
  assert set(config) == set(inspect.signature(cls).parameters)
  copy = cls(**config)
  assert copy.get_config() == config
  assert copy.verbose == 1 and copy.hyperparameter == "momentum"
  assert ([copy.value_at(t) for t in range(30)] ==
          [cb.value_at(t) for t in range(30)])


def test_base_class_follows_tf_keras():
  assert issubclass(callbacks.PolynomialDecay, tf.keras.callbacks.Callback)
  assert issubclass(callbacks.ExponentialDecay, tf.keras.callbacks.Callback)


# -- model.fit ----------------------------------------------------------------

X = np.random.RandomState(0).randn(16, 3)
Y = np.random.RandomState(1).randn(16, 1)
W0 = np.array([[0.3], [-0.2], [0.5]])
BATCH = 4
EPOCHS = 3  # 12 optimizer steps


def _float(value):
  if hasattr(value, "numpy"):
    value = value.numpy()
  return float(np.asarray(value))


def fit_records(keras_mod, optimizer, schedule, watched, model=None):
  """Fits the linear model; returns per-batch records and the History.

  A new model is made unless `model` (made by `linear_model`) is given.

  Each record: the optimizer step at the batch's start, the watched
  attributes right after the schedule set them, the weights before and
  after the batch, and the batch's rows.
  """
  records = []

  class Recorder(keras_mod.callbacks.Callback):

    def on_train_batch_begin(self, batch, logs=None):
      opt = self.model.optimizer
      records.append(dict(
          step=int(_float(opt.iterations)), batch=batch,
          values={name: _float(getattr(opt, name)) for name in watched},
          w_before=np.array(self.model.get_weights()[0], np.float64)))

    def on_train_batch_end(self, batch, logs=None):
      records[-1]["w_after"] = np.array(self.model.get_weights()[0],
                                        np.float64)

  if model is None:
    model = linear_model(keras_mod, optimizer)
  history = model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                      verbose=0, callbacks=[schedule, Recorder()])
  return records, history


def linear_model(keras_mod, optimizer):
  model = keras_mod.Sequential([
      keras_mod.Input((3,)),
      keras_mod.layers.Dense(
          1, use_bias=False,
          kernel_initializer=keras_mod.initializers.Constant(W0))])
  model.compile(optimizer=optimizer, loss="mse")
  return model


def check_records(records, schedule, step_scale, expected):
  """Values are `expected` (one per batch, by hand); updates are
  -step_scale(values) * grad."""
  first = records[0]["step"]
  assert [r["step"] for r in records] == list(
      range(first, first + EPOCHS * len(X) // BATCH))
  np.testing.assert_allclose(
      [r["values"][schedule.hyperparameter] for r in records], expected,
      rtol=1e-6)
  for r in records:
    rows = slice(r["batch"] * BATCH, (r["batch"] + 1) * BATCH)
    xb, yb = X[rows], Y[rows]
    w = r["w_before"]
    grad = 2.0 / BATCH * xb.T @ (xb @ w - yb)
    np.testing.assert_allclose(r["w_after"] - w,
                               -step_scale(r["values"]) * grad,
                               rtol=1e-4, atol=1e-6,
                               err_msg="step %d" % r["step"])


def lr_schedule():
  return callbacks.PolynomialDecay("learning_rate", 0.1, 0.01, power=2.0,
                                   num_decay_steps=6, num_delay_steps=3)


# lr_schedule on an optimizer built with learning_rate=0.5, by hand:
# 0.09 * (1 - s/6)**2 + 0.01 with s = t - 3; the optimizer's own 0.5 until
# the delay has passed (steps 0-3, kfac 0.2.x), 0.01 from step 9 on.
SGD_LRS = [0.5, 0.5, 0.5, 0.5, 0.0725, 0.05, 0.0325, 0.02, 0.0125, 0.01,
           0.01, 0.01]


def run_sgd_learning_rate(keras_mod):
  """Plain SGD's learning_rate driven by PolynomialDecay through fit."""
  schedule = lr_schedule()
  records, history = fit_records(
      keras_mod, keras_mod.optimizers.SGD(learning_rate=0.5), schedule,
      ["learning_rate"])
  check_records(records, schedule, lambda v: v["learning_rate"], SGD_LRS)
  # History records the value of the last batch of each epoch.
  np.testing.assert_allclose(history.history["learning_rate"],
                             [SGD_LRS[3], SGD_LRS[7], SGD_LRS[11]],
                             rtol=1e-6)


def test_keras3_fit_sgd_learning_rate():
  import keras  # pylint: disable=g-import-not-at-top
  run_sgd_learning_rate(keras)


def _damped_sgd_class():
  """A Keras 3 SGD with a `damping` property backed by a keras.Variable.

  The update is -learning_rate * damping * gradient, so the weights show
  which damping the compiled train step read.
  """
  import keras  # pylint: disable=g-import-not-at-top

  class DampedSGD(keras.optimizers.SGD):

    def __init__(self, damping=1.0, **kwargs):
      super().__init__(**kwargs)
      self._damping = keras.Variable(damping, dtype="float32",
                                     trainable=False, name="damping")

    @property
    def damping(self):
      return self._damping

    @damping.setter
    def damping(self, value):
      self._damping.assign(value)

    def update_step(self, gradient, variable, learning_rate):
      scale = keras.ops.cast(learning_rate, variable.dtype) * keras.ops.cast(
          self._damping, variable.dtype)
      variable.assign_sub(gradient * scale)

  return DampedSGD


def test_keras3_fit_damping_exponential_decay_verbose(capsys):
  import keras  # pylint: disable=g-import-not-at-top
  schedule = callbacks.ExponentialDecay("damping", 1.0, final_value=0.25,
                                        num_decay_steps=4, num_delay_steps=2,
                                        verbose=1)
  opt = _damped_sgd_class()(damping=7.0, learning_rate=0.05)
  records, history = fit_records(keras, opt, schedule, ["damping"])
  # By hand: the optimizer's own 7 until the delay has passed (steps 0-2,
  # kfac 0.2.x), then 0.25**(s/4) with s = t - 2, 0.25 from step 6 on.
  expected = [7, 7, 7, 0.25**0.25, 0.5, 0.25**0.75] + [0.25] * 6
  check_records(records, schedule, lambda v: 0.05 * v["damping"], expected)
  np.testing.assert_allclose(history.history["damping"],
                             [expected[3], expected[7], expected[11]],
                             rtol=1e-6)
  lines = [l for l in capsys.readouterr().out.splitlines() if "damping" in l]
  # printed at the start of epochs 1, 2, 3 (steps 0, 4, 8)
  assert lines == ["Epoch 00001: damping is 7.",
                   "Epoch 00002: damping is 0.5.",
                   "Epoch 00003: damping is 0.25."]


def test_chained_schedules_act_in_their_own_windows():
  """A warm-up of the learning rate, then a delayed decay of it: each
  callback sets the value only in its window (kfac 0.2.x), so neither
  undoes the other."""
  import keras  # pylint: disable=g-import-not-at-top
  warmup = callbacks.PolynomialDecay("learning_rate", 0.0, 0.2,
                                     num_decay_steps=4)
  decay = callbacks.ExponentialDecay("learning_rate", 0.2, decay_rate=0.5,
                                     num_decay_steps=3, num_delay_steps=6)
  opt = keras.optimizers.SGD(learning_rate=0.0)
  model = linear_model(keras, opt)
  records = []

  class Recorder(keras.callbacks.Callback):

    def on_train_batch_begin(self, batch, logs=None):
      records.append(_float(self.model.optimizer.learning_rate))

  for order in ([warmup, decay], [decay, warmup]):
    del records[:]
    opt.iterations.assign(0)
    opt.learning_rate.assign(0.0)
    model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
              verbose=0, callbacks=order + [Recorder()])
    # By hand: 0 at step 0 (the optimizer's own), 0.05 t up to t = 4, 0.2
    # held at steps 5 and 6, 0.2 * 0.5**(t - 6) for t = 7..9, then held.
    np.testing.assert_allclose(
        records, [0.0, 0.05, 0.1, 0.15, 0.2, 0.2, 0.2, 0.1, 0.05, 0.025,
                  0.025, 0.025], rtol=1e-6, atol=1e-9)


def test_resumed_fit_continues_from_optimizer_step():
  import keras  # pylint: disable=g-import-not-at-top
  schedule = lr_schedule()
  opt = keras.optimizers.SGD(learning_rate=0.5)
  model = linear_model(keras, opt)
  fit_records(keras, opt, schedule, ["learning_rate"], model=model)
  records, _ = fit_records(keras, opt, schedule, ["learning_rate"],
                           model=model)
  assert [r["step"] for r in records] == list(range(12, 24))
  # The decay ended at step 9: the value set then stays.
  check_records(records, schedule, lambda v: v["learning_rate"], [0.01] * 12)
  np.testing.assert_allclose(_float(opt.learning_rate), 0.01, rtol=1e-6)


def test_missing_attribute_is_an_error():
  import keras  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  schedule = callbacks.PolynomialDecay("damping", 1.0, 0.1,
                                       num_decay_steps=4)
  with pytest.raises(ValueError, match=r"SGD has no attribute 'damping'"):
    model.fit(X, Y, epochs=1, verbose=0, callbacks=[schedule])
  # No `iterations` counter.
  schedule.set_model(types.SimpleNamespace(
      optimizer=types.SimpleNamespace(damping=1.0)))
  with pytest.raises(ValueError, match="no 'iterations' attribute"):
    schedule.on_train_begin()
  # No optimizer.
  schedule.set_model(types.SimpleNamespace(optimizer=None))
  with pytest.raises(ValueError, match="compiled model with an optimizer"):
    schedule.on_train_begin()


def test_warns_for_plain_number_attribute():
  import keras  # pylint: disable=g-import-not-at-top
  opt = keras.optimizers.SGD(0.1, momentum=0.5)
  model = types.SimpleNamespace(optimizer=opt)
  momentum = callbacks.PolynomialDecay("momentum", 0.9, 0.99,
                                       num_decay_steps=4)
  momentum.set_model(model)
  with pytest.warns(UserWarning, match=r"SGD\.momentum is a plain Python"):
    momentum.on_train_begin()
  # Step 0: the schedule does not apply yet (kfac 0.2.x); at step 2 it does.
  assert opt.momentum == 0.5
  opt.iterations.assign(2)
  momentum.on_train_batch_begin(0)
  assert opt.momentum == pytest.approx(0.945, rel=1e-12)
  lr = callbacks.PolynomialDecay("learning_rate", 0.2, 0.1, num_decay_steps=4)
  lr.set_model(model)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    lr.on_train_begin()
  np.testing.assert_allclose(_float(opt.learning_rate), 0.15, rtol=1e-7)


# -- tf_keras and the crossed flavours, in fresh processes ---------------------

_FLAVOUR_SCRIPT = """
import sys
try:
  import tf_keras
except ImportError as e:
  sys.exit("tf_keras is not installed (pip install tf-keras): %s" % e)
import keras
import tensorflow as tf
from kfac.python.keras import callbacks
from kfac.python.kernel_tests import keras_callbacks_test as t

legacy = sys.argv[1] == "legacy"
assert tf.keras.__name__.startswith("tf_keras") == legacy, tf.keras.__name__
base = tf_keras.callbacks.Callback if legacy else keras.callbacks.Callback
assert issubclass(callbacks.PolynomialDecay, base)
t.run_sgd_learning_rate(tf_keras)   # tf.keras when legacy; crossed otherwise
if legacy:
  t.run_sgd_learning_rate(keras)    # crossed: tf_keras-based callback
print("FLAVOUR-OK")
"""


@pytest.mark.slow  # subprocesses per Keras flavour
@pytest.mark.parametrize("mode", ["legacy", "keras3"])
def test_tf_keras_flavour_in_subprocess(mode):
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  env.pop("TF_USE_LEGACY_KERAS", None)
  if mode == "legacy":
    env["TF_USE_LEGACY_KERAS"] = "1"
  proc = subprocess.run([sys.executable, "-c", _FLAVOUR_SCRIPT, mode],
                        env=env, cwd=str(ROOT), capture_output=True,
                        text=True, timeout=300, check=False)
  assert proc.returncode == 0 and "FLAVOUR-OK" in proc.stdout, (
      "tf_keras flavour check (%s) failed (rc %d):\n%s\n%s" %
      (mode, proc.returncode, proc.stdout[-3000:], proc.stderr[-5000:]))
