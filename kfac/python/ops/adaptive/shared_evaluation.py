"""One evaluation of the loss after the update for the calibration and the
damping rule.

With `calibrate_damping=True` and the immediate damping rule
(`adapt_damping=True`, `update_damping_immediately=True`, the default
recipe) a training step holds two evaluations of loss_fn(train_batch) at
changed variables: the burn-in calibration's trial (w + delta, then
restored) and the rule's loss after the update. They never run in the same
step (the calibration runs on burn-in steps, the update after them), but
each was a conditional of its own with its own copy of the model's forward
pass in the graph: on a keras.applications model some 3k ops traced,
optimized and placed for nothing on every first call.

`commit_sharing_evaluation` builds the step's tail with one evaluation,
for one replica (the calibration is not supported under several):

1. on a calibration step, the trial: the variables' values kept (as the
   outputs of a conditional; a step without a trial keeps nothing) and
   the variables set to w + delta;
2. the update itself (`active`: after burn-in, finite values), without
   the rule;
3. loss_fn(train_batch), in one conditional taken on a calibration step or
   an adaptation step of the rule;
4. the calibration's end (the variables restored, the damping moved), the
   rule, and the decoupled weight decay, each in its conditional.

The values are those of the separate evaluations (the tests compare every
variable and the damping in float64, in TF1 Sessions and tf.functions).
"""

import tensorflow as tf

from kfac.python.ops.tensors import utils


def commit_sharing_evaluation(damping, step_op, commit_decay, update, trial,
                              active):
  """The op of steps 1-4 of the module docstring. `damping`: the step's
  adaptive/damping_controller.DampingController; `step_op(update)`: the
  update's op on one replica without the rule; `commit_decay(update,
  after_op)`: the decoupled weight decay after `after_op`. `trial` and
  `active` are boolean tensors (never both true); `active` may be None
  (always)."""
  variables = [v for _, v in update.deltas]
  nan = tf.constant(float("nan"), tf.float64)

  def try_update():
    before, saved, tried = damping.calibration_trial(update)
    with tf.control_dependencies([tried]):
      return [tf.identity(before)] + [tf.identity(s) for s in saved]

  def no_trial():  # nothing kept (the outputs may differ in shape)
    return [nan] + [tf.zeros([0], v.dtype) for v in variables]

  kept = tf.cond(trial, try_update, no_trial)
  trial_before, saved = kept[0], kept[1:]
  with tf.control_dependencies(kept):
    if active is None:
      stepped = step_op(update)
    else:
      stepped = utils.cond_op(active, lambda: step_op(update))
  adapt = damping.adaptation_step()
  if active is not None:
    adapt = tf.logical_and(active, adapt)
  counter = tf.convert_to_tensor(damping.counter())
  with tf.control_dependencies([stepped]):
    batch = damping.checked_batch(damping.train_batch, "train_batch")
    after = tf.cond(tf.logical_or(trial, adapt),
                    lambda: damping.loss_value(batch), lambda: nan)
    # Read after the step, which waits for the ops that store the loss
    # before the update (use_passed_loss=False).
    before = damping.loss_before()
    change = update.predicted_change()
  # Explicit control edges: in a TF1 graph an untaken branch of a
  # control flow v1 conditional waits for none of the branch's inputs.
  with tf.control_dependencies([stepped, after]):
    calibrated = utils.cond_op(trial, lambda: damping.calibration_finish(
        update, trial_before, after, saved))
  with tf.control_dependencies([calibrated]):
    ruled = utils.cond_op(adapt, lambda: damping.immediate_rule(
        update, after, before, change, counter))
  ops = [stepped, calibrated, ruled]
  if update.decay_deltas:
    with tf.control_dependencies([ruled]):
      ops.append(commit_decay(update, tf.no_op()) if active is None
                 else utils.cond_op(active, lambda: commit_decay(
                     update, tf.no_op())))
  return tf.group(*ops)
