"""kfac.keras: Keras LSTM and GRU layers (kfac/python/keras/recurrent.py).

- In a recorded step (a tf.function with the model's recorder installed)
  a recognised LSTM / GRU is computed by recurrent.py's formulation: its
  outputs equal the layer's own (float64, 1e-12) for the configurations
  it covers (return_sequences / return_state, go_backwards, use_bias,
  activations, unroll, an initial state, GRU reset_after both ways,
  Bidirectional), and the cell's recorded call is the formulation's Record.
- Out of reach (dropout or recurrent dropout in training, a mask, a cell in
  keras.layers.RNN) the cell gets the generic diagonal block and a warning
  naming it and the reason; fisher_approx by the cell's name picks the
  dense family's approximations.
- The forward-mode products of the adaptive step (walked from the
  variables' reads) through the formulation equal the tape's JVP of the
  layer.
- An initial state of the wrong length: a ValueError naming the layer.
- Under mixed_float16 the same (float16 rounding) and fit steps move the
  weights.
- A small LSTM / GRU text classifier trained with Kfac(adaptive=True)
  lowers its loss (budget in steps; slow tier).
The Kronecker factors and the two fit steps against a hand registration
are in recurrent_test.py and keras_registration_test.py's zoo.

Keras flavour: written against `keras_flavor.keras_module()`;
`test_tf_keras` (slow) runs the file again under tf_keras, and the
recurrent zoo groups of keras_registration_test with it.
"""

import re
import warnings

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.keras import keras_flavor
from kfac.python.keras import recurrent
from kfac.python.keras import layer_registration
from kfac.python.keras import utils as keras_utils
from kfac.python.kernel_tests import keras_optimizer_test as base
from kfac.python.kernel_tests import kfac_test_util
from kfac.python.ops import forward_mode

keras = keras_flavor.keras_module()
N, T, D = 3, 4, 3


@pytest.fixture(autouse=True, scope="module")
def float64_keras():
  """floatx and (Keras 3) the dtype policy float64 for the module; see
  keras_registration_test.float64_keras."""
  with kfac_test_util.keras_float64(keras):
    yield


def _cells(model):
  return [l for l in keras_flavor.leaf_layers(model)
          if recurrent.cell_kind(l) is not None]


CONFIGS = {
    "lstm": lambda: keras.layers.LSTM(3),
    "gru": lambda: keras.layers.GRU(3),
    "lstm_sequences_state_backwards": lambda: keras.layers.LSTM(
        3, return_sequences=True, return_state=True, go_backwards=True),
    "gru_sequences_state_backwards": lambda: keras.layers.GRU(
        3, return_sequences=True, return_state=True, go_backwards=True),
    "lstm_nobias_relu": lambda: keras.layers.LSTM(
        2, use_bias=False, activation="relu",
        recurrent_activation="hard_sigmoid", return_sequences=True),
    "gru_nobias_relu": lambda: keras.layers.GRU(
        2, use_bias=False, activation="relu",
        recurrent_activation="hard_sigmoid", return_sequences=True),
    "lstm_unroll": lambda: keras.layers.LSTM(3, unroll=True),
    "gru_reset_before": lambda: keras.layers.GRU(
        3, reset_after=False, return_sequences=True),
    "gru_reset_before_nobias_state": lambda: keras.layers.GRU(
        3, reset_after=False, use_bias=False, return_state=True),
    "bidirectional_lstm": lambda: keras.layers.Bidirectional(
        keras.layers.LSTM(2, return_sequences=True)),
    "bidirectional_gru_sum": lambda: keras.layers.Bidirectional(
        keras.layers.GRU(2), merge_mode="sum"),
}


class StatefulInputs(keras.Model):
  """The layer called with an initial state (the model's other inputs)."""

  def __init__(self, layer):
    super().__init__(name="with_state")
    self.rnn = layer

  def call(self, inputs):
    return self.rnn(inputs[0], initial_state=list(inputs[1:]))


def _model(make, initial_state=False):
  layer = make()
  if initial_state:
    model = StatefulInputs(layer)
    count = 2 if recurrent.cell_kind(layer.cell) == "lstm" else 1
    model([np.zeros((1, T, D))] +
          [np.full((1, layer.cell.units), float(i)) for i in range(count)])
    return model
  x = keras.Input((T, D))
  return keras.Model(x, layer(x))


def _states(model):
  if isinstance(model, StatefulInputs):
    count = 2 if recurrent.cell_kind(model.rnn.cell) == "lstm" else 1
    return [model.rnn.cell.units] * count
  return []


def _randomize(model, seed):
  rng = np.random.RandomState(seed)
  for var in model.trainable_weights:
    var.assign(0.5 * rng.randn(*var.shape))


@pytest.mark.parametrize("name,initial_state", [
    (name, False) for name in sorted(CONFIGS)] + [("lstm", True),
                                                   ("gru", True)])
def test_recorded_forward_equals_the_layer(name, initial_state):
  model = _model(CONFIGS[name], initial_state)
  _randomize(model, 1)
  rng = np.random.RandomState(2)
  inputs = [rng.randn(N, T, D)]
  inputs += [rng.randn(N, units) for units in _states(model)]
  if len(inputs) == 1:
    inputs = inputs[0]
  recorder = layer_registration.recorder_for(model)
  cells = _cells(model)
  kinds = []

  @tf.function
  def recorded(xs):
    out = model(xs, training=True)
    for cell in cells:
      kinds.extend(type(c.preactivations).__name__
                   for c in recorder.calls(cell))
    return out

  want = model(inputs, training=True)  # eager: not recorded
  got = recorded(tf.nest.map_structure(tf.constant, inputs))
  assert kinds == ["Record"] * len(cells), kinds
  want, got = tf.nest.flatten(want), tf.nest.flatten(got)
  assert len(want) == len(got)
  for w, g in zip(want, got):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("name", ["lstm", "gru", "gru_reset_before"])
def test_forward_mode_products_reach_the_recurrent_weights(name):
  """The adaptive step's curvature products are forward-mode JVPs walked
  op by op from the variables' reads: through the recorded formulation
  (its loop one op with a tangent-loop rule, recurrent_loop.py) they equal
  the tape's JVP (ForwardAccumulator) of the layer's own forward, 1e-10.
  forward_mode.jvp itself, not fwd_gradients: it raises where the walk
  cannot pass the loop, so this also guards that the products do not go
  through the whole-graph double backward (a reverse pass and its
  reverse through the loop, most of a GRU step's cost). (A formulation
  whose loop captured only tensors read outside it once got no tangent,
  and the adaptive step diverged.)"""
  model = _model(CONFIGS[name])
  _randomize(model, 4)
  rng = np.random.RandomState(5)
  x = tf.constant(rng.randn(N, T, D))
  weights = [keras_flavor.unwrap_variable(v)
             for v in _cells(model)[0].trainable_weights]
  tangents = [tf.constant(rng.randn(*v.shape)) for v in weights]
  layer_registration.recorder_for(model)

  @tf.function
  def recorded():
    y = model(x, training=True)
    return forward_mode.jvp([y], weights, tangents)[0]

  with tf.autodiff.ForwardAccumulator(weights, tangents) as acc:
    y = model(x, training=True)  # eager: Keras's own loop
  np.testing.assert_allclose(recorded().numpy(), acc.jvp(y).numpy(),
                             rtol=1e-10, atol=1e-12)


def _trace_report(model, signature, **kwargs):
  keras_utils.watch(model)
  found = {}

  @tf.function(autograph=False)
  def trace(x):
    model(x, training=True)
    found["report"] = keras_utils.register_model(model, "mse", **kwargs)[1]
    return x

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trace.get_concrete_function(signature)
  return found["report"], [str(w.message) for w in caught
                           if str(w.message).startswith("kfac: layer")]


def _rows(report):
  """{the layer of a row's first parameter: the row} (Keras 3 rows name
  the cell's path, tf_keras rows its name; the parameters are paths in
  both)."""
  rows = {}
  for line in report.splitlines()[2:]:
    if not line.startswith("loss: "):
      rows[line.split()[5].split("/")[0]] = line
  return rows


def test_out_of_reach_cases_fall_back_naming_the_cell_and_the_reason():
  ids = keras.Input((T,), dtype="int32")
  masked = keras.layers.Embedding(5, D, mask_zero=True, name="emb")(ids)
  h1 = keras.layers.LSTM(2, name="masked")(masked)
  x = keras.Input((T, D))
  h2 = keras.layers.LSTM(2, dropout=0.25, name="dropout")(x)
  h3 = keras.layers.GRU(2, recurrent_dropout=0.25, name="rec_dropout")(x)
  h4 = keras.layers.RNN(keras.layers.LSTMCell(2, name="bare_cell"),
                        name="rnn")(x)
  out = keras.layers.Concatenate()([h1, h2, h3, h4])
  model = keras.Model([ids, x], out)
  report, messages = _trace_report(model, [
      tf.TensorSpec([None, T], tf.int32),
      tf.TensorSpec([None, T, D], tf.float64)])
  rows = _rows(report)
  reasons = {"masked": "LSTM called with a mask",
             "dropout": "LSTM with dropout=0.25, recurrent_dropout=0.0 in "
                        "training",
             "rec_dropout": "GRU with dropout=0.0, recurrent_dropout=0.25 "
                            "in training",
             "rnn": "LSTMCell called outside a Keras LSTM / GRU layer"}
  assert len(messages) == len(reasons), messages
  for layer, reason in reasons.items():
    assert "NaiveDiagonalFB" in rows[layer], report
    assert "fallback: " + reason in rows[layer], report
    cell = rows[layer].split()[0]
    assert any(reason in m and "'%s'" % cell in m for m in messages), (
        messages)


def test_fisher_approx_by_cell_name():
  x = keras.Input((T, D))
  h = keras.layers.LSTM(2, name="lstm")(x)
  model = keras.Model(x, keras.layers.GRU(2, name="gru")(
      keras.layers.RepeatVector(2)(h)))
  report, messages = _trace_report(
      model, tf.TensorSpec([None, T, D], tf.float64),
      fisher_approx={"lstm_cell": "diagonal", "gru_cell": "kron_reduce"})
  assert not messages, messages
  rows = _rows(report)
  assert rows["lstm"].split()[2] == "+".join(
      ["FullyConnectedDiagonalFB"] * 2), report
  # (kron_reduce: KFAC-reduce over the time steps)
  assert rows["gru"].split()[2] == "+".join(
      ["FullyConnectedKFACReduceFB"] * 3), report


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_mixed_float16_registers_the_kronecker_blocks_and_steps():
  """Under mixed_float16 the layer reads its kernels through autocast
  views: the formulation reads them the same way (float16 compute, float32
  variables), the recorded forward equals the layer's to float16 rounding,
  and fit steps move the weights."""
  old = keras.mixed_precision.global_policy()
  keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    rng = np.random.RandomState(3)
    x, y = rng.randn(8, T, D).astype(np.float32), np.arange(8) % 2
    # (GRU: its bias is split in the loop; LSTM reads its weights alike)
    for make in (lambda: keras.layers.GRU(4),):
      model = keras.Sequential([keras.Input((T, D)), make(),
                                keras.layers.Dense(2, dtype="float32")])
      layer_registration.recorder_for(model)  # the traced call is recorded
      got = tf.function(lambda v: model(v, training=True))(x)
      want = model(x, training=True)
      np.testing.assert_allclose(np.asarray(got), np.asarray(want),
                                 atol=2e-2)
      loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
      opt = kfac.keras.optimizers.Kfac(model=model, loss=loss,
                                       learning_rate=0.01, damping=0.01)
      model.compile(optimizer=opt, loss=loss)
      before = [np.asarray(w) for w in model.get_weights()]
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
      assert not [w for w in caught
                  if str(w.message).startswith("kfac: layer")]
      assert "Cell  FullyConnectedKFACBasicFB+" in re.sub(
          " +", "  ", opt.registration_report), opt.registration_report
      after = model.get_weights()
      assert all(np.isfinite(w).all() for w in after)
      assert all(np.abs(a - b).max() > 0 for a, b in zip(after, before))
  finally:
    keras.mixed_precision.set_global_policy(old)


@pytest.mark.slow  # (about 17 s each on the shared 2-core machine)
@pytest.mark.parametrize("layer", ["LSTM", "GRU"])
def test_text_classifier_loss_falls_with_adaptive_kfac(layer):
  """Tokens 1..7 in sequences of 6; the class is whether token 1 comes
  before token 2 (order matters: a bag of words cannot tell). Full
  batch, 16 steps."""
  rng = np.random.RandomState(0)
  steps, batch = 6, 64
  ids = rng.randint(3, 8, size=(batch, steps))
  first = rng.randint(0, steps - 1, size=batch)
  for n, i in enumerate(first):
    j = rng.randint(i + 1, steps)
    ids[n, i], ids[n, j] = (1, 2) if n % 2 else (2, 1)
  labels = (np.arange(batch) % 2).astype(np.int32)
  keras.utils.set_random_seed(0)
  model = keras.Sequential([
      keras.Input((steps,), dtype="int32"),
      keras.layers.Embedding(8, 8),
      getattr(keras.layers, layer)(8),
      keras.layers.Dense(2)])
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  opt = kfac.keras.optimizers.Kfac(model=model, loss=loss, adaptive=True,
                                   seed=0)
  model.compile(optimizer=opt, loss=loss)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    history = model.fit(ids, labels, batch_size=batch, epochs=16,
                        shuffle=False, verbose=0).history["loss"]
  assert not [w for w in caught if str(w.message).startswith("kfac: layer")]
  assert "+FullyConnectedKFACBasicFB" in opt.registration_report
  # (measured, 16 steps: 0.69 -> LSTM 0.004 / GRU 0.005 in Keras 3, LSTM
  # 0.143 / GRU 0.001 in tf_keras; the recipe's first 5 steps calibrate the
  # damping and do not move the weights)
  assert history[-1] < 0.3 * history[0], history


@pytest.mark.slow  # subprocess: the file again under tf_keras
def test_tf_keras():
  """This file and the recurrent zoo groups again under tf_keras
  (TF_USE_LEGACY_KERAS=1): tf_keras's LSTM / GRU (their own call, not the
  cell's loop) take the same formulation."""
  if base.LEGACY:
    return  # this is the run under tf_keras
  base.run_file_under_tf_keras(__file__)
  base.run_file_under_tf_keras(
      __file__.replace("keras_recurrent_test", "keras_registration_test"),
      "recurrent or reset_before")


def test_initial_state_of_the_wrong_length_is_an_error_naming_the_layer():
  """(Keras's own loop fails with an IndexError there.)"""
  model = _model(CONFIGS["lstm"])
  layer = model.layers[-1]
  layer_registration.recorder_for(model)

  @tf.function
  def call(x, h):
    return layer(x, initial_state=[h], training=True)

  with pytest.raises(ValueError, match=r"LSTM .*%s.*: initial_state has 1 "
                     r"tensors, expected 2" % layer.name):
    call(tf.zeros([N, T, D], tf.float64), tf.zeros([N, 3], tf.float64))
