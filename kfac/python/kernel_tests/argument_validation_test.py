"""Constructor arguments are checked when the object is built, and the error
names the argument (reliability/arguments.py); hyperparameters given as
tensors or variables are checked when the step runs, in a TF1 Session and
in a tf.function."""

import numpy as np
import pytest
import tensorflow as tf

import kfac

BASE = dict(learning_rate=0.1, damping=0.1)

# (arguments, the pattern the error must match)
BAD_CORE_ARGUMENTS = [
    (dict(damping=0.0), "damping must be > 0"),
    (dict(damping=-1.0), "damping must be > 0"),
    (dict(damping=float("nan")), "damping must be finite"),
    (dict(learning_rate=-0.1), "learning_rate must be >= 0"),
    (dict(learning_rate="0.1"), "learning_rate must be a number"),
    (dict(momentum=1.0), "momentum must be >= 0.0 and < 1.0"),
    (dict(momentum=-0.5), "momentum must be >= 0.0 and < 1.0"),
    (dict(cov_ema_decay=1.5), "cov_ema_decay must be >= 0.0 and <= 1.0"),
    (dict(cov_ema_decay=-0.1), "cov_ema_decay must be >= 0.0 and <= 1.0"),
    (dict(cov_ema_decay="0.9"), "cov_ema_decay must be a number"),
    (dict(weight_decay_coeff=-1.0), "weight_decay_coeff must be >= 0"),
    (dict(norm_constraint=0.0), "norm_constraint must be > 0"),
    (dict(l2_reg=-1.0), "l2_reg must be >= 0"),
    (dict(precon_damping_mult=0.0), "precon_damping_mult must be > 0"),
    (dict(min_damping=-1.0), "min_damping must be >= 0"),
    (dict(batch_size=2.5), "batch_size must be an integer >= 1"),
    (dict(batch_size=0), "batch_size must be an integer >= 1"),
    (dict(damping_adaptation_interval=0),
     "damping_adaptation_interval must be an integer >= 1"),
    (dict(estimation_mode="bogus"), "Unknown estimation_mode 'bogus'"),
    (dict(momentum_type="nesterov"), "Unknown momentum_type 'nesterov'"),
    (dict(dtype="int32"), "dtype must be a floating-point dtype"),
    (dict(max_consecutive_skipped_steps=0),
     "max_consecutive_skipped_steps must be an integer >= 1"),
]


@pytest.mark.parametrize("cls", [kfac.KfacOptimizer,
                                 kfac.PeriodicInvCovUpdateKfacOpt])
@pytest.mark.parametrize("args,match", BAD_CORE_ARGUMENTS)
def test_bad_core_arguments_name_the_argument(cls, args, match):
  with pytest.raises(ValueError, match=match):
    cls(**dict(BASE, **args))


@pytest.mark.parametrize("args,match", [
    (dict(invert_every=0), "invert_every must be an integer >= 1"),
    (dict(cov_update_every=1.5), "cov_update_every must be an integer >= 1"),
    (dict(num_burnin_steps=-1), "num_burnin_steps must be an integer >= 0"),
])
def test_bad_periodic_arguments_name_the_argument(args, match):
  with pytest.raises(ValueError, match=match):
    kfac.PeriodicInvCovUpdateKfacOpt(**dict(BASE, **args))


def test_unknown_keyword_argument_is_named():
  with pytest.raises(TypeError, match="unexpected keyword arguments "
                     "loss_tensor"):
    kfac.KfacOptimizer(loss_tensor=1.0, **BASE)


def test_adaptive_damping_may_start_at_zero_above_a_positive_floor():
  opt = kfac.KfacOptimizer(learning_rate=0.1, damping=0.0, adapt_damping=True,
                           min_damping=1e-3, loss_fn=lambda batch: 0.0)
  assert float(opt.damping.numpy()) == pytest.approx(1e-3)
  with pytest.raises(ValueError, match="damping must be > 0"):
    kfac.KfacOptimizer(learning_rate=0.1, damping=0.0, adapt_damping=True,
                       min_damping=0.0, loss_fn=lambda batch: 0.0)


def test_good_edge_values_are_accepted():
  kfac.KfacOptimizer(learning_rate=0.0, damping=1e-12, momentum=0.0,
                     cov_ema_decay=0.0)
  kfac.KfacOptimizer(learning_rate=0.1, damping=0.1, momentum=0.999,
                     cov_ema_decay=1.0, batch_size=4.0)
  kfac.KfacOptimizer(learning_rate=np.float32(0.1), damping=np.array(0.1))
  # Tensors, variables and callables are checked when the step runs.
  kfac.KfacOptimizer(learning_rate=tf.Variable(-1.0), damping=lambda: -1.0)


def test_estimator_cov_ema_decay():
  with pytest.raises(ValueError, match="cov_ema_decay must be >= 0.0"):
    kfac.estimator.FisherEstimator(
        variables=[], cov_ema_decay=2.0, damping=0.1,
        layer_collection=kfac.LayerCollection())


@pytest.mark.parametrize("args,match", [
    (dict(learning_rate=-0.1, damping=0.01), "learning_rate must be >= 0"),
    (dict(learning_rate=0.1, damping=0.0), "damping must be > 0"),
    (dict(learning_rate=0.1, damping=0.01, momentum=1.5),
     "momentum must be >= 0.0 and < 1.0"),
    (dict(learning_rate=0.1, damping=0.01, weight_decay_coeff=-1.0),
     "weight_decay_coeff must be >= 0"),
    (dict(learning_rate=0.1, damping=0.01, cov_ema_decay=3.0),
     "cov_ema_decay must be >= 0.0 and <= 1.0"),
    (dict(learning_rate=0.1, damping=0.01, invert_every=0),
     "invert_every must be an integer >= 1"),
])
def test_bad_keras_arguments_name_the_argument(args, match):
  with pytest.raises(ValueError, match=match):
    kfac.keras.optimizers.Kfac(**args)


# ----------------------------------------------------------- at run time
def _model(w, x, lc):
  logits = tf.matmul(x, w)
  lc.register_fully_connected(w, x, logits)
  lc.register_softmax_cross_entropy_loss(logits, targets=tf.constant([0, 1]))
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=tf.constant([0, 1]), logits=logits))


X = np.array([[1.0, 2.0], [0.5, -1.0]], np.float32)


@pytest.mark.parametrize("world", ["graph", "function"])
@pytest.mark.parametrize("name,bad", [("damping", -0.5),
                                      ("learning_rate", -1.0),
                                      ("momentum", 1.0)])
def test_tensor_hyperparameters_are_checked_when_the_step_runs(world, name,
                                                               bad):
  """A variable hyperparameter set to a bad value between steps: the next
  step fails with an error naming it, and nothing changed."""
  def make(w, lc):
    hyper = tf.Variable(0.5, name="my_" + name)
    args = dict(learning_rate=0.1, damping=0.1, momentum=0.5,
                estimation_mode="exact", invert_every=1)
    args[name] = hyper
    return hyper, kfac.PeriodicInvCovUpdateKfacOpt(layer_collection=lc,
                                                   **args)

  if world == "graph":
    with tf.Graph().as_default():
      w = tf.Variable(np.eye(2, dtype=np.float32))
      lc = kfac.LayerCollection()
      loss = _model(w, tf.constant(X), lc)
      hyper, opt = make(w, lc)
      train = opt.minimize(loss, var_list=[w])
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(train)
        hyper.load(bad, sess)
        before = sess.run(w)
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match="PeriodicInvCovUpdateKfacOpt: %s must be"
                           % name):
          sess.run(train)
        np.testing.assert_array_equal(sess.run(w), before)
    return
  w = tf.Variable(np.eye(2, dtype=np.float32))
  hyper, opt = make(w, None)

  @tf.function
  def step():
    lc = kfac.LayerCollection()
    opt.minimize(_model(w, tf.constant(X), lc), var_list=[w],
                 layer_collection=lc)

  step()
  hyper.assign(bad)
  before = w.numpy()
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match="PeriodicInvCovUpdateKfacOpt: %s must be" % name):
    step()
  np.testing.assert_array_equal(w.numpy(), before)
