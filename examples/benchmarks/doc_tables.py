"""The tables of README.md and docs/ rendered from the results files that
the benchmarks write, and the docs' commands checked against the tree.

A generated table sits between two markers in a markdown file:

    <!-- table: examples/benchmarks/results/critical_batch.json#cnn -->
    | optimizer | B=256 | ...
    <!-- end table -->

The marker names a results JSON (relative to the repository root) and a
key of its "tables" object, a markdown text the benchmark wrote from its
runs (the same text as its .md file). `key:section` takes one section of
that text: the lines after the bold heading line (`**...**`) whose slug
(lower case, every run of other characters than letters and digits one
`-`) is `section`, up to the next bold heading line:

    <!-- table: examples/benchmarks/results/make_bench.json#kfac_cost:cost-of-adaptive-k-fac-autoencoder-ms-per-step --> `render` replaces what is between
the markers with that text; `check` reports every marked table that
differs from its results file, and every reference in a doc to something
that does not exist:

* `make <target>` (in code): a target of the Makefile;
* a program of the tree run with flags (`examples/.../x.py --flag=...`, in
  code, across backslash-continued lines, also through a shell variable
  set in the same block, `B=examples/.../x.py` ... `$B --flag`): the file
  exists and defines each flag (absl `flags.DEFINE_*("name"`, in the
  program or in a module of its folder that it imports; argparse
  `add_argument("--name"`), absl's own flags aside;
* a path of the tree in code (`examples/...`, `kfac/...`, `docs/...`,
  `.ci/...`): it exists;
* `make bench` runs exactly the programs docs/benchmarks.md's program
  table marks "yes" (`bench_problems`: the Makefile's `bench` runs
  make_bench.py, whose PROGRAMS is the suite).

    python examples/benchmarks/doc_tables.py            # render in place
    python examples/benchmarks/doc_tables.py --check    # report, exit 1

(`make docs`, `make docs-check`.) No TensorFlow: the module reads text.
"""

import argparse
import ast
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

BEGIN = re.compile(r"^<!-- table: (?P<path>[^#\s]+)#(?P<key>[^\s]+) -->$")
END = "<!-- end table -->"

# Flags absl defines for every program (absl.app, absl.logging).
ABSL_FLAGS = frozenset((
    "help", "helpshort", "helpfull", "helpxml", "flagfile", "undefok",
    "logtostderr", "alsologtostderr", "log_dir", "verbosity", "v",
    "stderrthreshold", "showprefixforinfo", "only_check_args", "pdb",
    "pdb_post_mortem", "run_with_pdb", "run_with_profiling", "profile_file",
    "use_cprofile_for_profiling", "logger_levels"))

TREE_ROOTS = ("examples/", "kfac/", "docs/", ".ci/")


def doc_files(root=ROOT):
  """README.md and docs/*.md, sorted."""
  docs = os.path.join(root, "docs")
  return [os.path.join(root, "README.md")] + sorted(
      os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))


class DocError(ValueError):
  """A doc whose markers are malformed or name a missing table."""


def _table(root, path, key, where):
  full = os.path.join(root, path)
  if not os.path.isfile(full):
    raise DocError("%s: the results file %s does not exist" % (where, path))
  with open(full, encoding="utf-8") as f:
    data = json.load(f)
  tables = data.get("tables")
  key, _, section = key.partition(":")
  if not isinstance(tables, dict) or key not in tables:
    raise DocError("%s: %s has no table %r (it has: %s)" % (
        where, path, key, ", ".join(sorted(tables or {})) or "none"))
  text = tables[key].strip("\n")
  if not section:
    return text
  sections = _sections(text)
  if section not in sections:
    raise DocError("%s: %s's table %r has no section %r (it has: %s)" % (
        where, path, key, section, ", ".join(sorted(sections)) or "none"))
  return sections[section]


BOLD_HEADING = re.compile(r"^\*\*(?P<title>[^*].*?)\*\*$")


def slug(title):
  """`title` in lower case, each run of non-alphanumerics one `-`."""
  return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def _sections(text):
  """{slug of a bold heading line: the lines under it, stripped}."""
  sections, name, lines = {}, None, []
  for line in text.split("\n") + ["**end**"]:
    match = BOLD_HEADING.match(line.strip())
    if match:
      if name is not None:
        sections[name] = "\n".join(lines).strip("\n")
      name, lines = slug(match.group("title")), []
    elif name is not None:
      lines.append(line)
  sections.pop("end", None)
  return sections


def render_text(text, root=ROOT, name="<doc>"):
  """`text` with every marked table replaced by its results file's."""
  lines = text.split("\n")
  out, i = [], 0
  while i < len(lines):
    match = BEGIN.match(lines[i].strip())
    if lines[i].strip() == END:
      raise DocError("%s:%d: %s without a table marker before it" % (
          name, i + 1, END))
    if not match:
      out.append(lines[i])
      i += 1
      continue
    start = i
    i += 1
    while i < len(lines) and lines[i].strip() != END:
      if BEGIN.match(lines[i].strip()):
        raise DocError("%s:%d: a table marker inside the table of line %d"
                       % (name, i + 1, start + 1))
      i += 1
    if i == len(lines):
      raise DocError("%s:%d: table marker without %s" % (
          name, start + 1, END))
    where = "%s:%d" % (name, start + 1)
    out += [lines[start], _table(root, match.group("path"),
                                 match.group("key"), where), lines[i]]
    i += 1
  return "\n".join(out)


def table_differences(root=ROOT, files=None):
  """Problems: each marked table that differs from its results file."""
  problems = []
  for path in files or doc_files(root):
    name = os.path.relpath(path, root)
    with open(path, encoding="utf-8") as f:
      text = f.read()
    try:
      want = render_text(text, root, name)
    except DocError as e:
      problems.append(str(e))
      continue
    if want != text:
      got_lines, want_lines = text.split("\n"), want.split("\n")
      line = next((k for k, (a, b) in enumerate(zip(got_lines, want_lines))
                   if a != b), min(len(got_lines), len(want_lines)))
      problems.append(
          "%s:%d: a generated table differs from its results file "
          "(run `make docs`): %r" % (
              name, line + 1,
              got_lines[line] if line < len(got_lines) else "<end>"))
  return problems


# ------------------------------------------------------------ references
def makefile_targets(root=ROOT):
  targets = set()
  with open(os.path.join(root, "Makefile"), encoding="utf-8") as f:
    for line in f:
      m = re.match(r"^([A-Za-z0-9_.-]+(?:\s+[A-Za-z0-9_.-]+)*)\s*:(?!=)",
                   line)
      if m and not line.startswith("\t"):
        targets.update(m.group(1).split())
  return targets


def _code_regions(text):
  """The doc's code: fenced blocks (whole) and inline code spans."""
  blocks, rest = [], []
  fence = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
  last = 0
  for m in fence.finditer(text):
    rest.append(text[last:m.start()])
    blocks.append(m.group(1))
    last = m.end()
  rest.append(text[last:])
  spans = []
  for part in rest:
    spans += re.findall(r"``(.+?)``|`([^`\n]+)`", part)
  return blocks + [a or b for a, b in spans]


def _defined_flags(program, root, seen=None):
  """Flags a program of the tree defines (absl or argparse), with those of
  the modules of its folder that it imports."""
  seen = set() if seen is None else seen
  if program in seen or not os.path.isfile(program):
    return set()
  seen.add(program)
  with open(program, encoding="utf-8") as f:
    source = f.read()
  names = set(re.findall(
      r"flags\.DEFINE_\w+\(\s*[\"']([\w-]+)[\"']", source))
  names |= set(re.findall(r"add_argument\(\s*[\"']--([\w-]+)[\"']", source))
  names |= {n.replace("-", "_") for n in names}
  folder = os.path.dirname(program)
  for module in re.findall(r"^\s*(?:import|from)\s+(\w+)", source, re.M):
    # A module of the program's folder or of a folder above it, below the
    # root (the benchmarks import examples/side_by_side.py).
    here = folder
    while os.path.relpath(here, root) != os.pardir and here != root:
      sibling = os.path.join(here, module + ".py")
      if os.path.isfile(sibling):
        names |= _defined_flags(sibling, root, seen)
        break
      here = os.path.dirname(here)
  return names


def _flag_known(flag, defined):
  if flag in defined or flag in ABSL_FLAGS:
    return True
  # absl's --noFLAG for a boolean FLAG.
  return flag.startswith("no") and flag[2:] in defined


PROGRAM = re.compile(r"(?<![\w/.-])((?:examples|kfac)/[\w./-]+\.py)")


def _commands(code):
  """(program path, [flag names]) of each program run in a code text,
  lines joined across backslashes, $VAR expanded from VAR=path in it."""
  joined = re.sub(r"\\\n\s*", " ", code)
  variables = dict(re.findall(r"^\s*(\w+)=(\S+\.py)\s*$", joined, re.M))
  found = []
  for line in joined.split("\n"):
    for var, value in variables.items():
      line = line.replace("$" + var, value).replace("${%s}" % var, value)
    for m in PROGRAM.finditer(line):
      tail = line[m.end():]
      tail = re.split(r"[;|&`)]|\s#", tail)[0]
      flags = re.findall(r"(?:^|\s)--([A-Za-z][\w-]*)", tail)
      found.append((m.group(1), flags))
  return found


FILE_TYPES = (".py", ".md", ".json", ".png", ".txt", ".sh", ".ini", ".cfg",
              ".bzl", ".bazel", ".yaml", ".toml", ".csv")


def _tree_path(ref):
  """The file or folder of the tree that `ref` (a word of code starting
  with a TREE_ROOTS folder) names, or None where it names none: a pattern,
  or a word that is not a path (the TensorBoard scalar `kfac/damping`).
  `module.py::test` is its file; `kfac/python/x/module.NAME`, the module
  file."""
  ref = ref.split("::")[0].rstrip(".")
  if any(c in ref for c in "*<>{}$"):
    return None
  last = ref.rsplit("/", 1)[-1]
  if "." in last and not last.endswith(FILE_TYPES):
    stem = ref.rsplit(".", 1)[0]
    return stem + ".py" if stem.count("/") >= 2 else None
  if last.endswith(FILE_TYPES) or ref.count("/") >= 2:
    return ref
  return None


def reference_problems(root=ROOT, files=None):
  """Problems: docs naming a make target, program, flag or path of the tree
  that does not exist."""
  targets = makefile_targets(root)
  problems = []
  for path in files or doc_files(root):
    name = os.path.relpath(path, root)
    with open(path, encoding="utf-8") as f:
      text = f.read()
    for code in _code_regions(text):
      for target in re.findall(r"(?:^|[\s;(&|])make\s+([A-Za-z][\w.-]*)",
                               code):
        if target not in targets:
          problems.append("%s: `make %s`: no such Makefile target" % (
              name, target))
      commands = _commands(code)
      for program, flags in commands:
        full = os.path.join(root, program)
        if not os.path.isfile(full):
          problems.append("%s: %s: no such program" % (name, program))
          continue
        defined = _defined_flags(full, root)
        for flag in flags:
          if not _flag_known(flag, defined):
            problems.append("%s: %s --%s: the program has no such flag" % (
                name, program, flag))
      for ref in re.findall(r"(?<![\w/.$-])((?:%s)[\w./-]*[\w/])" % "|".join(
          re.escape(r) for r in TREE_ROOTS), code):
        clean = _tree_path(ref)
        if clean in {program for program, _ in commands}:
          continue  # checked as a program above
        if os.path.exists(os.path.join(root, ref.rstrip("."))):
          continue  # as written (a folder named `0.1`, say)
        if clean and not os.path.exists(os.path.join(root, clean)):
          problems.append("%s: %s: no such file or folder" % (name, ref))
  return problems


def suite_programs(root=ROOT):
  """The programs of make_bench.py's PROGRAMS (read as text, not imported)."""
  path = os.path.join(root, "examples", "benchmarks", "make_bench.py")
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  for node in tree.body:
    if (isinstance(node, ast.Assign) and len(node.targets) == 1 and
        getattr(node.targets[0], "id", None) == "PROGRAMS"):
      return [name for name, _ in ast.literal_eval(node.value)]
  raise DocError("%s: no PROGRAMS" % path)


def bench_problems(root=ROOT):
  """Problems: `make bench` (the Makefile's target runs make_bench.py, which
  runs its PROGRAMS) and docs/benchmarks.md's program table ("in `make
  bench`": yes / no) disagree on which programs it runs."""
  with open(os.path.join(root, "Makefile"), encoding="utf-8") as f:
    makefile = f.read()
  recipe = re.search(r"^bench:[^\n]*\n((?:\t[^\n]*\n|[ ]+[^\n]*\n)+)",
                     makefile, re.M)
  if recipe is None:
    return ["Makefile: no `bench` target"]
  if "examples/benchmarks/make_bench.py" not in recipe.group(1):
    return ["Makefile: `bench` does not run examples/benchmarks/make_bench.py"]
  try:
    runs = set(suite_programs(root))
  except (DocError, OSError, SyntaxError, ValueError) as e:
    return ["make_bench.py: %s" % e]
  with open(os.path.join(root, "docs", "benchmarks.md"),
            encoding="utf-8") as f:
    doc = f.read()
  listed = dict(re.findall(r"^\| `([\w]+\.py)` \| (yes|no) \|", doc, re.M))
  if not listed:
    return ["docs/benchmarks.md: no program table (| `x.py` | yes/no | ...)"]
  problems = []
  for name in sorted(runs - {n for n, v in listed.items() if v == "yes"}):
    problems.append("make bench runs %s, which docs/benchmarks.md does not "
                    "mark \"yes\"" % name)
  for name in sorted({n for n, v in listed.items() if v == "yes"} - runs):
    problems.append("docs/benchmarks.md marks %s \"yes\" but make bench does "
                    "not run it" % name)
  return problems


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--check", action="store_true",
                      help="Report differences and bad references; exit 1 "
                           "if any (write nothing).")
  args = parser.parse_args(argv)
  if args.check:
    problems = table_differences() + reference_problems() + bench_problems()
    for p in problems:
      print(p)
    print("docs-check: %d problem(s) in %d files" % (
        len(problems), len(doc_files())))
    return 1 if problems else 0
  changed, failed = 0, 0
  for path in doc_files():
    with open(path, encoding="utf-8") as f:
      text = f.read()
    try:
      new = render_text(text, ROOT, os.path.relpath(path, ROOT))
    except DocError as e:  # that file stays as it is; the others render
      print("docs: error: %s" % e)
      failed += 1
      continue
    if new != text:
      with open(path, "w", encoding="utf-8") as f:
        f.write(new)
      changed += 1
      print("rendered", os.path.relpath(path, ROOT))
  print("docs: %d file(s) changed, %d not rendered" % (changed, failed))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
