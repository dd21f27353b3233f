"""KfacOptimizer's wiring of the non-finite guard (reliability/nonfinite.py,
docs/reliability.md): a step whose loss, gradients or update are not all
finite changes no variable and is counted as skipped.

With `skip_non_finite_steps=False` there are no checks and the step is
always taken.
"""

import tensorflow as tf

from kfac.python.ops.distribute import collective
from kfac.python.ops.reliability import nonfinite
from kfac.python.ops.tensors import utils


class GuardedStepMixin:
  """The step of KfacOptimizer.apply_gradients, with the guard's checks."""

  def _checked_step(self, grads_and_vars, global_step, name):
    """The step with the current inverses, skipped (and counted) when the
    non-finite guard finds a non-finite loss or gradient."""
    checks = self._input_checks(grads_and_vars)
    with tf.name_scope(name or self.get_name()):
      update = self._compute_update(grads_and_vars)
      ok = self._update_checks(checks, update)
      return self._finish(self._commit(update, active=ok), global_step,
                          active=ok, checks=checks, ok=ok)

  @staticmethod
  def _update_checks(checks, update):
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

  def _input_checks(self, grads_and_vars):
    """The non-finite guard's checks of the step's loss and gradients
    (reliability/nonfinite.py); None without the guard. Under several
    replicas only the summed gradients decide (the same on every
    replica)."""
    if not self.config.guard.skip_non_finite_steps:
      return None
    checks = nonfinite.Checks()
    loss = self._passed_loss
    if loss is not None and not collective.is_distributed():
      checks.add("loss", [loss])
    # A dense weight gradient x^T d that its block may precondition
    # through x and d is checked through them, so that the product is not
    # computed for the check alone (factored_grads/match.py): finite x and
    # d give a finite product unless its sums overflow; such a step is
    # then judged by its update's own check.
    operands = (self._require_estimator().gradient_operands(grads_and_vars)
                if self._gradients_read_once() else {})
    for grad, var in grads_and_vars:
      pair = operands.get(var.ref())
      checks.add("gradient of " + utils.variable_name(var),
                 [grad] if pair is None else list(pair))
    return checks
