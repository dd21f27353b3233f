"""The non-finite guard of a K-FAC step (reliability/nonfinite.py,
docs/reliability.md): a step whose loss, gradients, statistics or update
are not all finite changes no variable and is counted as skipped.

`StepGuard` is the part of the step (optimizers/step.py) that says which
values are checked; with `skip_non_finite_steps=False` it checks nothing
and the step is always taken.
"""

from kfac.python.ops.distribute import collective
from kfac.python.ops.reliability import nonfinite
from kfac.python.ops.tensors import utils


class StepGuard:
  """The guard's checks of a step and its record of skipped steps."""

  def __init__(self, settings, store, name):
    """settings: a config.GuardConfig; store: the optimizer's StateStore
    (the skipped-step counters live there)."""
    self._enabled = settings.skip_non_finite_steps
    self.guard = nonfinite.NonFiniteGuard(
        store, settings.max_consecutive_skipped_steps, name)

  @property
  def enabled(self):
    return self._enabled

  def input_checks(self, grads_and_vars, loss, gradient_operands):
    """The checks of the step's loss and gradients (nonfinite.Checks), or
    None without the guard. Under several replicas only the summed
    gradients decide (the same on every replica).
    `gradient_operands(grads_and_vars)`: {var ref: (x, d)} of the dense
    weight gradients x^T d that their blocks precondition through x and d
    (factored_grads/match.py): such a gradient is checked through x and d,
    so that the product is not computed for the check alone (finite x and
    d give a finite product unless its sums overflow; such a step is then
    judged by its update's own check)."""
    if not self._enabled:
      return None
    checks = nonfinite.Checks()
    if loss is not None and not collective.is_distributed():
      checks.add("loss", [loss])
    operands = gradient_operands(grads_and_vars)
    for grad, var in grads_and_vars:
      pair = operands.get(var.ref())
      checks.add("gradient of " + utils.variable_name(var),
                 [grad] if pair is None else list(pair))
    return checks

  @staticmethod
  def update_checks(checks, update):
    """Adds the update's changes of the variables to `checks` (a step whose
    inputs are finite can still overflow) and returns whether the step may
    be taken (None without the guard)."""
    if checks is None:
      return None
    for delta, var in update.deltas:
      checks.add("update of " + utils.variable_name(var), [delta])
    for delta, var in update.decay_deltas:
      checks.add("weight decay of " + utils.variable_name(var), [delta])
    return checks.ok()

  def record(self, ok, checks, step):
    """The op that counts the step as skipped unless `ok`
    (nonfinite.NonFiniteGuard.record)."""
    return self.guard.record(ok, checks, step)

  @property
  def skipped_steps(self):
    return self.guard.skipped_steps

  @property
  def consecutive_skipped_steps(self):
    return self.guard.consecutive_skipped_steps
