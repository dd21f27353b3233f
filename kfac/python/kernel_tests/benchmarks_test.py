"""The benchmark programs of examples/benchmarks run end to end, tiny.

Benchmarks are programs (`make bench`), not timed tests: these runs use
tiny settings and check what the programs compute and write, never how
fast anything is.

* kfac_cost.py --quick (digits, factor widths 64/128, batches 32/64, 2
  reps, ~30 s): the markdown tables and the three PNGs are written; every
  time is positive; in the step split the amortised parts add up to the
  listed total; the K-FAC state takes memory beyond the parameters
  (statistics and inverses of the same size, velocities as large as the
  parameters).
* time_to_target.py on digits, the RNN workload, 2 s per optimizer (~40 s):
  all five optimizers train, losses are finite and below their start, the
  target is the best first-order final loss and the run that set it reaches
  it, the two K-FAC paths have the same hyperparameters, and the plots and
  tables are written.
* ekfac_bench.py --quick (digits, 20 steps per run, tiny layers, ~30 s):
  EKFAC and K-FAC runs differ only in their blocks, start from the same
  loss and get the stated target; the scalings rows are positive, the two
  strategies agree, "auto" picks the smaller memory; tables and plots.
* side_by_side with a fake backend (~10 s): a step that raises
  InvalidArgumentError ends that run with a NaN loss, the others go on.
* recurrent_step_time.py on a tiny GRU and LSTM, every configuration
  (~1 min): the rounds are timed and the table and JSON written.
* autoencoder_step_time.py at batch 16 with blocks of 2 steps, SGD and this
  kfac in TF2 behaviour and in legacy mode (~2 min): both ways of running
  a step (train_op only, train_op + loss) are timed for every
  configuration, ratios are taken within a behaviour, the old library's
  configurations are skipped with a note when it is not installed, and
  the table, JSON and plot are written.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

import kfac

# Slow tier (make test-slow): runs the benchmark programs in subprocesses.
pytestmark = pytest.mark.slow


BENCHMARKS = pathlib.Path(__file__).resolve().parents[3] / "examples" / (
    "benchmarks")


def _run(script, flags, tmp_path):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.run(
      [sys.executable, str(BENCHMARKS / script),
       "--output_dir=%s" % tmp_path] + flags, cwd=str(BENCHMARKS), env=env,
      capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def _png(path):
  with open(path, "rb") as f:
    head = f.read(8)
  assert head == b"\x89PNG\r\n\x1a\n", path
  assert os.path.getsize(path) > 1000, path


def test_kfac_cost_quick(tmp_path):
  stdout = _run("kfac_cost.py", ["--quick"], tmp_path)
  with open(tmp_path / "kfac_cost.json") as f:
    results = json.load(f)
  for row in results["inverse_cost"]:
    assert min(row["cholesky_ms"], row["cholesky_f64_ms"], row["eigh_ms"],
               row["precondition_ms"]) > 0, row
  assert [r["n"] for r in results["inverse_cost"]] == [64, 128]
  assert [r["batch"] for r in results["statistics_cost"]] == [32, 64]
  assert all(r["sgd_ms"] > 0 and r["statistics_ms"] > 0
             for r in results["statistics_cost"])
  split = {r["workload"]: r for r in results["step_split"]}
  assert sorted(split) == ["autoencoder", "convnet", "rnn"]
  for r in split.values():
    parts = (r["sgd_ms"] + r["precondition_ms"] + r["statistics_ms"] +
             r["inverse_update_ms"] / 10)
    assert r["amortised_total_ms"] == pytest.approx(parts, rel=1e-9)
    assert r["periodic_ms"] > 0 and r["inverse_update_ms"] > 0
    mem = r["memory"]
    assert mem["statistics"] > 0 and mem["inverses"] == mem["statistics"]
    assert mem["velocities"] == mem["parameters"] > 0
  assert [r["variant"] for r in results["adaptive_cost"]][0] == (
      "fixed lr and damping")
  assert results["adaptive_cost"][0]["ratio"] == 1.0
  for name in ("inverse_cost.png", "statistics_cost.png", "step_split.png"):
    _png(tmp_path / name)
  text = (tmp_path / "kfac_cost.md").read_text()
  for heading in ("Inverse cost", "Statistics cost", "Split of a K-FAC step",
                  "Memory of the K-FAC state", "Cost of adaptive K-FAC"):
    assert heading in text and heading in stdout


def test_time_to_target_small(tmp_path):
  stdout = _run("time_to_target.py", [
      "--dataset=digits", "--workloads=rnn", "--steps=20",
      "--seconds=100000", "--eval_every=5", "--print_seconds=100",
      "--eval_examples=300"],
                tmp_path)
  with open(tmp_path / "time_to_target_rnn.json") as f:
    results = json.load(f)
  runs = {r["name"]: r for r in results["runs"]}
  assert sorted(runs) == sorted(["sgd", "adam", "kfac", "kfac_tf2",
                                 "kfac_adaptive"])
  for name, run in runs.items():
    assert all(isinstance(l, float) and math.isfinite(l)
               for l in run["losses"]), name
    # A budget in steps (the seconds never end a run): the same work on a
    # slow or a busy machine.
    assert run["steps"][-1] == 20 and run["losses"][-1] < run["losses"][0], (
        name, run["steps"][-1], run["losses"])
  target = min(runs[n]["losses"][-1] for n in ("sgd", "adam"))
  table = (tmp_path / "time_to_target_rnn.md").read_text()
  assert "target loss %.4g" % target in table
  setter = min(("sgd", "adam"), key=lambda n: runs[n]["losses"][-1])
  row = [l for l in table.splitlines() if l.startswith("| %s |" % setter)][0]
  assert row.split("|")[7].strip() != "-"  # it reached its own final loss
  kfac_rows = [l for l in table.splitlines()
               if l.startswith(("| kfac |", "| kfac_tf2 |"))]
  assert len(kfac_rows) == 2
  assert kfac_rows[0].split("|")[2] == kfac_rows[1].split("|")[2]
  summary = (tmp_path / "time_to_target.md").read_text()
  assert summary.count("\n| rnn |") == 1 and "(%s)" % setter in summary
  written = json.loads((tmp_path / "time_to_target.json").read_text())
  assert written["tables"]["summary"].startswith("`time_to_target.py ")
  assert summary.strip() in written["tables"]["summary"]
  assert {r["workload"] for r in written["rows"]} == {"rnn"}
  assert written["tables"]["rnn"] == table.strip()
  for axis in ("steps", "seconds"):
    _png(tmp_path / ("rnn_loss_vs_%s.png" % axis))
  assert "total wall time" in stdout


_DIVERGING = r'''
import sys
sys.path.insert(0, sys.argv[1])
from absl import flags
import tensorflow as tf
import side_by_side

side_by_side.define_flags()
flags.FLAGS(["prog", "--eval_every=2", "--print_every=1000"])


class Backend(object):
  """Loss 10 - step; training raises like sampling from NaN logits does."""

  def __init__(self, fail_at):
    self.fail_at, self.step = fail_at, 0

  def batch(self, indices):
    return indices

  def train(self, batch):
    if self.step + 1 == self.fail_at:
      raise tf.errors.InvalidArgumentError(
          None, None, "Received a label value of 10 which is outside")
    self.step += 1

  def evaluate(self):
    return 10.0 - self.step

  def shown(self):
    return {}

  def finish(self):
    return {}


batches = side_by_side.Batches(100, 10, 0)
bad = side_by_side.Trainer("bad", Backend(fail_at=5), batches, 1e9)
good = side_by_side.Trainer("good", Backend(fail_at=-1), batches, 1e9)
flags.FLAGS.steps = 8
bad_h, good_h = side_by_side.run_in_turns([bad, good], chunk_steps=3)
print("RESULT", bad.step, bad_h.steps, bad_h.losses, good_h.steps,
      good_h.losses)
'''


def test_diverged_run_is_reported_not_raised(tmp_path):
  """A step that raises InvalidArgumentError (a diverged K-FAC run samples
  out-of-range targets from NaN logits) ends that run with a NaN loss; the
  other runs go on to their budget."""
  script = tmp_path / "diverging.py"
  script.write_text(_DIVERGING)
  proc = subprocess.run(
      [sys.executable, str(script), str(BENCHMARKS.parent)],
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), capture_output=True,
      text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][0]
  assert line == ("RESULT 4 [0, 2, 4, 4] [10.0, 8.0, 6.0, nan] "
                  "[0, 2, 4, 6, 8] [10.0, 8.0, 6.0, 4.0, 2.0]"), line
  assert "[bad] step 5  diverged (Received a label value of 10" in (
      proc.stdout)


def test_distributed_step_time_quick(tmp_path):
  """The distributed benchmark runs 1 and 2 replicas (eager, lazy and
  round-robin at 2) and writes its table, JSON and plot (times are not
  checked; the element counts are)."""
  proc = subprocess.run(
      [sys.executable, str(BENCHMARKS / "distributed_step_time.py"), "--quick",
       "--replicas=1,2", "--workloads=autoencoder",
       "--output_dir=%s" % tmp_path],
      capture_output=True, text=True, timeout=600, check=False,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(tmp_path / "distributed_step_time.json") as f:
    rows = json.load(f)
  assert [(r["replicas"], r["variant"]) for r in rows] == [
      (1, "eager"), (2, "eager"), (2, "lazy"), (2, "round_robin")]
  # The small autoencoder 64-48-32-16-8-16-32-48-64: its parameters, the
  # upper triangles of its 16 Kronecker factors (biases in A), and their
  # inverses in full (sum of n^2: 23192), per step of invert_every = 10.
  grads, stats, inverses = 10760, 11864, 23192
  expected = {"eager": (stats, grads + stats),
              "lazy": (stats / 10, grads + stats / 10),
              "round_robin": (stats, grads + stats + inverses / 10)}
  for r in rows:
    assert r["ms"] > 0
    assert r["grad_elements"] == grads, r
    stat_elements, sent = expected[r["variant"]]
    assert r["stat_elements"] == pytest.approx(stat_elements), r
    assert r["sent_elements"] == pytest.approx(
        sent if r["replicas"] > 1 else 0), r
  assert (tmp_path / "distributed_step_time.png").stat().st_size > 0
  table = (tmp_path / "distributed_step_time.md").read_text()
  assert "| autoencoder | 1000 | 2 | lazy |" in table


def test_ekfac_bench_quick(tmp_path):
  """ekfac_bench.py --quick (digits, 20 steps per run, tiny layers, 2 reps;
  ~30 s): the EKFAC runs register every layer with an EKFAC block and the
  K-FAC runs none, the compared runs start from the same loss, take the
  same steps and share the target (the higher of their final losses, which
  both reach; none if a run ended above its start); the scalings rows give
  positive times, the two strategies compute the same scalings, "auto"
  picks what kfac.ekfac.choose_strategy says; tables and plots are
  written."""
  stdout = _run("ekfac_bench.py", ["--quick"], tmp_path)
  with open(tmp_path / "ekfac_bench.json") as f:
    results = json.load(f)
  rows = results["optimizer"]
  assert [(r["workload"], r["name"]) for r in rows] == [
      ("autoencoder", "kfac"), ("autoencoder", "ekfac"),
      ("autoencoder", "ekfac_x10"), ("convnet", "kfac"), ("convnet", "ekfac"),
      ("convnet", "ekfac_x10"), ("convnet", "kfac_subsampled"),
      ("rnn", "kfac"), ("rnn", "ekfac"), ("rnn", "ekfac_x10")]
  for workload in ("autoencoder", "convnet", "rnn"):
    by = {r["name"]: r for r in rows if r["workload"] == workload}
    kfac_run = by["kfac"]
    grid = [by["ekfac"], by["ekfac_x10"]]
    for ekfac_run in grid:
      assert ekfac_run["ekfac_blocks"] == ekfac_run["blocks"] > 0
      assert kfac_run["blocks"] == ekfac_run["blocks"]
      assert "EKFAC" in ekfac_run["block_types"]
      # Same weights and evaluation set.
      assert kfac_run["initial_loss"] == ekfac_run["initial_loss"]
    assert kfac_run["ekfac_blocks"] == 0
    # K-FAC's hyperparameters; EKFAC at its damping and 10 times it.
    assert kfac_run["hyper"] == by["ekfac"]["hyper"] != by["ekfac_x10"][
        "hyper"]
    # The compared EKFAC run is the grid's lowest final loss.
    ekfac_run = min(grid, key=lambda r: r["final_loss"])
    assert [r["name"] for r in by.values() if r["compared"]] == [
        "kfac", ekfac_run["name"]]
    for r in by.values():
      # A budget in steps (--quick): the same work on any machine.
      assert r["steps"] == 20 and r["ms_per_step"] > 0
      assert math.isfinite(r["final_loss"]), r
    finals = [kfac_run["final_loss"], ekfac_run["final_loss"]]
    if max(finals) < kfac_run["initial_loss"]:
      assert all(r["target"] == max(finals) for r in by.values())
      for r in (kfac_run, ekfac_run):  # both reach the target
        assert 0 < r["steps_to_target"] <= 20 and r["seconds_to_target"] > 0
    else:  # a run ended above the start: no common target
      assert all(math.isnan(r["target"]) for r in by.values())
    table = (tmp_path / ("ekfac_%s.md" % workload)).read_text()
    assert table.count("\n| kfac |") == 1 and "\n| ekfac_x10 |" in table
    for axis in ("steps", "seconds"):
      _png(tmp_path / ("ekfac_%s_loss_vs_%s.png" % (workload, axis)))
  assert [r["sub_sampled_patches"] for r in rows] == [
      False, False, False, False, False, False, True, False, False, False]

  scal = results["scalings"]
  assert sorted({r["sweep"] for r in scal}) == ["batch", "conv", "positions",
                                                "width"]
  picks = set()
  for r in scal:
    assert r["backward_ms"] > 0 and r["kfac_statistics_ms"] > 0
    assert r["per_example_ms"] > 0 and r["gramian_ms"] > 0, r
    assert r["strategies_max_rel_diff"] < 1e-4, r
    rows_, cols, p = r["rows"], r["cols"], r["positions"]
    if p == 1:
      assert r["auto"] == "factored"
      assert r["per_example_memory"] == r["gramian_memory"] == rows_ + cols
      continue
    assert r["per_example_memory"] == rows_ * cols
    assert r["gramian_memory"] == p * p * (rows_ + cols)
    assert r["auto"] == kfac.ekfac.choose_strategy(p, rows_, cols), r
    picks.add(r["auto"])
  assert "per_example" in picks
  _png(tmp_path / "ekfac_scalings_cost.png")
  text = (tmp_path / "ekfac_bench.md").read_text()
  for heading in ("Time to a target loss", "Cost of the scalings",
                  "against batch size", "against width",
                  "against positions", "3x3 convolution"):
    assert heading in text and heading in stdout
  assert "total wall time" in stdout


def test_autoencoder_step_time_small(tmp_path):
  stdout = _run("autoencoder_step_time.py", [
      "--batch_sizes=16", "--invert_every=2", "--rounds=1",
      "--blocks_per_round=2", "--warmup_blocks=1",
      "--old_kfac_path=%s" % (tmp_path / "no_old_kfac"),
      "--configs=sgd_momentum,kfac_old_session,kfac_session,"
      "sgd_momentum_legacy,kfac_session_legacy"], tmp_path)
  with open(tmp_path / "autoencoder_step_time.json") as f:
    results = json.load(f)
  assert results["skipped"] == ["kfac_old_session"]
  assert "note: kfac_old_session skipped" in stdout
  rows = {r["config"]: r for r in results["rows"]}
  assert sorted(rows) == ["kfac_session", "kfac_session_legacy",
                          "sgd_momentum", "sgd_momentum_legacy"]
  for name, row in rows.items():
    assert row["behaviour"] == ("legacy" if "legacy" in name else "TF2")
    for way in ("train_op", "train_op+loss"):
      timing = row[way]
      assert 0 < timing["q25_ms"] <= timing["median_ms"] <= timing["q75_ms"]
      assert timing["cpu_ms"] > 0 and timing["ratio_to_old"] is None
      sgd = "sgd_momentum_legacy" if "legacy" in name else "sgd_momentum"
      assert timing["ratio_to_sgd"] == pytest.approx(
          timing["median_ms"] / rows[sgd][way]["median_ms"])
    assert min(row["first_run_s"].values()) > 0 and math.isfinite(row["loss"])
  text = (tmp_path / "autoencoder_step_time.md").read_text()
  assert "| train_op + loss ms/step |" in text
  assert "| kfac_session_legacy | legacy |" in text
  _png(tmp_path / "autoencoder_step_time_b16.png")


def test_keras_zoo_tiny(tmp_path):
  """keras_zoo.py on the tiny GPT, 8 steps, K-FAC and Adam: one result per
  run, every step timed, the losses finite, the coverage read from the
  registration report (every layer under a Kronecker block), and the
  table (its header naming the machine), JSON and plot written. (One model: each model's coverage and
  training are keras_zoo_test's; with the BN ResNet too this took 208 s of
  CI's slow tier.)"""
  _run("keras_zoo.py", ["--size=tiny", "--steps=8", "--val_examples=64",
                        "--models=gpt", "--optimizers=kfac,adam,kfac_auto"],
       tmp_path)
  with open(tmp_path / "keras_zoo.json") as f:
    written = json.load(f)
  runs = written["runs"]
  # The table the docs render: the .md's text.
  assert written["tables"]["zoo"] + "\n" == (
      tmp_path / "keras_zoo.md").read_text()
  assert [(r["model"], r["optimizer"]) for r in runs] == [
      ("gpt", "kfac"), ("gpt", "adam"), ("gpt", "kfac_auto")]
  for r in runs:
    assert "error" not in r, r
    assert len(r["losses"]) == len(r["elapsed"]) == 8, r
    assert all(math.isfinite(v) for v in r["losses"]), r
    assert r["first_call_s"] > 0 and r["ms_per_step"] > 0, r
    assert 0 <= r["val_accuracy"] <= 1, r
    if r["optimizer"] == "kfac":
      assert r["kron_share"] == pytest.approx(1.0), r["report"]
      assert r["fallbacks"] == [] and r["diagonal"] == [], r["report"]
    if r["optimizer"] == "kfac_auto":  # its noise scale and choice
      assert r["noise_scale"] > 0 and r["switched_at"] in (-1, 4), r
  table = (tmp_path / "keras_zoo.md").read_text()
  assert "| gpt |" in table
  # The header names the machine and the threads (tables from different
  # machines are compared only within themselves).
  assert ", %d cores, TF " % os.cpu_count() in table.splitlines()[0]
  assert "default threads" in table.splitlines()[0]
  assert "recipe='auto' (the gradient noise scale it measured, at batch " \
      "64, and the recipe it chose): gpt B_simple " in table, table
  _png(tmp_path / "keras_zoo.png")


def test_keras_zoo_step_time_quick(tmp_path):
  """keras_zoo_step_time.py times Adam and a Kfac(adaptive=True)
  configuration (the recipe with an option, so that the options reach the
  optimizer) on the small GPT-style transformer of the zoo and writes its
  table and JSON (times not checked). (Two configurations: a third took
  a third of this test's 100 s in CI's slow tier.)"""
  _run("keras_zoo_step_time.py", [
      "--models=gpt", "--configs=adam,kfac_qmodel_half", "--steps=2",
      "--warmup_steps=1", "--rounds=2", "--batch_size=16"], tmp_path)
  with open(tmp_path / "keras_zoo_step_time.json") as f:
    written = json.load(f)
  (row,) = written["runs"]
  assert written["tables"]["step_time"] == (
      tmp_path / "keras_zoo_step_time.md").read_text().strip()
  assert row["model"] == "gpt"
  for config in ("adam", "kfac_qmodel_half"):
    assert len(row["configs"][config]["ms_rounds"]) == 2
    assert row["configs"][config]["ms_best"] > 0
    assert math.isfinite(row["configs"][config]["last_loss"])
  table = (tmp_path / "keras_zoo_step_time.md").read_text()
  assert table.startswith(
      "| model | adam ms/step | kfac_qmodel_half ms/step | "
      "kfac_qmodel_half / adam |"), table
  assert "| gpt | " in table


def test_keras_zoo_step_time_split_configurations():
  """The step-splitting configurations of keras_zoo_step_time.py pass what
  their names say to Kfac: no quadratic model (a fixed rate and
  momentum), statistics and inverses "never" after the burn-in."""
  sys.path.insert(0, str(BENCHMARKS))
  try:
    import keras_zoo_step_time as zst  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.remove(str(BENCHMARKS))
  import keras  # pylint: disable=g-import-not-at-top
  import kfac.keras as kfac_keras  # pylint: disable=g-import-not-at-top
  expected = {
      "kfac": {},
      "kfac_no_statistics": dict(cov_update_every=zst.NEVER),
      "kfac_fixed_rate_no_statistics": dict(
          momentum_type="regular", momentum=0.9, cov_update_every=zst.NEVER),
      "kfac_fixed_rate_frozen": dict(
          momentum_type="regular", momentum=0.9, cov_update_every=zst.NEVER,
          invert_every=zst.NEVER),
      "kfac_minibatch": dict(
          momentum_type="regular", momentum=0.9, cov_update_every=10,
          invert_every=50),
  }
  for config, want in expected.items():
    model = zst.make(keras, kfac_keras, "gpt", config)
    got = model.optimizer.get_config()
    assert got["adaptive"] is True, config
    for key in ("momentum_type", "momentum", "cov_update_every",
                "invert_every"):
      if key in want:
        # (momentum is stored as a float32 variable)
        assert got[key] == pytest.approx(want[key]), (config, key,
                                                      got.get(key))
      else:
        assert key not in got or got[key] != zst.NEVER, (config, key)
    assert ("momentum_type" in want) == (
        got.get("momentum_type") == "regular"), config
    if "momentum_type" in want:
      assert got["learning_rate"] == pytest.approx(0.05), config
    assert (got.get("recipe") == "minibatch") == (
        config == "kfac_minibatch"), config
    assert "factor_block_size" not in got, config
  # The suffix _blocksB adds factor_block_size=B to its configuration.
  assert zst.split_blocks("kfac_minibatch_blocks256") == ("kfac_minibatch",
                                                          256)
  assert zst.split_blocks("kfac_blocksx") == ("kfac_blocksx", None)
  got = zst.make(keras, kfac_keras, "gpt",
                 "kfac_minibatch_blocks128").optimizer.get_config()
  assert got["factor_block_size"] == 128 and got["recipe"] == "minibatch"
  with pytest.raises(ValueError, match="unknown configuration"):
    zst.make(keras, kfac_keras, "gpt", "kfac_blocksx")
  # Options keyed by a layer class the model lacks are left out (Kfac
  # refuses them): the GPT has no convolutions, so the patch
  # configurations build as kfac.
  model = zst.make(keras, kfac_keras, "gpt", "kfac_dw_all_patches")
  assert zst.present_classes(model, {keras.layers.DepthwiseConv2D: 1,
                                     keras.layers.Dense: 2}) == {
                                         keras.layers.Dense: 2}
  zst.make(keras, kfac_keras, "gpt", "kfac_full_patches")


def test_recurrent_step_time_quick(tmp_path):
  """recurrent_step_time.py times its configurations on a tiny GRU and
  LSTM and writes its table and JSON (times not checked). Plain "kfac" is
  left out: the two variants are it with one option each."""
  configs = ["adam", "adam_rec", "kfac_nostats", "kfac_nodamp"]
  _run("recurrent_step_time.py", [
      "--units=4", "--time_steps=5", "--batch_size=8", "--steps=2",
      "--warmup_steps=6", "--rounds=2", "--configs=" + ",".join(configs)],
       tmp_path)
  with open(tmp_path / "recurrent_step_time.json") as f:
    out = json.load(f)
  assert sorted(out["ms_per_step"]) == ["gru", "lstm"]
  for cell in ("gru", "lstm"):
    for config in configs:
      rounds = out["ms_per_step"][cell][config]
      assert len(rounds) == 2 and min(rounds) > 0, (cell, config, rounds)
  table = (tmp_path / "recurrent_step_time.md").read_text()
  assert table.count("\n") == 2 + 2 * len(configs), table


def _keras_validation(tmp_path, flags):
  return _run("keras_validation.py", [
      "--size=tiny", "--max_steps=6", "--eval_every=3", "--batch_size=64",
      "--train_examples=512", "--val_examples=256"] + flags, tmp_path)


def test_keras_validation_tiny(tmp_path):
  """keras_validation.py on the tiny CNN, 6 steps per run (7 worker
  processes, ~1 CPU-minute): every optimizer runs from the same initial
  validation figure, is evaluated before the first step and every 3 steps,
  its training time is counted, and the table, JSON and plot are
  written."""
  optimizers = ["kfac", "kfac_l2", "kfac_auto", "adam", "adamw", "lion",
                "muon", "schedulefree"]
  stdout = _keras_validation(tmp_path, [
      "--workloads=cnn", "--optimizers=" + ",".join(optimizers),
      "--tuned=%s" % (tmp_path / "absent.json")])
  assert "cnn adam 0.001 step 3 val acc" in stdout, stdout[-2000:]
  with open(tmp_path / "keras_validation.json") as f:
    runs = json.load(f)["runs"]
  assert sorted(r["optimizer"] for r in runs) == sorted(optimizers)
  for r in runs:
    assert "error" not in r, r
    assert [p["step"] for p in r["points"]] == [0, 3, 6], r
    assert all(math.isfinite(p["metric"]) for p in r["points"]), r
    assert r["steps"] == 6 and r["train_cpu_s"] > 0, r
    assert r["points"][-1]["cpu_s"] == r["train_cpu_s"], r
    assert r["untuned"] == (r["optimizer"] in ("adam", "adamw", "lion", "muon",
                                               "schedulefree")), r
    assert 0 <= r["final"] <= 1, r
    if r["optimizer"] == "schedulefree":  # also judged at its point y
      assert all("metric_at_y" in p for p in r["points"]), r
    # recipe='auto' measured the gradient noise scale; the default recipe
    # (not asked) and the peers not.
    assert ("noise_scale" in r) == (r["optimizer"] == "kfac_auto"), r
    if "noise_scale" in r:
      assert math.isfinite(r["noise_scale"]) and r["noise_scale"] > 0, r
    # recipe='auto' records the step of its switch (-1: none; the first
    # check is at step 4, the next at 14).
    assert ("switched_at" in r) == (r["optimizer"] == "kfac_auto"), r
    if "switched_at" in r:
      assert r["switched_at"] in (-1, 4), r
  # Same seed, same initial weights: the same figure before any step.
  assert len({r["points"][0]["metric"] for r in runs}) == 1, runs
  table = (tmp_path / "keras_validation.md").read_text()
  assert "### cnn" in table
  assert "recipe='auto' switched to the minibatch recipe: kfac_auto " in table
  assert "| optimizer | grid value | final val acc | best val acc |" in table
  assert "schedulefree 0.0025 evaluated at its training point y" in table
  assert ("Gradient noise scale B_simple as K-FAC measured it at the end "
          "of each run that measured it (its first 5 steps, then one in 10 "
          "with recipe='auto'; batch 64): kfac_auto ") in table
  for o in optimizers:
    assert "| %s |" % o in table, table
  assert "pinned to 1 thread(s)" in table
  _png(tmp_path / "keras_validation.png")


def test_keras_validation_without_peers_and_rerender(tmp_path):
  """K-FAC variants alone: no peer, so no target (the table says so and
  leaves the to-target columns empty); --rerender rewrites a results
  file's tables from its runs (a table edited by hand comes back) and
  keeps its runs and command."""
  _keras_validation(tmp_path, ["--workloads=autoencoder",
                               "--optimizers=kfac,kfac_unbounded",
                               "--tuned=%s" % (tmp_path / "absent.json")])
  path = tmp_path / "keras_validation.json"
  with open(path) as f:
    out = json.load(f)
  table = out["tables"]["autoencoder"]
  assert "No peer ran on this workload in this run" in table, table
  assert "nan" not in table, table
  rows = [l for l in table.split("\n") if l.startswith("| kfac")]
  assert len(rows) == 2 and all(r.split("|")[7].strip() == "-"
                                for r in rows), rows
  edited = dict(out, tables=dict(out["tables"], autoencoder="edited"))
  with open(path, "w") as f:
    json.dump(edited, f)
  proc = subprocess.run(
      [sys.executable, str(BENCHMARKS / "keras_validation.py"),
       "--rerender=%s" % path], cwd=str(BENCHMARKS), capture_output=True,
      text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  with open(path) as f:
    again = json.load(f)
  assert again["tables"] == out["tables"]
  assert again["runs"] == out["runs"] and again["command"] == out["command"]
  assert again["rerendered"].startswith("keras_validation.py --rerender=")


def test_keras_validation_tune_then_run(tmp_path):
  """--tune runs Adam's grid and writes the best value, which the next run
  reads (and reproduces the tuning run of that value)."""
  tuned = tmp_path / "tuned.json"
  _keras_validation(tmp_path, ["--tune", "--workloads=autoencoder",
                               "--optimizers=adam", "--tuned=%s" % tuned])
  with open(tmp_path / "keras_validation_tune.json") as f:
    runs = json.load(f)["runs"]
  assert sorted(r["value"] for r in runs) == [3e-4, 1e-3, 3e-3]
  best = min(runs, key=lambda r: r["best"])
  with open(tuned) as f:
    chosen = json.load(f)["best"]["autoencoder"]["adam"]
  assert chosen["learning_rate"] == best["value"]
  assert chosen["best"] == best["best"]
  table = (tmp_path / "keras_validation_tune.md").read_text()
  assert "| optimizer | grid value | final val loss | best val loss |" in table
  assert "Target = val loss %.4f" % best["best"] in table
  _keras_validation(tmp_path, ["--workloads=autoencoder",
                               "--optimizers=adam,kfac", "--tuned=%s" % tuned])
  with open(tmp_path / "keras_validation.json") as f:
    out = json.load(f)
  (run,) = [r for r in out["runs"] if r["optimizer"] == "adam"]
  # The tuning table names each value's pass (its budget and command);
  # the recipe, which takes no learning rate, has no row.
  tuning = out["tables"]["tuning"]
  assert "| autoencoder | adam | %g | 0.0003, 0.001, 0.003 | 0 |" % (
      best["value"]) in tuning, tuning
  assert "| kfac |" not in tuning, tuning
  (pass_row,) = [l for l in tuning.split("\n") if l.startswith("| 0 | ")]
  assert "| 60 | `keras_validation.py " in pass_row, pass_row
  assert " --tune " in pass_row and "--size=tiny" in pass_row, pass_row
  assert run["value"] == best["value"] and not run["untuned"]
  # Same seed and batches as the tuning run of that value: same figures.
  assert [p["metric"] for p in run["points"]] == pytest.approx(
      [p["metric"] for p in best["points"]], rel=1e-4)


def test_keras_validation_seeds(tmp_path):
  """--seeds runs every (workload, optimizer) once per seed and
  --add_results adds an earlier run's seed: the summary across seeds has
  each optimizer's time to its seed's target per seed (Adam, the only
  peer, sets every target: 1.00x on each), a table per seed and its plot;
  another optimizer at seeds already run joins their runs; --tune with
  --seeds and a (seed, workload, optimizer) trained twice are refused."""
  flags = ["--workloads=autoencoder", "--optimizers=kfac,adam",
           "--tuned=%s" % (tmp_path / "absent.json")]
  first = tmp_path / "seed0"
  _keras_validation(first, flags + ["--seed=0"])
  stdout = _keras_validation(tmp_path, flags + [
      "--seeds=1,2", "--add_results=%s" % (first / "keras_validation.json")])
  assert "done autoencoder adam 0.001 seed 2:" in stdout, stdout[-2000:]
  with open(tmp_path / "keras_validation.json") as f:
    out = json.load(f)
  assert out["seeds"] == [0, 1, 2]
  assert sorted((r["seed"], r["optimizer"]) for r in out["runs"]) == [
      (1, "adam"), (1, "kfac"), (2, "adam"), (2, "kfac")]
  assert sorted((r["seed"], r["optimizer"]) for r in out["added_runs"]) == [
      (0, "adam"), (0, "kfac")]
  before = {}
  for r in out["runs"] + out["added_runs"]:
    before.setdefault(r["seed"], set()).add(r["points"][0]["metric"])
  # The same initial weights within a seed, other ones across seeds.
  assert all(len(v) == 1 for v in before.values()), before
  assert len({v.pop() for v in before.values()}) == 3, before
  table = (tmp_path / "keras_validation.md").read_text()
  assert "### autoencoder: 3 seed(s) (0, 1, 2)" in table, table
  assert ("| adam | 0.001 (untuned) | " in table and
          "| 1.00x / 1.00x / 1.00x | 1.00x | 3 of 3 |" in table), table
  assert "| kfac | - | " in table, table
  for seed in (0, 1, 2):
    assert "## Seed %d" % seed in table, table
  _png(tmp_path / "keras_validation_seeds.png")
  # The summary across seeds is also a table of the JSON (what the docs
  # render), naming the file the added runs came from.
  across = out["tables"]["across_seeds"]
  assert across.startswith("Runs from `") and "seed0" in across, across
  assert "### autoencoder: 3 seed(s) (0, 1, 2)" in across, across
  # --optimizers= with --add_results trains nothing and renders the same
  # summary from the files' runs.
  rendered = tmp_path / "rendered"
  stdout = _keras_validation(rendered, [
      "--workloads=autoencoder", "--optimizers=", "--seeds=0,1,2",
      "--tuned=%s" % (tmp_path / "absent.json"),
      "--add_results=%s,%s" % (first / "keras_validation.json",
                               tmp_path / "keras_validation.json")])
  assert "done " not in stdout, stdout[-2000:]
  with open(rendered / "keras_validation.json") as f:
    again = json.load(f)
  assert again["runs"] == [] and len(again["added_runs"]) == 6
  body = across[across.index("### autoencoder"):]
  assert body == again["tables"]["across_seeds"][
      again["tables"]["across_seeds"].index("### autoencoder"):]
  # Another optimizer at seeds already run joins them: its runs are added
  # to theirs in one summary.
  other = tmp_path / "other"
  _keras_validation(other, [
      "--workloads=autoencoder", "--optimizers=lion", "--seeds=0,1",
      "--tuned=%s" % (tmp_path / "absent.json"),
      "--add_results=%s,%s" % (first / "keras_validation.json",
                               tmp_path / "keras_validation.json")])
  with open(other / "keras_validation.json") as f:
    out = json.load(f)
  assert sorted((r["seed"], r["optimizer"]) for r in out["runs"]) == [
      (0, "lion"), (1, "lion")]
  assert len(out["added_runs"]) == 6 and out["seeds"] == [0, 1, 2]
  table = (other / "keras_validation.md").read_text()
  assert "| lion | 0.0003 (untuned) | " in table, table
  for bad in (["--tune", "--seeds=1,2"],
              ["--seeds=0,1", "--add_results=%s" % (
                  first / "keras_validation.json")]):
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "keras_validation.py"),
         "--output_dir=%s" % (tmp_path / "bad")] + flags + bad,
        cwd=str(BENCHMARKS), capture_output=True, text=True, timeout=600,
        check=False)
    assert proc.returncode != 0, bad
    assert ("--tune tunes at one seed" in proc.stderr or
            "has runs that this run trains too: seed 0 autoencoder adam, "
            "seed 0 autoencoder kfac" in proc.stderr), proc.stderr[-2000:]


def test_keras_validation_variant_errors():
  """A K-FAC variant whose keyword arguments Kfac rejects fails with the
  variant's name and Kfac's reason; an unknown name lists the choices."""
  sys.path.insert(0, str(BENCHMARKS))
  try:
    import val_workloads  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.remove(str(BENCHMARKS))
  import keras  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  val_workloads.KFAC_VARIANTS["kfac_bogus"] = {"bogus_argument": 1}
  try:
    with pytest.raises(ValueError, match="kfac_bogus.*bogus_argument"):
      val_workloads.make_optimizer("kfac_bogus", model)
  finally:
    del val_workloads.KFAC_VARIANTS["kfac_bogus"]
  with pytest.raises(ValueError, match="unknown optimizer 'sgd'; one of kfac"):
    val_workloads.make_optimizer("sgd", model)
  # Every variant the benchmark names is one Kfac accepts.
  for name in tuple(val_workloads.KFAC_VARIANTS) + val_workloads.TUNED_KFAC:
    val_workloads.make_optimizer(name, model)


def _schedule_free_reference(w0, grad, lr, steps, beta_1=0.9, beta_2=0.999,
                             eps=1e-8):
  """Schedule-free AdamW (Defazio et al. 2024, no warm-up), float64."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  y, z, x = w0.copy(), w0.copy(), w0.copy()
  v = np.zeros_like(w0)
  for t in range(1, steps + 1):
    g = grad(y)
    v = beta_2 * v + (1 - beta_2) * g * g
    z = z - lr * g / (np.sqrt(v / (1 - beta_2 ** t)) + eps)
    x = (1 - 1.0 / t) * x + z / t
    y = (1 - beta_1) * z + beta_1 * x
  return y, z, x


def test_keras_validation_schedule_free_matches_reference():
  """The benchmark's ScheduleFreeAdamW = the float64 reference on a
  quadratic (3 steps, eager and tf.function, built before or by the first
  apply), and schedule_free_eval puts the weights at x and restores y."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, str(BENCHMARKS))
  try:
    import val_workloads  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.remove(str(BENCHMARKS))
  import keras  # pylint: disable=g-import-not-at-top
  w0, c = np.array([0.5, 0.5, -1.0]), np.array([1.0, -2.0, 0.25])
  grad = lambda w: 2.0 * (w - c) * np.array([1.0, 3.0, 0.5])
  y_ref, z_ref, x_ref = _schedule_free_reference(w0, grad, 0.1, 3)
  for traced in (False, True):
    for build_first in (False, True):
      var = keras.Variable(w0.astype("float32"))
      opt = val_workloads.schedule_free_adamw_class()(0.1)
      if build_first:
        opt.build([var])
      scale = tf.constant([1.0, 3.0, 0.5])
      def step():
        opt.apply([2.0 * (var - tf.constant(c, tf.float32)) * scale], [var])  # pylint: disable=cell-var-from-loop
      step = tf.function(step) if traced else step
      for _ in range(3):
        step()
      np.testing.assert_allclose(var.numpy(), y_ref, rtol=0, atol=2e-6)
      np.testing.assert_allclose(opt._momentums[0].numpy(), z_ref, rtol=0,  # pylint: disable=protected-access
                                 atol=2e-6)
  model = keras.Sequential([keras.Input((3,)),
                            keras.layers.Dense(1, use_bias=False)])
  model.layers[0].kernel.assign(w0.reshape(3, 1).astype("float32"))
  opt = val_workloads.schedule_free_adamw_class()(0.1)
  model.compile(optimizer=opt, loss="mse")
  batch = (np.eye(3, dtype="float32"), np.zeros((3, 1), "float32"))
  for _ in range(3):
    model.train_on_batch(*batch)
  kernel = model.layers[0].kernel
  y_now = kernel.numpy().copy()
  z_now = opt._momentums[0].numpy()  # pylint: disable=protected-access
  with val_workloads.schedule_free_eval(model, opt):
    np.testing.assert_allclose(kernel.numpy(), (y_now - 0.1 * z_now) / 0.9,
                               rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(kernel.numpy(), y_now, rtol=0, atol=0)
  # Built by fit, z started at the weights: the first step is
  # Adam's (lr sign(g)), not a jump to -lr sign(g).
  assert np.all(np.abs(y_now - w0.reshape(3, 1)) < 0.35), y_now


def test_keras_validation_weight_average_and_linear_decay():
  """kfac_minibatch_ema's WeightAverage = a float64 moving average with
  decay min(0.99, (1 + t) / (10 + t)) at its t-th update, over 5 SGD steps
  of a model with batch norm; schedule_free_eval with it holds the averages
  and batch-norm statistics recomputed at them, and restores the weights
  and statistics that training left; kfac_minibatch_linear's rate."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, str(BENCHMARKS))
  try:
    import val_workloads  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.remove(str(BENCHMARKS))
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                            keras.layers.BatchNormalization(),
                            keras.layers.Dense(1)])
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  average = val_workloads.WeightAverage(model)
  rng = np.random.RandomState(0)
  x, y = rng.randn(16, 3).astype("float32"), rng.randn(16, 1).astype(
      "float32")
  ref = [v.numpy().astype(np.float64) for v in model.trainable_variables]
  for t in range(5):
    model.train_on_batch(x, y)
    average.update()
    d = min(0.99, (1.0 + t) / (10.0 + t))
    ref = [d * a + (1 - d) * v.numpy() for a, v in
           zip(ref, model.trainable_variables)]
  for got, want in zip(average.values(), ref):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  trained = [v.numpy().copy() for v in model.weights]
  bn = model.layers[1]
  with val_workloads.schedule_free_eval(model, None, [x], average):
    for v, want in zip(model.trainable_variables, ref):
      np.testing.assert_allclose(v.numpy(), want, rtol=1e-6, atol=1e-7)
    # One batch at momentum 0: the statistics of x under the averages.
    hidden = x @ ref[0] + ref[1]
    np.testing.assert_allclose(bn.moving_mean.numpy(), hidden.mean(0),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.moving_variance.numpy(), hidden.var(0),
                               rtol=1e-4, atol=1e-6)
  for v, want in zip(model.weights, trained):
    np.testing.assert_array_equal(v.numpy(), want)
  assert isinstance(val_workloads.weight_average(
      "kfac_minibatch_ema", model, None), val_workloads.WeightAverage)
  assert val_workloads.weight_average("kfac_minibatch", model, None) is None
  # kfac_minibatch_keras_ema: Kfac's own average (use_ema), evaluated
  # through the same context; the weights before the first step.
  kfac_model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  opt = val_workloads.make_optimizer("kfac_minibatch_keras_ema", kfac_model,
                                     0.05)
  assert opt.use_ema and opt.ema_momentum == pytest.approx(0.99)
  assert not opt.get_config()["ema_warmup"]
  assert val_workloads.make_optimizer(
      "kfac_minibatch_keras_ema_warmup", keras.Sequential(
          [keras.Input((3,)), keras.layers.Dense(2)]),
      0.05).get_config()["ema_warmup"]
  kfac_model.compile(optimizer=opt, loss="mse")
  own = val_workloads.weight_average("kfac_minibatch_keras_ema", kfac_model,
                                     opt)
  for got, want in zip(own.values(), kfac_model.get_weights()):
    np.testing.assert_array_equal(got, want)  # (not built yet)
  kfac_model.fit(x, rng.randn(16, 2).astype("float32"), batch_size=8,
                 epochs=1, verbose=0)
  for got, want in zip(own.values(), opt._model_variables_moving_average):  # pylint: disable=protected-access
    np.testing.assert_array_equal(got, want.numpy())
  # kfac_minibatch_linear's rate: linear over the budget, with a floor.
  decay = val_workloads.linear_decay
  assert decay("kfac_minibatch_linear", 0.1, 15.0, 60.0) == pytest.approx(
      0.075)
  assert decay("kfac_minibatch_linear", 0.1, 75.0, 60.0) == pytest.approx(
      1e-4)
  assert decay("kfac_minibatch", 0.1, 15.0, 60.0) is None


def test_products_step_time_quick(tmp_path):
  """products_step_time.py times the two curvature products with every
  forward-mode rule and without the convnet ops' rules on a tiny model
  (Pad, Relu6, swish, dropout), writes its table and JSON, and the two
  variants agree (times not checked); fewer nodes with the rules."""
  _run("products_step_time.py", [
      "--models=tiny", "--batch_size=4", "--calls=2", "--rounds=2"],
       tmp_path)
  with open(tmp_path / "products_step_time.json") as f:
    out = json.load(f)
  variants = out["tiny"]
  assert len(variants) == 2, variants
  full, without = variants["all rules"], [
      v for k, v in variants.items() if k != "all rules"][0]
  for v in (full, without):
    assert len(v["ms_rounds"]) == 2 and min(v["ms_rounds"]) > 0, v
  assert full["nodes"] < without["nodes"], (full, without)
  assert abs(full["value"] - without["value"]) <= 1e-5 * abs(
      without["value"]), (full, without)
  table = (tmp_path / "products_step_time.md").read_text()
  assert table.count("\n") == 4, table


def test_tree_step_time_tiny(tmp_path):
  """tree_step_time.py with this checkout on both sides (the Session
  autoencoder, one block of 10 steps, ~30 s): every worker imports kfac
  from its tree (checked in the worker), each side is timed once, and the
  JSON and table hold both medians and their ratio."""
  root = str(BENCHMARKS.parents[1])
  _run("tree_step_time.py", ["--base_tree=" + root, "--tree=" + root,
                             "--workloads=autoencoder_session",
                             "--rounds=1", "--blocks=1"], tmp_path)
  result = json.loads((tmp_path / "tree_step_time.json").read_text())
  row = result["summary"]["autoencoder_session"]
  for side in ("base", "tree"):
    assert len(row[side]["cpu_all"]) == 1 and row[side]["cpu_ms"] > 0
  assert math.isclose(row["ratio_cpu"],
                      row["tree"]["cpu_ms"] / row["base"]["cpu_ms"])
  assert math.isclose(row["paired_ratio_cpu"], row["ratio_cpu"])  # 1 round
  # One tree on both sides: the same graph, op for op.
  assert row["same_graph"], row
  assert sum(row["tree"]["graph_ops"]["counts"].values()) > 1000, row
  assert "| autoencoder_session |" in (tmp_path / "tree_step_time.md"
                                       ).read_text()


def test_tree_step_time_rejects_a_folder_without_kfac(tmp_path):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.run(
      [sys.executable, str(BENCHMARKS / "tree_step_time.py"),
       "--base_tree=%s" % tmp_path, "--output_dir=%s" % tmp_path],
      cwd=str(BENCHMARKS), env=env, capture_output=True, text=True,
      timeout=300, check=False)
  assert proc.returncode != 0
  assert "has no kfac/ package" in proc.stderr


def test_keras_damping_trace_tiny(tmp_path):
  """keras_damping_trace.py on the tiny ViT, 6 steps recorded every 3: the
  records (damping at the decay given, finite losses and scales) in the
  JSON and the table."""
  _run("keras_damping_trace.py", [
      "--workload=vit", "--size=tiny", "--steps=6", "--every=3",
      "--train_examples=2000", "--damping_adaptation_decay=0.9"], tmp_path)
  with open(tmp_path / "keras_damping_trace.json") as f:
    out = json.load(f)
  assert out["damping_adaptation_decay"] == 0.9
  records = out["records"]
  assert [r["step"] for r in records] == [3, 6], records
  for r in records:
    assert all(math.isfinite(r[k]) for k in (
        "train_loss", "val_acc", "damping", "curvature_scale")), r
    # From 1.0, one application of the rule moves it by 0.9**50 at most.
    assert 0.9**50 * 0.999 <= r["damping"] <= 0.9**-50 * 1.001, r
  table = (tmp_path / "keras_damping_trace.md").read_text()
  assert "| step | train loss | val acc | damping | rho |" in table
  assert "| 6 |" in table
  assert out["tables"]["trace"] == table  # what docs render from


def test_noise_scale_trace_tiny(tmp_path):
  """noise_scale_trace.py on the tiny CNN: a measurement before training
  and every 3 steps, positive and finite here, in the JSON and table."""
  _run("noise_scale_trace.py", [
      "--workload=cnn", "--size=tiny", "--steps=6", "--every=3",
      "--batches=2", "--batch_size=64", "--train_examples=1000"], tmp_path)
  with open(tmp_path / "noise_scale_trace.json") as f:
    out = json.load(f)
  assert out["batch_size"] == 64 and out["optimizer"] == "kfac_minibatch"
  records = out["records"]
  assert [r["step"] for r in records] == [0, 3, 6], records
  for r in records:
    assert r["trace_sigma_sum"] > 0 and math.isfinite(r["b_simple"]), r
    if r["grad_sq_sum"] > 0:
      assert r["b_simple"] == pytest.approx(
          r["trace_sigma_sum"] / r["grad_sq_sum"]), r
  table = (tmp_path / "noise_scale_trace.md").read_text()
  assert "| step | train loss | B_simple | B_simple / batch |" in table
  assert out["tables"]["trace"] == table  # what docs render from


def test_keras_first_step_records_and_tables(tmp_path):
  """keras_first_step.py adds its run to OUTPUT_DIR/keras_first_step.json
  with the table of its runs (MobileNetV2 with Adam here); --table writes
  the table from an older file's list of runs: the latest
  run of each (model, configuration) with its ratios to Adam's (checked on
  records written here); a bad configuration is named."""
  _run_first = lambda *args: subprocess.run(  # pylint: disable=g-long-lambda
      [sys.executable, str(BENCHMARKS / "keras_first_step.py")] + list(args),
      cwd=str(BENCHMARKS), capture_output=True, text=True, timeout=600,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), check=False)
  proc = _run_first("mobilenetv2", "adam", str(tmp_path))
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(tmp_path / "keras_first_step.json") as f:
    written = json.load(f)
  (run,) = written["runs"]
  # The table the docs render is the .md the run rewrote.
  assert written["tables"]["first_step"] + "\n" == (
      tmp_path / "keras_first_step.md").read_text()
  assert "| mobilenetv2 | adam |" in written["tables"]["first_step"]
  assert run["model"] == "mobilenetv2" and run["config"] == "adam"
  assert run["first_call_cpu_s"] > 0 and run["peak_rss_after_first_call_gb"] > 0
  made = dict(run, model="m", date="x")
  runs = [dict(made, config="adam", first_call_cpu_s=10.0,
               peak_rss_after_first_call_gb=2.0),
          dict(made, config="kfac", first_call_cpu_s=99.0),
          dict(made, config="kfac", first_call_cpu_s=25.0,
               peak_rss_after_first_call_gb=5.0, next_steps_cpu_ms=1234.0)]
  (tmp_path / "made").mkdir()
  with open(tmp_path / "made" / "keras_first_step.json", "w") as f:
    json.dump(runs, f)
  proc = _run_first("--table", str(tmp_path / "made"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  table = (tmp_path / "made" / "keras_first_step.md").read_text()
  assert "| m | adam | 10.0 | 1.00x | 2.00 | 1.00x |" in table, table
  assert "| m | kfac | 25.0 | 2.50x | 5.00 | 2.50x | 1234 |" in table, table
  assert "| m | kfac | 99.0" not in table, table
  proc = _run_first("mobilenetv2", "kfac_blocksx")
  assert proc.returncode != 0 and "kfac_blocksB" in proc.stderr, proc.stderr
  assert "kfac_calibrate_all" in proc.stderr, proc.stderr  # a configuration


def test_keras_first_step_configurations():
  """Each configuration name of keras_first_step.py maps to what it says
  (kfac_no_noise once fell through to the kfac_blocksB branch and crashed
  on int("se")), every one of them builds a Kfac, and a name that is none
  is refused."""
  sys.path.insert(0, str(BENCHMARKS))
  try:
    import keras_first_step as kfs  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.remove(str(BENCHMARKS))
  import keras  # pylint: disable=g-import-not-at-top
  import kfac.keras as kfac_keras  # pylint: disable=g-import-not-at-top
  assert kfs.kfac_kwargs("kfac") == {}
  assert kfs.kfac_kwargs("kfac_noise") == dict(noise_scale_steps=5)
  assert kfs.kfac_kwargs("kfac_no_noise") == dict(noise_scale_steps=0,
                                                  noise_scale_every=0)
  assert kfs.kfac_kwargs("kfac_calibrate_all") == dict(
      num_calibration_steps=5)
  assert kfs.kfac_kwargs("kfac_blocks512") == dict(factor_block_size=512)
  for bad in ("adam", "kfac_blocks", "kfac_blocksx", "kfac_se", "sgd"):
    assert kfs.kfac_kwargs(bad) is None, bad
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  for name in list(kfs.KFAC_CONFIGS) + ["kfac_blocks512"]:
    kfac_keras.optimizers.Kfac(model=model, loss=loss, adaptive=True,
                               **kfs.kfac_kwargs(name))


def test_batched_blocks_cost_forms_agree_and_tables(tmp_path):
  """batched_blocks_cost.py: the per-block and the batched preconditioning
  both equal A^-1 G B^-1 / 2 computed in numpy (float64) for blocks of
  repeated and unique shapes; the zoo's transformers give the Kronecker
  blocks counted by hand (the ViT: patch conv, 2 x 2 MLP layers, head = 6;
  the GPT: 2 x 2 MLP layers, head = 5; MultiHeadAttention's EinsumDense
  projections are not Dense); the program writes its JSON and table."""
  import numpy as np
  sys.path.insert(0, str(BENCHMARKS))
  try:
    import batched_blocks_cost as bbc  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.remove(str(BENCHMARKS))
  shapes = [(3, 4), (5, 2), (3, 4), (3, 4), (5, 2), (2, 7)]
  per_block, batched, groups, (a_inv, b_inv, grads) = bbc.build_forms(
      shapes, seed=3)
  assert groups == 3
  for k, ((i, o), x, y) in enumerate(zip(shapes, per_block(), batched())):
    want = (a_inv[k].astype(np.float64) @ grads[k].reshape(i, o).astype(
        np.float64) @ b_inv[k].astype(np.float64) / 2).ravel()
    np.testing.assert_allclose(x.numpy(), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-6)
  out = _run("batched_blocks_cost.py",
             ["--models=vit,gpt", "--rounds=1", "--calls=1"], tmp_path)
  with open(tmp_path / "batched_blocks_cost.json") as f:
    written = json.load(f)
  rows = {r["model"]: r for r in written["rows"]}
  assert rows["vit"]["blocks"] == 6 and rows["gpt"]["blocks"] == 5, rows
  for r in rows.values():
    assert r["cpu_ms_per_block"] > 0 and r["cpu_ms_batched"] > 0
    assert r["ops_batched_form"] < r["ops_per_block_form"], r
  table = (tmp_path / "batched_blocks_cost.md").read_text()
  assert "| vit | 6 |" in table and "| gpt | 5 |" in table, out
  assert written["tables"]["cost"] == table  # what docs render from


def test_critical_batch_fit_and_tiny_sweep(tmp_path):
  """critical_batch.py: McCandlish et al.'s fit recovers S_min and B_noise
  from exact points (0.5 %, its grid's resolution being 0.3 %) and needs 3;
  a tiny sweep (the tiny CNN at batches 32 and 64, K-FAC's default recipe
  once and Adam's grid scaled by sqrt(B / 256) per batch, step budgets
  8 * sqrt(256 / B); ~1 CPU-minute) writes every run with its evaluations,
  each stopping at its first validation at the target (else at its
  budget), the table and the plot; a second invocation at batch 128 merges with
  --add_results, and a run present twice is refused. Then
  large_batch_projection.py on the first sweep at global batch 64 on 2 and 4
  workers: each run that reached the target projected to steps * (compute
  at the per-worker batch + ring all-reduces), recomputed here, the step
  times cached and not measured again."""
  # (batch_scaling, not critical_batch: a module defining absl flags cannot
  # be imported next to another benchmark defining the same ones)
  sys.path.insert(0, str(BENCHMARKS))
  try:
    import batch_scaling  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.remove(str(BENCHMARKS))
  points = [(b, 100.0 * (1 + 1000.0 / b)) for b in (256, 1024, 4096, 8192)]
  s_min, b_noise = batch_scaling.fit_critical_batch(points)
  assert s_min == pytest.approx(100.0, rel=5e-3)
  assert b_noise == pytest.approx(1000.0, rel=5e-3)
  assert batch_scaling.fit_critical_batch(points[:2]) is None

  common = ["--size=tiny", "--workloads=cnn", "--optimizers=kfac,adam",
            "--max_steps=8", "--evals=4", "--train_examples=512",
            "--val_examples=256", "--targets=cnn=0.15"]
  first = tmp_path / "first"
  _run("critical_batch.py", common + ["--batches=32,64"], first)
  data = json.loads((first / "critical_batch.json").read_text())
  runs = data["runs"]
  assert data["targets"]["cnn"] == 0.15
  assert sorted((r["batch"], r["optimizer"], r["value"]) for r in runs
                if r["optimizer"] == "adam") == sorted(
                    (b, "adam", float("%.4g" % (v * math.sqrt(b / 256.0))))
                    for b in (32, 64) for v in (3e-4, 1e-3, 3e-3))
  assert sorted((r["batch"], r["value"]) for r in runs
                if r["optimizer"] == "kfac") == [(32, None), (64, None)]
  for r in runs:
    assert "error" not in r, r
    budget = int(round(8 * math.sqrt(256.0 / r["batch"])))
    every = budget // 4
    steps = [p["step"] for p in r["points"]]
    assert r["step_budget"] == budget and steps[0] == 0, r
    # (validations every `every` steps, and at the step it stopped at)
    assert steps[1:] == sorted(set(range(every, r["steps"] + 1, every)) |
                               {r["steps"]}), r
    # It stops at the first validation reaching the target, else at the
    # budget.
    reached = [p["metric"] >= 0.15 for p in r["points"]]
    if any(reached[1:]):
      assert reached.index(True, 1) == len(reached) - 1, r
    else:
      assert r["steps"] == budget, r
  table = (first / "critical_batch.md").read_text()
  assert "| optimizer | B=32 | B=64 | S_min |" in table, table
  assert "\n| kfac / best peer | " in table, table
  _png(first / "critical_batch.png")

  second = tmp_path / "second"
  _run("critical_batch.py", common + [
      "--batches=128", "--optimizers=kfac",
      "--add_results=%s" % (first / "critical_batch.json")], second)
  table = (second / "critical_batch.md").read_text()
  assert "| optimizer | B=32 | B=64 | B=128 | S_min |" in table, table
  proc = subprocess.run(
      [sys.executable, str(BENCHMARKS / "critical_batch.py"),
       "--output_dir=%s" % (tmp_path / "third")] + common + [
           "--batches=32", "--optimizers=kfac",
           "--add_results=%s" % (first / "critical_batch.json")],
      cwd=str(BENCHMARKS), capture_output=True, text=True, timeout=600,
      check=False)
  assert proc.returncode != 0
  assert "which this run has too" in proc.stderr, proc.stderr[-2000:]

  # The projection to W workers at global batch 64 from the first sweep:
  # the step times measured at the per-worker batches (and cached), the
  # projected time = steps * (compute + ring all-reduces), recomputed here.
  times = tmp_path / "step_times.json"
  proj_flags = ["--critical_batch=%s" % (first / "critical_batch.json"),
                "--global_batch=64", "--workers=2,4", "--size=tiny",
                "--time_steps=3", "--train_examples=512",
                "--compute_speedup=1,10", "--step_times=%s" % times]
  out = _run("large_batch_projection.py", proj_flags, tmp_path / "proj")
  assert "measuring" in out
  proj = json.loads((tmp_path / "proj" /
                     "large_batch_projection.json").read_text())
  cache = json.loads(times.read_text())
  reached = {o for (o, b), (s, _) in batch_scaling.best_runs(
      runs, "cnn", 0.15).items() if b == 64 and s}
  assert reached and {r["optimizer"] for r in proj["projections"]["1"]} == (
      reached)
  bw, lat = 25e9 / 8, 10e-6
  for speedup in ("1", "10"):
    for r in proj["projections"][speedup]:
      for w in (2, 4):
        key = "cnn/%s/%s/%d" % (r["optimizer"], "default" if r["value"] is
                                None else "%.6g" % r["value"], 64 // w)
        t = cache[key]
        comm = batch_scaling.ring_allreduce_s(4.0 * t["parameters"], w, lat,
                                              bw)
        if r["optimizer"] == "kfac":
          assert t["statistics_elements"] > t["parameters"], t
          # (the default recipe's statistics: every 2 steps)
          comm += batch_scaling.ring_allreduce_s(
              4.0 * t["statistics_elements"], w, lat, bw) / 2
          comm += batch_scaling.ring_allreduce_s(32.0, w, lat, bw)
        want = r["steps"] * (t["ms_per_step_cpu"] / 1e3 / float(speedup) +
                             comm)
        assert r["by_w"][str(w)][0] == pytest.approx(want, rel=1e-9), r
  text = (tmp_path / "proj" / "large_batch_projection.md").read_text()
  assert "| W=2 | W=4 |" in text and "compute 10x" in text, text
  _png(tmp_path / "proj" / "large_batch_projection.png")
  # Rerun: every step time from the cache, nothing measured.
  out = _run("large_batch_projection.py", proj_flags, tmp_path / "proj2")
  assert "measuring" not in out


def test_multiworker_step_time_quick(tmp_path):
  """multiworker_step_time.py --quick on 1 and 2 localhost workers: a row
  per (workload, optimizer, W) with the step and compute times, K-FAC
  sending its statistics besides the gradients Adam sends, nothing sent on
  one worker, the fitted all-reduce line, the model's prediction (compute +
  collectives x latency + bytes / bandwidth), the table and the plot."""
  _run("multiworker_step_time.py", ["--quick", "--workers=1,2"], tmp_path)
  data = json.loads((tmp_path / "multiworker_step_time.json").read_text())
  rows = data["rows"]
  assert sorted((r["workload"], r["optimizer"], r["workers"]) for r in rows
               ) == sorted((w, o, n) for w in ("autoencoder", "convnet")
                           for o in ("kfac", "adam") for n in (1, 2))
  fit = data["fits"]["2"]
  assert fit["latency_s"] >= 0 and fit["bytes_per_s"] > 0, fit
  for r in rows:
    assert r["ms_step"] > 0 and r["ms_compute"] > 0, r
    assert r["global_batch"] == 128 * r["workers"], r
    if r["workers"] == 1:
      assert r["bytes"] == 0 and r["ms_predicted"] == r["ms_compute"], r
    else:
      want = r["ms_compute"] + 1e3 * (
          r["collectives"] * fit["latency_s"] +
          r["bytes"] / fit["bytes_per_s"])
      assert r["ms_predicted"] == pytest.approx(want, rel=1e-9), r
  for w in ("autoencoder", "convnet"):
    kfac, adam = [[r for r in rows if r["workload"] == w and
                   r["optimizer"] == o and r["workers"] == 2][0]
                  for o in ("kfac", "adam")]
    assert kfac["grad_elements"] == adam["grad_elements"]
    assert kfac["bytes"] == 4 * (kfac["stat_elements"] +
                                 kfac["grad_elements"]) > adam["bytes"] == (
                                     4 * adam["grad_elements"])
  table = (tmp_path / "multiworker_step_time.md").read_text()
  assert "| workers | all-reduce latency (ms) | bandwidth (MB/s) |" in table
  _png(tmp_path / "multiworker_step_time.png")


def test_conv_statistics_cost_writes_its_tables(tmp_path):
  """conv_statistics_cost.py on a tiny convolution: every piece timed, the
  full KFC statistic's patch matrix counted at N * L rows of K * K * C
  floats, and the JSON's tables (what docs/convolutions.md renders) equal
  to the .md it writes."""
  out = _run("conv_statistics_cost.py",
             ["--batch=4", "--side=8", "--channels=4", "--repeats=1",
              "--warmup=1"], tmp_path)
  with open(tmp_path / "conv_statistics_cost.json") as f:
    written = json.load(f)
  assert len(written["ms"]) == 11 and all(
      v > 0 for v in written["ms"].values()), written["ms"]
  patches = [v for k, v in written["bytes"].items()
             if k.startswith("patch matrix")]
  assert patches == [4 * 8 * 8 * 9 * 4 * 4], written["bytes"]
  text = (tmp_path / "conv_statistics_cost.md").read_text()
  tables = written["tables"]
  assert text == "\n\n".join(
      (tables["machine"], tables["cost"], tables["memory"])) + "\n"
  assert "| **statistics update, kron (A + G)** |" in tables["cost"], out
