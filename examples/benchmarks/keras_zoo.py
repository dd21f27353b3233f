r"""The Keras model zoo: K-FAC's default recipe against Adam and Muon in fit.

For every model of zoo_models.py (keras.applications MobileNetV2 (alpha
0.35), ResNet50 and EfficientNetB0 on 32x32x3, a small BN ResNet, a ViT, a
GPT-style causal transformer, LSTM and GRU text classifiers) and every
optimizer

  kfac   kfac.keras.optimizers.Kfac(model=model, adaptive=True) (defaults)
  adam   keras.optimizers.Adam(1e-3)
  muon   keras.optimizers.Muon() (Keras's defaults)
  kfac_fixed_rate  (only when asked) the recipe at a fixed learning rate
         0.05 and momentum 0.9: Kfac(model=model, adaptive=True,
         momentum_type="regular", learning_rate=0.05, momentum=0.9)
  kfac_minibatch   (only when asked) Kfac(model=model, adaptive=True,
         recipe="minibatch", learning_rate=0.05)
  kfac_auto        (only when asked) Kfac(model=model, adaptive=True,
         recipe="auto"): its measured gradient noise scale and the step it
         switched to the minibatch recipe at (if it did) are recorded
  kfac_unbounded   (only when asked) Kfac(model=model, adaptive=True,
         qmodel_momentum_bound=None): the quadratic model's momentum
         unbounded (kfac 0.2.x's solve; the recipe bounds it by 1)
  kfac_blocks512   (only when asked) Kfac(model=model, adaptive=True,
         factor_block_size=512): factors wider than 512 rows as their
         diagonal blocks

one fresh worker process builds the model from the same seed (so the same
initial weights), compiles it and measures, with batch --batch_size:

  first call   wall and CPU seconds of the first train_on_batch (tracing the
               train step and one step) and the peak resident memory after it
  ms/step      the median wall time between Keras's on_train_batch_end
               callbacks in one fit call of --steps steps (the first 5
               left out), over the same batches for every optimizer
  loss         the training loss at equal steps (mean of the last 10 batch
               losses) and at equal time (the same, over the 10 steps
               before the time the fastest optimizer finished, timed from
               the end of fit's first step, which traces fit's train
               function: Keras traces it apart from train_on_batch's)
  validation   loss and accuracy on --val_examples held-out examples
  coverage     (kfac) the share of trainable parameters under non-diagonal
               (Kronecker or full) blocks, the layers that fell back to the
               generic diagonal, and the layers under diagonal blocks

Writes keras_zoo.md (table), keras_zoo.json ("runs"; "tables": "zoo", the
.md's text, what the docs render) and keras_zoo.png (training loss against
step per model) to --output_dir.

  python examples/benchmarks/keras_zoo.py                    # all models
  python examples/benchmarks/keras_zoo.py --models=vit,gpt --steps=100
  python examples/benchmarks/keras_zoo.py --size=tiny --steps=8  # smoke run
"""

import json
import os
import resource
import subprocess
import sys
import time

from absl import app
from absl import flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# pylint: disable=g-import-not-at-top,wrong-import-position
import machine
import results_files
import zoo_models

OPTIMIZERS = ("kfac", "adam", "muon", "kfac_fixed_rate", "kfac_minibatch",
              "kfac_auto", "kfac_blocks512", "kfac_unbounded")
DEFAULT_OPTIMIZERS = ("kfac", "adam", "muon")

flags.DEFINE_list("models", list(zoo_models.NAMES), "Zoo models to run.")
flags.DEFINE_list("optimizers", list(DEFAULT_OPTIMIZERS),
                  "Optimizers to run (%s)." % ", ".join(OPTIMIZERS))
flags.DEFINE_enum("size", "full", ["full", "tiny"], "Model size.")
flags.DEFINE_integer("steps", 200, "fit steps per run.")
flags.DEFINE_integer("batch_size", 64, "Batch size.")
flags.DEFINE_integer("val_examples", 1000, "Held-out examples.")
flags.DEFINE_integer("seed", 0, "Seed of the weights and the data.")
flags.DEFINE_string("output_dir", "bench_results", "Where to write.")
flags.DEFINE_string("worker", None, "(internal) run one model,optimizer.")
FLAGS = flags.FLAGS


def make_optimizer(name, model):
  import keras
  if name == "kfac":
    import kfac  # pylint: disable=unused-import
    import kfac.keras
    return kfac.keras.optimizers.Kfac(model=model, adaptive=True)
  if name == "kfac_fixed_rate":
    import kfac.keras
    return kfac.keras.optimizers.Kfac(
        model=model, adaptive=True, momentum_type="regular",
        learning_rate=0.05, momentum=0.9)
  if name in ("kfac_minibatch", "kfac_auto", "kfac_blocks512",
              "kfac_unbounded"):
    import kfac.keras
    kwargs = {"kfac_minibatch": dict(recipe="minibatch", learning_rate=0.05),
              "kfac_auto": dict(recipe="auto"),
              "kfac_blocks512": dict(factor_block_size=512),
              "kfac_unbounded": dict(qmodel_momentum_bound=None)}[name]
    return kfac.keras.optimizers.Kfac(model=model, adaptive=True, **kwargs)
  if name == "adam":
    return keras.optimizers.Adam(1e-3)
  if name == "muon":
    return keras.optimizers.Muon()
  raise ValueError("unknown optimizer %r; one of %s" % (name, OPTIMIZERS))


class _Clock(object):
  """Time and running-mean loss at the end of every batch of one fit."""

  def __init__(self):
    import keras

    clock = self

    class Callback(keras.callbacks.Callback):

      def on_train_batch_end(self, batch, logs=None):
        clock.times.append(time.perf_counter())
        clock.means.append(float(logs["loss"]))

    self.times, self.means = [], []
    self.callback = Callback()

  def losses(self):
    """Per-batch losses from Keras's running means."""
    out, previous = [], 0.0
    for k, mean in enumerate(self.means, 1):
      out.append(k * mean - (k - 1) * previous)
      previous = mean
    return out


def run_worker(model_name, opt_name):
  """One (model, optimizer) run; returns the result dict."""
  import numpy as np
  import keras
  keras.utils.set_random_seed(FLAGS.seed)
  model = zoo_models.build(model_name, FLAGS.size)
  n, b = FLAGS.steps * FLAGS.batch_size, FLAGS.batch_size
  x, y = zoo_models.data(model_name, n + b, FLAGS.seed)
  vx, vy = zoo_models.data(model_name, FLAGS.val_examples, FLAGS.seed + 1)
  opt = make_optimizer(opt_name, model)
  model.compile(optimizer=opt, loss=zoo_models.loss(model_name),
                metrics=["accuracy"])
  result = {"model": model_name, "optimizer": opt_name,
            "parameters": int(model.count_params())}
  wall, cpu = time.perf_counter(), time.process_time()
  model.train_on_batch(x[n:], y[n:])  # a batch fit never sees
  result["first_call_s"] = time.perf_counter() - wall
  result["first_call_cpu_s"] = time.process_time() - cpu
  result["peak_rss_gb"] = (
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6)
  clock = _Clock()
  start = time.perf_counter()
  model.fit(x[:n], y[:n], batch_size=b, epochs=1, shuffle=False, verbose=0,
            callbacks=[clock.callback])
  steps = np.diff([start] + clock.times)
  result["ms_per_step"] = float(np.median(steps[5:] if len(steps) > 8
                                          else steps) * 1000)
  result["elapsed"] = [float(t - start) for t in clock.times]
  result["losses"] = clock.losses()
  val = model.evaluate(vx, vy, batch_size=b, verbose=0, return_dict=True)
  result["val_loss"] = float(val["loss"])
  result["val_accuracy"] = float(val["accuracy"])
  if opt_name == "kfac_auto":
    noise = float(opt.noise_scale)
    result["noise_scale"] = noise if np.isfinite(noise) else None
    result["switched_at"] = int(opt.recipe_switched_at)
  if opt_name == "kfac":
    report = opt.registration_report
    kron, generic, fallbacks, diagonal = zoo_models.weight_shares(
        model, report)
    result.update(kron_share=kron, generic_share=generic,
                  fallbacks=fallbacks, diagonal=diagonal, report=report)
  return result


def _spawn(model_name, opt_name):
  argv = [sys.executable, os.path.abspath(__file__),
          "--worker=%s,%s" % (model_name, opt_name),
          "--size=%s" % FLAGS.size, "--steps=%d" % FLAGS.steps,
          "--batch_size=%d" % FLAGS.batch_size,
          "--val_examples=%d" % FLAGS.val_examples,
          "--seed=%d" % FLAGS.seed]
  proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        text=True, check=False)
  for line in reversed(proc.stdout.splitlines()):
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT "):])
  tail = (proc.stderr or "").strip().splitlines()[-5:]
  return {"model": model_name, "optimizer": opt_name,
          "error": " | ".join(tail) or "exit %d" % proc.returncode}


def _mean_tail(values, count=10):
  tail = values[-count:]
  return sum(tail) / len(tail) if tail else float("nan")


def equal_time_losses(runs):
  """{optimizer: loss over the 10 steps before the time the fastest
  optimizer finished}, the clock started at the end of fit's first step
  (which traces fit's train function again after train_on_batch's)."""
  ok = [r for r in runs if "error" not in r and len(r["elapsed"]) > 1]
  if not ok:
    return {}
  horizon = min(r["elapsed"][-1] - r["elapsed"][0] for r in ok)
  out = {}
  for r in ok:
    k = sum(1 for t in r["elapsed"][1:]
            if t - r["elapsed"][0] <= horizon + 1e-9)
    out[r["optimizer"]] = _mean_tail(r["losses"][1:1 + max(k, 1)])
  return out


def _fmt(value, pattern="%.3f"):
  return "-" if value is None else pattern % value


def table(results):
  """The markdown table, a row per model."""
  names = [o for o in OPTIMIZERS if o in FLAGS.optimizers]
  shown = " / ".join(names)
  header = ("| model | params | non-diagonal share (fallbacks) | first call "
            "s: kfac / adam (ratio) | peak RSS GB: kfac / adam | ms/step: "
            "%s (kfac/adam) | loss at equal steps: %s | loss at equal "
            "time: %s | val acc: %s |" % (shown, shown, shown, shown))
  lines = [header, "|" + "---|" * (header.count("|") - 1)]
  for model in dict.fromkeys(FLAGS.models):
    runs = {r["optimizer"]: r for r in results if r["model"] == model}
    def get(opt, key):
      r = runs.get(opt)
      return None if r is None or "error" in r else r.get(key)
    errors = ["%s: %s" % (o, r["error"][:80]) for o, r in runs.items()
              if "error" in r]
    kf = runs.get("kfac", {})
    coverage = "-"
    if "kron_share" in kf:
      coverage = "%.1f%% (%s)" % (100 * kf["kron_share"],
                                  ", ".join(kf["fallbacks"]) or "none")
    ratio = lambda a, b: ("%.2fx" % (a / b)) if a and b else "-"
    at_time = equal_time_losses(list(runs.values()))
    at_steps = {o: _mean_tail(get(o, "losses") or []) if get(o, "losses")
                else None for o in names}
    lines.append("| %s | %s | %s | %s / %s (%s) | %s / %s | %s "
                 "(%s) | %s | %s | %s |%s" % (
                     model, _fmt(get("kfac", "parameters") or
                                 get("adam", "parameters"), "%d"),
                     coverage,
                     _fmt(get("kfac", "first_call_s"), "%.1f"),
                     _fmt(get("adam", "first_call_s"), "%.1f"),
                     ratio(get("kfac", "first_call_s"),
                           get("adam", "first_call_s")),
                     _fmt(get("kfac", "peak_rss_gb"), "%.2f"),
                     _fmt(get("adam", "peak_rss_gb"), "%.2f"),
                     " / ".join(_fmt(get(o, "ms_per_step"), "%.1f")
                                for o in names),
                     ratio(get("kfac", "ms_per_step"),
                           get("adam", "ms_per_step")),
                     " / ".join(_fmt(at_steps.get(o)) for o in names),
                     " / ".join(_fmt(at_time.get(o)) for o in names),
                     " / ".join(_fmt(get(o, "val_accuracy")) for o in
                                names),
                     (" errors: " + "; ".join(errors)) if errors else ""))
  notes = []
  for r in results:
    if r.get("optimizer") == "kfac_auto" and "error" not in r:
      noise = r.get("noise_scale")
      notes.append("%s B_simple %s, %s" % (
          r["model"], "-" if noise is None else "%.4g" % noise,
          "the minibatch recipe from step %d" % r["switched_at"]
          if r.get("switched_at", -1) >= 0 else "the exact recipe throughout"))
  if notes:
    lines += ["", "recipe='auto' (the gradient noise scale it measured, at "
              "batch %d, and the recipe it chose): %s." % (
                  FLAGS.batch_size, "; ".join(notes))]
  return "\n".join(lines)


def plot(results, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  models = [m for m in FLAGS.models
            if any(r["model"] == m and "losses" in r for r in results)]
  if not models:
    return
  cols = min(3, len(models))
  rows = (len(models) + cols - 1) // cols
  fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.5 * rows),
                           squeeze=False)
  for ax, model in zip(axes.flat, models):
    for r in results:
      if r["model"] == model and "losses" in r:
        losses = r["losses"]
        smooth = [_mean_tail(losses[:k + 1]) for k in range(len(losses))]
        ax.plot(range(1, len(smooth) + 1), smooth, label=r["optimizer"])
    ax.set_title(model)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (10-step mean)")
    ax.legend()
  for ax in list(axes.flat)[len(models):]:
    ax.axis("off")
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def main(argv):
  del argv
  if FLAGS.worker:
    model_name, opt_name = FLAGS.worker.split(",")
    print("RESULT " + json.dumps(run_worker(model_name, opt_name)),
          flush=True)
    return
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  results = []
  for model in FLAGS.models:
    for opt in FLAGS.optimizers:
      r = _spawn(model, opt)
      results.append(r)
      print("%-15s %-5s %s" % (model, opt, r.get("error") or
                              "first call %.1f s, %.1f ms/step, loss %.3f"
                              " -> %.3f, val acc %.3f" % (
                                  r["first_call_s"], r["ms_per_step"],
                                  r["losses"][0], _mean_tail(r["losses"]),
                                  r["val_accuracy"])), flush=True)
  text = table(results)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  md = ("Keras zoo, batch %d, %d steps, size %s; %s, %s, %d cores, TF %s, "
        "default threads, one run at a time\n\n%s\n" % (
            FLAGS.batch_size, FLAGS.steps, FLAGS.size,
            time.strftime("%Y-%m-%d"), machine.cpu_name(),
            os.cpu_count() or 0, tf.__version__, text))
  results_files.write(FLAGS.output_dir, "keras_zoo", md,
                      dict(runs=results, tables=dict(zoo=md.strip())))
  plot(results, os.path.join(FLAGS.output_dir, "keras_zoo.png"))
  print(text)
  failed = [r for r in results if "error" in r]
  if failed:
    sys.exit("keras_zoo: %d run(s) failed" % len(failed))


if __name__ == "__main__":
  app.run(main)
