"""The old suite's report: OUT/junit_old.xml and OUT/junit_ours.xml (run.sh)
-> OUT/old_suite.json: every test's outcome in both passes, the counts, and
the tables docs/migration.md renders (doc_tables.py): "summary" (the
counts) and "differences" (each test that passes on kfac 0.2.4 and not
here, with its error and its reason from reasons.json).

    python examples/old_suite/report.py OUT

A test that passes on 0.2.4, fails here and has no reason in reasons.json
is listed as "unexplained" and the program exits 1; so does a reason for a
test that no longer differs (reasons.json must say only what is true)."""

import json
import os
import re
import sys
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
REASONS = os.path.join(HERE, "reasons.json")


def test_id(case):
  """kernel_tests/file_test.py::Class::test of a junit testcase."""
  parts = case.get("classname", "").split(".")
  name = case.get("name", "")
  for i in range(len(parts), 0, -1):
    if parts[i - 1].endswith("_test"):
      return "/".join(parts[:i]) + ".py" + "".join(
          "::" + p for p in parts[i:] + [name])
  return ".".join(parts + [name])


def error_line(element):
  """The exception's line of a failure ('E   Type: message'), else its
  message."""
  for line in (element.text or "").splitlines():
    if re.match(r"E\s+[\w.]+(Error|Exception|Exit)\b", line):
      return line[1:].strip()[:300]
  return (element.get("message") or "").strip().split("\n")[0][:300]


def outcomes(path):
  """{test id: (status, error line)} of a junit file."""
  found = {}
  for case in ET.parse(path).getroot().iter("testcase"):
    status, error = "passed", ""
    for tag, name in (("failure", "failed"), ("error", "error"),
                      ("skipped", "skipped")):
      element = case.find(tag)
      if element is not None:
        status, error = name, error_line(element)
        break
    found[test_id(case)] = (status, error)
  return found


def report(old, ours, reasons):
  """The results dict (tables included) from the two passes' outcomes."""
  ids = sorted(set(old) | set(ours))
  tests = {t: {"old": old.get(t, ("not run", ""))[0],
               "ours": ours.get(t, ("not run", ""))[0],
               "ours_error": ours.get(t, ("", ""))[1]} for t in ids}
  pass_old = [t for t in ids if tests[t]["old"] == "passed"]
  differ = [t for t in pass_old if tests[t]["ours"] != "passed"]
  unexplained = [t for t in differ if t not in reasons]
  stale = sorted(set(reasons) - set(differ))
  summary = "\n".join([
      "| tests of kfac 0.2.4's suite | count |", "|---|---:|",
      "| collected | %d |" % len(ids),
      "| pass on kfac 0.2.4 | %d |" % len(pass_old),
      "| of which pass on this package | %d |" % (len(pass_old) -
                                                  len(differ)),
      "| of which fail on this package (below, each with its reason) | %d |"
      % len(differ),
      "| fail on kfac 0.2.4, pass on this package | %d |" % sum(
          tests[t]["old"] != "passed" and tests[t]["ours"] == "passed"
          for t in ids)])
  rows = ["| test | error here | why |", "|---|---|---|"]
  for t in differ:
    rows.append("| `%s` | %s | %s |" % (
        t.replace("kernel_tests/", ""),
        tests[t]["ours_error"].replace("|", "/")[:160] or tests[t]["ours"],
        reasons.get(t, "**unexplained**")))
  return {"tests": tests, "pass_old": len(pass_old),
          "pass_both": len(pass_old) - len(differ), "differ": differ,
          "unexplained": unexplained, "stale_reasons": stale,
          "tables": {"summary": summary, "differences": "\n".join(rows)}}


def main(argv):
  if len(argv) != 2:
    sys.exit(__doc__)
  out = argv[1]
  with open(REASONS, encoding="utf-8") as f:
    reasons = json.load(f)
  result = report(outcomes(os.path.join(out, "junit_old.xml")),
                  outcomes(os.path.join(out, "junit_ours.xml")), reasons)
  commit = os.path.join(out, "commit.txt")
  if os.path.exists(commit):
    with open(commit, encoding="utf-8") as f:
      result["suite_commit"] = f.read().strip()
  with open(os.path.join(out, "old_suite.json"), "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1, sort_keys=True)
  print(result["tables"]["summary"] + "\n\n" + result["tables"]["differences"])
  problems = (["unexplained: " + t for t in result["unexplained"]] +
              ["reason for a test that does not differ: " + t
               for t in result["stale_reasons"]])
  for p in problems:
    print(p)
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
