"""The shape of the classes (docs/layout.md, "How the step is built"): parts,
not mixins.

* no class named `*Mixin` in the packages that build the step
  (`ops/optimizers`, `ops/adaptive`, `ops/estimation`, `ops/collection`,
  `keras/optimizer`), and at most MAX_MIXINS in the whole library (kfac
  0.2.4's public placement mixins are among them);
* no class with more than two kfac base classes;
* no class built or swapped at run time: no class statement inside a
  function, no three-argument `type(...)`, no metaclass, no `__new__`, no
  assignment to `__class__`.

Like layout_test.py, the checks read the source (`ast`), so they run in a
fraction of a second and name the class that breaks the rule; each check
is also run on a small made-up package, so that it is known to fail."""

import ast
import os

from kfac.python.kernel_tests import layout_test

MAX_MIXINS = 4
MAX_KFAC_BASES = 2
# Where the step is built: no mixins at all.
STEP_PACKAGES = ("kfac.python.ops.optimizers", "kfac.python.ops.adaptive",
                 "kfac.python.ops.estimation", "kfac.python.ops.collection",
                 "kfac.python.keras.optimizer")


class _Module:
  """The classes of one module, and the names it binds to kfac objects."""

  def __init__(self, name, source):
    self.name = name
    self.tree = ast.parse(source)
    # Names bound by `import kfac...` / `from kfac... import x`.
    self.kfac_names = set()
    for node in ast.walk(self.tree):
      if isinstance(node, ast.Import):
        for alias in node.names:
          if alias.name.startswith("kfac"):
            self.kfac_names.add((alias.asname or alias.name).split(".")[0])
      elif isinstance(node, ast.ImportFrom):
        if (node.module or "").startswith("kfac") or node.level:
          for alias in node.names:
            self.kfac_names.add(alias.asname or alias.name)
    self.classes = [n for n in ast.walk(self.tree)
                    if isinstance(n, ast.ClassDef)]
    self.own_classes = {c.name for c in self.classes}

  def kfac_bases(self, cls):
    """The base classes of `cls` that are kfac's (defined in this module or
    reached through a name imported from kfac)."""
    out = []
    for base in cls.bases:
      root = base
      while isinstance(root, ast.Attribute):
        root = root.value
      if not isinstance(root, ast.Name):
        continue
      if isinstance(base, ast.Name) and base.id in self.own_classes:
        out.append(base.id)
      elif root.id in self.kfac_names:
        out.append(ast.unparse(base))
    return out


def modules(root=layout_test.ROOT):
  out = []
  for name, path in layout_test.library_modules(root).items():
    with open(path, encoding="utf-8") as f:
      out.append(_Module(name, f.read()))
  return out


def mixins(mods):
  """[(module, class name)] of the classes named *Mixin."""
  return [(m.name, c.name) for m in mods for c in m.classes
          if c.name.endswith("Mixin")]


def too_many_bases(mods):
  return ["%s.%s (%s)" % (m.name, c.name, ", ".join(m.kfac_bases(c)))
          for m in mods for c in m.classes
          if len(m.kfac_bases(c)) > MAX_KFAC_BASES]


def built_at_run_time(mods):
  """Classes made or swapped while the program runs."""
  found = []
  for m in mods:
    for node in ast.walk(m.tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for inner in ast.walk(node):
          if isinstance(inner, ast.ClassDef):
            found.append("%s: class %s inside function %s" % (
                m.name, inner.name, node.name))
      elif isinstance(node, ast.ClassDef):
        if any(k.arg == "metaclass" for k in node.keywords):
          found.append("%s: class %s has a metaclass" % (m.name, node.name))
        for item in node.body:
          if isinstance(item, ast.FunctionDef) and item.name == "__new__":
            found.append("%s: class %s defines __new__" % (m.name, node.name))
      elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and
            node.func.id == "type" and len(node.args) == 3):
        found.append("%s: type(...) with three arguments, line %d" % (
            m.name, node.lineno))
      elif isinstance(node, (ast.Assign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [
            node.target]
        for t in targets:
          if isinstance(t, ast.Attribute) and t.attr == "__class__":
            found.append("%s: assigns __class__, line %d" % (
                m.name, node.lineno))
  return found


def test_no_mixins_where_the_step_is_built():
  bad = [(m, c) for m, c in mixins(modules())
         if any(m == p or m.startswith(p + ".") for p in STEP_PACKAGES)]
  assert not bad, "mixin classes in the step's packages: %s" % bad


def test_few_mixins_in_the_library():
  found = mixins(modules())
  assert len(found) <= MAX_MIXINS, "%d mixin classes (at most %d): %s" % (
      len(found), MAX_MIXINS, found)


def test_at_most_two_kfac_base_classes():
  bad = too_many_bases(modules())
  assert not bad, "classes with more than %d kfac bases: %s" % (
      MAX_KFAC_BASES, bad)


def test_no_class_built_at_run_time():
  bad = built_at_run_time(modules())
  assert not bad, "\n".join(bad)


def _fake_package(tmp_path, files):
  pkg = tmp_path / "kfac"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  for name, text in files.items():
    (pkg / name).write_text(text)
  return modules(str(tmp_path))


def test_checks_find_what_they_look_for(tmp_path):
  mods = _fake_package(tmp_path, {
      "a.py": "class AMixin:\n  pass\nclass B:\n  pass\n"
              "class C(AMixin, B):\n  pass\n",
      "b.py": "import tensorflow as tf\nfrom kfac import a\n"
              "from kfac.a import B\n"
              "class D(a.AMixin, B, a.C, tf.Module):\n  pass\n"
              "class E(B, tf.Module):\n  pass\n",
      "c.py": "def make():\n  class F:\n    pass\n  return F\n"
              "class G(metaclass=type):\n  def __new__(cls):\n"
              "    return object()\n"
              "H = type('H', (), {})\n"
              "def swap(o):\n  o.__class__ = int\n",
  })
  assert mixins(mods) == [("kfac.a", "AMixin")]
  assert too_many_bases(mods) == ["kfac.b.D (a.AMixin, B, a.C)"]
  assert [line.split(":")[1].strip() for line in built_at_run_time(mods)] == [
      "class F inside function make", "class G has a metaclass",
      "class G defines __new__", "type(...) with three arguments, line 8",
      "assigns __class__, line 10"]


def test_the_library_is_read():
  mods = modules()
  assert len(mods) > 100
  assert any(m.name == "kfac.python.ops.optimizers.kfac_optimizer"
             for m in mods)
  assert os.path.isdir(layout_test.PACKAGE)
