r"""Validation accuracy per second in Keras `fit`: K-FAC's default recipe
against the optimizers Keras 3.15 ships (issue 33).

Every (workload, optimizer) run is one fresh worker process that seeds
Keras (keras.utils.set_random_seed: the same initial weights for every
optimizer), builds the model of val_workloads.py, compiles it with the
optimizer and trains it with one `model.fit` over the same batches in the
same order (--batch_size, drawn from a seeded permutation of the training
subset), for a fixed TRAINING budget of --budget_s seconds of the worker's
CPU time, with TensorFlow pinned to --threads thread(s) (intra- and
inter-op parallelism; tf.data's private pool likewise): on a shared
machine the CPU time of a one-thread process barely depends on what else
runs, where its wall time does. Wall time is recorded too. Every
--eval_every steps (and before the first step) the clock stops, the model
is evaluated on the validation set, and the clock goes on: validation time
is not training time. The first step (which traces fit's train function)
is not counted either; its CPU and wall seconds are reported apart.

Optimizers (val_workloads.py): `kfac` = Kfac(model=model, adaptive=True),
the recipe, untouched and never tuned; the names of KFAC_VARIANTS are
recipe ablations (Kfac keyword arguments); the peers adam, adamw, lion,
muon, schedulefree (ScheduleFreeAdamW, evaluated at its averaged point)
each take the learning rate of the tuned JSON (--tuned), or the middle of
their grid when it has none (marked "untuned").

  --tune   runs every peer's grid and writes the best value per (workload,
           optimizer), by the best validation figure of the run, into
           --tuned (merged: pairs not tuned in this pass keep their value)

Outputs in --output_dir: keras_validation.md (a table per workload:
optimizer, grid value, final and best validation figure, the target = the
best validation figure any peer reached in its budget, CPU seconds and
steps to the target, ms/step, K-FAC's time to the target over the fastest
peer's), keras_validation.json (every run, every evaluation) and
keras_validation.png (validation figure against CPU seconds and against
steps, a column per workload). Progress lines while it runs.

  --seeds=1,2    every (workload, optimizer) once per seed (weights, subset
                 and batch order), with the tuned values
  --add_results  earlier runs' JSON (of a --tune run: the run at each
                 peer's tuned value) joining the summary: other seeds, or
                 other optimizers at this run's seeds (every optimizer of
                 the file joins; a (seed, workload, optimizer) this run
                 trains too is refused)

With more than one seed, keras_validation.md starts with the summary across
seeds (per workload and optimizer: the best figure and the time to that
seed's target over that seed's fastest peer's, per seed, their median and
how many seeds reached it; the step's CPU and wall ms and CPU ms over
Adam's, medians), then each seed's table; keras_validation_seeds.png plots
the ratios, a dot per seed. `--rerender=FILE` recomputes the tables of an
earlier run's JSON from its runs, training nothing. The JSON's "tables"
hold the markdown the docs
render: "summary" and each workload's table (the first seed's runs),
"tuning", and with several seeds "across_seeds". `--optimizers=` (none)
with --add_results trains nothing and renders the tables of the files'
runs.

  python examples/benchmarks/keras_validation.py --tune     # the grids
  python examples/benchmarks/keras_validation.py            # tuned values
  python examples/benchmarks/keras_validation.py --seeds=1,2 \
      --add_results=bench_results/keras_validation_tune.json  # 3 seeds
  python examples/benchmarks/keras_validation.py --workloads=cnn \
      --optimizers=kfac,kfac_wd,adam --budget_s=30
"""

import datetime
import json
import math
import os
import platform
import sys
import time

from absl import app
from absl import flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# pylint: disable=g-import-not-at-top,wrong-import-position
import machine
import val_workloads as vw

DEFAULT_OPTIMIZERS = ("kfac",) + vw.PEERS

flags.DEFINE_list("workloads", list(vw.WORKLOADS), "Workloads to run.")
flags.DEFINE_list("optimizers", list(DEFAULT_OPTIMIZERS),
                  "Optimizers: kfac, the K-FAC variants (%s) and the peers "
                  "(%s)." % (", ".join(list(vw.KFAC_VARIANTS)[1:]),
                             ", ".join(vw.PEERS)))
flags.DEFINE_bool("tune", False, "Run the peers' grids and write --tuned.")
flags.DEFINE_string("tuned", os.path.join(HERE, "keras_validation_tuned.json"),
                    "The tuned values (read, or written by --tune).")
flags.DEFINE_float("budget_s", 60.0, "Training CPU seconds per run.")
flags.DEFINE_integer("max_steps", 0, "Also stop after this many steps (0: no "
                     "limit; the smoke test's budget).")
flags.DEFINE_integer("eval_every", 40, "Steps between validations.")
flags.DEFINE_float("stop_at", float("nan"), "Also stop at the first "
                   "validation at least as good as this figure (off: NaN; "
                   "critical_batch.py's target).")
flags.DEFINE_integer("batch_size", 256, "Training batch size.")
flags.DEFINE_integer("train_examples", 20000, "Training images (a fixed "
                     "seeded subset).")
flags.DEFINE_integer("val_examples", 10000, "Validation images (the test "
                     "set's first ones).")
flags.DEFINE_integer("threads", 1, "TensorFlow threads per worker.")
flags.DEFINE_integer("parallel", 2, "Workers at once (at most 2).")
flags.DEFINE_enum("size", "full", ["full", "tiny"], "Model sizes.")
flags.DEFINE_integer("seed", 0, "Seed of the weights, subset and batches.")
flags.DEFINE_list("seeds", [], "Several seeds in one run (instead of --seed): "
                  "every (workload, optimizer) once per seed, a table per "
                  "seed and the summary across seeds.")
flags.DEFINE_list("add_results", [], "keras_validation JSON files of earlier "
                  "runs (other seeds, or other optimizers at these seeds) "
                  "to add to the summary (a --tune run's file gives the run "
                  "at each peer's tuned value).")
flags.DEFINE_string("output_dir", "bench_results", "Where to write.")
flags.DEFINE_string("rerender", None, "A keras_validation JSON whose "
                    "\"tables\" to recompute from its own runs with this "
                    "program's table code (after a change to it); trains "
                    "nothing, keeps the runs and the recorded command.")
flags.DEFINE_string("worker", None, "(internal) workload,optimizer[,value].")
FLAGS = flags.FLAGS

BN_BATCHES = 8  # batches that recompute ScheduleFree's batch-norm statistics


def _finite(v):
  return v is not None and math.isfinite(v)


def run_worker(workload, opt_name, value):
  """One run in this process; prints PROGRESS lines, returns the result."""
  import numpy as np
  import tensorflow as tf
  tf.config.threading.set_intra_op_parallelism_threads(FLAGS.threads)
  tf.config.threading.set_inter_op_parallelism_threads(FLAGS.threads)
  import keras
  x, y, vx, vy = vw.load(workload, FLAGS.train_examples, FLAGS.val_examples,
                         FLAGS.seed)
  keras.utils.set_random_seed(FLAGS.seed)
  model = vw.build(workload, FLAGS.size)
  opt = vw.make_optimizer(opt_name, model, value)
  model.compile(optimizer=opt, loss=vw.loss(workload),
                metrics=vw.metrics(workload))
  b = FLAGS.batch_size
  per_epoch = len(x) // b
  rng = np.random.RandomState(FLAGS.seed + 1)
  order = np.concatenate([rng.permutation(len(x))[:per_epoch * b]
                          for _ in range(40)]).astype("int32")
  options = tf.data.Options()
  options.threading.private_threadpool_size = FLAGS.threads
  xs, ys = tf.constant(x), tf.constant(y)
  if opt_name in vw.BATCH_GROWTH:
    # A growing batch: the first steps take consecutive slices of `order`
    # of the schedule's sizes, then batches of b.
    sizes = vw.batch_sizes(opt_name, b, vw.BATCH_GROWTH[opt_name][1])
    ends = np.cumsum(sizes)
    order_t = tf.constant(order)
    grown = (tf.data.Dataset.from_tensor_slices((ends - sizes, ends))
             .map(lambda start, end: order_t[start:end]))
    rest = tf.data.Dataset.from_tensor_slices(order[ends[-1]:]).batch(b)
    indices = grown.concatenate(rest.repeat())
  else:
    indices = tf.data.Dataset.from_tensor_slices(order).batch(b).repeat()
  train = (indices.map(lambda i: (tf.gather(xs, i), tf.gather(ys, i)))
           .prefetch(2).with_options(options))
  val = (tf.data.Dataset.from_tensor_slices((vx, vy)).batch(1000)
         .with_options(options))
  bn_batches = [x[k * b:(k + 1) * b] for k in range(BN_BATCHES)]
  key = "loss" if vw.is_loss_metric(workload) else "accuracy"
  result = {"workload": workload, "optimizer": opt_name, "value": value,
            "kwargs": vw.KFAC_VARIANTS.get(opt_name),
            "parameters": int(model.count_params()), "points": []}
  state = {"step": 0, "cpu": 0.0, "wall": 0.0, "mark": None}
  average = vw.weight_average(opt_name, model, opt)

  def evaluate(train_loss):
    with vw.schedule_free_eval(model, opt, bn_batches, average):
      logs = model.evaluate(val, verbose=0, return_dict=True)
    metric = float(logs[key])
    point = dict(step=state["step"], cpu_s=state["cpu"], wall_s=state["wall"],
                 metric=metric, train_loss=train_loss)
    if isinstance(opt, keras.optimizers.ScheduleFreeAdamW):
      # For the record: the figure at the training point y as well.
      point["metric_at_y"] = float(
          model.evaluate(val, verbose=0, return_dict=True)[key])
    result["points"].append(point)
    print("PROGRESS %s %s%s step %d %s %.4f train cpu %.1f s wall %.1f s" % (
        workload, opt_name, "" if value is None else " %g" % value,
        state["step"], vw.metric_name(workload), metric, state["cpu"],
        state["wall"]), flush=True)

  def out_of_budget():
    return state["cpu"] >= FLAGS.budget_s or (
        FLAGS.max_steps and state["step"] >= FLAGS.max_steps)

  class Clock(keras.callbacks.Callback):
    """Counts training CPU/wall time between the end of the first step and
    the end of the run, less the validations."""

    def on_train_batch_end(self, batch, logs=None):
      if average is not None:  # counted in this step's time
        average.update()
      state["step"] += 1
      cpu, wall = time.process_time(), time.perf_counter()
      if state["mark"] is None:  # the end of the first (tracing) step
        result["first_step_cpu_s"] = cpu - state["start"][0]
        result["first_step_wall_s"] = wall - state["start"][1]
      else:
        state["cpu"] += cpu - state["mark"][0]
        state["wall"] += wall - state["mark"][1]
      state["mark"] = (cpu, wall)
      rate = vw.linear_decay(opt_name, value, state["cpu"], FLAGS.budget_s)
      if rate is not None:  # kfac_minibatch_linear's schedule
        opt.learning_rate = rate
      loss = float((logs or {}).get("loss", 0.0))
      if not math.isfinite(loss):
        result["diverged_at_step"] = state["step"]
        self.model.stop_training = True
      if out_of_budget():
        self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
      cpu, wall = time.process_time(), time.perf_counter()
      state["cpu"] += cpu - state["mark"][0]
      state["wall"] += wall - state["mark"][1]
      loss = float((logs or {}).get("loss", float("nan")))
      evaluate(loss)
      if out_of_budget() or (_finite(FLAGS.stop_at) and vw.better(
          workload, result["points"][-1]["metric"], FLAGS.stop_at)):
        self.model.stop_training = True
      state["mark"] = (time.process_time(), time.perf_counter())

  evaluate(None)
  state["start"] = (time.process_time(), time.perf_counter())
  model.fit(train, steps_per_epoch=FLAGS.eval_every, epochs=10 ** 6,
            verbose=0, callbacks=[Clock()])
  metrics = [p["metric"] for p in result["points"]]
  finite = [m for m in metrics if math.isfinite(m)]
  pick = min if vw.is_loss_metric(workload) else max
  result.update(
      steps=state["step"], train_cpu_s=state["cpu"],
      train_wall_s=state["wall"],
      ms_per_step_cpu=1e3 * state["cpu"] / max(state["step"] - 1, 1),
      ms_per_step_wall=1e3 * state["wall"] / max(state["step"] - 1, 1),
      final=metrics[-1], best=pick(finite) if finite else float("nan"))
  stats = vw.kfac_statistics_elements(opt)
  if stats is not None:
    result["statistics_elements"] = stats
  noise = getattr(opt, "noise_scale", None)
  if noise is not None and math.isfinite(float(noise)):
    # Kfac: the gradient noise scale it measured (recipe="auto", or
    # asked for with noise_scale_steps).
    result["noise_scale"] = float(noise)
  switched = getattr(opt, "recipe_switched_at", None)
  if switched is not None:  # recipe="auto": the step it switched at
    result["switched_at"] = int(switched)
  return result


# ----------------------------------------------------------------- driver


def seeds():
  """The seeds this run trains with: --seeds, else --seed."""
  return [int(s) for s in FLAGS.seeds] or [FLAGS.seed]


def jobs(tuned):
  """[(workload, optimizer, value, untuned, seed)] in the order they run:
  per seed and workload, the optimizers taking turns (one grid value of
  each in turn)."""
  return [job + (seed,) for seed in seeds() for job in _seed_jobs(tuned)]


def _seed_jobs(tuned):
  out = []
  for workload in FLAGS.workloads:
    rounds = []
    for opt in FLAGS.optimizers:
      if opt in vw.KFAC_VARIANTS:
        values = [(None, False)]
      elif FLAGS.tune:
        values = [(v, False) for v in vw.GRIDS[opt]]
      else:
        best = tuned.get(workload, {}).get(opt)
        values = [(best["learning_rate"], False) if best else
                  (vw.GRIDS[opt][len(vw.GRIDS[opt]) // 2], True)]
      for k, (v, untuned) in enumerate(values):
        rounds.append((k, workload, opt, v, untuned))
    out += [r[1:] for r in sorted(rounds, key=lambda r: r[0])]
  return out


def _spawn(job, lock):
  workload, opt, value, untuned, seed = job
  argv = [sys.executable, os.path.abspath(__file__),
          "--worker=%s,%s%s" % (workload, opt,
                                "" if value is None else ",%r" % value)]
  for name in ("budget_s", "max_steps", "eval_every", "batch_size",
               "train_examples", "val_examples", "threads", "size"):
    argv.append("--%s=%s" % (name, getattr(FLAGS, name)))
  argv.append("--seed=%d" % seed)
  result = dict({"workload": workload, "optimizer": opt, "value": value},
                **vw.worker_result(argv, lock))
  result["untuned"] = untuned
  result["seed"] = seed
  return result


def run_all(job_list):
  """Runs the jobs, FLAGS.parallel at a time, in order; results in order."""
  def report(r):
    return "done %s %s%s%s: %s" % (
        r["workload"], r["optimizer"],
        "" if r.get("value") is None else " %g" % r["value"],
        " seed %d" % r["seed"] if len(seeds()) > 1 else "",
        r.get("error") or "%d steps, %.1f ms/step (CPU), final %.4f, "
        "best %.4f" % (r["steps"], r["ms_per_step_cpu"], r["final"],
                       r["best"]))
  return vw.run_jobs(job_list, _spawn, FLAGS.parallel, report)


def time_to(run, workload, target):
  """(CPU seconds, steps) of the first validation at least as good as the
  target, or None."""
  if run is None or "error" in run or not _finite(target):
    return None
  for p in run["points"]:
    if math.isfinite(p["metric"]) and vw.better(workload, p["metric"],
                                                 target):
      return p["cpu_s"], p["step"]
  return None


def target_of(runs, workload):
  """The best validation figure any peer reached, and the run."""
  peers = [r for r in runs if r["optimizer"] in vw.PEERS and "error" not in r
           and _finite(r["best"])]
  if not peers:
    return float("nan"), None
  pick = min if vw.is_loss_metric(workload) else max
  best = pick(peers, key=lambda r: r["best"])
  return best["best"], best


def label(r):
  if r.get("value") is None:
    return r["optimizer"]
  return "%s %g" % (r["optimizer"], r["value"])


def table(results, workload):
  """The markdown table of one workload."""
  runs = [r for r in results if r["workload"] == workload]
  target, setter = target_of(runs, workload)
  reached = {id(r): time_to(r, workload, target) for r in runs}
  peer_times = [reached[id(r)][0] for r in runs
                if r["optimizer"] in vw.PEERS and reached[id(r)]]
  fastest = min(peer_times) if peer_times else None
  metric = vw.metric_name(workload)
  if setter is None:
    head = ("No peer ran on this workload in this run, so there is no "
            "target: the runs compare by their own figures.")
  else:
    head = "Target = %s %.4f, the best any peer reached in its budget (%s)." % (
        metric, target, label(setter))
  lines = [
      "### %s" % workload, "", head, "",
      "| optimizer | grid value | final %s | best %s | steps | ms/step (CPU)"
      " | CPU s to target | steps to target | time / fastest peer's | first "
      "step CPU s |" % (metric, metric),
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in runs:
    if "error" in r:
      lines.append("| %s | | error: %s | | | | | | | |" % (
          label(r), r["error"][:300].replace("|", "/")))
      continue
    value = "-" if r.get("value") is None else "%g%s" % (
        r["value"], " (untuned)" if r.get("untuned") else "")
    hit = reached[id(r)]
    ratio = "-"
    if hit and fastest:
      ratio = "%.2fx" % (hit[0] / fastest) if fastest > 0 else "-"
    missed = "not reached" if setter is not None else "-"
    lines.append("| %s | %s | %.4f | %.4f | %d | %.1f | %s | %s | %s | %.1f "
                 "|%s" % (
                     r["optimizer"], value, r["final"], r["best"], r["steps"],
                     r["ms_per_step_cpu"],
                     "%.1f" % hit[0] if hit else missed,
                     "%d" % hit[1] if hit else missed, ratio,
                     r["first_step_cpu_s"],
                     " diverged at step %d" % r["diverged_at_step"]
                     if "diverged_at_step" in r else ""))
  noise = [r for r in runs
           if math.isfinite(r.get("noise_scale", float("nan")))]
  if noise:
    lines.append("")
    lines.append(
        "Gradient noise scale B_simple as K-FAC measured it at the end of "
        "each run that measured it (its first 5 steps, then one in 10 "
        "with recipe='auto'; batch %d): %s." % (FLAGS.batch_size, ", ".join(
            "%s %.4g" % (label(r), r["noise_scale"]) for r in noise)))
  switched = [r for r in runs if "switched_at" in r]
  if switched:
    lines.append("")
    lines.append("recipe='auto' switched to the minibatch recipe: %s." % (
        ", ".join("%s at step %d" % (r["optimizer"], r["switched_at"])
                  if r["switched_at"] >= 0 else "%s never (%d steps)" % (
                      r["optimizer"], r["steps"]) for r in switched)))
  for r in runs:
    ys = [p["metric_at_y"] for p in r.get("points", ()) if "metric_at_y" in p]
    if ys:
      pick = min if vw.is_loss_metric(workload) else max
      lines.append("")
      lines.append(
          "%s evaluated at its training point y instead of its averaged "
          "point x (for the record): final %.4f, best %.4f." % (
              label(r), ys[-1], pick(ys)))
  return "\n".join(lines) + "\n"


def tuning_table(tuned_file, workloads, optimizers):
  """Where each learning rate of this run came from: per (workload,
  optimizer) of the run that takes one, the value, its grid and the tuning
  pass that chose it ("untuned": the file has none, the grid's middle ran);
  then those passes (date, budget, command, note) from the --tuned file."""
  best = tuned_file.get("best", {})
  passes = tuned_file.get("passes", [])
  lines = ["| workload | optimizer | learning rate | grid | tuning pass |",
           "|---|---|---:|---|---:|"]
  used = set()
  for workload in workloads:
    for opt in optimizers:
      if opt not in vw.GRIDS:
        continue
      grid = ", ".join("%g" % v for v in vw.GRIDS[opt])
      entry = best.get(workload, {}).get(opt)
      if entry is None:
        lines.append("| %s | %s | %g | %s | untuned |" % (
            workload, opt, vw.GRIDS[opt][1], grid))
        continue
      used.add(entry.get("pass"))
      lines.append("| %s | %s | %g | %s | %s |" % (
          workload, opt, entry["learning_rate"], grid, entry.get("pass", "?")))
  lines += ["", "| tuning pass | date | budget (training CPU s) | command "
            "| note |", "|---:|---|---:|---|---|"]
  for k, p in enumerate(passes):
    if k in used:
      lines.append("| %d | %s | %g | `%s` | %s |" % (
          k, str(p.get("date", "?"))[:10], p.get("budget_s", float("nan")),
          p.get("command", "?"), p.get("note", "")))
  return "\n".join(lines) + "\n"


def summary_table(results, workloads):
  """One row per workload: the target and the peer that set it, K-FAC's
  (the default recipe, `kfac`) best figure and time to the target, the
  fastest peer's, and the CPU cost of a step against the peers'."""
  lines = [
      "| workload | target (set by) | kfac best | kfac CPU s to target | "
      "fastest peer to target | kfac time / fastest peer's | kfac ms/step "
      "/ peers' median |",
      "|---|---|---:|---:|---|---:|---:|"]
  for workload in workloads:
    runs = [r for r in results if r["workload"] == workload
            and "error" not in r]
    target, setter = target_of(runs, workload)
    kfac = next((r for r in runs if r["optimizer"] == "kfac"), None)
    peers = [r for r in runs if r["optimizer"] in vw.PEERS]
    if kfac is None or not peers:
      continue
    hits = [(time_to(r, workload, target), r) for r in peers]
    hits = [(h[0], r) for h, r in hits if h]
    fastest = min(hits, key=lambda h: h[0]) if hits else None
    mine = time_to(kfac, workload, target)
    costs = sorted(r["ms_per_step_cpu"] for r in peers)
    median = costs[len(costs) // 2] if len(costs) % 2 else 0.5 * (
        costs[len(costs) // 2 - 1] + costs[len(costs) // 2])
    lines.append("| %s | %s %.4f (%s) | %.4f | %s | %s | %s | %.1fx |" % (
        workload, vw.metric_name(workload), target,
        setter["optimizer"] if setter else "-", kfac["best"],
        "%.1f" % mine[0] if mine else "not reached",
        "%s, %.1f s" % (fastest[1]["optimizer"], fastest[0])
        if fastest else "-",
        "**%.2fx**" % (mine[0] / fastest[0]) if mine and fastest and
        fastest[0] > 0 else "-",
        kfac["ms_per_step_cpu"] / median))
  return "\n".join(lines)


def machine_line():
  cpu = machine.cpu_name()
  import keras
  import tensorflow as tf
  return ("%s, %d cores, %s, TF %s, Keras %s, load average %.2f at start; "
          "times are the worker's CPU seconds with TensorFlow pinned to %d "
          "thread(s), %d worker(s) at once" % (
              cpu, os.cpu_count() or 0, platform.platform(), tf.__version__,
              keras.__version__, os.getloadavg()[0], FLAGS.threads,
              FLAGS.parallel))


def plot(results, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  workloads = [w for w in FLAGS.workloads
               if any(r["workload"] == w and "points" in r for r in results)]
  if not workloads:
    return
  fig, axes = plt.subplots(2, len(workloads), squeeze=False,
                           figsize=(4.5 * len(workloads), 7))
  for col, workload in enumerate(workloads):
    runs = [r for r in results if r["workload"] == workload and "points" in r]
    target, _ = target_of(runs, workload)
    for row, (xkey, xlabel) in enumerate((("cpu_s", "training CPU seconds"),
                                          ("step", "steps"))):
      ax = axes[row][col]
      for r in runs:
        pts = r["points"]
        style = "-" if r["optimizer"] in vw.KFAC_VARIANTS else "--"
        ax.plot([p[xkey] for p in pts], [p["metric"] for p in pts], style,
                marker=".", label=label(r))
      if _finite(target):
        ax.axhline(target, color="gray", lw=0.8, ls=":")
      ax.set_title(workload)
      ax.set_xlabel(xlabel)
      ax.set_ylabel(vw.metric_name(workload))
      if not vw.is_loss_metric(workload) and _finite(target):
        ax.set_ylim(max(0.0, target - 0.25), min(1.0, target + 0.05))
      ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def _seed_of(data):
  """The seed of a results file's runs: recorded, or its command's --seed
  (files written before runs recorded it), or the default 0."""
  if "seed" in data:
    return int(data["seed"])
  for word in data.get("command", "").split():
    if word.startswith("--seed="):
      return int(word.split("=", 1)[1])
  return 0


def added_results(paths, tuned):
  """The runs of earlier results files (--add_results), each marked with
  its seed: of a --tune run's file, per (workload, optimizer) the run at
  the value --tuned holds for it (the grid's best when --tuned has
  none)."""
  out = []
  for path in paths:
    with open(path) as f:
      data = json.load(f)
    runs = [r for r in data["runs"] if r["workload"] in FLAGS.workloads]
    for r in runs:
      r.setdefault("seed", _seed_of(data))
      r["from"] = path
    best = tuned_values(runs)
    for r in runs:
      # A grid is one (workload, optimizer) at one seed: a file of several
      # seeds holds one run of each per seed.
      peers = [q for q in runs if (q["workload"], q["optimizer"], q["seed"])
               == (r["workload"], r["optimizer"], r["seed"])]
      if len(peers) == 1:
        out.append(r)
        continue
      entry = tuned.get(r["workload"], {}).get(r["optimizer"]) or best.get(
          r["workload"], {}).get(r["optimizer"])
      if entry and r.get("value") == entry["learning_rate"]:
        r["untuned"] = False
        out.append(r)
  return out


def added_sources(paths):
  """A line per --add_results file: its command and date (empty without
  any)."""
  lines = []
  for path in paths:
    with open(path) as f:
      data = json.load(f)
    lines.append("Runs from `%s`: `%s`, %s, %s.\n\n" % (
        os.path.relpath(path), data.get("command", "?"),
        data.get("date", "?")[:10], data.get("machine", "?")))
  return "".join(lines)


def _median(values):
  values = sorted(values)
  n = len(values)
  if not n:
    return float("nan")
  return 0.5 * (values[(n - 1) // 2] + values[n // 2])


def seed_summary(results, workload):
  """The markdown summary of one workload across seeds: per optimizer its
  best figure and its time to that seed's target over that seed's fastest
  peer's, per seed, with the median and range; the step's CPU and wall
  milliseconds (median over seeds) and the CPU ones over Adam's."""
  runs = [r for r in results if r["workload"] == workload and "error" not in r]
  seed_list = sorted({r["seed"] for r in runs})
  per_seed = {}
  for seed in seed_list:
    mine = [r for r in runs if r["seed"] == seed]
    target, setter = target_of(mine, workload)
    times = {}
    for r in mine:
      hit = time_to(r, workload, target)
      times[(r["optimizer"], r.get("value"))] = hit[0] if hit else None
    peer_times = [t for (o, _), t in times.items()
                  if o in vw.PEERS and t is not None]
    per_seed[seed] = dict(target=target, setter=setter, times=times,
                          fastest=min(peer_times) if peer_times else None)
  metric = vw.metric_name(workload)
  lines = ["### %s: %d seed(s) (%s)" % (workload, len(seed_list), ", ".join(
      str(s) for s in seed_list)), "",
           "Targets (the best %s any peer reached in its budget, per seed): "
           "%s." % (metric, "; ".join(
               "seed %d %.4f (%s)" % (seed, per_seed[seed]["target"],
                                      label(per_seed[seed]["setter"])
                                      if per_seed[seed]["setter"] else "-")
               for seed in seed_list)), "",
           "| optimizer | value | best %s per seed | time to target / fastest "
           "peer's, per seed | median | reached | ms/step CPU (median) | ms/"
           "step wall (median) | CPU ms/step / Adam's (median) |" % metric,
           "|---|---:|---|---|---:|---:|---:|---:|---:|"]
  adam_ms = {r["seed"]: r["ms_per_step_cpu"] for r in runs
             if r["optimizer"] == "adam"}
  keys = []
  for r in runs:
    key = r["optimizer"]
    if key not in keys:
      keys.append(key)
  summary = {}
  for opt in keys:
    mine = {r["seed"]: r for r in runs if r["optimizer"] == opt}
    ratios, cells, bests = [], [], []
    for seed in seed_list:
      r = mine.get(seed)
      if r is None:
        cells.append("-")
        bests.append("-")
        continue
      bests.append("%.4f" % r["best"])
      t = per_seed[seed]["times"].get((opt, r.get("value")))
      fastest = per_seed[seed]["fastest"]
      if t is None or not fastest:
        cells.append("not reached")
        ratios.append(float("inf"))
      else:
        ratios.append(t / fastest)
        cells.append("%.2fx" % (t / fastest))
    values = sorted({r.get("value") for r in mine.values()},
                    key=lambda v: -1 if v is None else v)
    value = ", ".join("-" if v is None else "%g" % v for v in values)
    if any(r.get("untuned") for r in mine.values()):
      value += " (untuned)"
    med = _median(ratios)
    reached = sum(1 for x in ratios if math.isfinite(x))
    ms_cpu = _median([r["ms_per_step_cpu"] for r in mine.values()])
    ms_wall = _median([r["ms_per_step_wall"] for r in mine.values()])
    vs_adam = _median([r["ms_per_step_cpu"] / adam_ms[seed]
                       for seed, r in mine.items() if seed in adam_ms])
    summary[opt] = dict(ratios=ratios, median=med, reached=reached,
                        ms_cpu=ms_cpu, ms_wall=ms_wall, vs_adam=vs_adam)
    lines.append("| %s | %s | %s | %s | %s | %d of %d | %.1f | %.1f | %s |" % (
        opt, value, " / ".join(bests), " / ".join(cells),
        "%.2fx" % med if math.isfinite(med) else "not reached",
        reached, len(ratios), ms_cpu, ms_wall,
        "%.2fx" % vs_adam if math.isfinite(vs_adam) else "-"))
  return "\n".join(lines) + "\n", summary


def plot_seeds(summaries, path):
  """Time to target over the fastest peer's, one dot per seed, a panel per
  workload (not reached: drawn at the top, hollow)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  workloads = [w for w in FLAGS.workloads if summaries.get(w)]
  if not workloads:
    return
  fig, axes = plt.subplots(1, len(workloads), squeeze=False,
                           figsize=(4.5 * len(workloads), 3.6))
  for col, workload in enumerate(workloads):
    ax = axes[0][col]
    names = list(summaries[workload])
    finite = [x for n in names for x in summaries[workload][n]["ratios"]
              if math.isfinite(x)]
    top = max(finite + [1.0]) * 1.15
    for i, name in enumerate(names):
      for x in summaries[workload][name]["ratios"]:
        if math.isfinite(x):
          ax.plot(i, x, "o", color="C0" if name.startswith("kfac") else "C1")
        else:
          ax.plot(i, top, "o", mfc="none",
                  color="C0" if name.startswith("kfac") else "C1")
    ax.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax.axhline(0.65, color="green", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("time to target / fastest peer's")
    ax.set_title("%s (hollow at top: not reached)" % workload, fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def tuned_values(results):
  """{workload: {optimizer: {learning_rate, best}}}: each peer's grid value
  with the best validation figure."""
  out = {}
  for r in results:
    if "error" in r or r["optimizer"] not in vw.PEERS + vw.TUNED_KFAC or (
        not _finite(r["best"])):
      continue
    cur = out.setdefault(r["workload"], {}).get(r["optimizer"])
    if cur is None or (vw.better(r["workload"], r["best"], cur["best"]) and
                       r["best"] != cur["best"]):
      out[r["workload"]][r["optimizer"]] = {"learning_rate": r["value"],
                                            "best": r["best"]}
  return out


def rerender(path):
  """Rewrites `path`'s "tables" (and its .md's tables) from its runs, as
  main writes them; the runs, the command and the date stay."""
  with open(path) as f:
    data = json.load(f)
  results, added = data["runs"], data.get("added_runs", [])
  first_seed = data.get("seed", 0)
  workloads = list(dict.fromkeys(r["workload"] for r in results + added))
  FLAGS.workloads = workloads
  first = [r for r in results + added if r.get("seed", first_seed) ==
           first_seed]
  tables = {"summary": summary_table(first, workloads)}
  tables.update({w: table(first, w) for w in workloads})
  if "tuning" in data.get("tables", {}):
    tables["tuning"] = data["tables"]["tuning"]  # from the tuned file then
  if "across_seeds" in data.get("tables", {}):
    tables["across_seeds"] = data["tables"]["across_seeds"]
  data["tables"] = tables
  data["rerendered"] = " ".join(["keras_validation.py"] + sys.argv[1:])
  with open(path, "w") as f:
    json.dump(data, f, indent=1)
  if len(data.get("seeds", [first_seed])) == 1:
    with open(path[:-len(".json")] + ".md", "w") as f:
      f.write(data["head"] + tables["summary"] + "\n\n" + "\n".join(
          table(results + added, w) for w in workloads))
  print("rerendered %s: %s" % (path, ", ".join(sorted(tables))))


def main(argv):
  del argv
  if FLAGS.rerender:
    rerender(FLAGS.rerender)
    return
  if FLAGS.worker:
    parts = FLAGS.worker.split(",")
    value = float(parts[2]) if len(parts) > 2 else None
    print("RESULT " + json.dumps(run_worker(parts[0], parts[1], value)),
          flush=True)
    return
  for w in FLAGS.workloads:
    if w not in vw.WORKLOADS:
      raise app.UsageError("unknown workload %r; one of %s" % (
          w, ", ".join(vw.WORKLOADS)))
  for o in FLAGS.optimizers:
    if o not in vw.optimizer_names():
      raise app.UsageError("unknown optimizer %r; one of %s" % (
          o, ", ".join(vw.optimizer_names())))
  if FLAGS.tune and (len(seeds()) > 1 or FLAGS.add_results):
    raise app.UsageError("--tune tunes at one seed (--seed); --seeds and "
                         "--add_results are for the runs with its values")
  tuned = {}
  tuned_file = {}
  if not FLAGS.tune and os.path.exists(FLAGS.tuned):
    with open(FLAGS.tuned) as f:
      tuned_file = json.load(f)
    tuned = tuned_file["best"]
  added = added_results(FLAGS.add_results, tuned)
  clash = sorted({(r["seed"], r["workload"], r["optimizer"]) for r in added}
                 & {(s, w, o) for s in seeds() for w in FLAGS.workloads
                    for o in FLAGS.optimizers})
  if clash:
    raise app.UsageError(
        "--add_results has runs that this run trains too: %s" % ", ".join(
            "seed %d %s %s" % c for c in clash))
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  machine = machine_line()
  started = datetime.datetime.now(datetime.timezone.utc)
  print("keras_validation: %s" % machine, flush=True)
  results = run_all(jobs(tuned))
  command = " ".join(["keras_validation.py"] + sys.argv[1:])
  head = ("Keras validation benchmark, %s UTC, %s; `%s`; budget %g training "
          "CPU s per run%s, validation every %d steps (not counted), batch "
          "%d, %d training / %d validation images, size %s\n\n" % (
              started.strftime("%Y-%m-%d %H:%M"), machine, command,
              FLAGS.budget_s, " or %d steps" % FLAGS.max_steps
              if FLAGS.max_steps else "", FLAGS.eval_every, FLAGS.batch_size,
              FLAGS.train_examples, FLAGS.val_examples, FLAGS.size))
  stem = "keras_validation_tune" if FLAGS.tune else "keras_validation"
  all_seeds = sorted(set(seeds()) | {r["seed"] for r in added})
  first = [r for r in results + added if r.get("seed", seeds()[0]) ==
           seeds()[0]]
  # The markdown that doc_tables.py renders into the docs: the summary (the
  # first seed's runs) and each workload's table.
  tables = {"summary": summary_table(first, FLAGS.workloads)}
  tables.update({w: table(first, w) for w in FLAGS.workloads})
  if not FLAGS.tune:
    tables["tuning"] = tuning_table(tuned_file, FLAGS.workloads,
                                    FLAGS.optimizers)
  both = results + added
  parts, summaries = [], {}
  if len(all_seeds) > 1:
    # Across seeds: each workload's summary (its .md section, rendered in
    # the docs as "across_seeds").
    for w in FLAGS.workloads:
      part, summaries[w] = seed_summary(both, w)
      parts.append(part)
    tables["across_seeds"] = (added_sources(FLAGS.add_results) +
                              "\n".join(parts)).strip()
  with open(os.path.join(FLAGS.output_dir, stem + ".json"), "w") as f:
    json.dump({"machine": machine, "command": command, "head": head,
               "date": started.isoformat(), "seed": seeds()[0],
               "seeds": all_seeds, "runs": results, "added_runs": added,
               "tables": tables},
              f, indent=1)
  if FLAGS.tune:
    # Merged into the file: the pairs tuned here replace theirs, the others
    # stay (each pair records the run that tuned it).
    tuned_file = {"best": {}, "passes": []}
    if os.path.exists(FLAGS.tuned):
      with open(FLAGS.tuned) as f:
        tuned_file = json.load(f)
    tuned_file.setdefault("passes", []).append(
        {"date": started.isoformat(), "machine": machine, "command": command,
         "budget_s": FLAGS.budget_s})
    for workload, best in tuned_values(results).items():
      for opt, entry in best.items():
        entry["pass"] = len(tuned_file["passes"]) - 1
        tuned_file["best"].setdefault(workload, {})[opt] = entry
    tuned_file["grids"] = vw.GRIDS
    with open(FLAGS.tuned, "w") as f:
      json.dump(tuned_file, f, indent=1, sort_keys=True)
  if len(all_seeds) == 1:
    text = head + tables["summary"] + "\n\n" + "\n".join(
        table(results + added, w) for w in FLAGS.workloads)
  else:
    text = (head + "## Across seeds\n\nSeeds %s%s; each seed's target "
            "and fastest peer are that seed's own.\n\n" % (
                ", ".join(str(s) for s in all_seeds),
                " (seed(s) %s from %s)" % (
                    ", ".join(str(s) for s in sorted({r["seed"]
                                                      for r in added})),
                    ", ".join(FLAGS.add_results)) if added else "") +
            "\n".join(parts))
    for seed in all_seeds:
      text += "\n## Seed %d\n\n" % seed + "\n".join(
          table([r for r in both if r["seed"] == seed], w)
          for w in FLAGS.workloads)
    plot_seeds(summaries, os.path.join(FLAGS.output_dir,
                                       stem + "_seeds.png"))
  with open(os.path.join(FLAGS.output_dir, stem + ".md"), "w") as f:
    f.write(text)
  plot([r for r in results + added if r["seed"] == seeds()[0]],
       os.path.join(FLAGS.output_dir, stem + ".png"))
  print(text, flush=True)
  failed = [r for r in results if "error" in r]
  if failed:
    sys.exit("keras_validation: %d run(s) failed" % len(failed))


if __name__ == "__main__":
  app.run(main)
