"""K-FAC with the statistic and inverse updates inside `minimize`.

`PeriodicInvCovUpdateKfacOpt` builds one training op. As in kfac 0.2.x:
1. during the first `num_burnin_steps` calls (counted by `burnin_counter`)
   it only adds the mini-batch statistics to an arithmetic mean (no
   parameter update, no inverses; with `calibrate_damping=True`, also the
   inverses and a trial of the update that calibrates the damping, see
   adaptive/damping_mixin.py, on the last `num_calibration_steps` of them:
   by default all). These calls do not advance the optimizer's `counter`
   nor `global_step`;
2. afterwards, at step t (the `counter`, which starts at 0 after burn-in),
   it updates the statistics' moving averages when t % cov_update_every ==
   0,
3. recomputes the inverses when t % invert_every == 0 (so the first real
   step already uses fresh inverses),
4. applies the K-FAC step, and increments the counter (and global_step).
All of it is one `session.run` / one `tf.function` call per step; the
inverse work is amortised over `invert_every` steps.

A `cov_ema_decay` passed explicitly is raised to the power
`cov_update_every` (kfac 0.2.x did this so that the average forgets at the
same rate per step whatever the update interval); the default 0.95 is
used as it is.
"""

import tensorflow as tf

from kfac.python.ops.optimizers import kfac_optimizer
from kfac.python.ops.tensors import utils
from kfac.python.ops.distribute import collective
from kfac.python.ops.optimizers import config as config_lib


@utils.exclude_from_autograph
class PeriodicInvCovUpdateKfacOpt(kfac_optimizer.KfacOptimizer):
  """KfacOptimizer that updates statistics and inverses periodically."""

  def __init__(self, invert_every=10, cov_update_every=1, num_burnin_steps=0,
               calibrate_damping=False, num_calibration_steps=None,
               **kfac_kwargs):
    """See the module docstring; `calibrate_damping=True` needs
    num_burnin_steps > 0 and loss_fn / train_batch (as adapt_damping).

    num_calibration_steps: with calibrate_damping, how many of the burn-in
      steps (the last ones) try the update and move the damping, each
      recomputing every inverse; the ones before only gather statistics,
      so that the first call returns without inverting anything. None: all
      of them."""
    periodic = config_lib.periods(invert_every, cov_update_every,
                                  num_burnin_steps, calibrate_damping,
                                  num_calibration_steps)
    if kfac_kwargs.get("cov_ema_decay") is not None:
      kfac_kwargs["cov_ema_decay"] = config_lib.periodic_cov_ema_decay(
          type(self).__name__, kfac_kwargs["cov_ema_decay"],
          periodic.periods.cov_update_every)
    kfac_kwargs[kfac_optimizer.PERIODIC_ARGUMENTS] = periodic
    super().__init__(**kfac_kwargs)

  @property
  def invert_every(self):
    return self.config.curvature.periods.invert_every

  @property
  def cov_update_every(self):
    return self.config.curvature.periods.cov_update_every

  @property
  def num_burnin_steps(self):
    return self.config.curvature.periods.num_burnin_steps

  @property
  def calibrate_damping(self):
    return self.config.damping.calibrate_damping

  @property
  def num_calibration_steps(self):
    """The burn-in steps that calibrate the damping (0 without it)."""
    return self.config.damping.num_calibration_steps

  # kfac 0.2.x's private names of the periods.
  _invert_every = invert_every
  _cov_update_every = cov_update_every
  _num_burnin_steps = num_burnin_steps
  _num_calibration_steps = num_calibration_steps

  @property
  def burnin_counter(self):
    """How many burn-in steps have run (they do not advance `counter`)."""
    return self._store.get_or_create("burnin_counter", [], tf.int64)

  def steps_taken(self):
    taken = super().steps_taken()
    if self._num_burnin_steps > 0:
      taken += tf.convert_to_tensor(self.burnin_counter)
    return taken

  def apply_gradients(self, grads_and_vars, global_step=None, name=None,
                      layer_collection=None):
    grads_and_vars = self._prepare(grads_and_vars, layer_collection)
    # The delayed damping rule (maybe_pre_update_adapt_damping) first: the
    # inverses of this step use the damping it sets, as in kfac 0.2.x.
    with tf.control_dependencies(self._pre_update_ops()):
      return self._periodic_step(grads_and_vars, global_step, name)

  def _periodic_step(self, grads_and_vars, global_step, name):
    est = self._require_estimator()
    est.instantiate_variables()
    est.create_ops_and_vars_thunks(scope=self.get_name())  # finalizes
    checks = self._input_checks(grads_and_vars)
    gate = None if checks is None else checks.ok()

    with tf.name_scope(name or self.get_name()):
      counter = tf.convert_to_tensor(self.counter)
      calibrating = None
      if self._num_burnin_steps > 0:
        burnin_counter = tf.convert_to_tensor(self.burnin_counter)
        in_burnin = burnin_counter < tf.constant(self._num_burnin_steps,
                                                 tf.int64)
        if self.config.damping.calibrate_damping:
          calibrating = in_burnin
          first = self._num_burnin_steps - self.config.damping.num_calibration_steps
          if first > 0:
            calibrating = tf.logical_and(
                in_burnin, burnin_counter >= tf.constant(first, tf.int64))
      else:
        in_burnin = tf.constant(False)
      do_cov = tf.equal(counter % self._cov_update_every, 0)
      scope = self.get_name()
      if self._num_burnin_steps > 0:
        # Burn-in: every step, into an arithmetic mean (should_decay False);
        # then the moving average. (Lazily synchronised statistics under
        # several replicas fold only into the moving average: there the
        # burn-in steps feed it too.) One statistics computation serves
        # both: should_decay is a tensor.
        should_decay = (True if est._lazy() else  # pylint: disable=protected-access
                        tf.logical_not(in_burnin))
        stats_ok = est.checked_cov_update(
            tf.logical_or(in_burnin, do_cov), gate, should_decay, scope=scope)
      else:
        # With cov_update_every > 1 under several replicas the statistics
        # are reduced only on the steps that fold them.
        stats_ok = est.checked_cov_update(
            True if self._cov_update_every == 1 else do_cov, gate,
            scope=scope, conditional_reduction=self._cov_update_every > 1)
      ok = None
      if checks is not None:
        checks.add_flag("curvature statistics", stats_ok)
        ok = checks.ok()
      with tf.control_dependencies([stats_ok]):
        do_inv = tf.logical_and(
            tf.logical_not(in_burnin),
            tf.equal(counter % self._invert_every, 0))
        if self.config.damping.calibrate_damping:
          do_inv = tf.logical_or(calibrating, do_inv)
        if ok is not None:
          do_inv = tf.logical_and(do_inv, ok)
        # Inverse updates that talk to other replicas (replica_round_robin)
        # need the conditional taken for all replicas at once.
        cond = (collective.cross_replica_cond
                if est.inverse_update_uses_collectives else utils.cond_op)
        inv_done = cond(do_inv,
                        lambda: est.inverse_update_op(scope=self.get_name()))
      with tf.control_dependencies([inv_done]):
        # Built outside the burn-in condition: the quadratic model's
        # curvature products are gradients, which tf.cond branches cannot
        # take of tensors built outside them. Only the commit is skipped
        # during burn-in (and on skipped steps).
        update = self._compute_update(grads_and_vars)
        if checks is not None:
          ok = self._update_checks(checks, update)
        active = _both(None if self._num_burnin_steps == 0 else
                       tf.logical_not(in_burnin), ok)
        trial = (_both(calibrating, ok) if self.config.damping.calibrate_damping
                 else None)
        if self._shares_evaluation(trial):
          # The calibration's trial and the damping rule evaluate the loss
          # in one conditional (adaptive/shared_evaluation.py).
          stepped = self._commit_sharing_evaluation(update, trial, active)
        else:
          calibrated = []
          if trial is not None:
            calibrated = [utils.cond_op(
                trial, lambda: self._calibration_op(update))]
          with tf.control_dependencies(calibrated):
            stepped = self._commit(update, active=active)
        if self._num_burnin_steps > 0:
          with tf.control_dependencies([stepped]):
            stepped = self.burnin_counter.assign_add(
                tf.cast(_both(in_burnin, ok), tf.int64))
      return self._finish(stepped, global_step, active=active, checks=checks,
                          ok=ok)


def _both(a, b):
  """a and b for boolean tensors, where None stands for True."""
  if a is None or b is None:
    return b if a is None else a
  return tf.logical_and(a, b)
