r"""What the parts of a K-FAC step cost, and how they scale.

Four measurements, each written as a markdown table (and a PNG where it is
a curve) to --output_dir, and printed:

1. Inverse cost against layer width: one damped factor inverse as kfac
   computes it (`linalg.damped_inverse`: Cholesky factorisation and solve,
   in float32, and in float64 where the damping is too small for float32)
   and an eigendecomposition (`linalg.eigh`, used for other matrix powers),
   for n x n float32 factors, n = 256 ... 4096; and the per-step
   preconditioning of an n -> n dense layer with its two factor inverses
   (A^-1 V G^-1, two n x n x n products).
2. Statistics cost against batch size, on the deep autoencoder: the
   statistics update (the sampled backward pass from the loss to the layer
   outputs, the a^T a and g^T g products and the moving averages) next to
   the SGD step at the same batch size.
3. The split of a K-FAC step on each workload of workloads.py at its
   benchmark batch size: the forward/backward pass (an SGD step),
   preconditioning (K-FAC step with fixed statistics and inverses minus the
   SGD step), statistics (their marginal cost when run with the step), and
   inverses (one inverse update, amortised over --invert_every steps); the
   amortised total next to a measured PeriodicInvCovUpdateKfacOpt step.
4. Memory of the K-FAC state on each workload: factor statistics, inverses
   and velocities, next to the parameters.
5. The cost of adaptive K-FAC on the autoencoder: ms per
   PeriodicInvCovUpdateKfacOpt step (blocks of invert_every steps,
   interleaved between the variants) with a fixed learning rate and
   damping, with damping adaptation (K-FAC-matrix model, or the exact model
   every step), with the quadratic-model learning rate and momentum
   ("qmodel"), and with both.
6. The cost of the non-finite guard (docs/reliability.md) on the
   autoencoder and the convnet: ms per PeriodicInvCovUpdateKfacOpt step
   with skip_non_finite_steps False and True, measured like 5.

Everything runs in TF1 Session graphs (one `session.run` per timed call);
times are medians over --reps calls after warm-up calls. Whole
PeriodicInvCovUpdateKfacOpt steps (3, 5, 6) are run as training loops run
them, with the loss fetched: session.run([train_op, loss]).

  python examples/benchmarks/kfac_cost.py                      # about 6 min
  python examples/benchmarks/kfac_cost.py --quick               # seconds
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads as workloads_lib

import kfac
from kfac.python.ops.numerics import linalg

FLAGS = flags.FLAGS

flags.DEFINE_string("output_dir", "bench_results", "Where to write results.")
flags.DEFINE_list("widths", ["256", "512", "1024", "2048", "4096"],
                  "Factor sizes n for the inverse-cost curve.")
flags.DEFINE_list("batch_sizes", ["64", "128", "256", "512", "1024", "2048"],
                  "Batch sizes for the statistics-cost curve.")
flags.DEFINE_list("workloads", ["autoencoder", "convnet", "rnn"],
                  "Workloads for the step split and the memory table.")
flags.DEFINE_integer("reps", 7, "Timed calls per measurement (median).")
flags.DEFINE_integer("invert_every", 10, "K-FAC inverse period (amortises "
                     "the inverse cost in the step split).")
flags.DEFINE_enum("dataset", "auto", ["auto", "digits", "fashion_mnist"],
                  "Data for the workloads.")
flags.DEFINE_bool("quick", False, "Tiny sizes (digits, widths 64/128, "
                  "batches 32/64, 2 reps): checks that everything runs.")
flags.DEFINE_integer("seed", 0, "Seed.")
flags.DEFINE_list("parts", ["inverse", "statistics", "split", "adaptive",
                            "guard"], "Which measurements to run.")


def _median_ms(run, reps, warmup=2):
  for _ in range(warmup):
    run()
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times))


def _reps_for(n):
  return max(2, FLAGS.reps if n <= 1024 else FLAGS.reps // 3)


# ------------------------------------------------------------------ 1
def inverse_cost(widths):
  """Rows (n, Cholesky inverse ms in float32 and float64, eigh ms,
  preconditioning ms).

  kfac's damped inverse runs in float32 unless the damping is too small for
  float32 Cholesky to be reliable (damping <= 10 n eps min(trace(F),
  largest absolute row sum), see linalg._float32_is_unsafe); then it casts to float64 and back. Both paths
  are timed through linalg.damped_inverse itself: float32 with twice that
  bound as the damping, float64 with half of it.
  """
  rows = []
  rng = np.random.RandomState(FLAGS.seed)
  eps = np.finfo(np.float32).eps
  for n in widths:
    x = rng.randn(2 * n, n).astype(np.float32)
    cov = x.T @ x / (2 * n)
    v = rng.randn(n, n).astype(np.float32)
    # linalg._float32_is_unsafe's bound: 10 n eps min(trace, max row sum).
    bound = 10 * n * eps * min(float(np.abs(np.diag(cov)).sum()),
                               float(np.abs(cov).sum(axis=1).max()))
    with tf.Graph().as_default():
      # A variable, not a constant or a placeholder with a default: Grappler
      # folds ops of those into constants once, and the eigendecomposition
      # then cost nothing per call.
      mat = tf.Variable(cov)
      paths = {}
      for key, damping in (("cholesky_ms", 2 * bound),
                           ("cholesky_f64_ms", bound / 2)):
        paths[key] = (linalg.damped_inverse(mat, damping),
                      linalg._float32_is_unsafe(mat, damping))  # pylint: disable=protected-access
      evals, _ = linalg.eigh(mat)
      a_inv = tf.Variable(np.linalg.inv(cov + 1e-3 * np.eye(n)).astype(
          np.float32))
      precon = tf.matmul(tf.matmul(a_inv, tf.constant(v)), a_inv)
      with tf.compat.v1.Session() as sess:
        sess.run([a_inv.initializer, mat.initializer])
        # The float32 timing must take the float32 branch and the float64
        # timing the fallback; a changed bound would make the columns lie.
        unsafe = sess.run({k: u for k, (_, u) in paths.items()})
        if unsafe["cholesky_ms"] or not unsafe["cholesky_f64_ms"]:
          raise RuntimeError("damped_inverse took an unexpected path at "
                             "n=%d: %s" % (n, unsafe))
        reps = _reps_for(n)
        row = dict(n=n)
        for key, (inverse, _) in paths.items():
          row[key] = _median_ms(lambda op=inverse.op: sess.run(op), reps)
        row["eigh_ms"] = _median_ms(lambda: sess.run(evals.op), reps)
        row["precondition_ms"] = _median_ms(lambda: sess.run(precon.op),
                                            reps)
    rows.append(row)
    print("inverse cost  n=%5d  cholesky inverse float32 %9.1f ms  float64 "
          "fallback %9.1f ms  eigh %9.1f ms  preconditioning %8.1f ms" % (
              n, row["cholesky_ms"], row["cholesky_f64_ms"], row["eigh_ms"],
              row["precondition_ms"]), flush=True)
  return rows


def _growth_exponent(rows, key):
  """Slope of log(time) against log(n) over the two largest widths."""
  if len(rows) < 2:
    return float("nan")
  a, b = rows[-2], rows[-1]
  return float(np.log(b[key] / a[key]) / np.log(b["n"] / a["n"]))


# ------------------------------------------------------------------ graphs
class StepGraph(object):
  """A workload's graph in a Session: SGD, K-FAC step and update ops."""

  def __init__(self, workload, data, batch_size, kfac_kwargs=None):
    self.graph = tf.Graph()
    with self.graph.as_default():
      tf.compat.v1.set_random_seed(FLAGS.seed)
      x_np, y_np = workloads_lib.random_batch(data, batch_size, FLAGS.seed)
      self.x = tf.constant(x_np)
      self.y = tf.constant(y_np)
      variables = workload.make_variables(
          workload.init_params(data, FLAGS.seed))
      var_list = workload.flat_variables(variables)

      def registered_model():
        lc = kfac.LayerCollection()
        logits = workload.forward(self.x, variables, lc)
        workload.register_loss(lc, logits, self.y)
        return lc, workload.loss(self.y, logits, variables)

      lc, loss = registered_model()
      self.sgd = tf.compat.v1.train.MomentumOptimizer(0.01, 0.9).minimize(
          loss, var_list=var_list)
      options = dict(learning_rate=0.01, damping=1.0, momentum=0.9,
                     l2_reg=workload.l2_reg)
      options.update(kfac_kwargs or {})
      opt = kfac.KfacOptimizer(layer_collection=lc, **options)
      (_, self.cov_update, _, self.inv_update, _, _) = (
          opt.make_vars_and_create_ops())
      self.kfac_step = opt.minimize(loss, var_list=var_list)
      self.kfac_step_with_stats = tf.group(self.kfac_step, self.cov_update)
      self.memory = dict(
          parameters=_bytes(var_list),
          statistics=_bytes(opt.get_cov_vars()),
          inverses=_bytes(opt.get_inv_vars()),
          velocities=_bytes(var_list) if options["momentum"] else 0)
      # The complete step, on its own collection (and state).
      periodic_lc, periodic_loss = registered_model()
      periodic = kfac.PeriodicInvCovUpdateKfacOpt(
          invert_every=FLAGS.invert_every, layer_collection=periodic_lc,
          name="periodic", **options)
      self.periodic_step = periodic.minimize(periodic_loss,
                                             var_list=var_list)
      # Timed as training loops run it: the loss fetched with the step.
      self.periodic_fetch = [self.periodic_step, periodic_loss]
      init = tf.compat.v1.global_variables_initializer()
    self.sess = tf.compat.v1.Session(graph=self.graph)
    self.sess.run(init)
    self.sess.run(self.cov_update)
    self.sess.run(self.inv_update)

  def time(self, op, reps):
    return _median_ms(lambda: self.sess.run(op), reps)

  def time_periodic(self, blocks):
    """ms per PeriodicInvCovUpdateKfacOpt step, median over blocks of
    invert_every steps (each block holds one inverse update)."""
    k = FLAGS.invert_every
    for _ in range(k):
      self.sess.run(self.periodic_fetch)
    times = []
    for _ in range(blocks):
      start = time.perf_counter()
      for _ in range(k):
        self.sess.run(self.periodic_fetch)
      times.append((time.perf_counter() - start) / k)
    return 1e3 * float(np.median(times))

  def close(self):
    self.sess.close()


def _bytes(variables):
  # get_cov_vars / get_inv_vars give one list per factor.
  flat = [v for item in variables
          for v in (item if isinstance(item, (list, tuple)) else [item])]
  return int(sum(v.shape.num_elements() * v.dtype.size for v in flat))


# ------------------------------------------------------------------ 2
def statistics_cost(data, batch_sizes):
  """Rows (batch, SGD step ms, statistics update ms) on the autoencoder."""
  workload = workloads_lib.get("autoencoder", small=data.name == "digits")
  rows = []
  for batch in batch_sizes:
    batch = min(batch, len(data))
    g = StepGraph(workload, data, batch)
    row = dict(batch=batch, sgd_ms=g.time(g.sgd, FLAGS.reps),
               statistics_ms=g.time(g.cov_update, FLAGS.reps),
               step_ms=g.time(g.kfac_step, FLAGS.reps))
    row["statistics_marginal_ms"] = (
        g.time(g.kfac_step_with_stats, FLAGS.reps) - row["step_ms"])
    g.close()
    rows.append(row)
    print("statistics    batch %5d  SGD step %7.1f ms  statistics update "
          "alone %7.1f ms (%.2fx), with a step +%.1f ms" % (
              batch, row["sgd_ms"], row["statistics_ms"],
              row["statistics_ms"] / row["sgd_ms"],
              row["statistics_marginal_ms"]), flush=True)
  return rows


# ------------------------------------------------------------------ 3, 4
def step_split(workload, data):
  batch = min(workload.batch_size, len(data))
  g = StepGraph(workload, data, batch)
  reps = FLAGS.reps
  sgd = g.time(g.sgd, reps)
  step = g.time(g.kfac_step, reps)
  with_stats = g.time(g.kfac_step_with_stats, reps)
  inverse = g.time(g.inv_update, max(2, reps // 2))
  periodic = g.time_periodic(max(2, reps // 2))
  memory = g.memory
  g.close()
  row = dict(workload=workload.name, batch=batch, sgd_ms=sgd,
             precondition_ms=step - sgd, statistics_ms=with_stats - step,
             inverse_update_ms=inverse,
             inverse_amortised_ms=inverse / FLAGS.invert_every,
             periodic_ms=periodic, memory=memory)
  row["amortised_total_ms"] = (sgd + row["precondition_ms"] +
                               row["statistics_ms"] +
                               row["inverse_amortised_ms"])
  print("step split    %-11s batch %4d  SGD %6.1f  precondition +%6.1f  "
        "statistics +%6.1f  inverses %7.1f/%d  = %6.1f ms (measured "
        "periodic step %6.1f ms, %.2fx SGD)" % (
            workload.name, batch, sgd, row["precondition_ms"],
            row["statistics_ms"], inverse, FLAGS.invert_every,
            row["amortised_total_ms"], periodic, periodic / sgd), flush=True)
  return row


# ------------------------------------------------------------------ 5
ADAPTIVE_VARIANTS = (
    ("fixed lr and damping", dict(learning_rate=0.1, momentum=0.9)),
    ("+ adapt_damping", dict(learning_rate=0.1, momentum=0.9,
                             adapt_damping=True)),
    ("+ adapt_damping, exact model", dict(
        learning_rate=0.1, momentum=0.9, adapt_damping=True,
        always_use_exact_qmodel_for_damping_adjustment=True)),
    ("qmodel", dict(learning_rate=None, momentum=None,
                    momentum_type="qmodel")),
    ("qmodel + adapt_damping", dict(learning_rate=None, momentum=None,
                                    momentum_type="qmodel",
                                    adapt_damping=True)),
)


# The non-finite guard (docs/reliability.md) on and off.
GUARD_VARIANTS = (
    ("guard off (skip_non_finite_steps=False)", dict(
        learning_rate=0.01, momentum=0.9, skip_non_finite_steps=False)),
    ("guard on (the default)", dict(learning_rate=0.01, momentum=0.9)),
)


def adaptive_cost(workload, data):
  """Rows (variant, ms per step) of adaptive K-FAC's step variants."""
  return variant_cost(workload, data, ADAPTIVE_VARIANTS, "adaptive cost")


def guard_cost(workload, data):
  """Rows (variant, ms per step) with the non-finite guard off and on."""
  return variant_cost(workload, data, GUARD_VARIANTS,
                      "guard cost %s" % workload.name)


def variant_cost(workload, data, variants, what):
  """Rows (variant, ms per step, ratio to the first variant) of
  PeriodicInvCovUpdateKfacOpt steps with the options of `variants`, timed
  in blocks of invert_every steps taking turns."""
  batch = min(workload.batch_size, len(data))
  x_np, y_np = workloads_lib.random_batch(data, batch, FLAGS.seed)
  steps = []
  for label, options in variants:
    graph = tf.Graph()
    with graph.as_default():
      x, y = tf.constant(x_np), tf.constant(y_np)
      variables = workload.make_variables(
          workload.init_params(data, FLAGS.seed))
      lc = kfac.LayerCollection()
      logits = workload.forward(x, variables, lc)
      workload.register_loss(lc, logits, y)
      loss = workload.loss(y, logits, variables)
      extra = {}
      if options.get("adapt_damping"):
        extra = dict(train_batch=(x, y), loss_fn=lambda b, v=variables: (
            workload.loss(b[1], workload.forward(b[0], v), v)),
                     damping_adaptation_interval=5)
      opt = kfac.PeriodicInvCovUpdateKfacOpt(
          invert_every=FLAGS.invert_every, damping=1.0, layer_collection=lc,
          l2_reg=workload.l2_reg, **dict(options, **extra))
      train = opt.minimize(loss, var_list=workload.flat_variables(variables))
      init = tf.compat.v1.global_variables_initializer()
    sess = tf.compat.v1.Session(graph=graph)
    sess.run(init)
    # Timed as training loops run it: the loss fetched with the step.
    steps.append((label, sess, [train, loss]))
  k = FLAGS.invert_every
  times = {label: [] for label, _, _ in steps}
  for round_ in range(max(2, FLAGS.reps // 2) + 1):
    for label, sess, train in steps:
      start = time.perf_counter()
      for _ in range(k):
        sess.run(train)
      if round_:  # the first round warms up
        times[label].append((time.perf_counter() - start) / k)
  rows = []
  base = 1e3 * float(np.median(times[steps[0][0]]))
  for label, sess, _ in steps:
    sess.close()
    ms = 1e3 * float(np.median(times[label]))
    rows.append(dict(variant=label, ms=ms, ratio=ms / base))
    print("%s: %-40s %7.1f ms/step (%.3fx)" % (what, label, ms, ms / base),
          flush=True)
  return rows


# ------------------------------------------------------------------ output
def _table(header, rows):
  lines = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---:" if i else "---" for i in range(len(header)))
           + "|"]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  return "\n".join(lines)


def _mib(num_bytes):
  return "%.2f" % (num_bytes / 2.0**20)


def write_report(results, out_dir):
  parts = ["# K-FAC cost and scaling", "", workloads_lib.machine_line(), ""]
  inv = results["inverse_cost"]
  if inv:
    parts += ["## Inverse cost against factor width", "",
              _table(["n", "Cholesky inverse ms (float32)",
                      "Cholesky inverse ms (float64 fallback)",
                      "eigh ms (float32)",
                      "preconditioning ms (A^-1 V A^-1, n x n)"],
                     [[str(r["n"]), "%.1f" % r["cholesky_ms"],
                       "%.1f" % r["cholesky_f64_ms"],
                       "%.1f" % r["eigh_ms"], "%.1f" % r["precondition_ms"]]
                      for r in inv]), "",
              "Growth exponent over the two largest widths: Cholesky "
              "%.2f (float64 fallback %.2f), eigh %.2f, preconditioning "
              "%.2f (3 = cubic). kfac inverts in float64 when the damping "
              "is at most 10 n eps min(trace(F), largest row sum)." % (
                  _growth_exponent(inv, "cholesky_ms"),
                  _growth_exponent(inv, "cholesky_f64_ms"),
                  _growth_exponent(inv, "eigh_ms"),
                  _growth_exponent(inv, "precondition_ms")), ""]
  stats = results["statistics_cost"]
  if stats:
    parts += ["## Statistics cost against batch size (autoencoder)", "",
              _table(["batch", "SGD step ms", "statistics update ms",
                      "statistics / SGD step", "marginal with the step ms"],
                     [[str(r["batch"]), "%.1f" % r["sgd_ms"],
                       "%.1f" % r["statistics_ms"],
                       "%.2f" % (r["statistics_ms"] / r["sgd_ms"]),
                       "%.1f" % r["statistics_marginal_ms"]]
                      for r in stats]), ""]
  split = results["step_split"]
  if split:
    parts += ["## Split of a K-FAC step (invert_every=%d)" %
              FLAGS.invert_every, "",
              _table(["workload", "batch", "SGD step ms", "+ precondition",
                      "+ statistics", "+ inverses (amortised)",
                      "= K-FAC ms", "measured periodic step ms",
                      "K-FAC / SGD"],
                     [[r["workload"], str(r["batch"]), "%.1f" % r["sgd_ms"],
                       "%.1f" % r["precondition_ms"],
                       "%.1f" % r["statistics_ms"],
                       "%.1f (%.0f per update)" % (r["inverse_amortised_ms"],
                                                   r["inverse_update_ms"]),
                       "%.1f" % r["amortised_total_ms"],
                       "%.1f" % r["periodic_ms"],
                       "%.2fx" % (r["periodic_ms"] / r["sgd_ms"])]
                      for r in split]), "",
              "## Memory of the K-FAC state (MiB)", "",
              _table(["workload", "parameters", "factor statistics",
                      "inverses", "velocities", "state / parameters"],
                     [[r["workload"], _mib(r["memory"]["parameters"]),
                       _mib(r["memory"]["statistics"]),
                       _mib(r["memory"]["inverses"]),
                       _mib(r["memory"]["velocities"]),
                       "%.1fx" % ((r["memory"]["statistics"] +
                                   r["memory"]["inverses"] +
                                   r["memory"]["velocities"]) /
                                  r["memory"]["parameters"])]
                      for r in split]), ""]
  adaptive = results.get("adaptive_cost")
  if adaptive:
    parts += ["## Cost of adaptive K-FAC (autoencoder, ms per step)", "",
              _table(["variant", "ms/step", "vs fixed"],
                     [[r["variant"], "%.1f" % r["ms"], "%.2fx" % r["ratio"]]
                      for r in adaptive]), ""]
  guard = results.get("guard_cost")
  if guard:
    parts += ["## Cost of the non-finite guard (ms per step)", "",
              _table(["workload", "variant", "ms/step", "vs guard off"],
                     [[w, r["variant"], "%.1f" % r["ms"],
                       "%.3fx" % r["ratio"]]
                      for w, rows in guard for r in rows]), ""]
  text = "\n".join(parts)
  with open(os.path.join(out_dir, "kfac_cost.md"), "w") as f:
    f.write(text)
  with open(os.path.join(out_dir, "kfac_cost.json"), "w") as f:
    json.dump(results, f, indent=1)
  _plot(results, out_dir)
  return text


def _plot(results, out_dir):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  def loglog(rows, x_key, series, xlabel, title, filename):
    """One log-log plot of rows[key] against rows[x_key] per (key, label)."""
    if not rows:
      return
    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r[x_key] for r in rows]
    for key, label in series:
      ax.loglog(x, [r[key] for r in rows], "o-", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, filename), dpi=120)
    plt.close(fig)

  loglog(results["inverse_cost"], "n",
         (("cholesky_ms", "Cholesky inverse, float32"),
          ("cholesky_f64_ms", "Cholesky inverse, float64 fallback"),
          ("eigh_ms", "eigendecomposition"),
          ("precondition_ms", "preconditioning A^-1 V A^-1")),
         "factor width n", "K-FAC factor costs", "inverse_cost.png")
  loglog(results["statistics_cost"], "batch",
         (("sgd_ms", "SGD step"), ("statistics_ms", "statistics update")),
         "batch size", "Statistics cost, deep autoencoder",
         "statistics_cost.png")
  split = results["step_split"]
  if split:
    fig, ax = plt.subplots(figsize=(6, 4))
    names = [r["workload"] for r in split]
    bottom = np.zeros(len(split))
    for key, label in (("sgd_ms", "forward + backward (SGD step)"),
                       ("precondition_ms", "preconditioning"),
                       ("statistics_ms", "statistics"),
                       ("inverse_amortised_ms", "inverses (amortised)")):
      values = np.array([max(r[key], 0.0) for r in split])
      ax.bar(names, values, bottom=bottom, label=label)
      bottom += values
    ax.set_ylabel("ms per step")
    ax.set_title("Split of a K-FAC step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "step_split.png"), dpi=120)
    plt.close(fig)



def main(argv):
  del argv
  widths = [int(w) for w in FLAGS.widths]
  batch_sizes = [int(b) for b in FLAGS.batch_sizes]
  dataset = FLAGS.dataset
  if FLAGS.quick:
    widths, batch_sizes, dataset = [64, 128], [32, 64], "digits"
    FLAGS.reps = 2
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  print(workloads_lib.machine_line(), flush=True)
  parts = set(FLAGS.parts)
  results = dict(inverse_cost=inverse_cost(widths) if "inverse" in parts
                 else [])
  data = {}

  def data_for(workload):
    kind = "autoencoder" if workload.name == "autoencoder" else "images"
    if kind not in data:
      data[kind] = workload.load(dataset, 20000)
    return data[kind]

  small = dataset == "digits"
  autoencoder = workloads_lib.get("autoencoder", small=small)
  if dataset == "auto":
    small = data_for(autoencoder).name == "digits"
    autoencoder = workloads_lib.get("autoencoder", small=small)
  results["statistics_cost"] = (
      statistics_cost(data_for(autoencoder), batch_sizes)
      if "statistics" in parts else [])
  results["step_split"] = [
      step_split(w, data_for(w)) for w in
      (workloads_lib.get(name, small=small) for name in FLAGS.workloads)
  ] if "split" in parts else []
  if "adaptive" in parts:
    results["adaptive_cost"] = adaptive_cost(autoencoder,
                                             data_for(autoencoder))
  if "guard" in parts:
    results["guard_cost"] = [
        (name, guard_cost(w, data_for(w))) for name, w in
        ((name, workloads_lib.get(name, small=small))
         for name in ("autoencoder", "convnet"))]
  text = write_report(results, FLAGS.output_dir)
  print()
  print(text)


if __name__ == "__main__":
  app.run(main)
