"""Decoupled weight decay (AdamW's, Loshchilov & Hutter 2019) for
KfacOptimizer: `decoupled_weight_decay=wd`.

Each step, after the K-FAC step, every decayed variable w gets

    w <- w - lr * wd * w_before

where w_before is its value before the step and lr the learning rate of
this step. This is what Keras's optimizers do with `weight_decay` (they
decay w by lr * wd * w before the update, from the same w_before): the
decay is not part of the gradient, is not preconditioned, does not enter
the momentum (velocities), the quadratic model, nor the damping rule's
predicted change, and does not change K-FAC's step in any other way.

The learning rate: with momentum "regular" / "adam", the learning rate of
the step (learning_rate, or its schedule's value). With "qmodel" /
"qmodel_fixedmu" the one the quadratic model chose for THIS step (the
`learning_rate` the optimizer reports after it), floored at 0 so that a
decay never grows the weights. This step's rate, not the previous one's:
it is known before any variable changes (the quadratic model solves for it
from this step's gradient and curvature), so the decay and the K-FAC step
use the same scale, as AdamW's decay and step do; the previous step's rate
would lag a rate that the model moves by large factors between steps
(e.g. at the end of burn-in, where no rate was chosen yet).

When it is applied: after the damping rule's evaluation of the loss after
the update (update_damping_immediately=True, one step), so the reduction
ratio rho compares the loss change of the K-FAC step alone with the
change the quadratic model predicted for it. With
update_damping_immediately=False the "after" loss is evaluated at the
start of the next step, after the decay; the decay then enters rho's
actual change (not its predicted one). Burn-in steps and steps the
non-finite guard skips do not decay (the variables do not move).

`decoupled_weight_decay_mask` (a callable variable -> bool, default: every
variable decays) selects the decayed variables; the Keras optimizer passes
its `exclude_from_weight_decay` choice through it.

kfac 0.2.x's `use_weight_decay=True, weight_decay_coeff=c` adds c * w to
the step before the learning rate multiplies it: for the momentum types
"regular" / "adam" that is the same change of w, but it enters the damping
rule's predicted change, cannot exclude variables and is not available with
the quadratic model. The two cannot be combined.
"""

import tensorflow as tf

from kfac.python.ops.distribute import collective
from kfac.python.ops.optimizers import step as step_lib
from kfac.python.ops.tensors import utils


class WeightDecay:
  """The decoupled weight decay of a step (module docstring): `add` fills
  an Update's decay_deltas, `commit` applies them."""

  def __init__(self, settings, learning_rate):
    """settings: a config.UpdateRuleConfig; learning_rate: the optimizer's
    learning rate (a number, tensor, variable or callable; with "qmodel*"
    the step's chosen one is read from the Update instead)."""
    self._settings = settings
    self._learning_rate = learning_rate

  @property
  def enabled(self):
    return self._settings.decoupled_weight_decay is not None

  def decays(self, var):
    """Whether `var` decays (decoupled_weight_decay_mask)."""
    mask = self._settings.decoupled_weight_decay_mask
    return True if mask is None else bool(mask(var))

  def add(self, update, variables):
    """Fills update.decay_deltas: -lr * wd * w for each decayed variable,
    with this step's learning rate (module docstring)."""
    if not self.enabled:
      return
    if self._settings.qmodel:
      lr = tf.maximum(update.records["learning_rate"],
                      tf.constant(0.0, tf.float64))
    else:
      lr = step_lib.read(self._learning_rate)
    wd = step_lib.read(self._settings.decoupled_weight_decay)
    for var in variables:
      if not self.decays(var):
        continue
      dtype = var.dtype.base_dtype
      scale = utils.cast(lr, dtype) * utils.cast(wd, dtype)
      update.decay_deltas.append((-scale * tf.convert_to_tensor(var), var))

  @staticmethod
  def commit(update, after_op, active=None):
    """The op that applies update.decay_deltas after `after_op` (the step
    and the damping rule); with a boolean tensor `active` under several
    replicas, a zero change where it is false (single replica: the commit
    is already inside the condition)."""
    if not update.decay_deltas:
      return after_op
    with tf.control_dependencies([after_op]):
      if collective.is_distributed():
        updates = []
        for delta, var in update.decay_deltas:
          delta = tf.identity(delta)
          if active is not None:
            delta = tf.where(active, delta, tf.zeros_like(delta))
          updates.append((step_lib.assign_add, var, (delta,)))
        with tf.name_scope("weight_decay_to_replicas"):
          return tf.group(collective.apply_updates(updates))
      return tf.group(*[var.assign_add(delta)
                        for delta, var in update.decay_deltas])
