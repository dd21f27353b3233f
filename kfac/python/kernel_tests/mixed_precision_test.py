"""Half-precision models: float16 / bfloat16 layers keep their K-FAC
statistics, averages and inverses in float32 (LayerCollection casts the
activations and output gradients once), precondition the gradients in
float32 and apply the update in the variable's dtype. Their steps equal
the float32 model's within the half precision's rounding; a bfloat16
convnet trains; Keras fit under the mixed_bfloat16 and mixed_float16
(LossScaleOptimizer) policies equals fit in float32 within the same
tolerance."""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import reference as ref

SIZES = (4, 6, 3)
# Tolerance of 3 steps against float32, relative to the largest weight (a
# few half-precision ulps: float16 has 11 significant bits, bfloat16 8).
# Measured: float16 <= 1.3e-3, bfloat16 <= 1.2e-2 (Keras biases).
RTOL = {"float16": 3e-3, "bfloat16": 2.5e-2}


def _batches(n=3):
  rng = np.random.RandomState(5)
  return [(rng.randn(16, SIZES[0]).astype(np.float32),
           rng.randint(0, SIZES[-1], 16).astype(np.int32)) for _ in range(n)]


def _mlp_step(variables, x, y, lc):
  w1, b1, w2, b2 = variables
  x = tf.cast(x, w1.dtype)
  pre = tf.matmul(x, w1) + b1
  hidden = tf.tanh(pre)
  logits = tf.matmul(hidden, w2) + b2
  lc.register_fully_connected((w1, b1), x, pre)
  lc.register_fully_connected((w2, b2), hidden, logits)
  lc.register_softmax_cross_entropy_loss(logits, targets=y)
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=y, logits=tf.cast(logits, tf.float32)))


def _train(world, dtype):
  """Weights (as float32) after 3 exact-mode steps of the MLP in `dtype`,
  and the dtypes of the factors' statistics."""
  inits = ref.mlp_inits(SIZES, seed=2, dtype=np.float32)
  opt_args = dict(learning_rate=0.1, damping=0.05, momentum=0.5,
                  invert_every=1, estimation_mode="exact")
  if world == "graph":
    with tf.Graph().as_default():
      variables = [tf.Variable(tf.cast(v, dtype)) for v in inits]
      x = tf.compat.v1.placeholder(tf.float32, [None, SIZES[0]])
      y = tf.compat.v1.placeholder(tf.int32, [None])
      lc = kfac.LayerCollection()
      loss = _mlp_step(variables, x, y, lc)
      opt = kfac.PeriodicInvCovUpdateKfacOpt(layer_collection=lc, **opt_args)
      train = opt.minimize(loss, var_list=variables)
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for bx, by in _batches():
          sess.run(train, {x: bx, y: by})
        weights = sess.run([tf.cast(v, tf.float32) for v in variables])
      stat_dtypes = {f.get_cov_var().dtype.base_dtype for f in opt.factors}
      return weights, stat_dtypes
  variables = [tf.Variable(tf.cast(v, dtype)) for v in inits]
  opt = kfac.PeriodicInvCovUpdateKfacOpt(**opt_args)

  @tf.function
  def step(x, y):
    lc = kfac.LayerCollection()
    opt.minimize(_mlp_step(variables, x, y, lc), var_list=variables,
                 layer_collection=lc)

  for bx, by in _batches():
    step(tf.constant(bx), tf.constant(by))
  stat_dtypes = {v.dtype.base_dtype for k, v in
                 opt.state_store.variables_by_name.items()
                 if k.endswith("/cov")}
  return [v.numpy().astype(np.float32) for v in variables], stat_dtypes


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_steps_equal_float32_steps(world, dtype):
  expected, f32_stats = _train(world, tf.float32)
  actual, stats = _train(world, tf.as_dtype(dtype))
  assert stats == {tf.float32} == f32_stats
  for a, e, init in zip(actual, expected,
                        ref.mlp_inits(SIZES, seed=2, dtype=np.float32)):
    assert not np.allclose(e, init)  # the steps moved the weights
    scale = np.max(np.abs(e))
    np.testing.assert_allclose(a, e, rtol=0, atol=RTOL[dtype] * scale)


def test_bfloat16_convnet_trains():
  rng = np.random.RandomState(0)
  x = rng.randn(32, 8, 8, 1).astype(np.float32)
  y = (x[:, :4].mean(axis=(1, 2, 3)) > 0).astype(np.int32)
  kernel = tf.Variable(tf.cast(0.3 * rng.randn(3, 3, 1, 4), tf.bfloat16))
  dense = tf.Variable(tf.cast(0.3 * rng.randn(4, 2), tf.bfloat16))
  opt = kfac.PeriodicInvCovUpdateKfacOpt(learning_rate=0.2, damping=0.01,
                                         invert_every=2)

  @tf.function
  def step():
    lc = kfac.LayerCollection()
    xb = tf.cast(x, tf.bfloat16)
    conv = tf.nn.conv2d(xb, kernel, strides=1, padding="SAME")
    lc.register_conv2d(kernel, (1, 1, 1, 1), "SAME", xb, conv)
    pooled = tf.reduce_mean(tf.nn.relu(conv), axis=[1, 2])
    logits = tf.matmul(pooled, dense)
    lc.register_fully_connected(dense, pooled, logits)
    lc.register_softmax_cross_entropy_loss(logits, targets=y)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.cast(logits, tf.float32)))
    opt.minimize(loss, var_list=[kernel, dense], layer_collection=lc)
    return loss

  losses = [float(step().numpy()) for _ in range(25)]
  assert kernel.dtype == tf.bfloat16
  assert all(np.isfinite(losses))
  assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses


def _keras_run(policy, steps=3, **kfac_args):
  from kfac.python.keras import keras_flavor  # pylint: disable=g-import-not-at-top
  keras = keras_flavor.keras_module()
  keras.mixed_precision.set_global_policy(policy)
  try:
    model = keras.Sequential([
        keras.Input((SIZES[0],)),
        keras.layers.Dense(SIZES[1], activation="tanh"),
        keras.layers.Dense(SIZES[2]),
        keras.layers.Activation("linear", dtype="float32")])
    model.set_weights(ref.mlp_inits(SIZES, seed=2, dtype=np.float32))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    args = dict(learning_rate=0.1, damping=0.05, invert_every=1,
                estimation_mode="exact")
    args.update(kfac_args)
    opt = kfac.keras.optimizers.Kfac(model=model, loss=loss, **args)
    model.compile(optimizer=opt, loss=loss)
    for bx, by in _batches(steps):
      model.train_on_batch(bx, by)
    return [np.asarray(w, np.float32) for w in model.get_weights()]
  finally:
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("policy", [
    pytest.param("mixed_bfloat16", marks=pytest.mark.slow),  # the cast path
    "mixed_float16"])  # of float16 plus the loss scaling's conditional
def test_keras_mixed_precision_fit_equals_float32(policy):
  """mixed_float16 wraps Kfac in Keras's LossScaleOptimizer, which applies
  it inside a conditional branch: K-FAC builds its statistics in the
  forward pass's graph around it."""
  expected = _keras_run("float32")
  actual = _keras_run(policy)
  tol = RTOL["bfloat16" if "bfloat16" in policy else "float16"]
  inits = ref.mlp_inits(SIZES, seed=2, dtype=np.float32)
  for a, e, init in zip(actual, expected, inits):
    atol = tol * np.max(np.abs(e))
    np.testing.assert_allclose(a, e, rtol=0, atol=atol)
    # Every step was taken (none skipped by the loss scaling).
    assert np.max(np.abs(a - init)) > 3 * atol


def test_keras_adaptive_under_mixed_float16_is_refused_clearly():
  """The quadratic model's curvature products cannot be taken inside the
  loss scaling's conditional yet: a clear error names the alternatives
  (mixed_bfloat16 works, see above)."""
  with pytest.raises(Exception, match="mixed_bfloat16 policy, float32, or a "
                     "fixed learning rate"):
    _keras_run("mixed_float16", steps=1, learning_rate=None, adaptive=True)
  _keras_run("mixed_bfloat16", steps=2, learning_rate=None, adaptive=True)
