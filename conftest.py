"""pytest options of the project (loaded from the repository root).

Estimator tests: kfac/python/kernel_tests/estimator_tf215_test.py needs
`tensorflow-estimator`, which exists for TensorFlow <= 2.15 only. It is in
`collect_ignore` (never collected, so neither run nor skipped) unless that
package is installed, as in the .venv-tf215 of `make test-tf215`, which
names the file explicitly.

--time_budget=SECONDS: start no test once SECONDS have passed since the
first one started; the tests left are listed as "not run (time budget)" at
the end and are neither passed, failed nor skipped. .ci/run uses it to run
as much of the slow tier as fits its time after the fast tier. Without the
option pytest runs every collected test, as usual.
"""

import importlib.util
import time

import pytest

collect_ignore = []
if importlib.util.find_spec("tensorflow_estimator") is None:
  collect_ignore.append("kfac/python/kernel_tests/estimator_tf215_test.py")


def pytest_addoption(parser):
  parser.addoption(
      "--time_budget", type=float, default=None, metavar="SECONDS",
      help="start no test after SECONDS; list the tests left as not run")


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
  budget = session.config.getoption("time_budget")
  if budget is None or session.config.option.collectonly:
    return None  # pytest's own loop
  option = session.config.option
  if session.testsfailed and not option.continue_on_collection_errors:
    raise session.Interrupted(
        "%d error(s) during collection" % session.testsfailed)
  start = time.monotonic()
  items = session.items
  for i, item in enumerate(items):
    if time.monotonic() - start > budget:
      session.config.stash[_NOT_RUN] = [it.nodeid for it in items[i:]]
      break
    next_item = items[i + 1] if i + 1 < len(items) else None
    item.config.hook.pytest_runtest_protocol(item=item, nextitem=next_item)
    if session.shouldfail:
      raise session.Failed(session.shouldfail)
    if session.shouldstop:
      raise session.Interrupted(session.shouldstop)
  return True


_NOT_RUN = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, config):
  not_run = config.stash.get(_NOT_RUN, None)
  if not not_run:
    return
  budget = config.getoption("time_budget")
  terminalreporter.section("not run: time budget of %.0f s used" % budget)
  for nodeid in not_run:
    terminalreporter.line(nodeid)
  terminalreporter.line("%d test(s) not run (time budget)" % len(not_run))
