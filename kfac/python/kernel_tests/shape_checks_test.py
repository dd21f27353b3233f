"""A layer's inputs and outputs, and a loss's predictions and targets, must
have the same number of rows (reliability/shapes.py): a static mismatch
fails at registration, a run-time one (unknown batch sizes) fails the step
with an error naming the layer or loss, in a TF1 Session and in a
tf.function; matching batches train as before."""

import numpy as np
import pytest
import tensorflow as tf

import kfac

WORLDS = ("graph", "function")


def _dense(x_stats, x_model, lc, w, targets=None):
  """A dense layer whose registered inputs may differ from the model's."""
  out = tf.matmul(x_model, w)
  lc.register_fully_connected(w, x_stats, out)
  if targets is None:
    targets = tf.zeros([tf.shape(x_model)[0]], tf.int32)
  lc.register_softmax_cross_entropy_loss(out, targets=targets)
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=tf.zeros([tf.shape(x_model)[0]], tf.int32), logits=out))


def _conv(x_stats, x_model, lc, w, targets=None):
  out = tf.nn.conv2d(x_model, w, strides=1, padding="SAME")
  lc.register_conv2d(w, (1, 1, 1, 1), "SAME", x_stats, out)
  logits = tf.reduce_mean(out, axis=[1, 2])
  lc.register_softmax_cross_entropy_loss(
      logits, targets=tf.zeros([tf.shape(x_model)[0]], tf.int32))
  return tf.reduce_mean(logits)


def _empirical_dense(x_stats, x_model, lc, w, targets=None):
  return _dense(x_model, x_model, lc, w, targets=x_stats[:, 0] > 0)


MODELS = {
    # (model, weight shape, input shape without the batch, what the error
    # names)
    "dense": (_dense, (3, 2), (3,), "layer w: inputs and outputs"),
    "conv": (_conv, (2, 2, 1, 2), (4, 4, 1), "layer w: inputs and outputs"),
    "loss_targets": (_empirical_dense, (3, 2), (3,),
                     "targets and predictions"),
}


def _train(world, model, w_shape, x_shape, rows_stats, rows_model):
  """Builds the step with batch sizes unknown at build time and runs it on
  (rows_stats, rows_model) rows."""
  x_s = np.ones((rows_stats,) + x_shape, np.float32)
  x_m = np.ones((rows_model,) + x_shape, np.float32)
  opt_args = dict(learning_rate=0.1, damping=0.1, estimation_mode="empirical")
  if world == "graph":
    with tf.Graph().as_default():
      w = tf.Variable(0.1 * np.ones(w_shape, np.float32), name="w")
      xs = tf.compat.v1.placeholder(tf.float32, (None,) + x_shape)
      xm = tf.compat.v1.placeholder(tf.float32, (None,) + x_shape)
      lc = kfac.LayerCollection()
      loss = model(xs, xm, lc, w)
      opt = kfac.PeriodicInvCovUpdateKfacOpt(layer_collection=lc, **opt_args)
      train = opt.minimize(loss, var_list=[w])
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(train, {xs: x_s, xm: x_m})
    return
  w = tf.Variable(0.1 * np.ones(w_shape, np.float32), name="w")
  opt = kfac.PeriodicInvCovUpdateKfacOpt(**opt_args)
  spec = tf.TensorSpec((None,) + x_shape, tf.float32)

  @tf.function(input_signature=[spec, spec])
  def step(xs, xm):
    lc = kfac.LayerCollection()
    opt.minimize(model(xs, xm, lc, w), var_list=[w], layer_collection=lc)

  step(tf.constant(x_s), tf.constant(x_m))


@pytest.mark.parametrize("world", [  # the function world: slow tier
    "graph", pytest.param("function", marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", sorted(MODELS))
def test_run_time_row_mismatch_names_the_culprit(world, case):
  model, w_shape, x_shape, culprit = MODELS[case]
  _train(world, model, w_shape, x_shape, 4, 4)  # matching rows train
  with pytest.raises(tf.errors.InvalidArgumentError) as info:
    _train(world, model, w_shape, x_shape, 5, 4)
  assert culprit in info.value.message
  assert "different numbers of rows" in info.value.message


def test_static_row_mismatch_fails_at_registration():
  w = tf.Variable(np.ones((3, 2), np.float32), name="w")
  lc = kfac.LayerCollection()
  with pytest.raises(ValueError, match=r"Outputs of the layer with weight w "
                     r"must have shape \(5, 2\)"):
    lc.register_fully_connected(w, tf.ones([5, 3]), tf.ones([4, 2]))
  loss = kfac.loss_functions.CategoricalLogitsNegativeLogProbLoss(
      tf.ones([4, 3]), targets=tf.zeros([6], tf.int32))
  with pytest.raises(ValueError, match="targets have 6 rows but "
                     "predictions have 4"):
    loss.evaluate()
