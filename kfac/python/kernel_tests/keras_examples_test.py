"""The Keras examples run end to end as scripts, with tiny flags.

* keras_fit_classifier.py: K-FAC and Adam through model.fit on the offline
  sklearn digits, 30 steps each, a small CNN. Checked: the JSON histories
  hold finite losses, both runs made 30 steps, start near ln 10 = 2.3 and
  end below 0.5 x (K-FAC) / 0.85 x (Adam) the start (measured with these
  flags: K-FAC 2.32 -> 0.63, Adam 2.32 -> 1.60), and the registration
  report shows the conv and dense blocks.
* keras_custom_loop.py: 10 steps with a checkpoint, then a second run that
  resumes from it to step 20 and checks that a fresh model+optimizer
  restored from the last checkpoint continues exactly like the trained
  ones. Checked: finite losses, the resume message, the restore check.
* benchmarks/keras_step_time.py: one round of one timed block on a tiny
  CNN and batch, random data, three configurations (model.fit with Adam,
  the custom Keras loop with Kfac, the TF1 Session core path; each is a
  fresh worker process, ~8 s). Checked: the markdown table with a positive
  ms/step and the ratio columns for each, the PNG and finite losses.

The XLA path (keras_custom_loop.py --jit_compile) is not run here: its
compilation takes 30-60 s on 2 CPU cores.
"""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

# Slow tier (make test-slow): runs the Keras example scripts in subprocesses.
pytestmark = pytest.mark.slow


EXAMPLES = pathlib.Path(__file__).resolve().parents[3] / "examples"
# keras_fit_classifier, 30 steps: final / initial loss must be below these.
_MAX_LOSS_RATIO = {"kfac": 0.5, "adam": 0.85}


def _run(script, flags, cwd=EXAMPLES):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.run([sys.executable, str(EXAMPLES / script)] + flags,
                        cwd=str(cwd), env=env, capture_output=True,
                        text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def test_keras_fit_classifier(tmp_path):
  results = tmp_path / "results.json"
  steps = 30
  stdout = _run("keras_fit_classifier.py", [
      "--dataset=digits", "--steps=%d" % steps, "--seconds=1000",
      "--eval_every=10", "--print_every=10", "--print_seconds=0",
      "--chunk_steps=10", "--eval_examples=300", "--conv_channels=8,16",
      "--dense_units=32", "--results_json=%s" % results])
  with open(results) as f:
    data = json.load(f)
  assert data["dataset"] == "digits" and data["api"] == "keras_fit"
  runs = {r["name"]: r for r in data["runs"]}
  assert sorted(runs) == ["adam", "kfac"]
  for name, run in runs.items():
    losses = run["losses"]
    assert all(isinstance(l, float) and math.isfinite(l) for l in losses), (
        name, losses)
    assert run["steps"][-1] == steps, (name, run["steps"])
    assert 1.8 < losses[0] < 3.0, (name, losses)
    assert losses[-1] < _MAX_LOSS_RATIO[name] * losses[0], (name, losses)
    assert 0.0 <= run["extra"]["test accuracy"] <= 1.0
    assert "[%s] done: %d steps" % (name, steps) in stdout
  assert "| optimizer | steps |" in stdout
  # Progress lines with K-FAC's damping and learning rate, every 10 steps.
  progress = re.findall(r"\[kfac\] epoch \d+  step (\d+)  loss [0-9.]+  "
                        r"damping [0-9.e+-]+  lr [0-9.e+-]+", stdout)
  assert [int(s) for s in progress] == [10, 20, 30], stdout
  assert re.search(r"cnn/conv1 +Conv2D +ConvKFCBasicFB", stdout), stdout
  assert re.search(r"cnn/probs +Dense +FullyConnectedKFACBasicFB", stdout)


def _eval_losses(stdout):
  return [float(x) for x in re.findall(
      r"eval loss ([-+0-9.eE]+|nan|inf)", stdout)]


def test_keras_custom_loop_checkpoint_resume(tmp_path):
  common = ["--dataset=digits", "--batch_size=64", "--print_every=5",
            "--eval_examples=300", "--conv_channels=8,16",
            "--dense_units=32", "--checkpoint_every=10",
            "--checkpoint_dir=%s" % (tmp_path / "ckpt")]
  first = _run("keras_custom_loop.py",
               common + ["--steps=10", "--verify_restore=false"])
  assert "saved" in first and "ckpt-10" in first
  losses = _eval_losses(first)
  assert len(losses) >= 3 and all(math.isfinite(l) for l in losses), first
  # The schedule lowers the damping (0.1 -> 0.03 over 150 steps by default).
  dampings = [float(x) for x in re.findall(r"damping ([0-9.e+-]+)  lr",
                                           first)]
  assert len(dampings) == 2 and 0.1 > dampings[0] > dampings[1] > 0.03, (
      dampings, first)

  second = _run("keras_custom_loop.py", common + ["--steps=20"])
  assert "continuing from step 10" in second, second
  assert "steps 11..20" in second
  losses = _eval_losses(second)
  assert losses and all(math.isfinite(l) for l in losses), second
  assert "restore check passed" in second, second


def test_keras_step_time_writes_table(tmp_path):
  configs = ["fit_adam", "loop_kfac", "session_kfac"]
  stdout = _run(os.path.join("benchmarks", "keras_step_time.py"), [
      "--rounds=1", "--blocks_per_round=1", "--warmup_blocks=1",
      "--invert_every=2", "--batch_size=16", "--conv_channels=4,8",
      "--dense_units=16", "--data=random",
      "--configs=%s" % ",".join(configs), "--output_dir=%s" % tmp_path])
  table = (tmp_path / "keras_step_time.md").read_text()
  assert "| configuration |" in table
  for name in configs:
    row = re.search(r"\| %s \|[^|]*\| ([0-9.]+) \| [^|]* \| ([0-9.]+)x \| "
                    r"([0-9.]+x|-) \|" % name, table)
    assert row is not None, table
    assert float(row.group(1)) > 0.0 and float(row.group(2)) > 0.0
  # The bases of the two ratio columns.
  assert re.search(r"\| fit_adam \| Keras model.fit \+ Adam \|[^\n]*\| 1\.00x "
                   r"\| - \|\n", table), table
  assert re.search(r"\| session_kfac \| raw tf.nn, TF1 Session[^\n]*\| "
                   r"1\.00x \|\n", table), table
  assert (tmp_path / "keras_step_time.png").stat().st_size > 1000
  with open(tmp_path / "keras_step_time.json") as f:
    results = json.load(f)
  assert all(math.isfinite(l) for l in results["losses"].values())
  assert "wrote" in stdout


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))
