r"""K-FAC in a custom Keras training loop: tf.function (optionally XLA),
a damping schedule, and checkpoints that resume the exact trajectory.

The model is the CNN of keras_fit_classifier.py. The loop is what a Keras
user writes by hand, with `kfac.keras.optimizers.Kfac` in place of Adam:

  opt = kfac.keras.optimizers.Kfac(learning_rate=0.1, damping=1.0,
                                   model=model,  # watched from now on
                                   loss="sparse_categorical_crossentropy")

  @tf.function(jit_compile=FLAGS.jit_compile)
  def train_step(images, labels):
    with tf.GradientTape() as tape:
      loss = loss_fn(labels, model(images, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss

The forward pass and `apply_gradients` must be in the same traced step: the
optimizer registers the layers from the inputs and pre-activations recorded
while the model was called in that trace (an eager loop is refused).

Damping schedule: between steps the loop assigns `opt.damping` (a
variable, so the traced step is not retraced): exponential decay from
--damping to --final_damping over --damping_decay_steps steps (default
0.1 -> 0.03 at learning rate 0.01: a larger damping for the first steps,
where keras_fit_classifier.py's grid saw K-FAC diverge with a too small
one, ending at that grid's best setting). The learning
rate (`opt.learning_rate`) and momentum (`opt.momentum`) can be assigned the
same way.

Checkpoints: with --checkpoint_dir, `tf.train.Checkpoint(model=model,
optimizer=opt)` is saved every --checkpoint_every steps and at the end, and a
run finds the latest checkpoint there and continues from it. The K-FAC
state (factor statistics, inverses, velocities, counter) is part of the
optimizer's checkpoint; the targets K-FAC samples are drawn from (seed,
step), and the batches from (seed, epoch), so a resumed run continues on
exactly the trajectory of an uninterrupted one. --verify_restore (on by
default with --checkpoint_dir) shows it at the end: a new model and
optimizer restored from the last checkpoint take one more step next to the
trained ones, and the losses and weights are compared.

  python examples/keras_custom_loop.py
  python examples/keras_custom_loop.py --jit_compile
  python examples/keras_custom_loop.py --steps=100 --checkpoint_dir=/tmp/ck
  python examples/keras_custom_loop.py --steps=200 --checkpoint_dir=/tmp/ck
      # the second run restores step 100 and trains steps 101..200

The K-FAC state is keyed by the model's variable names, so a model that
restores a checkpoint must be built with the same layer names (the CNN
here names its layers; two `Sequential` models built in one process with
default names get different ones, and the K-FAC state would then not be
restored: TensorFlow only warns about unrestored values).

Measured on 2 shared AMD EPYC cores, TF 2.21, Keras 3.15, Fashion-MNIST
(20000 training images, batch 256), default flags and --print_every=50:

  300 steps in one run:      eval loss 0.5259 (step 50), 0.3068 (150),
                             0.1618 (300); test accuracy 0.8895; 219 ms/step
  150 steps, then a second   identical: 0.3068 at 150, then the second
  process resuming to 300:   process restores ckpt-150 and prints
                             0.2344 (200), 0.2127 (250), 0.1618 (300) and
                             test accuracy 0.8895, as the single run;
                             the restore check: loss 0.316460 vs 0.316460,
                             weights and 33 K-FAC state variables equal
                             (max |diff| 0) after one more step
  --jit_compile, 60 steps:   works on CPU; eval loss 0.4745 at step 60
                             vs 0.4744 without XLA; but the first step
                             (trace + XLA compile) takes 28-36 s instead
                             of 3.5-5 s, and the steps are slower: 688-739
                             ms vs 256-374 ms without XLA (two runs each,
                             interleaved, machine busy). XLA is slower on
                             CPU for this CNN with Adam too, see
                             benchmarks/keras_step_time.py
"""

import os
import sys
import time
import types

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
from absl import logging
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import classifier_common as common
import keras_fit_classifier as fit_example
import side_by_side

import kfac

keras = tf.keras
FLAGS = flags.FLAGS

flags.DEFINE_enum("dataset", "auto", ["auto", "digits", "fashion_mnist"],
                  "Fashion-MNIST when present ('auto') or sklearn digits.")
flags.DEFINE_integer("max_examples", 20000, "Use at most this many "
                     "Fashion-MNIST training images.")
flags.DEFINE_integer("batch_size", 256, "Mini-batch size.")
flags.DEFINE_integer("steps", 300, "Train until this many steps in all (a "
                     "resumed run continues up to it).")
flags.DEFINE_integer("seed", 0, "Seed of the weights, batches and sampling.")
flags.DEFINE_bool("jit_compile", False, "Compile the training step with "
                  "XLA (tf.function(jit_compile=True)).")
flags.DEFINE_float("learning_rate", 0.01, "K-FAC learning rate.")
flags.DEFINE_float("damping", 0.1, "Initial damping.")
flags.DEFINE_float("final_damping", 0.03, "Damping after the decay.")
flags.DEFINE_integer("damping_decay_steps", 150, "Steps of the exponential "
                     "damping decay from --damping to --final_damping.")
flags.DEFINE_float("momentum", 0.9, "K-FAC momentum (type 'adam').")
flags.DEFINE_integer("invert_every", 10, "K-FAC inverse period.")
flags.DEFINE_integer("print_every", 20, "Print progress every N steps.")
flags.DEFINE_integer("eval_examples", 2000, "Size of the fixed subset of "
                     "training images the progress loss is measured on.")
flags.DEFINE_string("checkpoint_dir", None, "Save checkpoints here and "
                    "resume from the latest one.")
flags.DEFINE_integer("checkpoint_every", 100, "Checkpoint period in steps.")
flags.DEFINE_bool("verify_restore", True, "With --checkpoint_dir: check at "
                  "the end that a model and optimizer restored from the "
                  "last checkpoint continue exactly like the trained ones.")
flags.DEFINE_list("conv_channels", None, "Conv channels (default: as "
                  "keras_fit_classifier.py for the dataset).")
flags.DEFINE_integer("dense_units", None, "Hidden dense units (default: as "
                     "keras_fit_classifier.py for the dataset).")

LOSS = "sparse_categorical_crossentropy"


def damping_at(step):
  """Exponential decay from --damping to --final_damping."""
  frac = min(step / max(FLAGS.damping_decay_steps, 1), 1.0)
  return float(FLAGS.damping * (FLAGS.final_damping / FLAGS.damping) ** frac)


class Trainee(object):
  """A model, its Kfac optimizer, the traced step and a checkpoint."""

  def __init__(self, model_args, image_shape):
    self.model = fit_example.build_model(image_shape, common.NUM_CLASSES,
                                         **model_args)
    # Creating the optimizer with model= makes it watch the model's layers.
    self.opt = kfac.keras.optimizers.Kfac(
        learning_rate=FLAGS.learning_rate, damping=damping_at(0),
        model=self.model, loss=LOSS, seed=FLAGS.seed,
        momentum=FLAGS.momentum, momentum_type="adam",
        invert_every=FLAGS.invert_every, cov_update_every=1)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    model, opt = self.model, self.opt

    @tf.function(jit_compile=FLAGS.jit_compile)
    def train_step(images, labels):
      with tf.GradientTape() as tape:
        loss = loss_fn(labels, model(images, training=True))
      grads = tape.gradient(loss, model.trainable_variables)
      opt.apply_gradients(zip(grads, model.trainable_variables))
      return loss

    self.train_step = train_step
    self.checkpoint = tf.train.Checkpoint(model=self.model, optimizer=self.opt)

  @property
  def step(self):
    return int(self.opt.iterations.numpy())

  def run_step(self, batch):
    """One step; the damping for it is set first (no retrace)."""
    self.opt.damping.assign(damping_at(self.step))
    return self.train_step(tf.constant(batch.images[..., np.newaxis]),
                           tf.constant(batch.labels))


def kfac_state(opt):
  """{name: numpy value} of the optimizer's K-FAC state."""
  return {k: v.numpy() for k, v in opt.state_store.variables_by_name.items()}


def verify_restore(trained, path, model_args, image_shape, batch):
  """A fresh model+optimizer restored from `path` vs the trained ones."""
  fresh = Trainee(model_args, image_shape)
  fresh.checkpoint.restore(path).assert_existing_objects_matched()
  weights_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(
      trained.model.get_weights(), fresh.model.get_weights()))
  print("restored %s into a new model and optimizer: step %d, weights max "
        "|diff| %.1e" % (path, fresh.step, weights_diff))
  # The K-FAC state variables are created by the first traced step; the
  # restored values wait for them (and the step counter says no inverse
  # needs recomputing out of turn).
  loss_trained = float(trained.run_step(batch))
  loss_fresh = float(fresh.run_step(batch))
  state_a, state_b = kfac_state(trained.opt), kfac_state(fresh.opt)
  state_diff = max(float(np.max(np.abs(state_a[k] - state_b[k])))
                   for k in state_a)
  weights_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(
      trained.model.get_weights(), fresh.model.get_weights()))
  print("one more step on both: loss %.6f vs %.6f; after it, weights max "
        "|diff| %.1e, K-FAC state (%d variables) max |diff| %.1e" % (
            loss_trained, loss_fresh, weights_diff, len(state_a),
            state_diff))
  if sorted(state_a) != sorted(state_b) or weights_diff > 1e-5:
    raise RuntimeError("the restored run does not continue like the "
                       "trained one")
  print("restore check passed")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  name, train, test = fit_example.load_data(FLAGS.dataset,
                                            FLAGS.max_examples)
  defaults = fit_example.DATASET_DEFAULTS[name]
  model_args = dict(
      conv_channels=FLAGS.conv_channels or defaults["conv_channels"],
      dense_units=FLAGS.dense_units or defaults["dense_units"],
      padding=defaults["padding"], seed=FLAGS.seed)
  image_shape = train.images.shape[1:]
  batches = side_by_side.Batches(len(train), FLAGS.batch_size, FLAGS.seed)
  rng = np.random.RandomState(FLAGS.seed)
  eval_data = train.subset(rng.choice(
      len(train), min(FLAGS.eval_examples, len(train)), replace=False))

  trainee = Trainee(model_args, image_shape)
  evaluate = fit_example.make_eval_fn(trainee.model)
  manager = None
  if FLAGS.checkpoint_dir:
    manager = tf.train.CheckpointManager(trainee.checkpoint,
                                         FLAGS.checkpoint_dir, max_to_keep=2)
    if manager.latest_checkpoint:
      trainee.checkpoint.restore(manager.latest_checkpoint)
      print("restored %s: continuing from step %d" % (
          manager.latest_checkpoint, trainee.step))
  start_step = trainee.step
  print("model: %dx%d -> %s; batch %d, %d training images; custom "
        "tf.function loop (jit_compile=%s), steps %d..%d" % (
            image_shape[0], image_shape[1],
            fit_example.describe(types.SimpleNamespace(**model_args), False),
            batches.batch_size, len(train), FLAGS.jit_compile, start_step + 1,
            FLAGS.steps))
  print("kfac: lr %g, damping %g -> %g over %d steps, momentum %g (adam), "
        "invert_every %d" % (FLAGS.learning_rate, FLAGS.damping,
                             FLAGS.final_damping, FLAGS.damping_decay_steps,
                             FLAGS.momentum, FLAGS.invert_every))
  if start_step == 0:
    print("initial loss %.4f" % evaluate(eval_data)[0])

  step_seconds, first = [], None
  while trainee.step < FLAGS.steps:
    step = trainee.step
    batch = train.subset(batches.indices(step))
    start = time.perf_counter()
    loss = float(trainee.run_step(batch))  # float(): waits for the step
    elapsed = time.perf_counter() - start
    if first is None:
      first = elapsed
      print("first step (traces%s): %.1fs" % (
          " and XLA-compiles" if FLAGS.jit_compile else "", elapsed))
    else:
      step_seconds.append(elapsed)
    if not np.isfinite(loss):
      raise RuntimeError("loss is %s at step %d" % (loss, step + 1))
    done = trainee.step
    if done % FLAGS.print_every == 0 or done == FLAGS.steps:
      print("step %d  epoch %d  batch loss %.4f  eval loss %.4f  damping "
            "%.3g  lr %.3g  %.1f ms/step" % (
                done, step // batches.per_epoch + 1, loss,
                evaluate(eval_data)[0], float(trainee.opt.damping.numpy()),
                float(tf.convert_to_tensor(trainee.opt.learning_rate)),
                1e3 * np.median(step_seconds[-FLAGS.print_every:])
                if step_seconds else np.nan), flush=True)
    if manager is not None and (done % FLAGS.checkpoint_every == 0 or
                                done == FLAGS.steps):
      print("saved %s" % manager.save(checkpoint_number=done))

  if step_seconds:
    print("trained steps %d..%d: median %.1f ms/step (first step %.1fs "
          "not counted)" % (start_step + 1, trainee.step,
                            1e3 * np.median(step_seconds), first))
  loss, accuracy = evaluate(test)
  print("final: eval loss %.4f, test loss %.4f, test accuracy %.4f" % (
      evaluate(eval_data)[0], loss, accuracy))
  print("\nK-FAC registration:\n%s" % trainee.opt.registration_report)
  if manager is not None and FLAGS.verify_restore and manager.latest_checkpoint:
    print()
    verify_restore(trainee, manager.latest_checkpoint, model_args,
                   image_shape, train.subset(batches.indices(trainee.step)))


if __name__ == "__main__":
  app.run(main)
