"""examples/old_suite/report.py: the report of kfac 0.2.4's own suite run
against kfac 0.2.4 and this package (examples/old_suite/run.sh, which needs
a clone of github.com/tensorflow/kfac and so is not run here): outcomes read
from junit files, every test that passes on 0.2.4 and fails here needs its
reason, and the committed results file agrees with reasons.json."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
HERE = os.path.join(ROOT, "examples", "old_suite")
sys.path.insert(0, HERE)
import report  # pylint: disable=g-import-not-at-top,wrong-import-position

CASE = ('<testcase classname="kernel_tests.a_test.ATest" name="%s" '
        'time="0.1">%s</testcase>')
FAILURE = ('<failure message="boom">def test():\n&gt;   x()\n'
           'E   ValueError: the reason here\n</failure>')


def _junit(path, outcomes):
  """A junit file: outcomes maps test name -> True (passed) / False."""
  cases = "".join(CASE % (name, "" if ok else FAILURE)
                  for name, ok in outcomes.items())
  with open(path, "w", encoding="utf-8") as f:
    f.write('<?xml version="1.0"?><testsuites><testsuite name="pytest">%s'
            '</testsuite></testsuites>' % cases)


def _run(tmp_path, old, ours, reasons, monkeypatch):
  _junit(str(tmp_path / "junit_old.xml"), old)
  _junit(str(tmp_path / "junit_ours.xml"), ours)
  path = tmp_path / "reasons.json"
  path.write_text(json.dumps(reasons), encoding="utf-8")
  monkeypatch.setattr(report, "REASONS", str(path))
  code = report.main(["report.py", str(tmp_path)])
  with open(tmp_path / "old_suite.json", encoding="utf-8") as f:
    return code, json.load(f)


T = "kernel_tests/a_test.py::ATest::"


def test_explained_differences_pass_and_are_tabled(tmp_path, monkeypatch):
  code, result = _run(
      tmp_path, {"t1": True, "t2": True, "t3": False},
      {"t1": True, "t2": False, "t3": True}, {T + "t2": "because"},
      monkeypatch)
  assert code == 0
  assert (result["pass_old"], result["pass_both"]) == (2, 1)
  assert result["differ"] == [T + "t2"]
  assert result["tests"][T + "t2"]["ours_error"] == (
      "ValueError: the reason here")
  table = result["tables"]["differences"]
  assert "`a_test.py::ATest::t2` | ValueError: the reason here | because |" in (
      table)
  summary = result["tables"]["summary"]
  assert "| pass on kfac 0.2.4 | 2 |" in summary
  assert "| fail on kfac 0.2.4, pass on this package | 1 |" in summary


@pytest.mark.parametrize("reasons, word", [
    ({}, "unexplained: " + T + "t2"),
    ({T + "t2": "x", T + "t1": "y"},
     "reason for a test that does not differ: " + T + "t1"),
])
def test_unexplained_or_stale_reasons_fail(tmp_path, monkeypatch, capsys,
                                           reasons, word):
  code, _ = _run(tmp_path, {"t1": True, "t2": True},
                 {"t1": True, "t2": False}, reasons, monkeypatch)
  assert code == 1
  assert word in capsys.readouterr().out


def test_committed_results_agree_with_the_reasons():
  with open(os.path.join(HERE, "results", "old_suite.json"),
            encoding="utf-8") as f:
    result = json.load(f)
  with open(os.path.join(HERE, "reasons.json"), encoding="utf-8") as f:
    reasons = json.load(f)
  assert result["unexplained"] == [] and result["stale_reasons"] == []
  assert sorted(result["differ"]) == sorted(reasons)
  # The bar: at most 9 of the tests that pass on kfac 0.2.4 fail.
  assert result["pass_old"] - result["pass_both"] <= 9
  for test in result["differ"]:
    assert reasons[test] in result["tables"]["differences"]
