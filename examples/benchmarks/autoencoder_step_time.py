r"""Milliseconds per training step on the deep autoencoder of the K-FAC paper.

Model: 784-1000-500-250-30-250-500-1000-784, tanh (linear code layer),
sigmoid cross-entropy reconstruction loss, batch 256 by default.

Configurations, all on the same graph (same model code, same weights):
  sgd_momentum      tf.compat.v1.train.MomentumOptimizer, TF1 Session
  kfac_old_session  the old library, kfac 0.2.4 from PyPI (frozen TF1 code,
                    run on this TensorFlow in tf.compat.v1 mode), Session
  kfac_session      this kfac, PeriodicInvCovUpdateKfacOpt(invert_every=10)
  kfac_tf_function  this kfac, the same optimizer in a TF2 tf.function step
  kfac_tf_function_xla  the same step compiled by XLA (jit_compile=True);
                    not in the default set, name it with --configs

Each measurement is a fresh worker process (the old library is also called
`kfac`, so it cannot share a process with this one): it builds the graph,
runs untimed warm-up blocks, then times blocks of `invert_every` consecutive
steps, so every block holds exactly one K-FAC inverse update and the
amortised inversion cost is counted. ms/step is the median over blocks of
(block time / block length). Workers run in interleaved rounds with a
rotating order so that machine noise hits every configuration alike.

The old library is looked up in --old_kfac_path (`make bench` installs it
there with `pip install --no-deps --target`); without it that configuration
is skipped with a note.

Results go to stdout and to bench_results/ (markdown table and a PNG).

  python examples/benchmarks/autoencoder_step_time.py --rounds=3
"""

import json
import os
import platform
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import autoencoder_model as model
import datasets
import step_time_plot  # this script's own folder

FLAGS = flags.FLAGS

ALL_CONFIGS = ("sgd_momentum", "kfac_old_session", "kfac_session",
               "kfac_tf_function", "kfac_tf_function_xla")
DEFAULT_CONFIGS = ALL_CONFIGS[:4]

flags.DEFINE_integer("batch_size", 256, "Mini-batch size.")
flags.DEFINE_integer("invert_every", 10, "K-FAC inverse period; also the "
                     "length of a timed block.")
flags.DEFINE_integer("cov_update_every", 1, "K-FAC statistics period (the "
                     "same for every K-FAC configuration; kfac 0.2.4 runs "
                     "the statistics' backward pass on every step whatever "
                     "it is, this library only on the update steps).")
flags.DEFINE_integer("rounds", 3, "Interleaved rounds; each starts one "
                     "worker per configuration.")
flags.DEFINE_integer("blocks_per_round", 3, "Timed blocks per worker.")
flags.DEFINE_integer("warmup_blocks", 2, "Untimed blocks per worker.")
flags.DEFINE_string("old_kfac_path", ".bench_deps/kfac-0.2.4",
                    "Directory holding the old kfac package (pip --target).")
flags.DEFINE_string("worker", None, "Internal: run one configuration and "
                    "print its block times as JSON.")
flags.DEFINE_enum("data", "auto", ["auto", "random", "fashion_mnist"],
                  "Fashion-MNIST images when present ('auto'), else random "
                  "binary images.")
flags.DEFINE_list("configs", list(DEFAULT_CONFIGS), "Which configurations "
                  "(known: %s)." % ", ".join(ALL_CONFIGS))
flags.DEFINE_integer("seed", 0, "Seed.")
flags.DEFINE_string("output_dir", "bench_results", "Where to write results.")


def load_batches(num_batches, batch_size, seed):
  rng = np.random.RandomState(seed)
  images = None
  if FLAGS.data != "random":
    images = datasets.load_fashion_mnist_images(num_batches * batch_size)
    if images is None and FLAGS.data == "fashion_mnist":
      raise app.UsageError("Fashion-MNIST not found; run `make data`.")
  if images is None or len(images) < num_batches * batch_size:
    name = "random binary images"
    images = (rng.uniform(size=(num_batches * batch_size, 784)) < 0.3)
    images = images.astype(np.float32)
  else:
    name = "Fashion-MNIST"
  return name, images.reshape(num_batches, batch_size, 784)


def kfac_kwargs():
  return dict(invert_every=FLAGS.invert_every,
              cov_update_every=FLAGS.cov_update_every,
              learning_rate=1e-3, damping=1e-1, momentum=0.9,
              cov_ema_decay=0.95, momentum_type="regular")


class SessionRunner(object):
  """A TF1 graph + Session; step() runs one training step."""

  def __init__(self, kind, params_np, batches):
    self.batches = batches
    self.graph = tf.Graph()
    with self.graph.as_default():
      tf.compat.v1.set_random_seed(FLAGS.seed)
      self.x = tf.compat.v1.placeholder(tf.float32, [None, 784])
      variables = model.make_variables(params_np)
      var_list = model.flat_variables(variables)
      global_step = tf.compat.v1.train.get_or_create_global_step()
      if kind == "kfac":
        import kfac
        lc = kfac.LayerCollection()
        logits = model.forward(self.x, variables, layer_collection=lc)
        model.register_loss(lc, self.x, logits)
        opt = kfac.PeriodicInvCovUpdateKfacOpt(layer_collection=lc,
                                               **kfac_kwargs())
      else:
        logits = model.forward(self.x, variables)
        opt = tf.compat.v1.train.MomentumOptimizer(1e-3, 0.9)
      self.loss = model.reconstruction_loss(self.x, logits)
      self.train_op = opt.minimize(self.loss, var_list=var_list,
                                   global_step=global_step)
      init = tf.compat.v1.global_variables_initializer()
    self.graph.finalize()
    self.sess = tf.compat.v1.Session(graph=self.graph)
    self.sess.run(init)

  def step(self, i):
    self.sess.run(self.train_op, {self.x: self.batches[i % len(self.batches)]})

  def loss_value(self):
    return float(self.sess.run(self.loss, {self.x: self.batches[0]}))

  def close(self):
    self.sess.close()


class TF2KfacRunner(object):
  """K-FAC in a TF2 tf.function step: registration inside the trace."""

  def __init__(self, params_np, batches, jit_compile=False):
    import kfac
    tf.random.set_seed(FLAGS.seed)
    self.batches = [tf.constant(b) for b in batches]
    self.variables = model.make_variables(params_np, name="tf2")
    var_list = model.flat_variables(self.variables)
    opt = kfac.PeriodicInvCovUpdateKfacOpt(**kfac_kwargs())

    @tf.function(jit_compile=jit_compile)
    def train_step(x):
      lc = kfac.LayerCollection()
      logits = model.forward(x, self.variables, layer_collection=lc)
      model.register_loss(lc, x, logits)
      loss = model.reconstruction_loss(x, logits)
      opt.minimize(loss, var_list=var_list, layer_collection=lc)
      return loss

    self.train_step = train_step

  def step(self, i):
    self.train_step(self.batches[i % len(self.batches)])

  def loss_value(self):
    logits = model.forward(self.batches[0], self.variables)
    return float(model.reconstruction_loss(self.batches[0], logits))

  def close(self):
    pass


def make_runner(name, params_np, batches):
  if name == "sgd_momentum":
    return SessionRunner("sgd", params_np, batches)
  if name in ("kfac_session", "kfac_old_session"):
    # Which `kfac` this imports is decided by the worker's sys.path.
    return SessionRunner("kfac", params_np, batches)
  if name == "kfac_tf_function":
    return TF2KfacRunner(params_np, batches)
  if name == "kfac_tf_function_xla":
    return TF2KfacRunner(params_np, batches, jit_compile=True)
  raise app.UsageError("unknown configuration %r (known: %s)" %
                       (name, ", ".join(ALL_CONFIGS)))


def time_block(runner, start_step, length):
  start = time.perf_counter()
  for i in range(start_step, start_step + length):
    runner.step(i)
  return (time.perf_counter() - start) / length


def run_worker(name):
  """Builds one configuration, warms up, times blocks; prints JSON."""
  if name == "kfac_old_session":
    import kfac  # the old library, first on sys.path in this worker
    if "kfac-0.2" not in kfac.__file__ and "site" not in kfac.__file__:
      raise RuntimeError("expected the old kfac, got %s" % kfac.__file__)
  sizes = model.mirrored_sizes(model.FULL_MNIST_ENCODER)
  _, batches = load_batches(8, FLAGS.batch_size, FLAGS.seed)
  params_np = model.init_params(sizes, FLAGS.seed)
  start = time.perf_counter()
  runner = make_runner(name, params_np, batches)
  block = FLAGS.invert_every
  for b in range(FLAGS.warmup_blocks):
    time_block(runner, b * block, block)
  build_s = time.perf_counter() - start
  times = []
  for b in range(FLAGS.blocks_per_round):
    times.append(time_block(runner, (FLAGS.warmup_blocks + b) * block, block))
  print("WORKER_RESULT " + json.dumps(dict(
      times=times, loss=runner.loss_value(), build_s=build_s)), flush=True)
  runner.close()


def spawn_worker(name):
  """Runs one worker process; returns its result dict, or None with a note."""
  env = dict(os.environ)
  if name == "kfac_old_session":
    path = os.path.abspath(FLAGS.old_kfac_path)
    if not os.path.isdir(os.path.join(path, "kfac")):
      return None
    env["PYTHONPATH"] = os.pathsep.join(
        [path] + [p for p in [env.get("PYTHONPATH")] if p])
  argv = [sys.executable, os.path.abspath(__file__), "--worker=" + name]
  for flag in ("batch_size", "invert_every", "cov_update_every",
               "blocks_per_round", "warmup_blocks", "data", "seed"):
    argv.append("--%s=%s" % (flag, getattr(FLAGS, flag)))
  out = subprocess.run(argv, env=env, capture_output=True, text=True)
  for line in out.stdout.splitlines():
    if line.startswith("WORKER_RESULT "):
      return json.loads(line[len("WORKER_RESULT "):])
  raise RuntimeError("worker %s failed:\n%s" % (name, out.stderr[-4000:]))


def write_plot(path, names, medians, spreads, title):
  step_time_plot.write_step_time_plot(
      path, names, medians, spreads, title,
      ["#888888", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"][:len(names)], label_format="%.1f", height=3.6)


def main(argv):
  del argv
  if FLAGS.worker:
    run_worker(FLAGS.worker)
    return
  sizes = model.mirrored_sizes(model.FULL_MNIST_ENCODER)
  data_name, _ = load_batches(8, FLAGS.batch_size, FLAGS.seed)
  block = FLAGS.invert_every
  print("model %s, batch %d, data: %s, TF %s, %d CPUs" % (
      "-".join(str(s) for s in sizes), FLAGS.batch_size, data_name,
      tf.__version__, os.cpu_count()), flush=True)

  names = list(FLAGS.configs)
  times = {n: [] for n in names}
  losses, skipped = {}, []
  for r in range(FLAGS.rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for name in order:
      if name in skipped:
        continue
      result = spawn_worker(name)
      if result is None:
        skipped.append(name)
        print("note: %s skipped: the old kfac is not in %s (make bench "
              "installs it)" % (name, FLAGS.old_kfac_path), flush=True)
        continue
      times[name].extend(result["times"])
      losses[name] = result["loss"]
    print("round %d/%d: %s" % (r + 1, FLAGS.rounds, "  ".join(
        "%s %.1f ms" % (n, 1e3 * np.median(times[n])) for n in names
        if times[n])), flush=True)

  names = [n for n in names if times[n]]
  ms = {n: 1e3 * np.array(times[n]) for n in names}
  medians = [float(np.median(ms[n])) for n in names]
  q25 = [float(np.percentile(ms[n], 25)) for n in names]
  q75 = [float(np.percentile(ms[n], 75)) for n in names]

  def ratio_to(base):
    if base not in ms:
      return ["-"] * len(names)
    ref_ms = float(np.median(ms[base]))
    return ["%.2fx" % (m / ref_ms) for m in medians]

  to_sgd, to_old = ratio_to("sgd_momentum"), ratio_to("kfac_old_session")
  lines = [
      "Deep autoencoder %s, batch %d, %s; TF %s, Python %s, %d CPUs (%s)." % (
          "-".join(str(s) for s in sizes), FLAGS.batch_size, data_name,
          tf.__version__, platform.python_version(), os.cpu_count(),
          platform.machine()),
      "ms/step: median over %d blocks of %d steps per configuration (each "
      "block holds one K-FAC inverse update), %d interleaved rounds of fresh "
      "worker processes, warm-up excluded." % (
          FLAGS.rounds * FLAGS.blocks_per_round, block, FLAGS.rounds),
      "",
      "| optimizer | ms/step (median) | IQR | ratio to SGD | ratio to old "
      "kfac |",
      "|---|---:|---:|---:|---:|",
  ]
  for n, m, lo, hi, rs, ro in zip(names, medians, q25, q75, to_sgd, to_old):
    lines.append("| %s | %.1f | %.1f-%.1f | %s | %s |" % (n, m, lo, hi, rs,
                                                          ro))
  lines += ["", "Loss on the first batch after each worker's %d steps "
            "(sanity): %s." % (
                (FLAGS.warmup_blocks + FLAGS.blocks_per_round) * block,
                ", ".join("%s %.1f" % (n, losses[n]) for n in names))]
  if skipped:
    lines += ["", "Skipped (not installed): %s." % ", ".join(skipped)]
  table = "\n".join(lines)
  print()
  print(table)

  os.makedirs(FLAGS.output_dir, exist_ok=True)
  md_path = os.path.join(FLAGS.output_dir, "autoencoder_step_time.md")
  png_path = os.path.join(FLAGS.output_dir, "autoencoder_step_time.png")
  with open(md_path, "w") as f:
    f.write(table + "\n")
  write_plot(png_path, names, medians,
             [np.subtract(medians, q25), np.subtract(q75, medians)],
             "Deep autoencoder, batch %d, TF %s, %d CPUs" % (
                 FLAGS.batch_size, tf.__version__, os.cpu_count()))
  print("\nwrote %s and %s" % (md_path, png_path))


if __name__ == "__main__":
  app.run(main)
