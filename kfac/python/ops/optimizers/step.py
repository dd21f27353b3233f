"""One K-FAC training step, composed from its parts, top to bottom.

`build_step` is the whole step of `KfacOptimizer.apply_gradients` (and of
its facades `PeriodicInvCovUpdateKfacOpt` and `AsyncInvCovUpdateKfacOpt`).
It reads in the order the step runs:

1. statistics, per period (`config.Periods`; none when the program runs
   the estimator's ops itself): during burn-in into an arithmetic mean,
   then into the moving average every `cov_update_every` steps;
2. inverses, per period (every `invert_every` steps, and on the burn-in
   steps that calibrate the damping);
3. preconditioning and the update rule (`compute_update`: the momentum
   types "regular" / "adam", or the quadratic model; the decoupled weight
   decay), without touching any state;
4. the non-finite guard's verdict on the update;
5. the damping's calibration (burn-in) and the commit with the damping
   rule around it (one loss evaluation shared by both where it can);
6. the counters (burn-in, step, global step; skipped steps).

Everything is one `session.run` / one `tf.function` call. The parts are
given in `Parts`; each is an object with a small interface:
* `guard` (optimizers/guarded_step.StepGuard): the checks of the loss,
  the gradients, the statistics and the update;
* `compute_update`: grads_and_vars -> `Update` (optimizers/update.py);
* `damping` (adaptive/damping_controller.DampingController): the damping,
  its rule and its calibration (`shares_evaluation`, `calibration_op`);
* `commit` (optimizers/commit.Commit): the op that carries out an Update,
  with the damping rule's ops around it (`commit`,
  `commit_sharing_evaluation`);
* `counters` (optimizers/commit.Counters): the step counters.
"""

from typing import Any, Callable, NamedTuple, Optional

import tensorflow as tf

from kfac.python.ops.distribute import collective
from kfac.python.ops.optimizers import config as config_lib
from kfac.python.ops.tensors import utils


class Parts(NamedTuple):
  """What `build_step` composes (module docstring)."""
  estimator: Any
  """The estimator of this trace (statistics, inverses, preconditioning)."""
  periods: Optional[config_lib.Periods]
  """When the step updates statistics and inverses (None: never)."""
  num_calibration_steps: int
  """The last burn-in steps that calibrate the damping (0: none)."""
  scope: str
  """The name scope of the estimator's ops."""
  guard: Any
  """The non-finite guard (guarded_step.StepGuard)."""
  passed_loss: Any
  """The loss of this step (checked by the guard), or None."""
  gradient_operands: Callable[[Any], Any]
  """grads_and_vars -> {var ref: (x, d)} of factored weight gradients."""
  compute_update: Callable[[Any], Any]
  """grads_and_vars -> Update, without changing any state."""
  damping: Any
  """The damping controller (adaptive/damping_controller.py: the rule and
  the calibration)."""
  commit: Any
  """The commit (optimizers/commit.Commit: the op that carries out an
  update, with the damping rule around it)."""
  counters: Any
  """The step counters (commit.Counters)."""


def build_step(parts, grads_and_vars, global_step, name):
  """The training op of one K-FAC step (module docstring)."""
  periods = parts.periods
  est = parts.estimator
  if periods is not None:
    est.instantiate_variables()
    est.create_ops_and_vars_thunks(scope=parts.scope)  # finalizes
  checks = parts.guard.input_checks(grads_and_vars, parts.passed_loss,
                                    parts.gradient_operands)
  if periods is None:
    # Statistics and inverses are the program's ops: the step itself.
    with tf.name_scope(name):
      update = parts.compute_update(grads_and_vars)
      ok = parts.guard.update_checks(checks, update)
      return parts.counters.finish(parts.commit.commit(update, active=ok),
                                   global_step, active=ok, checks=checks,
                                   ok=ok)
  gate = None if checks is None else checks.ok()
  with tf.name_scope(name):
    counter = tf.convert_to_tensor(parts.counters.counter)
    in_burnin, calibrating = _burnin(parts, periods)
    # 1. Statistics.
    stats_ok = _statistics(parts, periods, counter, in_burnin, gate)
    ok = None
    if checks is not None:
      checks.add_flag("curvature statistics", stats_ok)
      ok = checks.ok()
    # 2. Inverses.
    with tf.control_dependencies([stats_ok]):
      inv_done = _inverses(parts, periods, counter, in_burnin, calibrating,
                           ok)
    with tf.control_dependencies([inv_done]):
      # 3. Preconditioning and the update rule, built outside the burn-in
      # condition: the quadratic model's curvature products are
      # gradients, which tf.cond branches cannot take of tensors built
      # outside them. Only the commit is skipped during burn-in (and on
      # skipped steps).
      update = parts.compute_update(grads_and_vars)
      # 4. The guard's verdict.
      if checks is not None:
        ok = parts.guard.update_checks(checks, update)
      active = _both(None if periods.num_burnin_steps == 0 else
                     tf.logical_not(in_burnin), ok)
      trial = (_both(calibrating, ok) if calibrating is not None
               else None)
      # 5. Calibration, commit and damping rule.
      stepped = _commit(parts, update, trial, active)
      # 6. Counters.
      if periods.num_burnin_steps > 0:
        with tf.control_dependencies([stepped]):
          stepped = parts.counters.burnin_counter.assign_add(
              tf.cast(_both(in_burnin, ok), tf.int64))
    return parts.counters.finish(stepped, global_step, active=active,
                                 checks=checks, ok=ok)


def _burnin(parts, periods):
  """(in burn-in, calibrating): boolean tensors (calibrating None without
  the calibration)."""
  if periods.num_burnin_steps == 0:
    return tf.constant(False), None
  burnin_counter = tf.convert_to_tensor(parts.counters.burnin_counter)
  in_burnin = burnin_counter < tf.constant(periods.num_burnin_steps,
                                           tf.int64)
  if not parts.num_calibration_steps:
    return in_burnin, None
  calibrating = in_burnin
  first = periods.num_burnin_steps - parts.num_calibration_steps
  if first > 0:
    calibrating = tf.logical_and(
        in_burnin, burnin_counter >= tf.constant(first, tf.int64))
  return in_burnin, calibrating


def _statistics(parts, periods, counter, in_burnin, gate):
  """The statistics' update of this step; returns whether they were
  finite (the estimator's checked_cov_update)."""
  est = parts.estimator
  do_cov = tf.equal(counter % periods.cov_update_every, 0)
  if periods.num_burnin_steps > 0:
    # Burn-in: every step, into an arithmetic mean (should_decay False);
    # then the moving average. (Lazily synchronised statistics under
    # several replicas fold only into the moving average: there the
    # burn-in steps feed it too.) One statistics computation serves both:
    # should_decay is a tensor.
    should_decay = (True if est._lazy() else  # pylint: disable=protected-access
                    tf.logical_not(in_burnin))
    return est.checked_cov_update(
        tf.logical_or(in_burnin, do_cov), gate, should_decay,
        scope=parts.scope)
  # With cov_update_every > 1 under several replicas the statistics are
  # reduced only on the steps that fold them.
  return est.checked_cov_update(
      True if periods.cov_update_every == 1 else do_cov, gate,
      scope=parts.scope,
      conditional_reduction=periods.cov_update_every > 1)


def _inverses(parts, periods, counter, in_burnin, calibrating, ok):
  """The inverses' update of this step (an op)."""
  est = parts.estimator
  do_inv = tf.logical_and(tf.logical_not(in_burnin),
                          tf.equal(counter % periods.invert_every, 0))
  if calibrating is not None:
    do_inv = tf.logical_or(calibrating, do_inv)
  if ok is not None:
    do_inv = tf.logical_and(do_inv, ok)
  # Inverse updates that talk to other replicas (replica_round_robin) need
  # the conditional taken for all replicas at once.
  cond = (collective.cross_replica_cond
          if est.inverse_update_uses_collectives else utils.cond_op)
  return cond(do_inv, lambda: est.inverse_update_op(scope=parts.scope))


def _commit(parts, update, trial, active):
  """The calibration's trial (burn-in), the commit and the damping rule."""
  if parts.damping.shares_evaluation(trial):
    # The calibration's trial and the damping rule evaluate the loss in
    # one conditional (adaptive/shared_evaluation.py).
    return parts.commit.commit_sharing_evaluation(update, trial, active)
  calibrated = []
  if trial is not None:
    calibrated = [utils.cond_op(
        trial, lambda: parts.damping.calibration_op(update))]
  with tf.control_dependencies(calibrated):
    return parts.commit.commit(update, active=active)


def _both(a, b):
  """a and b for boolean tensors, where None stands for True."""
  if a is None or b is None:
    return b if a is None else a
  return tf.logical_and(a, b)
