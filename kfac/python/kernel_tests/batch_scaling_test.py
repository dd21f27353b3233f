"""The arithmetic of examples/benchmarks/batch_scaling.py (issue 54's
critical-batch fit, all-reduce model and choice of runs), against exact
inputs and an explicit simulation of the ring algorithm."""

import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[3] / "examples" / (
    "benchmarks")
sys.path.insert(0, str(BENCHMARKS))
try:
  import batch_scaling  # pylint: disable=g-import-not-at-top
finally:
  sys.path.remove(str(BENCHMARKS))


def test_critical_batch_fit_recovers_s_min_and_b_noise():
  for s_min, b_noise in ((100.0, 1000.0), (60.0, 422.0), (335.0, 54.0)):
    points = [(b, s_min * (1 + b_noise / b)) for b in (256, 1024, 4096)]
    got = batch_scaling.fit_critical_batch(points)
    assert got[0] == pytest.approx(s_min, rel=5e-3)
    assert got[1] == pytest.approx(b_noise, rel=5e-3)
  # Fewer than 3 reached batches: no fit; unreached (None) ones are dropped.
  assert batch_scaling.fit_critical_batch([(256, 10), (512, 8)]) is None
  assert batch_scaling.fit_critical_batch(
      [(256, 10), (512, 8), (1024, None)]) is None


def test_latency_bandwidth_fit_recovers_the_line():
  latency, bandwidth = 2e-3, 150e6
  points = [(n, latency + n / bandwidth) for n in (4e3, 4e4, 4e5, 4e6)]
  got = batch_scaling.fit_latency_bandwidth(points)
  assert got[0] == pytest.approx(latency, rel=1e-9)
  assert got[1] == pytest.approx(bandwidth, rel=1e-9)
  # Times that do not grow with the bytes: all latency.
  flat = batch_scaling.fit_latency_bandwidth([(1e3, 1e-3), (1e6, 1e-3)])
  assert flat == (pytest.approx(1e-3), float("inf"))
  with pytest.raises(ValueError, match="2 points or more, got 1"):
    batch_scaling.fit_latency_bandwidth([(1e3, 1e-3)])


def _simulated_ring(nbytes, workers, latency, bandwidth):
  """The ring all-reduce step by step: the vector in W chunks;
  W - 1 reduce-scatter steps, then W - 1 all-gather steps, in each of which
  every worker sends one chunk to its neighbour at once (the step lasting
  one message)."""
  chunk = nbytes / workers
  clock = 0.0
  sent = [0.0] * workers
  for _ in range(2 * (workers - 1)):
    for w in range(workers):
      sent[w] += chunk
    clock += latency + chunk / bandwidth
  return clock, sent


@pytest.mark.parametrize("workers", [2, 4, 8, 64, 256])
def test_ring_allreduce_time_equals_the_simulated_ring(workers):
  nbytes, latency, bandwidth = 1.3e6, 10e-6, 25e9 / 8
  clock, sent = _simulated_ring(nbytes, workers, latency, bandwidth)
  got = batch_scaling.ring_allreduce_s(nbytes, workers, latency, bandwidth)
  assert got == pytest.approx(clock, rel=1e-12)
  assert sent[0] == pytest.approx(2.0 * (workers - 1) / workers * nbytes)
  assert batch_scaling.ring_allreduce_s(nbytes, 1, latency, bandwidth) == 0


def _run(optimizer, batch, value, metrics, workload="cnn"):
  return dict(workload=workload, optimizer=optimizer, batch=batch,
              value=value, best=max(metrics) if workload == "cnn" else
              min(metrics),
              points=[dict(step=10 * i, metric=m)
                      for i, m in enumerate(metrics)])


def test_best_runs_picks_the_fewest_steps_to_the_target():
  runs = [
      _run("adam", 256, 1e-3, [0.1, 0.5, 0.86, 0.88]),   # 30 steps
      _run("adam", 256, 3e-3, [0.1, 0.87, 0.9]),          # 10 steps
      _run("adam", 1024, 1e-3, [0.1, 0.5, 0.8]),          # not reached
      _run("adam", 1024, 3e-3, [0.1, 0.6, 0.7]),          # not reached
      dict(workload="cnn", optimizer="kfac", batch=256, value=None,
           error="diverged"),
      _run("kfac", 256, None, [0.1, 0.2, 0.9]),           # 20 steps
      _run("adam", 256, 1e-3, [5.0, 0.2], workload="autoencoder"),
  ]
  best = batch_scaling.best_runs(runs, "cnn", 0.87)
  assert set(best) == {("adam", 256), ("adam", 1024), ("kfac", 256)}
  assert best[("adam", 256)][0] == 10
  assert best[("adam", 256)][1]["value"] == 3e-3
  # Not reached: None, with the run of the best figure.
  assert best[("adam", 1024)][0] is None
  assert best[("adam", 1024)][1]["value"] == 1e-3
  assert best[("kfac", 256)][0] == 20
  # A loss metric: at most the target.
  loss = batch_scaling.best_runs(runs, "autoencoder", 0.3)
  assert loss[("adam", 256)][0] == 10
