r"""Time and steps to a target loss: K-FAC against Adam and SGD.

For each workload of workloads.py (deep autoencoder, convnet, RNN on
Fashion-MNIST) five optimizers train from the same initial weights on the
same mini-batches, with the same training-time budget, taking turns a few
steps each so that machine noise slows all of them alike
(examples/side_by_side.py):

  sgd            tf.compat.v1.train.MomentumOptimizer (momentum 0.9)
  adam           tf.compat.v1.train.AdamOptimizer
  kfac           PeriodicInvCovUpdateKfacOpt, fixed learning rate, damping
                 and momentum, in a TF1 Session graph
  kfac_tf2       the same optimizer and hyperparameters in a TF2
                 tf.function step (a new LayerCollection per trace)
  kfac_adaptive  the default recipe (kfac.python.ops.adaptive.recipe, docs/recipe.md):
                 PeriodicInvCovUpdateKfacOpt with momentum_type="qmodel"
                 (learning rate and momentum from the exact quadratic model),
                 adapt_damping=True (immediate rule, every 5 steps), initial
                 damping 1 calibrated during 5 burn-in steps, damping floor
                 0.1 x the curvature scale; the same on every workload
                 (nothing tuned), Session

The target loss of a workload is the lowest final loss of the first-order
runs (sgd, adam) at the end of the budget; the table gives for every run
the training seconds and steps until its evaluation loss first reached it,
its ms/step and the ratio to SGD's. Losses are evaluated on a fixed subset
of the training set every --eval_every steps; evaluation time is not
training time. Every training step also returns its loss, as training loops
do (Session: session.run([train_op, loss]); tf.function: the step returns
the loss and the loop reads it).

Hyperparameters: DEFAULTS below, chosen with --tune, which runs every point
of GRIDS alone for --tune_seconds and keeps the lowest final loss (written to
<output_dir>/tuning_<workload>.md). kfac_tf2 uses kfac's values.

  python examples/benchmarks/time_to_target.py                  # ~25 min
  python examples/benchmarks/time_to_target.py --workloads=rnn --seconds=30
  python examples/benchmarks/time_to_target.py --tune           # ~2 h
  python examples/benchmarks/time_to_target.py --tune --workloads=convnet \
      --optimizers=kfac --tune_only=damping=0.01    # part of a grid
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
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
import results_files
import side_by_side
import workloads as workloads_lib

import kfac
from kfac.python.ops.adaptive import recipe

FLAGS = flags.FLAGS

OPTIMIZERS = ("sgd", "adam", "kfac", "kfac_tf2", "kfac_adaptive")
FIRST_ORDER = ("sgd", "adam")

side_by_side.define_flags()
FLAGS.set_default("optimizers", list(OPTIMIZERS))
FLAGS.set_default("dataset", "fashion_mnist")
flags.DEFINE_list("workloads", ["autoencoder", "convnet", "rnn"],
                  "Workloads (workloads.py).")
flags.DEFINE_string("output_dir", "bench_results", "Where to write results.")
flags.DEFINE_bool("tune", False, "Run the grids instead of the comparison.")
flags.DEFINE_float("tune_seconds", None, "Budget of one tuning run "
                   "(default: half the comparison's).")
flags.DEFINE_float("adaptive_min_damping", 1e-8, "min_damping of "
                   "kfac_adaptive (1e-8: the library's default).")
flags.DEFINE_float("adaptive_relative_min_damping",
                   recipe.RELATIVE_MIN_DAMPING,
                   "relative_min_damping of kfac_adaptive (default: the "
                   "recipe's; a negative value: none).")
flags.DEFINE_integer("adaptive_cov_update_every", None, "cov_update_every "
                     "of kfac_adaptive (default: the recipe's, %d)."
                     % recipe.COV_UPDATE_EVERY)
flags.DEFINE_list("tune_only", [], "With --tune, run only the grid points "
                  "with these values, e.g. damping=0.01,learning_rate=0.03.")

# Training-time budget per run, and the hyperparameters (from --tune; see
# docs/benchmarks.md for the tuning tables).
SECONDS = {"autoencoder": 120.0, "convnet": 60.0, "rnn": 60.0}
DEFAULTS = {
    "autoencoder": dict(sgd=dict(learning_rate=0.003),
                        adam=dict(learning_rate=1e-3),
                        kfac=dict(learning_rate=0.1, damping=10.0),
                        kfac_adaptive=dict(damping=recipe.INITIAL_DAMPING)),
    "convnet": dict(sgd=dict(learning_rate=0.1),
                    adam=dict(learning_rate=3e-3),
                    kfac=dict(learning_rate=0.03, damping=0.1),
                    kfac_adaptive=dict(damping=recipe.INITIAL_DAMPING)),
    "rnn": dict(sgd=dict(learning_rate=0.003),
                adam=dict(learning_rate=1e-3),
                kfac=dict(learning_rate=3e-4, damping=0.001),
                kfac_adaptive=dict(damping=recipe.INITIAL_DAMPING)),
}
GRIDS = {
    "sgd": [dict(learning_rate=lr) for lr in (0.001, 0.003, 0.01, 0.03,
                                                 0.1, 0.3)],
    "adam": [dict(learning_rate=lr) for lr in (1e-4, 3e-4, 1e-3, 3e-3,
                                               1e-2)],
    "kfac": [dict(learning_rate=lr, damping=d)
             for lr in (3e-4, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3)
             for d in (0.001, 0.01, 0.1, 1.0, 10.0)],
    "kfac_adaptive": [dict(damping=d) for d in (0.01, 1.0, 100.0)],
}
KFAC_COMMON = dict(invert_every=10, cov_update_every=1, momentum=0.9,
                   momentum_type="adam", cov_ema_decay=0.95)
# The default recipe, with the library's other defaults spelled out.
ADAPTIVE = recipe.adaptive_kwargs(invert_every=10,
                                  damping_adaptation_interval=5,
                                  cov_ema_decay=0.95)
del ADAPTIVE["damping"], ADAPTIVE["relative_min_damping"]


def make_optimizer(name, hyper, workload, layer_collection=None,
                   loss_fn=None, train_batch=None):
  """(optimizer, {name: value shown in progress lines})."""
  if name == "sgd":
    return (tf.compat.v1.train.MomentumOptimizer(hyper["learning_rate"], 0.9),
            dict(lr=hyper["learning_rate"]))
  if name == "adam":
    return (tf.compat.v1.train.AdamOptimizer(hyper["learning_rate"]),
            dict(lr=hyper["learning_rate"]))
  if name in ("kfac", "kfac_tf2"):
    opt = kfac.PeriodicInvCovUpdateKfacOpt(
        learning_rate=hyper["learning_rate"], damping=hyper["damping"],
        layer_collection=layer_collection, l2_reg=workload.l2_reg,
        **KFAC_COMMON)
    return opt, dict(damping=opt.damping, lr=opt.learning_rate)
  if name == "kfac_adaptive":
    opt = kfac.PeriodicInvCovUpdateKfacOpt(
        damping=hyper["damping"], layer_collection=layer_collection,
        l2_reg=workload.l2_reg, loss_fn=loss_fn, train_batch=train_batch,
        min_damping=FLAGS.adaptive_min_damping,
        relative_min_damping=(None if FLAGS.adaptive_relative_min_damping < 0
                              else FLAGS.adaptive_relative_min_damping),
        **dict(ADAPTIVE, **({} if FLAGS.adaptive_cov_update_every is None
                            else dict(cov_update_every=
                                      FLAGS.adaptive_cov_update_every))))
    return opt, dict(damping=opt.damping, lr=opt.learning_rate,
                     momentum=opt.momentum, rho=opt.rho,
                     # burn-in steps leave the counter at 0
                     burn_in=tf.equal(opt.counter, 0))
  raise ValueError("unknown optimizer %r" % name)


class _Backend(object):
  """Evaluation shared by both backends (see side_by_side.py)."""

  def __init__(self, data, eval_batch):
    self.data = data
    self.eval_batch = eval_batch

  def batch(self, indices):
    return self.data.batch(indices)

  def finish(self):
    self.close()
    return {}

  def close(self):
    pass


class SessionBackend(_Backend):
  """One optimizer in its own tf.Graph run by a tf.compat.v1.Session."""

  def __init__(self, name, hyper, workload, data, params_np, eval_batch):
    super().__init__(data, eval_batch)
    graph = tf.Graph()
    with graph.as_default():
      tf.compat.v1.set_random_seed(FLAGS.seed)
      self.x = tf.compat.v1.placeholder(tf.float32,
                                        (None,) + data.x.shape[1:])
      self.y = tf.compat.v1.placeholder(workload.target_dtype,
                                        (None,) + data.y.shape[1:])
      variables = workload.make_variables(params_np)
      var_list = workload.flat_variables(variables)
      lc = None if name in FIRST_ORDER else kfac.LayerCollection()
      logits = workload.forward(self.x, variables, lc)
      if lc is not None:
        workload.register_loss(lc, logits, self.y)
      self.loss = workload.loss(self.y, logits, variables)

      def loss_fn(batch):
        x, y = batch
        return workload.loss(y, workload.forward(x, variables), variables)

      opt, shown = make_optimizer(name, hyper, workload, lc, loss_fn,
                                  (self.x, self.y))
      self.train_op = opt.minimize(
          self.loss, var_list=var_list,
          global_step=tf.compat.v1.train.get_or_create_global_step())
      self.shown_ops = {k: tf.convert_to_tensor(v) for k, v in shown.items()}
      init = tf.compat.v1.global_variables_initializer()
    graph.finalize()
    self.sess = tf.compat.v1.Session(graph=graph)
    self.sess.run(init)

  def train(self, batch):
    # The loss fetched with the step, as training loops do.
    _, loss = self.sess.run([self.train_op, self.loss],
                            {self.x: batch[0], self.y: batch[1]})
    return float(loss)

  def evaluate(self):
    return float(self.sess.run(self.loss, {self.x: self.eval_batch[0],
                                           self.y: self.eval_batch[1]}))

  def shown(self):
    return self.sess.run(self.shown_ops)

  def close(self):
    self.sess.close()


class FunctionBackend(_Backend):
  """One optimizer in TF2 style: variables and a tf.function step."""

  def __init__(self, name, hyper, workload, data, params_np, eval_batch):
    super().__init__(data, eval_batch)
    tf.random.set_seed(FLAGS.seed)
    variables = workload.make_variables(params_np)
    var_list = workload.flat_variables(variables)
    opt, self._shown = make_optimizer(name, hyper, workload)

    @tf.function(autograph=False)
    def train_step(x, y):
      lc = kfac.LayerCollection()  # a new collection on every trace
      logits = workload.forward(x, variables, lc)
      workload.register_loss(lc, logits, y)
      loss = workload.loss(y, logits, variables)
      opt.minimize(loss, var_list=var_list, layer_collection=lc)
      return loss

    @tf.function(autograph=False)
    def loss(x, y):
      return workload.loss(y, workload.forward(x, variables), variables)

    self._train_step, self._loss = train_step, loss
    # Trace now (creating the K-FAC state), so that the clock of the first
    # step does not count it; tracing runs no step.
    size = min(FLAGS.batch_size or workload.batch_size, len(data))
    x, y = data.batch(np.arange(size))
    train_step.get_concrete_function(tf.TensorSpec(x.shape, tf.float32),
                                     tf.TensorSpec(y.shape, y.dtype))

  def train(self, batch):
    return float(self._train_step(*batch))  # the loss read every step

  def evaluate(self):
    return float(self._loss(*self.eval_batch))

  def shown(self):
    return {k: float(tf.convert_to_tensor(v)) for k, v in self._shown.items()}


def _backend(name, hyper, workload, data, params_np, eval_batch):
  cls = FunctionBackend if name == "kfac_tf2" else SessionBackend
  return cls(name, hyper, workload, data, params_np, eval_batch)


def _hyper(workload, name):
  return DEFAULTS[workload.name]["kfac" if name == "kfac_tf2" else name]


def _format_hyper(hyper):
  return ", ".join("%s %g" % (k.replace("learning_rate", "lr"), v)
                   for k, v in sorted(hyper.items()))


# ------------------------------------------------------------------ compare
def compare(workload, data, seconds, out_dir):
  """Trains every optimizer side by side; returns the summary rows."""
  batch_size = min(FLAGS.batch_size or workload.batch_size, len(data))
  params_np = workload.init_params(data, FLAGS.seed)
  eval_batch = _eval_batch(data)
  batches = side_by_side.Batches(len(data), batch_size, FLAGS.seed)
  print("\n== %s: %s, batch %d, %.0f s per optimizer ==" % (
      workload.name, workload.describe(data), batch_size, seconds),
        flush=True)
  trainers = []
  for name in FLAGS.optimizers:
    hyper = _hyper(workload, name)
    print("  %s: %s" % (name, _format_hyper(hyper)), flush=True)
    backend = _backend(name, hyper, workload, data, params_np, eval_batch)
    trainers.append(side_by_side.Trainer(name, backend, batches, seconds,
                                         record_shown=True))
  histories = side_by_side.run_in_turns(trainers, FLAGS.chunk_steps)
  rows = _summarise(workload, histories)
  table = _markdown(workload, data, batch_size, seconds, rows)
  print("\n" + table, flush=True)
  with open(os.path.join(out_dir, "time_to_target_%s.md" % workload.name),
            "w") as f:
    f.write(table + "\n")
  side_by_side.write_results(
      os.path.join(out_dir, "time_to_target_%s.json" % workload.name),
      histories, workload=workload.name, dataset=data.name,
      batch_size=batch_size, seconds=seconds)
  for axis in ("steps", "seconds"):
    side_by_side.plot_histories(
        histories, os.path.join(out_dir, "%s_loss_vs_%s.png" % (
            workload.name, axis)), axis, workload.eval_loss_name(),
        log_y=workload.name == "autoencoder",
        title="%s (%s)" % (workload.name, data.name))
  return rows


def _eval_batch(data):
  rng = np.random.RandomState(FLAGS.seed)
  return data.batch(rng.choice(len(data), min(FLAGS.eval_examples,
                                               len(data)), replace=False))


def _summarise(workload, histories):
  by_name = {h.name: h for h in histories}
  first_order = [by_name[n].final_loss for n in FIRST_ORDER
                 if n in by_name and np.isfinite(by_name[n].final_loss)]
  target = min(first_order) if first_order else np.nan
  sgd_ms = None
  if "sgd" in by_name:
    sgd_ms = 1e3 * by_name["sgd"].seconds[-1] / max(by_name["sgd"].steps[-1],
                                                    1)
  rows = []
  for h in histories:
    ms = 1e3 * h.seconds[-1] / max(h.steps[-1], 1)
    rows.append(dict(
        workload=workload.name, name=h.name,
        hyper=_format_hyper(_hyper(workload, h.name)), steps=h.steps[-1],
        seconds=h.seconds[-1], ms_per_step=ms,
        ms_ratio_to_sgd=ms / sgd_ms if sgd_ms else np.nan,
        final_loss=h.final_loss, target=target,
        seconds_to_target=h.seconds_to_reach(target),
        steps_to_target=h.steps_to_reach(target)))
  return rows


def _fmt(value, fmt):
  return "-" if value is None or not np.isfinite(value) else fmt % value


def _markdown(workload, data, batch_size, seconds, rows):
  target = rows[0]["target"]
  lines = [
      "### %s: %s" % (workload.name, workload.describe(data)), "",
      "%s training images: %d, batch %d, %.0f s of training per "
      "optimizer; target loss %s (the best first-order final loss)." % (
          data.name, len(data), batch_size, seconds, _fmt(target, "%.4g")),
      "",
      "| optimizer | hyperparameters | steps | ms/step | vs SGD | final loss "
      "| seconds to target | steps to target |",
      "|---|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append("| %s | %s | %d | %.1f | %s | %.4g | %s | %s |" % (
        r["name"], r["hyper"], r["steps"], r["ms_per_step"],
        _fmt(r["ms_ratio_to_sgd"], "%.2fx"), r["final_loss"],
        _fmt(r["seconds_to_target"], "%.1f"),
        "-" if r["steps_to_target"] is None else str(r["steps_to_target"])))
  return "\n".join(lines)


def summary_table(rows):
  """Per workload: time to target of K-FAC and of the first-order run that
  set the target, and K-FAC's step cost relative to SGD."""
  lines = ["| workload | target (set by) | its s to target | Adam s | "
           "K-FAC s (Session) | K-FAC s (tf.function) | adaptive K-FAC s | "
           "K-FAC / first-order time | K-FAC / SGD ms per step |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for workload in dict.fromkeys(r["workload"] for r in rows):
    by = {r["name"]: r for r in rows if r["workload"] == workload}

    def sec(name, by=by):
      r = by.get(name)
      return None if r is None else r["seconds_to_target"]

    setter = min((n for n in FIRST_ORDER if n in by),
                 key=lambda n, by=by: by[n]["final_loss"], default=None)
    ratio = (sec("kfac") / sec(setter) if setter and sec("kfac") and
             sec(setter) else None)
    lines.append("| %s | %s (%s) | %s | %s | %s | %s | %s | %s | %s |" % (
        workload, _fmt(next(iter(by.values()))["target"], "%.4g"), setter,
        _fmt(sec(setter), "%.1f"), _fmt(sec("adam"), "%.1f"),
        _fmt(sec("kfac"), "%.1f"), _fmt(sec("kfac_tf2"), "%.1f"),
        _fmt(sec("kfac_adaptive"), "%.1f"), _fmt(ratio, "%.2fx"),
        _fmt(by["kfac"]["ms_ratio_to_sgd"] if "kfac" in by else None,
             "%.2fx")))
  return "\n".join(lines)


# ------------------------------------------------------------------ tune
def tune(workload, data, seconds, out_dir):
  """Runs each grid point alone; returns {optimizer: best hyperparameters}."""
  params_np = workload.init_params(data, FLAGS.seed)
  eval_batch = _eval_batch(data)
  batch_size = min(FLAGS.batch_size or workload.batch_size, len(data))
  batches = side_by_side.Batches(len(data), batch_size, FLAGS.seed)
  lines = ["### Tuning on %s (%.0f s per run, batch %d)" % (
      workload.name, seconds, batch_size), "",
           "| optimizer | hyperparameters | steps | final loss |",
           "|---|---|---:|---:|"]
  best = {}
  for name in [n for n in FLAGS.optimizers if n in GRIDS]:
    for hyper in _selected(GRIDS[name]):
      backend = _backend(name, hyper, workload, data, params_np, eval_batch)
      trainer = side_by_side.Trainer(name, backend, batches, seconds)
      history = side_by_side.run_in_turns([trainer], FLAGS.chunk_steps)[0]
      loss = history.final_loss if np.isfinite(history.final_loss) else np.inf
      lines.append("| %s | %s | %d | %s |" % (
          name, _format_hyper(hyper), history.steps[-1],
          _fmt(history.final_loss, "%.4g")))
      if name not in best or loss < best[name][1]:
        best[name] = (hyper, loss)
  if not best:
    raise ValueError("--tune_only=%s selects no grid point of %s" % (
        ",".join(FLAGS.tune_only), ",".join(FLAGS.optimizers)))
  lines.append("")
  lines.append("Best: " + "; ".join("%s: %s (%.4g)" % (
      n, _format_hyper(h), l) for n, (h, l) in best.items()))
  text = "\n".join(lines)
  print("\n" + text, flush=True)
  with open(os.path.join(out_dir, "tuning_%s.md" % workload.name), "w") as f:
    f.write(text + "\n")
  return {n: h for n, (h, _) in best.items()}


def _selected(grid):
  """The points of `grid` that match every --tune_only key=value."""
  wanted = {}
  for item in FLAGS.tune_only:
    key, sep, value = item.partition("=")
    if not sep:
      raise ValueError("--tune_only takes key=value items, got %r" % item)
    wanted[key] = float(value)
  return [h for h in grid
          if all(k in h and h[k] == v for k, v in wanted.items())]


def _workload_tables(out_dir):
  """{workload: its time_to_target_WORKLOAD.md} of this run's workloads
  (each optimizer's steps and seconds to the target)."""
  tables = {}
  for name in FLAGS.workloads:
    with open(os.path.join(out_dir, "time_to_target_%s.md" % name)) as f:
      tables[name] = f.read().strip()
  return tables


def _plain(value):
  """A numpy scalar as its Python value (json.dumps's default)."""
  return value.item() if hasattr(value, "item") else str(value)


def main(argv):
  del argv
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  start = time.time()
  rows, tuned = [], {}
  cache = {}
  for name in FLAGS.workloads:
    small = FLAGS.dataset == "digits"
    workload = workloads_lib.get(name, small=small)
    kind = "autoencoder" if name == "autoencoder" else "images"
    if kind not in cache:
      cache[kind] = workload.load(FLAGS.dataset, FLAGS.max_examples)
    data = cache[kind]
    seconds = FLAGS.seconds or SECONDS[name]
    if FLAGS.tune:
      tuned[name] = tune(workload, data, FLAGS.tune_seconds or seconds / 2,
                         FLAGS.output_dir)
    else:
      rows.extend(compare(workload, data, seconds, FLAGS.output_dir))
  if FLAGS.tune:
    with open(os.path.join(FLAGS.output_dir, "tuned.json"), "w") as f:
      json.dump(tuned, f, indent=1)
  else:
    table = summary_table(rows)
    print("\n" + table)
    command = " ".join(["time_to_target.py"] + sys.argv[1:])
    # time_to_target.md as before; time_to_target.json: the rows and, under
    # "tables", the table headed by its command (what the docs render).
    results_files.write(
        FLAGS.output_dir, "time_to_target", table + "\n",
        dict(command=command,
             rows=json.loads(json.dumps(rows, default=_plain)),
             tables=dict(summary="`%s`\n\n%s" % (command, table),
                         **_workload_tables(FLAGS.output_dir))))
  print("\ntotal wall time %.0f s" % (time.time() - start))


if __name__ == "__main__":
  app.run(main)
