"""Keras `model.fit` with kfac.keras.optimizers.Kfac under tf.distribute.

    python -m kfac.python.kernel_tests.keras_multiworker_program \
        multiworker TASK_INDEX PORT0,PORT1 CASE...   (one process per worker)
    python -m kfac.python.kernel_tests.keras_multiworker_program \
        mirrored R CASE...                     (R logical CPUs, one process)

Run with TF_USE_LEGACY_KERAS=1 (tf_keras; Keras 3 `fit` under
MultiWorkerMirroredStrategy is broken upstream, keras issue 20585, so the
multiworker mode is for tf_keras only). Each CASE ("dense", "conv", or
"options": the dense model with lazy_statistics_sync and
replica_round_robin inverses under the strategy)
trains STEPS `fit` steps of a small model on the fixed global batch of
GLOBAL_BATCH examples twice in the same process: without a strategy on the
whole batch, and under the strategy, where each replica gets its
consecutive share of the batch (worker / replica i: examples
[i * n, (i + 1) * n)), by `distribute_datasets_from_function`, no
shuffling. Prints one line per case:

  RESULT {"case", "weights_rel": max |W_R - W_1| / max |W_1| per variable,
          "identical": the replicas' copies (of this process) bit-identical,
          "digest": a hash of the strategy run's weights (equal on every
          worker when the workers hold identical weights),
          "moved": max |W_1 - W_init|, "replicas", "worker", "keras"}

The multiworker mode configures TF_CONFIG itself (a localhost cluster on
the given ports) and creates the strategy before anything else.
"""

import hashlib
import json
import os
import sys

import numpy as np
import tensorflow as tf

GLOBAL_BATCH = 16
STEPS = 4

_RNG = np.random.RandomState(0)
DATA = {
    "dense": (_RNG.randn(GLOBAL_BATCH, 4).astype(np.float32),
              _RNG.randint(0, 3, GLOBAL_BATCH).astype(np.int32)),
    "conv": (_RNG.randn(GLOBAL_BATCH, 6, 6, 2).astype(np.float32),
             _RNG.randint(0, 3, GLOBAL_BATCH).astype(np.int32)),
}


def build(keras, case):
  """The case's model with fixed initial weights (the same in every
  process)."""
  if case == "dense":
    model = keras.Sequential([keras.Input((4,)),
                              keras.layers.Dense(5, activation="tanh"),
                              keras.layers.Dense(3)])
  else:
    model = keras.Sequential([keras.Input((6, 6, 2)),
                              keras.layers.Conv2D(3, 3, activation="tanh"),
                              keras.layers.Flatten(), keras.layers.Dense(3)])
  rng = np.random.RandomState(1)
  model.set_weights([(rng.randn(*w.shape) * 0.5).astype(np.float32)
                     for w in model.get_weights()])
  return model


# "options": the dense model, and under the strategy the statistics reduced
# only at inversion steps and each factor's inverses computed on one
# replica (the same steps as the eager sync for this model).
OPTIONS = dict(lazy_statistics_sync=True,
               placement_strategy="replica_round_robin")


def fit(kfac, keras, strategy, case):
  """STEPS fit steps; the trained model."""
  replicas = strategy.num_replicas_in_sync
  extra = OPTIONS if case == "options" and replicas > 1 else {}
  if case == "options":
    case = "dense"
  with strategy.scope():
    model = build(keras, case)
    opt = kfac.keras.optimizers.Kfac(
        learning_rate=0.05, damping=0.1, model=model, momentum=0.9,
        invert_every=2, estimation_mode="exact", seed=3, **extra)
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
  x, y = DATA[case]
  if replicas == 1:
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=STEPS, shuffle=False,
              verbose=0)
    return model

  def dataset_fn(context):
    # One input pipeline per worker; each worker's replicas take
    # consecutive shares of the global batch.
    per = context.get_per_replica_batch_size(GLOBAL_BATCH)
    local = GLOBAL_BATCH // context.num_input_pipelines
    start = context.input_pipeline_id * local
    data = tf.data.Dataset.from_tensor_slices(
        (x[start:start + local], y[start:start + local]))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF)
    return data.batch(per).repeat().with_options(options)

  data = strategy.distribute_datasets_from_function(dataset_fn)
  model.fit(data, epochs=STEPS, steps_per_epoch=1, verbose=0)
  if extra:  # the options reached the K-FAC core
    names = list(opt.state_store.variables_by_name)
    assert any("/local_stat" in n for n in names), names
  return model


def compare(keras, strategy, case, single, many):
  init = build(keras, "dense" if case == "options" else case)
  out = {"weights_rel": 0.0, "identical": True, "moved": 0.0}
  digest = hashlib.sha1()
  for w_many, w_one, w0 in zip(many.weights, single.weights, init.weights):
    copies = [np.asarray(c) for c in strategy.experimental_local_results(
        w_many.value if not callable(w_many.value) else w_many)]
    ref = w_one.numpy()
    out["weights_rel"] = max(out["weights_rel"], float(
        np.abs(copies[0] - ref).max() / np.abs(ref).max()))
    out["moved"] = max(out["moved"],
                       float(np.abs(ref - w0.numpy()).max()))
    out["identical"] &= all(np.array_equal(c, copies[0]) for c in copies)
    digest.update(np.ascontiguousarray(copies[0]).tobytes())
  out["digest"] = digest.hexdigest()
  return out


def run_cases(strategy, cases, worker=None):
  import kfac.keras  # pylint: disable=g-import-not-at-top
  from kfac.python.keras import keras_flavor  # pylint: disable=g-import-not-at-top
  keras = keras_flavor.keras_module()
  for case in cases:
    many = fit(kfac, keras, strategy, case)
    single = fit(kfac, keras, tf.distribute.get_strategy(), case)
    result = compare(keras, strategy, case, single, many)
    result.update(case=case, replicas=strategy.num_replicas_in_sync,
                  worker=worker, keras=keras.__name__)
    print("RESULT " + json.dumps(result), flush=True)


def main(argv):
  if argv[1] == "multiworker":
    index, ports = int(argv[2]), argv[3].split(",")
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": ["localhost:%s" % p for p in ports]},
        "task": {"type": "worker", "index": index}})
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    run_cases(strategy, argv[4:], worker=index)
    return
  if argv[1] == "mirrored":
    replicas = int(argv[2])
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
    # One strategy per process (a second one over the same devices would
    # reuse its collective keys).
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:%d" % i for i in range(replicas)])
    run_cases(strategy, argv[3:])
    return
  raise ValueError("usage: multiworker INDEX PORTS CASE... | "
                   "mirrored R CASE...")


if __name__ == "__main__":
  main(sys.argv)
