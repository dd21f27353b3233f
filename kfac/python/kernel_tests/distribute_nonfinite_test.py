"""The non-finite guard under MirroredStrategy: a NaN in one replica's shard
makes every replica skip the step (the decision is taken on reduced
gradients and statistics), the state of every replica stays bit for bit
what it was, and training then goes on exactly as a run that never saw the
bad batch. Two logical CPU devices, configured before TensorFlow starts:
the program runs in a subprocess."""

import json
import subprocess
import sys

import pytest

from kfac.python.kernel_tests import distribute_test

pytestmark = pytest.mark.slow

_PROGRAM = r'''
import json
import numpy as np
import tensorflow as tf
cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
import kfac

R, N = 2, 8
rng = np.random.RandomState(0)
W0 = (0.5 * rng.randn(3, 4)).astype(np.float32)
GOOD = [(rng.randn(N, 3).astype(np.float32), rng.randint(0, 4, N))
        for _ in range(4)]
BAD = (GOOD[0][0].copy(), GOOD[0][1])
BAD[0][6, 1] = np.nan  # a row of replica 1's shard only


def run(batches, mode):
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with strategy.scope():
    w = tf.Variable(W0)
  opt = kfac.PeriodicInvCovUpdateKfacOpt(
      invert_every=2, learning_rate=0.1, damping=0.05, momentum=0.9,
      estimation_mode=mode, cov_ema_decay=0.9)

  @tf.function
  def train(x_all, y_all):
    def step():
      i = tf.distribute.get_replica_context().replica_id_in_sync_group
      x = x_all[i * (N // R):(i + 1) * (N // R)]
      y = y_all[i * (N // R):(i + 1) * (N // R)]
      lc = kfac.LayerCollection()
      logits = tf.matmul(x, w)
      lc.register_fully_connected(w, x, logits)
      lc.register_softmax_cross_entropy_loss(logits, targets=y)
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=y, logits=logits)) / R
      opt.minimize(loss, var_list=[w], layer_collection=lc)
    strategy.run(step)

  states = []
  for x, y in batches:
    train(tf.constant(x), tf.constant(y))
    state = {"w": [v.numpy().tolist()
                   for v in strategy.experimental_local_results(w)]}
    for key, var in sorted(opt.state_store.variables_by_name.items()):
      state[key] = [v.numpy().tolist()
                    for v in strategy.experimental_local_results(var)]
    states.append(state)
  return states


out = {}
for mode in ("exact", "empirical"):
  clean = run(GOOD, mode)
  guarded = run([GOOD[0], BAD] + GOOD[1:], mode)
  out[mode] = dict(clean=clean, guarded=guarded)
print("RESULT " + json.dumps(out))
'''


def _state_without_guard(state):
  """The state without the guard's counters, as a string (records not yet
  written hold NaN, which must compare equal to itself)."""
  return json.dumps({k: v for k, v in state.items()
                     if "skipped_steps" not in k}, sort_keys=True)


def test_nan_in_one_shard_skips_the_step_on_every_replica():
  proc = subprocess.run([sys.executable, "-c", _PROGRAM],
                        capture_output=True, text=True, timeout=600,
                        env=distribute_test.env(), check=False)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  results = json.loads(line[-1][len("RESULT "):])
  for mode, runs in results.items():
    clean, guarded = runs["clean"], runs["guarded"]
    # Every replica's copy of every variable is the same.
    for state in clean + guarded:
      for key, copies in state.items():
        assert json.dumps(copies[0]) == json.dumps(copies[1]), (mode, key)
    # The bad step (guarded[1]) changed nothing but the guard's counters.
    assert (_state_without_guard(guarded[1]) ==
            _state_without_guard(guarded[0])), mode
    assert guarded[1]["skipped_steps"] == [1, 1]
    assert guarded[1]["consecutive_skipped_steps"] == [1, 1]
    # Later steps equal the run without the bad batch, bit for bit.
    for c, g in zip(clean, [guarded[0]] + guarded[2:]):
      assert _state_without_guard(g) == _state_without_guard(c), mode
    assert guarded[-1]["consecutive_skipped_steps"] == [0, 0]
    assert clean[-1]["skipped_steps"] == [0, 0]
    assert clean[-1]["w"] != clean[0]["w"]  # it trained
