"""Preemption with the Keras Kfac optimizer: BackupAndRestore.

A digits MLP (64-16-10) trains with kfac.keras.optimizers.Kfac(
adaptive=True) and keras.callbacks.BackupAndRestore. The first run is
"preempted" (an exception raised from a callback at the start of
--preempt_epoch); a new model with a new Kfac and the same
BackupAndRestore directory then finishes the run (as a restarted process
would), and its weights and K-FAC state are compared with an
uninterrupted run's: they are equal bit for bit.

    python examples/keras_preemption.py [--epochs=3] [--preempt_epoch=1]

docs/reliability.md ("Preemption") describes every saving path and the
multi-worker recipe.
"""

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

import datasets  # pylint: disable=g-import-not-at-top,wrong-import-position
import kfac.keras  # pylint: disable=g-import-not-at-top,wrong-import-position
from kfac.python.keras import keras_flavor  # pylint: disable=g-import-not-at-top,wrong-import-position

keras = keras_flavor.keras_module()


def build():
  """The MLP with fixed initial weights, compiled with a new Kfac."""
  model = keras.Sequential([keras.Input((64,)),
                            keras.layers.Dense(16, activation="tanh"),
                            keras.layers.Dense(10, activation="softmax")])
  rng = np.random.RandomState(0)
  model.set_weights([(rng.randn(*w.shape) * 0.3).astype(np.float32)
                     for w in model.get_weights()])
  model.compile(optimizer=kfac.keras.optimizers.Kfac(
      model=model, adaptive=True, loss="sparse_categorical_crossentropy"),
                loss="sparse_categorical_crossentropy")
  return model


class Preempted(Exception):
  pass


class PreemptAt(keras.callbacks.Callback):

  def __init__(self, epoch):
    super().__init__()
    self._epoch = epoch

  def on_epoch_begin(self, epoch, logs=None):
    if epoch == self._epoch:
      raise Preempted("preempted at the start of epoch %d" % epoch)


def state(model):
  values = list(model.get_weights())
  store = model.optimizer.state_store.numpy_state()
  return values + [store[k] for k in sorted(store)]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=3)
  parser.add_argument("--preempt_epoch", type=int, default=1)
  parser.add_argument("--batch_size", type=int, default=128)
  parser.add_argument("--examples", type=int, default=1024)
  args = parser.parse_args()
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  x = datasets.load_digits_images()[:args.examples]
  y = load_digits().target[:args.examples].astype(np.int32)
  fit = dict(x=x, y=y, batch_size=args.batch_size, epochs=args.epochs,
             shuffle=False, verbose=0)
  backup = tempfile.mkdtemp(prefix="kfac_backup_")

  first = build()
  try:
    first.fit(callbacks=[keras.callbacks.BackupAndRestore(backup),
                         PreemptAt(args.preempt_epoch)], **fit)
  except Preempted as error:
    print("first run:", error)
  resumed = build()  # a restarted process does the same
  history = resumed.fit(callbacks=[keras.callbacks.BackupAndRestore(backup)],
                        **fit)
  print("resumed run: epochs %s, final loss %.4f" % (
      history.epoch, history.history["loss"][-1]))

  uninterrupted = build()
  uninterrupted.fit(**fit)
  diff = max(float(np.max(np.abs(a - b))) if np.size(a) else 0.0
             for a, b in zip(state(resumed), state(uninterrupted)))
  print("max |resumed - uninterrupted| over weights and K-FAC state: %g"
        % diff)
  return 0 if diff == 0.0 else 1


if __name__ == "__main__":
  sys.exit(main())
