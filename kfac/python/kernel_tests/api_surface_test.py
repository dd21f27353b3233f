"""Every public name and signature of kfac 0.2.4 exists in ours.

The old package is installed into a throwaway folder
(`pip install --no-deps --target`, cached under the system's temporary
folder; KFAC_OLD_PACKAGE_DIR names an unpacked copy instead) and read
statically by api_surface.py: it is never imported. Each deliberate
difference is a row of the table under "### Names and signatures" in
docs/migration.md, which this test reads: every name in a row's first
column, `kfac.python.` + the module column + `.` + the name, exempts the
problems reported for exactly that key. A listed class exempts only the
class missing as a whole (the key of the class itself), never its methods:
each member that differs is named. A listed difference that no longer
exists fails the test too, so the table stays true.
"""

import os
import re
import subprocess
import sys
import tempfile

import pytest

from kfac.python.kernel_tests import api_surface

OLD_VERSION = "0.2.4"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
MIGRATION = os.path.join(ROOT, "docs", "migration.md")
_SECTION = "### Names and signatures"
_HEADER = "| old name | module | what we do instead |"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")
_MODULE = re.compile(r"^(keras|ops)(\.[a-z_][a-z0-9_]*)*$")


def parse_exemptions(text):
  """{key: reason} from the table of docs/migration.md's section "Names and
  signatures"; ValueError naming the row for a row it cannot read."""
  if _SECTION not in text:
    raise ValueError("docs/migration.md has no section %r" % _SECTION)
  lines = text[text.index(_SECTION):].splitlines()
  try:
    first = lines.index(_HEADER)
  except ValueError:
    raise ValueError("docs/migration.md, %s: no table with the header %r" %
                     (_SECTION, _HEADER)) from None
  exemptions = {}
  for row in lines[first + 2:]:
    if not row.startswith("|"):
      break
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    if len(cells) != 3 or not all(cells):
      raise ValueError("docs/migration.md: a row without 3 filled cells: "
                       "%r" % row)
    names, module, reason = cells
    module = module.strip("`")
    names = [n.strip() for n in names.split(",")]
    if not _MODULE.match(module) or not all(
        n.startswith("`") and n.endswith("`") and _NAME.match(n[1:-1])
        for n in names):
      raise ValueError(
          "docs/migration.md: row %r: the first column must list `Name` or "
          "`Class.member` names, comma separated, and the module column a "
          "module under kfac.python (e.g. `ops.fisher_factors`)" % row)
    for n in names:
      key = "kfac.python.%s.%s" % (module, n[1:-1])
      if key in exemptions:
        raise ValueError("docs/migration.md: %s is listed twice" % key)
      exemptions[key] = reason
  if not exemptions:
    raise ValueError("docs/migration.md: the table of %s is empty" % _SECTION)
  return exemptions


def _exemptions():
  with open(MIGRATION, encoding="utf-8") as f:
    return parse_exemptions(f.read())


def _old_package():
  given = os.environ.get("KFAC_OLD_PACKAGE_DIR")
  if given:
    return given
  target = os.path.join(tempfile.gettempdir(), "kfac-%s-api" % OLD_VERSION)
  if os.path.exists(os.path.join(target, "kfac", "__init__.py")):
    return target
  # Installed beside the target and renamed into place: runs at the same
  # time (other checkouts, other workers) never see a half-written copy.
  staging = tempfile.mkdtemp(prefix="kfac-%s-api." % OLD_VERSION,
                             dir=tempfile.gettempdir())
  result = subprocess.run(
      [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
       "--disable-pip-version-check", "--target", staging,
       "kfac==%s" % OLD_VERSION],
      capture_output=True, text=True, timeout=300, check=False)
  if result.returncode != 0:
    pytest.fail("kfac %s could not be installed from the package registry "
                "(offline? set KFAC_OLD_PACKAGE_DIR to an unpacked copy), so "
                "the API surface cannot be compared: %s" %
                (OLD_VERSION, result.stderr.strip()[-300:]))
  try:
    os.rename(staging, target)
  except OSError:  # another run put its copy there first
    if not os.path.exists(os.path.join(target, "kfac", "__init__.py")):
      raise
    return staging
  return target


@pytest.fixture(scope="module")
def problems():
  return api_surface.compare(_old_package())


def test_every_old_public_name_and_signature_exists(problems):
  exempt = _exemptions()
  unexpected = ["%s: %s" % (k, p) for k, p in problems if k not in exempt]
  assert not unexpected, "\n".join(unexpected)


def test_every_exemption_is_a_real_difference(problems):
  keys = {k for k, _ in problems}
  stale = sorted(set(_exemptions()) - keys)
  assert not stale, (
      "listed in docs/migration.md as different, but compatible now (or not "
      "a member that the comparison reports): %s" % stale)


def test_a_listed_class_does_not_exempt_its_members():
  """Exemptions match keys exactly: a class's row covers the class key
  only, and a member's row that member only."""
  exempt = parse_exemptions(
      "### Names and signatures\n\n" + _HEADER + "\n| --- | --- | --- |\n"
      "| `FisherFactor`, `Kfac.layers` | `ops.fisher_factors` | why |\n")
  assert set(exempt) == {"kfac.python.ops.fisher_factors.FisherFactor",
                         "kfac.python.ops.fisher_factors.Kfac.layers"}
  problems = [("kfac.python.ops.fisher_factors.FisherFactor", "missing"),
              ("kfac.python.ops.fisher_factors.FisherFactor.get_cov_vars",
               "missing"),
              ("kfac.python.ops.fisher_factors.Kfac.layers_extra", "missing")]
  assert [k for k, _ in problems if k not in exempt] == [
      problems[1][0], problems[2][0]]


@pytest.mark.parametrize("row, message", [
    ("| `FisherFactor` | `ops.fisher_factors` |  |", "3 filled cells"),
    ("| FisherFactor | `ops.fisher_factors` | why |", "first column"),
    ("| `FisherFactor` | `fisher_factors` | why |", "module column"),
    ("| `a.b.c` | `ops.utils` | why |", "first column"),
])
def test_an_unreadable_row_is_an_error_naming_it(row, message):
  text = ("### Names and signatures\n\n" + _HEADER +
          "\n| --- | --- | --- |\n" + row + "\n")
  with pytest.raises(ValueError, match=re.escape(message)):
    parse_exemptions(text)


def test_the_table_has_one_row_per_difference_and_no_duplicates():
  exempt = _exemptions()
  assert len(exempt) >= 40, sorted(exempt)
  with pytest.raises(ValueError, match="listed twice"):
    parse_exemptions(
        "### Names and signatures\n\n" + _HEADER + "\n| --- | --- | --- "
        "|\n| `K` | `keras.utils` | a |\n| `K` | `keras.utils` | b |\n")
