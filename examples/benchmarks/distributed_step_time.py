r"""K-FAC step time on 1, 2 and 4 replicas, and what the replicas exchange.

For the autoencoder and the convnet of workloads.py at their benchmark
global batch sizes, a PeriodicInvCovUpdateKfacOpt step (invert_every=10,
momentum 0.9, a TF2 tf.function with strategy.run) is timed under
MirroredStrategy over R replicas, each on global_batch / R examples. Each R
runs in a subprocess of its own (the replica devices are configured before
TensorFlow initialises); the rows come from one run of this program, one
after the other, and the ratio column is each row's time over the
one-replica row of the same workload. The loop reads the loss of every
step, as training loops do.

Replicas are logical CPU devices here (--devices=cpu, they share the
machine's cores, so this measures the overhead of the reductions, not a
speed-up) or the machine's GPUs (--devices=gpu, R up to their number).

Three variants run at each R > 1 (--variants): "eager" (the default: the
statistics reduced at every step), "lazy" (lazy_statistics_sync=True: the
replicas' accumulators reduced at inversion steps only) and "round_robin"
(placement_strategy="replica_round_robin": each factor's inverses computed
on one replica and broadcast at inversion steps); the "vs eager" column is
each row's time over the eager row of the same workload and R.

The elements all-reduced per step (averaged over the invert_every steps)
are counted from the model's factors: the statistics (upper triangles of
the Kronecker factors, one collective per dtype; lazy: once per
invert_every steps), the gradients (one collective), and for round_robin
the inverses (in full, once per invert_every steps); bytes are float32.

  python examples/benchmarks/distributed_step_time.py    # a few minutes
  python examples/benchmarks/distributed_step_time.py --quick
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

FLAGS = flags.FLAGS
flags.DEFINE_string("output_dir", "bench_results", "Where the table goes.")
flags.DEFINE_list("replicas", ["1", "2", "4"], "Replica counts.")
flags.DEFINE_list("workloads", ["autoencoder", "convnet"], "Workloads.")
flags.DEFINE_enum("devices", "cpu", ["cpu", "gpu"], "Replica devices.")
flags.DEFINE_integer("steps", 10, "Timed steps (after 3 warm-up steps).")
flags.DEFINE_bool("quick", False, "Digits, small models, 3 timed steps.")
flags.DEFINE_list("variants", ["eager", "lazy", "round_robin"],
                  "Variants timed at R > 1 (see the module docstring).")
flags.DEFINE_integer("worker_replicas", 0, "Internal: run one R.")

INVERT_EVERY = 10
_VARIANT_KWARGS = {
    "eager": {},
    "lazy": {"lazy_statistics_sync": True},
    "round_robin": {"placement_strategy": "replica_round_robin"},
}


def _measure(workload_name, strategy, variant):
  """(ms per step, elements all-reduced per step) in this process."""
  import tensorflow as tf
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import workloads as workloads_lib
  import kfac

  replicas = strategy.num_replicas_in_sync
  workload = workloads_lib.get(workload_name, small=FLAGS.quick)
  data = workload.load("digits" if FLAGS.quick else "auto",
                       max_examples=2000 if FLAGS.quick else 10000)
  batch = min(workload.batch_size, len(data)) // replicas * replicas
  x, y = workloads_lib.random_batch(data, batch, seed=0)
  with strategy.scope():
    variables = workload.make_variables(workload.init_params(data, seed=0))
  var_list = workload.flat_variables(variables)
  opt = kfac.PeriodicInvCovUpdateKfacOpt(
      invert_every=INVERT_EVERY, learning_rate=1e-3, damping=1.0,
      momentum=0.9, l2_reg=workload.l2_reg, **_VARIANT_KWARGS[variant])
  per = batch // replicas

  def replica_step(xs, ys):
    lc = kfac.LayerCollection()
    logits = workload.forward(xs, variables, lc)
    workload.register_loss(lc, logits, ys)
    loss = workload.loss(ys, logits, variables) / replicas
    opt.minimize(loss, var_list=var_list, layer_collection=lc)
    return loss

  @tf.function
  def step(shards):
    return strategy.run(replica_step, args=shards)

  def shard(ctx):
    r = ctx.replica_id_in_sync_group
    return (tf.constant(x[r * per:(r + 1) * per]),
            tf.constant(y[r * per:(r + 1) * per], workload.target_dtype))

  shards = strategy.experimental_distribute_values_from_function(shard)
  for _ in range(3):
    step(shards)
  # Whole inversion periods, so that every variant pays its inversions.
  steps = INVERT_EVERY if FLAGS.quick else max(FLAGS.steps, INVERT_EVERY)
  steps -= steps % INVERT_EVERY
  start = time.perf_counter()
  for _ in range(steps):
    out = step(shards)
    # The loss read every step, as training loops do.
    float(strategy.experimental_local_results(out)[0])
  ms = (time.perf_counter() - start) * 1000.0 / steps

  # What one replica sends per step: count it on a single-replica graph.
  stat_elements, grad_elements, inv_elements = (
      workloads_lib.all_reduced_elements(workload, data, x[:per], y[:per]))
  if variant == "lazy":
    stat_elements /= float(INVERT_EVERY)
  sent = stat_elements + grad_elements
  if variant == "round_robin":
    sent += inv_elements / float(INVERT_EVERY)
  return ms, stat_elements, grad_elements, sent, batch


def _worker():
  import tensorflow as tf
  replicas = FLAGS.worker_replicas
  if FLAGS.devices == "cpu":
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * replicas)
  elif len(tf.config.list_physical_devices("GPU")) < replicas:
    print("RESULT " + json.dumps({"skipped": "fewer GPUs than %d" % replicas}))
    return
  devices = (["/gpu:%d" % i for i in range(replicas)]
             if FLAGS.devices == "gpu" else
             ["/cpu:%d" % i for i in range(replicas)])
  # One strategy per process: a second MirroredStrategy over the same
  # devices would reuse the first one's collective keys.
  strategy = tf.distribute.MirroredStrategy(devices)
  variants = ["eager"] if replicas == 1 else FLAGS.variants
  for name in FLAGS.workloads:
    for variant in variants:
      ms, stats, grads, sent, batch = _measure(name, strategy, variant)
      print("RESULT " + json.dumps(dict(
          workload=name, replicas=replicas, variant=variant, batch=batch,
          ms=ms, stat_elements=stats, grad_elements=grads,
          sent_elements=0 if replicas == 1 else sent)), flush=True)


def _table(rows):
  lines = ["| workload | global batch | replicas | variant | ms/step | vs 1 "
           "replica | vs eager | statistics elements / step | gradient "
           "elements | MB all-reduced per replica per step |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  base = {r["workload"]: r["ms"] for r in rows if r["replicas"] == 1}
  eager = {(r["workload"], r["replicas"]): r["ms"] for r in rows
           if r["variant"] == "eager"}
  for r in rows:
    ratio = r["ms"] / base[r["workload"]] if r["workload"] in base else None
    key = (r["workload"], r["replicas"])
    vs_eager = r["ms"] / eager[key] if key in eager else None
    lines.append("| %s | %d | %d | %s | %.1f | %s | %s | %.0f | %d | %.2f |" % (
        r["workload"], r["batch"], r["replicas"], r["variant"], r["ms"],
        "%.2fx" % ratio if ratio else "-",
        "%.2fx" % vs_eager if vs_eager and r["replicas"] > 1 else "-",
        r["stat_elements"], r["grad_elements"],
        r["sent_elements"] * 4 / 1e6))
  return "\n".join(lines)


def _plot(rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  for name in sorted({r["workload"] for r in rows}):
    for variant in FLAGS.variants:
      mine = [r for r in rows if r["workload"] == name and
              (r["variant"] == variant or r["replicas"] == 1)]
      ax.plot([r["replicas"] for r in mine], [r["ms"] for r in mine], "o-",
              label="%s, %s" % (name, variant))
  ax.set_xlabel("replicas (%s devices)" % FLAGS.devices)
  ax.set_ylabel("ms per K-FAC step (global batch fixed)")
  ax.set_title("K-FAC under MirroredStrategy")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  if FLAGS.worker_replicas:
    _worker()
    return
  rows = []
  for r in FLAGS.replicas:
    cmd = [sys.executable, os.path.abspath(__file__),
           "--worker_replicas=%s" % r, "--devices=%s" % FLAGS.devices,
           "--steps=%d" % FLAGS.steps,
           "--workloads=%s" % ",".join(FLAGS.workloads),
           "--variants=%s" % ",".join(FLAGS.variants)]
    if FLAGS.quick:
      cmd.append("--quick")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
      raise RuntimeError("%d replicas failed:\n%s" % (int(r),
                                                      proc.stderr[-3000:]))
    for line in proc.stdout.splitlines():
      if line.startswith("RESULT "):
        row = json.loads(line[len("RESULT "):])
        if "skipped" in row:
          print("%s replicas: skipped (%s)" % (r, row["skipped"]))
          continue
        rows.append(row)
        print("%-11s %d replicas %-11s %8.1f ms/step" % (
            row["workload"], row["replicas"], row["variant"], row["ms"]),
              flush=True)
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  table = _table(rows)
  header = ("# K-FAC step time under MirroredStrategy\n\n%s, %s devices, "
            "%s\n\n" % (platform.node() or "machine", FLAGS.devices,
                        "quick" if FLAGS.quick else "full"))
  with open(os.path.join(FLAGS.output_dir, "distributed_step_time.md"),
            "w") as f:
    f.write(header + table + "\n")
  with open(os.path.join(FLAGS.output_dir, "distributed_step_time.json"),
            "w") as f:
    json.dump(rows, f, indent=1)
  _plot(rows, os.path.join(FLAGS.output_dir, "distributed_step_time.png"))
  print(table)


if __name__ == "__main__":
  app.run(main)
