r"""K-FAC on several replicas with tf.distribute.MirroredStrategy.

An MLP classifier (784-128-10) trains with kfac.PeriodicInvCovUpdateKfacOpt
in a TF2 custom loop (`strategy.run` in a tf.function) or a TF1 Session
(`call_for_each_replica`), each replica on its share of every global batch.
K-FAC's statistics, gradients and the quadratic model's terms are reduced
across the replicas, so the run is the one-replica run on the global batch:
with --check_single the same batches are also trained without a strategy and
the largest weight difference is printed (float32 rounding, ~1e-6).

  python examples/distributed_mirrored.py --replicas=2 --steps=50
  python examples/distributed_mirrored.py --devices=gpu   # every GPU
  python examples/distributed_mirrored.py --world=tf1 --check_single

Without GPUs the replicas are logical CPU devices (--replicas of them; the
CPU is split before TensorFlow initialises). Each replica's loss is its mean
loss divided by the number of replicas: TensorFlow's convention for
tf.compat.v1 optimizers under a strategy is that the replicas' gradients
are summed. Data: Fashion-MNIST (`make data`), else sklearn's digits.
"""

import os
import sys
import time

from absl import app
from absl import flags
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FLAGS = flags.FLAGS
flags.DEFINE_integer("replicas", 2, "Logical CPU devices (without GPUs).")
flags.DEFINE_enum("devices", "cpu", ["cpu", "gpu"], "Replica devices.")
flags.DEFINE_enum("world", "tf2", ["tf1", "tf2"],
                  "tf2: tf.function + strategy.run; tf1: Session + "
                  "call_for_each_replica.")
flags.DEFINE_integer("steps", 40, "Training steps.")
flags.DEFINE_integer("batch_size", 256, "Global batch (all replicas).")
flags.DEFINE_enum("dataset", "auto", ["auto", "fashion_mnist", "digits"],
                  "Training data.")
flags.DEFINE_float("damping", 0.1, "Initial damping (adapted).")
flags.DEFINE_integer("print_every", 5, "Steps between progress lines.")
flags.DEFINE_enum("estimation_mode", "exact",
                  ["exact", "empirical", "gradients"],
                  "K-FAC's estimation mode. 'gradients' samples targets, "
                  "differently on each replica, so its statistics only "
                  "approach the one-replica ones as the batch grows.")
flags.DEFINE_bool("check_single", False,
                  "Also train one replica on the same batches and print the "
                  "largest weight difference.")

HIDDEN = 128


def _configure_devices():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if FLAGS.devices == "gpu":
    gpus = tf.config.list_logical_devices("GPU")
    if not gpus:
      raise app.UsageError("--devices=gpu: no GPU found.")
    return tf, [d.name for d in gpus]
  cpus = tf.config.list_physical_devices("CPU")
  tf.config.set_logical_device_configuration(
      cpus[0], [tf.config.LogicalDeviceConfiguration()] * FLAGS.replicas)
  return tf, ["/cpu:%d" % i for i in range(FLAGS.replicas)]


def _data():
  import classifier_common  # pylint: disable=g-import-not-at-top
  name, train, _ = classifier_common.load_classification_data(
      FLAGS.dataset, max_examples=20000)
  images = train.images.reshape(len(train), -1).astype(np.float32)
  return name, images, train.labels.astype(np.int32)


def _init_params(dim, classes):
  rng = np.random.RandomState(0)
  return {
      "w1": (rng.randn(dim, HIDDEN) / np.sqrt(dim)).astype(np.float32),
      "b1": np.zeros(HIDDEN, np.float32),
      "w2": (rng.randn(HIDDEN, classes) / np.sqrt(HIDDEN)).astype(
          np.float32),
      "b2": np.zeros(classes, np.float32),
  }


def _forward(tf, kfac, v, x, y, lc):
  """Mean cross-entropy of the MLP; registers its layers in `lc`."""
  pre = tf.matmul(x, v["w1"]) + v["b1"]
  lc.register_fully_connected((v["w1"], v["b1"]), x, pre)
  hidden = tf.nn.relu(pre)
  logits = tf.matmul(hidden, v["w2"]) + v["b2"]
  lc.register_fully_connected((v["w2"], v["b2"]), hidden, logits)
  lc.register_softmax_cross_entropy_loss(logits, targets=y)
  del kfac
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=y, logits=logits))


def _optimizer(kfac, loss_fn):
  return kfac.PeriodicInvCovUpdateKfacOpt(
      invert_every=5, cov_update_every=1, learning_rate=None, momentum=None,
      momentum_type="qmodel", damping=FLAGS.damping, adapt_damping=True,
      loss_fn=loss_fn, estimation_mode=FLAGS.estimation_mode,
      cov_ema_decay=0.95)


def _batches(images, labels):
  rng = np.random.RandomState(1)
  for _ in range(FLAGS.steps):
    idx = rng.randint(0, len(images), FLAGS.batch_size)
    yield {"x": images[idx], "y": labels[idx]}


def train_tf2(tf, kfac, strategy, images, labels, params):
  """The TF2 loop; returns the final weights."""
  replicas = strategy.num_replicas_in_sync if strategy else 1
  scope = strategy.scope() if strategy else _Null()
  with scope:
    v = {k: tf.Variable(a, name=k) for k, a in params.items()}
    opt = _optimizer(kfac, lambda b: _forward(
        tf, kfac, v, b["x"], b["y"], kfac.LayerCollection()))

  def replica_step(x, y):
    lc = kfac.LayerCollection()
    loss = _forward(tf, kfac, v, x, y, lc)
    opt.set_train_batch({"x": x, "y": y})
    opt.minimize(loss / replicas, var_list=list(v.values()),
                 layer_collection=lc)
    return loss

  @tf.function
  def step(batch):
    if strategy is None:
      return replica_step(batch["x"], batch["y"])
    losses = strategy.run(lambda b: replica_step(b["x"], b["y"]),
                          args=(batch,))
    return strategy.reduce(tf.distribute.ReduceOp.MEAN, losses, axis=None)

  data = _distribute(tf, strategy, images, labels)
  start = time.time()
  for i, batch in enumerate(data):
    loss = step(batch)
    _progress(i, float(loss), opt, start)
  return {k: _copies(strategy, var) for k, var in v.items()}


def _distribute(tf, strategy, images, labels):
  """The global batches as the step takes them: per-replica shards."""
  for batch in _batches(images, labels):
    if strategy is None:
      yield {k: tf.constant(a) for k, a in batch.items()}
      continue
    replicas = strategy.num_replicas_in_sync
    per = FLAGS.batch_size // replicas

    def shard(ctx, batch=batch, per=per):
      r = ctx.replica_id_in_sync_group
      return {k: tf.constant(a[r * per:(r + 1) * per])
              for k, a in batch.items()}
    yield strategy.experimental_distribute_values_from_function(shard)


def train_tf1(tf, kfac, strategy, images, labels, params):
  """The TF1 Session loop; returns the final weights."""
  replicas = strategy.num_replicas_in_sync if strategy else 1
  batches = list(_batches(images, labels))
  with tf.Graph().as_default():
    scope = strategy.scope() if strategy else _Null()
    with scope:
      v = {k: tf.Variable(a, name=k) for k, a in params.items()}
      x_all = tf.compat.v1.placeholder(
          tf.float32, [FLAGS.batch_size, images.shape[1]])
      y_all = tf.compat.v1.placeholder(tf.int32, [FLAGS.batch_size])
      opt = _optimizer(kfac, lambda b: _forward(
          tf, kfac, v, b["x"], b["y"], kfac.LayerCollection()))

      def replica_step():
        if replicas == 1:
          x, y = x_all, y_all
        else:
          rid = tf.distribute.get_replica_context().replica_id_in_sync_group
          per = FLAGS.batch_size // replicas
          x = x_all[rid * per:(rid + 1) * per]
          y = y_all[rid * per:(rid + 1) * per]
        lc = kfac.LayerCollection()
        loss = _forward(tf, kfac, v, x, y, lc)
        opt.set_train_batch({"x": x, "y": y})
        train = opt.minimize(loss / replicas, var_list=list(v.values()),
                             layer_collection=lc)
        with tf.control_dependencies([train]):
          return tf.identity(loss)

      if strategy is None:
        loss_op = replica_step()
      else:
        per_replica = strategy.extended.call_for_each_replica(replica_step)
        loss_op = strategy.reduce(tf.distribute.ReduceOp.MEAN, per_replica,
                                  axis=None)
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        start = time.time()
        for i, batch in enumerate(batches):
          loss = sess.run(loss_op, {x_all: batch["x"], y_all: batch["y"]})
          _progress(i, loss, opt, start, sess)
        return {k: sess.run(_copies(strategy, var)) for k, var in v.items()}


class _Null:
  def __enter__(self):
    return self

  def __exit__(self, *args):
    return False


def _copies(strategy, var):
  if strategy is None:
    return [var]
  return list(strategy.experimental_local_results(var))


def _progress(i, loss, opt, start, sess=None):
  if (i + 1) % FLAGS.print_every and i + 1 != FLAGS.steps:
    return
  values = [opt.damping, opt.learning_rate]
  damping, rate = (sess.run(values) if sess is not None else
                   [float(x) for x in values])
  print("step %4d  loss %.4f  damping %.4g  rate %.4g  %.1f s" %
        (i + 1, loss, damping, rate, time.time() - start), flush=True)


def main(argv):
  del argv
  tf, devices = _configure_devices()
  import kfac  # pylint: disable=g-import-not-at-top
  name, images, labels = _data()
  if FLAGS.batch_size % len(devices):
    raise app.UsageError("--batch_size must be a multiple of the %d "
                         "replicas." % len(devices))
  params = _init_params(images.shape[1], int(labels.max()) + 1)
  strategy = tf.distribute.MirroredStrategy(devices)
  train = train_tf2 if FLAGS.world == "tf2" else train_tf1
  print("%s, %s: K-FAC on %d replicas (%s), global batch %d" %
        (name, FLAGS.world, len(devices), ", ".join(devices),
         FLAGS.batch_size))
  weights = train(tf, kfac, strategy, images, labels, params)
  same = all(np.array_equal(c, w[0]) for w in weights.values() for c in w)
  print("replica copies identical: %s" % same)
  if FLAGS.check_single:
    print("the same batches on one replica:")
    single = train(tf, kfac, None, images, labels, params)
    diff = max(float(np.max(np.abs(weights[k][0] - single[k][0])) /
                     np.max(np.abs(single[k][0]))) for k in weights)
    print("max relative weight difference, %d replicas vs 1: %.2e" %
          (len(devices), diff))


if __name__ == "__main__":
  app.run(main)
