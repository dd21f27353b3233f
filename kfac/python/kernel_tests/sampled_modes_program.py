"""Sampled estimation modes on R replicas against 1 replica (a program).

    python -m kfac.python.kernel_tests.sampled_modes_program R MODE:N ...

configures R logical CPU devices (before TensorFlow initialises), and for
each MODE:N (an estimation mode, a global batch size) trains the dense
model of distribute_program.py (4-5-3, tanh, softmax cross-entropy) for
STEPS steps of PeriodicInvCovUpdateKfacOpt (statistics and inverses every
step, momentum) on a fixed global batch of N examples: once without a
strategy, once without a strategy and another random seed, and once under
MirroredStrategy over R devices, each replica on its consecutive N / R
examples (TF2, strategy.run), for each of the SEEDS. The random ops are
seeded with tf.random.set_seed before each run, so every run is
deterministic.

In the sampled modes ("gradients": targets drawn from the model;
"curvature_prop": random +-1 vectors) each replica draws its own samples
for its own examples, so the R-replica statistics are another sample of
the same expectation as the one-replica ones: they differ by sampling
noise, which shrinks like 1 / sqrt(N). Prints one JSON line per MODE:N,
with a list of values (one per seed) and their "_mean" for:

  stats_rel:  max over the Kronecker factors' moving averages ("/cov") of
              ||C_R - C_1||_F / ||C_1||_F (C_R: the first replica's copy);
  reseed_rel: the same between the one-replica run and the one-replica run
              with another seed (the noise floor of one replica);
  weights_rel: the same over the model's variables;
and identical: for every seed, every replica's copy of every weight and
every K-FAC state variable is bit-identical.
"""

import contextlib
import json
import sys

import numpy as np
import tensorflow as tf

from kfac.python.kernel_tests import distribute_program as dp

STEPS = 3
SEEDS = (1, 2, 3)
NAMES = dp.MODEL_VARS["dense"]


def data(n):
  rng = np.random.RandomState(5)
  return {"x": rng.randn(n, 4).astype(np.float32),
          "y": rng.randint(0, 3, n).astype(np.int32)}


def run(kfac, strategy, mode, batch, seed):
  """STEPS steps; (weights, state): lists of every replica's copies."""
  tf.random.set_seed(seed)
  replicas = strategy.num_replicas_in_sync if strategy else 1
  n = len(batch["y"]) // replicas
  scope = strategy.scope() if strategy else contextlib.nullcontext()
  with scope:
    v = {k: tf.Variable(dp.INIT[k], name=k) for k in NAMES}
  opt = kfac.PeriodicInvCovUpdateKfacOpt(
      invert_every=1, cov_update_every=1, learning_rate=0.05, damping=0.1,
      momentum=0.9, estimation_mode=mode, cov_ema_decay=0.9)

  def step():
    rid = 0
    if strategy is not None:
      ctx = tf.distribute.get_replica_context()
      rid = int(tf.get_static_value(ctx.replica_id_in_sync_group))
    shard = {k: tf.constant(a[rid * n:(rid + 1) * n])
             for k, a in batch.items()}
    lc = kfac.LayerCollection()
    loss = dp.model("dense", v, shard, lc) / replicas
    return opt.minimize(loss, var_list=[v[k] for k in NAMES],
                        layer_collection=lc)

  return dp.train_tf2(strategy, step, STEPS, opt, {k: v[k] for k in NAMES})


def _max_rel(one, other, keys):
  """max over `keys` of ||other - one||_F / ||one||_F (first copies)."""
  worst, where = 0.0, None
  for k in keys:
    ref = np.asarray(one[k][0], np.float64)
    diff = np.asarray(other[k][0], np.float64) - ref
    rel = float(np.linalg.norm(diff) / max(np.linalg.norm(ref), 1e-12))
    if rel > worst:
      worst, where = rel, k
  return worst, where


def main(argv):
  replicas = int(argv[1])
  cpus = tf.config.list_physical_devices("CPU")
  tf.config.set_logical_device_configuration(
      cpus[0], [tf.config.LogicalDeviceConfiguration()] * replicas)
  import kfac  # pylint: disable=g-import-not-at-top
  # One strategy for the whole program (a second one over the same devices
  # reuses the collective keys of the first).
  strategy = tf.distribute.MirroredStrategy(
      ["/cpu:%d" % i for i in range(replicas)])
  for spec in argv[2:]:
    mode, n = spec.split(":")
    batch = data(int(n))
    out = {"case": spec, "replicas": replicas, "identical": True,
           "stats_rel": [], "reseed_rel": [], "weights_rel": [],
           "stats_worst": []}
    for seed in SEEDS:
      w1, s1 = run(kfac, None, mode, batch, seed)
      _, s1b = run(kfac, None, mode, batch, seed + 1000)
      wr, sr = run(kfac, strategy, mode, batch, seed)
      covs = sorted(k for k in s1 if k.endswith("/cov"))
      assert covs, sorted(s1)
      rel, worst = _max_rel(s1, sr, covs)
      out["stats_rel"].append(rel)
      out["stats_worst"].append(worst)
      out["reseed_rel"].append(_max_rel(s1, s1b, covs)[0])
      out["weights_rel"].append(_max_rel(w1, wr, NAMES)[0])
      out["identical"] &= all(
          np.array_equal(c, copies[0], equal_nan=True)
          for copies in list(wr.values()) + list(sr.values())
          for c in copies)
    out["factors"] = covs
    for key in ("stats_rel", "reseed_rel", "weights_rel"):
      out[key + "_mean"] = float(np.mean(out[key]))
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
  main(sys.argv)
