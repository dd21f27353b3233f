r"""K-FAC in a tf.estimator.Estimator job, on several replicas.

A 20-64-5 tanh MLP classifier on a synthetic teacher problem trains with
kfac.PeriodicInvCovUpdateKfacOpt inside an Estimator model_fn (a TF1 graph:
variables, a kfac.LayerCollection, `opt.minimize(loss, global_step=...)`).
With --replicas > 1 the Estimator runs under
RunConfig(train_distribute=tf.distribute.MirroredStrategy(...)), each
replica on its share of every global batch; K-FAC reduces its statistics
and gradients across the replicas, so the run is the one-replica run on the
global batch (--check_single trains that too and prints the largest relative
weight difference).

Needs TensorFlow 2.15 and tensorflow-estimator (the Estimator is gone from
2.16+): run it with the venv of `make test-tf215`.

  .venv-tf215/bin/python examples/distributed_estimator.py --replicas=2
  .venv-tf215/bin/python examples/distributed_estimator.py --replicas=4 \
      --steps=100 --check_single
  .venv-tf215/bin/python examples/distributed_estimator.py --devices=gpu

Without GPUs the replicas are logical CPU devices (--replicas of them, split
before TensorFlow initialises); the Session must then also be told about
them: session_config=tf.compat.v1.ConfigProto(device_count={"CPU": R}),
without which the replicas' first collective waits forever.

The model_fn returns the plain mean loss: under an Estimator's
train_distribute, `minimize` scales it by 1 / replicas itself (the
tf.compat.v1 optimizer rule), so that the replicas' summed gradients are the
global batch's mean gradient.
"""

import os
import sys
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

FLAGS = flags.FLAGS
flags.DEFINE_integer("replicas", 2, "Replicas (logical CPU devices without "
                     "GPUs; 1: no strategy).")
flags.DEFINE_enum("devices", "cpu", ["cpu", "gpu"], "Replica devices.")
flags.DEFINE_integer("steps", 60, "Training steps.")
flags.DEFINE_integer("batch_size", 256, "Global batch (all replicas).")
flags.DEFINE_integer("print_every", 10, "Steps between progress lines.")
flags.DEFINE_float("learning_rate", 0.1, "K-FAC learning rate.")
flags.DEFINE_float("damping", 0.1, "K-FAC damping.")
flags.DEFINE_string("model_dir", None,
                    "Estimator model_dir (default: a temporary folder, "
                    "removed at the end).")
flags.DEFINE_bool("check_single", False,
                  "Also train one replica (no strategy) on the same global "
                  "batches and print the largest relative weight "
                  "difference.")

DIM, HIDDEN, CLASSES = 20, 64, 5


def _configure_devices():
  """(tf, replica device names); splits the CPU before TF initialises."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  if FLAGS.devices == "gpu":
    gpus = tf.config.list_logical_devices("GPU")
    if not gpus:
      raise app.UsageError("--devices=gpu: no GPU found.")
    return tf, [d.name for d in gpus][:FLAGS.replicas]
  if FLAGS.replicas > 1:
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * FLAGS.replicas)
  return tf, ["/cpu:%d" % i for i in range(FLAGS.replicas)]


def _data(steps, batch):
  """`steps` global batches of a noisy linear-teacher problem."""
  rng = np.random.RandomState(0)
  teacher = rng.randn(DIM, CLASSES)
  x = rng.randn(steps, batch, DIM).astype(np.float32)
  y = np.argmax(x @ teacher + 0.5 * rng.randn(steps, batch, CLASSES),
                axis=-1).astype(np.int32)
  return x, y


def _initial_weights():
  rng = np.random.RandomState(1)
  return {
      "w1": (rng.randn(DIM, HIDDEN) / np.sqrt(DIM)).astype(np.float32),
      "b1": np.zeros(HIDDEN, np.float32),
      "w2": (rng.randn(HIDDEN, CLASSES) / np.sqrt(HIDDEN)).astype(np.float32),
      "b2": np.zeros(CLASSES, np.float32),
  }


def _model_fn(tf, init):
  import kfac  # pylint: disable=g-import-not-at-top

  def model_fn(features, labels, mode):
    v = {n: tf.compat.v1.get_variable(n, initializer=tf.constant(a))
         for n, a in init.items()}
    lc = kfac.LayerCollection()
    pre = tf.matmul(features, v["w1"]) + v["b1"]
    lc.register_fully_connected((v["w1"], v["b1"]), features, pre)
    act = tf.tanh(pre)
    logits = tf.matmul(act, v["w2"]) + v["b2"]
    lc.register_fully_connected((v["w2"], v["b2"]), act, logits)
    lc.register_softmax_cross_entropy_loss(logits, targets=labels)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits))
    opt = kfac.PeriodicInvCovUpdateKfacOpt(
        invert_every=5, cov_update_every=1, learning_rate=FLAGS.learning_rate,
        damping=FLAGS.damping, momentum=0.9, estimation_mode="exact")
    train_op = opt.minimize(
        loss, global_step=tf.compat.v1.train.get_or_create_global_step(),
        layer_collection=lc)
    return tf.estimator.EstimatorSpec(
        mode, loss=tf.identity(loss, name="replica_loss"), train_op=train_op)

  return model_fn


def _progress_hook(tf, every):
  """Prints the step and the mean of the replicas' losses."""

  class Progress(tf.compat.v1.train.SessionRunHook):

    def begin(self):
      graph = tf.compat.v1.get_default_graph()
      self._losses = [op.outputs[0] for op in graph.get_operations()
                      if op.name.split("/")[-1] == "replica_loss"]
      self._step = tf.compat.v1.train.get_global_step()
      self._start = time.time()

    def before_run(self, run_context):
      return tf.compat.v1.train.SessionRunArgs((self._step, self._losses))

    def after_run(self, run_context, run_values):
      step, losses = run_values.results
      step += 1  # the step just taken
      if step == 1 or step % every == 0 or step == FLAGS.steps:
        print("step %4d  loss %.4f  (%.1f s)" %
              (step, float(np.mean(losses)), time.time() - self._start),
              flush=True)

  return Progress()


def train(tf, devices, x, y, init, model_dir, verbose):
  """Trains FLAGS.steps steps; the final weights."""
  replicas = len(devices)
  kwargs = {}
  if replicas > 1:
    kwargs["train_distribute"] = tf.distribute.MirroredStrategy(devices)
    if FLAGS.devices == "cpu":
      kwargs["session_config"] = tf.compat.v1.ConfigProto(
          device_count={"CPU": replicas})
  config = tf.estimator.RunConfig(
      model_dir=model_dir, save_checkpoints_steps=FLAGS.steps,
      log_step_count_steps=FLAGS.steps, **kwargs)
  est = tf.estimator.Estimator(_model_fn(tf, init), config=config)

  def input_fn():
    # The Estimator hands the replicas consecutive elements in turn
    # (replica r gets elements k * R + r): cut each global batch into R.
    per_replica = FLAGS.batch_size // replicas
    return tf.data.Dataset.from_tensor_slices((
        x.reshape(-1, per_replica, DIM), y.reshape(-1, per_replica)))

  hooks = [_progress_hook(tf, FLAGS.print_every)] if verbose else []
  est.train(input_fn, steps=FLAGS.steps, hooks=hooks)
  return {n: est.get_variable_value(n) for n in init}


def main(argv):
  del argv
  if FLAGS.replicas < 1 or FLAGS.batch_size % FLAGS.replicas:
    raise app.UsageError("--batch_size must be a multiple of --replicas.")
  tf, devices = _configure_devices()
  if not hasattr(tf, "estimator") or not hasattr(tf.estimator, "Estimator"):
    raise app.UsageError(
        "tf.estimator is not available in TensorFlow %s: it needs "
        "TensorFlow 2.15 with tensorflow-estimator (make venv-tf215)."
        % tf.__version__)
  x, y = _data(FLAGS.steps, FLAGS.batch_size)
  init = _initial_weights()
  print("Estimator + K-FAC: %d replica(s) on %s, global batch %d, TF %s" %
        (len(devices), ", ".join(devices), FLAGS.batch_size, tf.__version__))
  with tempfile.TemporaryDirectory() as tmp:
    model_dir = FLAGS.model_dir or os.path.join(tmp, "model")
    weights = train(tf, devices, x, y, init, model_dir, verbose=True)
    if FLAGS.check_single:
      single = train(tf, devices[:1], x, y, init, os.path.join(tmp, "one"),
                     verbose=False)
      rel = max(float(np.max(np.abs(weights[n] - single[n])) /
                      np.max(np.abs(single[n]))) for n in init)
      print("max relative weight difference to one replica: %.3g" % rel)
  return 0


if __name__ == "__main__":
  sys.exit(app.run(main))
