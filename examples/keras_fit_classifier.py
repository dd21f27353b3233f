r"""K-FAC vs Adam on a Keras CNN trained with `model.fit`, side by side.

Model (Keras Sequential, float32):
  image -> Conv2D 32 3x3 relu -> MaxPool 2 -> Conv2D 64 3x3 relu -> MaxPool 2
  -> Flatten -> Dense 128 relu -> Dense 10 softmax
with "valid" padding on Fashion-MNIST (28x28, flattened 5x5x64 = 1600) and
"same" padding on the 8x8 sklearn digits fallback; --batch_norm adds a
BatchNormalization after each convolution (registered by K-FAC as a scale
and shift layer).

Both optimizers are plain Keras optimizers passed to `model.compile` and run
by `model.fit`:

  opt = kfac.keras.optimizers.Kfac(
      learning_rate=0.01, damping=0.03, model=model, momentum=0.9,
      momentum_type="adam", invert_every=10, cov_update_every=1, seed=0)
  model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
  model.fit(images, labels, batch_size=256, ...)

Kfac registers the two convolutions (Kronecker factors over patches and
output channels), the two dense layers and the loss (categorical on the
logits behind the softmax) from the traced fit step; `print(opt.
registration_report)` shows it (printed at the end of the K-FAC run).

Fairness: both models start from the same weights and see the same
mini-batches (a fresh permutation per epoch, from --seed). They take turns:
`model.fit` is called on consecutive chunks of --chunk_steps batches of that
sequence, one optimizer after the other, so that machine noise slows both
alike (a chunked fit is one long fit: the train function is traced once and
the optimizer state persists). Training time is the time between Keras's
on_train_batch_begin and on_train_batch_end, except for the first step,
which traces the train function (its time is printed, not counted: one
untimed step for each optimizer); the evaluations (mean
cross-entropy on a fixed subset of --eval_examples training images every
--eval_every steps) pause the clock. The run ends at the --seconds budget
per optimizer, or after --epochs epochs when given (equal epochs).

  python examples/keras_fit_classifier.py                # ~2 minutes
  python examples/keras_fit_classifier.py --epochs=3     # equal epochs
  python examples/keras_fit_classifier.py --dataset=digits --seconds=10

Fashion-MNIST defaults were picked on a small grid at 80 steps, every
setting from the same weights and batches: K-FAC (momentum 0.9, type
"adam", invert_every 10) learning rate in {0.03, 0.1, 0.3} x damping in
{0.1, 0.3, 1, 3}, extended by (0.01, 0.03), (0.01, 0.1), (0.03, 0.03);
Adam learning rate in {3e-4, 1e-3, 3e-3, 1e-2}. K-FAC (0.1, 0.1),
(0.3, 0.1), (0.3, 0.3) and (0.03, 0.03) diverged to NaN, (0.1, 0.3) and
(0.3, 1) got stuck at ln 10 (dead ReLUs after a huge early step): learning
rate / damping must stay below ~0.3, and lower for a learning rate of 0.1
or more. Loss at step 80: K-FAC
(0.01, 0.03) 0.324, (0.03, 0.1) 0.337, (0.03, 0.3) 0.417, (0.1, 1) 0.429;
Adam 1e-2 0.413, 3e-3 0.428, 1e-3 0.548. The best two of each, checked at
300 steps: K-FAC (0.01, 0.03) 0.138, (0.03, 0.1) 0.157; Adam 1e-2 0.244,
3e-3 0.275. The digits defaults are not tuned.

Measured on 2 shared AMD EPYC cores (other jobs running), TF 2.21, Keras
3.15, Fashion-MNIST, 20000 training images, batch 256.

Default flags (40 s per optimizer; 2 min 20 s wall in all):

| optimizer | steps | ms/step | loss at step 158 | loss at 40 s | test accuracy |
|---|---:|---:|---:|---:|---:|
| kfac | 158 | 254 | 0.2517 | 0.2554 | 0.8713 |
| adam | 461 | 87 | 0.3625 | 0.2173 | 0.8738 |

--epochs=3 (234 steps each):

| optimizer | seconds | ms/step | loss at step 234 | loss at 19.7 s | test loss | test accuracy |
|---|---:|---:|---:|---:|---:|---:|
| kfac | 61.6 | 263 | 0.1896 | 0.3708 | 0.3279 | 0.8861 |
| adam | 19.7 | 84 | 0.2583 | 0.2583 | 0.3431 | 0.8762 |

Per step K-FAC is clearly ahead (it reaches Adam's 3-epoch loss after ~140
steps instead of 234), but its steps cost 3x Adam's here (the sampled
backward pass, the statistics, the preconditioning and every 10 steps the
inverses; the input statistic of the second convolution, built from all
11x11 patch positions of each image, is the largest single part), so at equal time
Adam reaches the lower training loss on this small CNN; test accuracies
end within 0.3 points at equal time. See benchmarks/keras_step_time.py for
where the time goes and how the Keras path compares with the core API.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import classifier_common as common
import side_by_side

import kfac

keras = tf.keras
FLAGS = flags.FLAGS

LOSS = "sparse_categorical_crossentropy"
LOSS_FORMAT = "%.4f"

DATASET_DEFAULTS = {
    "fashion_mnist": dict(conv_channels=["32", "64"], dense_units=128,
                          padding="valid", batch_size=256, seconds=40.0,
                          kfac_learning_rate=0.01, kfac_damping=0.03,
                          kfac_momentum_type="adam",
                          adam_learning_rate=1e-2),
    "digits": dict(conv_channels=["16", "32"], dense_units=64,
                   padding="same", batch_size=128, seconds=10.0,
                   kfac_learning_rate=0.1, kfac_damping=1.0,
                   kfac_momentum_type="adam", adam_learning_rate=3e-3),
}


def define_flags():
  """The flags of this script (side_by_side's shared ones and the model's).

  Called only when run as a script, so that other scripts can import
  `build_model` and `load_data` without getting these flags."""
  side_by_side.define_flags()
  flags.DEFINE_integer("epochs", None, "Train every optimizer for this many "
                       "epochs (equal epochs) instead of for --seconds.")
  flags.DEFINE_list("conv_channels", None, "Output channels of the conv "
                    "layers (default: per dataset).")
  flags.DEFINE_integer("dense_units", None, "Units of the hidden dense "
                       "layer (default: per dataset).")
  flags.DEFINE_enum("padding", None, ["valid", "same"], "Conv padding "
                    "(default: per dataset).")
  flags.DEFINE_bool("batch_norm", False, "Add BatchNormalization after each "
                    "convolution.")
  # Fewer, longer model.fit calls and evaluations than side_by_side's
  # defaults: each fit call and each evaluation costs a fraction of a
  # second of (untimed) wall time.
  FLAGS.set_default("chunk_steps", 20)
  FLAGS.set_default("eval_every", 20)
  # Progress every 20 steps (at most one line per 5 s of training): the
  # library default of 100 steps printed nothing before K-FAC's budget ended.
  FLAGS.set_default("print_every", 20)


# ------------------------------------------------------------------ model
def build_model(image_shape, num_classes=10, conv_channels=(32, 64),
                dense_units=128, padding="valid", batch_norm=False, seed=0):
  """The CNN of this example, with weights drawn from `seed`."""
  keras.utils.set_random_seed(seed)
  layers = [keras.Input(tuple(image_shape) + (1,))]
  for i, channels in enumerate(conv_channels):
    # Explicit names: the K-FAC state is keyed by variable names, so a model
    # rebuilt with the same names (e.g. to restore a checkpoint into it)
    # finds its state again.
    name = "conv%d" % (i + 1)
    if batch_norm:
      layers += [keras.layers.Conv2D(int(channels), 3, padding=padding,
                                     use_bias=False, name=name),
                 keras.layers.BatchNormalization(name=name + "_bn"),
                 keras.layers.ReLU(name=name + "_relu")]
    else:
      layers.append(keras.layers.Conv2D(int(channels), 3, padding=padding,
                                        activation="relu", name=name))
    layers.append(keras.layers.MaxPooling2D(2, name=name + "_pool"))
  layers += [keras.layers.Flatten(name="flatten"),
             keras.layers.Dense(dense_units, activation="relu",
                                name="dense"),
             keras.layers.Dense(num_classes, activation="softmax",
                                name="probs")]
  return keras.Sequential(layers, name="cnn")


def describe(cfg, batch_norm):
  convs = " -> ".join("conv 3x3 %s%s relu -> pool" % (
      c, " bn" if batch_norm else "") for c in cfg.conv_channels)
  return "%s (%s padding) -> dense %d relu -> dense 10 softmax" % (
      convs, cfg.padding, cfg.dense_units)


def keras_version():
  """Version of the Keras behind tf.keras (Keras 3, or tf_keras when
  TF_USE_LEGACY_KERAS=1)."""
  top = sys.modules.get(keras.__name__.split(".")[0])
  return getattr(top, "__version__", "?")


def load_data(prefer, max_examples):
  """(name, train LabelledData, test LabelledData); images [N, side, side]."""
  return common.load_classification_data(prefer, max_examples)


def make_eval_fn(model):
  """A traced function: (summed cross-entropy, number correct) of a chunk."""

  @tf.function(reduce_retracing=True)
  def sums(images, labels):
    probs = model(images[..., tf.newaxis], training=False)
    loss = tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(
        labels, probs))
    correct = tf.reduce_sum(tf.cast(
        tf.equal(tf.argmax(probs, axis=1), labels), tf.float32))
    return loss, correct

  def mean_loss_and_accuracy(data):
    loss = correct = 0.0
    for start in range(0, len(data), common.EVAL_CHUNK):
      part = slice(start, start + common.EVAL_CHUNK)
      l, c = sums(tf.constant(data.images[part]),
                  tf.constant(data.labels[part]))
      loss += float(l)
      correct += float(c)
    return loss / len(data), correct / len(data)

  return mean_loss_and_accuracy


def make_optimizer(opt_name, cfg, model):
  """(Keras optimizer, {name: variable shown in the progress lines})."""
  if opt_name == "kfac":
    opt = kfac.keras.optimizers.Kfac(
        learning_rate=cfg.kfac_learning_rate, damping=cfg.kfac_damping,
        model=model, seed=FLAGS.seed,  # the loss comes from compile
        momentum=FLAGS.kfac_momentum, momentum_type=cfg.kfac_momentum_type,
        invert_every=FLAGS.invert_every, cov_update_every=1,
        cov_ema_decay=FLAGS.cov_ema_decay,
        norm_constraint=FLAGS.kfac_norm_constraint)
    return opt, dict(damping=opt.damping, lr=opt.learning_rate)
  if opt_name == "adam":
    opt = keras.optimizers.Adam(cfg.adam_learning_rate)
    return opt, dict(lr=opt.learning_rate)
  raise ValueError("unknown optimizer %r" % opt_name)


# ------------------------------------------------------------------ training
class FitRunner(keras.callbacks.Callback):
  """One optimizer: its model, its clock, and model.fit on chunks of the
  shared batch sequence. It is also the Keras callback that times the
  steps, evaluates, prints progress and stops at the budget."""

  def __init__(self, name, cfg, init_weights, image_shape, data, eval_data,
               test, batches, max_steps):
    super().__init__()
    self.name = name
    self.data, self.eval_data, self.test = data, eval_data, test
    self.batches = batches
    self.max_steps = max_steps
    self.seconds = cfg.seconds if FLAGS.epochs is None else np.inf
    model = build_model(image_shape, common.NUM_CLASSES, cfg.conv_channels,
                        cfg.dense_units, cfg.padding, FLAGS.batch_norm,
                        FLAGS.seed)
    model.set_weights(init_weights)
    self.optimizer, self.shown = make_optimizer(name, cfg, model)
    # jit_compile=False: XLA off, as Keras's "auto" does on CPU.
    model.compile(optimizer=self.optimizer, loss=LOSS, jit_compile=False)
    self.keras_model = model
    self.evaluate = make_eval_fn(model)
    self.history = side_by_side.History(name)
    self.history.add(0, 0.0, self.evaluate(eval_data)[0])
    self.step = 0
    self.train_seconds = 0.0
    self.last_print = -np.inf
    self.done = False
    self._start = None
    self.first_step_seconds = None

  # Keras callback hooks.
  def on_train_batch_begin(self, batch, logs=None):
    self._start = time.perf_counter()

  def on_train_batch_end(self, batch, logs=None):
    elapsed = time.perf_counter() - self._start
    if self.step == 0:
      # The first step traces the train function: reported, not timed.
      self.first_step_seconds = elapsed
      print("[%s] first step (traces the train step): %.1fs, not timed" % (
          self.name, elapsed), flush=True)
    else:
      self.train_seconds += elapsed
    self.step += 1
    if self.step % FLAGS.eval_every == 0:
      self.history.add(self.step, self.train_seconds,
                       self.evaluate(self.eval_data)[0])
      if not np.isfinite(self.history.final_loss):
        print("[%s] step %d  loss is %s: stopping this run" % (
            self.name, self.step, self.history.final_loss), flush=True)
        self.keras_model.stop_training = True
        self.finish()
        return
    if (self.step % FLAGS.print_every == 0 and
        self.train_seconds - self.last_print >= FLAGS.print_seconds):
      self.last_print = self.train_seconds
      shown = "  ".join("%s %.0e" % (k, float(tf.convert_to_tensor(v)))
                        for k, v in self.shown.items())
      print(("[%s] epoch %d  step %d  loss " + LOSS_FORMAT + "  %s  %.1fs") %
            (self.name, self.step // self.batches.per_epoch + 1, self.step,
             self.history.final_loss, shown, self.train_seconds), flush=True)
    if self.step >= self.max_steps or self.train_seconds >= self.seconds:
      self.keras_model.stop_training = True

  def run_chunk(self, num_steps):
    """model.fit on the next `num_steps` batches of the shared sequence."""
    num_steps = min(num_steps, self.max_steps - self.step)
    if num_steps <= 0 or self.train_seconds >= self.seconds:
      self.finish()
      return
    indices = np.concatenate([self.batches.indices(s) for s in range(
        self.step, self.step + num_steps)])
    chunk = self.data.subset(indices)
    self.keras_model.fit(chunk.images[..., np.newaxis], chunk.labels,
                         batch_size=self.batches.batch_size, epochs=1,
                         shuffle=False, verbose=0, callbacks=[self])
    if self.step >= self.max_steps or self.train_seconds >= self.seconds:
      self.finish()

  def finish(self):
    if self.done:
      return
    self.done = True
    if self.history.steps[-1] != self.step:
      self.history.add(self.step, self.train_seconds,
                       self.evaluate(self.eval_data)[0])
    loss, accuracy = self.evaluate(self.test)
    self.history.extra = {"first step s": self.first_step_seconds or 0.0,
                          "test loss": loss, "test accuracy": accuracy}
    print(("[%s] done: %d steps (%.2f epochs) in %.1fs, loss " + LOSS_FORMAT +
           ", test loss %.4f, test accuracy %.4f") % (
               self.name, self.step, self.step / self.batches.per_epoch,
               self.train_seconds, self.history.final_loss, loss, accuracy),
          flush=True)


def main(argv):
  del argv
  name, train, test = load_data(FLAGS.dataset, FLAGS.max_examples)
  if FLAGS.dataset == "fashion_mnist" and name != "fashion_mnist":
    raise app.UsageError("--dataset=fashion_mnist but it is not available; "
                         "run `make data`.")
  cfg = side_by_side.Config(DATASET_DEFAULTS[name])
  image_shape = train.images.shape[1:]
  batches = side_by_side.Batches(len(train), cfg.batch_size, FLAGS.seed)
  max_steps = FLAGS.steps
  if FLAGS.epochs is not None:
    max_steps = min(max_steps, FLAGS.epochs * batches.per_epoch)
  print("model: %dx%d -> %s; batch %d, %d training images (%d steps per "
        "epoch), %s" % (
            image_shape[0], image_shape[1], describe(cfg, FLAGS.batch_norm),
            batches.batch_size, len(train), batches.per_epoch,
            "%d epochs per optimizer" % FLAGS.epochs if FLAGS.epochs else
            "budget %.0fs per optimizer" % cfg.seconds))
  print("Keras %s, TensorFlow %s, model.fit" % (keras_version(),
                                               tf.__version__))
  side_by_side.print_hyperparameters(cfg)
  init_weights = build_model(image_shape, common.NUM_CLASSES,
                             cfg.conv_channels, cfg.dense_units, cfg.padding,
                             FLAGS.batch_norm, FLAGS.seed).get_weights()
  rng = np.random.RandomState(FLAGS.seed)
  eval_data = train.subset(rng.choice(
      len(train), min(FLAGS.eval_examples, len(train)), replace=False))
  runners = [FitRunner(opt_name, cfg, init_weights, image_shape, train,
                       eval_data, test, batches, max_steps)
             for opt_name in FLAGS.optimizers]
  while not all(r.done for r in runners):
    for r in runners:
      if not r.done:
        r.run_chunk(FLAGS.chunk_steps)
  histories = [r.history for r in runners]
  side_by_side.print_table(
      histories, "Losses: cross-entropy, mean over a fixed set of %d "
      "training examples; test: the %d held-out examples, at the end; "
      "seconds: training time only (model.fit steps)." % (
          len(eval_data), len(test)), loss_format=LOSS_FORMAT)
  for r in runners:
    if isinstance(r.optimizer, kfac.keras.optimizers.Kfac):
      print("\nK-FAC registration (%s):\n%s" % (
          r.name, r.optimizer.registration_report))
  if FLAGS.results_json:
    side_by_side.write_results(FLAGS.results_json, histories, dataset=name,
                               api="keras_fit", epochs=FLAGS.epochs)


if __name__ == "__main__":
  define_flags()
  app.run(main)
