r"""K-FAC with tf.distribute.MultiWorkerMirroredStrategy: several processes.

An MLP classifier trains with kfac.PeriodicInvCovUpdateKfacOpt in a TF2
custom loop (`strategy.run` in a tf.function). Each worker is one process
with one replica (its CPU, or its GPUs); the workers find each other through
TF_CONFIG, and every worker trains on its share of every global batch.
K-FAC reduces its statistics, gradients and the quadratic model's terms
across all replicas, so the run is the one-process run on the global batch.

Start every worker of a localhost cluster from one command:

  python examples/distributed_multiworker.py --launch_local=2

or start each worker yourself (e.g. on different machines, with their host
names in --hosts), with the same flags and its own --worker_index:

  python examples/distributed_multiworker.py --worker_index=0 \
      --ports=23456,23457 &
  python examples/distributed_multiworker.py --worker_index=1 \
      --ports=23456,23457

Each worker sets its TF_CONFIG
  {"cluster": {"worker": ["localhost:23456", "localhost:23457"]},
   "task": {"type": "worker", "index": i}}
and creates the strategy before anything else touches TensorFlow. The chief
(worker 0) prints step and loss; at the end every worker gathers every
replica's weights (an all-gather) and the chief prints whether they are
bit-identical; every worker prints a digest of its weights, which the
launcher compares. With --check_single the chief also trains the same
batches in one process without a strategy and prints the largest relative
weight difference. Data: Fashion-MNIST (`make data`), else sklearn's
digits.
"""

import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

from absl import app
from absl import flags
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FLAGS = flags.FLAGS
flags.DEFINE_integer("launch_local", 0,
                     "Start this many workers on localhost (free ports), "
                     "relay the chief's output, and compare the workers' "
                     "weight digests.")
flags.DEFINE_integer("worker_index", None, "This worker's index (task).")
flags.DEFINE_list("ports", None, "Every worker's port, in worker order.")
flags.DEFINE_list("hosts", None, "Every worker's host (default: localhost).")
flags.DEFINE_integer("steps", 30, "Training steps.")
flags.DEFINE_integer("batch_size", 128, "Global batch (all workers).")
flags.DEFINE_enum("dataset", "auto", ["auto", "fashion_mnist", "digits"],
                  "Training data.")
flags.DEFINE_integer("hidden", 64, "Hidden units.")
flags.DEFINE_float("damping", 0.1, "Initial damping (adapted).")
flags.DEFINE_integer("print_every", 5, "Steps between progress lines.")
flags.DEFINE_bool("check_single", False,
                  "The chief also trains one process on the same batches "
                  "and prints the largest relative weight difference.")

_SELF = os.path.abspath(__file__)


# ---------------------------------------------------------------- launcher
def _free_ports(count):
  socks = [socket.socket() for _ in range(count)]
  try:
    for s in socks:
      s.bind(("localhost", 0))
    return [s.getsockname()[1] for s in socks]
  finally:
    for s in socks:
      s.close()


def _passed_flags(argv):
  """The command line's flags without --launch_local (each worker gets
  the rest, plus its index and the ports)."""
  out, skip = [], False
  for arg in argv[1:]:
    if skip:
      skip = False
    elif arg == "--launch_local":
      skip = True
    elif not arg.startswith("--launch_local="):
      out.append(arg)
  return out


def launch_local(workers, argv):
  """Runs `workers` worker processes of this program; returns the exit
  status."""
  ports = ",".join(str(p) for p in _free_ports(workers))
  env = dict(os.environ)
  env.pop("TF_CONFIG", None)
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  print("launching %d workers on localhost ports %s" % (workers, ports),
        flush=True)
  procs, errs = [], []
  for i in range(workers):
    # stderr to files: a full pipe would stall a worker, and with it the
    # collectives of all.
    errs.append(tempfile.TemporaryFile("w+"))  # pylint: disable=consider-using-with
    procs.append(subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, _SELF, "--worker_index=%d" % i,
         "--ports=" + ports] + _passed_flags(argv),
        env=env, stdout=subprocess.PIPE, stderr=errs[i], text=True))
  outputs = [""] * workers
  lines = []

  def relay():  # the chief's lines as they come
    for line in procs[0].stdout:
      print(line, end="", flush=True)
      lines.append(line)
  relay_thread = threading.Thread(target=relay, daemon=True)
  relay_thread.start()
  try:
    # A worker that fails leaves the others waiting in a collective: end
    # them.
    while any(p.poll() is None for p in procs):
      if any(p.poll() not in (None, 0) for p in procs):
        break
      time.sleep(0.2)
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  relay_thread.join()
  outputs[0] = "".join(lines)
  for i in range(1, workers):
    outputs[i] = procs[i].stdout.read()
  stderr = []
  for err in errs:
    err.seek(0)
    stderr.append(err.read())
    err.close()
  failed = [i for i, p in enumerate(procs) if p.returncode != 0]
  for i in failed:
    print("worker %d failed (exit status %d):\n%s" %
          (i, procs[i].returncode, stderr[i][-3000:]), flush=True)
  if failed:
    return 1
  digests = []
  for i, out in enumerate(outputs):
    found = [l.split()[-1] for l in out.splitlines()
             if l.startswith("weights digest")]
    digests.append(found[-1] if found else None)
    if i:
      print("[worker %d] weights digest %s" % (i, digests[-1]))
  same = None not in digests and len(set(digests)) == 1
  print("launcher: the %d workers' weight digests agree: %s" %
        (workers, same), flush=True)
  return 0 if same else 1


# ---------------------------------------------------------------- a worker
def _data():
  import classifier_common  # pylint: disable=g-import-not-at-top
  name, train, _ = classifier_common.load_classification_data(
      FLAGS.dataset, max_examples=20000)
  images = train.images.reshape(len(train), -1).astype(np.float32)
  return name, images, train.labels.astype(np.int32)


def _init_params(dim, classes):
  rng = np.random.RandomState(0)
  hidden = FLAGS.hidden
  return {
      "w1": (rng.randn(dim, hidden) / np.sqrt(dim)).astype(np.float32),
      "b1": np.zeros(hidden, np.float32),
      "w2": (rng.randn(hidden, classes) / np.sqrt(hidden)).astype(
          np.float32),
      "b2": np.zeros(classes, np.float32),
  }


def _forward(tf, v, x, y, lc):
  """Mean cross-entropy of the MLP; registers its layers in `lc`. tanh, not
  ReLU: a ReLU whose input sits within rounding of 0 can switch on one
  side and off on the other, which the float32 rounding of R replicas'
  sums (against one sum) then turns into a visible difference to one
  process (measured: 1e-2 after 10 steps, from one such unit)."""
  pre = tf.matmul(x, v["w1"]) + v["b1"]
  lc.register_fully_connected((v["w1"], v["b1"]), x, pre)
  hidden = tf.tanh(pre)
  logits = tf.matmul(hidden, v["w2"]) + v["b2"]
  lc.register_fully_connected((v["w2"], v["b2"]), hidden, logits)
  lc.register_softmax_cross_entropy_loss(logits, targets=y)
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=y, logits=logits))


def _batches(images, labels):
  """The global batches: the same on every worker (the same seed)."""
  rng = np.random.RandomState(1)
  for _ in range(FLAGS.steps):
    idx = rng.randint(0, len(images), FLAGS.batch_size)
    yield {"x": images[idx], "y": labels[idx]}


def train(tf, kfac, strategy, images, labels, params, chief):
  """The TF2 loop; returns the variables."""
  replicas = strategy.num_replicas_in_sync if strategy else 1
  scope = strategy.scope() if strategy else _Null()
  with scope:
    v = {k: tf.Variable(a, name=k) for k, a in params.items()}
  opt = kfac.PeriodicInvCovUpdateKfacOpt(
      invert_every=5, cov_update_every=1, learning_rate=None, momentum=None,
      momentum_type="qmodel", damping=FLAGS.damping, adapt_damping=True,
      loss_fn=lambda b: _forward(tf, v, b["x"], b["y"],
                                 kfac.LayerCollection()),
      estimation_mode="exact", cov_ema_decay=0.95)

  def replica_step(batch):
    lc = kfac.LayerCollection()
    loss = _forward(tf, v, batch["x"], batch["y"], lc)
    opt.set_train_batch(batch)
    # The replicas' gradients are summed: each replica's mean loss / R.
    opt.minimize(loss / replicas, var_list=list(v.values()),
                 layer_collection=lc)
    return loss

  @tf.function
  def step(batch):
    if strategy is None:
      return replica_step(batch)
    losses = strategy.run(replica_step, args=(batch,))
    return strategy.reduce(tf.distribute.ReduceOp.MEAN, losses, axis=None)

  start = time.time()
  for i, batch in enumerate(_batches(images, labels)):
    if strategy is None:
      batch = {k: tf.constant(a) for k, a in batch.items()}
    else:
      per = FLAGS.batch_size // replicas

      def shard(ctx, batch=batch, per=per):
        # Called for this worker's replicas, with their ids across the
        # cluster: replica r takes examples [r * per, (r + 1) * per).
        r = ctx.replica_id_in_sync_group
        return {k: tf.constant(a[r * per:(r + 1) * per])
                for k, a in batch.items()}
      batch = strategy.experimental_distribute_values_from_function(shard)
    loss = float(step(batch))
    if chief and ((i + 1) % FLAGS.print_every == 0 or i + 1 == FLAGS.steps):
      print("step %4d  loss %.4f  damping %.4g  rate %.4g  %.1f s" %
            (i + 1, loss, float(opt.damping), float(opt.learning_rate),
             time.time() - start), flush=True)
  return v


def _all_replicas_identical(tf, strategy, variables):
  """Gathers every replica's copy of the (flattened) weights onto every
  replica; whether they are bit-identical, and the largest difference."""
  names = sorted(variables)

  def gather():
    ctx = tf.distribute.get_replica_context()
    flat = tf.concat([tf.reshape(variables[k], [-1]) for k in names], 0)
    return ctx.all_gather(flat[tf.newaxis], axis=0)

  gathered = strategy.experimental_local_results(
      tf.function(lambda: strategy.run(gather))())[0].numpy()
  diff = float(np.max(np.abs(gathered - gathered[:1])))
  same = all(np.array_equal(row, gathered[0]) for row in gathered)
  return same, diff, len(gathered)


def _digest(arrays):
  return hashlib.sha1(b"".join(
      np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()


class _Null:

  def __enter__(self):
    return self

  def __exit__(self, *args):
    return False


def run_worker():
  ports = FLAGS.ports
  hosts = FLAGS.hosts or ["localhost"] * len(ports)
  if len(hosts) != len(ports):
    raise app.UsageError("--hosts and --ports must have the same length.")
  index = FLAGS.worker_index
  os.environ["TF_CONFIG"] = json.dumps({
      "cluster": {"worker": ["%s:%s" % hp for hp in zip(hosts, ports)]},
      "task": {"type": "worker", "index": index}})
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  # First thing: the strategy configures this process's collectives.
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  import kfac  # pylint: disable=g-import-not-at-top
  replicas = strategy.num_replicas_in_sync
  if FLAGS.batch_size % replicas:
    raise app.UsageError("--batch_size must be a multiple of the %d "
                         "replicas." % replicas)
  chief = index == 0
  name, images, labels = _data()
  params = _init_params(images.shape[1], int(labels.max()) + 1)
  if chief:
    print("%s: K-FAC on %d workers, %d replicas in sync, global batch %d" %
          (name, len(ports), replicas, FLAGS.batch_size), flush=True)
  v = train(tf, kfac, strategy, images, labels, params, chief)
  same, diff, count = _all_replicas_identical(tf, strategy, v)
  if chief:
    print("all %d replicas' weights identical: %s (max difference %.3g)" %
          (count, same, diff), flush=True)
  weights = {k: strategy.experimental_local_results(var)[0].numpy()
             for k, var in v.items()}
  print("weights digest %s" % _digest(weights[k] for k in sorted(weights)),
        flush=True)
  if chief and FLAGS.check_single:
    print("the same batches in one process:", flush=True)
    single = train(tf, kfac, None, images, labels, params, chief)
    rel = max(float(np.max(np.abs(weights[k] - single[k].numpy())) /
                    np.max(np.abs(single[k].numpy()))) for k in weights)
    print("max relative weight difference, %d replicas vs 1: %.2e" %
          (replicas, rel), flush=True)
  return 0 if same else 1


def main(argv):
  if FLAGS.launch_local:
    if FLAGS.worker_index is not None or FLAGS.ports:
      raise app.UsageError("--launch_local starts the workers itself: "
                           "drop --worker_index / --ports.")
    del argv  # the flags only: the workers get the whole command line
    return launch_local(FLAGS.launch_local, sys.argv)
  if FLAGS.worker_index is None or not FLAGS.ports:
    raise app.UsageError("Pass --launch_local=N, or --worker_index and "
                         "--ports (one per worker).")
  return run_worker()


if __name__ == "__main__":
  app.run(main)
