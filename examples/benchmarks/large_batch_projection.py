r"""Time to target on 8 to 256 data-parallel workers, projected from measured
steps, measured step times and a stated network (issue 54).

For one global batch B (--global_batch) and each workload and optimizer of a
critical_batch.py results file that reached the workload's target at B:

  steps S      the fewest steps to the target at B over the optimizer's
               learning-rate grid (critical_batch.py, measured);
  compute      the training CPU time of one step at the per-worker batch
               B / W, measured here on one TensorFlow thread
               (keras_validation.py's worker: the same model, optimizer and
               learning rate, --time_steps steps after the first), divided
               by --compute_speedup (1: this machine's core is the worker);
  all-reduce   the bytes each worker sends per step under a strategy: the
               gradients (float32, one collective) and, for K-FAC, its factor
               statistics (upper triangles, one collective at each of their
               updates: every 2 steps in the default recipe) and the
               quadratic model's scalars (one more collective), each costing
               batch_scaling.ring_allreduce_s at --bandwidth_gbit and
               --latency_us per message;

  projected time = S * (compute + all-reduce), on W = --workers.

The compute times are cached in --step_times (JSON; entries missing there
are measured and added), so the projection reruns in seconds. The
localhost check of the all-reduce model is multiworker_step_time.py's.

  python examples/benchmarks/large_batch_projection.py \
      --critical_batch=examples/benchmarks/results/critical_batch.json
"""

import datetime
import json
import math
import os
import sys

from absl import app
from absl import flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# pylint: disable=g-import-not-at-top,wrong-import-position
import batch_scaling
import machine
import val_workloads as vw

flags.DEFINE_string("critical_batch", os.path.join(
    HERE, "results", "critical_batch.json"), "critical_batch.py's results.")
flags.DEFINE_integer("global_batch", 4096, "The global batch B.")
# K-FAC's default recipe, its best large-batch lever (docs/large_batch.md)
# and the peers.
flags.DEFINE_list("optimizers", ["kfac", "kfac_damping_1e-2_invert1_decay80"]
                  + list(vw.PEERS), "Optimizers projected (those of them "
                  "with a run at B that reached the target).")
flags.DEFINE_list("workers", ["8", "16", "32", "64", "128", "256"],
                  "Worker counts W (B / W examples per worker).")
flags.DEFINE_float("bandwidth_gbit", 25.0, "Network bandwidth per worker, "
                   "Gbit/s.")
flags.DEFINE_float("latency_us", 10.0, "Latency per message, microseconds.")
flags.DEFINE_list("compute_speedup", ["1", "10"], "Worker compute this many "
                  "times faster than one core of this machine.")
flags.DEFINE_integer("time_steps", 30, "Steps timed per step-time "
                     "measurement (after the first).")
flags.DEFINE_integer("train_examples", 20000, "Training images of a "
                     "step-time measurement.")
flags.DEFINE_integer("parallel", 1, "Step-time measurements at once.")
flags.DEFINE_string("step_times", os.path.join(
    HERE, "results", "step_times.json"), "Cache of measured step times.")
flags.DEFINE_enum("size", "full", ["full", "tiny"], "Model sizes.")
flags.DEFINE_string("output_dir", "bench_results", "Where to write.")

FLAGS = flags.FLAGS
KFAC_COLLECTIVES = 3   # gradients, statistics, quadratic-model scalars


def _key(workload, optimizer, value, batch):
  return "%s/%s/%s/%d" % (workload, optimizer,
                          "default" if value is None else "%.6g" % value,
                          batch)


def chosen_runs(data, batch):
  """[(workload, optimizer, steps, run)] of the runs at `batch` that
  reached their workload's target in the fewest steps of their grid."""
  out = []
  for workload, target in sorted(data["targets"].items()):
    best = batch_scaling.best_runs(data["runs"], workload, target)
    for (opt, b), (steps, run) in sorted(best.items()):
      if b == batch and steps and opt in FLAGS.optimizers:
        out.append((workload, opt, steps, run))
  return out


def _measure(job, lock):
  workload, opt, value, batch = job
  argv = [sys.executable, os.path.join(HERE, "keras_validation.py"),
          "--worker=%s,%s%s" % (workload, opt,
                                "" if value is None else ",%r" % value),
          "--batch_size=%d" % batch, "--max_steps=%d" % (FLAGS.time_steps + 1),
          "--budget_s=1e9", "--eval_every=%d" % (FLAGS.time_steps + 1),
          "--train_examples=%d" % max(FLAGS.train_examples, batch),
          "--val_examples=500", "--threads=1", "--size=%s" % FLAGS.size]
  r = vw.worker_result(argv, lock)
  if "error" in r:
    raise RuntimeError("step time of %s: %s" % (_key(*job), r["error"]))
  return dict(ms_per_step_cpu=r["ms_per_step_cpu"],
              ms_per_step_wall=r["ms_per_step_wall"],
              statistics_elements=r.get("statistics_elements", 0),
              parameters=r["parameters"], cpu=machine.cpu_name())


def step_times(chosen, workers):
  """{key: measurement} for every (run, per-worker batch), measuring the
  ones the cache lacks."""
  cache = {}
  if os.path.exists(FLAGS.step_times):
    with open(FLAGS.step_times) as f:
      cache = json.load(f)
  jobs = []
  for workload, opt, _, run in chosen:
    for w in workers:
      job = (workload, opt, run["value"], FLAGS.global_batch // w)
      if _key(*job) not in cache and job not in jobs:
        jobs.append(job)
  if jobs:
    print("measuring %d step times" % len(jobs), flush=True)
    results = vw.run_jobs(jobs, _measure, FLAGS.parallel,
                          lambda r: "%.1f ms/step (CPU)" % r["ms_per_step_cpu"])
    for job, r in zip(jobs, results):
      cache[_key(*job)] = r
    with open(FLAGS.step_times, "w") as f:
      json.dump(cache, f, indent=1, sort_keys=True)
  return cache


def project(chosen, times, workers, speedup):
  """[{workload, optimizer, steps, by_w: {W: (seconds, compute s, comm s,
  MB per step)}}]."""
  from kfac.python.ops.adaptive import recipe  # pylint: disable=g-import-not-at-top
  bandwidth = FLAGS.bandwidth_gbit * 1e9 / 8.0
  latency = FLAGS.latency_us * 1e-6
  rows = []
  for workload, opt, steps, run in chosen:
    by_w = {}
    for w in workers:
      t = times[_key(workload, opt, run["value"], FLAGS.global_batch // w)]
      compute = t["ms_per_step_cpu"] / 1e3 / speedup
      grads = 4.0 * t["parameters"]
      comm = batch_scaling.ring_allreduce_s(grads, w, latency, bandwidth)
      sent = grads
      if opt in vw.KFAC_VARIANTS:
        # The statistics are all-reduced at their updates, every
        # cov_update_every steps (the recipe's default unless the variant
        # sets it): per step, that share of one all-reduce.
        every = vw.KFAC_VARIANTS[opt].get("cov_update_every",
                                          recipe.COV_UPDATE_EVERY)
        stats = 4.0 * t["statistics_elements"]
        sent += stats / every
        comm += batch_scaling.ring_allreduce_s(
            stats, w, latency, bandwidth) / every
        comm += batch_scaling.ring_allreduce_s(
            4.0 * 8, w, latency, bandwidth) * (KFAC_COLLECTIVES - 2)
      by_w[w] = (steps * (compute + comm), compute, comm, sent / 1e6)
    rows.append(dict(workload=workload, optimizer=opt, steps=steps,
                     value=run["value"], by_w=by_w))
  return rows


def table(rows, workers, speedup):
  lines = ["#### compute %sx this machine's core" % speedup, "",
           "| workload | optimizer | steps at B=%d | MB sent per worker per "
           "step | " % FLAGS.global_batch +
           " | ".join("W=%d" % w for w in workers) + " |",
           "|---|---|---:|---:|" + "---:|" * len(workers)]
  for r in rows:
    lines.append("| %s | %s | %d | %.2f | " % (
        r["workload"], r["optimizer"] + (
            "" if r["value"] is None else " (lr %.3g)" % r["value"]),
        r["steps"], r["by_w"][workers[0]][3]) + " | ".join(
            "%.1f s (%.0f%% comm)" % (r["by_w"][w][0], 100.0 * r["by_w"][w][2]
                                     / (r["by_w"][w][1] + r["by_w"][w][2]))
            for w in workers) + " |")
  for workload in sorted({r["workload"] for r in rows}):
    mine = [r for r in rows if r["workload"] == workload]
    kfac = [r for r in mine if r["optimizer"] == "kfac"]
    peers = [r for r in mine if r["optimizer"] in vw.PEERS]
    if kfac and peers:
      cells = []
      for w in workers:
        best = min(peers, key=lambda r, w=w: r["by_w"][w][0])
        cells.append("%.2fx (%s)" % (kfac[0]["by_w"][w][0] /
                                     best["by_w"][w][0], best["optimizer"]))
      lines.append("| %s | kfac / best peer | | | " % workload +
                   " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(rows, workers, speedups, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  names = sorted({r["workload"] for r in rows[speedups[0]]})
  fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4),
                           squeeze=False)
  for ax, name in zip(axes[0], names):
    for speedup, style in zip(speedups, ("o-", "x--", "s:")):
      for r in rows[speedup]:
        if r["workload"] == name:
          ax.plot(workers, [r["by_w"][w][0] for w in workers], style,
                  label="%s, compute %sx" % (r["optimizer"], speedup))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers (global batch %d)" % FLAGS.global_batch)
    ax.set_ylabel("projected seconds to target")
    ax.set_title(name)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  with open(FLAGS.critical_batch) as f:
    data = json.load(f)
  workers = [int(w) for w in FLAGS.workers]
  bad = [w for w in workers if w < 1 or FLAGS.global_batch % w]
  if bad:
    raise ValueError("--workers must divide --global_batch=%d; got %s" % (
        FLAGS.global_batch, bad))
  chosen = chosen_runs(data, FLAGS.global_batch)
  if not chosen:
    raise ValueError("no run of %s reached its target at batch %d" % (
        FLAGS.critical_batch, FLAGS.global_batch))
  times = step_times(chosen, workers)
  speedups = [float(s) for s in FLAGS.compute_speedup]
  rows = {s: project(chosen, times, workers, s) for s in speedups}
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  text = ["Projected time to each workload's target at global batch %d "
          "(%s; steps from %s; compute: one-thread CPU step times on %s; "
          "ring all-reduce at %g Gbit/s, %g us per message; %s)" % (
              FLAGS.global_batch, "W workers, B / W examples each",
              os.path.basename(FLAGS.critical_batch), machine.cpu_name(),
              FLAGS.bandwidth_gbit, FLAGS.latency_us,
              datetime.date.today().isoformat()), ""]
  tables = {}
  for s in speedups:
    tables["compute_%gx" % s] = table(rows[s], workers, "%g" % s)
    text += [tables["compute_%gx" % s], ""]
  with open(os.path.join(FLAGS.output_dir, "large_batch_projection.md"),
            "w") as f:
    f.write("\n".join(text))
  with open(os.path.join(FLAGS.output_dir, "large_batch_projection.json"),
            "w") as f:
    json.dump(dict(
        global_batch=FLAGS.global_batch, workers=workers,
        bandwidth_gbit=FLAGS.bandwidth_gbit, latency_us=FLAGS.latency_us,
        critical_batch=os.path.basename(FLAGS.critical_batch),
        projections={"%g" % s: rows[s] for s in speedups},
        tables=tables), f, indent=1)
  plot({"%g" % s: rows[s] for s in speedups}, workers,
       ["%g" % s for s in speedups],
       os.path.join(FLAGS.output_dir, "large_batch_projection.png"))
  print("\n".join(text))
  if any(math.isnan(r["by_w"][w][0]) for s in speedups for r in rows[s]
         for w in workers):
    raise ValueError("a projection is NaN")


if __name__ == "__main__":
  app.run(main)
