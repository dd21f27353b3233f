r"""Adaptive K-FAC vs tuned K-FAC and Adam on the K-FAC paper's autoencoder.

The deep autoencoder of Martens & Grosse (2015), 784-1000-500-250-30-250-
500-1000-784 (tanh, linear code layer, sigmoid cross-entropy summed over
pixels and averaged over the batch), on Fashion-MNIST. Every run minimises
the same objective, that loss plus 0.5 * l2_reg * sum(w^2) over all weights
and biases (l2_reg = 1e-5), starting from the same initial weights:

  kfac_adaptive  PeriodicInvCovUpdateKfacOpt with momentum_type="qmodel":
                 the learning rate and momentum are chosen at every step by
                 the exact quadratic model, the damping by the Levenberg-
                 Marquardt rule (adapt_damping=True) after being calibrated
                 during --num_burnin_steps burn-in steps
                 (calibrate_damping=True). Its batch size grows, from
                 --initial_batch_size by a factor --batch_growth per step up
                 to --max_batch_size (kfac.batch_size_schedules on the global
                 step), and its batches come from a
                 kfac.data_reader.CachedDataReader inside its graph: it draws
                 its own batches (a different sequence from the other two
                 runs) from the same training images. --damping_rule=delayed
                 evaluates the rule's "loss after" on the previous step's
                 batch (the reader's cached batch) at the start of the next
                 step; =immediate re-evaluates the step's batch right after
                 its update (one more forward pass on adaptation steps).
  kfac_fixed     PeriodicInvCovUpdateKfacOpt with a fixed learning rate,
                 damping and momentum, fixed batch size.
  adam           tf.compat.v1.train.AdamOptimizer, fixed batch size.

The two fixed-batch runs see the same mini-batches (side_by_side.Batches).
The runs take turns, a few steps each, and their training time is measured
without the evaluation pauses (see side_by_side.py). Losses are the
objective on a fixed subset of the training images; the burn-in steps of
kfac_adaptive (statistics and calibration only, no update) count as steps
and their time as training time.

  python examples/adaptive_autoencoder.py    # Fashion-MNIST, 90 s per run
  python examples/adaptive_autoencoder.py --seconds=150 --output_dir=/tmp/ae
  python examples/adaptive_autoencoder.py --dataset=digits \
      --encoder=48,32,16,8 --seconds=20

Writes loss_vs_steps.png, loss_vs_seconds.png, results.md (the table) and
results.json (the histories, with kfac_adaptive's damping, learning rate,
momentum, rho and batch size at every evaluation) to --output_dir.

Tuning (Fashion-MNIST, 20000 images, the full architecture, each setting
run alone with the other flags at their defaults; 2 shared CPU cores, whose
speed varied by up to 2x with the load of other jobs, so the fixed-batch
runs, whose step cost does not depend on their hyperparameters, are ranked
by the loss at an equal step):

kfac_fixed (batch 1000, momentum 0.9, 60 s): loss at step 150 / at 60 s;
"blew up": above 1000, far above the initial 545.
momentum_type "adam":
  lr \ damping    0.1        1          10         100
  0.03          blew up    264 / 260  250 / 245  324 / 299
  0.1           blew up    620 / 523  234 / 225  275 / 269
  0.3           blew up    blew up    261 / 248  246 / 234
  1             blew up    blew up    blew up    239 / 226
momentum_type "regular" (pruned: lr 1, and damping 0.1 but for lr 0.03):
  0.03          blew up    646 / 734  262 / 241  315 / 285
  0.1           -          1128 / 949 242 / 229  269 / 247
  0.3           -          blew up    382 / 382  251 / 236
Winner: "adam", lr 0.1, damping 10 (lr 1, damping 100 is nearly as good:
with a large damping only lr / damping matters).

adam (batch 1000, 60 s): loss at step 400 / at 60 s:
  lr 3e-4: 232 / 225;  1e-3: 226 / 216;  3e-3: 235 / 225;  1e-2: 389 / 399.
Winner: 1e-3.

kfac_adaptive (90 s budget): loss at step 150 / at 90 s (steps).
  damping rule  growth  initial damping  calibrated to  loss
  delayed       1.02    0.1              1.78           202.7 / 199.3 (210)
  delayed       1.02    1                10             205.1 / 200.4 (211)
  delayed       1.02    10               10             204.9 / 200.5 (210)
  immediate     1.02    0.1              1.78           202.7 / 201.1 (173)
  immediate     1.02    1                10             205.1 / 201.9 (187)
  immediate     1.02    10               10             205.1 / 200.2 (214)
  delayed       1.01    0.1              10             207.7 / 199.1 (261)
  delayed       1.01    1                10             207.7 / 199.0 (262)
  immediate     1.01    1                10             207.7 / 199.1 (261)
  delayed       1.05    1                10             204.8 / 201.9 (184)
  delayed       1000 constant, 1         10             206.9 / 200.7 (261)
(Immediate 1.02 / 0.1 and / 1 were slowed by other jobs on the machine:
immediate 1.02 / 10 made 214 steps. Repeats of delayed 1.02 / 0.1 and
1.01 / 1 gave 202.7 / 199.2 in 212 steps and 207.7 / 199.1 in 261.)
Winner: delayed, growth 1.01 (250 -> 2000 by step 209), initial damping 1;
every setting is within about 3 of it at 90 s.

What the runs show: the calibration makes the initial damping nearly
irrelevant (0.1, 1 and 10 were all calibrated to 10, except once
0.1 -> 1.78, which gained about 2 at step 150 and 1 at 90 s). After it,
the Levenberg-Marquardt rule finds rho near 1 on every adaptation step and
lowers the damping at its largest rate (x0.95^5 every 5 steps) all run
long, to about 3e-5 at 90 s. The delayed and immediate rules compute rho
from the same batch at the same parameters and change the damping before
the next update either way, so their trajectories agree to float
rounding; they cost the same (one forward pass per adaptation step).

Measured with these defaults and --seconds=150 (Fashion-MNIST, 2 shared
AMD EPYC cores, TF 2.21; 8.3 minutes wall in all):

| optimizer | steps | ms/step | loss at 150s | loss at step 381 |
|---|---:|---:|---:|---:|
| kfac_adaptive | 381 | 395.5 | 197.0 | 197.1 |
| kfac_fixed | 830 | 180.9 | 211.3 | 220.2 |
| adam | 2163 | 69.4 | 207.2 | 226.2 |

Adam's final loss, 207.2, took adam 148 s (2140 steps) and kfac_adaptive
41 s (160 steps); kfac_fixed did not reach it. kfac_adaptive loses only
early: its burn-in takes the first 8 s, and adam stays ahead until about
19 s. Its steps cost 2.2x kfac_fixed's (a batch growing to 2000, the exact
curvature products of the quadratic model, the damping rule's forward
pass); at the end its damping was 7e-8 (below l2_reg = 1e-5, which the
preconditioner adds), lr 0.014, momentum 0.53, batch 2000.
"""

import contextlib
import io
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

import autoencoder_model as model
import kfac
import side_by_side

FLAGS = flags.FLAGS

RUNS = ("kfac_adaptive", "kfac_fixed", "adam")

side_by_side.define_flags()
FLAGS.set_default("optimizers", list(RUNS))
FLAGS.set_default("print_every", 10)
flags.DEFINE_string("encoder", None,
                    "Comma-separated encoder sizes after the input, mirrored "
                    "for the decoder (default: per dataset).")
flags.DEFINE_float("l2_reg", 1e-5, "Coefficient of the L2 term of the "
                   "objective (every run), also K-FAC's l2_reg.")
flags.DEFINE_enum("damping_rule", "delayed", ["delayed", "immediate"],
                  "kfac_adaptive: when the damping rule evaluates the loss "
                  "after an update: on the previous batch at the next step "
                  "(delayed) or right after the update (immediate).")
flags.DEFINE_float("adaptive_damping", None, "kfac_adaptive: initial "
                   "damping, calibrated during the burn-in (default: per "
                   "dataset).")
flags.DEFINE_float("min_damping", 1e-8, "kfac_adaptive: floor of the "
                   "damping.")
flags.DEFINE_integer("num_burnin_steps", 10, "kfac_adaptive: burn-in steps "
                     "(statistics and damping calibration, no update).")
flags.DEFINE_integer("initial_batch_size", None, "kfac_adaptive: batch size "
                     "at step 0 (default: per dataset).")
flags.DEFINE_integer("max_batch_size", None, "kfac_adaptive: largest batch "
                     "size (default: per dataset).")
flags.DEFINE_float("batch_growth", None, "kfac_adaptive: batch size growth "
                   "factor per step (default: per dataset).")
flags.DEFINE_string("output_dir", "adaptive_autoencoder_results",
                    "Where the plots, results.md and results.json go.")

# Per-dataset defaults for the flags left unset (Fashion-MNIST: tuned, see
# the module docstring; digits: a quick setting that learns).
DATASET_DEFAULTS = {
    "fashion_mnist": dict(
        encoder="1000,500,250,30", seconds=90.0, batch_size=1000,
        kfac_learning_rate=0.1, kfac_damping=10.0, kfac_momentum_type="adam",
        adam_learning_rate=1e-3, adaptive_damping=1.0,
        initial_batch_size=250, max_batch_size=2000, batch_growth=1.01),
    "digits": dict(
        encoder="48,32,16,8", seconds=20.0, batch_size=256,
        kfac_learning_rate=0.1, kfac_damping=1.0, kfac_momentum_type="adam",
        adam_learning_rate=1e-2, adaptive_damping=1.0,
        initial_batch_size=64, max_batch_size=512, batch_growth=1.05),
}


def objective(x, variables):
  """The reconstruction loss of the batch x plus the L2 term."""
  return total_loss(x, model.forward(x, variables), variables)


def total_loss(x, logits, variables):
  """The objective, given the logits of x."""
  l2 = tf.add_n([tf.reduce_sum(tf.square(v))
                 for v in model.flat_variables(variables)])
  return model.reconstruction_loss(x, logits) + 0.5 * FLAGS.l2_reg * l2


def batch_size_schedule(cfg):
  return kfac.batch_size_schedules.exponential_batch_size_schedule(
      cfg.initial_batch_size, cfg.max_batch_size, cfg.batch_growth)


def damping_rule_kwargs(reader):
  """The optimizer arguments of --damping_rule."""
  if FLAGS.damping_rule == "immediate":
    return dict(update_damping_immediately=True)
  return dict(update_damping_immediately=False,
              prev_train_batch=reader.cached_batch)


def adaptive_step(cfg, params_np, data):
  """kfac_adaptive's tensors, built in the current graph."""
  reader = kfac.data_reader.CachedDataReader((data,), cfg.max_batch_size,
                                             seed=FLAGS.seed)
  variables = model.make_variables(params_np)
  global_step = tf.compat.v1.train.get_or_create_global_step()
  batch_size = batch_size_schedule(cfg)(global_step)
  x, = reader(batch_size)
  lc = kfac.LayerCollection()
  logits = model.forward(x, variables, layer_collection=lc)
  model.register_loss(lc, x, logits)

  def loss_fn(batch):
    return objective(batch[0], variables)

  opt = kfac.PeriodicInvCovUpdateKfacOpt(
      invert_every=FLAGS.invert_every,
      num_burnin_steps=FLAGS.num_burnin_steps, calibrate_damping=True,
      learning_rate=None, momentum=None, momentum_type="qmodel",
      damping=cfg.adaptive_damping, layer_collection=lc,
      cov_ema_decay=FLAGS.cov_ema_decay, adapt_damping=True,
      min_damping=FLAGS.min_damping, l2_reg=FLAGS.l2_reg, loss_fn=loss_fn,
      train_batch=(x,), **damping_rule_kwargs(reader))
  train_op = opt.minimize(total_loss(x, logits, variables),
                          var_list=model.flat_variables(variables),
                          global_step=global_step)
  # Burn-in steps do not advance the counter (nor global_step): the
  # counter is still 0 after a burn-in step.
  shown = dict(damping=opt.damping, lr=opt.learning_rate,
               momentum=opt.momentum, rho=opt.rho, batch=batch_size,
               burn_in=tf.equal(opt.counter, 0))
  return dict(variables=variables, train_op=train_op, x=None, shown=shown)


def fixed_batch_step(cfg, run, params_np, input_dim):
  """kfac_fixed's or adam's tensors, built in the current graph."""
  x = tf.compat.v1.placeholder(tf.float32, [None, input_dim], name="x")
  variables = model.make_variables(params_np)
  lc = kfac.LayerCollection() if run == "kfac_fixed" else None
  logits = model.forward(x, variables, layer_collection=lc)
  if run == "kfac_fixed":
    model.register_loss(lc, x, logits)
    opt = kfac.PeriodicInvCovUpdateKfacOpt(
        invert_every=FLAGS.invert_every,
        learning_rate=cfg.kfac_learning_rate, damping=cfg.kfac_damping,
        layer_collection=lc, momentum=FLAGS.kfac_momentum,
        momentum_type=cfg.kfac_momentum_type,
        cov_ema_decay=FLAGS.cov_ema_decay,
        norm_constraint=FLAGS.kfac_norm_constraint, l2_reg=FLAGS.l2_reg)
    shown = dict(damping=opt.damping, lr=opt.learning_rate)
  else:
    opt = tf.compat.v1.train.AdamOptimizer(cfg.adam_learning_rate)
    shown = dict(lr=cfg.adam_learning_rate)
  train_op = opt.minimize(
      total_loss(x, logits, variables),
      var_list=model.flat_variables(variables),
      global_step=tf.compat.v1.train.get_or_create_global_step())
  return dict(variables=variables, train_op=train_op, x=x, shown=shown)


class Backend(object):
  """One run's graph and tf.compat.v1.Session (see side_by_side.py).

  The fixed-batch runs feed the batch of the given indices; kfac_adaptive
  reads its own (batch(None) is None, nothing is fed).
  """

  def __init__(self, cfg, run, params_np, data, eval_data):
    self.data = data
    self.eval_data = eval_data
    graph = tf.Graph()
    with graph.as_default():
      tf.compat.v1.set_random_seed(FLAGS.seed)
      if run == "kfac_adaptive":
        step = adaptive_step(cfg, params_np, data)
      else:
        step = fixed_batch_step(cfg, run, params_np, data.shape[1])
      self.x = step["x"]
      self.train_op = step["train_op"]
      self.shown_ops = {k: tf.convert_to_tensor(v)
                        for k, v in step["shown"].items()}
      self.eval_x = tf.compat.v1.placeholder(
          tf.float32, [None, data.shape[1]], name="eval_x")
      self.eval_loss = objective(self.eval_x, step["variables"])
      init = tf.compat.v1.global_variables_initializer()
    graph.finalize()
    self.sess = tf.compat.v1.Session(graph=graph)
    self.sess.run(init)

  def batch(self, indices):
    return None if indices is None else self.data[indices]

  def train(self, batch):
    self.sess.run(self.train_op, {} if batch is None else {self.x: batch})

  def evaluate(self):
    return float(self.sess.run(self.eval_loss,
                               {self.eval_x: self.eval_data}))

  def shown(self):
    return self.sess.run(self.shown_ops)

  def finish(self):
    self.sess.close()
    return {}


def describe_runs(cfg):
  """One line per run of --optimizers, and the settings they share."""
  lines = dict(zip(RUNS, [
      "kfac_adaptive: qmodel lr/momentum, initial damping %g calibrated "
      "over %d burn-in steps, %s damping rule, batch %d -> %d (x%g per "
      "step)" % (cfg.adaptive_damping, FLAGS.num_burnin_steps,
                 FLAGS.damping_rule, cfg.initial_batch_size,
                 cfg.max_batch_size, cfg.batch_growth),
      "kfac_fixed: lr %g, damping %g, momentum %g (%s), batch %d" % (
          cfg.kfac_learning_rate, cfg.kfac_damping, FLAGS.kfac_momentum,
          cfg.kfac_momentum_type, cfg.batch_size),
      "adam: lr %g, batch %d" % (cfg.adam_learning_rate, cfg.batch_size)]))
  return [lines[run] for run in FLAGS.optimizers] + [
      "K-FAC: invert_every %d, cov_ema_decay %g, l2_reg %g" % (
          FLAGS.invert_every, FLAGS.cov_ema_decay, FLAGS.l2_reg)]


def target_lines(histories):
  """Time and steps each run took to reach adam's final loss."""
  by_name = {h.name: h for h in histories}
  if "adam" not in by_name or not np.isfinite(by_name["adam"].final_loss):
    return []
  target = by_name["adam"].final_loss
  lines = ["Target: adam's final loss %.2f." % target]
  for h in histories:
    seconds = h.seconds_to_reach(target)
    if seconds is None:
      lines.append("  %s: not reached (final loss %.2f)" % (h.name,
                                                            h.final_loss))
    else:
      lines.append("  %s: reached at %.1fs, step %d" % (
          h.name, seconds, h.steps_to_reach(target)))
  return lines


def final_values_line(histories):
  for h in histories:
    if h.name == "kfac_adaptive" and h.shown:
      last = h.shown[-1]
      return ("kfac_adaptive at the end: damping %.3g, lr %.3g, momentum "
              "%.3f, rho %.2f, batch %d" % (
                  last["damping"], last["lr"], last["momentum"],
                  last["rho"], last["batch"]))
  return None


def report(histories, num_eval, name):
  """Prints the table and the targets; writes the plots and results."""
  with contextlib.redirect_stdout(io.StringIO()) as table:
    side_by_side.print_table(
        histories, "Losses: sigmoid cross-entropy summed over pixels plus "
        "the L2 term, mean over a fixed set of %d training images; "
        "seconds: training time only." % num_eval)
  lines = [table.getvalue().strip()] + target_lines(histories)
  final_values = final_values_line(histories)
  if final_values:
    lines.append(final_values)
  text = "\n".join(lines) + "\n"
  print("\n" + text, end="")
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  with open(os.path.join(FLAGS.output_dir, "results.md"), "w") as f:
    f.write(text)
  for x_axis in ("steps", "seconds"):
    side_by_side.plot_histories(
        histories, os.path.join(FLAGS.output_dir, "loss_vs_%s.png" % x_axis),
        x_axis, "objective on %d training images" % num_eval,
        title="Deep autoencoder, %s" % name)
  for path in (os.path.join(FLAGS.output_dir, "results.json"),
               FLAGS.results_json):
    if path:
      side_by_side.write_results(path, histories, dataset=name,
                                 tables={"results": text.strip()},
                                 damping_rule=FLAGS.damping_rule,
                                 min_damping=FLAGS.min_damping,
                                 num_burnin_steps=FLAGS.num_burnin_steps)
  print("Wrote the plots, results.md and results.json to %s" %
        FLAGS.output_dir)


def main(argv):
  del argv
  unknown = [r for r in FLAGS.optimizers if r not in RUNS]
  if unknown:
    raise app.UsageError("unknown --optimizers %s; choose from %s" % (
        ",".join(unknown), ",".join(RUNS)))
  name, data, cfg, sizes = side_by_side.autoencoder_setup(DATASET_DEFAULTS)
  print("model: %s (tanh, linear code, sigmoid cross-entropy + L2), budget "
        "%.0fs per run" % ("-".join(str(s) for s in sizes), cfg.seconds))
  print("\n".join(describe_runs(cfg)))

  rng = np.random.RandomState(FLAGS.seed)
  params_np = model.init_params(sizes, FLAGS.seed)
  eval_data = data[rng.choice(len(data), min(FLAGS.eval_examples, len(data)),
                              replace=False)]
  batches = side_by_side.Batches(len(data), cfg.batch_size, FLAGS.seed)
  trainers = []
  for run in FLAGS.optimizers:
    adaptive = run == "kfac_adaptive"
    trainers.append(side_by_side.Trainer(
        run, Backend(cfg, run, params_np, data, eval_data),
        None if adaptive else batches, cfg.seconds, record_shown=adaptive))
  histories = side_by_side.run_in_turns(trainers, FLAGS.chunk_steps)
  report(histories, len(eval_data), name)


if __name__ == "__main__":
  app.run(main)
