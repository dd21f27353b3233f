"""examples/benchmarks/fault_cases.py end to end: every bad-input and fault
case (bad batches, divergence, row mismatches, bad arguments, half and
mixed precision, resume) in the TF1, TF2 and Keras paths either raises an
error that names the culprit or keeps working; none is silent or fails
with an unnamed culprit. (41 cases, about 2 minutes: slow tier.)"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = (pathlib.Path(__file__).resolve().parents[3] / "examples" /
          "benchmarks" / "fault_cases.py")


def test_every_fault_case_is_a_clear_error_or_keeps_working(tmp_path):
  out = tmp_path / "cases.json"
  root = str(pathlib.Path(__file__).resolve().parents[3])
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
             PYTHONPATH=os.pathsep.join(
                 [root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  proc = subprocess.run([sys.executable, str(SCRIPT), "--output=%s" % out],
                        capture_output=True, text=True, timeout=900,
                        env=env, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = json.loads(out.read_text())
  assert len(rows) >= 40
  bad = [r for r in rows if not r["verdict"].startswith(
      ("clear error", "keeps working"))]
  assert not bad, bad
  paths = {r["path"] for r in rows}
  assert paths == {"tf1", "tf2", "keras"}
