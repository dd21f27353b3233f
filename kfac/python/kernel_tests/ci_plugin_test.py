"""The project's pytest plugin (conftest.py at the repository root) and
.ci/check_all_ran.py: CI fails when a collected test was not run.

Each test runs pytest (pytester, in this process, or with pytest-xdist
workers) on a tiny test file with a copy of the project's conftest.py, and
checks the outcomes and the exit code:

- fail_on_skip: a skipped, skipif-ed, xfailed or xpassed test, and a module
  skipped by pytest.importorskip, fail; without the ini option they are the
  usual skips (so it is the option that turns them into failures);
- --time_budget: the tests left when the budget is used fail as "not run",
  also under pytest-xdist, and the exit code is not 0;
- --run_log and check_all_ran.py: every collected test must have passed;
- kernel_tests/slow_cases.txt: the listed cases are marked slow (out of the
  fast tier, in the slow one), and a listed name that its file no longer
  collects fails the collection.
"""

import importlib.util
import io
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]

SKIPS = """
import pytest

def test_passes():
  assert 1 + 1 == 2

def test_skip_call():
  pytest.skip("no GPU here")

@pytest.mark.skipif(True, reason="not on this system")
def test_skipif():
  pass

@pytest.mark.xfail(reason="a known bug")
def test_xfail():
  assert False

@pytest.mark.xfail(reason="fixed since?")
def test_xpass():
  pass
"""

MODULE_SKIP = """
import pytest

missing = pytest.importorskip("kfac_no_such_module")

def test_never_collected():
  pass
"""

THREE = """
def test_a():
  pass

def test_b():
  pass

def test_c():
  pass
"""


def _project(pytester, fail_on_skip=True):
  pytester.makeconftest((ROOT / "conftest.py").read_text())
  pytester.makeini("[pytest]\n" +
                   ("fail_on_skip = true\n" if fail_on_skip else ""))


def _check_all_ran():
  spec = importlib.util.spec_from_file_location(
      "check_all_ran", ROOT / ".ci" / "check_all_ran.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_skips_and_xfails_fail_with_the_option(pytester):
  _project(pytester)
  pytester.makepyfile(test_skips=SKIPS)
  result = pytester.runpytest("-rfE")
  result.assert_outcomes(passed=1, failed=3, errors=1)
  assert result.ret == pytest.ExitCode.TESTS_FAILED
  out = result.stdout.str()
  for name, what in [("test_skip_call", "skipped"),
                     ("test_skipif", "skipped"),
                     ("test_xfail", "xfailed"), ("test_xpass", "xpassed")]:
    assert "test_skips.py::%s %s" % (name, what) in out, (name, out)
  assert "no GPU here" in out and "not on this system" in out, out
  assert "fail_on_skip" in out, out


def test_without_the_option_they_stay_skips(pytester):
  _project(pytester, fail_on_skip=False)
  pytester.makepyfile(test_skips=SKIPS)
  result = pytester.runpytest()
  result.assert_outcomes(passed=1, skipped=2, xfailed=1, xpassed=1)
  assert result.ret == pytest.ExitCode.OK


def test_a_module_skipped_at_collection_fails(pytester):
  _project(pytester)
  pytester.makepyfile(test_module_skip=MODULE_SKIP)
  result = pytester.runpytest()
  result.assert_outcomes(errors=1)
  assert result.ret == pytest.ExitCode.INTERRUPTED
  out = result.stdout.str()
  assert "skipped at collection" in out and "kfac_no_such_module" in out, out
  _project(pytester, fail_on_skip=False)
  result = pytester.runpytest()
  result.assert_outcomes(skipped=1)
  assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED


def test_the_project_ini_sets_fail_on_skip():
  ini = (ROOT / "pytest.ini").read_text()
  assert "\nfail_on_skip = true\n" in ini, ini


@pytest.mark.parametrize("workers", [[], ["-n", "2"]])
def test_a_zero_time_budget_runs_nothing_and_fails(pytester, workers):
  _project(pytester)
  pytester.makepyfile(test_three=THREE)
  result = pytester.runpytest("--time_budget=0", *workers)
  result.assert_outcomes(failed=3)
  assert result.ret == pytest.ExitCode.TESTS_FAILED
  out = result.stdout.str()
  assert "3 test(s) not run (time budget): the run fails" in out, out
  for name in ("test_a", "test_b", "test_c"):
    assert "test_three.py::%s" % name in out, out


def test_tests_left_after_the_budget_fail(pytester):
  """test_a runs until the clock has moved past the budget (a condition on
  the clock, not a sleep): test_b and test_c are not started."""
  _project(pytester)
  pytester.makepyfile(test_three=THREE.replace(
      "def test_a():\n  pass",
      "def test_a():\n  import time\n  t0 = time.monotonic()\n"
      "  while time.monotonic() - t0 < 0.05:\n    pass"))
  result = pytester.runpytest("--time_budget=0.01")
  result.assert_outcomes(passed=1, failed=2)
  assert result.ret == pytest.ExitCode.TESTS_FAILED
  assert "2 test(s) not run (time budget)" in result.stdout.str()


def test_a_large_budget_runs_everything(pytester):
  _project(pytester)
  pytester.makepyfile(test_three=THREE)
  result = pytester.runpytest("--time_budget=3600")
  result.assert_outcomes(passed=3)
  assert result.ret == pytest.ExitCode.OK
  assert "not run" not in result.stdout.str()


def test_run_logs_prove_every_collected_test_passed(pytester, tmp_path):
  _project(pytester)
  pytester.makepyfile(test_three=THREE)
  collected = tmp_path / "collected.txt"
  passed = tmp_path / "passed.txt"
  assert pytester.runpytest("--collect-only", "-q",
                            "--run_log=%s" % collected).ret == 0
  assert collected.read_text().splitlines() == [
      "collected test_three.py::test_%s" % n for n in "abc"]
  # Two "tiers" (-k splits the file), the second in pytest-xdist workers:
  # only the controller writes the log.
  assert pytester.runpytest("-k", "test_a", "--run_log=%s" % passed).ret == 0
  assert pytester.runpytest("-k", "not test_a", "-n", "2",
                            "--run_log=%s" % passed).ret == 0
  assert sorted(passed.read_text().splitlines()) == [
      "passed test_three.py::test_%s" % n for n in "abc"]
  checker = _check_all_ran()
  out = io.StringIO()
  assert checker.check([str(collected), str(passed)], out) == 0, out.getvalue()
  assert "3 tests collected, 3 passed" in out.getvalue()


def test_check_all_ran_fails_on_a_test_that_did_not_pass(tmp_path):
  checker = _check_all_ran()
  log = tmp_path / "log.txt"
  log.write_text("collected a.py::t1\ncollected a.py::t2\ncollected "
                 "b.py::t3\npassed a.py::t1\npassed b.py::t3\n")
  out = io.StringIO()
  assert checker.check([str(log)], out) == 1
  assert "not passed: a.py::t2" in out.getvalue(), out.getvalue()
  # A passed test that the collection did not list fails it too.
  log.write_text("collected a.py::t1\npassed a.py::t1\npassed a.py::t9\n")
  out = io.StringIO()
  assert checker.check([str(log)], out) == 1
  assert "passed but not collected: a.py::t9" in out.getvalue()
  # So does a log without a collection.
  log.write_text("passed a.py::t1\n")
  assert checker.check([str(log)], io.StringIO()) == 1
  log.write_text("collected a.py::t1\npassed a.py::t1\n")
  assert checker.check([str(log)], io.StringIO()) == 0
  with pytest.raises(SystemExit, match="no run log .*did not run"):
    checker.check([str(log), str(tmp_path / "missing.txt")], io.StringIO())
  log.write_text("ran a.py::t1\n")
  with pytest.raises(SystemExit, match="not a run log line"):
    checker.check([str(log)], io.StringIO())



PARAMS = """
import pytest

def test_a():
  pass

@pytest.mark.parametrize("n", [1, 2])
def test_b(n):
  pass
"""


def _slow_cases(pytester, text):
  """The plugin's list of slow cases, at its place under the test root."""
  listed = pytester.path / "kfac" / "python" / "kernel_tests"
  listed.mkdir(parents=True)
  (listed / "slow_cases.txt").write_text(text)


def test_listed_cases_are_slow_and_stale_names_fail(pytester):
  _project(pytester)
  _slow_cases(pytester, "# the long one\ntest_params.py::test_b[2]\n")
  pytester.makeini("[pytest]\nfail_on_skip = true\nmarkers =\n    slow: x\n")
  pytester.makepyfile(test_params=PARAMS)
  fast = pytester.runpytest("-m", "not slow", "-v")
  fast.assert_outcomes(passed=2, deselected=1)
  assert "test_b[2]" not in fast.stdout.str()
  slow = pytester.runpytest("-m", "slow", "-v")
  slow.assert_outcomes(passed=1, deselected=2)
  assert "test_params.py::test_b[2] PASSED" in slow.stdout.str()
  # A renamed case: the list names what its file no longer collects.
  (pytester.path / "kfac/python/kernel_tests/slow_cases.txt").write_text(
      "test_params.py::test_b[3]\n")
  stale = pytester.runpytest("-m", "not slow")
  assert stale.ret == pytest.ExitCode.USAGE_ERROR
  assert "test_params.py::test_b[3]" in stale.stderr.str()
