"""Runs every ```python block of docs/*.md, so the documentation stays true."""

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[3] / "docs"
_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _blocks():
  out = []
  for page in sorted(DOCS.glob("*.md")):
    for i, code in enumerate(_BLOCK.findall(page.read_text())):
      out.append(pytest.param(code, id="%s-%d" % (page.stem, i)))
  return out


def test_docs_have_snippets():
  assert len(_blocks()) >= 7


@pytest.mark.parametrize("code", _blocks())
def test_doc_snippet_runs(code):
  exec(compile(code, "<doc snippet>", "exec"), {"__name__": "__doc__"})  # pylint: disable=exec-used
