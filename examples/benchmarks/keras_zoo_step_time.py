r"""CPU milliseconds per `model.fit` step: Kfac(adaptive=True) against Adam on
real Keras models (issue 32: the default recipe at most 2.5x Adam's step).

Models: the Keras model zoo of zoo_models.py (keras.applications
MobileNetV2 (alpha 0.35), ResNet50, EfficientNetB0 on 32x32x3; a small BN
ResNet, a ViT, a GPT-style causal transformer, LSTM and GRU text
classifiers), its data and losses, batch 64.

Configurations: `adam` (keras.optimizers.Adam(1e-3)) and `kfac`
(kfac.keras.optimizers.Kfac(model=..., loss=..., adaptive=True), the
default recipe); `kfac_full_patches` is the recipe with every conv patch in
the input statistics (the recipe before it sub-sampled them);
`kfac_qmodel_half` the recipe with qmodel_batch_fraction=0.5 (the quadratic
model's curvature products on half of each batch); `kfac_dw_all_patches`
the recipe with every patch in the depthwise convolutions' input
statistics (the recipe before it sub-sampled them); `kfac_fixed_rate` the
recipe at a fixed learning rate 0.05 and momentum 0.9 (momentum_type
"regular": no quadratic model, only the damping adapted);
`kfac_invert_every30` and `kfac_cov_update_every4` the recipe with its
inverses every 30 steps (not 10) and its statistics every 4 (not 2);
`kfac_no_statistics` the recipe whose statistics stop after the burn-in
(cov_update_every=10**6), `kfac_fixed_rate_no_statistics` the same at the
fixed rate, and `kfac_fixed_rate_frozen` that with the inverses stopped
too (invert_every=10**6: preconditioning and bookkeeping only, with the
burn-in's factors): what each part of a step costs (docs/recipe.md,
"Where a step goes"). Any K-FAC configuration with the suffix `_blocksB`
(e.g. `kfac_minibatch_blocks256`) is that configuration with
factor_block_size=B (factors wider than B rows as their diagonal blocks,
docs/approximations.md).

Measurement: one process per model, TensorFlow limited to one thread
(intra- and inter-op), so that the CPU time of a step does not depend on
what else runs on the machine; every configuration is built and warmed up
with `--warmup_steps` steps (past K-FAC's 5 burn-in steps, whose inverses
are recomputed on every step but the first), each takes one more untimed
step once all are built (the first fit call after other models were built
costs seconds more), then the configurations alternate in
`--rounds` rounds (order reversed every other round) of one `fit` call of
`--steps` steps each (a multiple of the inverse period, 10). ms/step is
the process CPU time of the fit call / steps, the best round (the least
disturbed; the median is printed too).

Writes keras_zoo_step_time.md and .json ("runs"; "tables": "step_time",
the .md's table, what the docs render) to --output_dir.

  python examples/benchmarks/keras_zoo_step_time.py                # ~10 min
  python examples/benchmarks/keras_zoo_step_time.py --models=resnet,transformer
"""

import json
import os
import subprocess
import sys
import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# pylint: disable=g-import-not-at-top,wrong-import-position
import results_files
import zoo_models

MODELS = zoo_models.NAMES
CONFIGS = ("adam", "kfac", "kfac_full_patches", "kfac_qmodel_half",
           "kfac_dw_all_patches", "kfac_fixed_rate", "kfac_invert_every30",
           "kfac_cov_update_every4", "kfac_no_statistics",
           "kfac_fixed_rate_no_statistics", "kfac_fixed_rate_frozen",
           "kfac_minibatch", "kfac_minibatch_dw_diagonal",
           "kfac_minibatch_diagonal_norms")
# Statistics (or inverses) "never" after the burn-in: the step's other parts
# alone, to split what K-FAC adds (the factors and inverses of the burn-in
# steps stay in use).
NEVER = 10 ** 6
flags.DEFINE_list("models", ["mobilenetv2", "bn_resnet", "efficientnetb0",
                             "vit", "gpt"], "Which models (%s)." %
                  ", ".join(MODELS))
flags.DEFINE_list("configs", ["adam", "kfac"], "Which configurations (adam, "
                  "kfac, kfac_full_patches, kfac_qmodel_half, "
                  "kfac_dw_all_patches, kfac_fixed_rate, "
                  "kfac_invert_every30, kfac_cov_update_every4, "
                  "kfac_no_statistics, kfac_fixed_rate_no_statistics, "
                  "kfac_fixed_rate_frozen); the first is the baseline.")
flags.DEFINE_integer("batch_size", 64, "Mini-batch size.")
flags.DEFINE_integer("steps", 20, "Steps per timed fit call.")
flags.DEFINE_integer("warmup_steps", 10, "Untimed steps after the build.")
flags.DEFINE_integer("rounds", 3, "Alternating timed rounds.")
flags.DEFINE_string("output_dir", "/tmp/kfac_keras_zoo_bench", "Where to "
                    "write the table.")
flags.DEFINE_string("worker", None, "Internal: time one model in this "
                    "process.")

def data(name, n):
  return zoo_models.data(name, n, seed=0)


def split_blocks(config):
  """(the configuration, B) of "<configuration>_blocksB"; (config, None)
  without the suffix."""
  head, sep, size = config.rpartition("_blocks")
  if sep and head in CONFIGS and size.isdigit():
    return head, int(size)
  return config, None


def present_classes(model, options):
  """`options` ({layer class: value}) without the classes of which `model`
  has no layer (a model without depthwise convolutions runs
  kfac_dw_all_patches as kfac)."""
  layers = list(model._flatten_layers(include_self=False))  # pylint: disable=protected-access
  return {cls: value for cls, value in options.items()
          if any(isinstance(layer, cls) for layer in layers)}


def make(keras, kfac_keras, name, config):
  config, block_size = split_blocks(config)
  keras.utils.set_random_seed(0)
  model = zoo_models.build(name)
  loss = zoo_models.loss(name)
  if config == "adam":
    opt = keras.optimizers.Adam(1e-3)
  elif config in CONFIGS:
    kwargs = {}
    if config == "kfac_qmodel_half":
      kwargs["qmodel_batch_fraction"] = 0.5
    if config == "kfac_full_patches":
      kwargs["registration_options"] = {
          keras.layers.Conv2D: {"sub_sample_patches": False}}
    if config.startswith("kfac_fixed_rate"):  # no quadratic model
      kwargs.update(momentum_type="regular", learning_rate=0.05,
                    momentum=0.9)
    if config.endswith(("no_statistics", "frozen")):
      kwargs["cov_update_every"] = NEVER
    if config.endswith("frozen"):
      kwargs["invert_every"] = NEVER
    if config == "kfac_invert_every30":  # what the inverses cost
      kwargs["invert_every"] = 30
    if config == "kfac_cov_update_every4":  # what the statistics cost
      kwargs["cov_update_every"] = 4
    if config.startswith("kfac_minibatch"):
      # The recipe for noisy minibatches (issue 53, docs/recipe.md).
      kwargs.update(recipe="minibatch", learning_rate=0.05)
    if config == "kfac_minibatch_dw_diagonal":
      # ... with the depthwise convolutions' cheapest block.
      kwargs["fisher_approx"] = {keras.layers.DepthwiseConv2D: "diagonal"}
    if config == "kfac_minibatch_diagonal_norms":
      # ... and the normalisation layers' too.
      kwargs["fisher_approx"] = {
          keras.layers.DepthwiseConv2D: "diagonal",
          keras.layers.BatchNormalization: "diagonal"}
    if block_size:
      kwargs["factor_block_size"] = block_size
    if config == "kfac_dw_all_patches":
      kwargs["registration_options"] = {
          keras.layers.DepthwiseConv2D: {"sub_sample_patches": False}}
    for key in ("registration_options", "fisher_approx"):
      if key in kwargs:  # Kfac refuses a layer class the model lacks
        kwargs[key] = present_classes(model, kwargs[key])
    opt = kfac_keras.optimizers.Kfac(model=model, loss=loss, adaptive=True,
                                     **kwargs)
  else:
    raise ValueError("unknown configuration %r" % config)
  model.compile(optimizer=opt, loss=loss)
  return model


def worker(name):
  """Times FLAGS.configs on one model in this process; prints one JSON
  line."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.threading.set_intra_op_parallelism_threads(1)
  tf.config.threading.set_inter_op_parallelism_threads(1)
  import keras  # pylint: disable=g-import-not-at-top
  import kfac.keras as kfac_keras  # pylint: disable=g-import-not-at-top
  x, y = data(name, 4 * FLAGS.batch_size)
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
      FLAGS.batch_size)
  models, first, times, losses = {}, {}, {}, {}
  for config in FLAGS.configs:
    wall, cpu = time.time(), time.process_time()
    models[config] = make(keras, kfac_keras, name, config)
    models[config].fit(dataset, steps_per_epoch=FLAGS.warmup_steps,
                       epochs=1, verbose=0)
    first[config] = dict(wall_s=time.time() - wall,
                         cpu_s=time.process_time() - cpu)
    times[config], losses[config] = [], []
  # A model's first fit call after other models were built and fitted in
  # the process costs seconds more (the function runtime's, not a trace:
  # on 2026-11-29 MobileNetV2's recipe took 1945 ms/step in the first
  # 20-step round against 173 in the second, Adam 368 against 54). One
  # untimed step of each configuration, after all are built, pays it.
  for config in FLAGS.configs:
    models[config].fit(dataset, steps_per_epoch=1, epochs=1, verbose=0)
  for r in range(FLAGS.rounds):
    order = list(FLAGS.configs) if r % 2 == 0 else list(FLAGS.configs)[::-1]
    for config in order:
      cpu = time.process_time()
      history = models[config].fit(dataset, steps_per_epoch=FLAGS.steps,
                                   epochs=1, verbose=0)
      times[config].append((time.process_time() - cpu) / FLAGS.steps * 1e3)
      losses[config].append(float(history.history["loss"][-1]))
  result = {config: dict(ms_best=min(times[config]),
                         ms_median=float(np.median(times[config])),
                         ms_rounds=times[config], last_loss=losses[config][-1],
                         build_and_warmup=first[config])
            for config in FLAGS.configs}
  print("RESULT " + json.dumps(dict(model=name, configs=result)), flush=True)


def table(results):
  base = FLAGS.configs[0]
  head = ["model"] + ["%s ms/step" % c for c in FLAGS.configs] + [
      "%s / %s" % (c, base) for c in FLAGS.configs[1:]]
  lines = ["| " + " | ".join(head) + " |",
           "|" + "---|" + "---:|" * (len(head) - 1)]
  for res in results:
    cfg = res["configs"]
    cells = [res["model"]] + ["%.1f (median %.1f)" % (
        cfg[c]["ms_best"], cfg[c]["ms_median"]) for c in FLAGS.configs]
    cells += ["%.2fx" % (cfg[c]["ms_best"] / cfg[base]["ms_best"])
              for c in FLAGS.configs[1:]]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  if FLAGS.worker:
    worker(FLAGS.worker)
    return
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  results = []
  for name in FLAGS.models:
    if name not in MODELS:
      raise app.UsageError("unknown model %r (choose from %s)" %
                           (name, ", ".join(MODELS)))
    args = [sys.executable, os.path.abspath(__file__), "--worker=" + name] + [
        "--%s=%s" % (k, v) for k, v in (
            ("configs", ",".join(FLAGS.configs)),
            ("batch_size", FLAGS.batch_size), ("steps", FLAGS.steps),
            ("warmup_steps", FLAGS.warmup_steps), ("rounds", FLAGS.rounds))]
    out = subprocess.run(args, capture_output=True, text=True, check=False)
    rows = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if out.returncode != 0 or not rows:
      raise RuntimeError("worker %s failed:\n%s" % (name, out.stderr[-3000:]))
    results.append(json.loads(rows[-1][len("RESULT "):]))
    print(table(results[-1:]), flush=True)
  text = table(results)
  results_files.write(FLAGS.output_dir, "keras_zoo_step_time", text,
                      dict(runs=results, tables=dict(step_time=text.strip())))
  print(text)


if __name__ == "__main__":
  app.run(main)
