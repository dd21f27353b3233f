"""The shape of the package (docs/layout.md): no import cycle between kfac's
modules, and kfac/python/ops/ holding
kfac 0.2.4's module paths and otherwise only the concept packages that
docs/layout.md describes.

The checks read the source files (the `ast` of every module), so they run
in a fraction of a second and fail with the cycle, the module or the folder
that breaks the rule."""

import ast
import collections
import os
import re

import pytest

# From the resolved path, so that under Bazel the source tree is read.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.realpath(__file__)))))
PACKAGE = os.path.join(ROOT, "kfac")
OPS = os.path.join(PACKAGE, "python", "ops")
LAYOUT_DOC = os.path.join(ROOT, "docs", "layout.md")

# kfac 0.2.4's modules in kfac/python/ops (kept importable; thin where the
# code moved). linear_operator was a module there and is a package here.
OLD_OPS_MODULES = {
    "__init__", "curvature_matrix_vector_products", "estimator",
    "fisher_blocks", "fisher_factors", "layer_collection", "loss_functions",
    "op_queue", "optimizer", "placement", "utils",
}
OLD_OPS_PACKAGES = {"kfac_utils", "tensormatch", "linear_operator"}

# The dependency direction (docs/layout.md), lowest level first: a module of
# kfac/python/ops imports only from its own level or lower ones. A module
# belongs to the longest entry its dotted name (under kfac.python.ops)
# starts with. kfac 0.2.4's thin modules (ops/*.py except
# curvature_matrix_vector_products, which holds its code) are above every
# level: only users, kfac/__init__.py and other thin modules import them.
LEVELS = (
    ("tensors", "numerics", "reliability", "forward_mode", "lazy",
     "schedules", "compat_utils"),
    ("layers.base", "compat_utils.legacy_constants",
     "compat_utils.block_helpers"),
    ("layers", "ekfac"),
    ("losses",),
    ("tensormatch", "collection"),
    ("distribute", "compat_utils.replication", "compat_utils.accumulators"),
    ("estimation", "linear_operator", "curvature_matrix_vector_products"),
    ("adaptive",),
    ("optimizers", "data", "kfac_utils"),
)


def library_modules(root=ROOT):
  """{dotted module name: path} of kfac's library (no kernel_tests)."""
  modules = {}
  for dirpath, dirnames, filenames in os.walk(os.path.join(root, "kfac")):
    dirnames[:] = sorted(d for d in dirnames
                         if d not in ("kernel_tests", "__pycache__"))
    for f in sorted(filenames):
      if not f.endswith(".py"):
        continue
      path = os.path.join(dirpath, f)
      name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
      if name.endswith(".__init__"):
        name = name[:-len(".__init__")]
      modules[name] = path
  return modules


def import_graph(modules):
  """{module: set of kfac modules it imports}, counting imports anywhere in
  the file (inside functions too: a deferred import is still a dependency)."""
  graph = collections.defaultdict(set)
  for name, path in modules.items():
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
      targets = []
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        for a in node.names:
          full = node.module + "." + a.name
          targets.append(full if full in modules else node.module)
      for t in targets:
        # `import kfac.python.ops.x` also runs the packages above it, but a
        # package's __init__ importing its own submodules is not a cycle.
        if t in modules and t != name and not name.startswith(t + "."):
          graph[name].add(t)
  return graph


def cycles(graph):
  """The strongly connected components with more than one module."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []
  counter = [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def test_no_import_cycles():
  found = cycles(import_graph(library_modules()))
  assert not found, "import cycles between kfac modules: %s" % "; ".join(
      " <-> ".join(c) for c in found)


def test_the_cycle_check_finds_a_cycle(tmp_path):
  pkg = tmp_path / "kfac"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from kfac import b\n")
  (pkg / "b.py").write_text("def f():\n  from kfac.a import x\n")
  (pkg / "c.py").write_text("import kfac.a\n")
  assert cycles(import_graph(library_modules(str(tmp_path)))) == [
      ["kfac.a", "kfac.b"]]


def _level(module):
  prefix = "kfac.python.ops."
  if not module.startswith(prefix):
    return None
  rest, best, best_len = module[len(prefix):], None, -1
  for i, names in enumerate(LEVELS):
    for n in names:
      if (rest == n or rest.startswith(n + ".")) and len(n) > best_len:
        best, best_len = i, len(n)
  return best


def test_imports_follow_the_dependency_direction():
  modules = library_modules()
  graph = import_graph(modules)
  thin = {"kfac.python.ops." + m for m in OLD_OPS_MODULES
          if m not in ("__init__", "curvature_matrix_vector_products")}
  unplaced, upward, through_thin = [], [], []
  for m in sorted(modules):
    if not m.startswith("kfac.python.ops.") or m in thin:
      continue
    lm = _level(m)
    if lm is None:
      unplaced.append(m)
      continue
    for t in sorted(graph.get(m, ())):
      if t in thin:
        through_thin.append("%s -> %s" % (m, t))
      elif _level(t) is not None and _level(t) > lm:
        upward.append("%s (level %d) -> %s (level %d)" % (m, lm, t, _level(t)))
  assert not unplaced, (
      "modules of kfac/python/ops in no level of layout_test.LEVELS (add "
      "their package there and to docs/layout.md): %s" % unplaced)
  assert not upward, "imports against the dependency direction: %s" % upward
  assert not through_thin, (
      "kfac modules importing kfac 0.2.4's thin paths instead of the code's "
      "home: %s" % through_thin)


def _ops_entries():
  modules, packages = set(), set()
  for entry in os.listdir(OPS):
    path = os.path.join(OPS, entry)
    if entry.endswith(".py"):
      modules.add(entry[:-3])
    elif os.path.isdir(path) and entry != "__pycache__":
      packages.add(entry)
  return modules, packages


def test_ops_holds_old_paths_and_concept_packages():
  modules, packages = _ops_entries()
  assert modules == OLD_OPS_MODULES, (
      "kfac/python/ops/ holds kfac 0.2.4's module paths and otherwise only "
      "concept packages; new modules: %s, missing old ones: %s" % (
          sorted(modules - OLD_OPS_MODULES),
          sorted(OLD_OPS_MODULES - modules)))
  for p in packages:
    assert os.path.isfile(os.path.join(OPS, p, "__init__.py")), p


def test_layout_page_names_every_package():
  with open(LAYOUT_DOC, encoding="utf-8") as f:
    text = f.read()
  documented = set(re.findall(r"`ops/([a-z_/]+)/`", text))
  on_disk = set()
  for dirpath, dirnames, _ in os.walk(OPS):
    dirnames[:] = [d for d in dirnames if d != "__pycache__"]
    rel = os.path.relpath(dirpath, OPS)
    if rel != ".":
      on_disk.add(rel.replace(os.sep, "/"))
  missing = sorted(on_disk - documented)
  stale = sorted(documented - on_disk)
  assert not missing and not stale, (
      "docs/layout.md: packages not described: %s; described but not in "
      "kfac/python/ops: %s" % (missing, stale))


@pytest.mark.parametrize("name", sorted(OLD_OPS_MODULES - {"__init__"}) +
                         sorted(OLD_OPS_PACKAGES))
def test_old_paths_import(name):
  module = __import__("kfac.python.ops." + name, fromlist=["_"])
  assert module.__name__ == "kfac.python.ops." + name


BENCHMARKS = os.path.join(ROOT, "examples", "benchmarks")
KERNEL_TESTS = os.path.join(PACKAGE, "python", "kernel_tests")


def _imported_names(tree):
  """The top-level module names a file's `import` statements name (at any
  depth of the file: imports inside test functions count)."""
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.update(a.name.split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names.add(node.module.split(".")[0])
  return names


def _module_level_flags(tree):
  """The absl flags a module defines when imported: DEFINE_* calls in its
  top-level statements (not in functions it leaves to its caller)."""
  found = []
  for stmt in tree.body:
    if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):
      continue
    for node in ast.walk(stmt):
      if (isinstance(node, ast.Call) and
          isinstance(node.func, ast.Attribute) and
          node.func.attr.startswith("DEFINE") and node.args and
          isinstance(node.args[0], ast.Constant)):
        found.append(node.args[0].value)
  return found


def test_benchmarks_imported_by_tests_define_no_flag_twice():
  """Tests import some benchmark programs in-process; pytest's workers run
  any of them in one process, and absl refuses a flag defined by two
  modules (DuplicateFlagError). So no flag name may be defined at import by
  two of the benchmark modules that tests import (with what those import in
  turn); a test that needs a program's arithmetic imports a flag-free
  module (as batch_scaling.py is for critical_batch.py)."""
  def parse(path):
    with open(path) as f:
      return ast.parse(f.read(), path)

  bench = {name[:-3]: parse(os.path.join(BENCHMARKS, name))
           for name in os.listdir(BENCHMARKS) if name.endswith(".py")}
  imported = set()
  for name in os.listdir(KERNEL_TESTS):
    if name.endswith(".py"):
      imported |= _imported_names(parse(os.path.join(KERNEL_TESTS, name)))
  pending = sorted(imported & set(bench))
  closure = set()
  while pending:
    module = pending.pop()
    if module not in closure:
      closure.add(module)
      pending.extend(sorted(_imported_names(bench[module]) & set(bench)))
  definers = collections.defaultdict(set)
  for module in closure:
    for flag in _module_level_flags(bench[module]):
      definers[flag].add(module)
  twice = {f: sorted(m) for f, m in definers.items() if len(m) > 1}
  assert closure, "no benchmark module imported by a test: the scan is broken"
  assert not twice, ("benchmark modules that tests import define the same "
                     "absl flags: %s" % twice)
