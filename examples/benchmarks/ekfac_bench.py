r"""EKFAC against K-FAC: time to a target loss, and the cost of the scalings.

Two parts (--parts=optimizer,scalings), written as markdown tables
(ekfac_bench.md, and one table per workload), JSON (ekfac_bench.json) and
PNG plots to --output_dir, and printed.

1. optimizer: EKFAC and K-FAC as the optimiser on the workloads of
   workloads.py (deep autoencoder, convnet, RNN). Both runs are
   time_to_target.py's `kfac` run (PeriodicInvCovUpdateKfacOpt in a TF1
   Session graph with its tuned hyperparameters, time_to_target.DEFAULTS and
   KFAC_COMMON) from the same initial weights on the same mini-batches with
   the same training-time budget, taking turns every --chunk_steps steps
   (examples/side_by_side.py) so that machine noise slows both alike. Only
   the registration's approximation differs: the EKFAC run's
   LayerCollection registers every dense, convolution and multi-use (RNN)
   layer with --ekfac_approx ("ekfac": the K-FAC-expand / KFC / kron_indep
   eigenbasis) instead of the defaults (kron, kron, kron_indep).
   The convnet of time_to_target.py sub-samples the convolutions' patches
   for its input factors (`sub_sample_patches`, a kron-only option that
   EKFAC does not accept); here both compared runs use all patches, and with
   --convnet_reference time_to_target's K-FAC with sub-sampled patches runs
   alongside them as a third curve (not part of the ratios).
   Equal damping is not equal regularisation: EKFAC adds the damping to
   its scalings, K-FAC adds pi-split multiples of its square root to both
   factors (cross terms included), which is more. So EKFAC runs at K-FAC's
   tuned damping times each of --ekfac_damping_scales (default 1 and 10;
   run names "ekfac", "ekfac_x10"), all taking turns, and the one with the
   lowest final loss is compared with K-FAC (EKFAC tuned on a small grid,
   K-FAC on time_to_target's).
   Target: the higher of the two compared runs' final losses (both reach
   it; none when a run ended at or above the initial loss); the tables give
   the training seconds and steps until each run's evaluation loss first
   reached it, ms/step, and the EKFAC / K-FAC ratios.
   Losses are evaluated like time_to_target.py's (a fixed subset of the
   training set every --eval_every steps; evaluation is not training time).
   --ekfac_damping replaces K-FAC's damping as the base of the grid.

2. scalings: the cost of EKFAC's eigen-correction statistic
   (`EigenCorrectionFactor._compute_new_cov()`: rotate the layer's inputs
   and output gradients into the eigenbasis and form the second moments of
   the per-example gradients) against batch size N, layer width and the
   number of positions P over which the weights are shared, for the
   "per_example" and "gramian" strategies (ekfac/scalings.py), on a
   weight-shared dense layer (inputs [N, P, width] -> [N, P, width]) and on
   a 3x3 convolution (P = the image's locations). Next to it: the K-FAC
   factor statistics of the same layer (its input and output factors'
   `_compute_new_cov()`), and the forward pass with the backward pass to the
   layer's outputs alone (which every statistic includes). Each statistic
   runs in its own tf.function (TF2), after a statistics update and a basis
   refresh; the times are medians over --reps calls, the functions of one
   layer taking turns call by call. The tables also give each strategy's
   intermediate memory per example (scalings.memory_per_example, float32)
   and which strategy "auto" picks for the layer. Strategies whose
   intermediate tensor would exceed --max_intermediate_mib are skipped.

  python examples/benchmarks/ekfac_bench.py                    # ~14 min
  python examples/benchmarks/ekfac_bench.py --parts=scalings    # ~1.5 min
  python examples/benchmarks/ekfac_bench.py --workloads=rnn --seconds=30
  python examples/benchmarks/ekfac_bench.py --parts=optimizer \
      --workloads=autoencoder --ekfac_damping=100
  python examples/benchmarks/ekfac_bench.py --quick             # tiny, checks

The flags of time_to_target.py and side_by_side.py apply (--seconds,
--workloads, --dataset, --eval_every, --chunk_steps, --seed, ...); its
--tune, --optimizers and K-FAC/Adam hyperparameter flags do not.
"""

import collections
import contextlib
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
# time_to_target's helpers and the factors' statistics are private:
# pylint: disable=protected-access
from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
import convnet_model
import side_by_side
# time_to_target defines the side-by-side flags (--seconds, --dataset,
# --eval_every, --chunk_steps, --seed, ...) and --output_dir, --workloads.
import time_to_target
import workloads as workloads_lib

import kfac
from kfac.python.ops.ekfac import scalings as scalings_lib

FLAGS = flags.FLAGS

flags.DEFINE_list("parts", ["optimizer", "scalings"], "Which parts to run.")
flags.DEFINE_bool("quick", False, "Tiny settings that check that everything "
                  "runs: digits, 20 steps per run, small layers, 2 reps.")
flags.DEFINE_enum("ekfac_approx", "ekfac", ["ekfac", "ekfac_reduce"],
                  "The EKFAC run's approximation of the dense and "
                  "convolution layers (multi-use layers: always 'ekfac').")
flags.DEFINE_enum("ekfac_strategy", "auto", list(scalings_lib.STRATEGIES),
                  "LayerCollection.ekfac_strategy of the EKFAC run.")
flags.DEFINE_list("ekfac_damping_scales", ["1", "10"],
                  "EKFAC runs at these multiples of the damping (K-FAC's "
                  "tuned one, or --ekfac_damping); the best final loss is "
                  "compared with K-FAC.")
flags.DEFINE_float("ekfac_damping", None, "The EKFAC run's damping (default: "
                   "K-FAC's tuned one; EKFAC adds it to the scalings, K-FAC "
                   "splits it between its two factors).")
flags.DEFINE_bool("convnet_reference", True, "Also run time_to_target's "
                  "K-FAC with sub-sampled patches on the convnet.")
flags.DEFINE_integer("reps", 11, "Timed calls per statistic (median).")
flags.DEFINE_list("scaling_base", ["128", "16", "128"], "The dense layer's "
                  "base point: batch N, positions P, width.")
flags.DEFINE_list("scaling_batches", ["32", "64", "128", "256", "512"],
                  "Batch sizes of the dense sweep (P, width at the base).")
flags.DEFINE_list("scaling_positions", ["1", "2", "4", "8", "16", "32", "64"],
                  "Positions of the dense sweep (N, width at the base).")
flags.DEFINE_list("scaling_widths", ["32", "64", "128", "256", "512"],
                  "Widths of the dense sweep (N, P at the base).")
flags.DEFINE_list("conv_sides", ["4", "8", "16", "32"], "Image sides of the "
                  "convolution sweep (P = side^2 locations).")
flags.DEFINE_integer("conv_batch", 32, "Batch of the convolution sweep.")
flags.DEFINE_integer("conv_channels", 16, "Input and output channels of the "
                     "3x3 convolution.")
flags.DEFINE_float("max_intermediate_mib", 1024.0, "Skip a strategy whose "
                   "intermediate tensor would be larger (MiB).")

# Training-time budget per run (--seconds overrides): about 10 minutes for
# the part with the convnet reference, on 2 CPU cores.
SECONDS = {"autoencoder": 90.0, "convnet": 60.0, "rnn": 60.0}
STRATEGIES = ("per_example", "gramian")
_CLASSES = 10


# ------------------------------------------------------------------ part 1
class ConvnetAllPatches(workloads_lib.Convnet):
  """workloads.py's convnet with every patch in the input factors (EKFAC's
  convolution blocks take no `sub_sample_patches`)."""

  def forward(self, x, variables, layer_collection=None):
    return convnet_model.forward(x, variables, layer_collection,
                                 sub_sample_patches=None)


@contextlib.contextmanager
def _collections(approx, strategy, made):
  """While active, kfac.LayerCollection() (which time_to_target's backends
  call while they build their graphs) makes a collection whose default
  dense, conv2d and multi-use approximation is `approx` (None: the
  library's defaults) and whose ekfac_strategy is `strategy`; each one is
  appended to `made`."""
  original = kfac.LayerCollection

  class Collection(original):

    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      if approx is not None:
        self.set_default_fully_connected_approximation(approx)
        self.set_default_conv2d_approximation(approx)
        self.set_default_fully_connected_multi_approximation("ekfac")
      self.ekfac_strategy = strategy
      made.append(self)

  kfac.LayerCollection = Collection
  try:
    yield
  finally:
    kfac.LayerCollection = original


def _runs(name):
  """(run name, approximation or None, workload) of a workload's runs; the
  first two are the compared pair."""
  small = FLAGS.dataset == "digits"
  workload = workloads_lib.get(name, small=small)
  if name == "convnet":
    workload, reference = ConvnetAllPatches(), workload
  runs = [("kfac", None, workload)]
  runs.extend((ekfac_run_name(scale), FLAGS.ekfac_approx, workload)
              for scale in _damping_scales())
  if name == "convnet" and FLAGS.convnet_reference:
    runs.append(("kfac_subsampled", None, reference))
  return runs


def _damping_scales():
  return [float(s) for s in FLAGS.ekfac_damping_scales]


def ekfac_run_name(scale):
  """"ekfac" at K-FAC's damping, "ekfac_x10" at 10 times it, ..."""
  return "ekfac" if scale == 1 else "ekfac_x%g" % scale


def _describe_blocks(collection):
  counts = collections.Counter(type(b).__name__
                               for b in collection.get_blocks())
  return ", ".join("%d %s" % (c, n) for n, c in sorted(counts.items()))


def compare(name, data, out_dir):
  """Trains the runs of workload `name` side by side; returns its rows."""
  runs = _runs(name)
  workload = runs[0][2]
  batch_size = min(FLAGS.batch_size or workload.batch_size, len(data))
  params_np = workload.init_params(data, FLAGS.seed)
  eval_batch = time_to_target._eval_batch(data)
  batches = side_by_side.Batches(len(data), batch_size, FLAGS.seed)
  seconds = FLAGS.seconds or SECONDS[name]
  hyper = time_to_target.DEFAULTS[name]["kfac"]
  print("\n== %s: %s, batch %d, %.0f s per run, %s ==" % (
      name, workload.describe(data), batch_size, seconds,
      time_to_target._format_hyper(hyper)), flush=True)
  trainers, info = [], {}
  for run, approx, run_workload in runs:
    run_hyper = hyper
    if approx is not None:
      scale = dict((ekfac_run_name(x), x) for x in _damping_scales())[run]
      damping = (FLAGS.ekfac_damping if FLAGS.ekfac_damping is not None
                 else hyper["damping"])
      run_hyper = dict(hyper, damping=damping * scale)
    made = []
    with _collections(approx, FLAGS.ekfac_strategy, made):
      backend = time_to_target.SessionBackend(
          "kfac", run_hyper, run_workload, data, params_np, eval_batch)
    blocks = made[0].get_blocks()
    info[run] = dict(
        hyper=time_to_target._format_hyper(run_hyper),
        blocks=len(blocks),
        ekfac_blocks=sum(bool(getattr(b, "is_ekfac", False)) for b in blocks),
        block_types=_describe_blocks(made[0]),
        sub_sampled_patches=(name == "convnet" and not isinstance(
            run_workload, ConvnetAllPatches)))
    print("  %s: %s" % (run, info[run]["block_types"]), flush=True)
    trainers.append(side_by_side.Trainer(run, backend, batches, seconds,
                                         record_shown=True))
  histories = side_by_side.run_in_turns(trainers, FLAGS.chunk_steps)
  rows = _summarise(name, histories, info)
  table = _workload_table(name, workload, data, batch_size, seconds, rows)
  print("\n" + table, flush=True)
  with open(os.path.join(out_dir, "ekfac_%s.md" % name), "w") as f:
    f.write(table + "\n")
  side_by_side.write_results(
      os.path.join(out_dir, "ekfac_%s.json" % name), histories,
      workload=name, dataset=data.name, batch_size=batch_size,
      seconds=seconds, hyperparameters=hyper, runs_info=info)
  for axis in ("steps", "seconds"):
    side_by_side.plot_histories(
        histories, os.path.join(out_dir, "ekfac_%s_loss_vs_%s.png" % (
            name, axis)), axis, workload.eval_loss_name(),
        log_y=name == "autoencoder",
        title="EKFAC vs K-FAC: %s (%s)" % (name, data.name))
  return rows


def best_ekfac(histories):
  """The EKFAC run (of the damping grid) with the lowest final loss."""
  runs = [h for h in histories if h.name.startswith("ekfac")]
  finite = [h for h in runs if np.isfinite(h.final_loss)]
  return min(finite, key=lambda h: h.final_loss) if finite else runs[0]


def _summarise(name, histories, info):
  pair = [histories[0], best_ekfac(histories)]
  finals = [h.final_loss for h in pair if np.isfinite(h.final_loss)]
  target = max(finals) if finals else float("nan")
  if not target < min(h.losses[0] for h in pair):
    target = float("nan")  # a run ended above the start: no common target
  rows = []
  for h in histories:
    rows.append(dict(
        workload=name, name=h.name, compared=any(h is p for p in pair),
        steps=h.steps[-1],
        seconds=h.seconds[-1],
        ms_per_step=1e3 * h.seconds[-1] / max(h.steps[-1], 1),
        initial_loss=h.losses[0], final_loss=h.final_loss, target=target,
        seconds_to_target=h.seconds_to_reach(target),
        steps_to_target=h.steps_to_reach(target), **info[h.name]))
  return rows


def _fmt(value, fmt):
  return time_to_target._fmt(value, fmt)


def _ratio(a, b):
  if a is None or b is None or not b or not (np.isfinite(a) and
                                              np.isfinite(b)):
    return None
  return a / b


def _workload_table(name, workload, data, batch_size, seconds, rows):
  lines = [
      "### %s: %s" % (name, workload.describe(data)), "",
      "%s training images: %d, batch %d, %.0f s of training per run; "
      "target loss %s." % (
          data.name, len(data), batch_size, seconds,
          "%.4g (the higher final loss of kfac and ekfac)" % rows[0]["target"]
          if np.isfinite(rows[0]["target"]) else "none (a run ended at or "
          "above the initial loss)"), "",
      "| run | hyperparameters | blocks | steps | ms/step | final loss | "
      "seconds to target | steps to target |",
      "|---|---|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append("| %s | %s | %s%s | %d | %.1f | %.4g | %s | %s |" % (
        r["name"], r["hyper"], r["block_types"],
        ", sub-sampled patches" if r["sub_sampled_patches"] else "",
        r["steps"], r["ms_per_step"], r["final_loss"],
        _fmt(r["seconds_to_target"], "%.1f"),
        "-" if r["steps_to_target"] is None else str(r["steps_to_target"])))
  return "\n".join(lines)


def summary_table(rows):
  """Per workload: the compared pair's results and EKFAC / K-FAC ratios."""
  lines = ["| workload | target | K-FAC s (steps) to target | EKFAC s (steps) "
           "to target | EKFAC / K-FAC time to target | EKFAC / K-FAC steps "
           "to target | K-FAC ms/step | EKFAC ms/step | EKFAC / K-FAC "
           "ms/step | final loss K-FAC | final loss EKFAC |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for workload in dict.fromkeys(r["workload"] for r in rows):
    by = {r["name"]: r for r in rows if r["workload"] == workload}
    k = by["kfac"]
    e = [r for r in by.values() if r["compared"] and r is not k][0]

    def reach(r):
      if r["seconds_to_target"] is None:
        return "not reached"
      return "%.1f (%d)" % (r["seconds_to_target"], r["steps_to_target"])

    lines.append("| %s | %s | %s | %s | %s | %s | %.1f | %.1f | %s | %.4g "
                 "| %.4g |" % (
                     workload, _fmt(k["target"], "%.4g"), reach(k),
                     "%s: %s" % (e["name"], reach(e)),
                     _fmt(_ratio(e["seconds_to_target"],
                                 k["seconds_to_target"]), "%.2fx"),
                     _fmt(_ratio(e["steps_to_target"],
                                 k["steps_to_target"]), "%.2fx"),
                     k["ms_per_step"], e["ms_per_step"],
                     _fmt(_ratio(e["ms_per_step"], k["ms_per_step"]),
                          "%.2fx"), k["final_loss"], e["final_loss"]))
  return "\n".join(lines)


def optimizer_part(out_dir):
  rows, cache = [], {}
  for name in FLAGS.workloads:
    kind = "autoencoder" if name == "autoencoder" else "images"
    if kind not in cache:
      cache[kind] = workloads_lib.get(name).load(FLAGS.dataset,
                                                 FLAGS.max_examples)
    rows.extend(compare(name, cache[kind], out_dir))
  return rows


# ------------------------------------------------------------------ part 2
class LayerCase(object):
  """One weight-shared layer with an EKFAC registration, its estimator
  state, and one tf.function per timed statistic.

  kind "dense": inputs [N, P, width] -> [N, P, width] (shared weights
  [width + 1, width] with the bias); kind "conv": images [N, side, side, C]
  -> 3x3 SAME convolution to C channels (P = side^2). A mean over the
  positions and a dense layer give 10 logits; the loss is the softmax
  cross-entropy with fixed random labels, and the statistics use the
  "empirical" mode (the labels' gradients: deterministic, so the two
  strategies' scalings can be compared; the sampled mode costs the same).
  """

  def __init__(self, kind, batch, positions, width, seed):
    rng = np.random.RandomState(seed)
    self.kind, self.batch = kind, batch
    if kind == "dense":
      self.positions, self.width = positions, width
      x = rng.randn(batch, positions, width)
      w = rng.randn(width, width) / np.sqrt(width)
      self.rows, self.cols = width + 1, width
    else:
      side = int(round(np.sqrt(positions)))
      self.positions, self.width = side * side, width
      x = rng.randn(batch, side, side, width)
      w = rng.randn(3, 3, width, width) / np.sqrt(9 * width)
      self.rows, self.cols = 9 * width + 1, width
    self.x = tf.constant(x.astype(np.float32))
    self.labels = tf.constant(rng.randint(0, _CLASSES, batch))
    self.params = [tf.Variable(w.astype(np.float32)),
                   tf.Variable(np.zeros(width, np.float32)),
                   tf.Variable((rng.randn(width, _CLASSES) /
                                np.sqrt(width)).astype(np.float32)),
                   tf.Variable(np.zeros(_CLASSES, np.float32))]
    self.store = kfac.state.StateStore("ekfac_bench_%s_%d_%d_%d" % (
        kind, batch, positions, width))
    self.auto = None

  def describe(self):
    if self.kind == "dense":
      return "dense [%d, %d, %d] -> %d" % (self.batch, self.positions,
                                           self.width, self.width)
    side = int(round(np.sqrt(self.positions)))
    return "conv 3x3 [%d, %d, %d, %d] -> %d" % (self.batch, side, side,
                                                self.width, self.width)

  def _forward(self, lc, strategy):
    """(EKFAC block, loss, layer outputs) with the layer registered on a
    new collection `lc` (ekfac_strategy `strategy`)."""
    w, b, w_out, b_out = self.params
    lc.ekfac_strategy = strategy
    if self.kind == "dense":
      pre = tf.einsum("npi,ij->npj", self.x, w) + b
      lc.register_fully_connected((w, b), self.x, pre, approx="ekfac")
      axes = [1]
    else:
      pre = tf.nn.conv2d(self.x, w, strides=1, padding="SAME") + b
      lc.register_conv2d((w, b), 1, "SAME", self.x, pre, approx="ekfac")
      axes = [1, 2]
    h = tf.reduce_mean(tf.tanh(pre), axis=axes)
    logits = tf.matmul(h, w_out) + b_out
    lc.register_fully_connected((w_out, b_out), h, logits, approx="kron")
    lc.register_softmax_cross_entropy_loss(logits, targets=self.labels)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=self.labels, logits=logits))
    return lc, loss, pre

  def _estimator(self, strategy):
    lc, loss, pre = self._forward(kfac.LayerCollection(), strategy)
    est = kfac.estimator.FisherEstimator(
        variables=self.params, cov_ema_decay=0.95, damping=1e-3,
        layer_collection=lc, estimation_mode="empirical",
        state_store=self.store)
    est.instantiate_variables()  # makes the factors; reuses the store's
    block = [blk for blk in est.blocks if getattr(blk, "is_ekfac", False)][0]
    return est, block, loss, pre

  def refresh(self):
    """Two rounds of a statistics update followed by a basis refresh (in a
    tf.function: its stateful ops run in program order), so that the
    scalings have a basis; records the strategy "auto" picks."""
    def update():
      est, block, _, _ = self._estimator("auto")
      est.make_vars_and_create_ops()
      self.auto = block.correction_factor.chosen_strategy()

    def ready():
      _, block, _, _ = self._estimator("auto")
      return block.correction_factor.basis_ready()
    refresh = tf.function(update, autograph=False)
    refresh()
    refresh()
    if not bool(tf.function(ready, autograph=False)()):
      raise RuntimeError("no eigenbasis after the refresh of %s" %
                         self.describe())

  def functions(self):
    """{column: tf.function} of the timed statistics."""
    def backward():
      _, _, loss, pre = self._estimator("auto")
      return tf.reduce_sum(tf.gradients(loss, pre)[0])

    def kfac_statistics():
      _, block, _, _ = self._estimator("auto")
      a, g = block.correction_factor.basis_factors
      return a._compute_new_cov(), g._compute_new_cov()

    def scalings(strategy):
      _, block, _, _ = self._estimator(strategy)
      return block.correction_factor._compute_new_cov()

    fns = collections.OrderedDict(
        backward=backward, kfac_statistics=kfac_statistics)
    for strategy in STRATEGIES:
      if self.intermediate_mib(strategy) <= FLAGS.max_intermediate_mib:
        fns[strategy] = lambda s=strategy: scalings(s)
    return collections.OrderedDict(
        (k, tf.function(f, autograph=False)) for k, f in fns.items())

  def strategy_for(self, strategy):
    return scalings_lib.choose_strategy(self.positions, self.rows, self.cols,
                                        strategy)

  def memory_per_example(self, strategy):
    """Entries of the intermediate tensor per example (float32)."""
    return scalings_lib.memory_per_example(self.strategy_for(strategy),
                                           self.positions, self.rows,
                                           self.cols)

  def intermediate_mib(self, strategy):
    return self.batch * self.memory_per_example(strategy) * 4 / 2.0**20


def _median_times(fns, reps):
  """{name: median ms} of the functions, taking turns call by call, after
  two warm-up calls each (the first traces); and {name: last result}."""
  results = {}
  for name, fn in fns.items():
    for _ in range(2):
      results[name] = tf.nest.map_structure(lambda t: t.numpy(), fn())
  times = {name: [] for name in fns}
  for _ in range(reps):
    for name, fn in fns.items():
      start = time.perf_counter()
      results[name] = tf.nest.map_structure(lambda t: t.numpy(), fn())
      times[name].append(time.perf_counter() - start)
  return {k: 1e3 * float(np.median(v)) for k, v in times.items()}, results


def measure(case, reps):
  case.refresh()
  ms, results = _median_times(case.functions(), reps)
  row = dict(kind=case.kind, layer=case.describe(), batch=case.batch,
             positions=case.positions, width=case.width, rows=case.rows,
             cols=case.cols, auto=case.auto, backward_ms=ms["backward"],
             kfac_statistics_ms=ms["kfac_statistics"])
  for strategy in STRATEGIES:
    row["%s_strategy" % strategy] = case.strategy_for(strategy)
    row["%s_memory" % strategy] = case.memory_per_example(strategy)
    row["%s_ms" % strategy] = ms.get(strategy)
  timed = [s for s in STRATEGIES if row["%s_ms" % s] is not None]
  row["fastest"] = min(timed, key=lambda s: row["%s_ms" % s])
  if len(timed) == 2:
    a, b = (np.asarray(results[s]) for s in STRATEGIES)
    row["strategies_max_rel_diff"] = float(
        np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-30))
  else:
    row["strategies_max_rel_diff"] = None
  print("scalings  %-34s auto %-11s backward %7.1f  K-FAC A+G %7.1f  "
        "per_example %s  gramian %s ms" % (
            row["layer"], row["auto"], row["backward_ms"],
            row["kfac_statistics_ms"], _fmt(row["per_example_ms"], "%7.1f"),
            _fmt(row["gramian_ms"], "%7.1f")), flush=True)
  return row


def _ints(values):
  return [int(v) for v in values]


def scalings_part():
  """Rows {sweep, ...} of the dense sweeps (batch, width, positions) and the
  convolution sweep."""
  # Every layer makes new tf.functions (on purpose): no retracing warnings.
  tf.get_logger().setLevel("ERROR")
  base_n, base_p, base_w = _ints(FLAGS.scaling_base)
  sweeps = [("batch", [("dense", n, base_p, base_w)
                       for n in _ints(FLAGS.scaling_batches)]),
            ("width", [("dense", base_n, base_p, w)
                       for w in _ints(FLAGS.scaling_widths)]),
            ("positions", [("dense", base_n, p, base_w)
                           for p in _ints(FLAGS.scaling_positions)]),
            ("conv", [("conv", FLAGS.conv_batch, s * s, FLAGS.conv_channels)
                      for s in _ints(FLAGS.conv_sides)])]
  measured, rows = {}, []
  for sweep, configs in sweeps:
    for config in configs:
      if config not in measured:
        measured[config] = measure(LayerCase(*config, seed=FLAGS.seed),
                                   FLAGS.reps)
      rows.append(dict(measured[config], sweep=sweep))
  return rows


_SWEEP_TITLES = collections.OrderedDict([
    ("batch", "Dense layer, against batch size N"),
    ("width", "Dense layer, against width"),
    ("positions", "Dense layer, against positions P"),
    ("conv", "3x3 convolution, against image size (P = side^2)")])


def _kib(entries):
  return "%.1f" % (entries * 4 / 1024.0)


def scalings_tables(rows):
  parts = []
  for sweep, title in _SWEEP_TITLES.items():
    sweep_rows = [r for r in rows if r["sweep"] == sweep]
    if not sweep_rows:
      continue
    lines = ["### %s" % title, "",
             "| layer (inputs -> outputs) | S shape | forward + backward ms | "
             "K-FAC A+G statistics ms | per_example ms | gramian ms | "
             "fastest | auto picks | auto / K-FAC statistics | "
             "per_example KiB/example | gramian KiB/example |",
             "|---|---|---:|---:|---:|---:|---|---|---:|---:|---:|"]
    for r in sweep_rows:
      auto_ms = r.get("%s_ms" % r["auto"]) if r["auto"] in STRATEGIES else (
          r["per_example_ms"])  # "factored": both strategies run it
      lines.append("| %s | %dx%d | %.1f | %.1f | %s | %s | %s | %s | %s | "
                   "%s | %s |" % (
                       r["layer"], r["rows"], r["cols"], r["backward_ms"],
                       r["kfac_statistics_ms"],
                       _fmt(r["per_example_ms"], "%.1f"),
                       _fmt(r["gramian_ms"], "%.1f"),
                       r["fastest"] if r["auto"] in STRATEGIES else "-",
                       r["auto"], _fmt(_ratio(auto_ms,
                                              r["kfac_statistics_ms"]),
                                       "%.2fx"),
                       _kib(r["per_example_memory"]),
                       _kib(r["gramian_memory"])))
    parts += lines + [""]
  return "\n".join(parts)


def _plot_scalings(rows, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  sweeps = [s for s in _SWEEP_TITLES if any(r["sweep"] == s for r in rows)]
  fig, axes = plt.subplots(1, len(sweeps), figsize=(4.2 * len(sweeps), 3.8),
                           squeeze=False)
  x_key = dict(batch="batch", width="width", positions="positions",
               conv="positions")
  series = (("backward_ms", "forward + backward", ":"),
            ("kfac_statistics_ms", "K-FAC A+G statistics", "--"),
            ("per_example_ms", "scalings, per_example", "-"),
            ("gramian_ms", "scalings, gramian", "-"))
  for ax, sweep in zip(axes[0], sweeps):
    sweep_rows = [r for r in rows if r["sweep"] == sweep]
    x = np.array([r[x_key[sweep]] for r in sweep_rows], dtype=float)
    for key, label, style in series:
      y = np.array([np.nan if r[key] is None else r[key]
                    for r in sweep_rows], dtype=float)
      line, = ax.plot(x, y, style, marker="o", markersize=3, label=label)
      if key.endswith("e_ms") or key == "gramian_ms":
        strategy = key[:-3]
        picked = np.array([r["auto"] == strategy for r in sweep_rows])
        ax.plot(x[picked], y[picked], "o", markersize=9, fillstyle="none",
                color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel({"batch": "batch N", "width": "width",
                   "positions": "positions P",
                   "conv": "locations P"}[sweep])
    ax.set_ylabel("ms")
    ax.set_title(_SWEEP_TITLES[sweep].replace(", against", "\nagainst"),
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
  axes[0][0].legend(fontsize=7, title="circled: auto's pick",
                    title_fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


# ------------------------------------------------------------------ output

def _apply_quick():
  FLAGS.dataset = "digits"
  FLAGS.steps, FLAGS.seconds = 20, 1e6   # a budget in steps
  FLAGS.eval_every, FLAGS.print_seconds = 5, 1e6
  FLAGS.eval_examples = 300
  FLAGS.reps = 2
  # At the base, P^2 (rows + cols) < rows cols: "auto" picks the Gramian.
  FLAGS.scaling_base = ["8", "2", "8"]
  FLAGS.scaling_batches = ["4", "8"]
  FLAGS.scaling_widths = ["4", "16"]
  FLAGS.scaling_positions = ["1", "2", "4"]
  FLAGS.conv_sides, FLAGS.conv_batch, FLAGS.conv_channels = ["2", "4"], 4, 3


def main(argv):
  del argv
  if FLAGS.quick:
    _apply_quick()
  parts = set(FLAGS.parts)
  unknown = parts - {"optimizer", "scalings"}
  if unknown:
    raise app.UsageError("unknown --parts %s" % sorted(unknown))
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  start = time.time()
  print(workloads_lib.machine_line(), flush=True)
  results = dict(machine=workloads_lib.machine_line(), optimizer=[],
                 scalings=[])
  text = ["# EKFAC against K-FAC", "", workloads_lib.machine_line(), ""]
  if "optimizer" in parts:
    results["optimizer"] = optimizer_part(FLAGS.output_dir)
    text += ["## Time to a target loss (the higher of the two final losses)",
             "", summary_table(results["optimizer"]), ""]
    for name in FLAGS.workloads:
      with open(os.path.join(FLAGS.output_dir, "ekfac_%s.md" % name)) as f:
        text += [f.read()]  # ends with a newline: a blank line follows
  if "scalings" in parts:
    results["scalings"] = scalings_part()
    text += ["## Cost of the scalings (eigen-correction) statistic", "",
             "Medians of %d calls (ms), each statistic in its own "
             "tf.function; every column includes the forward pass and the "
             "backward pass to the layer's outputs. Memory: the "
             "strategy's intermediate tensor per example (float32); "
             "'factored' (one position) needs rows + cols." % FLAGS.reps, "",
             scalings_tables(results["scalings"])]
    _plot_scalings(results["scalings"],
                   os.path.join(FLAGS.output_dir, "ekfac_scalings_cost.png"))
  report = "\n".join(text)
  with open(os.path.join(FLAGS.output_dir, "ekfac_bench.md"), "w") as f:
    f.write(report + "\n")
  with open(os.path.join(FLAGS.output_dir, "ekfac_bench.json"), "w") as f:
    json.dump(results, f, indent=1, default=str)
  print("\n" + report)
  print("\ntotal wall time %.0f s" % (time.time() - start))


if __name__ == "__main__":
  app.run(main)
