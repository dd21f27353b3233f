"""kfac.keras: cross-entropies on outputs that are probabilities but do not
come straight out of a Sigmoid / Softmax op (an ensemble's average, a
concatenation of sigmoid heads), and the loss coefficient conventions.

What is checked:
- `probabilities.value_range` on traced graphs: the bounds of sigmoid /
  softmax outputs, their averages, concatenations, products, 1 - p, a
  clip, relu / tanh / linear outputs, and None where an op outside its
  table (cos) or a division by a variable stands in the way.
- The registered Fisher w.r.t. the probabilities p equals the brute-force
  Fisher of the Keras loss, float64: the registered loss's
  coeff * multiply_fisher in its logits space z, pulled back with the
  tape Jacobian dz/dp (J^T F_z J, per example), against
  sum over every target y of P(y | p) g_y g_y^T, g_y the tape gradient
  w.r.t. p of the Keras loss object's value at targets y (all 2^D
  Bernoulli target vectors, all classes), times k (the outputs per example
  Keras averages over) with average_over_outputs=False (kfac 0.2.x) and
  times 1 with True (the recipe's scale). Cases: binary cross-entropy on
  an average of sigmoid models and on a concatenation of sigmoid heads
  ([N, 2] and [N, 2, 2] outputs), categorical and sparse categorical on an
  average of softmax models. In a tf.function with Keras 3 (relative
  1e-9; measured <= 4.3e-16) and in a TF1 graph + Session with a tf_keras
  model built in it (tf_keras's binary cross-entropy adds eps = 1e-7 inside
  its logs, a relative change of about 2 eps / p in g_y g_y^T: 1e-5 there;
  measured <= 6.1e-7 for the binary cases, <= 1.5e-16 for the others).
- The report line names the logits of the output's probabilities.
- Kfac trains such an ensemble with model.fit (Keras 3): the loss falls.
- The optimizer's coefficient: Kfac(...) registers kfac 0.2.x's (the loss
  weight) and Kfac(adaptive=True) the Keras loss's per example (weight / k),
  read from the registration report after one fit step.
- Slow tier: the tf.function, fit and coefficient tests again under
  tf_keras (TF_USE_LEGACY_KERAS=1, a subprocess).
"""

import itertools
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.keras import keras_flavor
from kfac.python.keras import probabilities
from kfac.python.keras import utils as keras_utils
from kfac.python.kernel_tests import kfac_test_util

keras = keras_flavor.keras_module()
LEGACY = keras_flavor.legacy_keras_active()

N = 3       # batch
F_IN = 2    # input features
REL_KERAS3 = 1e-9
REL_TF_KERAS = 1e-5


# ------------------------------------------------------------ value_range
def test_value_range_of_traced_outputs():
  v = tf.Variable(2.0, dtype=tf.float32)
  found = {}

  @tf.function
  def trace(x):
    s1, s2 = tf.sigmoid(x), tf.sigmoid(2.0 * x)
    sm = tf.nn.softmax(x)
    lin = tf.nn.bias_add(tf.matmul(x, tf.ones([2, 2])), tf.zeros([2]))
    cases = {
        "sigmoid": s1,
        "softmax": sm,
        "average": (s1 + s2 + sm) / 3.0,
        "concat": tf.concat([s1, sm], axis=-1),
        "product": s1 * s2,
        "complement": 1.0 - s1,
        "stack_mean": tf.reduce_mean(tf.stack([s1, s2]), axis=0),
        "clip_linear": tf.clip_by_value(lin, 0.0, 1.0),
        "relu": tf.nn.relu(lin),
        "tanh": tf.tanh(lin),
        "linear": lin,
        "sum_of_two": s1 + s2,
        "cos": tf.math.cos(x),
        "by_variable": s1 / v,
    }
    for name, t in cases.items():
      found[name] = probabilities.value_range(t)
    return x

  trace.get_concrete_function(tf.TensorSpec([None, 2], tf.float32))
  inf = math.inf
  assert found == {
      "sigmoid": (0.0, 1.0), "softmax": (0.0, 1.0), "average": (0.0, 1.0),
      "concat": (0.0, 1.0), "product": (0.0, 1.0),
      "complement": (0.0, 1.0), "stack_mean": (0.0, 1.0),
      "clip_linear": (0.0, 1.0), "relu": (0.0, inf), "tanh": (-1.0, 1.0),
      "linear": (-inf, inf), "sum_of_two": (0.0, 2.0), "cos": None,
      "by_variable": None}
  within = {k for k, b in found.items()
            if probabilities.is_within_probabilities(b)}
  assert within == {"sigmoid", "softmax", "average", "concat", "product",
                    "complement", "stack_mean", "clip_linear"}


# ------------------------------------------------------------ the Fisher
class Case:
  """kind: the Keras loss; combine: "average" of three models or "concat"
  of sigmoid heads; units: outputs of each model / head; rank3: [N, 2, .]
  outputs (from [N, 2, F_IN] inputs)."""

  def __init__(self, kind, combine, units, rank3=False):
    self.kind, self.combine, self.units, self.rank3 = (kind, combine, units,
                                                      rank3)

  @property
  def name(self):
    return "%s-%s-%d%s" % (self.kind, self.combine, self.units,
                           "-rank3" if self.rank3 else "")

  @property
  def outputs(self):
    """Output entries per position."""
    return self.units * (2 if self.combine == "concat" else 1)

  @property
  def k(self):
    """Outputs per example Keras averages over (by hand)."""
    positions = 2 if self.rank3 else 1
    if self.kind == "binary_crossentropy":
      return positions * self.outputs
    return positions


CASES = [
    Case("binary_crossentropy", "average", 2),
    Case("binary_crossentropy", "concat", 1),
    Case("binary_crossentropy", "average", 1, rank3=True),
    Case("categorical_crossentropy", "average", 3),
    Case("sparse_categorical_crossentropy", "average", 3),
]


def _build_model(k, case):
  """An ensemble / multi-head model in the Keras module `k` (Keras 3 or
  tf_keras) whose output is probabilities in about (0.1, 0.9)."""
  act = "sigmoid" if case.kind == "binary_crossentropy" else "softmax"
  rng = np.random.RandomState(len(case.name))
  shape = (2, F_IN) if case.rank3 else (F_IN,)
  inputs = k.Input(shape)
  heads = []
  for _ in range(3 if case.combine == "average" else 2):
    dense = k.layers.Dense(
        case.units, activation=act,
        kernel_initializer=k.initializers.Constant(
            0.5 * rng.randn(F_IN, case.units)),
        bias_initializer=k.initializers.Constant(0.3 * rng.randn(case.units)))
    heads.append(dense(inputs))
  if case.combine == "average":
    out = k.layers.Average()(heads)
  else:
    out = k.layers.Concatenate()(heads)
  return k.Model(inputs, out)


def _data(case):
  rng = np.random.RandomState(7)
  return rng.randn(*((N, 2, F_IN) if case.rank3 else (N, F_IN)))


def _targets(case, p):
  """[(target tensor for every example, its probability per example)]:
  every value the Keras loss's target can take, with P(y | p)."""
  flat = tf.reshape(p, [N, -1])
  if case.kind == "binary_crossentropy":
    out = []
    size = int(flat.shape[1])
    for bits in itertools.product([0.0, 1.0], repeat=size):
      y = tf.constant(bits, p.dtype)
      prob = tf.reduce_prod(y * flat + (1 - y) * (1 - flat), axis=1)
      out.append((tf.reshape(tf.tile(y[None], [N, 1]), tf.shape(p)), prob))
    return out
  q = p / tf.reduce_sum(p, axis=-1, keepdims=True)
  out = []
  for c in range(case.units):
    if case.kind == "sparse_categorical_crossentropy":
      y = tf.fill([N, 1], c)
    else:
      y = tf.tile(tf.one_hot([c], case.units, dtype=p.dtype), [N, 1])
    out.append((y, q[:, c]))
  return out


def _fisher_pair(k, case, lc, p):
  """(registered coeff * Fisher w.r.t. p, brute-force Fisher of k * the
  Keras loss w.r.t. p), both [N, P, P], built in the current graph."""
  (loss_fn, coeff), = lc.losses_with_coeffs()
  z = loss_fn.inputs[0]
  size_z, size_p = z.shape[1:].num_elements(), p.shape[1:].num_elements()
  jac = tf.stack([tf.reshape(tf.gradients(z[:, j], p)[0], [N, size_p])
                  for j in range(size_z)], axis=1)          # [N, Z, P]
  f_z = tf.stack([coeff * loss_fn.multiply_fisher(
      tf.tile(tf.one_hot([j], size_z, dtype=z.dtype), [N, 1]))
                  for j in range(size_z)], axis=2)           # [N, Z, Z]
  registered = tf.matmul(jac, tf.matmul(f_z, jac), transpose_a=True)
  keras_loss = k.losses.get(case.kind)
  brute = tf.zeros([N, size_p, size_p], p.dtype)
  for y, prob in _targets(case, p):
    value = N * case.k * tf.reduce_mean(keras_loss(y, p))
    g = tf.reshape(tf.gradients(value, p)[0], [N, size_p])
    brute += prob[:, None, None] * g[:, :, None] * g[:, None, :]
  return registered, brute


def _check(registered, brute, case, average, rel):
  expected = brute / case.k if average else brute
  scale = np.abs(expected).max()
  assert scale > 0.1
  err = np.abs(registered - expected).max() / scale
  assert err < rel, (case.name, average, err)


@pytest.fixture
def float64_keras():
  with kfac_test_util.keras_float64(keras):
    yield


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fisher_on_probabilities_tf_function(case, float64_keras):
  del float64_keras
  model = _build_model(keras, case)
  keras_utils.watch(model)
  x = tf.constant(_data(case))
  reports = {}

  @tf.function
  def fishers():
    p = model(x, training=True)
    out = {}
    for average in (False, True):
      lc, reports[average] = keras_utils.register_model(
          model, case.kind, average_over_outputs=average)
      out[average] = _fisher_pair(keras, case, lc, p)
    return out, p

  out, p = fishers()
  p = p.numpy()
  assert 0.05 < p.min() and p.max() < 0.95, (p.min(), p.max())
  rel = REL_TF_KERAS if LEGACY else REL_KERAS3
  for average, (registered, brute) in out.items():
    _check(registered.numpy(), brute.numpy(), case, average, rel)
    assert "(logits of the output's probabilities)" in reports[average]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fisher_on_probabilities_tf1_graph_tf_keras(case):
  import tf_keras  # pylint: disable=g-import-not-at-top
  import tf_keras.src.backend  # pylint: disable=g-import-not-at-top,unused-import
  old = tf_keras.backend.floatx()
  tf_keras.backend.set_floatx("float64")
  try:
    with tf.Graph().as_default():
      x = tf.constant(_data(case))
      inputs = tf_keras.Input(tensor=x)
      model = _build_model(tf_keras, case)
      p = model(inputs)
      lcs = {average: keras_utils.get_layer_collection(
          model, case.kind, average_over_outputs=average)
             for average in (False, True)}
      ops = {average: _fisher_pair(tf_keras, case, lc, p)
             for average, lc in lcs.items()}
      sess = tf_keras.src.backend.get_session()
      sess.run(tf.compat.v1.global_variables_initializer())
      out = sess.run(ops)
  finally:
    tf_keras.backend.set_floatx(old)
  for average, (registered, brute) in out.items():
    _check(registered, brute, case, average, REL_TF_KERAS)


# ------------------------------------------------------------ training
@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_kfac_fits_an_ensemble_of_sigmoid_models():
  """kfac 0.2.x's testTrainingNestedModel, in Keras 3 with model.fit."""
  keras.utils.set_random_seed(0)
  rng = np.random.RandomState(0)
  x = rng.randn(128, 3).astype("float32")
  y = (x[:, :1] + 0.5 * x[:, 1:2] > 0).astype("float32")
  inputs = keras.Input((3,))
  members = [keras.Sequential([keras.Input((3,)),
                               keras.layers.Dense(8, activation="tanh"),
                               keras.layers.Dense(1, activation="sigmoid")])
             for _ in range(3)]
  outputs = keras.layers.Average()([m(inputs) for m in members])
  model = keras.Model(inputs, outputs)
  opt = kfac.keras.optimizers.Kfac(learning_rate=0.1, damping=0.01,
                                   model=model, loss="binary_crossentropy",
                                   seed=1)
  model.compile(opt, "binary_crossentropy")
  history = model.fit(x, y, batch_size=32, epochs=5, verbose=0)
  losses = history.history["loss"]
  assert "(logits of the output's probabilities)" in opt.registration_report
  assert np.all(np.isfinite(losses))
  assert losses[-1] < 0.7 * losses[0], losses


# ------------------------------------------------------------ coefficients
@pytest.mark.parametrize("adaptive,coeff", [(False, "coeff 1.5"),
                                            (True, "coeff 0.375")])
def test_optimizer_coefficient_convention(adaptive, coeff):
  """An mse loss on 4 outputs with loss weight 1.5: Kfac(...) registers
  kfac 0.2.x's coefficient (1.5), Kfac(adaptive=True) the Keras loss's per
  example (1.5 / 4)."""
  keras.utils.set_random_seed(0)
  x = np.random.RandomState(0).randn(16, 3).astype("float32")
  y = np.random.RandomState(1).randn(16, 4).astype("float32")
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
  kwargs = (dict(adaptive=True, damping=1.0) if adaptive else
            dict(learning_rate=0.01, damping=0.01))
  opt = kfac.keras.optimizers.Kfac(model=model, **kwargs)
  model.compile(opt, loss="mse", loss_weights=[1.5])
  model.fit(x, y, batch_size=16, epochs=1, verbose=0)
  (line,) = [l for l in opt.registration_report.splitlines()
             if l.startswith("loss: ")]
  assert line.endswith(coeff), line


@pytest.mark.slow  # subprocess: this file again under tf_keras
def test_under_tf_keras():
  if LEGACY:
    return  # this is the run under tf_keras
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__)))))
  env = dict(os.environ, TF_USE_LEGACY_KERAS="1")
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
       "-k", "tf_function or fits or coefficient", os.path.abspath(__file__)],
      env=env, cwd=root, capture_output=True, text=True, timeout=900,
      check=False)
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
  assert "\n8 passed" in result.stdout, result.stdout[-2000:]
