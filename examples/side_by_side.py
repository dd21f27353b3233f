"""Optimizers trained side by side, fairly: the loop the kfac demos share.

Every optimizer starts from the same initial weights and sees the same
mini-batches. They take turns, a chunk of steps each, so that machine noise
slows all of them alike. Training time is measured with the evaluation
pauses taken out, and the final table compares the losses reached at the
same number of steps and at the same number of seconds.

A demo supplies one "backend" per optimizer, an object with

  batch(indices)  the mini-batch of the examples at `indices` (untimed);
                  called with None when the Trainer has no Batches (a
                  backend that draws its own batches, e.g. from a reader
                  inside its graph);
  train(batch)    one training step on it;
  evaluate()      the loss (a float) on a fixed evaluation set;
  shown()         a dict of scalars for the progress line ("damping", "lr",
                  "momentum", "rho", "batch");
  finish()        end of training: returns a dict of extra results for the
                  table (e.g. {"test accuracy": 0.87}) and frees resources.

How the step runs (a tf.compat.v1 Session, a tf.function) is the backend's
business.
"""

import json
import time

from absl import flags
import numpy as np
import tensorflow as tf

FLAGS = flags.FLAGS


def define_flags():
  """The flags every side-by-side demo has; call once, at import time.

  Flags whose default is None take a per-dataset default (see Config).
  """
  flags.DEFINE_enum("dataset", "auto", ["auto", "digits", "fashion_mnist"],
                    "Data: Fashion-MNIST when present ('auto') or sklearn "
                    "digits.")
  flags.DEFINE_integer("steps", 100000,
                       "Maximum training steps per optimizer (the --seconds "
                       "budget usually ends training first).")
  flags.DEFINE_float("seconds", None,
                     "Training-time budget per optimizer, in seconds "
                     "(default: per dataset).")
  flags.DEFINE_integer("batch_size", None, "Mini-batch size (default: per "
                       "dataset).")
  flags.DEFINE_integer("seed", 0, "Seed for weights, batches and sampling.")
  flags.DEFINE_integer("print_every", 100, "Print a progress line every N "
                       "steps (but see --print_seconds).")
  flags.DEFINE_float("print_seconds", 5.0, "Skip a progress line when less "
                     "than this many training seconds passed since the "
                     "last.")
  flags.DEFINE_integer("eval_every", 10, "Evaluate the loss on a fixed "
                       "subset every N steps (for the equal-time "
                       "comparison).")
  flags.DEFINE_integer("eval_examples", 2000, "Size of that fixed subset.")
  flags.DEFINE_integer("max_examples", 20000,
                       "Use at most this many Fashion-MNIST training "
                       "images.")
  flags.DEFINE_list("optimizers", ["kfac", "adam"], "Which optimizers to "
                    "run.")
  flags.DEFINE_integer("chunk_steps", 10, "The optimizers take turns, this "
                       "many steps each.")
  flags.DEFINE_string("results_json", None, "Also write the histories and "
                      "final results to this JSON file.")
  # K-FAC.
  flags.DEFINE_float("kfac_learning_rate", None, "K-FAC learning rate.")
  flags.DEFINE_float("kfac_damping", None, "K-FAC damping.")
  flags.DEFINE_float("kfac_momentum", 0.9, "K-FAC momentum.")
  flags.DEFINE_enum("kfac_momentum_type", None, ["regular", "adam"],
                    "K-FAC momentum type.")
  flags.DEFINE_float("kfac_norm_constraint", None, "K-FAC: bound on the "
                     "approximate squared Fisher norm of each update (None: "
                     "no bound).")
  flags.DEFINE_integer("invert_every", 10, "K-FAC: recompute the inverses "
                       "every N steps.")
  flags.DEFINE_float("cov_ema_decay", 0.95, "K-FAC statistics decay.")
  # Adam.
  flags.DEFINE_float("adam_learning_rate", None, "Adam learning rate.")


class Config(object):
  """The flags named in `defaults`, the unset ones filled from it."""

  def __init__(self, defaults):
    for key, value in defaults.items():
      flag = getattr(FLAGS, key)
      setattr(self, key, value if flag is None else flag)


def autoencoder_setup(dataset_defaults):
  """(dataset name, images, Config, mirrored layer sizes) of an autoencoder
  demo: --dataset's data and its defaults, --encoder mirrored."""
  # pylint: disable=g-import-not-at-top
  from absl import app
  import autoencoder_model
  import datasets
  name, data = datasets.load_autoencoder_data(
      prefer=FLAGS.dataset, max_examples=FLAGS.max_examples)
  if FLAGS.dataset == "fashion_mnist" and name != "fashion_mnist":
    raise app.UsageError("--dataset=fashion_mnist but it is not available; "
                         "run `make data`.")
  cfg = Config(dataset_defaults[name])
  hidden = [int(s) for s in cfg.encoder.split(",")]
  sizes = autoencoder_model.mirrored_sizes([data.shape[1]] + hidden)
  return name, data, cfg, sizes


def make_optimizer(opt_name, cfg, layer_collection=None):
  """(optimizer, {name: tensor or value shown in the progress lines})."""
  if opt_name == "kfac":
    import kfac  # pylint: disable=g-import-not-at-top
    opt = kfac.PeriodicInvCovUpdateKfacOpt(
        invert_every=FLAGS.invert_every,
        cov_update_every=1,
        learning_rate=cfg.kfac_learning_rate,
        damping=cfg.kfac_damping,
        layer_collection=layer_collection,
        momentum=FLAGS.kfac_momentum,
        momentum_type=cfg.kfac_momentum_type,
        cov_ema_decay=FLAGS.cov_ema_decay,
        norm_constraint=FLAGS.kfac_norm_constraint,
        estimation_mode="gradients")
    return opt, dict(damping=opt.damping, lr=opt.learning_rate)
  if opt_name == "adam":
    return (tf.compat.v1.train.AdamOptimizer(cfg.adam_learning_rate),
            dict(lr=cfg.adam_learning_rate))
  raise ValueError("unknown optimizer %r" % opt_name)


def new_layer_collection(opt_name):
  if opt_name != "kfac":
    return None
  import kfac  # pylint: disable=g-import-not-at-top
  return kfac.LayerCollection()


def print_hyperparameters(cfg):
  print("kfac: lr %g, damping %g, momentum %g (%s), invert_every %d;  "
        "adam: lr %g" % (cfg.kfac_learning_rate, cfg.kfac_damping,
                         FLAGS.kfac_momentum, cfg.kfac_momentum_type,
                         FLAGS.invert_every, cfg.adam_learning_rate))


class Batches(object):
  """The same sequence of mini-batch indices for every optimizer.

  Each epoch is a fresh permutation drawn from (seed, epoch), so any step's
  batch can be produced without storing the whole schedule.
  """

  def __init__(self, num_examples, batch_size, seed):
    self.num_examples = num_examples
    self.batch_size = min(batch_size, num_examples)
    self.per_epoch = num_examples // self.batch_size
    self.seed = seed
    self._epoch = None
    self._perm = None

  def indices(self, step):
    epoch, i = divmod(step, self.per_epoch)
    if epoch != self._epoch:
      self._epoch = epoch
      self._perm = np.random.RandomState([self.seed, epoch]).permutation(
          self.num_examples)
    return self._perm[i * self.batch_size:(i + 1) * self.batch_size]


class History(object):
  """(step, training seconds, eval loss) points of one run, and its extras."""

  def __init__(self, name):
    self.name = name
    self.steps = []
    self.seconds = []
    self.losses = []
    self.extra = {}
    self.shown = []  # backend.shown() at each evaluation, when recorded

  def add(self, step, seconds, loss):
    self.steps.append(step)
    self.seconds.append(seconds)
    self.losses.append(loss)

  @property
  def final_loss(self):
    return self.losses[-1]

  def loss_at(self, seconds):
    """Loss of the last evaluation made at or before `seconds`."""
    i = np.searchsorted(self.seconds, seconds, side="right") - 1
    return self.losses[max(i, 0)]

  def loss_at_step(self, step):
    """Loss of the last evaluation made at or before `step`."""
    i = np.searchsorted(self.steps, step, side="right") - 1
    return self.losses[max(i, 0)]

  def _first_reaching(self, axis, loss):
    for x, l in zip(axis, self.losses):
      if l <= loss:
        return x
    return None

  def seconds_to_reach(self, loss):
    """First training time at which the eval loss was <= `loss`, or None."""
    return self._first_reaching(self.seconds, loss)

  def steps_to_reach(self, loss):
    """First step at which the eval loss was <= `loss`, or None."""
    return self._first_reaching(self.steps, loss)

  def as_dict(self):
    d = dict(name=self.name, steps=self.steps, seconds=self.seconds,
             losses=self.losses, extra=self.extra)
    if self.shown:
      d["shown"] = self.shown
    return d


# The values a progress line shows, when the backend gives them, in order.
_SHOWN_FORMATS = (("damping", "%.0e"), ("lr", "%.0e"), ("momentum", "%.2f"),
                  ("rho", "%.2f"), ("batch", "%d"))


def format_shown(values):
  """The progress line's values. During a burn-in (values["burn_in"] true:
  the steps so far only gathered statistics and calibrated the damping, no
  update was applied) the learning rate and momentum mean nothing yet."""
  if values.get("burn_in"):
    parts = ["burn-in (statistics, damping calibration; no update)"]
    values = {k: v for k, v in values.items()
              if k not in ("lr", "momentum", "rho")}
  else:
    parts = []
  for key, value_format in _SHOWN_FORMATS:
    if key in values:
      parts.append(("%s " + value_format) % (key, values[key]))
  return "  ".join(parts)


def _error_summary(error):
  """The line of a TensorFlow error that says what went wrong, shortened."""
  lines = [l.strip() for l in str(error).splitlines() if l.strip()]
  for line in lines:
    if not (line.endswith(":") or line.startswith((
        "Detected at node", "Node:", "File ", "[["))):
      return line[:80]
  return lines[0][:80] if lines else type(error).__name__


class Trainer(object):
  """One optimizer's backend and clock; trains in short chunks.

  `batches` is a Batches, or None when the backend draws its own batches.
  With record_shown=True, backend.shown() is kept at every evaluation
  (History.shown, written by write_results).
  """

  def __init__(self, name, backend, batches, seconds, loss_format="%.2f",
               record_shown=False):
    self.name = name
    self.loss_format = loss_format
    self.backend = backend
    self.batches = batches
    self.seconds = seconds
    self.record_shown = record_shown
    self.history = History(name)
    self.step = 0
    self.train_seconds = 0.0
    self._evaluate()
    self.last_print = -np.inf
    self.done = False

  def run_chunk(self, num_steps):
    """Up to num_steps training steps; sets self.done at the budget's end."""
    for _ in range(num_steps):
      if self.step >= FLAGS.steps or self.train_seconds >= self.seconds:
        self.finish()
        return
      batch = self.backend.batch(
          None if self.batches is None else self.batches.indices(self.step))
      start = time.perf_counter()
      try:
        self.backend.train(batch)
      except tf.errors.InvalidArgumentError as e:
        # A diverged run: e.g. targets sampled from NaN logits fall outside
        # the classes. Reported like a NaN loss, not as a crash of the suite.
        self.train_seconds += time.perf_counter() - start
        print("[%s] step %d  diverged (%s): stopping this run" % (
            self.name, self.step + 1, _error_summary(e)), flush=True)
        self.history.add(self.step, self.train_seconds, float("nan"))
        self.finish()
        return
      self.train_seconds += time.perf_counter() - start
      self.step += 1
      if self.step % FLAGS.eval_every == 0:
        self._evaluate()
        if not np.isfinite(self.history.final_loss):
          print("[%s] step %d  loss is %s: stopping this run" % (
              self.name, self.step, self.history.final_loss), flush=True)
          self.finish()
          return
      if (self.step % FLAGS.print_every == 0 and
          self.train_seconds - self.last_print >= FLAGS.print_seconds):
        self.last_print = self.train_seconds
        print(("[%s] step %d  loss " + self.loss_format + "  %s  %.1fs") % (
            self.name, self.step, self.history.final_loss,
            format_shown(self.backend.shown()), self.train_seconds),
              flush=True)

  def _evaluate(self):
    self.history.add(self.step, self.train_seconds, self.backend.evaluate())
    if self.record_shown:
      self.history.shown.append(
          {k: float(v) for k, v in self.backend.shown().items()})

  def finish(self):
    if self.done:
      return
    if self.history.steps[-1] != self.step:
      self._evaluate()
    self.history.extra = dict(self.backend.finish())
    self.done = True
    extras = "".join(", %s %s" % (k, _format_value(v))
                     for k, v in self.history.extra.items())
    print(("[%s] done: %d steps in %.1fs, loss " + self.loss_format +
           "%s") % (
        self.name, self.step, self.train_seconds, self.history.final_loss,
        extras), flush=True)


def run_in_turns(trainers, chunk_steps):
  """Trains every trainer to the end of its budget, a chunk each in turn."""
  while not all(t.done for t in trainers):
    for t in trainers:
      if not t.done:
        t.run_chunk(chunk_steps)
  return [t.history for t in trainers]


def _format_value(value):
  if isinstance(value, float):
    return "%.4f" % value
  return str(value)


def _finite_or_inf(value):
  return value if np.isfinite(value) else np.inf


def print_table(histories, note, loss_format="%.2f"):
  """Side-by-side summary: losses at a common time and at a common step.

  Args:
    histories: the runs' History objects; their `extra` results become
      additional columns.
    note: a sentence printed under the table (what the losses are).
    loss_format: how to print a loss.
  """
  common = min(h.seconds[-1] for h in histories)
  common_step = min(h.steps[-1] for h in histories)
  # The loss every run reached: the worst finite final loss.
  finite = [h.final_loss for h in histories if np.isfinite(h.final_loss)]
  target = max(finite) if finite else np.nan
  extra_keys = []
  for h in histories:
    extra_keys += [k for k in h.extra if k not in extra_keys]
  print()
  print(("| optimizer | steps | seconds | ms/step | final loss | loss at %.1fs "
         "| loss at step %d | seconds to loss " + loss_format + " |%s") % (
             common, common_step, target,
             "".join(" %s |" % k for k in extra_keys)))
  print("|---|---:|---:|---:|---:|---:|---:|---:|%s" % (
      "---:|" * len(extra_keys)))
  for h in histories:
    reach = h.seconds_to_reach(target)
    loss_cells = " | ".join([loss_format] * 3)
    print(("| %s | %d | %.1f | %.1f | " + loss_cells + " | %s |%s") % (
        h.name, h.steps[-1], h.seconds[-1],
        1e3 * h.seconds[-1] / max(h.steps[-1], 1), h.final_loss,
        h.loss_at(common), h.loss_at_step(common_step),
        "-" if reach is None else "%.1f" % reach,
        "".join(" %s |" % _format_value(h.extra.get(k, "-"))
                for k in extra_keys)))
  print()
  print(note)
  if len(histories) > 1:
    for line in verdict_lines(histories, common, common_step, loss_format):
      print(line)
    for h in histories:
      if not np.isfinite(h.final_loss):
        print("%s diverged (loss %s)." % (h.name, h.final_loss))


def _verdict(label, losses, loss_format):
  """'<label>: <winner> wins, loss A vs B for <runner-up>' (or a tie)."""
  ranked = sorted(losses, key=lambda item: _finite_or_inf(item[1]))
  (best, best_loss), (second, second_loss) = ranked[0], ranked[1]
  if not np.isfinite(best_loss):
    return None
  if best_loss == second_loss:
    return ("%s: %s and %s tie at loss " + loss_format + ".") % (
        label, best, second, best_loss)
  return ("%s: %s wins, loss " + loss_format + " vs " + loss_format +
          " for %s.") % (label, best, best_loss, second_loss, second)


def verdict_lines(histories, common_seconds, common_step, loss_format="%.2f"):
  """Who won at equal training time and at equal steps, with the losses."""
  lines = []
  for label, losses in (
      ("Equal time (%.1fs)" % common_seconds,
       [(h.name, h.loss_at(common_seconds)) for h in histories]),
      ("Equal steps (%d)" % common_step,
       [(h.name, h.loss_at_step(common_step)) for h in histories])):
    line = _verdict(label, losses, loss_format)
    if line:
      lines.append(line)
  return lines


def write_results(path, histories, **info):
  """Writes the histories (and `info`) as JSON, for scripts and tests."""
  def clean(value):
    if isinstance(value, float) and not np.isfinite(value):
      return str(value)
    return value
  runs = []
  for h in histories:
    d = h.as_dict()
    d["losses"] = [clean(float(l)) for l in d["losses"]]
    d["extra"] = {k: clean(v) for k, v in d["extra"].items()}
    if "shown" in d:
      d["shown"] = [{k: clean(v) for k, v in values.items()}
                    for values in d["shown"]]
    runs.append(d)
  with open(path, "w") as f:
    json.dump(dict(info, runs=runs), f, indent=1)


def plot_histories(histories, path, x_axis, ylabel, log_y=False, title=None):
  """Writes a PNG of the runs' eval losses against "steps" or "seconds".

  The y axis ends a little above the highest initial loss, so that early
  spikes do not squash the rest of the curves.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.ticker  # pylint: disable=g-import-not-at-top
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(7, 4.5))
  lowest = np.inf
  for h in histories:
    losses = np.asarray(h.losses, dtype=np.float64)
    ok = np.isfinite(losses)
    ax.plot(np.asarray(getattr(h, x_axis))[ok], losses[ok], label=h.name)
    lowest = min([lowest] + list(losses[ok]))
  if log_y:
    ax.set_yscale("log")
    plain = matplotlib.ticker.FormatStrFormatter("%g")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
  highest_initial = max(h.losses[0] for h in histories)
  if np.isfinite(lowest) and np.isfinite(highest_initial):
    ax.set_ylim(0.98 * lowest, 1.05 * highest_initial)
  ax.set_xlabel("training seconds" if x_axis == "seconds" else "steps")
  ax.set_ylabel(ylabel)
  if title:
    ax.set_title(title)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
