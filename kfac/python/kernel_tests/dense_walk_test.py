"""docs/layout.md's walk of one Dense layer through a step, checked.

The walk ("One Dense layer through a step, module by module") names the
modules a Dense layer's step goes through under `Kfac(adaptive=True)` in
`fit`, one numbered stage each. These tests read that section and check
that it names at most MAX_MODULES distinct modules, that each exists and
has its role written beside it, and that each one's code really runs when
a one-Dense-layer model takes its first `fit` steps (the modules executed
are found with `sys.setprofile`), so that the page cannot drift from the
code.
"""

import collections
import os
import re
import sys

import numpy as np

import kfac

MAX_MODULES = 12
SECTION = "## One Dense layer through a step, module by module"
ROOT = os.path.dirname(os.path.dirname(os.path.realpath(kfac.__file__)))
DOC = os.path.join(ROOT, "docs", "layout.md")
# A stage: "N. `path/module.py`: its role ..." (path under kfac/python/).
STAGE = re.compile(r"^\s*(\d+)\.\s+`([\w/]+\.py)`(?: and `([\w/]+\.py)`)?:\s*"
                   r"(\S.*)$")


def walk_stages(text):
  """[(number, [module paths], its role)] of the walk."""
  start = text.index(SECTION)
  end = text.find("\n## ", start + len(SECTION))
  section = text[start:end if end >= 0 else len(text)]
  stages, current = [], None
  for line in section.splitlines():
    m = STAGE.match(line)
    if m:
      current = [int(m.group(1)), [p for p in m.groups()[1:3] if p],
                 m.group(4)]
      stages.append(current)
    elif current is not None and line.startswith("   ") and line.strip():
      current[2] += " " + line.strip()  # the role goes on
    else:
      current = None
  return [tuple(stage) for stage in stages]


def walk_modules(text):
  """The distinct module paths the walk names, in order."""
  seen = []
  for _, paths, _ in walk_stages(text):
    for p in paths:
      if p not in seen:
        seen.append(p)
  return seen


def _doc():
  with open(DOC) as f:
    return f.read()


def test_the_walk_names_at_most_twelve_modules_each_with_its_role():
  text = _doc()
  stages = walk_stages(text)
  assert stages, "no numbered stage found in %r" % SECTION
  assert [n for n, _, _ in stages] == list(range(1, len(stages) + 1))
  modules = walk_modules(text)
  assert len(modules) <= MAX_MODULES, modules
  for _, paths, role in stages:
    assert len(role.split()) >= 4, (paths, role)
  for path in modules:
    assert os.path.isfile(os.path.join(ROOT, "kfac", "python", path)), path


def test_the_checks_fail_on_a_walk_that_breaks_them():
  good = "%s\n\n1. `keras/a.py`: the class users construct here.\n" % SECTION
  assert walk_modules(good) == ["keras/a.py"]
  too_many = SECTION + "\n\n" + "".join(
      "%d. `ops/m%d.py`: one stage of the step.\n" % (i + 1, i)
      for i in range(MAX_MODULES + 1))
  assert len(walk_modules(too_many)) > MAX_MODULES
  no_role = SECTION + "\n\n1. `keras/a.py`: x\n"
  assert len(walk_stages(no_role)[0][2].split()) < 4
  # Sections after the walk are not read.
  assert walk_modules(good + "\n## Next\n\n2. `ops/b.py`: not the walk.\n"
                      ) == ["keras/a.py"]


def _modules_run_by_a_dense_fit():
  """{path under kfac/python/: calls} of the kfac modules whose functions
  run while a one-Dense-layer model is built into Kfac(adaptive=True) and
  takes its first fit steps."""
  import keras  # pylint: disable=g-import-not-at-top
  from kfac.python.keras import optimizers  # pylint: disable=g-import-not-at-top

  base = os.path.join(ROOT, "kfac", "python") + os.sep
  calls = collections.Counter()

  def profile(frame, event, arg):
    del arg
    if event == "call":
      f = frame.f_code.co_filename
      if f.startswith(base):
        calls[f[len(base):]] += 1

  rng = np.random.RandomState(0)
  x = rng.randn(64, 5).astype("float32")
  y = rng.randint(0, 3, 64)
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((5,)),
                            keras.layers.Dense(3, name="out")])
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  sys.setprofile(profile)
  try:
    opt = optimizers.Kfac(model=model, adaptive=True, loss=loss)
    model.compile(optimizer=opt, loss=loss)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
  finally:
    sys.setprofile(None)
  return calls


def test_every_module_of_the_walk_runs_in_a_dense_fit():
  ran = _modules_run_by_a_dense_fit()
  modules = walk_modules(_doc())
  if not ran["keras/optimizer/keras3.py"]:
    # Keras 2 (TF 2.15) or tf_keras: the walk names that class beside
    # Keras 3's (stage 1).
    modules = [m.replace("keras/optimizer/keras3.py",
                         "keras/optimizer/legacy_keras.py") for m in modules]
  assert not [m for m in modules if not ran[m]], sorted(ran)
