r"""K-FAC's and Adam's step time on 1, 2 and 4 MultiWorkerMirroredStrategy
workers, the per-worker batch fixed, with the bytes each worker all-reduces
per step and a check of the ring all-reduce time model (issue 54).

Each worker count W runs W localhost processes (TF_CONFIG, one replica and
one TensorFlow thread each, the RING collective implementation). For each
workload of workloads.py (the autoencoder, the convnet) and each optimizer
(K-FAC: PeriodicInvCovUpdateKfacOpt, invert_every=10, momentum 0.9;
Adam: tf.compat.v1.train.AdamOptimizer), every worker times

  * the distributed step: strategy.run of the step on its --per_worker_batch
    examples of a global batch of W * per_worker_batch, the loss read every
    step, whole inversion periods;
  * the same step without a strategy on the same examples (its compute),
    timed by all workers at once so that it shares the cores as the
    distributed step does;
  * all-reduces of 1e3 .. 4e6 float32 elements (kfac's packed collective,
    8 chained in one call, the call's time divided by 8), to which
    t = latency + elements * 4 / bandwidth is fitted.

The bytes each worker all-reduces per step are counted from the model's
factors, as in distributed_step_time.py: the gradients (one collective) and
for K-FAC the factor statistics (the upper triangles, one collective). The
check: measured distributed step against the compute step plus the fitted
all-reduce time of the counted bytes (two collectives for K-FAC, one for
Adam). The table and JSON go to --output_dir; docs/large_batch.md projects
from them (large_batch_projection.py).

Localhost workers share this machine's cores: with more workers than cores
the compute step slows too (both timings see it), and the "network" is the
loopback interface, so the fitted bandwidth is not a datacenter's.

  python examples/benchmarks/multiworker_step_time.py     # a few minutes
  python examples/benchmarks/multiworker_step_time.py --quick
"""

import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import batch_scaling

FLAGS = flags.FLAGS
flags.DEFINE_string("output_dir", "bench_results", "Where to write.")
flags.DEFINE_list("workers", ["1", "2", "4"], "Worker counts.")
flags.DEFINE_list("workloads", ["autoencoder", "convnet"], "Workloads.")
flags.DEFINE_integer("per_worker_batch", 128, "Examples per worker per step.")
flags.DEFINE_integer("steps", 20, "Timed steps (whole inversion periods, "
                     "after 3 warm-up steps).")
flags.DEFINE_bool("quick", False, "Digits, small models, 10 steps, small "
                  "all-reduces.")
flags.DEFINE_integer("timeout_s", 900, "Per worker count.")
flags.DEFINE_integer("worker_index", None, "(internal) this worker's index.")
flags.DEFINE_list("ports", None, "(internal) every worker's port.")

INVERT_EVERY = 10
OPTIMIZERS = ("kfac", "adam")
SIZES = (1000, 10000, 100000, 1000000, 4000000)
QUICK_SIZES = (1000, 10000, 100000)
CHAINED = 8


# ---------------------------------------------------------------- a worker
def _barrier(strategy, tf):
  """Returns when every worker has reached it (a one-element all-reduce)."""
  @tf.function
  def go():
    return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
        tf.distribute.ReduceOp.SUM, tf.ones([])))
  float(strategy.experimental_local_results(go())[0])


def _timed(fn, steps):
  start = time.perf_counter()
  for _ in range(steps):
    fn()
  return (time.perf_counter() - start) * 1000.0 / steps


def _optimizer(kfac, tf, name, workload):
  if name == "kfac":
    return kfac.PeriodicInvCovUpdateKfacOpt(
        invert_every=INVERT_EVERY, learning_rate=1e-3, damping=1.0,
        momentum=0.9, l2_reg=workload.l2_reg)
  return tf.compat.v1.train.AdamOptimizer(1e-3)


def _step_fn(kfac, tf, workload, opt_name, variables, opt, scale):
  var_list = workload.flat_variables(variables)

  def step(xs, ys):
    lc = kfac.LayerCollection()
    logits = workload.forward(xs, variables, lc)
    workload.register_loss(lc, logits, ys)
    loss = workload.loss(ys, logits, variables) * scale
    if opt_name == "kfac":
      opt.minimize(loss, var_list=var_list, layer_collection=lc)
    else:
      opt.minimize(loss, var_list=var_list)
    return loss
  return step


def _measure(strategy, workload_name, opt_name, workers, index):
  import tensorflow as tf
  import kfac
  import workloads as workloads_lib
  workload = workloads_lib.get(workload_name, small=FLAGS.quick)
  data = workload.load("digits" if FLAGS.quick else "auto",
                       max_examples=2000 if FLAGS.quick else 10000)
  per = FLAGS.per_worker_batch
  x_all, y_all = workloads_lib.random_batch(data, per * workers, seed=0)
  x = x_all[index * per:(index + 1) * per]
  y = y_all[index * per:(index + 1) * per]
  steps = 10 if FLAGS.quick else max(FLAGS.steps, INVERT_EVERY)
  steps -= steps % INVERT_EVERY

  # The distributed step.
  with strategy.scope():
    dist_vars = workload.make_variables(workload.init_params(data, seed=0))
  dist_opt = _optimizer(kfac, tf, opt_name, workload)
  dist_step = _step_fn(kfac, tf, workload, opt_name, dist_vars, dist_opt,
                       1.0 / workers)
  shards = strategy.experimental_distribute_values_from_function(
      lambda ctx: (tf.constant(x), tf.constant(y, workload.target_dtype)))

  @tf.function
  def distributed():
    return strategy.run(dist_step, args=shards)

  def run_distributed():
    float(strategy.experimental_local_results(distributed())[0])

  # The same step, no strategy (this worker's compute alone).
  local_vars = workload.make_variables(workload.init_params(data, seed=0))
  local_opt = _optimizer(kfac, tf, opt_name, workload)
  local_step = _step_fn(kfac, tf, workload, opt_name, local_vars, local_opt,
                        1.0)
  xt, yt = tf.constant(x), tf.constant(y, workload.target_dtype)
  local = tf.function(lambda: local_step(xt, yt))

  def run_local():
    float(local())

  for _ in range(3):
    run_distributed()
    run_local()
  _barrier(strategy, tf)
  ms_local = _timed(run_local, steps)
  _barrier(strategy, tf)
  ms_dist = _timed(run_distributed, steps)
  stat_elements, grad_elements, _ = workloads_lib.all_reduced_elements(
      workload, data, x, y)
  if opt_name != "kfac":
    stat_elements = 0
  return dict(workload=workload_name, optimizer=opt_name, workers=workers,
              per_worker_batch=per, global_batch=per * workers, steps=steps,
              ms_step=ms_dist, ms_compute=ms_local,
              stat_elements=stat_elements, grad_elements=grad_elements,
              collectives=2 if opt_name == "kfac" else 1)


def _allreduce_times(strategy, workers):
  """[(elements, ms)] of kfac's packed all-reduce of one float32 vector: a
  call of CHAINED all-reduces, each of the previous one's result, timed and
  divided by CHAINED (so that the call's own overhead is not counted as the
  network's)."""
  del workers
  import tensorflow as tf
  from kfac.python.ops.distribute import collective
  out = []
  for n in (QUICK_SIZES if FLAGS.quick else SIZES):
    value = tf.ones([n])

    def chained(value=value):
      v = value
      for _ in range(CHAINED):
        v = collective.all_reduce([v])[0]
      return v[:1]

    reduce_calls = tf.function(lambda fn=chained: strategy.run(fn))

    def run(fn=reduce_calls):
      float(strategy.experimental_local_results(fn())[0][0])
    for _ in range(2):
      run()
    _barrier(strategy, tf)
    reps = 5 if n <= 100000 else 2
    out.append((n, _timed(run, reps) / CHAINED))
  return out


def _worker():
  ports = FLAGS.ports
  workers, index = len(ports), FLAGS.worker_index
  os.environ["TF_CONFIG"] = json.dumps({
      "cluster": {"worker": ["localhost:%s" % p for p in ports]},
      "task": {"type": "worker", "index": index}})
  import tensorflow as tf
  tf.config.threading.set_intra_op_parallelism_threads(1)
  tf.config.threading.set_inter_op_parallelism_threads(1)
  strategy = tf.distribute.MultiWorkerMirroredStrategy(
      communication_options=tf.distribute.experimental.CommunicationOptions(
          implementation=tf.distribute.experimental.CommunicationImplementation
          .RING))
  for name in FLAGS.workloads:
    for opt_name in OPTIMIZERS:
      row = _measure(strategy, name, opt_name, workers, index)
      if index == 0:
        print("RESULT " + json.dumps(row), flush=True)
  times = _allreduce_times(strategy, workers)
  if index == 0:
    print("ALLREDUCE " + json.dumps(dict(workers=workers, times=times)),
          flush=True)


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


def _run_workers(workers):
  """(rows, all-reduce times) from the chief of `workers` processes."""
  ports = ",".join(str(p) for p in _free_ports(workers))
  env = dict(os.environ)
  env.pop("TF_CONFIG", None)
  cmd = [sys.executable, os.path.abspath(__file__), "--ports=" + ports,
         "--per_worker_batch=%d" % FLAGS.per_worker_batch,
         "--steps=%d" % FLAGS.steps,
         "--workloads=" + ",".join(FLAGS.workloads)]
  if FLAGS.quick:
    cmd.append("--quick")
  procs, errs = [], []
  for i in range(workers):
    # stderr to files: a full pipe would stall a worker and the collectives.
    errs.append(tempfile.TemporaryFile("w+"))  # pylint: disable=consider-using-with
    procs.append(subprocess.Popen(  # pylint: disable=consider-using-with
        cmd + ["--worker_index=%d" % i], env=env, stdout=subprocess.PIPE,
        stderr=errs[i], text=True))
  deadline = time.time() + FLAGS.timeout_s
  try:
    while any(p.poll() is None for p in procs):
      if (any(p.poll() not in (None, 0) for p in procs) or
          time.time() > deadline):
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  failed = [i for i, p in enumerate(procs) if p.returncode != 0]
  if failed:
    errs[failed[0]].seek(0)
    raise RuntimeError("%d workers: worker %d failed (exit %s):\n%s" % (
        workers, failed[0], procs[failed[0]].returncode,
        errs[failed[0]].read()[-3000:]))
  rows, times = [], None
  for line in procs[0].stdout.read().splitlines():
    if line.startswith("RESULT "):
      rows.append(json.loads(line[len("RESULT "):]))
    elif line.startswith("ALLREDUCE "):
      times = json.loads(line[len("ALLREDUCE "):])["times"]
  for e in errs:
    e.close()
  return rows, times


def _table(rows, fits):
  lines = [
      "| workload | optimizer | workers | global batch | ms/step | ms "
      "compute | MB all-reduced per worker per step | predicted ms/step | "
      "predicted / measured |",
      "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append("| %s | %s | %d | %d | %.1f | %.1f | %.2f | %s | %s |" % (
        r["workload"], r["optimizer"], r["workers"], r["global_batch"],
        r["ms_step"], r["ms_compute"], r["bytes"] / 1e6,
        "%.1f" % r["ms_predicted"] if r["workers"] > 1 else "-",
        "%.2f" % (r["ms_predicted"] / r["ms_step"]) if r["workers"] > 1
        else "-"))
  lines += ["", "| workers | all-reduce latency (ms) | bandwidth (MB/s) |",
            "|---:|---:|---:|"]
  for w in sorted(fits):
    lines.append("| %d | %.2f | %.0f |" % (w, fits[w][0] * 1e3,
                                           fits[w][1] / 1e6))
  return "\n".join(lines)


def _plot(rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  for name in sorted({r["workload"] for r in rows}):
    for opt in OPTIMIZERS:
      mine = [r for r in rows if r["workload"] == name and
              r["optimizer"] == opt]
      ax.plot([r["workers"] for r in mine], [r["ms_step"] for r in mine],
              "o-", label="%s, %s" % (name, opt))
      ax.plot([r["workers"] for r in mine],
              [r["ms_predicted"] for r in mine], "x:", color=ax.lines[-1]
              .get_color())
  ax.set_xlabel("localhost workers (per-worker batch %d)" %
                FLAGS.per_worker_batch)
  ax.set_ylabel("ms per step (o measured, x model)")
  ax.set_yscale("log")
  ax.set_title("MultiWorkerMirroredStrategy on one machine")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  if FLAGS.worker_index is not None:
    _worker()
    return
  rows, fits, times_by_w = [], {}, {}
  for w in [int(v) for v in FLAGS.workers]:
    got, times = _run_workers(w)
    times_by_w[w] = times
    fits[w] = batch_scaling.fit_latency_bandwidth(
        [(n * 4, ms / 1e3) for n, ms in times]) if w > 1 else (0.0, 0.0)
    for r in got:
      r["bytes"] = 0 if w == 1 else 4 * (r["stat_elements"] +
                                         r["grad_elements"])
      r["ms_predicted"] = r["ms_compute"]
      if w > 1:
        latency, bandwidth = fits[w]
        r["ms_predicted"] += 1e3 * (r["collectives"] * latency +
                                    r["bytes"] / bandwidth)
      rows.append(r)
      print("%-11s %-5s %d workers %8.1f ms/step (compute %.1f, model %.1f)"
            % (r["workload"], r["optimizer"], w, r["ms_step"],
               r["ms_compute"], r["ms_predicted"]), flush=True)
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  table = _table(rows, {w: f for w, f in fits.items() if w > 1})
  header = ("# K-FAC and Adam under MultiWorkerMirroredStrategy (localhost)"
            "\n\n%s, per-worker batch %d, one thread per worker, %s\n\n" % (
                platform.node() or "machine", FLAGS.per_worker_batch,
                "quick" if FLAGS.quick else "full"))
  with open(os.path.join(FLAGS.output_dir, "multiworker_step_time.md"),
            "w") as f:
    f.write(header + table + "\n")
  with open(os.path.join(FLAGS.output_dir, "multiworker_step_time.json"),
            "w") as f:
    json.dump(dict(rows=rows, allreduce=times_by_w,
                   fits={w: dict(latency_s=f[0], bytes_per_s=f[1])
                         for w, f in fits.items() if w > 1},
                   per_worker_batch=FLAGS.per_worker_batch,
                   cpu=platform.processor() or platform.machine(),
                   tables={"step_time": table}), f,
              indent=1)
  _plot(rows, os.path.join(FLAGS.output_dir, "multiworker_step_time.png"))
  print(table)


if __name__ == "__main__":
  app.run(main)
