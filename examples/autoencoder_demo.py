r"""K-FAC vs Adam on a deep tanh autoencoder, side by side, in about 2 minutes.

Both optimizers start from the same initial weights and see the same
mini-batches, each in its own TF1-style graph run by a tf.compat.v1.Session
(the classic kfac API). They take turns, a few steps each, so that machine
noise slows both alike. Training time is measured with the evaluation
pauses taken out; the table at the end compares the losses reached at the
same number of seconds.

  python examples/autoencoder_demo.py                  # Fashion-MNIST if present
  python examples/autoencoder_demo.py --dataset=digits --seconds=20
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

import autoencoder_model as model
import datasets

FLAGS = flags.FLAGS

flags.DEFINE_enum("dataset", "auto", ["auto", "digits", "fashion_mnist"],
                  "Data: Fashion-MNIST when present ('auto') or sklearn "
                  "digits.")
flags.DEFINE_integer("steps", 100000,
                     "Maximum training steps per optimizer (the --seconds "
                     "budget usually ends training first).")
flags.DEFINE_float("seconds", None,
                   "Training-time budget per optimizer, in seconds "
                   "(default: per dataset, see DATASET_DEFAULTS).")
flags.DEFINE_integer("batch_size", None, "Mini-batch size (default: per "
                     "dataset).")
flags.DEFINE_integer("seed", 0, "Seed for weights, batches and sampling.")
flags.DEFINE_string("encoder", None,
                    "Comma-separated encoder sizes after the input, mirrored "
                    "for the decoder (default: per dataset).")
flags.DEFINE_integer("print_every", 100, "Print a progress line every N "
                     "steps (but see --print_seconds).")
flags.DEFINE_float("print_seconds", 5.0, "Skip a progress line when less "
                   "than this many training seconds passed since the last.")
flags.DEFINE_integer("eval_every", 10, "Evaluate the loss on a fixed subset "
                     "every N steps (for the equal-time comparison).")
flags.DEFINE_integer("eval_examples", 2000, "Size of that fixed subset.")
flags.DEFINE_integer("max_examples", 20000,
                     "Use at most this many Fashion-MNIST training images.")
flags.DEFINE_list("optimizers", ["kfac", "adam"], "Which optimizers to run.")
flags.DEFINE_integer("chunk_steps", 10, "The optimizers take turns, this "
                     "many steps each.")
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

# Per-dataset defaults for the flags left unset. Learning rates and damping
# were picked by a small grid search on this demo (K-FAC: learning rate in
# {0.01, 0.03, 0.1, 0.3, 1}, damping in {0.1, 0.3, 1, 3, 10}, both momentum
# types; Adam: learning rate in {1e-3, 3e-3, 1e-2}).
DATASET_DEFAULTS = {
    "fashion_mnist": dict(encoder="256,128,64,30", batch_size=1000,
                          seconds=45.0, kfac_learning_rate=0.1,
                          kfac_damping=3.0, kfac_momentum_type="adam",
                          adam_learning_rate=3e-3),
    "digits": dict(encoder="48,32,16,8", batch_size=256, seconds=20.0,
                   kfac_learning_rate=0.1, kfac_damping=1.0,
                   kfac_momentum_type="adam", adam_learning_rate=1e-2),
}


class Config(object):
  """The flags, with the unset ones filled from DATASET_DEFAULTS."""

  def __init__(self, dataset):
    for key, value in DATASET_DEFAULTS[dataset].items():
      setattr(self, key, value)
    for key in DATASET_DEFAULTS[dataset]:
      if getattr(FLAGS, key) is not None:
        setattr(self, key, getattr(FLAGS, key))


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
  """(step, training seconds, eval loss) points of one run."""

  def __init__(self, name):
    self.name = name
    self.steps = []
    self.seconds = []
    self.losses = []

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

  def seconds_to_reach(self, loss):
    """First training time at which the eval loss was <= `loss`, or None."""
    for s, l in zip(self.seconds, self.losses):
      if l <= loss:
        return s
    return None


def build_graph(cfg, opt_name, params_np, input_dim):
  """One optimizer's graph: returns a dict of the tensors the loop needs."""
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.set_random_seed(FLAGS.seed)
    x = tf.compat.v1.placeholder(tf.float32, [None, input_dim], name="x")
    variables = model.make_variables(params_np)
    var_list = model.flat_variables(variables)
    global_step = tf.compat.v1.train.get_or_create_global_step()
    shown = {}
    if opt_name == "kfac":
      import kfac  # pylint: disable=g-import-not-at-top
      lc = kfac.LayerCollection()
      logits = model.forward(x, variables, layer_collection=lc)
      model.register_loss(lc, x, logits)
      loss = model.reconstruction_loss(x, logits)
      opt = kfac.PeriodicInvCovUpdateKfacOpt(
          invert_every=FLAGS.invert_every,
          cov_update_every=1,
          learning_rate=cfg.kfac_learning_rate,
          damping=cfg.kfac_damping,
          layer_collection=lc,
          momentum=FLAGS.kfac_momentum,
          momentum_type=cfg.kfac_momentum_type,
          cov_ema_decay=FLAGS.cov_ema_decay,
          norm_constraint=FLAGS.kfac_norm_constraint,
          estimation_mode="gradients")
      shown["damping"] = tf.convert_to_tensor(opt.damping)
      shown["lr"] = tf.convert_to_tensor(opt.learning_rate)
    elif opt_name == "adam":
      logits = model.forward(x, variables)
      loss = model.reconstruction_loss(x, logits)
      opt = tf.compat.v1.train.AdamOptimizer(cfg.adam_learning_rate)
      shown["lr"] = tf.constant(cfg.adam_learning_rate)
    else:
      raise ValueError("unknown optimizer %r" % opt_name)
    train_op = opt.minimize(loss, var_list=var_list, global_step=global_step)
    init = tf.compat.v1.global_variables_initializer()
  graph.finalize()
  return dict(graph=graph, x=x, loss=loss, train_op=train_op, init=init,
              shown=shown)


def format_shown(values):
  parts = []
  for key in ("damping", "lr"):
    if key in values:
      parts.append("%s %.0e" % (key, values[key]))
  return "  ".join(parts)


class Trainer(object):
  """One optimizer's graph, session and clock; trains in short chunks.

  The optimizers take turns (a chunk of steps each), so that a busy machine
  slows all of them alike.
  """

  def __init__(self, cfg, opt_name, params_np, data, eval_data, batches):
    self.cfg = cfg
    self.name = opt_name
    self.data = data
    self.eval_data = eval_data
    self.batches = batches
    self.g = build_graph(cfg, opt_name, params_np, data.shape[1])
    self.sess = tf.compat.v1.Session(graph=self.g["graph"])
    self.sess.run(self.g["init"])
    self.history = History(opt_name)
    self.history.add(0, 0.0, self.evaluate())
    self.step = 0
    self.train_seconds = 0.0
    self.last_print = -np.inf
    self.done = False

  def evaluate(self):
    return float(self.sess.run(self.g["loss"], {self.g["x"]: self.eval_data}))

  def run_chunk(self, num_steps):
    """Up to num_steps training steps; sets self.done at the budget's end."""
    g = self.g
    for _ in range(num_steps):
      if self.step >= FLAGS.steps or self.train_seconds >= self.cfg.seconds:
        self.finish()
        return
      batch = self.data[self.batches.indices(self.step)]
      start = time.perf_counter()
      self.sess.run(g["train_op"], {g["x"]: batch})
      self.train_seconds += time.perf_counter() - start
      self.step += 1
      if self.step % FLAGS.eval_every == 0:
        self.history.add(self.step, self.train_seconds, self.evaluate())
        if not np.isfinite(self.history.final_loss):
          print("[%s] step %d  loss is %s: stopping this run" % (
              self.name, self.step, self.history.final_loss), flush=True)
          self.finish()
          return
      if (self.step % FLAGS.print_every == 0 and
          self.train_seconds - self.last_print >= FLAGS.print_seconds):
        self.last_print = self.train_seconds
        shown = self.sess.run(g["shown"])
        print("[%s] step %d  loss %.2f  %s  %.1fs" % (
            self.name, self.step, self.history.final_loss,
            format_shown(shown), self.train_seconds), flush=True)

  def finish(self):
    if self.done:
      return
    if self.history.steps[-1] != self.step:
      self.history.add(self.step, self.train_seconds, self.evaluate())
    self.sess.close()
    self.done = True
    print("[%s] done: %d steps in %.1fs, loss %.2f" % (
        self.name, self.step, self.train_seconds, self.history.final_loss),
          flush=True)


def _finite_or_inf(value):
  return value if np.isfinite(value) else np.inf


def print_table(histories, num_eval):
  """Side-by-side summary: losses at a common time and at a common step."""
  common = min(h.seconds[-1] for h in histories)
  common_step = min(h.steps[-1] for h in histories)
  # The loss every run reached: the worst finite final loss.
  finite = [h.final_loss for h in histories if np.isfinite(h.final_loss)]
  target = max(finite) if finite else np.nan
  print()
  print("| optimizer | steps | seconds | ms/step | final loss | loss at %.1fs "
        "| loss at step %d | seconds to loss %.2f |" % (
            common, common_step, target))
  print("|---|---:|---:|---:|---:|---:|---:|---:|")
  for h in histories:
    reach = h.seconds_to_reach(target)
    print("| %s | %d | %.1f | %.1f | %.2f | %.2f | %.2f | %s |" % (
        h.name, h.steps[-1], h.seconds[-1],
        1e3 * h.seconds[-1] / max(h.steps[-1], 1), h.final_loss,
        h.loss_at(common), h.loss_at_step(common_step),
        "-" if reach is None else "%.1f" % reach))
  print()
  print("Losses: sigmoid cross-entropy summed over pixels, mean over a fixed "
        "set of %d training images; seconds: training time only." % num_eval)
  if len(histories) > 1:
    best = min(histories, key=lambda h: _finite_or_inf(h.loss_at(common)))
    if np.isfinite(best.loss_at(common)):
      print("Equal time (%.1fs): %s has the lowest loss." % (common,
                                                            best.name))
    best = min(histories,
               key=lambda h: _finite_or_inf(h.loss_at_step(common_step)))
    if np.isfinite(best.loss_at_step(common_step)):
      print("Equal steps (%d): %s has the lowest loss." % (common_step,
                                                          best.name))
    for h in histories:
      if not np.isfinite(h.final_loss):
        print("%s diverged (loss %s)." % (h.name, h.final_loss))


def main(argv):
  del argv
  name, data = datasets.load_autoencoder_data(
      prefer=FLAGS.dataset, max_examples=FLAGS.max_examples)
  if FLAGS.dataset == "fashion_mnist" and name != "fashion_mnist":
    raise app.UsageError("--dataset=fashion_mnist but it is not available; "
                         "run `make data`.")
  cfg = Config(name)
  hidden = [int(s) for s in cfg.encoder.split(",")]
  sizes = model.mirrored_sizes([data.shape[1]] + hidden)
  print("model: %s (tanh, linear code, sigmoid cross-entropy), batch %d, "
        "budget %.0fs per optimizer" % (
            "-".join(str(s) for s in sizes), cfg.batch_size, cfg.seconds))
  print("kfac: lr %g, damping %g, momentum %g (%s), invert_every %d;  "
        "adam: lr %g" % (cfg.kfac_learning_rate, cfg.kfac_damping,
                         FLAGS.kfac_momentum, cfg.kfac_momentum_type,
                         FLAGS.invert_every, cfg.adam_learning_rate))

  rng = np.random.RandomState(FLAGS.seed)
  params_np = model.init_params(sizes, FLAGS.seed)
  eval_data = data[rng.choice(len(data), min(FLAGS.eval_examples, len(data)),
                              replace=False)]
  batches = Batches(len(data), cfg.batch_size, FLAGS.seed)

  trainers = [Trainer(cfg, opt_name, params_np, data, eval_data, batches)
              for opt_name in FLAGS.optimizers]
  while not all(t.done for t in trainers):
    for t in trainers:
      if not t.done:
        t.run_chunk(FLAGS.chunk_steps)
  print_table([t.history for t in trainers], len(eval_data))


if __name__ == "__main__":
  app.run(main)
