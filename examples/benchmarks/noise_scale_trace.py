"""How the gradient noise scale B_simple of a validation workload
(val_workloads.py) changes along a training run: every --every steps of a
run with --optimizer, B_simple = tr(Sigma) / |G|^2 estimated on --batches
training batches of --batch_size (each split into two halves at the
current weights, the estimates summed before dividing:
kfac/python/ops/adaptive/noise_scale.py), beside the training loss.
Writes noise_scale_trace.json and .md to --output_dir; docs/recipe.md
("The gradient noise scale") has the runs:

  .venv/bin/python examples/benchmarks/noise_scale_trace.py --workload=cnn
"""

import json
import os
import sys

from absl import app
from absl import flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import val_workloads as vw  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_enum("workload", "cnn", list(vw.WORKLOADS), "Workload.")
flags.DEFINE_string("optimizer", "kfac_minibatch", "An optimizer of "
                    "val_workloads.make_optimizer (its grid's middle rate).")
flags.DEFINE_integer("steps", 600, "Training steps.")
flags.DEFINE_integer("every", 100, "Steps between measurements.")
flags.DEFINE_integer("batches", 8, "Batches per measurement.")
flags.DEFINE_integer("batch_size", 256, "Training batch size.")
flags.DEFINE_enum("size", "full", ["full", "tiny"], "Model size.")
flags.DEFINE_integer("train_examples", 20000, "Training images.")
flags.DEFINE_string("output_dir", "bench_results", "Where to write.")


def measure(model, loss_fn, x, y, rng):
  """(B_simple, tr(Sigma) sum, |G|^2 sum) on FLAGS.batches random batches
  at the model's current weights (training mode)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from kfac.python.ops.adaptive import noise_scale  # pylint: disable=g-import-not-at-top
  half = FLAGS.batch_size // 2
  # The training-mode passes leave the model's state (batch-norm moving
  # statistics, random layers' seeds) as it was.
  state = [(v, v.numpy()) for v in model.non_trainable_variables]
  trace_sum = grad_sum = 0.0
  for _ in range(FLAGS.batches):
    rows = rng.choice(len(x), FLAGS.batch_size, replace=False)
    grads = []
    for part in (rows[:half], rows[half:2 * half]):
      with tf.GradientTape() as tape:
        part_loss = loss_fn(y[part], model(x[part], training=True))
      grads.append(tape.gradient(part_loss, model.trainable_variables))
    t, g = noise_scale.estimates(grads[0], grads[1], half)
    trace_sum += float(t)
    grad_sum += float(g)
  for v, value in state:
    v.assign(value)
  ratio = trace_sum / grad_sum if grad_sum > 0 else float("inf")
  return ratio, trace_sum, grad_sum


def run():
  """The records of one run (a list of dicts)."""
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  x, y, _, _, model, loss = vw.one_thread_run(
      FLAGS.workload, FLAGS.size, FLAGS.train_examples, 1000)
  opt = vw.make_optimizer(FLAGS.optimizer, model)
  model.compile(optimizer=opt, loss=loss)
  rng = np.random.RandomState(1)
  records = []

  def record(step, train_loss):
    b_simple, trace_sum, grad_sum = measure(model, loss, x, y, rng)
    records.append(dict(step=step, train_loss=train_loss, b_simple=b_simple,
                        trace_sigma_sum=trace_sum, grad_sq_sum=grad_sum))
    print("step %d train loss %s B_simple %.4g" % (
        step, "-" if train_loss is None else "%.4f" % train_loss, b_simple),
          flush=True)

  class Record(keras.callbacks.Callback):

    def on_train_batch_end(self, batch, logs=None):
      step = int(opt.iterations.numpy())
      if step % FLAGS.every == 0:
        record(step, float(logs["loss"]))
      if step >= FLAGS.steps:
        self.model.stop_training = True

  record(0, None)
  per_epoch = len(x) // FLAGS.batch_size
  model.fit(x, y, batch_size=FLAGS.batch_size,
            epochs=-(-FLAGS.steps // per_epoch), verbose=0,
            callbacks=[Record()])
  return records


def main(argv):
  del argv
  records = run()
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  command = "noise_scale_trace.py " + " ".join(sys.argv[1:])
  path = os.path.join(FLAGS.output_dir, "noise_scale_trace")
  lines = ["`%s`" % command, "",
           "| step | train loss | B_simple | B_simple / batch |",
           "|---:|---:|---:|---:|"]
  for r in records:
    lines.append("| %d | %s | %.4g | %.3g |" % (
        r["step"], "-" if r["train_loss"] is None else
        "%.4f" % r["train_loss"], r["b_simple"],
        r["b_simple"] / FLAGS.batch_size))
  text = "\n".join(lines) + "\n"
  # The table also goes into the JSON ("tables"), which docs render from
  # (examples/benchmarks/doc_tables.py).
  with open(path + ".json", "w") as f:
    json.dump(dict(workload=FLAGS.workload, optimizer=FLAGS.optimizer,
                   batch_size=FLAGS.batch_size, command=command,
                   records=records, tables={"trace": text}), f, indent=1)
  with open(path + ".md", "w") as f:
    f.write(text)
  print("\n".join(lines))


if __name__ == "__main__":
  app.run(main)
