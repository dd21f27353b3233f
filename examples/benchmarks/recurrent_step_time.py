r"""CPU milliseconds per `model.fit` step of Keras LSTM / GRU models: Adam
against Kfac(adaptive=True), with cost ablations (issue 32 item 2).

The model is keras_validation.py's `rnn` workload (val_workloads.py: an
RNN of --units over the 28 rows of a 28 x 28 image, Dense 10, batch 256),
with a GRU or an LSTM, on random data of those shapes (the cost does not
depend on the values).

Configurations (--configs):
  adam          keras.optimizers.Adam(1e-3)
  adam_rec      Adam on K-FAC's recorded formulation of the layer
                (kfac/python/keras/recurrent.py) instead of Keras's loop:
                the formulation's own forward + backward cost
  kfac          Kfac(model=..., loss=..., adaptive=True), the default recipe
  kfac_nostats  ... with cov_update_every=10**6 (no statistics after the
                warm-up)
  kfac_nodamp   ... with damping_adaptation_interval=10**6 (no damping rule
                after the warm-up)

Measurement: one process, TensorFlow limited to one thread (intra- and
inter-op); each configuration is built and warmed up with --warmup_steps
steps (past K-FAC's 5 burn-in steps), then the configurations alternate in
--rounds rounds (order reversed every other round) of one `fit` call of
--steps steps; ms/step is the process CPU time of the call / steps, the
best round (all rounds are printed too).

  python examples/benchmarks/recurrent_step_time.py              # ~3 min
  python examples/benchmarks/recurrent_step_time.py --cells=lstm \
      --configs=adam,adam_rec,kfac,kfac_nostats,kfac_nodamp
"""

import json
import os
import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS
CONFIGS = ("adam", "adam_rec", "kfac", "kfac_nostats", "kfac_nodamp")
flags.DEFINE_list("cells", ["gru", "lstm"], "gru and/or lstm.")
flags.DEFINE_list("configs", ["adam", "kfac"], "Which of %s." %
                  ", ".join(CONFIGS))
flags.DEFINE_integer("units", 128, "Recurrent units.")
flags.DEFINE_integer("time_steps", 28, "Time steps (and input width).")
flags.DEFINE_integer("batch_size", 256, "Mini-batch size.")
flags.DEFINE_integer("steps", 20, "Steps per timed fit call.")
flags.DEFINE_integer("warmup_steps", 12, "Untimed steps after the build.")
flags.DEFINE_integer("rounds", 3, "Alternating timed rounds.")
flags.DEFINE_string("output_dir", "/tmp/kfac_recurrent_step_time", "Where "
                    "to write recurrent_step_time.md and .json.")


def _model(keras, cell, recorded):
  """The rnn workload's model; recorded: the layer computed by K-FAC's
  recorded formulation (recurrent.call) in every call."""
  from kfac.python.keras import recurrent  # pylint: disable=g-import-not-at-top
  base = keras.layers.GRU if cell == "gru" else keras.layers.LSTM

  class Recorded(base):

    def call(self, sequences, initial_state=None, mask=None, training=False):
      return recurrent.call(self, (sequences,), {})[0]

  keras.utils.set_random_seed(0)
  t = FLAGS.time_steps
  inputs = keras.Input((t, t))
  x = (Recorded if recorded else base)(FLAGS.units)(inputs)
  return keras.Model(inputs, keras.layers.Dense(10, name="head")(x))


def _make(keras, kfac_keras, cell, config, loss):
  if config not in CONFIGS:
    raise ValueError("unknown configuration %r; one of %s" % (
        config, ", ".join(CONFIGS)))
  model = _model(keras, cell, recorded=config == "adam_rec")
  if config.startswith("adam"):
    opt = keras.optimizers.Adam(1e-3)
  else:
    kwargs = {}
    if config == "kfac_nostats":
      kwargs["cov_update_every"] = 10**6
    if config == "kfac_nodamp":
      kwargs["damping_adaptation_interval"] = 10**6
    opt = kfac_keras.optimizers.Kfac(model=model, loss=loss, adaptive=True,
                                     **kwargs)
  model.compile(optimizer=opt, loss=loss)
  return model


def main(argv):
  del argv
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.threading.set_intra_op_parallelism_threads(1)
  tf.config.threading.set_inter_op_parallelism_threads(1)
  import keras  # pylint: disable=g-import-not-at-top
  import kfac.keras  # pylint: disable=g-import-not-at-top

  b, t = FLAGS.batch_size, FLAGS.time_steps
  n = b * max(FLAGS.steps, FLAGS.warmup_steps)
  rng = np.random.RandomState(0)
  x = rng.rand(n, t, t).astype("float32")
  y = rng.randint(0, 10, n).astype("int32")
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  results = {}
  for cell in FLAGS.cells:
    models = {}
    for config in FLAGS.configs:
      models[config] = _make(keras, kfac.keras, cell, config, loss)
      models[config].fit(x[:b * FLAGS.warmup_steps],
                         y[:b * FLAGS.warmup_steps], batch_size=b,
                         epochs=1, verbose=0, shuffle=False)
    times = {c: [] for c in FLAGS.configs}
    for r in range(FLAGS.rounds):
      order = FLAGS.configs if r % 2 == 0 else FLAGS.configs[::-1]
      for config in order:
        start = time.process_time()
        models[config].fit(x[:b * FLAGS.steps], y[:b * FLAGS.steps],
                           batch_size=b, epochs=1, verbose=0, shuffle=False)
        times[config].append(
            1000.0 * (time.process_time() - start) / FLAGS.steps)
    results[cell] = times
    for config in FLAGS.configs:
      print("%s %s ms/step best %.1f rounds %s" % (
          cell, config, min(times[config]),
          " ".join("%.1f" % v for v in times[config])))

  base = FLAGS.configs[0]
  lines = ["| cell | configuration | ms/step (best) | / %s | rounds |" % base,
           "|---|---|---:|---:|---|"]
  for cell, times in results.items():
    for config in FLAGS.configs:
      lines.append("| %s | %s | %.1f | %.2fx | %s |" % (
          cell, config, min(times[config]),
          min(times[config]) / min(times[base]),
          " ".join("%.1f" % v for v in times[config])))
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  with open(os.path.join(FLAGS.output_dir, "recurrent_step_time.md"),
            "w") as f:
    f.write("\n".join(lines) + "\n")
  with open(os.path.join(FLAGS.output_dir, "recurrent_step_time.json"),
            "w") as f:
    json.dump({"flags": {k: getattr(FLAGS, k) for k in (
        "cells", "configs", "units", "time_steps", "batch_size", "steps",
        "warmup_steps", "rounds")}, "ms_per_step": results}, f, indent=1)
  print("\n".join(lines))


if __name__ == "__main__":
  app.run(main)
