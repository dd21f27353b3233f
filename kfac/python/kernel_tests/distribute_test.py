"""K-FAC on several replicas equals K-FAC on one, on the same global batch.

Each case runs distribute_program.py in a subprocess (the logical CPU
devices must be configured before TensorFlow initialises): the model trains
5 steps without a strategy on the global batch of 8 and under
MirroredStrategy over R logical CPUs, each replica on its shard, in a TF1
Session (call_for_each_replica) and in a TF2 tf.function (strategy.run).

Tolerances: the weights and every K-FAC state variable (statistics,
inverses, velocities, counters, damping) agree to 1e-5 relative (float32;
measured <= 3.2e-6), the recorded scalars (rho, the quadratic model's rate
and momentum) to 1e-4 (measured 1.1e-5: a 2x2 solve amplifies rounding),
every replica's copy of every variable is bit-identical, and the run moved
the weights (> 0.05). One TF2 case is in
the fast tier; the full matrix (R in {2, 4}, dense / conv / embedding /
multi-use layers, burn-in with invert_every = cov_update_every = 2,
momentum, qmodel, KfacOptimizer with explicit update ops, the
Levenberg-Marquardt damping rule with qmodel and with the delayed rule on
loss_fn, uneven shards) is slow.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import kfac

_ALL_CASES = ["dense:periodic", "conv:periodic", "embedding:periodic",
              "multi_use:periodic", "dense:qmodel", "conv:regular",
              "conv:adaptive", "dense:adaptive_delayed"]
REL_TOL = 1e-5
RECORDS_REL_TOL = 1e-4


def run_program(replicas, world, cases):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  root = str(pathlib.Path(kfac.__file__).parents[1])
  env["PYTHONPATH"] = os.pathsep.join(
      [root] + [p for p in [env.get("PYTHONPATH")] if p])
  proc = subprocess.run(
      [sys.executable, "-m", "kfac.python.kernel_tests.distribute_program",
       str(replicas), world] + list(cases),
      env=env, capture_output=True, text=True, timeout=900, check=False,
      cwd=root)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  results = [json.loads(line[len("RESULT "):])
             for line in proc.stdout.splitlines()
             if line.startswith("RESULT ")]
  assert [r["case"] for r in results] == list(cases), proc.stdout
  return results


def check(results):
  for r in results:
    assert r["moved"] > 0.05, r
    assert r["weights_rel"] <= REL_TOL, r
    assert r["state_rel"] <= REL_TOL, r
    assert r["records_rel"] <= RECORDS_REL_TOL, r
    assert r["identical"], r


def test_two_replicas_equal_one_tf2():
  check(run_program(2, "tf2", ["dense:periodic", "dense:adaptive"]))


@pytest.mark.slow
@pytest.mark.parametrize("world", ["tf1", "tf2"])
@pytest.mark.parametrize("replicas", [2, 4])
def test_replicas_equal_one(world, replicas):
  cases = list(_ALL_CASES)
  if replicas == 2:
    # shards of 3 and 5 examples
    cases.extend(["dense:periodic:uneven", "dense:adaptive:uneven"])
  check(run_program(replicas, world, cases))
