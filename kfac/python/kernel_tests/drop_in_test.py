"""What kfac 0.2.4 ran and this package runs as it did, with a warning,
where it otherwise checks more (issue 55; docs/migration.md, "Scripts
kfac 0.2.4 ran that warn here"):

* kfac 0.2.x's Keras functions (`kfac.keras.utils.get_layer_collection`,
  `register_loss`; the graph-mode Kfac uses the first) register a
  cross-entropy with from_logits=False on an output that is not a
  probability (a linear layer, a pooling, an average) with that output as
  the logits, as 0.2.4 did, and warn naming the output and what would be
  right; the Keras 3 `Kfac` optimizer keeps refusing it
  (keras_registration_test.py).
* Scalar tensors registered as a dense layer's weights are registered with
  a warning; building an estimator (every optimizer has one) on the
  collection raises the error naming them.
* kfac 0.2.x's private names read by its own tests: `_loss_tensor` (kept
  by the graph-mode Keras optimizer's core without adapt_damping),
  `_min_damping`, and a factor's `_cov` (0.2.x's moving-average object:
  `_var`, `add_to_average`, `value`, `reset`).

In a TF1 graph and in a tf.function."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import kfac
import kfac.keras
from kfac.python.keras import keras_flavor
from kfac.python.keras import layer_registration
from kfac.python.keras import utils as keras_utils

keras = keras_flavor.keras_module()


def _in_world(world, fn):
  """fn() in a fresh TF1 graph ("graph") or traced in a tf.function."""
  if world == "graph":
    with tf.Graph().as_default():
      return fn()
  out = {}

  @tf.function(autograph=False)
  def trace():
    out["value"] = fn()
    return tf.constant(0)

  trace.get_concrete_function()
  return out["value"]


def _ending_in(kind):
  inputs = keras.Input((4,))
  hidden = keras.layers.Dense(3, name="hidden")(inputs)
  if kind == "linear":
    out = keras.layers.Dense(2, name="linear_out")(hidden)
  else:
    out = keras.layers.Average(name="average_out")(
        [keras.layers.Dense(2, name="a")(hidden),
         keras.layers.Dense(2, name="b")(hidden)])
  return keras.Model(inputs, out)


@pytest.mark.parametrize("kind", ["linear", "average"])
@pytest.mark.parametrize("loss", ["categorical_crossentropy",
                                  "binary_crossentropy"])
def test_old_keras_functions_register_a_non_probability_as_logits(kind,
                                                                   loss):
  model = _ending_in(kind)
  keras_utils.watch(model)
  found = {}

  @tf.function(autograph=False)
  def trace(x):
    y = model(x, training=True)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      found["lc"] = keras_utils.get_layer_collection(model, loss=loss)
    found["warnings"] = [str(w.message) for w in caught
                         if issubclass(w.category, UserWarning)]
    found["y"] = y
    return y

  trace.get_concrete_function(tf.TensorSpec([None, 4], tf.float32))
  text = [w for w in found["warnings"] if "from_logits=False" in w]
  assert len(text) == 1, found["warnings"]
  # Names the output (its layer) and what would be right.
  assert ("%s_out" % kind) in text[0], text[0]
  assert "as the logits, as kfac 0.2.x did" in text[0]
  assert "from_logits=True" in text[0]
  # Registered as 0.2.4 did: the output itself is the logits.
  (registered,) = found["lc"].losses
  assert registered.inputs[0] is found["y"]


def test_the_keras3_optimizers_registration_still_refuses_it():
  model = _ending_in("linear")
  keras_utils.watch(model)

  @tf.function(autograph=False)
  def trace(x):
    model(x, training=True)
    layer_registration.register_model(model, "categorical_crossentropy")
    return x

  with pytest.raises(layer_registration.RegistrationError,
                     match=r"from_logits=False.*linear_out.*"
                     r"from_logits=True"):
    trace.get_concrete_function(tf.TensorSpec([None, 4], tf.float32))


@pytest.mark.parametrize("world", ["graph", "function"])
def test_scalar_dense_weights_register_with_a_warning_then_fail_by_name(
    world):
  def run():
    lc = kfac.LayerCollection()
    with pytest.warns(UserWarning, match=r"Dense layer weight w_scalar must "
                      r"have rank 2.*Registered anyway, as kfac 0.2.x did"):
      lc.register_fully_connected(
          tf.constant(1.0, name="w_scalar"), tf.constant(2.0),
          tf.constant(3.0))
    assert len(lc.get_blocks()) == 1
    if world == "function":
      with pytest.raises(ValueError, match=r"cannot compute factors for.*"
                         r"w_scalar must have rank 2"):
        lc.check_usable()
      return True
    w = tf.Variable(tf.ones([3, 2]), name="w_ok")
    x = tf.ones([4, 3])
    y = tf.matmul(x, w)
    lc.register_fully_connected(w, x, y)
    lc.register_squared_error_loss(y)
    # The estimator (every optimizer has one) stops, naming the weight.
    with pytest.raises(ValueError, match=r"cannot compute factors for.*"
                       r"w_scalar must have rank 2"):
      kfac.estimator.FisherEstimatorRoundRobin(
          variables=[w], cov_ema_decay=0.9, damping=0.1,
          layer_collection=lc).make_vars_and_create_op_thunks()
    return True

  assert _in_world(world, run)


def test_a_correct_registration_records_nothing_unusable():
  with tf.Graph().as_default():
    lc = kfac.LayerCollection()
    w = tf.Variable(tf.ones([3, 2]))
    x = tf.ones([4, 3])
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      lc.register_fully_connected(w, x, tf.matmul(x, w))
      lc.register_conv2d(params=tf.Variable(tf.ones((2, 3, 4, 5))),
                         strides=[1, 1, 1, 1], padding="SAME",
                         inputs=tf.ones((1, 2, 3, 4)),
                         outputs=tf.ones((1, 2, 3, 5)))
    lc.check_usable()  # no error


def test_core_optimizer_keeps_the_loss_tensor_and_min_damping():
  with tf.Graph().as_default():
    w = tf.Variable(tf.ones([3, 2]))
    x = tf.ones([4, 3])
    y = tf.matmul(x, w)
    lc = kfac.LayerCollection()
    lc.register_fully_connected(w, x, y)
    lc.register_squared_error_loss(y)
    loss = tf.reduce_sum(y)
    with pytest.warns(UserWarning, match="used by the damping adaptation"):
      opt = kfac.PeriodicInvCovUpdateKfacOpt(
          learning_rate=0.1, damping=0.1, min_damping=9.0,
          layer_collection=lc, loss=loss)
    assert opt._loss_tensor is loss
    assert opt._min_damping == 9.0
    np.testing.assert_equal(opt._num_burnin_steps, 0)


def _old_rule(calls, shape):
  """kfac 0.2.x's MovingAverageVariable in float64 numpy: a weighted sum
  and its total weight, read as their quotient."""
  total, weight = np.zeros(shape), 0.0
  for value, decay, w in calls:
    total, weight = decay * total + w * value, decay * weight + w
  return total / weight, weight


@pytest.mark.parametrize("world", ["graph", "function"])
def test_a_factor_keeps_the_old_moving_average_interface(world):
  """factor._cov._var is the statistic's variable; add_to_average gives the
  average (and weight) 0.2.x's weighted sum would read; reset zeroes both;
  a value of the wrong shape is refused naming the statistic."""
  rng = np.random.RandomState(0)
  a, b, c = (rng.randn(3, 3) for _ in range(3))
  calls = [(a, 1.0, 1.0), (b, 0.5, 2.0), (c, 0.9, 0.1)]
  want, want_weight = _old_rule(calls, (3, 3))

  def build(w):
    x = tf.ones([4, 2], tf.float64)
    lc = kfac.LayerCollection()
    y = tf.matmul(x, w)
    lc.register_fully_connected(w, x, y)
    lc.register_squared_error_loss(y)
    kfac.estimator.FisherEstimatorRoundRobin(
        variables=[w], layer_collection=lc, damping=0.2,
        cov_ema_decay=0.0).make_vars_and_create_op_thunks()
    factor = [f for f in lc.get_factors() if f.cov_shape == [3, 3]][0]
    view = factor._cov  # pylint: disable=protected-access
    assert view._var is factor.get_cov_var()  # pylint: disable=protected-access
    with pytest.raises(ValueError, match=r"add_to_average.*\(2, 2\)"):
      view.add_to_average(np.eye(2))
    return factor, view

  if world == "graph":
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
      factor, view = build(tf.Variable(tf.ones([2, 3], tf.float64)))
      ops = [view.add_to_average(v, decay=d, weight=w) for v, d, w in calls]
      sess.run(tf.compat.v1.global_variables_initializer())
      for op in ops:
        sess.run(op)
      got, got_weight = sess.run([view.value, view._total_weight])  # pylint: disable=protected-access
      sess.run(view.reset())
      after_reset = sess.run(factor.get_cov_var())
  else:
    # Registered in a trace (as the optimizers do); the state store makes
    # the factor's variables outside it.
    w = tf.Variable(tf.ones([2, 3], tf.float64))
    factor, view = _in_world("function", lambda: build(w))

    @tf.function
    def fold(value, decay, weight):
      view.add_to_average(value, decay=decay, weight=weight)

    for v, d, w in calls:
      fold(tf.constant(v), tf.constant(d, tf.float64), tf.constant(w, tf.float64))
    got = view.value.numpy()
    got_weight = view._total_weight.numpy()  # pylint: disable=protected-access

    @tf.function
    def reset():
      view.reset()

    reset()
    after_reset = factor.get_cov_var().numpy()
  np.testing.assert_allclose(got, want, rtol=1e-14, atol=1e-14)
  np.testing.assert_allclose(got_weight, want_weight, rtol=1e-15)
  np.testing.assert_array_equal(after_reset, np.zeros((3, 3)))
