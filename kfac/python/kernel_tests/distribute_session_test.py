"""A TF1 Session step under MirroredStrategy as users write it trains as
one replica on the same global batches.

Runs distribute_session_program.py in a subprocess (2 logical CPU devices,
configured before TensorFlow initialises): an 8-16-3 tanh MLP, 5 steps of
PeriodicInvCovUpdateKfacOpt (or KfacOptimizer with its update thunks),
the model's variables made in `strategy.scope()`, each replica slicing its
rows of a global placeholder batch by its replica id.

A MirroredStrategy made in a tf.Graph, or under disable_v2_behavior,
reduces with ReductionToOneDevice: one merge_call whose outputs on each
replica depend on every replica's input. TensorFlow's replica-context
all_reduce wraps it in tf.custom_gradient, whose graph-mode check walked
from those outputs into the other replica's gradient graph and failed on
its variables ("grad_fn must accept keyword argument 'variables'" with
tf.Variable, "Unsuccessful at finding variable .../replica_1" with
get_variable). A strategy made eagerly before the graph uses collective
ops, which the other distributed tests run.

Slow tier: each world is a subprocess of about 30 s of CPU (six cases).
Tolerances as in distribute_test.py: the weights and every K-FAC state
variable within 1e-5 relative of one replica (float32; measured <= 8.3e-7),
every replica's copy (and, with the optimizer made in the replica
function, every replica's optimizer's copy) bit-identical, and the weights
moved (> 0.05).
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from kfac.python.kernel_tests import distribute_test

_PROGRAM = [sys.executable, "-m",
            "kfac.python.kernel_tests.distribute_session_program"]
_CASES = ["variable:outside", "variable:inside", "get_variable:outside",
          "get_variable:inside", "variable:compute_apply", "variable:thunks"]

pytestmark = pytest.mark.slow


def run_program(world, cases):
  proc = subprocess.run(_PROGRAM + [world] + list(cases),
                        env=distribute_test.env(), capture_output=True,
                        text=True, timeout=900, check=False,
                        cwd=distribute_test._ROOT)  # pylint: disable=protected-access
  return distribute_test._results(  # pylint: disable=protected-access
      proc.stdout, proc.stderr, proc.returncode, cases)


_REDUCTION = {"graph": "ReductionToOneDevice",
              "legacy": "ReductionToOneDevice",
              "eager": "CollectiveAllReduce"}


def check(results, world):
  distribute_test.check(results)
  for r in results:
    assert r["state_vars"] > 0, r
    # The path the world is meant to cover.
    assert r["reduction"] == _REDUCTION[world], r
  # minimize, with the optimizer made outside or inside the replica
  # function, and compute_gradients + apply_gradients build the same step.
  digests = {r["case"]: r["digest"] for r in results
             if not r["case"].endswith(":thunks")}
  for params in ("variable", "get_variable"):
    same = {d for c, d in digests.items() if c.startswith(params + ":")}
    assert len(same) == 1, digests


@pytest.mark.parametrize("world", ["graph", "legacy", "eager"])
def test_tf1_session_steps_equal_one_replica(world):
  """"graph": the reported case (tf.Variable parameters, minimize() with
  the optimizer made once in the scope, and made in the replica function)
  and the other ways of writing the step; "legacy": all of them under
  disable_v2_behavior; "eager": the strategy made eagerly (collective ops),
  as a control."""
  check(run_program(world, _CASES), world)


@pytest.mark.parametrize("world", ["graph", "legacy", "eager"])
def test_utils_all_reduce_values_and_gradients(world):
  """kfac.utils.all_sum / all_average (kfac 0.2.x helpers) hit the same
  TensorFlow check; they must stay differentiable. Replica r reduces
  x_r = (r + 1) w with w = ones(3) and differentiates
  loss_r = sum(reduced * (r + 1)): the sum is 3 w with gradient
  (sum of upstream 1 + 2) * (r + 1) = 3 (r + 1), the average 1.5 w with
  gradient 1.5 (r + 1) (the reduction of the replicas' upstream gradients,
  TensorFlow's own all_reduce gradient, which "eager" uses)."""
  proc = subprocess.run(_PROGRAM + [world, "utils_all_reduce"],
                        env=distribute_test.env(), capture_output=True,
                        text=True, timeout=900, check=False,
                        cwd=distribute_test._ROOT)  # pylint: disable=protected-access
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert proc.returncode == 0 and len(lines) == 1, proc.stderr[-4000:]
  result = json.loads(lines[0][len("RESULT "):])
  for name, total in (("all_sum", 3.0), ("all_average", 1.5)):
    for r in range(2):
      np.testing.assert_allclose(result[name]["values"][r], [total] * 3,
                                 rtol=1e-6)
      np.testing.assert_allclose(result[name]["grads"][r],
                                 [total * (r + 1)] * 3, rtol=1e-6)
