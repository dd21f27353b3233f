r"""K-FAC vs Adam on a deep tanh autoencoder, side by side, in about 2 minutes.

Both optimizers start from the same initial weights and see the same
mini-batches, each in its own TF1-style graph run by a tf.compat.v1.Session
(the classic kfac API). Training time is measured with the evaluation
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
flags.DEFINE_float("seconds", 45.0,
                   "Training-time budget per optimizer, in seconds.")
flags.DEFINE_integer("batch_size", None,
                     "Mini-batch size (default: 500 for Fashion-MNIST, 256 "
                     "for digits).")
flags.DEFINE_integer("seed", 0, "Seed for weights, batches and sampling.")
flags.DEFINE_string("encoder", None,
                    "Comma-separated encoder sizes after the input, mirrored "
                    "for the decoder (default: 256,128,64,30 for "
                    "Fashion-MNIST, 48,32,16,8 for digits).")
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
# K-FAC.
flags.DEFINE_float("kfac_learning_rate", 1e-2, "K-FAC learning rate.")
flags.DEFINE_float("kfac_damping", 1e-2, "K-FAC damping.")
flags.DEFINE_float("kfac_momentum", 0.9, "K-FAC momentum.")
flags.DEFINE_enum("kfac_momentum_type", "regular", ["regular", "adam"],
                  "K-FAC momentum type.")
flags.DEFINE_integer("invert_every", 10, "K-FAC: recompute the inverses "
                     "every N steps.")
flags.DEFINE_float("cov_ema_decay", 0.95, "K-FAC statistics decay.")
# Adam.
flags.DEFINE_float("adam_learning_rate", 1e-3, "Adam learning rate.")


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

  def loss_at(self, seconds):
    """Loss of the last evaluation made at or before `seconds`."""
    i = np.searchsorted(self.seconds, seconds, side="right") - 1
    return self.losses[max(i, 0)]

  def seconds_to_reach(self, loss):
    """First training time at which the eval loss was <= `loss`, or None."""
    for s, l in zip(self.seconds, self.losses):
      if l <= loss:
        return s
    return None


def build_graph(opt_name, params_np, input_dim):
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
          learning_rate=FLAGS.kfac_learning_rate,
          damping=FLAGS.kfac_damping,
          layer_collection=lc,
          momentum=FLAGS.kfac_momentum,
          momentum_type=FLAGS.kfac_momentum_type,
          cov_ema_decay=FLAGS.cov_ema_decay,
          estimation_mode="gradients")
      shown["damping"] = tf.convert_to_tensor(opt.damping)
      shown["lr"] = tf.convert_to_tensor(opt.learning_rate)
    elif opt_name == "adam":
      logits = model.forward(x, variables)
      loss = model.reconstruction_loss(x, logits)
      opt = tf.compat.v1.train.AdamOptimizer(FLAGS.adam_learning_rate)
      shown["lr"] = tf.constant(FLAGS.adam_learning_rate)
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


def train(opt_name, params_np, data, eval_data, batches):
  """Trains one optimizer within the budget; returns its History."""
  g = build_graph(opt_name, params_np, data.shape[1])
  history = History(opt_name)
  with tf.compat.v1.Session(graph=g["graph"]) as sess:
    sess.run(g["init"])

    def evaluate():
      return float(sess.run(g["loss"], {g["x"]: eval_data}))

    history.add(0, 0.0, evaluate())
    train_seconds = 0.0
    last_print = -np.inf
    step = 0
    while step < FLAGS.steps and train_seconds < FLAGS.seconds:
      batch = data[batches.indices(step)]
      start = time.perf_counter()
      sess.run(g["train_op"], {g["x"]: batch})
      train_seconds += time.perf_counter() - start
      step += 1
      if step % FLAGS.eval_every == 0:
        history.add(step, train_seconds, evaluate())
      if (step % FLAGS.print_every == 0 and
          train_seconds - last_print >= FLAGS.print_seconds):
        last_print = train_seconds
        shown = sess.run(g["shown"])
        print("[%s] step %d  loss %.2f  %s  %.1fs" % (
            opt_name, step, history.losses[-1], format_shown(shown),
            train_seconds), flush=True)
    if history.steps[-1] != step:
      history.add(step, train_seconds, evaluate())
  print("[%s] done: %d steps in %.1fs, loss %.2f" % (
      opt_name, step, train_seconds, history.losses[-1]), flush=True)
  return history


def print_table(histories):
  """Side-by-side summary, losses compared at a common training time."""
  common = min(h.seconds[-1] for h in histories)
  target = max(h.losses[-1] for h in histories)
  header = ("| optimizer | steps | seconds | final loss | loss at %.1fs "
            "| seconds to loss %.2f |" % (common, target))
  print()
  print(header)
  print("|---|---:|---:|---:|---:|---:|")
  for h in histories:
    reach = h.seconds_to_reach(target)
    print("| %s | %d | %.1f | %.2f | %.2f | %s |" % (
        h.name, h.steps[-1], h.seconds[-1], h.losses[-1], h.loss_at(common),
        "-" if reach is None else "%.1f" % reach))
  print()
  print("Losses: sigmoid cross-entropy summed over pixels, mean over a fixed "
        "set of %d training images; seconds: training time only." %
        FLAGS.eval_examples)
  if len(histories) > 1:
    best = min(histories, key=lambda h: h.loss_at(common))
    print("At %.1fs of training %s has the lowest loss." % (common, best.name))


def main(argv):
  del argv
  name, data = datasets.load_autoencoder_data(
      prefer=FLAGS.dataset, max_examples=FLAGS.max_examples)
  if FLAGS.dataset == "fashion_mnist" and name != "fashion_mnist":
    raise app.UsageError("--dataset=fashion_mnist but it is not available; "
                         "run `make data`.")
  if FLAGS.encoder:
    hidden = [int(s) for s in FLAGS.encoder.split(",")]
  elif name == "fashion_mnist":
    hidden = [256, 128, 64, 30]
  else:
    hidden = [48, 32, 16, 8]
  batch_size = FLAGS.batch_size or (500 if name == "fashion_mnist" else 256)
  sizes = model.mirrored_sizes([data.shape[1]] + hidden)
  print("model: %s (tanh, linear code, sigmoid cross-entropy), batch %d, "
        "budget %.0fs per optimizer" % (
            "-".join(str(s) for s in sizes), batch_size, FLAGS.seconds))

  rng = np.random.RandomState(FLAGS.seed)
  params_np = model.init_params(sizes, FLAGS.seed)
  eval_data = data[rng.choice(len(data), min(FLAGS.eval_examples, len(data)),
                              replace=False)]
  batches = Batches(len(data), batch_size, FLAGS.seed)

  histories = []
  for opt_name in FLAGS.optimizers:
    histories.append(train(opt_name, params_np, data, eval_data, batches))
  print_table(histories)


if __name__ == "__main__":
  app.run(main)
