"""examples/benchmarks/kfac_jax_step_time.py runs end to end, tiny.

The benchmark against kfac-jax (`make bench`) needs kfac-jax in its private
folder; these runs do not: they run this kfac's side of the program (SGD,
tf.function and Session K-FAC on sklearn's digits with a 64-16-4-16-64
autoencoder), the report writer (also fed made-up kfac-jax rows, so that
the comparison columns are checked without JAX), and the clear error when
kfac-jax is not installed. They check what the program computes and writes,
never how fast anything is.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

# Slow tier (make test-slow): runs the benchmark program in subprocesses.
pytestmark = pytest.mark.slow

BENCHMARKS = pathlib.Path(__file__).resolve().parents[3] / "examples" / (
    "benchmarks")
PROGRAM = BENCHMARKS / "kfac_jax_step_time.py"

TINY = ["--data=digits", "--encoder=16,4", "--batch_sizes=32",
        "--loss_steps=10", "--loss_at=5,10", "--rounds=2",
        "--warmup_blocks=1", "--blocks_per_round=1", "--invert_every=5",
        "--max_images=1000", "--eval_examples=200"]


def _run(flags, tmp_path, check=True):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.run(
      [sys.executable, str(PROGRAM), "--output_dir=%s" % tmp_path] + flags,
      cwd=str(BENCHMARKS), env=env, capture_output=True, text=True,
      timeout=600, check=False)
  if check:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc


def _png(path):
  with open(path, "rb") as f:
    head = f.read(8)
  assert head == b"\x89PNG\r\n\x1a\n", path
  assert os.path.getsize(path) > 1000, path


def _rows(table, first_cell):
  return [l for l in table.splitlines() if l.startswith("| %s |" % first_cell)]


def test_our_side_and_report(tmp_path):
  missing = tmp_path / "no_kfac_jax"
  out = tmp_path / "out"
  proc = _run(TINY + [
      "--configs=sgd_tf,kfac_tf_function,kfac_session,kfac_jax",
      "--kfac_jax_path=%s" % missing, "--missing_kfac_jax=skip"], out)
  assert "kfac-jax is not installed in %s" % missing in proc.stdout
  with open(out / "kfac_jax_step_time.json") as f:
    results = json.load(f)
  names = ["sgd_tf", "kfac_tf_function", "kfac_session"]
  assert results["names"] == names
  assert results["skipped"] == ["kfac_jax (kfac-jax not installed)"]
  assert results["info"]["sizes"] == [64, 16, 4, 16, 64]
  assert results["info"]["data"] == "digits"
  # One batch size (a worker process per configuration and round: 6; the
  # report's columns for several batch sizes are test_report_with_kfac_jax_
  # rows' below).
  assert sorted(results["ms_per_step"]) == ["32"]
  timed = results["ms_per_step"]["32"]
  assert sorted(timed) == sorted(names)
  for name, row in timed.items():
    # Round 1: 10 steps = 2 blocks, 1 of them timed; round 2: 1 timed block.
    assert row["blocks"] == 2, (name, row)
    assert 0 < row["q25"] <= row["median"] <= row["q75"], row
  losses = {k: {int(s): v for s, v in row.items()}
            for k, row in results["losses"].items()}
  assert sorted(losses) == sorted("%s@32" % n for n in names)
  for key, row in losses.items():
    assert sorted(row) == [0, 5, 10], key
    assert all(math.isfinite(v) for v in row.values()), (key, row)
    assert row[10] < row[0], (key, row)
  # Same weights, same batches: one starting loss; the two K-FAC paths of
  # this kfac run the same math with the same seed.
  assert len({row[0] for row in losses.values()}) == 1, losses
  tf_fn, session = losses["kfac_tf_function@32"], losses["kfac_session@32"]
  for step in (5, 10):
    assert tf_fn[step] == pytest.approx(session[step], rel=1e-3)
  table = (out / "kfac_jax_step_time.md").read_text()
  assert table.strip() in proc.stdout
  assert "| optimizer | batch 32: ms/step (IQR) |\n" in table
  for name in names:
    assert len(_rows(table, name)) == 2, name  # ms/step row and loss row
  assert not _rows(table, "kfac_jax")
  assert "| optimizer | step 0 | step 5 | step 10 |" in table
  assert "Skipped: kfac_jax (kfac-jax not installed)." in table
  assert "Ratios of medians" not in table  # nothing to compare with
  _png(out / "kfac_jax_step_time.png")


_REPORT = r'''
import sys
sys.path.insert(0, sys.argv[1])
import kfac_jax_step_time as bench

bench.FLAGS(["prog"])
info = dict(sizes=[784, 1000, 30, 1000, 784], data="fashion_mnist",
            versions=["TensorFlow 2.x", "kfac-jax 0.0.8, jax 0.8.3 (cpu)"])
names = ["sgd_tf", "kfac_tf_function", "kfac_jax", "sgd_jax"]
def row(ms):
  return dict(median=ms, q25=ms - 1, q75=ms + 1, blocks=4)
summary = {1000: dict(sgd_tf=row(50.0), kfac_tf_function=row(300.0),
                      kfac_jax=row(200.0), sgd_jax=row(40.0)),
           256: dict(sgd_tf=row(20.0), kfac_tf_function=row(90.0),
                     kfac_jax=row(120.0))}
losses = {(n, 1000): {0: 480.0, 50: l50, 100: l100}
          for n, l50, l100 in (("sgd_tf", 200.0, 150.0),
                               ("kfac_tf_function", 120.0, 90.0),
                               ("kfac_jax", 121.0, 91.0),
                               ("sgd_jax", 200.0, 150.0))}
bench.write_report(sys.argv[2], info, summary, losses, names, [])
assert "tensorflow" not in sys.modules and "jax" not in sys.modules
'''


def test_report_with_kfac_jax_rows(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-c", _REPORT, str(BENCHMARKS), str(tmp_path)],
      capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # The report writer ran without TensorFlow or JAX (asserted in _REPORT).
  table = (tmp_path / "kfac_jax_step_time.md").read_text()
  assert _rows(table, "kfac_jax")[0] == (
      "| kfac_jax | 200.0 (199.0-201.0) | 120.0 (119.0-121.0) |")
  assert _rows(table, "sgd_jax")[0] == "| sgd_jax | 40.0 (39.0-41.0) | - |"
  assert ("Ratios of medians: batch 1000: kfac_tf_function/kfac_jax 1.50x, "
          "sgd_tf/sgd_jax 1.25x; batch 256: kfac_tf_function/kfac_jax "
          "0.75x.") in table
  assert _rows(table, "kfac_jax")[1] == "| kfac_jax | 480.00 | 121.00 | 91.00 |"
  assert "TensorFlow 2.x; kfac-jax 0.0.8, jax 0.8.3 (cpu)" in table
  with open(tmp_path / "kfac_jax_step_time.json") as f:
    results = json.load(f)
  assert results["losses"]["kfac_jax@1000"] == {"0": 480.0, "50": 121.0,
                                                "100": 91.0}
  _png(tmp_path / "kfac_jax_step_time.png")


def test_clear_error_without_kfac_jax(tmp_path):
  missing = tmp_path / "no_kfac_jax"
  proc = _run(TINY + ["--configs=kfac_tf_function,kfac_jax",
                      "--kfac_jax_path=%s" % missing], tmp_path / "out",
              check=False)
  assert proc.returncode != 0
  assert "Traceback" not in proc.stderr + proc.stdout
  assert "error: kfac-jax is not installed in %s." % missing in proc.stderr
  assert "make bench" in proc.stderr
  assert "-m pip install --target %s kfac-jax==0.0.8 jax==0.8.3" % missing \
      in proc.stderr
  assert not (tmp_path / "out").exists()  # stopped before any work


def test_clear_error_when_kfac_jax_does_not_import(tmp_path):
  # A folder that looks installed but holds no importable kfac-jax: the
  # worker's ImportError becomes the same message, not a traceback.
  broken = tmp_path / "broken_kfac_jax"
  (broken / "kfac_jax").mkdir(parents=True)
  (broken / "jax").mkdir()
  (broken / "jax" / "__init__.py").write_text("raise ImportError('broken')\n")
  proc = _run(TINY + ["--configs=kfac_jax", "--rounds=1",
                      "--kfac_jax_path=%s" % broken], tmp_path / "out",
              check=False)
  assert proc.returncode != 0
  assert "Traceback" not in proc.stderr + proc.stdout
  assert ("error: kfac-jax is not installed in %s (ImportError: broken)." %
          broken) in proc.stderr
  assert "make bench" in proc.stderr
