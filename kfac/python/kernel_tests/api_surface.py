"""The public surface of a kfac source tree, read statically, and its
comparison with our package at run time.

The old library (kfac 0.2.4) is TF1 code that must not be imported next to
ours (both are the package `kfac`), so its surface is read from the source
with `ast`: every public module, its public classes and functions, their
public methods, and each function's parameters with their literal defaults.
`compare(old_root)` imports the same module paths from our package and
reports what is missing or incompatible:

- a missing module or public name;
- a function or method whose parameters do not accept a call that the old
  signature accepted: a parameter name missing (unless we take **kwargs), a
  positional parameter moved, a parameter that became required, or a literal
  default that changed.

Used by api_surface_test.py and runnable as a script
(`python -m kfac.python.kernel_tests.api_surface OLD_ROOT`), which prints
the report.
"""

import ast
import importlib
import inspect
import os
import sys

# Where the old library keeps code that is not public API.
_SKIP_DIRS = ("kernel_tests", "examples")
_NO_DEFAULT = object()


def _public(name):
  return not name.startswith("_")


def _literal(node):
  try:
    return ast.literal_eval(node)
  except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
    return _NO_DEFAULT  # not a literal: not compared


def _params_of(fn_node):
  """(name, default) of each parameter of an ast function, in order, with
  _NO_DEFAULT for required or non-literal defaults; kw-only marked."""
  args = fn_node.args
  positional = list(args.posonlyargs) + list(args.args)
  defaults = [None] * (len(positional) - len(args.defaults)) + list(
      args.defaults)
  params = []
  for a, d in zip(positional, defaults):
    params.append((a.arg, "positional", d is not None,
                   _literal(d) if d is not None else _NO_DEFAULT))
  for a, d in zip(args.kwonlyargs, args.kw_defaults):
    params.append((a.arg, "keyword", d is not None,
                   _literal(d) if d is not None else _NO_DEFAULT))
  return params, args.vararg is not None, args.kwarg is not None


def _module_names(root):
  """Module paths of the public python modules under root/kfac."""
  out = []
  base = os.path.join(root, "kfac")
  for dirpath, dirnames, filenames in os.walk(base):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and
                         not d.startswith(("_", ".")))
    for f in sorted(filenames):
      if not f.endswith(".py") or f.endswith("_test.py"):
        continue
      if f != "__init__.py" and not _public(f):
        continue
      rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3]
      parts = rel.split(os.sep)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      out.append((".".join(parts), os.path.join(dirpath, f)))
  return out


def read_surface(root):
  """{module: {name: entry}} of the source tree at root; entry is
  ("function", params) / ("class", {method: params}) / ("name", None)."""
  surface = {}
  for module, path in _module_names(root):
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
    names = {}
    for node in tree.body:
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if _public(node.name):
          names[node.name] = ("function", _params_of(node))
      elif isinstance(node, ast.ClassDef):
        if _public(node.name):
          methods = {}
          for item in node.body:
            if (isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and
                (_public(item.name) or item.name == "__init__")):
              methods[item.name] = _params_of(item)
          names[node.name] = ("class", methods)
      elif isinstance(node, ast.Assign):
        for t in node.targets:
          if isinstance(t, ast.Name) and _public(t.id):
            names[t.id] = ("name", None)
      elif (isinstance(node, ast.ImportFrom) and module.count(".") == 0 and
            node.module != "__future__"):
        # The package's own __init__ re-exports modules.
        for a in node.names:
          names[a.asname or a.name] = ("name", None)
    surface[module] = names
  return surface


def _check_params(label, old, ours_fn):
  """Problems calling ours_fn the way old params allowed."""
  old_params, _, _ = old
  try:
    sig = inspect.signature(ours_fn)
  except (TypeError, ValueError):
    return []
  params = list(sig.parameters.values())
  has_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
  has_varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
  by_name = {p.name: p for p in params}
  ours_positional = [p.name for p in params
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  old_self = int(bool(old_params) and old_params[0][0] in ("self", "cls"))
  ours_self = int(bool(ours_positional) and
                  ours_positional[0] in ("self", "cls"))
  problems = []
  for index, (name, kind, has_default, default) in enumerate(old_params):
    if name in ("self", "cls") and index == 0:
      continue
    p = by_name.get(name)
    if p is None:
      if not has_kwargs:
        problems.append("%s: parameter %r is missing" % (label, name))
      continue
    if kind == "positional" and not has_varargs:
      if name not in ours_positional:
        problems.append("%s: %r is no longer positional" % (label, name))
      elif ours_positional.index(name) - ours_self != index - old_self:
        problems.append("%s: %r moved from position %d to %d" % (
            label, name, index - old_self,
            ours_positional.index(name) - ours_self))
    if has_default and p.default is p.empty:
      problems.append("%s: %r became required" % (label, name))
    if (default is not _NO_DEFAULT and p.default is not p.empty and
        not _same_default(default, p.default)):
      problems.append("%s: default of %r changed from %r to %r" % (
          label, name, default, p.default))
  for p in params:
    if (p.default is p.empty and
        p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and
        p.name not in ("self", "cls") and
        p.name not in [n for n, _, _, _ in old_params]):
      problems.append("%s: new required parameter %r" % (label, p.name))
  return problems


def _same_default(old, new):
  if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)):
    return list(old) == list(new)
  try:
    return type(old) is type(new) and old == new or (
        isinstance(old, (int, float)) and not isinstance(old, bool) and
        isinstance(new, (int, float)) and not isinstance(new, bool) and
        float(old) == float(new))
  except Exception:  # pylint: disable=broad-except
    return False


def compare(old_root):
  """List of (key, problem) for each incompatibility of our package with the
  source tree at old_root; key is "module" or "module.name"."""
  problems = []
  for module, names in sorted(read_surface(old_root).items()):
    try:
      ours = importlib.import_module(module)
    except ImportError as e:
      problems.append((module, "module cannot be imported: %s" % e))
      continue
    for name, (kind, detail) in sorted(names.items()):
      key = "%s.%s" % (module, name)
      if not hasattr(ours, name):
        problems.append((key, "missing"))
        continue
      obj = getattr(ours, name)
      if kind == "function":
        if not callable(obj):
          problems.append((key, "is not callable"))
          continue
        problems.extend((key, p) for p in _check_params(key, detail, obj))
      elif kind == "class":
        if not inspect.isclass(obj):
          # A factory function in place of a class still constructs.
          if callable(obj) and "__init__" in detail:
            problems.extend((key, p) for p in _check_params(
                key, detail["__init__"], obj))
          continue
        for method, params in sorted(detail.items()):
          mkey = "%s.%s" % (key, method)
          if not hasattr(obj, method):
            problems.append((mkey, "missing"))
            continue
          m = getattr(obj, method)
          if isinstance(inspect.getattr_static(obj, method), property):
            continue
          if callable(m):
            problems.extend((mkey, p) for p in _check_params(mkey, params, m))
  return problems


def main(argv):
  problems = compare(argv[1])
  for key, problem in problems:
    print("%s: %s" % (key, problem))
  print("%d problems" % len(problems))


if __name__ == "__main__":
  main(sys.argv)
