r"""Per-step time of this kfac against another source tree of it, side by side.

For a change that must not move the step time (a refactoring), this program
runs the same timing workers with `kfac` imported from two source trees,
alternating them round by round, and reports each tree's median and the
ratio. Only `kfac` differs between the two: the benchmark programs, the
data and the weights come from this checkout.

Workloads (each a worker of an existing benchmark program):
  autoencoder_session   autoencoder_step_time.py, kfac_session: the K-FAC
                        paper's autoencoder, PeriodicInvCovUpdateKfacOpt in a
                        TF1 Session, batch 256, ms/step with the loss
                        fetched (as Session loops do)
  autoencoder_function  the same in a TF2 tf.function (kfac_tf_function)
  cnn_fit               keras_validation.py's residual CNN with batch norm,
                        Kfac(model=..., adaptive=True) in model.fit, batch
                        256: CPU and wall ms/step after the first step
  autoencoder_fit       keras_validation.py's autoencoder, the same way

Both CPU and wall times are reported; one TensorFlow thread per worker
(--threads) so that the figures are CPU-bound and comparable on a loaded
machine. On a machine whose speed drifts between runs the times alone
cannot show a change of a few percent, so each worker also counts the
TensorFlow ops it creates (graph_ops.py: per kind of graph, and a
fingerprint of their sequence of op types): where the two trees create the
same ops in the same order, their steps run the same graph.

  python examples/benchmarks/tree_step_time.py --base_tree=/path/to/old/checkout
  python examples/benchmarks/tree_step_time.py --base_tree=... \
      --workloads=cnn_fit --rounds=3 --fit_steps=60

Writes tree_step_time.json and tree_step_time.md to --output_dir.
"""

import json
import os
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# pylint: disable=g-import-not-at-top,wrong-import-position
import graph_ops
# pylint: enable=g-import-not-at-top,wrong-import-position
THIS_TREE = os.path.dirname(os.path.dirname(HERE))
FLAGS = flags.FLAGS

WORKLOADS = ("autoencoder_session", "autoencoder_function", "cnn_fit",
             "autoencoder_fit")

flags.DEFINE_string("base_tree", None, "The checkout to compare with (its "
                    "kfac/ package is imported by the base workers).")
flags.DEFINE_string("tree", THIS_TREE, "The checkout under test (default: "
                    "this one).")
flags.DEFINE_list("workloads", list(WORKLOADS), "Workloads to time.")
flags.DEFINE_integer("rounds", 3, "Rounds; each runs every workload once "
                     "per tree, the trees' order alternating.")
flags.DEFINE_integer("fit_steps", 80, "Training steps of the fit workers "
                     "(the first, tracing step is not timed).")
flags.DEFINE_integer("blocks", 3, "Timed blocks (of 10 steps) of the "
                     "autoencoder workers.")
flags.DEFINE_integer("threads", 1, "TensorFlow threads per worker.")
flags.DEFINE_string("output_dir", "bench_results", "Where to write.")


def _command(workload):
  """argv of one worker, and the parser of its output line."""
  py = sys.executable
  if workload.startswith("autoencoder_") and not workload.endswith("_fit"):
    config = {"autoencoder_session": "kfac_session",
              "autoencoder_function": "kfac_tf_function"}[workload]
    argv = [py, os.path.join(HERE, "autoencoder_step_time.py"),
            "--worker=" + config, "--worker_batch_size=256",
            "--blocks_per_round=%d" % FLAGS.blocks, "--warmup_blocks=1",
            "--threads=%d" % FLAGS.threads]
    return argv, _parse_autoencoder
  name = {"cnn_fit": "cnn", "autoencoder_fit": "autoencoder"}[workload]
  argv = [py, os.path.join(HERE, "keras_validation.py"),
          "--worker=%s,kfac" % name, "--max_steps=%d" % FLAGS.fit_steps,
          "--eval_every=%d" % FLAGS.fit_steps, "--budget_s=1e9",
          "--threads=%d" % FLAGS.threads]
  return argv, _parse_fit


def _parse_autoencoder(out):
  for line in out.splitlines():
    if line.startswith("WORKER_RESULT "):
      r = json.loads(line[len("WORKER_RESULT "):])
      way = "train_op+loss"
      return {"wall_ms": 1e3 * statistics.median(r["times"][way]),
              "cpu_ms": 1e3 * statistics.median(r["cpu"][way])}
  return None


def _parse_fit(out):
  for line in out.splitlines():
    if line.startswith("RESULT "):
      r = json.loads(line[len("RESULT "):])
      return {"wall_ms": r["ms_per_step_wall"], "cpu_ms": r["ms_per_step_cpu"]}
  return None


def run_one(workload, tree):
  """Runs one worker with `kfac` from `tree`; returns its times."""
  argv, parse = _command(workload)
  tree = os.path.realpath(tree)
  # The worker's script runs after `kfac` was imported from `tree` and
  # checked (so neither the editable install nor a path the script adds can
  # give it another kfac).
  code = ("import os, runpy, sys; sys.path.insert(0, %r); sys.argv = %r; "
          "import kfac; where = os.path.realpath(kfac.__file__); "
          "assert where.startswith(%r), where; "
          "import graph_ops; graph_ops.install(); "
          "runpy.run_path(%r, run_name='__main__')" % (
              os.path.dirname(argv[1]), argv[1:], tree + os.sep, argv[1]))
  env = dict(os.environ, PYTHONPATH=tree, TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.run([argv[0], "-c", code], env=env, capture_output=True,
                        text=True, check=False, cwd=tree)
  result = parse(proc.stdout)
  ops = graph_ops.parse(proc.stdout)
  if proc.returncode or result is None or ops is None:
    raise RuntimeError("worker %s on %s failed (exit %d):\n%s" % (
        workload, tree, proc.returncode, proc.stderr[-3000:]))
  result["graph_ops"] = ops
  return result


def _check_tree(tree):
  """`tree` has a kfac package, and a worker's Python imports it."""
  if not os.path.isfile(os.path.join(tree, "kfac", "__init__.py")):
    raise app.UsageError("%s has no kfac/ package" % tree)
  env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
  found = subprocess.run(
      [sys.executable, "-c", "import kfac, os; print(os.path.dirname("
       "os.path.dirname(os.path.realpath(kfac.__file__))))"],
      env=env, capture_output=True, text=True, check=True,
      cwd=os.path.abspath(tree)).stdout.strip()
  if found != os.path.realpath(tree):
    raise app.UsageError("PYTHONPATH=%s imports kfac from %s" % (tree, found))


def summarize(runs):
  """{workload: {tree: {cpu_ms, wall_ms (medians), cpu_all, wall_all}},
  with the ratio tree / base of each median."""
  out = {}
  for workload, by_tree in runs.items():
    row = {}
    for key, results in by_tree.items():
      row[key] = {
          "cpu_ms": statistics.median(r["cpu_ms"] for r in results),
          "wall_ms": statistics.median(r["wall_ms"] for r in results),
          "cpu_all": [r["cpu_ms"] for r in results],
          "wall_all": [r["wall_ms"] for r in results]}
    row["ratio_cpu"] = row["tree"]["cpu_ms"] / row["base"]["cpu_ms"]
    # The two trees' runs of one round ran next to each other: the median
    # of the rounds' ratios is less moved by a round the machine was slow.
    row["paired_ratio_cpu"] = statistics.median(
        t / b for t, b in zip(row["tree"]["cpu_all"], row["base"]["cpu_all"]))
    row["ratio_wall"] = row["tree"]["wall_ms"] / row["base"]["wall_ms"]
    for key, results in by_tree.items():
      # The same program and tree create the same ops in every round.
      prints = {json.dumps(r["graph_ops"], sort_keys=True) for r in results}
      row[key]["graph_ops"] = (results[0]["graph_ops"] if len(prints) == 1
                               else None)
    base_ops, tree_ops = row["base"]["graph_ops"], row["tree"]["graph_ops"]
    row["same_graph"] = base_ops is not None and base_ops == tree_ops
    out[workload] = row
  return out


def table(summary):
  lines = ["| workload | base CPU ms/step | tree CPU ms/step | CPU ratio | "
           "median of the rounds' CPU ratios | base wall ms/step | "
           "tree wall ms/step | wall ratio | graph ops created, base / tree "
           "| same op sequence |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
  for workload, row in summary.items():
    ops = ["%d" % sum(row[k]["graph_ops"]["counts"].values())
           if row[k]["graph_ops"] else "varies" for k in ("base", "tree")]
    lines.append(
        "| %s | %.1f | %.1f | %.3f | %.3f | %.1f | %.1f | %.3f | %s | %s |" % (
            workload, row["base"]["cpu_ms"], row["tree"]["cpu_ms"],
            row["ratio_cpu"], row["paired_ratio_cpu"], row["base"]["wall_ms"],
            row["tree"]["wall_ms"], row["ratio_wall"], " / ".join(ops),
            "yes" if row["same_graph"] else "no"))
  return "\n".join(lines)


def main(argv):
  del argv
  if not FLAGS.base_tree:
    raise app.UsageError("--base_tree is required")
  for tree in (FLAGS.base_tree, FLAGS.tree):
    _check_tree(tree)
  for w in FLAGS.workloads:
    if w not in WORKLOADS:
      raise app.UsageError("unknown workload %r; one of %s" % (
          w, ", ".join(WORKLOADS)))
  trees = {"base": FLAGS.base_tree, "tree": FLAGS.tree}
  runs = {w: {"base": [], "tree": []} for w in FLAGS.workloads}
  start = time.time()
  for r in range(FLAGS.rounds):
    order = ("base", "tree") if r % 2 == 0 else ("tree", "base")
    for w in FLAGS.workloads:
      for key in order:
        res = run_one(w, trees[key])
        runs[w][key].append(res)
        print("round %d %s %s: cpu %.1f ms/step, wall %.1f ms/step (%.0f s)"
              % (r + 1, w, key, res["cpu_ms"], res["wall_ms"],
                 time.time() - start), flush=True)
  summary = summarize(runs)
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  header = ("kfac from %s (tree) against %s (base); %d rounds, medians; "
            "%d TensorFlow thread(s) per worker; %s" % (
                FLAGS.tree, FLAGS.base_tree, FLAGS.rounds, FLAGS.threads,
                time.strftime("%Y-%m-%d %H:%M")))
  with open(os.path.join(FLAGS.output_dir, "tree_step_time.json"), "w") as f:
    json.dump({"header": header, "summary": summary,
               "fit_steps": FLAGS.fit_steps, "rounds": FLAGS.rounds}, f,
              indent=1)
  text = header + "\n\n" + table(summary) + "\n"
  with open(os.path.join(FLAGS.output_dir, "tree_step_time.md"), "w") as f:
    f.write(text)
  print(text, flush=True)


if __name__ == "__main__":
  app.run(main)
