"""The examples run end to end, and K-FAC and Adam learn in them.

Each example runs as a script (as a user would run it) on the offline sklearn
digits for a fixed number of steps, K-FAC and Adam side by side, and writes
its histories with --results_json. Checked for each optimizer: every
evaluated loss is finite and the final training loss is below a fraction of
the initial one; for the classifiers also that the initial loss is about
ln 10 = 2.3 (10 balanced classes) and that the held-out accuracy is far
above chance (0.1). The bounds leave a margin; measured with these flags:

  convnet (40 steps)  loss 2.29 -> K-FAC 0.19, Adam 0.97; test acc 0.93, 0.78
  rnn (60 steps)      loss 2.51 -> K-FAC 0.63, Adam 0.73; test acc 0.83, 0.80
  autoencoder (20)    loss 44.7 -> K-FAC 27.1, Adam 27.4
  adaptive autoencoder (40)  loss 44.7 -> kfac_adaptive 19.0,
                      kfac_fixed 25.9, adam 26.3
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

# Slow tier (make test-slow): runs the example scripts in subprocesses.
pytestmark = pytest.mark.slow


EXAMPLES = pathlib.Path(__file__).resolve().parents[3] / "examples"

# Fixed-step runs; the time budget is large enough never to end them first.
_COMMON_FLAGS = ["--dataset=digits", "--seconds=1000", "--eval_every=10",
                 "--print_every=20", "--print_seconds=0", "--chunk_steps=10",
                 "--eval_examples=500"]


def _run_example(script, steps, tmp_path, extra_flags=()):
  results = tmp_path / "results.json"
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.run(
      [sys.executable, str(EXAMPLES / script), "--steps=%d" % steps,
       "--results_json=%s" % results] + _COMMON_FLAGS + list(extra_flags),
      cwd=str(EXAMPLES), env=env, capture_output=True, text=True,
      timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(results) as f:
    return json.load(f), proc.stdout


def _check_learned(results, stdout, steps, max_loss_ratio,
                   names=("adam", "kfac")):
  assert results["dataset"] == "digits"
  runs = {r["name"]: r for r in results["runs"]}
  assert sorted(runs) == sorted(names)
  for name, run in runs.items():
    losses = run["losses"]
    assert all(isinstance(l, float) and math.isfinite(l) for l in losses), (
        name, losses)
    assert run["steps"][-1] == steps, (name, run["steps"])
    assert losses[-1] < max_loss_ratio * losses[0], (name, losses)
    assert "[%s] done: %d steps" % (name, steps) in stdout
  assert "| optimizer | steps |" in stdout
  return runs


def _check_classifier(results, stdout, steps):
  runs = _check_learned(results, stdout, steps, max_loss_ratio=0.5)
  for name, run in runs.items():
    assert 1.8 < run["losses"][0] < 3.0, (name, run["losses"][0])
    assert run["extra"]["test accuracy"] > 0.6, (name, run["extra"])
  assert "test accuracy" in stdout


def test_convnet_classifier_session(tmp_path):
  steps = 40
  results, stdout = _run_example(
      "convnet_classifier.py", steps, tmp_path,
      ["--conv_channels=8,16", "--dense_units=32"])
  assert results["backend"] == "session"
  _check_classifier(results, stdout, steps)


def test_rnn_rows_classifier_function(tmp_path):
  steps = 60
  results, stdout = _run_example("rnn_rows_classifier.py", steps, tmp_path,
                                 ["--hidden_units=32"])
  assert results["backend"] == "function"
  _check_classifier(results, stdout, steps)


def test_autoencoder_demo(tmp_path):
  steps = 20
  results, stdout = _run_example("autoencoder_demo.py", steps, tmp_path)
  _check_learned(results, stdout, steps, max_loss_ratio=0.75)


def test_adaptive_autoencoder(tmp_path):
  steps = 40
  output_dir = tmp_path / "out"
  results, stdout = _run_example(
      "adaptive_autoencoder.py", steps, tmp_path,
      ["--encoder=48,32,16,8", "--output_dir=%s" % output_dir])
  runs = _check_learned(results, stdout, steps, max_loss_ratio=0.75,
                        names=("adam", "kfac_adaptive", "kfac_fixed"))
  # The damping: calibrated during the burn-in, then moved by the
  # Levenberg-Marquardt rule, never below its floor.
  adaptive = runs["kfac_adaptive"]
  assert len(adaptive["shown"]) == len(adaptive["steps"])
  damping = [v["damping"] for v in adaptive["shown"]]
  assert all(math.isfinite(d) and d >= results["min_damping"]
             for d in damping), damping
  after_burnin = [d for s, d in zip(adaptive["steps"], damping)
                  if s >= results["num_burnin_steps"]]
  assert damping[0] != after_burnin[0], damping
  assert len(set(after_burnin)) > 1, damping
  batch = [v["batch"] for v in adaptive["shown"]]
  assert batch[-1] > batch[0], batch
  for name in ("loss_vs_steps.png", "loss_vs_seconds.png"):
    with open(output_dir / name, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    assert (output_dir / name).stat().st_size > 1000, name
  assert "| kfac_adaptive | %d |" % steps in (
      output_dir / "results.md").read_text()
  assert "Target: adam's final loss" in stdout
  # The table docs/adaptive.md renders: results.md's text, in results.json.
  with open(output_dir / "results.json") as f:
    written = json.load(f)
  assert written["tables"]["results"] == (
      output_dir / "results.md").read_text().strip()


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.parametrize("world, replicas", [("tf2", 2), ("tf1", 4)])
def test_distributed_mirrored_matches_one_replica(world, replicas):
  """examples/distributed_mirrored.py: several logical CPUs train as one
  replica on the same batches (measured 1.5e-6 / 1.9e-6 relative)."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.run(
      [sys.executable, str(EXAMPLES / "distributed_mirrored.py"),
       "--dataset=digits", "--steps=10", "--batch_size=64",
       "--world=%s" % world, "--replicas=%d" % replicas, "--check_single"],
      cwd=str(EXAMPLES), env=env, capture_output=True, text=True,
      timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  out = proc.stdout
  assert "K-FAC on %d replicas" % replicas in out, out
  assert "replica copies identical: True" in out, out
  losses = [float(l.split()[3]) for l in out.splitlines()
            if l.startswith("step ")]
  assert len(losses) == 4, out  # 2 progress lines per run, 2 runs
  assert all(math.isfinite(l) for l in losses), out
  assert losses[1] < losses[0], out
  (line,) = [l for l in out.splitlines() if l.startswith("max relative")]
  assert float(line.split()[-1]) <= 1e-5, line


def test_distributed_multiworker_matches_one_process():
  """examples/distributed_multiworker.py --launch_local=2: two localhost
  worker processes (MultiWorkerMirroredStrategy) train as one process on
  the same batches (measured 1.8e-6 relative after 20 steps, loss 0.51 at
  step 5 -> 0.078 at step 20), every replica's weights bit-identical, and
  the launcher finds the two workers' weight digests equal."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  env.pop("TF_CONFIG", None)
  proc = subprocess.run(
      [sys.executable, str(EXAMPLES / "distributed_multiworker.py"),
       "--launch_local=2", "--dataset=digits", "--steps=20",
       "--batch_size=64", "--check_single"],
      cwd=str(EXAMPLES), env=env, capture_output=True, text=True,
      timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  out = proc.stdout
  assert "K-FAC on 2 workers, 2 replicas in sync" in out, out
  assert "all 2 replicas' weights identical: True" in out, out
  assert "the 2 workers' weight digests agree: True" in out, out
  losses = [float(l.split()[3]) for l in out.splitlines()
            if l.startswith("step ")]
  assert len(losses) == 8, out  # 4 progress lines per run, 2 runs
  assert all(math.isfinite(l) for l in losses), out
  assert losses[3] < 0.5 * losses[0], out
  (line,) = [l for l in out.splitlines() if l.startswith("max relative")]
  assert float(line.split()[-1]) <= 1e-5, line


def test_influence_functions_example(tmp_path):
  """examples/influence_functions.py on 600 Fashion-MNIST images: the
  influence grid, the check against CG on the exact GGN and the Laplace
  evidence are written and sane (CG converged, finite errors, helpful
  scores negative and harmful ones positive, the evidence's best prior
  precision inside the grid)."""
  out = tmp_path / "influence"
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.run(
      [sys.executable, str(EXAMPLES / "influence_functions.py"),
       "--train_examples=600", "--epochs=2", "--check_examples=150",
       "--check_dampings=1e-3,1e-1", "--output_dir=%s" % out],
      cwd=str(EXAMPLES), env=env, capture_output=True, text=True,
      timeout=600, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert (out / "influence_grid.png").stat().st_size > 10000
  assert (out / "laplace_evidence.png").stat().st_size > 10000
  with open(out / "results.json") as f:
    results = json.load(f)
  assert max(results["helpful_scores"]) < 0 < min(results["harmful_scores"])
  # The tables docs/ekfac.md renders: a row per damping checked.
  rows = [l for l in results["tables"]["check"].split("\n")
          if l.startswith("| 0.")]
  assert [r.split(" | ")[0] for r in rows] == ["| 0.001", "| 0.1"], rows
  assert "%.3g" % results["best_delta"]["ekfac"] in (
      results["tables"]["laplace"])
  frobenius = results["check"].pop("frobenius")
  # EKFAC is the best approximation diagonal in K-FAC's basis.
  assert 0 < frobenius["ekfac"] <= frobenius["kron"] < 1, frobenius
  for row in results["check"].values():
    assert row["cg_relative_residual"] < 1e-4, row
    for approx in ("ekfac", "kron", "kron_pi"):
      assert 0 < row[approx]["relative_error"] < 1.5, row
      assert row[approx]["score_correlation"] > 0.3, row
  deltas = results["deltas"]
  for name, curve in results["evidence"].items():
    assert all(math.isfinite(v) for v in curve), name
    assert deltas[0] < results["best_delta"][name] < deltas[-1], name


def test_keras_preemption_example():
  """examples/keras_preemption.py: the run preempted at epoch 1 and resumed
  by BackupAndRestore in a new model and Kfac runs epochs 1-2 only and
  ends equal to the uninterrupted run (weights and K-FAC state, bit for
  bit; the script exits 1 otherwise)."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.run(
      [sys.executable, str(EXAMPLES / "keras_preemption.py")],
      cwd=str(EXAMPLES), env=env, capture_output=True, text=True,
      timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "resumed run: epochs [1, 2]" in proc.stdout, proc.stdout
  assert "K-FAC state: 0\n" in proc.stdout, proc.stdout
