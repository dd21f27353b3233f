"""K-FAC with the statistic and inverse updates inside `minimize`.

`PeriodicInvCovUpdateKfacOpt` builds one training op that, at step t
(the optimizer's `counter`):
1. during the first `num_burnin_steps` steps only updates the statistics
   (no parameter update, no inverses; with `calibrate_damping=True`, the
   inverses every step and a trial of the update that calibrates the
   damping, see adaptive_damping.py);
2. otherwise updates the statistics when t % cov_update_every == 0,
3. recomputes the inverses when (t - num_burnin_steps) % invert_every == 0
   (so the first real step already uses fresh inverses),
4. applies the K-FAC step, and increments the counter (and global_step).
All of it is one `session.run` / one `tf.function` call per step; the
inverse work is amortised over `invert_every` steps.
"""

import tensorflow as tf

from kfac.python.ops import optimizer
from kfac.python.ops import utils
from kfac.python.ops.distribute import collective


@utils.exclude_from_autograph
class PeriodicInvCovUpdateKfacOpt(optimizer.KfacOptimizer):
  """KfacOptimizer that updates statistics and inverses periodically."""

  def __init__(self, invert_every=10, cov_update_every=1, num_burnin_steps=0,
               calibrate_damping=False, **kfac_kwargs):
    """See the module docstring; `calibrate_damping=True` needs
    num_burnin_steps > 0 and loss_fn / train_batch (as adapt_damping)."""
    for arg, value, low in (("invert_every", invert_every, 1),
                            ("cov_update_every", cov_update_every, 1),
                            ("num_burnin_steps", num_burnin_steps, 0)):
      if int(value) != value or value < low:
        raise ValueError("%s must be an integer >= %d, got %r." %
                         (arg, low, value))
    self._invert_every = int(invert_every)
    self._cov_update_every = int(cov_update_every)
    self._num_burnin_steps = int(num_burnin_steps)
    if calibrate_damping and not self._num_burnin_steps:
      raise ValueError(
          "calibrate_damping=True calibrates the damping during the burn-in "
          "steps: pass num_burnin_steps > 0 (e.g. 10).")
    self._calibrate_damping = bool(calibrate_damping)
    super().__init__(**kfac_kwargs)

  @property
  def invert_every(self):
    return self._invert_every

  @property
  def cov_update_every(self):
    return self._cov_update_every

  @property
  def num_burnin_steps(self):
    return self._num_burnin_steps

  @property
  def calibrate_damping(self):
    return self._calibrate_damping

  def apply_gradients(self, grads_and_vars, global_step=None, name=None,
                      layer_collection=None):
    grads_and_vars = self._prepare(grads_and_vars, layer_collection)
    est = self._require_estimator()
    est.instantiate_variables()
    (_, cov_thunks, _, inv_thunks) = est.create_ops_and_vars_thunks(
        scope=self.get_name())

    with tf.name_scope(name or self.get_name()):
      counter = tf.convert_to_tensor(self.counter)
      burnin = tf.constant(self._num_burnin_steps, tf.int64)
      in_burnin = counter < burnin
      do_cov = tf.logical_or(
          in_burnin, tf.equal(counter % self._cov_update_every, 0))
      if self._cov_update_every > 1:
        # Under several replicas the statistics are then reduced only on
        # the steps that fold them.
        cov_done = est.conditional_cov_update(do_cov, scope=self.get_name())
      else:
        cov_done = utils.cond_op(
            do_cov, lambda: tf.group(*[t() for t in cov_thunks]))
      with tf.control_dependencies([cov_done]):
        do_inv = tf.logical_and(
            tf.logical_not(in_burnin),
            tf.equal((counter - burnin) % self._invert_every, 0))
        if self._calibrate_damping:
          do_inv = tf.logical_or(in_burnin, do_inv)
        # Inverse updates that talk to other replicas (replica_round_robin)
        # need the conditional taken for all replicas at once.
        cond = (collective.cross_replica_cond
                if est.inverse_update_uses_collectives else utils.cond_op)
        inv_done = cond(do_inv, lambda: tf.group(*[t() for t in inv_thunks]))
      with tf.control_dependencies([inv_done]):
        # Built outside the burn-in condition: the quadratic model's
        # curvature products are gradients, which tf.cond branches cannot
        # take of tensors built outside them. Only the commit is skipped
        # during burn-in.
        update = self._compute_update(grads_and_vars)
        if self._num_burnin_steps > 0:
          calibrated = []
          if self._calibrate_damping:
            calibrated = [utils.cond_op(
                in_burnin, lambda: self._calibration_op(update))]
          with tf.control_dependencies(calibrated):
            stepped = self._commit(update, active=tf.logical_not(in_burnin))
        else:
          stepped = self._commit(update)
      return self._finish(stepped, global_step)
