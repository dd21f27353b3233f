"""The docs' generated tables equal their results files, and the docs name
only make targets, programs, flags and paths that exist
(examples/benchmarks/doc_tables.py, `make docs-check`). Each check is also
shown to fail on a copy of the tree with one thing broken: a table cell
edited by hand, a target, flag, program or path that does not exist."""

import json
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "examples", "benchmarks"))
import doc_tables  # pylint: disable=g-import-not-at-top,wrong-import-position


def test_committed_docs_pass_the_check():
  assert doc_tables.table_differences() == []
  assert doc_tables.reference_problems() == []
  assert doc_tables.bench_problems() == []


def test_docs_have_generated_tables():
  marked = 0
  for path in doc_tables.doc_files():
    with open(path, encoding="utf-8") as f:
      marked += sum(bool(doc_tables.BEGIN.match(line.strip()))
                    for line in f)
  assert marked >= 4


def _tree(tmp_path):
  """A copy of what the checks read: the Makefile, README.md, docs/ (text),
  examples/ (the programs and results files), kfac/ and .ci/."""
  root = tmp_path / "tree"
  root.mkdir()
  shutil.copy(os.path.join(ROOT, "Makefile"), root / "Makefile")
  shutil.copy(os.path.join(ROOT, "README.md"), root / "README.md")
  shutil.copytree(os.path.join(ROOT, "docs"), root / "docs",
                  ignore=shutil.ignore_patterns("*.png"))
  shutil.copytree(os.path.join(ROOT, "examples"), root / "examples",
                  ignore=shutil.ignore_patterns("__pycache__", "*.png"))
  shutil.copytree(os.path.join(ROOT, "kfac"), root / "kfac",
                  ignore=shutil.ignore_patterns("__pycache__"))
  shutil.copytree(os.path.join(ROOT, ".ci"), root / ".ci")
  return root


def _first_marked_doc(root):
  for path in doc_tables.doc_files(str(root)):
    with open(path, encoding="utf-8") as f:
      lines = f.read().split("\n")
    for i, line in enumerate(lines):
      m = doc_tables.BEGIN.match(line.strip())
      if m:
        return path, lines, i, m
  raise AssertionError("no marked table in the docs")


def _problems(root):
  return (doc_tables.table_differences(str(root)) +
          doc_tables.reference_problems(str(root)) +
          doc_tables.bench_problems(str(root)))


def _append(path, text):
  with open(path, "a", encoding="utf-8") as f:
    f.write(text)


def test_a_hand_edited_cell_fails_and_make_docs_restores_it(tmp_path):
  root = _tree(tmp_path)
  assert _problems(root) == []
  path, lines, i, _ = _first_marked_doc(root)
  row = next(k for k in range(i + 1, len(lines))
             if lines[k].startswith("| ") and any(c.isdigit()
                                                  for c in lines[k]))
  cells = lines[row].split("|")
  cell = next(k for k, c in enumerate(cells) if any(d.isdigit() for d in c))
  cells[cell] = cells[cell].replace(
      next(d for d in cells[cell] if d.isdigit()),
      str((int(next(d for d in cells[cell] if d.isdigit())) + 1) % 10), 1)
  lines[row] = "|".join(cells)
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines))
  problems = doc_tables.table_differences(str(root))
  assert len(problems) == 1, problems
  assert os.path.relpath(path, str(root)) in problems[0]
  assert "make docs" in problems[0]
  # Rendering writes the results file's table back.
  with open(path, encoding="utf-8") as f:
    fixed = doc_tables.render_text(f.read(), str(root))
  with open(path, "w", encoding="utf-8") as f:
    f.write(fixed)
  assert doc_tables.table_differences(str(root)) == []


def test_a_changed_results_file_fails_until_rendered(tmp_path):
  root = _tree(tmp_path)
  path, _, _, m = _first_marked_doc(root)
  results = root / m.group("path")
  data = json.loads(results.read_text(encoding="utf-8"))
  data["tables"][m.group("key")] += "\n| new | row |"
  results.write_text(json.dumps(data), encoding="utf-8")
  # Every doc that shows this table differs from it now.
  marker = "<!-- table: %s#%s -->" % (m.group("path"), m.group("key"))
  showing = sorted(os.path.relpath(p, str(root))
                   for p in doc_tables.doc_files(str(root))
                   if marker in open(p, encoding="utf-8").read())
  problems = doc_tables.table_differences(str(root))
  assert sorted(p.split(":")[0] for p in problems) == showing, problems
  assert os.path.relpath(path, str(root)) in showing
  with open(path, encoding="utf-8") as f:
    text = doc_tables.render_text(f.read(), str(root))
  assert "| new | row |" in text


@pytest.mark.parametrize("marker, message", [
    ("<!-- table: examples/benchmarks/results/none.json#x -->\n"
     "<!-- end table -->", "does not exist"),
    ("<!-- table: examples/benchmarks/results/critical_batch.json#nope -->\n"
     "<!-- end table -->", "has no table 'nope'"),
    ("<!-- table: examples/benchmarks/results/critical_batch.json#cnn -->",
     "without <!-- end table -->"),
    ("<!-- end table -->", "without a table marker"),
    ("<!-- table: examples/benchmarks/results/make_bench.json#kfac_cost:nope"
     " -->\n<!-- end table -->", "has no section 'nope'"),
])
def test_malformed_markers_are_named(tmp_path, marker, message):
  root = _tree(tmp_path)
  _append(root / "docs" / "index.md", "\n" + marker + "\n")
  problems = doc_tables.table_differences(str(root))
  assert len(problems) == 1 and message in problems[0], problems
  assert problems[0].startswith("docs/index.md:")


def test_a_section_marker_shows_that_section_only(tmp_path):
  root = tmp_path / "tree"
  (root / "r").mkdir(parents=True)
  table = ("**Program title**\n\nMachine: m.\n\n**First part (ms)**\n\n"
           "| a | b |\n|---|---:|\n| x | 1.0 |\n\n**Second: part 2**\n\n"
           "| c |\n|---|\n| y |\n")
  (root / "r" / "res.json").write_text(json.dumps({"tables": {"p": table}}))
  doc = ("<!-- table: r/res.json#p:second-part-2 -->\nold\n"
         "<!-- end table -->\n<!-- table: r/res.json#p:first-part-ms -->\n"
         "<!-- end table -->")
  assert doc_tables.render_text(doc, str(root)).split("\n") == [
      "<!-- table: r/res.json#p:second-part-2 -->", "| c |", "|---|", "| y |",
      "<!-- end table -->", "<!-- table: r/res.json#p:first-part-ms -->",
      "| a | b |", "|---|---:|", "| x | 1.0 |", "<!-- end table -->"]
  with pytest.raises(doc_tables.DocError, match="has no section 'machine'"):
    doc_tables.render_text("<!-- table: r/res.json#p:machine -->\n"
                           "<!-- end table -->", str(root))


@pytest.mark.parametrize("snippet, message", [
    ("`make no-such-target`", "`make no-such-target`: no such Makefile"),
    ("```\n.venv/bin/python examples/benchmarks/critical_batch.py \\\n"
     "    --workloads=cnn --no_such_flag=3\n```",
     "critical_batch.py --no_such_flag: the program has no such flag"),
    ("```\nB=examples/benchmarks/critical_batch.py\n"
     ".venv/bin/python $B --batchez=256\n```",
     "critical_batch.py --batchez: the program has no such flag"),
    ("`python examples/benchmarks/no_such_program.py --x=1`",
     "no_such_program.py: no such program"),
    ("see `examples/benchmarks/results/no_such.json`",
     "results/no_such.json: no such file"),
    ("`kfac/python/ops/no_such_module.NAME`",
     "no_such_module.NAME: no such file"),
])
def test_a_reference_to_nothing_fails(tmp_path, snippet, message):
  root = _tree(tmp_path)
  _append(root / "docs" / "index.md", "\n" + snippet + "\n")
  problems = doc_tables.reference_problems(str(root))
  assert len(problems) == 1 and message in problems[0], problems


@pytest.mark.parametrize("snippet", [
    # Flags of a module the program imports (val_workloads, side_by_side),
    # absl's own, a boolean's --no form, and words that are not paths.
    "`examples/benchmarks/time_to_target.py --seconds=5 --helpfull`",
    "`examples/benchmarks/keras_validation.py --notune`",
    "the scalar `kfac/damping` in TensorBoard",
    "`make docs-check`",
    # A folder whose name has a dot (not a module's NAME).
    "`--output_dir=examples/benchmarks/results/damping_floor/0.1`",
])
def test_references_that_exist_pass(tmp_path, snippet):
  root = _tree(tmp_path)
  _append(root / "docs" / "index.md", "\n" + snippet + "\n")
  assert doc_tables.reference_problems(str(root)) == []


def test_make_bench_and_the_program_table_must_agree(tmp_path):
  root = _tree(tmp_path)
  assert doc_tables.bench_problems(str(root)) == []
  doc = root / "docs" / "benchmarks.md"
  text = doc.read_text(encoding="utf-8")
  doc.write_text(text.replace("| `kfac_cost.py` | yes |",
                              "| `kfac_cost.py` | no |"), encoding="utf-8")
  assert doc_tables.bench_problems(str(root)) == [
      "make bench runs kfac_cost.py, which docs/benchmarks.md does not mark "
      "\"yes\""]
  doc.write_text(text.replace("| `recurrent_step_time.py` | no |",
                              "| `recurrent_step_time.py` | yes |"),
                 encoding="utf-8")
  assert doc_tables.bench_problems(str(root)) == [
      "docs/benchmarks.md marks recurrent_step_time.py \"yes\" but make bench "
      "does not run it"]


def test_the_suite_is_make_bench_py_programs(tmp_path):
  root = _tree(tmp_path)
  runner = root / "examples" / "benchmarks" / "make_bench.py"
  text = runner.read_text(encoding="utf-8")
  runner.write_text(text.replace('    ("kfac_cost.py", ()),\n', ""),
                    encoding="utf-8")
  assert doc_tables.bench_problems(str(root)) == [
      "docs/benchmarks.md marks kfac_cost.py \"yes\" but make bench does "
      "not run it"]
  runner.write_text(text, encoding="utf-8")
  makefile = root / "Makefile"
  mk = makefile.read_text(encoding="utf-8")
  makefile.write_text(mk.replace("examples/benchmarks/make_bench.py",
                                 "examples/benchmarks/kfac_cost.py"),
                      encoding="utf-8")
  assert doc_tables.bench_problems(str(root)) == [
      "Makefile: `bench` does not run examples/benchmarks/make_bench.py"]
