"""The damping of Kfac(adaptive=True, recipe="minibatch") along a run of one
validation workload (val_workloads.py): every --every steps the training
loss, the validation accuracy on the first 2,000 validation images, the
damping, the damping rule's last rho and the curvature scale (the damping
floor's unit, recipe.curvature_scale). Writes keras_damping_trace.json and
.md to --output_dir. docs/recipe.md ("The minibatch recipe's damping") has
the runs:

  .venv/bin/python examples/benchmarks/keras_damping_trace.py \\
      --workload=vit --damping_adaptation_decay=0.95
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
flags.DEFINE_enum("workload", "vit", ["cnn", "vit"], "Workload.")
flags.DEFINE_float("learning_rate", 0.05, "The recipe's learning rate.")
flags.DEFINE_float("damping_adaptation_decay", None,
                   "The damping rule's decay (default: the recipe's).")
flags.DEFINE_integer("steps", 400, "Training steps (batch 256).")
flags.DEFINE_integer("every", 25, "Steps between records.")
flags.DEFINE_enum("size", "full", ["full", "tiny"], "Model size.")
flags.DEFINE_integer("train_examples", 20000, "Training images.")
flags.DEFINE_string("output_dir", "bench_results", "Where to write.")


def run():
  """The records of one run (a list of dicts)."""
  import keras  # pylint: disable=g-import-not-at-top
  import kfac.keras  # pylint: disable=g-import-not-at-top
  from kfac.python.ops.adaptive import recipe  # pylint: disable=g-import-not-at-top
  x, y, xv, yv, model, loss = vw.one_thread_run(
      FLAGS.workload, FLAGS.size, FLAGS.train_examples, 2000)
  extra = {}
  if FLAGS.damping_adaptation_decay is not None:
    extra["damping_adaptation_decay"] = FLAGS.damping_adaptation_decay
  opt = kfac.keras.optimizers.Kfac(model=model, loss=loss, adaptive=True,
                                   recipe="minibatch",
                                   learning_rate=FLAGS.learning_rate,
                                   **extra)
  model.compile(optimizer=opt, loss=loss, metrics=vw.metrics(FLAGS.workload))
  core = opt.kfac_optimizer
  records = []

  class Record(keras.callbacks.Callback):

    def on_train_batch_end(self, batch, logs=None):
      step = int(opt.iterations.numpy())
      if step % FLAGS.every and step != FLAGS.steps:
        return
      _, acc = model.evaluate(xv, yv, batch_size=1000, verbose=0)
      scale = recipe.curvature_scale(core.estimator.blocks)
      records.append(dict(
          step=step, train_loss=float(logs["loss"]), val_acc=float(acc),
          damping=float(core.damping.numpy()), rho=float(core.rho.numpy()),
          curvature_scale=float(scale.numpy())))
      print("step %(step)d loss %(train_loss).3f val acc %(val_acc).4f "
            "damping %(damping).3g rho %(rho).3g curvature scale "
            "%(curvature_scale).3g" % records[-1], flush=True)

  per_epoch = len(x) // 256
  epochs = -(-FLAGS.steps // per_epoch)
  model.fit(x, y, batch_size=256, epochs=epochs, steps_per_epoch=None,
            verbose=0, callbacks=[Record(), _Stop(FLAGS.steps, opt)])
  return records


class _Stop:
  """A callback that stops fit after `steps` optimizer steps (built lazily:
  keras is imported in run())."""

  def __new__(cls, steps, opt):
    import keras  # pylint: disable=g-import-not-at-top

    class Stop(keras.callbacks.Callback):

      def on_train_batch_end(self, batch, logs=None):
        if int(opt.iterations.numpy()) >= steps:
          self.model.stop_training = True
    return Stop()


def main(argv):
  del argv
  records = run()
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  head = dict(workload=FLAGS.workload, learning_rate=FLAGS.learning_rate,
              damping_adaptation_decay=FLAGS.damping_adaptation_decay,
              command="keras_damping_trace.py " + " ".join(sys.argv[1:]))
  path = os.path.join(FLAGS.output_dir, "keras_damping_trace")
  lines = ["`%s`" % head["command"], "",
           "| step | train loss | val acc | damping | rho | curvature scale |",
           "|---:|---:|---:|---:|---:|---:|"]
  for r in records:
    lines.append("| %d | %.3f | %.4f | %.3g | %.3g | %.3g |" % (
        r["step"], r["train_loss"], r["val_acc"], r["damping"], r["rho"],
        r["curvature_scale"]))
  text = "\n".join(lines) + "\n"
  # The table also goes into the JSON ("tables"), which docs render from
  # (examples/benchmarks/doc_tables.py).
  with open(path + ".json", "w") as f:
    json.dump(dict(head, records=records, tables={"trace": text}), f,
              indent=1)
  with open(path + ".md", "w") as f:
    f.write(text)
  print("\n".join(lines))


if __name__ == "__main__":
  app.run(main)
