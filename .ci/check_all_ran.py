#!/usr/bin/env python3
"""Fails unless every collected test passed in one of the tiers.

usage: check_all_ran.py LOG [LOG...]

The logs are written by conftest.py's --run_log: "collected <node id>"
lines from `pytest --collect-only --run_log=LOG` (every test of the suite,
both tiers), "passed <node id>" lines from each tier's run. A collected test
that did not pass in any log (deselected by both tiers, skipped, failed,
never started) fails the check, and so does a passed test that the
collection did not list (the two runs disagree on what the suite is), or an
empty collection.
"""

import collections
import sys


def read_logs(paths):
  seen = collections.defaultdict(set)
  for path in paths:
    try:
      f = open(path, encoding="utf-8")
    except FileNotFoundError:
      raise SystemExit("check_all_ran: FAILED: no run log %s (its tier did "
                       "not run)" % path) from None
    with f:
      for number, line in enumerate(f, 1):
        line = line.rstrip("\n")
        if not line:
          continue
        kind, _, nodeid = line.partition(" ")
        if kind not in ("collected", "passed") or not nodeid:
          raise SystemExit("%s:%d: not a run log line: %r" %
                           (path, number, line))
        seen[kind].add(nodeid)
  return seen["collected"], seen["passed"]


def check(paths, out=sys.stdout):
  """0 when every collected test passed (and nothing else ran), else 1."""
  collected, passed = read_logs(paths)
  missing = sorted(collected - passed)
  unknown = sorted(passed - collected)
  out.write("check_all_ran: %d tests collected, %d passed\n" %
            (len(collected), len(passed & collected)))
  if not collected:
    out.write("check_all_ran: FAILED: no collected tests in the logs\n")
    return 1
  for nodeid in missing:
    out.write("not passed: %s\n" % nodeid)
  for nodeid in unknown:
    out.write("passed but not collected: %s\n" % nodeid)
  if missing or unknown:
    out.write("check_all_ran: FAILED: %d collected test(s) did not pass in "
              "any tier, %d passed test(s) were not collected\n" %
              (len(missing), len(unknown)))
    return 1
  out.write("check_all_ran: every collected test passed\n")
  return 0


if __name__ == "__main__":
  if len(sys.argv) < 2:
    sys.exit(__doc__)
  sys.exit(check(sys.argv[1:]))
