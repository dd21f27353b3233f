r"""Steps to a validation target against the global batch size (issue 54).

On N data-parallel workers a step takes about the same time whatever N, so
at a large global batch the number of steps decides who finishes first.
This program measures it on the validation workloads of keras_validation.py
(val_workloads.py: the same models, data, losses and evaluation): for each
(workload, global batch B, optimizer, learning rate) one fresh worker
process (keras_validation.py's own worker, one TensorFlow thread) trains
with `model.fit` on the full 60,000 training images for at most
--max_steps * sqrt(256 / B) steps (the step budget shrinks with the batch,
more slowly than the steps a perfectly scaling optimizer needs), evaluating
on the 10,000 test images every 1/--evals of that budget, and stops at
the first validation that reaches the workload's fixed target (TARGETS,
or --targets): its step is the run's steps to target. Steps to target of an optimizer at B: the fewest
over its learning-rate grid at B.

Learning rates: each peer's 3-value grid of val_workloads.GRIDS (the one
keras_validation tunes at batch 256), scaled by sqrt(B / 256) (the
square-root rule for adaptive methods), so that every optimizer is tuned
per batch size on the same small grid; K-FAC's default recipe
(`kfac`: Kfac(model=..., adaptive=True)) chooses its own rate and is run
once per B; the minibatch recipes (val_workloads.TUNED_KFAC) get their
grid scaled the same way.

The critical batch: for each optimizer, the points (B, steps to target) are
fitted with McCandlish et al. (2018)'s S(B) = S_min (1 + B_noise / B)
(least squares in log space, at least 3 batch sizes that reached the
target); B_noise is the batch at which an optimizer needs twice its
fewest steps, the critical batch size.

Outputs in --output_dir: critical_batch.json (every run, every evaluation,
the targets, the fits), critical_batch.md (per workload: steps to target
per batch and optimizer, examples to target, the fit) and
critical_batch.png (steps to target against B, log-log, a line per
optimizer and the fitted curves). --add_results merges earlier files'
runs (a sweep split over several invocations; a (workload, batch,
optimizer, value, seed) run twice is refused).

  python examples/benchmarks/critical_batch.py --workloads=autoencoder \
      --batches=256,1024,4096 --optimizers=kfac,adam,muon
"""

import datetime
import json
import math
import os
import subprocess
import sys

from absl import app
from absl import flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# pylint: disable=g-import-not-at-top,wrong-import-position
from batch_scaling import best_runs
from batch_scaling import fit_critical_batch
import machine
import val_workloads as vw

# The fixed validation target of each workload: a figure the tuned peers
# reach at batch 256 well inside keras_validation's 60 CPU s runs on 20,000
# images (docs/recipe.md, the three-seed tables: CNN 0.87-0.89, ViT
# 0.85-0.86, GRU 0.85-0.87, autoencoder 0.28-0.30), so that it is reached
# at every batch size the step budget allows.
TARGETS = {"cnn": 0.87, "vit": 0.84, "rnn": 0.85, "autoencoder": 0.30}
BASE_BATCH = 256

flags.DEFINE_list("workloads", ["autoencoder"], "Workloads to run.")
flags.DEFINE_list("optimizers", ["kfac", "adam", "muon"],
                  "Optimizers (val_workloads names).")
flags.DEFINE_list("batches", ["256", "512", "1024", "2048", "4096", "8192"],
                  "Global batch sizes.")
flags.DEFINE_list("targets", [], "workload=value overrides of TARGETS.")
flags.DEFINE_integer("max_steps", 2000, "Step budget at batch 256 (scaled "
                     "by sqrt(256 / B) at batch B).")
flags.DEFINE_integer("evals", 40, "Validations per run's step budget.")
flags.DEFINE_integer("train_examples", 60000, "Training images.")
flags.DEFINE_integer("val_examples", 10000, "Validation images.")
flags.DEFINE_integer("threads", 1, "TensorFlow threads per worker.")
flags.DEFINE_integer("parallel", 2, "Workers at once (at most 2).")
flags.DEFINE_enum("size", "full", ["full", "tiny"], "Model sizes.")
flags.DEFINE_integer("seed", 0, "Seed of the weights and batches.")
flags.DEFINE_list("add_results", [], "critical_batch JSON files of earlier "
                  "invocations to merge.")
flags.DEFINE_string("output_dir", "bench_results", "Where to write.")

FLAGS = flags.FLAGS


def targets():
  out = dict(TARGETS)
  for item in FLAGS.targets:
    workload, _, value = item.partition("=")
    if workload not in vw.WORKLOADS or not value:
      raise ValueError("--targets takes workload=value with a workload of "
                       "%s, got %r" % (", ".join(vw.WORKLOADS), item))
    out[workload] = float(value)
  return out


def step_budget(batch):
  """The step budget at `batch`: --max_steps * sqrt(256 / batch)."""
  return max(1, int(round(FLAGS.max_steps * math.sqrt(BASE_BATCH / batch))))


def grid(optimizer, batch):
  """The learning rates `optimizer` is run with at `batch` ([None]: the
  default recipe, which chooses its own)."""
  if optimizer in vw.KFAC_VARIANTS:
    return [None]
  if optimizer not in vw.GRIDS:
    raise ValueError("unknown optimizer %r; one of %s" % (
        optimizer, ", ".join(vw.optimizer_names())))
  scale = math.sqrt(batch / BASE_BATCH)
  return [float("%.4g" % (v * scale)) for v in vw.GRIDS[optimizer]]


def jobs():
  """[(workload, batch, optimizer, value)], small batches first."""
  out = []
  for workload in FLAGS.workloads:
    for batch in sorted(int(b) for b in FLAGS.batches):
      for opt in FLAGS.optimizers:
        out += [(workload, batch, opt, v) for v in grid(opt, batch)]
  return out


def _spawn(job, lock):
  """One run: keras_validation.py's worker with this job's settings."""
  workload, batch, opt, value = job
  budget = step_budget(batch)
  argv = [sys.executable, os.path.join(HERE, "keras_validation.py"),
          "--worker=%s,%s%s" % (workload, opt,
                                "" if value is None else ",%r" % value),
          "--batch_size=%d" % batch, "--max_steps=%d" % budget,
          "--budget_s=1e9", "--eval_every=%d" % max(1, budget // FLAGS.evals),
          "--train_examples=%d" % FLAGS.train_examples,
          "--val_examples=%d" % FLAGS.val_examples,
          "--threads=%d" % FLAGS.threads, "--size=%s" % FLAGS.size,
          "--seed=%d" % FLAGS.seed, "--stop_at=%r" % targets()[workload]]
  result = vw.worker_result(argv, lock)
  result.update(workload=workload, optimizer=opt, value=value, batch=batch,
                step_budget=budget, seed=FLAGS.seed)
  return result


def run_all(job_list):
  """The jobs, FLAGS.parallel at a time, in order; results in order."""
  def report(r):
    return "done %s batch %d %s%s: %s" % (
        r["workload"], r["batch"], r["optimizer"],
        "" if r["value"] is None else " %g" % r["value"],
        r.get("error") or "%d steps, best %.4f, %.1f ms/step (CPU)" % (
            r["steps"], r["best"], r["ms_per_step_cpu"]))
  return vw.run_jobs(job_list, _spawn, FLAGS.parallel, report)


def summary(results, workload, target):
  """(the markdown of one workload, its fits {optimizer: (S_min,
  B_noise)})."""
  best = best_runs(results, workload, target)
  batches = sorted({b for (_, b) in best})
  optimizers = [o for o in FLAGS.optimizers if any(k[0] == o for k in best)]
  optimizers += sorted({o for (o, _) in best} - set(optimizers))
  fits = {}
  lines = [
      "### %s: steps to %s %s %.4g" % (
          workload, vw.metric_name(workload),
          "<=" if vw.is_loss_metric(workload) else ">=", target), "",
      "| optimizer | " + " | ".join("B=%d" % b for b in batches) +
      " | S_min | B_noise (critical batch) |",
      "|---|" + "---:|" * (len(batches) + 2)]
  for opt in optimizers:
    cells, points = [], []
    for b in batches:
      if (opt, b) not in best:
        cells.append("")
        continue
      s, r = best[(opt, b)]
      value = "" if r.get("value") is None else " (lr %g)" % r["value"]
      if "error" in r:
        cells.append("error")
      elif s is None:
        cells.append("> %d%s" % (r["steps"], value))
      else:
        cells.append("%d%s" % (s, value))
        points.append((b, s))
    fit = fit_critical_batch(points)
    if fit:
      fits[opt] = fit
    lines.append("| %s | %s | %s | %s |" % (
        opt, " | ".join(cells), "%.0f" % fit[0] if fit else "-",
        "%.0f" % fit[1] if fit else "-"))
  peers = [o for o in optimizers if o in vw.PEERS]
  if "kfac" in optimizers and peers:
    cells = []
    for b in batches:
      mine = best.get(("kfac", b), (None, None))[0]
      theirs = [(best[(o, b)][0], o) for o in peers
                if best.get((o, b), (None, None))[0]]
      if mine and theirs:
        steps, peer = min(theirs)
        cells.append("%.2fx (%s)" % (mine / float(steps), peer))
      else:
        cells.append("-")
    fit_ratio = ("%.2fx" % (fits["kfac"][1] / max(
        fits[o][1] for o in peers if o in fits))
                 if "kfac" in fits and any(o in fits for o in peers)
                 else "-")
    lines.append("| kfac / best peer | %s | | %s |" % (" | ".join(cells),
                                                      fit_ratio))
  lines.append("")
  lines.append(
      "Each cell: the fewest steps to the target over the optimizer's "
      "learning-rate grid at that batch (its rate in brackets); \"> n\": "
      "not reached in the n-step budget. S_min and B_noise: the fit of "
      "S(B) = S_min (1 + B_noise / B) to the reached cells (3 or more). "
      "kfac / best peer: K-FAC's default recipe's steps over the fewest of "
      "the peers' (which peer), and its critical batch over the largest "
      "of theirs.")
  return "\n".join(lines) + "\n", fits


def plot(results, fits_by_workload, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  workloads = list(fits_by_workload)
  if not workloads:
    return
  fig, axes = plt.subplots(1, len(workloads), squeeze=False,
                           figsize=(5 * len(workloads), 4))
  for col, workload in enumerate(workloads):
    ax = axes[0][col]
    target = targets()[workload]
    best = best_runs(results, workload, target)
    for opt in sorted({o for (o, _) in best}):
      pts = sorted((b, s) for (o, b), (s, _) in best.items()
                   if o == opt and s)
      if not pts:
        continue
      line, = ax.plot([b for b, _ in pts], [s for _, s in pts], "o-",
                      label=opt)
      fit = fits_by_workload[workload].get(opt)
      if fit:
        lo, hi = pts[0][0], pts[-1][0]
        bs = [lo * (hi / lo) ** (k / 50.0) for k in range(51)]
        ax.plot(bs, [fit[0] * (1 + fit[1] / b) for b in bs], ":",
                color=line.get_color(), lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("global batch size")
    ax.set_ylabel("steps to target")
    ax.set_title("%s (%s %g)" % (workload, vw.metric_name(workload), target))
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def _key(r):
  return (r["workload"], r["batch"], r["optimizer"], r.get("value"),
          r.get("seed", 0))


def added_runs(paths, job_list):
  """The runs of the files in `paths`, checked before anything trains: a
  run present twice (in two files, or in a file and this invocation's
  jobs) is an error naming it."""
  seen = {(w, b, o, v, FLAGS.seed): "this run"
          for w, b, o, v in job_list}
  out = []
  for path in paths:
    with open(path) as f:
      data = json.load(f)
    for r in data["runs"]:
      if _key(r) in seen:
        raise ValueError("%s holds the run %r, which %s has too" % (
            path, _key(r), seen[_key(r)]))
      seen[_key(r)] = path
      out.append(r)
  return out


def main(argv):
  del argv
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  goal = targets()
  job_list = jobs()
  added = added_runs(FLAGS.add_results, job_list)
  results = run_all(job_list) + added
  sections, fits, tables = [], {}, {}
  workloads = [w for w in vw.WORKLOADS if any(r["workload"] == w
                                              for r in results)]
  for workload in workloads:
    text, fits[workload] = summary(results, workload, goal[workload])
    sections.append(text)
    tables[workload] = text
  budgets = sorted({(r["workload"], int(round(
      r["step_budget"] * math.sqrt(r["batch"] / BASE_BATCH))))
                    for r in results if "step_budget" in r})
  header = ("Steps to a fixed validation target against the global batch "
            "(critical_batch.py; %s; %d training images, seed %d, step "
            "budget at batch 256 %s, scaled by sqrt(256 / B); %s).\n\n" % (
                machine.cpu_name(), FLAGS.train_examples, FLAGS.seed,
                ", ".join("%s %d" % b for b in budgets),
                datetime.date.today().isoformat()))
  with open(os.path.join(FLAGS.output_dir, "critical_batch.md"), "w") as f:
    f.write(header + "\n".join(sections))
  with open(os.path.join(FLAGS.output_dir, "critical_batch.json"), "w") as f:
    json.dump({"command": " ".join(sys.argv), "targets": goal,
               "fits": {w: {o: {"s_min": v[0], "b_noise": v[1]}
                            for o, v in fw.items()}
                        for w, fw in fits.items()},
               # The markdown of each workload (doc_tables.py renders the
               # docs' tables from it).
               "tables": tables, "runs": results}, f, indent=1)
  plot(results, fits, os.path.join(FLAGS.output_dir, "critical_batch.png"))
  print(header + "\n".join(sections))


if __name__ == "__main__":
  app.run(main)
