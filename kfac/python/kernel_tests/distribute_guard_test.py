"""What K-FAC does not support under several replicas is refused with a
clear error instead of running silently wrong (the damping calibration, a
damping variable of the user's adapted by the damping rule, the
asynchronous optimizer, ops built in the cross-replica context, model
variables created outside the strategy), and one replica under a strategy
trains exactly as without one. (What is supported is checked against one replica in
distribute_test.py.)

The replicas are logical CPU devices, which must be configured before
TensorFlow initialises: each case runs in a subprocess (slow tier).
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import kfac

pytestmark = pytest.mark.slow

_PRELUDE = r'''
import sys
import numpy as np
import tensorflow as tf
cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
import kfac

rng = np.random.RandomState(0)
X = rng.randn(8, 3).astype(np.float32)
Y = rng.randint(0, 2, 8)
W0 = rng.randn(3, 2).astype(np.float32) * 0.5


def model(x, w, lc):
  logits = tf.matmul(x, w)
  lc.register_fully_connected(w, x, logits)
  lc.register_softmax_cross_entropy_loss(logits, targets=tf.constant(Y))
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=tf.constant(Y), logits=logits))


def make_opt(**kwargs):
  args = dict(invert_every=1, learning_rate=0.1, damping=0.1, momentum=0.0,
              estimation_mode="exact")
  args.update(kwargs)
  return kfac.PeriodicInvCovUpdateKfacOpt(**args)


def report(error):
  print("ERROR", type(error).__name__, str(error).replace("\n", " "))


def run_tf1_step(make, error):
  """Builds one TF1 replica step (call_for_each_replica) with the optimizer
  make(w) under MirroredStrategy; reports `error`."""
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with tf.Graph().as_default(), strategy.scope():
    w = tf.Variable(W0)
    opt = make(w)
    def step():
      lc = kfac.LayerCollection()
      return opt.minimize(model(tf.constant(X), w, lc), var_list=[w],
                          layer_collection=lc)
    try:
      strategy.extended.call_for_each_replica(step)
    except error as e:
      report(e)


def run_tf2_step(strategy, w, opt, error):
  """Builds and runs one TF2 step under strategy.run; reports `error`."""
  @tf.function
  def train():
    def step():
      lc = kfac.LayerCollection()
      opt.minimize(model(tf.constant(X), w, lc), var_list=[w],
                   layer_collection=lc)
    strategy.run(step)
  try:
    train()
  except error as e:
    report(e)
'''

_CASES = {
    # TF1 Session graph, one step per replica, the damping rule adapting a
    # variable of the user's.
    "tf1_adapt_damping": r'''
run_tf1_step(lambda w: make_opt(
    adapt_damping=True, damping=tf.Variable(0.1, name="my_damping"),
    learning_rate=0.1, loss_fn=lambda batch: tf.constant(0.0),
    train_batch=()), NotImplementedError)
''',
    # TF2: a tf.function step run by strategy.run, with burn-in calibration.
    "tf2_calibrate_damping": r'''
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
  w = tf.Variable(W0)
opt = make_opt(calibrate_damping=True, num_burnin_steps=2,
               loss_fn=lambda batch: tf.constant(0.0), train_batch=())
run_tf2_step(strategy, w, opt, NotImplementedError)
''',
    # The model's variable created outside strategy.scope().
    "tf2_variable_outside_scope": r'''
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
w = tf.Variable(W0, name="outside")
opt = make_opt()
run_tf2_step(strategy, w, opt, ValueError)
''',
    # The asynchronous optimizer (Session threads) in a TF1 replica step.
    "tf1_async": r'''
run_tf1_step(lambda w: kfac.AsyncInvCovUpdateKfacOpt(
    None, None, learning_rate=0.1, damping=0.1, momentum=0.0),
    NotImplementedError)
''',
    # The estimator's update ops, built in the strategy's cross-replica scope.
    "estimator_in_scope": r'''
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with tf.Graph().as_default(), strategy.scope():
  w = tf.Variable(W0)
  lc = kfac.LayerCollection()
  model(tf.constant(X), w, lc)
  est = kfac.estimator.FisherEstimator(
      variables=[w], cov_ema_decay=0.9, damping=0.1, layer_collection=lc,
      estimation_mode="exact")
  try:
    est.make_vars_and_create_op_thunks()
  except NotImplementedError as e:
    report(e)
''',
    # One replica under a strategy: the same steps as without a strategy.
    "one_replica": r'''
def run(strategy):
  with tf.Graph().as_default():
    scope = strategy.scope() if strategy else tf.init_scope()
    with scope:
      w = tf.Variable(W0)
    opt = make_opt()
    lc = kfac.LayerCollection()
    loss = model(tf.constant(X), w, lc)
    train = opt.minimize(loss, var_list=[w], layer_collection=lc)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      losses = [sess.run([loss, train])[0] for _ in range(4)]
      return losses, sess.run(w)
plain = run(None)
single = run(tf.distribute.OneDeviceStrategy("/cpu:0"))
print("LOSSES", " ".join("%.9g" % l for l in plain[0]))
print("MAXDIFF", float(np.max(np.abs(plain[1] - single[1]))),
      float(np.max(np.abs(np.array(plain[0]) - np.array(single[0])))))
''',
}


def _run(case):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  env["PYTHONPATH"] = os.pathsep.join(
      [str(pathlib.Path(kfac.__file__).parents[1])] +
      [p for p in [env.get("PYTHONPATH")] if p])
  proc = subprocess.run([sys.executable, "-c", _PRELUDE + _CASES[case]],
                        env=env, capture_output=True, text=True, timeout=300,
                        check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


@pytest.mark.parametrize("case, expected", [
    ("tf1_adapt_damping",
     "ERROR NotImplementedError PeriodicInvCovUpdateKfacOpt with several "
     "replicas (MirroredStrategy): adapt_damping=True with the damping in "
     "your variable my_damping"),
    ("tf2_calibrate_damping",
     "ERROR NotImplementedError PeriodicInvCovUpdateKfacOpt with several "
     "replicas (MirroredStrategy): calibrate_damping=True (the calibration "
     "tries the update on the model's variables inside a conditional"),
    ("tf1_async",
     "ERROR NotImplementedError AsyncInvCovUpdateKfacOpt with several "
     "replicas (MirroredStrategy): its update ops run in Session threads"),
    ("estimator_in_scope",
     "ERROR NotImplementedError K-FAC ops built in the cross-replica context "
     "of MirroredStrategy with 2 replicas: build the training step inside "
     "strategy.run"),
    ("tf2_variable_outside_scope",
     "ERROR ValueError K-FAC under MirroredStrategy updates the model's "
     "variables on every replica, but outside:0 was created outside "
     "strategy.scope()"),
])
def test_unsupported_uses_are_refused_with_a_clear_error(case, expected):
  out = _run(case)
  lines = [l for l in out.splitlines() if l.startswith("ERROR ")]
  assert len(lines) == 1, out
  assert lines[0].startswith(expected), lines[0]


def _values(out, tag):
  (line,) = [l for l in out.splitlines() if l.startswith(tag + " ")]
  return [float(v) for v in line.split()[1:]]


def test_one_replica_under_a_strategy_trains_as_without_one():
  out = _run("one_replica")
  losses = _values(out, "LOSSES")
  assert len(losses) == 4 and losses[-1] < losses[0], losses
  # Largest |difference| of the weights and of the losses: bit-identical.
  np.testing.assert_array_equal(_values(out, "MAXDIFF"), [0.0, 0.0])
