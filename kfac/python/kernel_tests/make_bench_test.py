"""make_bench.py (`make bench`'s runner): each program timed and recorded,
the suite's total only when every program finished, --resume and --only.

The programs here are stand-ins (tiny Python processes); the real suite's
programs have their own smoke tests (benchmarks_test.py)."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "examples", "benchmarks"))

import make_bench  # pylint: disable=g-import-not-at-top,wrong-import-position

# A stand-in program: writes <name>.md into the output folder and exits with
# the status its name asks for.
_SCRIPT = """
import os, sys
out, name = sys.argv[1], sys.argv[2]
with open(os.path.join(out, name[:-3] + ".md"), "w") as f:
  f.write("| %s |\\n|---|\\n" % name)
sys.exit(3 if name.startswith("bad") else 0)
"""


@pytest.fixture
def suite(monkeypatch):
  programs = [("one.py", ()), ("bad_two.py", ()), ("three.py", ())]
  monkeypatch.setattr(make_bench, "PROGRAMS", tuple(programs))
  ran = []

  def command_for(name, args):
    ran.append(name)
    return [sys.executable, "-c", _SCRIPT, args.output_dir, name]

  monkeypatch.setattr(make_bench, "command_for", command_for)
  return programs, ran


def _results(out):
  with open(os.path.join(out, make_bench.RESULTS)) as f:
    return json.load(f)


def test_each_program_is_recorded_and_a_failure_leaves_no_total(
    tmp_path, suite):
  out = str(tmp_path)
  assert make_bench.main(["--output_dir=" + out]) == 1
  data = _results(out)
  assert data["suite"] == ["one.py", "bad_two.py", "three.py"]
  assert data["programs"]["one.py"]["returncode"] == 0
  assert data["programs"]["bad_two.py"]["returncode"] == 3
  assert data["programs"]["three.py"]["md_files"] == ["three.md"]
  for rec in data["programs"].values():
    assert rec["wall_s"] >= 0 and rec["cpu_s"] >= 0
  assert data["tables"]["one"] == "| one.py |\n|---|\n"
  time = data["tables"]["time"]
  assert "| `bad_two.py` |" in time and "exit 3" in time
  assert "2 of 3 programs timed (no total yet)" in time
  assert "make bench`, all" not in time


def test_resume_runs_only_the_unfinished_and_then_states_the_total(
    tmp_path, suite, monkeypatch):
  programs, ran = suite
  out = str(tmp_path)
  make_bench.main(["--output_dir=" + out])
  first = _results(out)["programs"]
  del ran[:]
  fixed = [("one.py", ()), ("two.py", ()), ("three.py", ())]
  monkeypatch.setattr(make_bench, "PROGRAMS", tuple(fixed))
  assert make_bench.main(["--output_dir=" + out, "--resume"]) == 0
  assert ran == ["two.py"]
  data = _results(out)
  assert set(data["programs"]) == {"one.py", "two.py", "three.py"}
  assert data["programs"]["one.py"] == first["one.py"]
  time = data["tables"]["time"]
  total = sum(r["wall_s"] for r in data["programs"].values())
  assert "| **`make bench`, all 3** | | **%.1f** |" % (total / 60) in time
  assert "not run yet" not in time


def test_a_program_not_yet_run_is_listed_as_such(tmp_path, suite):
  _, ran = suite
  out = str(tmp_path)
  assert make_bench.main(["--output_dir=" + out, "--only=three.py"]) == 0
  assert ran == ["three.py"]
  time = _results(out)["tables"]["time"]
  assert "| `one.py` | not run yet |" in time
  assert "1 of 3 programs timed" in time


def test_only_names_an_unknown_program(tmp_path, suite, capsys):
  with pytest.raises(SystemExit) as e:
    make_bench.main(["--output_dir=" + str(tmp_path), "--only=nope.py"])
  assert e.value.code == 2
  assert "nope.py" in capsys.readouterr().err


def test_the_real_suite_commands():
  args = make_bench.argparse.Namespace(
      output_dir="out", old_kfac_path="OLD", kfac_jax_path="JAX")
  for name in make_bench.program_names():
    cmd = make_bench.command_for(name, args)
    assert os.path.exists(os.path.join(ROOT, cmd[1])), cmd
    assert cmd[2] == "--output_dir=out"
  assert "--old_kfac_path=OLD" in make_bench.command_for(
      "autoencoder_step_time.py", args)
  assert "--kfac_jax_path=JAX" in make_bench.command_for(
      "kfac_jax_step_time.py", args)


def test_headings_of_a_program_table_become_bold_lines():
  assert make_bench.embeddable("# Title\n\n### cnn\n| a |\n|---|\n#x\n") == (
      "**Title**\n\n**cnn**\n| a |\n|---|\n#x\n")


def test_the_time_table_names_the_cpus_the_programs_ran_on(tmp_path, suite):
  out = str(tmp_path)
  make_bench.main(["--output_dir=" + out, "--only=one.py"])
  data = _results(out)
  cpu = data["programs"]["one.py"]["cpu"]
  assert cpu == make_bench.machine.cpu_name()
  assert data["tables"]["time"].startswith("Machine: %s; " % cpu)
