"""K-FAC with the statistic and inverse updates inside `minimize`.

`PeriodicInvCovUpdateKfacOpt` is a facade: a `KfacOptimizer` whose
configuration has periods (`config.Periods`), so that its step
(optimizers/step.py) builds one training op. As in kfac 0.2.x:
1. during the first `num_burnin_steps` calls (counted by `burnin_counter`)
   it only adds the mini-batch statistics to an arithmetic mean (no
   parameter update, no inverses; with `calibrate_damping=True`, also the
   inverses and a trial of the update that calibrates the damping, see
   adaptive/damping_controller.py, on the last `num_calibration_steps` of them:
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

from kfac.python.ops.optimizers import kfac_optimizer
from kfac.python.ops.tensors import utils
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
    return self._counters.burnin_counter
