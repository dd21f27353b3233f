r"""Milliseconds per training step on the deep autoencoder of the K-FAC paper.

Model: 784-1000-500-250-30-250-500-1000-784, tanh (linear code layer),
sigmoid cross-entropy reconstruction loss; batches of 256 and 1000 by
default (--batch_sizes), Fashion-MNIST images when present.

Configurations, all on the same graph-building code and the same weights:
  sgd_momentum          tf.compat.v1.train.MomentumOptimizer, TF1 Session
  kfac_old_session      the old library, kfac 0.2.4 from PyPI (frozen TF1
                        code, run on this TensorFlow), Session
  kfac_session          this kfac, PeriodicInvCovUpdateKfacOpt, Session
  kfac_tf_function      this kfac, the same optimizer in a TF2 tf.function
  sgd_momentum_legacy, kfac_old_legacy, kfac_session_legacy
                        the three Session configurations in "legacy mode":
                        the worker calls tf.compat.v1.disable_v2_behavior()
                        before it builds anything, as old TF1 scripts do
                        (control flow v1, ref variables, v1 shapes)
  kfac_tf_function_xla  the tf.function step compiled by XLA
                        (jit_compile=True); not in the default set, name it
                        with --configs

Every K-FAC configuration runs the same settings: invert_every=10,
cov_update_every=2, cov_ema_decay=0.95, damping 0.1, learning rate 1e-3,
momentum 0.9 "regular" (--invert_every and --cov_update_every change them
for all alike).

Two ways to run a step, both timed in every worker:
  train_op only     sess.run(train_op)
  train_op + loss   sess.run([train_op, loss]), as training loops and the
                    README's TF1 snippet do (tf.function: the step returns
                    the loss and the loop reads it with float())
A Session prepares (prunes, optimizes with grappler, builds an executor for)
each new set of fetches once, on its first run; every later run reuses it.
The worker warms up each way separately and reports that first run too
("first run" columns): it is a one-off cost, and timing a short loop that
includes it inflates ms/step (on this graph, about 4 s of one core for this
kfac, 1.2 s for kfac 0.2.4).

Each measurement is a fresh worker process (the old library is also called
`kfac`, so it cannot share a process with this one): it builds the graph,
runs --warmup_blocks untimed blocks of each way, then times
--blocks_per_round blocks of each way, alternating between the two ways
block by block. A block is `invert_every` consecutive steps, so it holds
exactly one K-FAC inverse update and the amortised inversion cost is
counted. ms/step is the median over blocks of (block time / block length).
Workers run in interleaved rounds with a rotating order, so that machine
noise hits every configuration alike; the table also gives this kfac's ratio
to the old library per round.

The old library is looked up in --old_kfac_path (`make bench` installs it
there with `pip install --no-deps --target`); without it its configurations
are skipped with a note.

Writes autoencoder_step_time.md (one table per batch size),
autoencoder_step_time.json and autoencoder_step_time_b<batch>.png to
--output_dir.

  python examples/benchmarks/autoencoder_step_time.py \
      --old_kfac_path=.bench_deps/kfac-0.2.4          # make bench; ~25 min
  python examples/benchmarks/autoencoder_step_time.py --batch_sizes=256 \
      --configs=kfac_old_session,kfac_session --rounds=5   # one comparison

Flags: --batch_sizes, --configs, --rounds, --blocks_per_round,
--warmup_blocks, --invert_every, --cov_update_every, --data, --seed,
--threads, --old_kfac_path, --output_dir.
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
               "kfac_tf_function", "sgd_momentum_legacy", "kfac_old_legacy",
               "kfac_session_legacy", "kfac_tf_function_xla")
DEFAULT_CONFIGS = ALL_CONFIGS[:7]
LEGACY_CONFIGS = ("sgd_momentum_legacy", "kfac_old_legacy",
                  "kfac_session_legacy")
OLD_CONFIGS = ("kfac_old_session", "kfac_old_legacy")
# The two ways to run a step (see the module docstring).
WAYS = ("train_op", "train_op+loss")

flags.DEFINE_list("batch_sizes", ["256", "1000"], "Mini-batch sizes; one "
                  "table (and plot) per size.")
flags.DEFINE_integer("invert_every", 10, "K-FAC inverse period; also the "
                     "length of a timed block.")
flags.DEFINE_integer("cov_update_every", 2, "K-FAC statistics period (the "
                     "same for every K-FAC configuration; kfac 0.2.4 runs "
                     "the statistics' backward pass on every step whatever "
                     "it is, this library only on the update steps).")
flags.DEFINE_integer("rounds", 3, "Interleaved rounds; each starts one "
                     "worker per configuration and batch size.")
flags.DEFINE_integer("blocks_per_round", 3, "Timed blocks per worker and "
                     "way of running a step.")
flags.DEFINE_integer("warmup_blocks", 1, "Untimed blocks per worker and way "
                     "(the first holds the way's first run).")
flags.DEFINE_string("old_kfac_path", ".bench_deps/kfac-0.2.4",
                    "Directory holding the old kfac package (pip --target).")
flags.DEFINE_string("worker", None, "Internal: run one configuration and "
                    "print its block times as JSON.")
flags.DEFINE_integer("worker_batch_size", 256, "Internal: the worker's "
                     "batch size.")
flags.DEFINE_enum("data", "auto", ["auto", "random", "fashion_mnist"],
                  "Fashion-MNIST images when present ('auto'), else random "
                  "binary images.")
flags.DEFINE_list("configs", list(DEFAULT_CONFIGS), "Which configurations "
                  "(known: %s)." % ", ".join(ALL_CONFIGS))
flags.DEFINE_integer("seed", 0, "Seed.")
flags.DEFINE_integer("threads", 0, "TensorFlow's intra- and inter-op "
                     "thread counts in every worker (0: TensorFlow's "
                     "default). --threads=1 on a loaded machine: each worker "
                     "then also reports CPU seconds per step that other "
                     "jobs hardly disturb (the JSON's cpu_ms).")
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


def session_config():
  if not FLAGS.threads:
    return None
  return tf.compat.v1.ConfigProto(
      intra_op_parallelism_threads=FLAGS.threads,
      inter_op_parallelism_threads=FLAGS.threads)


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
    self.sess = tf.compat.v1.Session(graph=self.graph, config=session_config())
    self.sess.run(init)

  def step(self, i, fetch_loss):
    feed = {self.x: self.batches[i % len(self.batches)]}
    if fetch_loss:
      _, loss = self.sess.run([self.train_op, self.loss], feed)
      return float(loss)
    self.sess.run(self.train_op, feed)
    return None

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

  def step(self, i, fetch_loss):
    loss = self.train_step(self.batches[i % len(self.batches)])
    return float(loss) if fetch_loss else None

  def loss_value(self):
    logits = model.forward(self.batches[0], self.variables)
    return float(model.reconstruction_loss(self.batches[0], logits))

  def close(self):
    pass


def make_runner(name, params_np, batches):
  if name in ("sgd_momentum", "sgd_momentum_legacy"):
    return SessionRunner("sgd", params_np, batches)
  if name in ("kfac_session", "kfac_session_legacy") + OLD_CONFIGS:
    # Which `kfac` this imports is decided by the worker's sys.path.
    return SessionRunner("kfac", params_np, batches)
  if name == "kfac_tf_function":
    return TF2KfacRunner(params_np, batches)
  if name == "kfac_tf_function_xla":
    return TF2KfacRunner(params_np, batches, jit_compile=True)
  raise app.UsageError("unknown configuration %r (known: %s)" %
                       (name, ", ".join(ALL_CONFIGS)))


def time_block(runner, start_step, length, fetch_loss, cpu=None):
  """Seconds per step of `length` steps (wall); appends the CPU seconds
  per step of this process to the list `cpu` when given."""
  start, start_cpu = time.perf_counter(), time.process_time()
  for i in range(start_step, start_step + length):
    runner.step(i, fetch_loss)
  if cpu is not None:
    cpu.append((time.process_time() - start_cpu) / length)
  return (time.perf_counter() - start) / length


def run_worker(name):
  """Builds one configuration, warms up, times blocks; prints JSON."""
  if name in LEGACY_CONFIGS:
    tf.compat.v1.disable_v2_behavior()
  if FLAGS.threads:
    tf.config.threading.set_intra_op_parallelism_threads(FLAGS.threads)
    tf.config.threading.set_inter_op_parallelism_threads(FLAGS.threads)
  if name in OLD_CONFIGS:
    import kfac  # the old library, first on sys.path in this worker
    if "kfac-0.2" not in kfac.__file__ and "site" not in kfac.__file__:
      raise RuntimeError("expected the old kfac, got %s" % kfac.__file__)
  sizes = model.mirrored_sizes(model.FULL_MNIST_ENCODER)
  _, batches = load_batches(8, FLAGS.worker_batch_size, FLAGS.seed)
  params_np = model.init_params(sizes, FLAGS.seed)
  start = time.perf_counter()
  runner = make_runner(name, params_np, batches)
  build_s = time.perf_counter() - start
  block = FLAGS.invert_every
  step = 0
  first_run_s = {}
  for way in WAYS:
    fetch_loss = way != "train_op"
    for b in range(max(FLAGS.warmup_blocks, 1)):
      if b == 0:
        start = time.perf_counter()
        runner.step(step, fetch_loss)  # the first run of this way
        first_run_s[way] = time.perf_counter() - start
        time_block(runner, step + 1, block - 1, fetch_loss)
      else:
        time_block(runner, step, block, fetch_loss)
      step += block
  times = {way: [] for way in WAYS}
  cpu = {way: [] for way in WAYS}
  for b in range(FLAGS.blocks_per_round):
    for way in (WAYS if b % 2 == 0 else WAYS[::-1]):
      times[way].append(time_block(runner, step, block, way != "train_op",
                                   cpu[way]))
      step += block
  print("WORKER_RESULT " + json.dumps(dict(
      times=times, cpu=cpu, first_run_s=first_run_s,
      loss=runner.loss_value(), build_s=build_s, steps=step)), flush=True)
  runner.close()


def spawn_worker(name, batch_size):
  """Runs one worker process; returns its result dict, or None with a note."""
  env = dict(os.environ)
  if name in OLD_CONFIGS:
    path = os.path.abspath(FLAGS.old_kfac_path)
    if not os.path.isdir(os.path.join(path, "kfac")):
      return None
    env["PYTHONPATH"] = os.pathsep.join(
        [path] + [p for p in [env.get("PYTHONPATH")] if p])
  argv = [sys.executable, os.path.abspath(__file__), "--worker=" + name,
          "--worker_batch_size=%d" % batch_size]
  for flag in ("invert_every", "cov_update_every", "blocks_per_round",
               "warmup_blocks", "data", "seed", "threads"):
    argv.append("--%s=%s" % (flag, getattr(FLAGS, flag)))
  out = subprocess.run(argv, env=env, capture_output=True, text=True)
  for line in out.stdout.splitlines():
    if line.startswith("WORKER_RESULT "):
      return json.loads(line[len("WORKER_RESULT "):])
  raise RuntimeError("worker %s failed:\n%s" % (name, out.stderr[-4000:]))


def baselines(name):
  """(SGD, old kfac) configurations that `name` is compared with: those
  of the same behaviour (TF2 or legacy)."""
  if name in LEGACY_CONFIGS:
    return "sgd_momentum_legacy", "kfac_old_legacy"
  return "sgd_momentum", "kfac_old_session"


def _ms(values):
  ms = 1e3 * np.asarray(values)
  return (float(np.median(ms)), float(np.percentile(ms, 25)),
          float(np.percentile(ms, 75)))


def summarize(batch_size, data_name, results, names):
  """Markdown lines and JSON rows for one batch size. results[name] is a
  list of worker results (one per round)."""
  stats = {}
  for n in names:
    stats[n] = {w: _ms([t for r in results[n] for t in r["times"][w]])
                for w in WAYS}
  rows, table = [], []
  for n in names:
    sgd, old = baselines(n)
    row = dict(config=n, batch_size=batch_size,
               behaviour="legacy" if n in LEGACY_CONFIGS else "TF2",
               first_run_s={w: float(np.median([r["first_run_s"][w]
                                                for r in results[n]]))
                            for w in WAYS},
               build_s=float(np.median([r["build_s"] for r in results[n]])),
               loss=results[n][-1]["loss"])
    for w in WAYS:
      row[w] = dict(zip(("median_ms", "q25_ms", "q75_ms"), stats[n][w]))
      row[w]["cpu_ms"] = 1e3 * float(np.median(
          [t for r in results[n] for t in r["cpu"][w]]))
      row[w]["ratio_to_sgd"] = (stats[n][w][0] / stats[sgd][w][0]
                                if sgd in stats else None)
      row[w]["ratio_to_old"] = (stats[n][w][0] / stats[old][w][0]
                                if old in stats else None)
      # Per round: this worker's median against the old library's worker
      # of the same round.
      if (old in stats and n not in OLD_CONFIGS and not n.startswith("sgd")
          and len(results[old]) == len(results[n])):
        row[w]["ratio_to_old_per_round"] = [
            float(np.median(a["times"][w]) / np.median(b["times"][w]))
            for a, b in zip(results[n], results[old])]
    rows.append(row)

  def fmt(value, pattern):
    return "-" if value is None else pattern % value

  # With --threads=1: the CPU time per step (+ loss) too, and its ratio.
  cpu_head = (" CPU ms/step (+ loss) | CPU ratio to old kfac |", "---:|---:|"
             ) if FLAGS.threads == 1 else None

  table += [
      "### Batch %d" % batch_size, "",
      "Deep autoencoder %s, batch %d, %s; TF %s, Python %s, %d CPUs (%s); "
      "invert_every=%d, cov_update_every=%d." % (
          "-".join(str(s) for s in model.mirrored_sizes(
              model.FULL_MNIST_ENCODER)), batch_size, data_name,
          tf.__version__, platform.python_version(), os.cpu_count(),
          platform.machine(), FLAGS.invert_every, FLAGS.cov_update_every),
      "ms/step: median over %d blocks of %d steps per configuration and way "
      "(each block holds one K-FAC inverse update), %d interleaved rounds "
      "of fresh worker processes, warm-up excluded; IQR in brackets. Ratios "
      "compare configurations of the same behaviour (TF2 or legacy).%s" % (
          FLAGS.rounds * FLAGS.blocks_per_round, FLAGS.invert_every,
          FLAGS.rounds, "" if not FLAGS.threads else
          " TensorFlow ran %d intra- and %d inter-op thread(s)." % (
              FLAGS.threads, FLAGS.threads)),
      "",
      "| configuration | behaviour | train_op only ms/step | train_op + loss "
      "ms/step | ratio to SGD (+ loss) | ratio to old kfac (+ loss) | first "
      "run (s): train_op / + loss |" + (cpu_head[0] if cpu_head else ""),
      "|---|---|---:|---:|---:|---:|---:|" + (cpu_head[1] if cpu_head else ""),
  ]
  for row in rows:
    only, fetched = row["train_op"], row["train_op+loss"]
    cpu = ""
    if cpu_head:
      old = baselines(row["config"])[1]
      old_cpu = [r for r in rows if r["config"] == old]
      cpu = " %.1f | %s |" % (fetched["cpu_ms"], fmt(
          fetched["cpu_ms"] / old_cpu[0]["train_op+loss"]["cpu_ms"]
          if old_cpu else None, "%.2fx"))
    table.append("| %s | %s | %.1f (%.1f-%.1f) | %.1f (%.1f-%.1f) | %s | %s "
                 "| %.1f / %.1f |%s" % (
                     row["config"], row["behaviour"], only["median_ms"],
                     only["q25_ms"], only["q75_ms"], fetched["median_ms"],
                     fetched["q25_ms"], fetched["q75_ms"],
                     fmt(fetched["ratio_to_sgd"], "%.2fx"),
                     fmt(fetched["ratio_to_old"], "%.2fx"),
                     row["first_run_s"]["train_op"],
                     row["first_run_s"]["train_op+loss"], cpu))
  per_round = [r for r in rows if "ratio_to_old_per_round" in r[WAYS[1]]]
  if per_round:
    table += ["", "Ratio to the old library per round (train_op only; "
              "train_op + loss): " + "; ".join(
                  "%s %s; %s" % (r["config"], ", ".join(
                      "%.2f" % v for v in r[WAYS[0]]["ratio_to_old_per_round"]),
                                 ", ".join("%.2f" % v for v in r[WAYS[1]][
                                     "ratio_to_old_per_round"]))
                  for r in per_round) + "."]
  table += ["", "Loss on the first batch after each worker's %d steps "
            "(sanity): %s." % (
                results[names[0]][-1]["steps"],
                ", ".join("%s %.1f" % (r["config"], r["loss"]) for r in rows))]
  return table, rows


def write_plot(path, rows, title):
  names, medians, low, high, colors = [], [], [], [], []
  for row in rows:
    # Light: train_op only; dark: train_op + loss. Grey SGD, orange the old
    # library, blue this kfac.
    if row["config"].startswith("sgd"):
      pair = ("#cccccc", "#888888")
    elif row["config"] in OLD_CONFIGS:
      pair = ("#fdd0a2", "#ff7f0e")
    else:
      pair = ("#9ecae1", "#1f77b4")
    for way, color in zip(WAYS, pair):
      names.append("%s (%s)" % (row["config"], way.replace("+", " + ")))
      medians.append(row[way]["median_ms"])
      low.append(row[way]["median_ms"] - row[way]["q25_ms"])
      high.append(row[way]["q75_ms"] - row[way]["median_ms"])
      colors.append(color)
  step_time_plot.write_step_time_plot(
      path, names, medians, [low, high], title, colors, label_format="%.1f")


def main(argv):
  del argv
  if FLAGS.worker:
    run_worker(FLAGS.worker)
    return
  unknown = [n for n in FLAGS.configs if n not in ALL_CONFIGS]
  if unknown:
    raise app.UsageError("unknown configuration(s) %s (known: %s)" % (
        ", ".join(unknown), ", ".join(ALL_CONFIGS)))
  batch_sizes = [int(b) for b in FLAGS.batch_sizes]
  data_name, _ = load_batches(8, batch_sizes[0], FLAGS.seed)
  print("model %s, batches %s, data: %s, TF %s, %d CPUs" % (
      "-".join(str(s) for s in model.mirrored_sizes(
          model.FULL_MNIST_ENCODER)), batch_sizes, data_name,
      tf.__version__, os.cpu_count()), flush=True)
  started = time.time()
  names = list(FLAGS.configs)
  results = {(b, n): [] for b in batch_sizes for n in names}
  skipped = []
  for r in range(FLAGS.rounds):
    for batch_size in batch_sizes:
      order = names[r % len(names):] + names[:r % len(names)]
      for name in order:
        if name in skipped:
          continue
        result = spawn_worker(name, batch_size)
        if result is None:
          skipped.append(name)
          print("note: %s skipped: the old kfac is not in %s (make bench "
                "installs it)" % (name, FLAGS.old_kfac_path), flush=True)
          continue
        results[(batch_size, name)].append(result)
      print("round %d/%d, batch %d: %s" % (
          r + 1, FLAGS.rounds, batch_size, "  ".join(
              "%s %.1f/%.1f ms" % (n, 1e3 * np.median(
                  results[(batch_size, n)][-1]["times"][WAYS[0]]),
                                   1e3 * np.median(results[(batch_size, n)][
                                       -1]["times"][WAYS[1]]))
              for n in names if results[(batch_size, n)])), flush=True)

  names = [n for n in names if n not in skipped]
  lines = ["Step time of the deep autoencoder, measured %s; total wall time "
           "%.0f s." % (time.strftime("%Y-%m-%d"), time.time() - started), ""]
  all_rows = []
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  pngs = []
  for batch_size in batch_sizes:
    table, rows = summarize(batch_size, data_name, {
        n: results[(batch_size, n)] for n in names}, names)
    lines += table + [""]
    all_rows += rows
    png = os.path.join(FLAGS.output_dir,
                       "autoencoder_step_time_b%d.png" % batch_size)
    write_plot(png, rows, "Deep autoencoder, batch %d, TF %s, %d CPUs" % (
        batch_size, tf.__version__, os.cpu_count()))
    pngs.append(png)
  if skipped:
    lines += ["Skipped (not installed): %s." % ", ".join(skipped)]
  text = "\n".join(lines)
  print()
  print(text)
  md_path = os.path.join(FLAGS.output_dir, "autoencoder_step_time.md")
  with open(md_path, "w") as f:
    f.write(text + "\n")
  with open(os.path.join(FLAGS.output_dir, "autoencoder_step_time.json"),
            "w") as f:
    json.dump(dict(rows=all_rows, skipped=skipped), f, indent=1)
  print("\nwrote %s, autoencoder_step_time.json and %s" % (
      md_path, ", ".join(pngs)))


if __name__ == "__main__":
  app.run(main)
