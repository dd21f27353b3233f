"""One worker of a 2-worker tf_keras `fit` with Kfac under
MultiWorkerMirroredStrategy and BackupAndRestore (keras_lost_worker_test).

    python -m kfac.python.kernel_tests.keras_lost_worker_program \
        INDEX PORT0,PORT1 BACKUP_DIR KILL_EPOCH KILL_BATCH

Run with TF_USE_LEGACY_KERAS=1 (tf_keras: Keras 3 `fit` under
MultiWorkerMirroredStrategy is broken upstream, keras issue 20585). Trains
EPOCHS epochs of STEPS_PER_EPOCH steps on a fixed global batch of
GLOBAL_BATCH (each worker its consecutive half; every epoch goes through
each worker's data exactly once, so an epoch resumed from its start feeds
the same batches). Worker 1 kills itself with SIGKILL at the start of
batch KILL_BATCH of epoch KILL_EPOCH (-1: never). Prints
`RESULT {"worker", "weights": [...], "iterations", "epochs_run": the
epochs this process began}` at the end.
"""

import json
import os
import signal
import sys

import numpy as np
import tensorflow as tf

GLOBAL_BATCH = 16
STEPS_PER_EPOCH = 2
EPOCHS = 3

_RNG = np.random.RandomState(0)
X = _RNG.randn(GLOBAL_BATCH * STEPS_PER_EPOCH, 4).astype(np.float32)
Y = _RNG.randint(0, 3, GLOBAL_BATCH * STEPS_PER_EPOCH).astype(np.int32)


def main(argv):
  index, ports, backup = int(argv[1]), argv[2].split(","), argv[3]
  kill_epoch, kill_batch = int(argv[4]), int(argv[5])
  os.environ["TF_CONFIG"] = json.dumps({
      "cluster": {"worker": ["localhost:%s" % p for p in ports]},
      "task": {"type": "worker", "index": index}})
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  import kfac.keras  # pylint: disable=g-import-not-at-top
  from kfac.python.keras import keras_flavor  # pylint: disable=g-import-not-at-top
  keras = keras_flavor.keras_module()
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)),
                              keras.layers.Dense(5, activation="tanh"),
                              keras.layers.Dense(3)])
    rng = np.random.RandomState(1)
    model.set_weights([(rng.randn(*w.shape) * 0.5).astype(np.float32)
                       for w in model.get_weights()])
    opt = kfac.keras.optimizers.Kfac(
        learning_rate=0.05, damping=0.1, model=model, momentum=0.9,
        invert_every=2, seed=3)
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))

  def dataset_fn(context):
    per = context.get_per_replica_batch_size(GLOBAL_BATCH)
    local = len(X) // context.num_input_pipelines
    start = context.input_pipeline_id * local
    data = tf.data.Dataset.from_tensor_slices(
        (X[start:start + local], Y[start:start + local]))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF)
    return data.batch(per).repeat().with_options(options)

  class KillSelf(keras.callbacks.Callback):
    """The lost worker: SIGKILL, mid-epoch, no chance to clean up."""

    def __init__(self):
      super().__init__()
      self._epoch = None

    def on_epoch_begin(self, epoch, logs=None):
      self._epoch = epoch
      epochs_run.append(epoch)

    def on_train_batch_begin(self, batch, logs=None):
      if (index == 1 and self._epoch == kill_epoch and
          batch == kill_batch):
        print("KILLED", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

  epochs_run = []
  callbacks = [keras.callbacks.BackupAndRestore(backup), KillSelf()]
  data = strategy.distribute_datasets_from_function(dataset_fn)
  model.fit(data, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH, verbose=0,
            callbacks=callbacks)
  print("RESULT " + json.dumps({
      "worker": index,
      "epochs_run": epochs_run,
      "iterations": int(opt.iterations.numpy()),
      "weights": [w.numpy().tolist() for w in model.weights]}), flush=True)


if __name__ == "__main__":
  main(sys.argv)
