"""`make bench`: every benchmark program of the suite, one after another,
each one timed, into one output folder.

    python examples/benchmarks/make_bench.py --output_dir=bench_results \\
        --old_kfac_path=.bench_deps/kfac-0.2.4 \\
        --kfac_jax_path=.bench_deps/kfac-jax-0.0.8

`PROGRAMS` is the suite (docs/benchmarks.md's program table marks these
"yes"; `doc_tables.py --check` fails when the two disagree). Each program
runs as its own process with its default settings and writes its tables,
JSON and plots into --output_dir; its output goes to this terminal as it
runs. After each program this runner rewrites `make_bench.json` there:

* `programs`: per program its command, CPU model, start (UTC), wall seconds, CPU
  seconds of the process and its children, the load average at its start,
  its exit status, and the .md files it wrote;
* `tables`: `time` (the programs' times and, once every program of the
  suite has a record, the suite's total; the `make bench` time that
  docs/benchmarks.md states), and one entry per .md file a program wrote
  (key: the file's name without .md; its headings made bold lines), so
  that docs can embed each program's result tables (`doc_tables.py`).

`--resume` keeps the records of programs that already finished with status
0 in that file and runs only the others (a suite longer than one sitting
can be completed; each program's record says when it ran). `--only` runs a
comma-separated subset. No TensorFlow here: the runner only starts
processes.
"""

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import machine  # pylint: disable=g-import-not-at-top

# The suite, in the order it runs (short programs first, so that a stopped
# run has timed the most programs). Flags beyond --output_dir: "{old_kfac}"
# and "{kfac_jax}" are the runner's --old_kfac_path / --kfac_jax_path.
PROGRAMS = (
    ("large_batch_projection.py", ()),
    ("keras_step_time.py", ()),
    ("products_step_time.py", ()),
    ("kfac_cost.py", ()),
    ("distributed_step_time.py", ()),
    ("multiworker_step_time.py", ()),
    ("kfac_jax_step_time.py", ("--kfac_jax_path={kfac_jax}",
                               "--missing_kfac_jax=skip")),
    ("ekfac_bench.py", ()),
    ("keras_validation.py", ()),
    ("time_to_target.py", ()),
    ("autoencoder_step_time.py", ("--old_kfac_path={old_kfac}",)),
    ("keras_zoo_step_time.py", ()),
    ("keras_zoo.py", ()),
)

RESULTS = "make_bench.json"


def program_names():
  return [name for name, _ in PROGRAMS]


def command_for(name, args):
  extra = [f.format(old_kfac=args.old_kfac_path, kfac_jax=args.kfac_jax_path)
           for f in dict(PROGRAMS)[name]]
  return ([sys.executable, os.path.join("examples", "benchmarks", name),
           "--output_dir=%s" % args.output_dir] + extra)


def _minutes(seconds):
  return "%.1f" % (seconds / 60.0)


def time_table(records, machine_line=None):
  """Markdown: the programs' times in suite order; the total row only when
  every program of the suite finished (status 0)."""
  lines = (["Machine: %s." % machine_line, ""] if machine_line else []) + [
      "| program | started (UTC) | wall min | CPU min | load at start "
      "| status |", "|---|---|---:|---:|---:|---|"]
  done = 0
  wall, cpu = 0.0, 0.0
  for name in program_names():
    r = records.get(name)
    if r is None:
      lines.append("| `%s` | not run yet | | | | |" % name)
      continue
    lines.append("| `%s` | %s | %s | %s | %.2f | %s |" % (
        name, r["started"], _minutes(r["wall_s"]), _minutes(r["cpu_s"]),
        r["load_at_start"], "ok" if r["returncode"] == 0
        else "exit %d" % r["returncode"]))
    if r["returncode"] == 0:
      done += 1
      wall += r["wall_s"]
      cpu += r["cpu_s"]
  if done == len(PROGRAMS):
    lines.append("| **`make bench`, all %d** | | **%s** | **%s** | | |" % (
        done, _minutes(wall), _minutes(cpu)))
  else:
    lines.append("| %d of %d programs timed (no total yet) | | %s | %s | | |"
                 % (done, len(PROGRAMS), _minutes(wall), _minutes(cpu)))
  return "\n".join(lines) + "\n"


def _md_stamps(out_dir):
  return {f: os.stat(os.path.join(out_dir, f)).st_mtime_ns
          for f in os.listdir(out_dir) if f.endswith(".md")}


def _md_written(out_dir, before):
  """The .md files new or rewritten since the `before` stamps."""
  return sorted(f for f, t in _md_stamps(out_dir).items()
                if before.get(f) != t)


def embeddable(md):
  """A program's .md text as a doc embeds it: its headings become bold
  lines, so that they do not enter the doc's own outline."""
  out = []
  for line in md.rstrip("\n").split("\n"):
    stripped = line.lstrip("#")
    if line.startswith("#") and stripped.startswith(" "):
      line = "**%s**" % stripped.strip()
    out.append(line)
  return "\n".join(out) + "\n"


def write_results(out_dir, records):
  # The CPU each program ran on (a resumed suite may span machines).
  cpus = sorted({r.get("cpu", "?") for r in records.values()}) or [
      machine.cpu_name()]
  where = "%s; %d cores, %s, Python %s" % (
      " / ".join(cpus), os.cpu_count() or 0, platform.platform(),
      platform.python_version())
  tables = {"time": time_table(records, where)}
  for name in program_names():
    for f in records.get(name, {}).get("md_files", ()):
      path = os.path.join(out_dir, f)
      if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
          tables[f[:-3]] = embeddable(fh.read())
  payload = {"machine": where, "suite": program_names(),
             "programs": records, "tables": tables}
  tmp = os.path.join(out_dir, RESULTS + ".new")
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(payload, f, indent=1, sort_keys=True)
  os.replace(tmp, os.path.join(out_dir, RESULTS))


def run_one(name, args):
  cmd = command_for(name, args)
  started = datetime.datetime.now(datetime.timezone.utc)
  load = os.getloadavg()[0]
  print("make_bench: %s  %s" % (started.strftime("%H:%M:%S"),
                                " ".join(cmd[1:])), flush=True)
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  t0 = time.monotonic()
  stamps = _md_stamps(args.output_dir)
  code = subprocess.call(cmd)
  wall = time.monotonic() - t0
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  cpu = ((after.ru_utime - before.ru_utime) +
         (after.ru_stime - before.ru_stime))
  print("make_bench: %s finished (status %d) in %.1f min wall, %.1f min CPU"
        % (name, code, wall / 60, cpu / 60), flush=True)
  return {"command": " ".join(["python"] + cmd[1:]),
          "cpu": machine.cpu_name(),
          "started": started.strftime("%Y-%m-%d %H:%M"),
          "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
          "load_at_start": round(load, 2), "returncode": code,
          "md_files": _md_written(args.output_dir, stamps)}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--output_dir", default="bench_results")
  parser.add_argument("--old_kfac_path", default=".bench_deps/kfac-0.2.4")
  parser.add_argument("--kfac_jax_path",
                      default=".bench_deps/kfac-jax-0.0.8")
  parser.add_argument("--only", default="",
                      help="Comma-separated programs of the suite to run.")
  parser.add_argument("--resume", action="store_true",
                      help="Keep the records of programs that finished; run "
                           "the others.")
  args = parser.parse_args(argv)
  names = program_names()
  if args.only:
    chosen = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in names]
    if unknown:
      parser.error("--only: not programs of the suite: %s (the suite: %s)"
                   % (", ".join(unknown), ", ".join(names)))
    names = [n for n in names if n in chosen]
  os.makedirs(args.output_dir, exist_ok=True)
  records = {}
  path = os.path.join(args.output_dir, RESULTS)
  if (args.resume or args.only) and os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      records = {k: v for k, v in json.load(f).get("programs", {}).items()
                 if k in dict(PROGRAMS)}
  if args.resume:
    names = [n for n in names
             if records.get(n, {}).get("returncode") != 0]
  failed = []
  for name in names:
    records[name] = run_one(name, args)
    if records[name]["returncode"] != 0:
      failed.append(name)
    write_results(args.output_dir, records)
  if not names:
    write_results(args.output_dir, records)
  print(time_table(records))
  if failed:
    print("make_bench: failed: %s" % ", ".join(failed))
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
