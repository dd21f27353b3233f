r"""K-FAC under tf.estimator.Estimator and TPUEstimator (TensorFlow 2.15).

The Estimator lives in the `tensorflow-estimator` package, which exists for
TensorFlow <= 2.15 only. This file therefore runs only in the environment of
`make test-tf215` (.venv-tf215: tensorflow-cpu 2.15, tensorflow-estimator
2.15); the project's conftest.py keeps it out of the normal tiers (it puts
the file in `collect_ignore` when `tensorflow_estimator` is not installed),
so it is neither run nor skipped there.

The model is a 4-6-3 tanh MLP classifier on a synthetic teacher problem
(fixed batches, fixed initial weights), registered in a kfac.LayerCollection
and trained with kfac.PeriodicInvCovUpdateKfacOpt ("exact" estimation mode:
no sampling, so runs are reproducible bit for bit). The tests check that

  * an Estimator trains exactly like a hand-written TF1 Session loop over the
    same batches (per-step losses and weights);
  * an Estimator with RunConfig(train_distribute=MirroredStrategy over R
    logical CPUs) trains like the one-replica Estimator on the same global
    batches: weights and every other checkpointed variable (K-FAC's
    statistics, inverses, velocities, counters) within 1e-5 relative;
  * an Estimator that stops and resumes from its checkpoint (a second
    train() call in the same model_dir) continues exactly: K-FAC's state is
    checkpointed and restored with the weights, also when the number of
    replicas changes between the two calls (1 -> R and R -> 1);
  * a TPUEstimator(use_tpu=False) with a TPUEstimatorSpec trains exactly like
    the Estimator;
  * examples/distributed_estimator.py runs and its loss falls.

The MirroredStrategy runs need several logical CPU devices, configured
before TensorFlow initialises: they run in a subprocess, this file as a
program:

  python -m kfac.python.kernel_tests.estimator_tf215_test mirrored R
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import numpy as np
import tensorflow as tf

ROOT = pathlib.Path(__file__).resolve().parents[3]

STEPS = 10
BATCH = 16  # the global batch
DIM, HIDDEN, CLASSES = 4, 6, 3

_RNG = np.random.RandomState(0)
X = _RNG.randn(STEPS, BATCH, DIM).astype(np.float32)
_TEACHER = _RNG.randn(DIM, CLASSES)
Y = np.argmax(X @ _TEACHER + 0.3 * _RNG.randn(STEPS, BATCH, CLASSES),
              axis=-1).astype(np.int32)
INIT = {
    "w1": (_RNG.randn(DIM, HIDDEN) * 0.5).astype(np.float32),
    "b1": np.zeros(HIDDEN, np.float32),
    "w2": (_RNG.randn(HIDDEN, CLASSES) * 0.5).astype(np.float32),
    "b2": np.zeros(CLASSES, np.float32),
}
LOSS_NAME = "train_loss"


def build_train_op(x, y):
  """The model on the batch (x, y), registered for K-FAC; (loss, train_op).

  Called once per graph (once per replica under a strategy): plain TF1
  variables with constant initial values, the optimizer's `minimize` with
  the global step, as an Estimator model_fn does it.
  """
  import kfac  # pylint: disable=g-import-not-at-top
  v = {name: tf.compat.v1.get_variable(name, initializer=tf.constant(value))
       for name, value in INIT.items()}
  lc = kfac.LayerCollection()
  pre = tf.matmul(x, v["w1"]) + v["b1"]
  lc.register_fully_connected((v["w1"], v["b1"]), x, pre)
  act = tf.tanh(pre)
  logits = tf.matmul(act, v["w2"]) + v["b2"]
  lc.register_fully_connected((v["w2"], v["b2"]), act, logits)
  lc.register_softmax_cross_entropy_loss(logits, targets=y)
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=y, logits=logits))
  opt = kfac.PeriodicInvCovUpdateKfacOpt(
      invert_every=2, cov_update_every=1, learning_rate=0.1, damping=0.1,
      momentum=0.9, estimation_mode="exact")
  # Under train_distribute, minimize scales this mean loss by 1 / replicas
  # (the tf.compat.v1 optimizer rule for Estimators): nothing to do here.
  train_op = opt.minimize(
      loss, global_step=tf.compat.v1.train.get_or_create_global_step(),
      layer_collection=lc)
  return tf.identity(loss, name=LOSS_NAME), train_op


def model_fn(features, labels, mode):
  loss, train_op = build_train_op(features, labels)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def tpu_model_fn(features, labels, mode, params):
  del params  # batch_size: the input_fn's business
  loss, train_op = build_train_op(features, labels)
  return tf.compat.v1.estimator.tpu.TPUEstimatorSpec(
      mode, loss=loss, train_op=train_op)


def input_fn(replicas=1):
  """The STEPS global batches in order. Under MirroredStrategy the Estimator
  gives replica r the dataset elements k * R + r, so each global batch is
  cut into R consecutive per-replica elements of BATCH / R examples."""
  xs = X.reshape(STEPS * replicas, BATCH // replicas, DIM)
  ys = Y.reshape(STEPS * replicas, BATCH // replicas)
  return tf.data.Dataset.from_tensor_slices((xs, ys))


class LossHook(tf.compat.v1.train.SessionRunHook):
  """Records the mean over the replicas of the losses named LOSS_NAME
  (each replica's mean loss on its equal share of the global batch)."""

  def __init__(self):
    self.losses = []
    self._tensors = None

  def begin(self):
    graph = tf.compat.v1.get_default_graph()
    self._tensors = [op.outputs[0] for op in graph.get_operations()
                     if op.name.split("/")[-1] == LOSS_NAME]
    assert self._tensors, "no %s tensor in the graph" % LOSS_NAME

  def before_run(self, run_context):
    return tf.compat.v1.train.SessionRunArgs(self._tensors)

  def after_run(self, run_context, run_values):
    self.losses.append(float(np.mean(run_values.results)))


def _quiet():
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)


def checkpoint_values(model_dir):
  """Every variable of the Estimator's last checkpoint, by name."""
  reader = tf.train.load_checkpoint(model_dir)
  return {name: reader.get_tensor(name)
          for name in reader.get_variable_to_shape_map()}


def run_estimator(model_dir, replicas=1, strategy=None, steps=STEPS,
                  first_step=0):
  """Trains `steps` steps from the global batch `first_step` on (resuming
  from model_dir's checkpoint if there is one); (losses, checkpointed
  variables)."""
  _quiet()
  kwargs = {}
  if replicas > 1:
    kwargs = dict(
        train_distribute=strategy,
        # Without it the Session sees one CPU device and the replicas' first
        # collective waits forever.
        session_config=tf.compat.v1.ConfigProto(
            device_count={"CPU": replicas}))
  config = tf.estimator.RunConfig(
      model_dir=model_dir, save_checkpoints_steps=10 * STEPS,
      log_step_count_steps=10 * STEPS, **kwargs)
  est = tf.estimator.Estimator(model_fn, config=config)
  hook = LossHook()
  est.train(lambda: input_fn(replicas).skip(first_step * replicas),
            steps=steps, hooks=[hook])
  return hook.losses, checkpoint_values(model_dir)


def run_tpu_estimator(model_dir):
  _quiet()
  config = tf.compat.v1.estimator.tpu.RunConfig(
      model_dir=model_dir, save_checkpoints_steps=10 * STEPS,
      log_step_count_steps=10 * STEPS)
  est = tf.compat.v1.estimator.tpu.TPUEstimator(
      model_fn=tpu_model_fn, use_tpu=False, config=config,
      train_batch_size=BATCH)

  def tpu_input_fn(params):  # params["batch_size"] == train_batch_size
    return tf.data.Dataset.from_tensor_slices(
        (X.reshape(-1, DIM), Y.reshape(-1))).batch(
            params["batch_size"], drop_remainder=True)

  hook = LossHook()
  est.train(tpu_input_fn, steps=STEPS, hooks=[hook])
  return hook.losses, checkpoint_values(model_dir)


def run_session_loop():
  """The same STEPS steps by hand: one graph, one Session, the dataset's
  iterator; (losses, {weight name: value})."""
  with tf.Graph().as_default():
    x, y = tf.compat.v1.data.make_one_shot_iterator(input_fn()).get_next()
    loss, train_op = build_train_op(x, y)
    weights = {v.op.name: v for v in tf.compat.v1.global_variables()
               if v.op.name in INIT}
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      losses = [float(sess.run([loss, train_op])[0]) for _ in range(STEPS)]
      return losses, sess.run(weights)


def rel_diff(values, reference):
  """max |a - b| / max |b| over the names of `reference`; worst name."""
  worst, worst_name = 0.0, None
  for name, ref in reference.items():
    ref = np.asarray(ref, np.float64)
    diff = np.max(np.abs(np.asarray(values[name], np.float64) - ref),
                  initial=0.0)
    rel = float(diff / max(np.max(np.abs(ref), initial=0.0), 1e-6))
    if rel > worst or worst_name is None:
      worst, worst_name = rel, name
  return worst, worst_name


def _assert_trains(losses):
  assert len(losses) == STEPS, losses
  assert all(np.isfinite(losses)), losses
  # Measured: 0.977 -> 0.383 (0.39 of the first).
  assert losses[-1] < 0.75 * losses[0], losses


# ------------------------------------------------------------------ tests

def test_estimator_trains_like_a_session_loop(tmp_path):
  session_losses, session_weights = run_session_loop()
  losses, values = run_estimator(str(tmp_path))
  _assert_trains(losses)
  # The same graph, the same batches in the same order: equal (measured
  # bit-identical).
  np.testing.assert_allclose(losses, session_losses, rtol=1e-5)
  rel, name = rel_diff(values, session_weights)
  assert rel <= 1e-5, (rel, name)
  assert values["global_step"] == STEPS


def test_estimator_resumes_kfac_state_from_its_checkpoint(tmp_path):
  """Two train() calls of 4 and 6 steps in one model_dir (the second
  restores the weights, the global step and K-FAC's statistics, inverses,
  velocities and counter from the checkpoint) = 10 steps in one call."""
  straight_losses, straight = run_estimator(str(tmp_path / "straight"))
  resumed = str(tmp_path / "resumed")
  losses_a, _ = run_estimator(resumed, steps=4)
  losses_b, values = run_estimator(resumed, steps=STEPS - 4, first_step=4)
  np.testing.assert_allclose(losses_a + losses_b, straight_losses, rtol=1e-5)
  assert sorted(values) == sorted(straight)
  rel, name = rel_diff(values, straight)
  assert rel <= 1e-5, (rel, name)  # measured: bit-identical


def test_tpu_estimator_without_tpu_trains_like_the_estimator(tmp_path):
  est_losses, est_values = run_estimator(str(tmp_path / "estimator"))
  losses, values = run_tpu_estimator(str(tmp_path / "tpu"))
  _assert_trains(losses)
  np.testing.assert_allclose(losses, est_losses, rtol=1e-5)
  # Every variable of the Estimator's checkpoint, K-FAC state included.
  missing = sorted(set(est_values) - set(values))
  assert not missing, missing
  rel, name = rel_diff(values, est_values)
  assert rel <= 1e-5, (rel, name)


def _run_program(*args, timeout=300):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.run(
      [sys.executable] + list(args), cwd=str(ROOT), env=env,
      capture_output=True, text=True, timeout=timeout, check=False)
  assert proc.returncode == 0, (proc.stdout[-3000:] + proc.stderr[-5000:])
  return proc.stdout


def test_mirrored_estimator_trains_like_one_replica():
  """R = 2 and 4 logical CPUs, each replica on BATCH / R examples of every
  global batch, against the one-replica Estimator on the global batches;
  checkpoints resume across replica counts."""
  out = _run_program("-m", "kfac.python.kernel_tests.estimator_tf215_test",
                     "mirrored", "2", "4")
  results = [json.loads(line[len("RESULT "):])
             for line in out.splitlines() if line.startswith("RESULT ")]
  assert [r["replicas"] for r in results] == [2, 4], out[-3000:]
  for r in results:
    _assert_trains(r["losses"])
    # The checkpoint holds the same variables under the same names as the
    # one-replica run's (K-FAC's state saved once, from the first replica).
    assert r["names"] and r["up_names"] and r["down_names"], r
    # Measured (R = 2 / 4): weights 1.8e-7 / 2.4e-7, K-FAC's state
    # 8.3e-7 / 5.5e-7, losses 1.3e-7 / 9.9e-8.
    assert r["weights_rel"] <= 1e-5, r
    assert r["state_rel"] <= 1e-5, r
    assert r["losses_rel"] <= 1e-5, r
    # Resumed with another replica count (1 -> R, R -> 1 at step 4): every
    # variable as after 10 one-replica steps.
    assert r["up_rel"] <= 1e-5, r
    assert r["down_rel"] <= 1e-5, r
    assert r["moved"] > 0.05, r  # it did train


def test_distributed_estimator_example_runs():
  out = _run_program(str(ROOT / "examples" / "distributed_estimator.py"),
                     "--replicas=2", "--steps=12", "--print_every=3",
                     "--batch_size=64", "--check_single")
  losses = [float(v) for v in re.findall(r"^step +\d+ +loss +([-+0-9.eE]+)",
                                         out, re.M)]
  assert len(losses) >= 4, out[-3000:]
  assert all(np.isfinite(losses)), losses
  assert losses[-1] < 0.75 * losses[0], losses
  rel = float(re.search(r"max relative weight difference to one replica: "
                        r"([-+0-9.eE]+)", out).group(1))
  assert rel <= 1e-5, out[-3000:]


# ---------------------------------------------------------------- program

def _mirrored(replica_counts):
  """One-replica Estimator, then per R (the process has max(R) logical
  CPUs; one strategy over the first R of them): a MirroredStrategy
  Estimator, and two resumed runs that change the replica count at step 4
  (1 -> R and R -> 1) in the same model_dir."""
  with tempfile.TemporaryDirectory() as tmp:
    losses1, values1 = run_estimator(os.path.join(tmp, "one"))
    weights1 = {n: values1[n] for n in INIT}
    state1 = {n: v for n, v in values1.items() if n not in INIT}
    for replicas in replica_counts:
      strategy = tf.distribute.MirroredStrategy(
          ["/cpu:%d" % i for i in range(replicas)])
      losses, values = run_estimator(
          os.path.join(tmp, "r%d" % replicas), replicas, strategy)
      w_rel, w_worst = rel_diff(values, weights1)
      # K-FAC's state is saved once (from the first replica), under the
      # names of the one-replica run.
      s_rel, s_worst = rel_diff(values, state1)
      l_rel = float(np.max(np.abs(np.subtract(losses, losses1)) /
                           np.abs(losses1)))
      up = os.path.join(tmp, "up%d" % replicas)
      run_estimator(up, steps=4)
      _, values_up = run_estimator(up, replicas, strategy, steps=STEPS - 4,
                                   first_step=4)
      down = os.path.join(tmp, "down%d" % replicas)
      run_estimator(down, replicas, strategy, steps=4)
      _, values_down = run_estimator(down, steps=STEPS - 4, first_step=4)
      print("RESULT " + json.dumps(dict(
          replicas=replicas, losses=losses, losses_rel=l_rel,
          weights_rel=w_rel, weights_worst=w_worst, state_rel=s_rel,
          state_worst=s_worst, n_state=len(state1),
          names=sorted(values) == sorted(values1),
          up_rel=rel_diff(values_up, values1)[0],
          up_names=sorted(values_up) == sorted(values1),
          down_rel=rel_diff(values_down, values1)[0],
          down_names=sorted(values_down) == sorted(values1),
          moved=max(float(np.max(np.abs(values1[n] - INIT[n])))
                    for n in INIT))), flush=True)


def main(argv):
  if len(argv) < 3 or argv[1] != "mirrored":
    raise SystemExit("usage: %s mirrored R [R ...]" % argv[0])
  counts = [int(r) for r in argv[2:]]
  cpus = tf.config.list_physical_devices("CPU")
  tf.config.set_logical_device_configuration(
      cpus[0], [tf.config.LogicalDeviceConfiguration()] * max(counts))
  _mirrored(counts)


if __name__ == "__main__":
  main(sys.argv)
