"""Main of the Bazel py_test targets: runs one kernel test file with pytest.

The kernel tests are pytest files (fixtures, parametrize, marks), not
scripts, so every py_test in BUILD has this file as its main and the test
file as its argument:

  bazel_pytest_main.py kfac/python/kernel_tests/foo_test.py

It runs from the runfiles root (Bazel's working directory for tests), where
BUILD puts pytest.ini and conftest.py, and selects the tests with
`-m "$KFAC_PYTEST_MARKERS"`: "not slow" (the fast tier of `make test`) unless
the variable is set, e.g. `bazel test //... --test_env=KFAC_PYTEST_MARKERS=slow`
for the slow tier. A file whose tests are all deselected by the marker
expression (install_test in the fast tier) passes with a line saying so;
a file in which pytest collects no test at all fails.
"""

import os
import sys

import pytest


class _Selection:
  """Counts the tests pytest selected and deselected."""

  def __init__(self):
    self.selected = 0
    self.deselected = 0

  def pytest_deselected(self, items):
    self.deselected += len(items)

  def pytest_collection_finish(self, session):
    self.selected = len(session.items)


def main(argv):
  if len(argv) != 2 or not argv[1].endswith(".py"):
    sys.stderr.write("usage: %s path/to/foo_test.py\n" % argv[0])
    return 2
  test_file = argv[1]
  if not os.path.exists("pytest.ini"):
    sys.stderr.write("pytest.ini is not in the runfiles root %s; it must be "
                     "in the test's data (BUILD)\n" % os.getcwd())
    return 2
  markers = os.environ.get("KFAC_PYTEST_MARKERS", "not slow")
  args = [test_file, "-q", "-m", markers]
  # Per-test-case results for Bazel, and pytest's temporary folders in the
  # test's own TEST_TMPDIR rather than the shared /tmp/pytest-of-$USER.
  if os.environ.get("XML_OUTPUT_FILE"):
    args.append("--junitxml=" + os.environ["XML_OUTPUT_FILE"])
  if os.environ.get("TEST_TMPDIR"):
    args.append("--basetemp=" + os.path.join(os.environ["TEST_TMPDIR"],
                                             "pytest"))
  print("bazel_pytest_main: %s -m pytest %s" % (sys.executable,
                                                " ".join(args)))
  selection = _Selection()
  rc = pytest.main(args, plugins=[selection])
  if "kfac" in sys.modules:
    print("bazel_pytest_main: kfac imported from %s"
          % sys.modules["kfac"].__file__)
  if (rc == pytest.ExitCode.NO_TESTS_COLLECTED and selection.deselected
      and not selection.selected):
    print("bazel_pytest_main: all %d tests of %s are deselected by -m %r; "
          "none ran" % (selection.deselected, test_file, markers))
    return 0
  return int(rc)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
