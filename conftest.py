"""pytest options of the project (loaded from the repository root).

Nothing here imports TensorFlow: the plugin's own tests
(kfac/python/kernel_tests/ci_plugin_test.py) run it on tiny test files.

Estimator tests: kfac/python/kernel_tests/estimator_tf215_test.py needs
`tensorflow-estimator`, which exists for TensorFlow <= 2.15 only. It is in
`collect_ignore` (never collected, so neither run nor skipped) unless that
package is installed, as in the .venv-tf215 of `make test-tf215`, which
names the file explicitly.

A test that cannot run is a failure (ini option `fail_on_skip`, set in
pytest.ini): a skipped test (pytest.skip, a skip / skipif marker,
pytest.importorskip), a skipped test module, an xfailed or xpassed test are
reported as failed, with the reason. A missing optional dependency of a test
is a failure, not a skip.

--time_budget=SECONDS: a pytest process starts no test once SECONDS have
passed since its first test started; every test left is reported as FAILED
("not run: time budget ..."), so a run that leaves tests out exits non-zero.
Under pytest-xdist each worker counts its own time. Without the option every
collected test runs.

--run_log=FILE: the controller process appends one line per test that
passed ("passed <node id>") to FILE; with --collect-only, one line per
collected test ("collected <node id>"). .ci/run logs every collected test
and each tier's passed tests, and .ci/check_all_ran.py fails unless every
collected test passed in one of the tiers.
"""

import gc
import importlib.util
import pathlib
import time

import pytest

# pytester: kfac/python/kernel_tests/ci_plugin_test.py runs this plugin.
pytest_plugins = ("pytester",)

collect_ignore = []
if importlib.util.find_spec("tensorflow_estimator") is None:
  collect_ignore.append("kfac/python/kernel_tests/estimator_tf215_test.py")

NOT_RUN = "not run: time budget"
_START = pytest.StashKey[float]()


def pytest_addoption(parser):
  parser.addoption(
      "--time_budget", type=float, default=None, metavar="SECONDS",
      help="start no test after SECONDS (per process); the tests left fail "
           "as 'not run'")
  parser.addoption(
      "--run_log", default=None, metavar="FILE",
      help="append 'passed <node id>' for each test that passed to FILE "
           "('collected <node id>' for each test with --collect-only)")
  parser.addini(
      "fail_on_skip", type="bool", default=False,
      help="report skipped, xfailed and xpassed tests (and skipped modules) "
           "as failures")


def pytest_configure(config):
  if not hasattr(config, "workerinput"):  # not in a pytest-xdist worker
    config.pluginmanager.register(_Recorder(config), "kfac_ci_recorder")


# ------------------------------------------------------------ speed
def pytest_collection_finish(session):
  """What the collection imported (TensorFlow, Keras, the tests) is frozen
  out of the garbage collector's sweeps, and the youngest generation is
  swept less often: building TF graphs makes many short-lived objects, and
  the sweeps took about 8% of the tests' CPU time (measured 12.9 s of 161
  s on two test files; 6.3 s after this). Nothing here changes a test."""
  del session
  gc.collect()
  gc.freeze()
  gc.set_threshold(20000, 20, 20)


# ------------------------------------------------------------- tiers
_SLOW_CASES = pathlib.Path(__file__).parent / "kfac" / "python" / \
    "kernel_tests" / "slow_cases.txt"


def _case_key(item):
  """"file.py::test[params]" of a collected test."""
  return "%s::%s" % (item.path.name, item.nodeid.split("::", 1)[1])


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
  """Marks the cases listed in kernel_tests/slow_cases.txt `slow` (fast-tier
  cases measured at 2.5 s or more; the rule: docs/testing.md). A listed
  case that its file, collected, no longer has is a usage error: the list
  must not keep names that mark nothing."""
  if not _SLOW_CASES.parent.is_dir():
    return  # a copy of this plugin outside the project (ci_plugin_test)
  listed = set()
  for line in _SLOW_CASES.read_text(encoding="utf-8").splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
      listed.add(line)
  seen, files = set(), set()
  for item in items:
    key = _case_key(item)
    files.add(item.path.name)
    if key in listed:
      item.add_marker(pytest.mark.slow)
      seen.add(key)
  if any("::" in str(arg) for arg in config.args):
    return  # single tests named on the command line: files not whole
  stale = sorted(k for k in listed - seen if k.split("::")[0] in files)
  if stale:
    raise pytest.UsageError(
        "%s lists test cases that their files do not collect (renamed or "
        "removed?): %s" % (_SLOW_CASES, ", ".join(stale)))


# ------------------------------------------------------------- no skips
def _skip_reason(longrepr):
  if isinstance(longrepr, tuple) and len(longrepr) == 3:
    return str(longrepr[2])  # (path, line, "Skipped: reason")
  return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  report = outcome.get_result()
  if not item.config.getini("fail_on_skip"):
    return
  xfail = getattr(report, "wasxfail", None)
  if report.skipped:
    what = ("xfailed (%s)" % xfail if xfail is not None else
            "skipped (%s)" % _skip_reason(report.longrepr))
  elif xfail is not None:
    what = "xpassed (xfail marker: %s)" % xfail
  else:
    return
  if xfail is not None:
    del report.wasxfail
  report.outcome = "failed"
  report.longrepr = (
      "%s %s in %s: a test that cannot run, or is expected to fail, counts as "
      "a failure here (fail_on_skip in pytest.ini); install what it needs "
      "or fix it." % (item.nodeid, what, report.when))


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
  outcome = yield
  report = outcome.get_result()
  if report.skipped and collector.config.getini("fail_on_skip"):
    report.outcome = "failed"
    report.longrepr = (
        "%s was skipped at collection (%s): a test module that cannot run "
        "counts as a failure here (fail_on_skip in pytest.ini); install what "
        "it needs." % (collector.nodeid, _skip_reason(report.longrepr)))


# ---------------------------------------------------------- time budget
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
  """Past the budget: reports the test as failed without running it."""
  del nextitem
  budget = item.config.getoption("time_budget")
  if budget is None:
    return None
  now = time.monotonic()
  start = item.config.stash.setdefault(_START, now)
  if now - start < budget:
    return None
  ihook = item.ihook
  ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
  report = pytest.TestReport(
      item.nodeid, item.location, {k: 1 for k in item.keywords}, "failed",
      "%s of %g s used (--time_budget): this test was not run, which fails "
      "the run." % (NOT_RUN, budget), "call",
      user_properties=[("not_run", "time budget")])
  ihook.pytest_runtest_logreport(report=report)
  ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
  return True


# ------------------------------------------------------------ reporting
class _Recorder:
  """Counts the controller's reports (pytest-xdist forwards the workers'
  reports to it): tests not run for the budget, tests that passed."""

  def __init__(self, config):
    self.config = config
    self.not_run = []
    self.passed = []
    self.collected = []

  def pytest_collection_finish(self, session):
    if self.config.option.collectonly:
      self.collected = [item.nodeid for item in session.items]

  def pytest_runtest_logreport(self, report):
    if ("not_run", "time budget") in report.user_properties:
      self.not_run.append(report.nodeid)
    elif report.when == "call" and report.passed:
      self.passed.append(report.nodeid)

  def pytest_sessionfinish(self):
    path = self.config.getoption("run_log")
    if path:
      with open(path, "a", encoding="utf-8") as f:
        for nodeid in self.collected:
          f.write("collected %s\n" % nodeid)
        for nodeid in self.passed:
          f.write("passed %s\n" % nodeid)

  def pytest_terminal_summary(self, terminalreporter):
    if not self.not_run:
      return
    terminalreporter.section("not run: time budget of %g s used" %
                             self.config.getoption("time_budget"))
    for nodeid in self.not_run:
      terminalreporter.line(nodeid)
    terminalreporter.line(
        "%d test(s) not run (time budget): the run fails" % len(self.not_run))
