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
EKFAC's eigenvectors to 1e-4 (measured <= 2e-5: rounding moves an
eigenvector by about rounding / eigen-gap), every replica's copy of every
variable is bit-identical, and the run moved
the weights (> 0.05). Every test here is in the slow tier (subprocesses
with logical CPUs): the matrix (R in {2, 4}, dense / conv / embedding /
multi-use layers, burn-in with invert_every = cov_update_every = 2,
momentum, qmodel, KfacOptimizer with explicit update ops, the
Levenberg-Marquardt damping rule with qmodel and with the delayed rule on
loss_fn, uneven shards, the Estimator's loss scaling in TF1, inverses
placed by replica_round_robin, which must give bit-identical weights to
replicated inverses, the lazy statistics sync, whose weights and inverses
must equal the eager sync's, EKFAC on every layer kind), the
MultiWorkerMirroredStrategy run (two localhost worker processes against
one process), and TF1 runs with the strategy made in the graph or under
disable_v2_behavior, where TensorFlow reduces with ReductionToOneDevice
instead of collective ops (the user's way of writing such a Session step:
distribute_session_test).
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

import kfac

_ALL_CASES = ["dense:periodic", "conv:periodic", "embedding:periodic",
              "multi_use:periodic", "dense:qmodel", "conv:regular",
              "conv:adaptive", "dense:adaptive_delayed"]
_FOUR_REPLICA_CASES = ["dense:periodic", "conv:periodic",
                       "embedding:periodic", "multi_use:periodic",
                       "conv:regular", "conv:adaptive",
                       "dense:adaptive_delayed"]
REL_TOL = 1e-5
RECORDS_REL_TOL = 1e-4
BASIS_REL_TOL = 1e-4


_ROOT = str(pathlib.Path(kfac.__file__).parents[1])
_PROGRAM = [sys.executable, "-m",
            "kfac.python.kernel_tests.distribute_program"]


def env():
  """The environment of the test programs (the source tree first on the
  path; no TF_CONFIG)."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  env["PYTHONPATH"] = os.pathsep.join(
      [_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
  env.pop("TF_CONFIG", None)
  return env


def _results(stdout, stderr, returncode, cases):
  assert returncode == 0, stdout[-3000:] + stderr[-5000:]
  results = [json.loads(line[len("RESULT "):])
             for line in stdout.splitlines() if line.startswith("RESULT ")]
  assert [r["case"] for r in results] == list(cases), stdout
  return results


def run_program(replicas, world, cases):
  proc = subprocess.run(_PROGRAM + [str(replicas), world] + list(cases),
                        env=env(), capture_output=True, text=True,
                        timeout=900, check=False, cwd=_ROOT)
  if world == "tf1_checkpoint":  # two results per case
    cases = [c + ":" + way for c in cases for way in ("down", "up")]
  return _results(proc.stdout, proc.stderr, proc.returncode, cases)


def free_ports(count):
  socks = [socket.socket() for _ in range(count)]
  try:
    for s in socks:
      s.bind(("localhost", 0))
    return [s.getsockname()[1] for s in socks]
  finally:
    for s in socks:
      s.close()


def check(results):
  for r in results:
    assert r["moved"] > 0.05, r
    assert r["weights_rel"] <= REL_TOL, r
    assert r["state_rel"] <= REL_TOL, r
    assert r["records_rel"] <= RECORDS_REL_TOL, r
    assert r["basis_rel"] <= BASIS_REL_TOL, r
    assert r["identical"], r


def _matrix(world, replicas):
  """(cases, placed) of test_replicas_equal_one[replicas-world]: the cases
  and the cases whose inverses are also placed by replica_round_robin."""
  # Two replicas run every case; four (on 2 cores, about twice the time per
  # case) the ones whose reduction or placement depends on the replica
  # count: a factor of each kind, the damping rules, the round-robin
  # placement and the lazy sync. The options that only rescale or reorder
  # what those cases reduce (Estimator-style losses, EKFAC's scalings,
  # uneven shards) run on two.
  cases = list(_ALL_CASES if replicas == 2 else _FOUR_REPLICA_CASES)
  if replicas == 2:
    # shards of 3 and 5 examples
    cases.extend(["dense:periodic:uneven", "dense:adaptive:uneven"])
  if world == "tf1" and replicas == 2:
    # Unscaled losses, built as an Estimator builds its step:
    # compute_gradients scales them by 1 / R.
    cases.extend(["dense:periodic:estimator", "conv:adaptive:estimator"])
  # Each factor's inverses on one replica, broadcast: bit-identical to the
  # replicated inverses (KfacOptimizer's explicit ops, the periodic
  # conditional, a multi-use layer, an embedding, the damping rule).
  placed = ["conv:regular", "multi_use:periodic", "conv:adaptive",
            "embedding:periodic", "dense:periodic:ekfac"]
  if replicas == 4:
    placed = ["conv:regular", "multi_use:periodic", "embedding:periodic"]
  else:
    cases.append("dense:periodic:ekfac")
  cases.extend(case + ":replica_round_robin" for case in placed)
  # Statistics reduced only at inversion steps: the same steps as the eager
  # sync (Kronecker factors; the damping rule; with the placement above).
  cases.extend(["conv:regular:lazy_statistics_sync",
                "dense:adaptive_delayed:lazy_statistics_sync",
                "multi_use:periodic:lazy_statistics_sync:replica_round_robin"])
  if replicas == 2:
    cases.append("dense:periodic:uneven:lazy_statistics_sync")
  # EKFAC: the scalings are means over the global batch like the factors.
  cases.extend(["embedding:periodic:ekfac", "multi_use:periodic:ekfac",
                "conv:regular:ekfac:uneven"] if replicas == 2 else
               ["conv:regular:ekfac"])
  if world == "tf1" and replicas == 4:
    # What depends on the replica count (the 1/R scaling of every reduction,
    # the round-robin placement over R devices) is one code path for both
    # worlds, which [4-tf2] runs in full; the Session world at four
    # replicas runs a case of each reduction kind (factor, damping rule,
    # placement, lazy sync) to show its graph collectives agree there too
    # (the full list took 344 s of CI's slow tier).
    cases = ["conv:regular", "dense:adaptive_delayed",
             "conv:regular:replica_round_robin",
             "conv:regular:lazy_statistics_sync"]
    placed = ["conv:regular"]
  if world == "tf2" and replicas == 2:
    # The TF2 world at two replicas runs what [4-tf2] does not (the
    # quadratic model alone, uneven shards, EKFAC's scalings, the other
    # placements): the same code at another replica count took 275 s of
    # CI's slow tier. [2-tf1] runs the whole list.
    four = _matrix("tf2", 4)[0]
    placed = [c for c in placed if c + ":replica_round_robin" not in four]
    cases = [c for c in cases if c not in four or c in placed]
  return cases, placed


@pytest.mark.slow
@pytest.mark.parametrize("world", ["tf1", "tf2"])
@pytest.mark.parametrize("replicas", [2, 4])
def test_replicas_equal_one(world, replicas):
  cases, placed = _matrix(world, replicas)
  # A diagonal factor (the embedding's inputs) reads its moving average at
  # every step, which the lazy sync updates only at inversion steps: the
  # steps differ from the eager sync's, but the replicas still agree.
  # (Statistics every step, inverses every second step: the lazy sync's
  # average then lags for a step.)
  lagging = "embedding:every_step:lazy_statistics_sync"
  results = run_program(replicas, world, cases + [lagging])
  lag = results.pop()
  assert lag["identical"] and lag["moved"] > 0.05, lag
  assert lag["weights_rel"] > 1e-5, lag
  check(results)
  digests = {r["case"]: r["digest"] for r in results}
  for case in placed:
    assert digests[case + ":replica_round_robin"] == digests[case], case


def test_matrix_runs_every_case_in_each_world():
  """Every case of the two-replica list runs in each world at some replica
  count (the trims above remove only what another entry runs)."""
  for world in ("tf1", "tf2"):
    ran = set(_matrix(world, 2)[0]) | set(_matrix(world, 4)[0])
    wanted = set(_matrix("tf1", 2)[0]) - {"dense:periodic:estimator",
                                          "conv:adaptive:estimator"}
    assert wanted <= ran, (world, sorted(wanted - ran))
  cases, placed = _matrix("tf2", 2)
  assert placed and all(c in cases and c + ":replica_round_robin" in cases
                        for c in placed), (cases, placed)


@pytest.mark.slow
@pytest.mark.parametrize("world", ["tf1_graph", "tf1_legacy"])
def test_replicas_equal_one_reduction_to_one_device(world):
  """The strategy made in each case's graph (TF2 behaviour), or under
  disable_v2_behavior: TensorFlow reduces with ReductionToOneDevice (one
  merge_call whose outputs depend on every replica's input) instead of
  collective ops. One case per path: the statistics conditional
  (cross_replica_cond), KfacOptimizer's explicit ops, the quadratic model,
  the damping rule (uneven shards; delayed, with the lazy sync), the
  Estimator's loss scaling, the placement's broadcasts, EKFAC."""
  cases = ["dense:periodic", "conv:regular", "dense:qmodel",
           "dense:adaptive:uneven",
           "dense:adaptive_delayed:lazy_statistics_sync",
           "multi_use:periodic:lazy_statistics_sync:replica_round_robin",
           "conv:adaptive:estimator", "embedding:periodic:ekfac",
           "conv:regular:replica_round_robin"]
  results = run_program(2, world, cases)
  check(results)
  assert results[-1]["digest"] == results[1]["digest"]


def run_workers(program, cases, environ, parse, workers=2, timeout=900):
  """Runs `program multiworker I PORTS cases...` as `workers` localhost
  processes at once; [parse(stdout, stderr, returncode)] per worker."""
  ports = ",".join(str(p) for p in free_ports(workers))
  procs = [subprocess.Popen(
      program + ["multiworker", str(i), ports] + list(cases), env=environ,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=_ROOT)
           for i in range(workers)]
  outs = []
  try:
    for proc in procs:
      stdout, stderr = proc.communicate(timeout=timeout)
      outs.append(parse(stdout, stderr, proc.returncode))
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  return outs


@pytest.mark.slow
def test_tf1_checkpoints_move_between_replica_counts():
  """A tf.compat.v1.train.Saver checkpoint written by 2 replicas after 3
  steps, restored in a one-replica graph for 2 more steps (and the other
  way round), equals 5 one-replica steps: K-FAC's state is saved once
  under replica-count-independent names."""
  cases = ["dense:periodic", "dense:adaptive"]
  results = run_program(2, "tf1_checkpoint", cases)
  assert [r["case"] for r in results] == [
      c + ":" + way for c in cases for way in ("down", "up")]
  check(results)


@pytest.mark.slow
def test_two_workers_equal_one_process():
  """MultiWorkerMirroredStrategy: two localhost processes (one CPU replica
  each, TF_CONFIG cluster) train as one process on the global batch."""
  cases = ["dense:periodic", "conv:periodic", "dense:adaptive:uneven",
           "dense:periodic:lazy_statistics_sync:replica_round_robin"]
  outs = run_workers(_PROGRAM, cases, env(),
                     lambda out, err, rc: _results(out, err, rc, cases))
  for worker, results in enumerate(outs):
    assert all(r["worker"] == worker and r["replicas"] == 2
               for r in results), results
    check(results)
  # Both workers end with the same weights (the same distance to the
  # one-process run).
  assert [r["weights_rel"] for r in outs[0]] == [
      r["weights_rel"] for r in outs[1]]
