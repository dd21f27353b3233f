"""The first `train_on_batch` of a keras.applications model (trace + first
step) with Kfac(adaptive=True) (kfac_noise: with the gradient noise
scale's measurement, kfac_no_noise: without it, as the default now;
kfac_blocksB: with factor_block_size=B; kfac_calibrate_all: every burn-in
step calibrating, num_calibration_steps=5, so the first call inverts) or
Adam: wall and process CPU seconds, the
mean of the next 3 steps (wall and CPU ms), and the peak resident memory
(after the first call and at the end). One model and optimizer per
process; run them one at a time (a K-FAC run takes minutes and GBs):

  .venv/bin/python examples/benchmarks/keras_first_step.py effnet kfac \
      [OUTPUT_DIR]
  .venv/bin/python examples/benchmarks/keras_first_step.py --table OUTPUT_DIR

With OUTPUT_DIR the run is also added to OUTPUT_DIR/keras_first_step.json
("runs"), and the table of them (per model, the latest run of each
configuration, ratios to Adam's) is rewritten: keras_first_step.md and the
JSON's "tables" ("first_step"); --table writes keras_first_step.md alone.

Models: effnet (EfficientNetB0), resnet50 (ResNet50), mobilenetv2
(MobileNetV2, alpha 0.35); all weights=None, 32x32x3 inputs, 10 classes,
batch 64 of random data. Results: docs/benchmarks.md ("First step on
keras.applications models").
"""

import datetime
import json
import os
import resource
import sys
import time

import numpy as np

import machine  # (examples/benchmarks, the script's folder)


def main(argv):
  if len(argv) == 3 and argv[1] == "--table":
    print(write_table(argv[2]))
    return
  out_dir = argv[3] if len(argv) == 4 else None
  argv = argv[:3]
  if len(argv) != 3 or argv[1] not in BUILDERS or (
      argv[2] != "adam" and kfac_kwargs(argv[2]) is None):
    sys.exit("usage: keras_first_step.py {%s} {adam,%s,kfac_blocksB} "
             "[OUTPUT_DIR] | --table OUTPUT_DIR"
             % (",".join(sorted(BUILDERS)), ",".join(KFAC_CONFIGS)))
  import keras  # pylint: disable=g-import-not-at-top
  import kfac  # pylint: disable=g-import-not-at-top
  name, opt_name = argv[1], argv[2]
  keras.utils.set_random_seed(0)
  model = BUILDERS[name](keras)
  x = np.random.RandomState(0).rand(64, 32, 32, 3).astype("float32")
  y = np.random.RandomState(1).randint(0, 10, 64)
  loss = keras.losses.SparseCategoricalCrossentropy()
  if opt_name == "adam":
    opt = keras.optimizers.Adam(1e-3)
  else:
    opt = kfac.keras.optimizers.Kfac(model=model, loss=loss, adaptive=True,
                                     **kfac_kwargs(opt_name))
  model.compile(optimizer=opt, loss=loss)
  wall0, cpu0 = time.time(), time.process_time()
  model.train_on_batch(x, y)
  wall1, cpu1 = time.time(), time.process_time()
  rss_first = _peak_rss_gb()
  for _ in range(3):
    model.train_on_batch(x, y)
  wall2, cpu2 = time.time(), time.process_time()
  record = dict(
      model=name, config=opt_name, first_call_wall_s=wall1 - wall0,
      first_call_cpu_s=cpu1 - cpu0, next_steps_ms=(wall2 - wall1) / 3 * 1000,
      next_steps_cpu_ms=(cpu2 - cpu1) / 3 * 1000, peak_rss_gb=_peak_rss_gb(),
      peak_rss_after_first_call_gb=rss_first,
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
      machine=_machine())
  if out_dir:
    os.makedirs(out_dir, exist_ok=True)
    _write_runs(out_dir, _read_runs(out_dir) + [record])
  print("RESULT %s %s first_call_wall=%.1f s first_call_cpu=%.1f s "
        "next_steps_ms=%.0f next_steps_cpu_ms=%.0f peak_rss=%.2f GB "
        "peak_rss_after_first_call=%.2f GB" % (
            name, opt_name, wall1 - wall0, cpu1 - cpu0,
            (wall2 - wall1) / 3 * 1000, (cpu2 - cpu1) / 3 * 1000,
            _peak_rss_gb(), rss_first),
        flush=True)


# The K-FAC configurations: Kfac(adaptive=True) with these arguments.
KFAC_CONFIGS = {
    "kfac": {},  # the default recipe (no gradient noise scale)
    "kfac_noise": dict(noise_scale_steps=5),  # measuring the noise scale
    # the default, the noise scale's measurement explicitly off
    "kfac_no_noise": dict(noise_scale_steps=0, noise_scale_every=0),
    # all 5 burn-in steps calibrating, so the first call inverts
    "kfac_calibrate_all": dict(num_calibration_steps=5),
}


def kfac_kwargs(config):
  """Kfac's arguments beyond adaptive=True for a K-FAC configuration name
  (kfac_blocksB: factors wider than B rows as their diagonal blocks), or
  None for a name that is none."""
  if config in KFAC_CONFIGS:
    return dict(KFAC_CONFIGS[config])
  blocks = config[len("kfac_blocks"):]
  if config.startswith("kfac_blocks") and blocks.isdigit():
    return dict(factor_block_size=int(blocks))
  return None


def _machine():
  return "%s, %d cores" % (machine.cpu_name(), os.cpu_count() or 0)


def write_table(out_dir, runs=None):
  """OUTPUT_DIR/keras_first_step.md from its JSON: per model, Adam's first
  call (CPU s, peak GB after it) and each K-FAC configuration's with its
  ratios to Adam's, and the mean of the next 3 steps (CPU ms); the latest
  run of each (model, configuration)."""
  runs = _read_runs(out_dir) if runs is None else runs
  latest = {}
  for r in runs:
    latest[(r["model"], r["config"])] = r
  lines = ["First `train_on_batch` of keras.applications models (32x32x3, "
           "batch 64; `keras_first_step.py MODEL CONFIG DIR`, one process at "
           "a time; %s): CPU seconds and peak resident memory after the "
           "first call, ratios to Adam's; next steps: the mean CPU ms of the "
           "3 calls after it (K-FAC's burn-in steps)." % (
               runs[-1]["machine"] if runs else "?"), "",
           "| model | configuration | first call CPU s | / Adam | peak GB | "
           "/ Adam | next steps CPU ms |", "|---|---|---:|---:|---:|---:|---:|"]
  for model in sorted({m for m, _ in latest}):
    adam = latest.get((model, "adam"))
    configs = sorted((c for m, c in latest if m == model),
                     key=lambda c: (c != "adam", c))
    for config in configs:
      r = latest[(model, config)]

      def ratio(key, r=r):
        return "%.2fx" % (r[key] / adam[key]) if adam else "-"
      lines.append("| %s | %s | %.1f | %s | %.2f | %s | %.0f |" % (
          model, config, r["first_call_cpu_s"], ratio("first_call_cpu_s"),
          r["peak_rss_after_first_call_gb"],
          ratio("peak_rss_after_first_call_gb"), r["next_steps_cpu_ms"]))
  text = "\n".join(lines) + "\n"
  with open(os.path.join(out_dir, "keras_first_step.md"), "w") as f:
    f.write(text)
  return text


def _read_runs(out_dir):
  """The runs recorded in OUTPUT_DIR/keras_first_step.json (a list of runs
  in files written before it held its table too)."""
  path = os.path.join(out_dir, "keras_first_step.json")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    data = json.load(f)
  return data if isinstance(data, list) else data["runs"]


def _write_runs(out_dir, runs):
  """keras_first_step.json: the runs and the table of them (what the docs
  render, the same text as keras_first_step.md, which it rewrites)."""
  text = write_table(out_dir, runs)
  with open(os.path.join(out_dir, "keras_first_step.json"), "w") as f:
    json.dump(dict(runs=runs, tables=dict(first_step=text.strip())), f,
              indent=1)


def _peak_rss_gb():
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


BUILDERS = {
    "effnet": lambda keras: keras.applications.EfficientNetB0(
        weights=None, input_shape=(32, 32, 3), classes=10),
    "resnet50": lambda keras: keras.applications.ResNet50(
        weights=None, input_shape=(32, 32, 3), classes=10),
    "mobilenetv2": lambda keras: keras.applications.MobileNetV2(
        weights=None, input_shape=(32, 32, 3), classes=10, alpha=0.35),
}


if __name__ == "__main__":
  main(sys.argv)
