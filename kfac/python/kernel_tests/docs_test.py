"""Runs every ```python block of docs/*.md and README.md, so the
documentation stays true.

The README's blocks are complete training programs on Fashion-MNIST (from
the Keras cache, where `make data` puts Debian's copy): each must print its
loss as it trains (`loss 0.42` / Keras's `loss: 0.42`), and the test checks
that every printed loss is finite and that the last one is below 3/4 of the
first (measured: TF1 2.24 -> 0.37, TF2 2.3 -> 0.4, Keras fit 0.43 -> 0.27
over its two epochs).
"""

import contextlib
import io
import math
import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
_LOSS = re.compile(r"\bloss:? +([-+0-9.eE]+|nan|inf)\b")
_FMNIST = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
           "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


# Snippets that took 2 s or more of CPU each (measured on 2 shared cores)
# run in the slow tier (make test-slow; CI runs both tiers), the others in
# the fast tier. test_slow_snippets_exist keeps every name here a snippet.
SLOW_SNIPPETS = ("adaptive-0", "adaptive-2", "convolutions-0", "distributed-1",
                 "ekfac-0", "graph_search-1", "keras-0", "keras-2", "keras-4",
                 "keras-5", "keras-6", "normalization_layers-0", "recipe-0",
                 "recipe-1", "recipe-2", "recipe-3", "recipe-4",
                 "approximations-4", "reliability-2", "tf2-0")


def _blocks(pages):
  out = []
  for page in pages:
    for i, code in enumerate(_BLOCK.findall(page.read_text())):
      name = "%s-%d" % (page.stem, i)
      out.append(pytest.param(code, id=name, marks=(
          [pytest.mark.slow] if name in SLOW_SNIPPETS else [])))
  return out


def _run(code):
  # pylint: disable-next=exec-used
  exec(compile(code, "<doc snippet>", "exec"), {"__name__": "__doc__"})


def test_docs_have_snippets():
  assert len(_blocks(sorted(DOCS.glob("*.md")))) >= 7


def test_slow_snippets_exist():
  names = {p.id for p in _blocks(sorted(DOCS.glob("*.md")))}
  assert set(SLOW_SNIPPETS) <= names, sorted(set(SLOW_SNIPPETS) - names)


@pytest.mark.parametrize("code", _blocks(sorted(DOCS.glob("*.md"))))
def test_doc_snippet_runs(code):
  _run(code)


def test_readme_has_the_three_usage_snippets():
  assert len(_blocks([README])) == 3


def _require_fashion_mnist():
  home = os.environ.get("KERAS_HOME") or os.path.join(
      os.path.expanduser("~"), ".keras")
  folder = os.path.join(home, "datasets", "fashion-mnist")
  missing = [f for f in _FMNIST if not os.path.exists(os.path.join(folder, f))]
  assert not missing, (
      "The README snippets train on Fashion-MNIST, which is not in %s "
      "(missing %s). Run `make data` (it installs Debian's "
      "dataset-fashion-mnist and copies it there); nothing is downloaded by "
      "the tests." % (folder, ", ".join(missing)))


@pytest.mark.slow  # complete training programs on Fashion-MNIST
@pytest.mark.parametrize("code", _blocks([README]))
def test_readme_snippet_trains(code):
  if "fashion_mnist" in code:
    _require_fashion_mnist()
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    _run(code)
  text = out.getvalue()
  losses = [float(v) for v in _LOSS.findall(text)]
  assert len(losses) >= 2, text[-2000:]
  assert all(math.isfinite(l) for l in losses), losses
  assert losses[-1] < 0.75 * losses[0], losses
