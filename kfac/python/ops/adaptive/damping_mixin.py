"""The ops of K-FAC's damping rule and of its calibration during burn-in.

`AdaptiveDampingMixin` is the part of `KfacOptimizer` (through
`adaptive.AdaptiveMixin`) that builds the Levenberg-Marquardt damping rule
(`adaptive/damping_rule.py` has its math) into a training step, and the
calibration of the initial damping that `PeriodicInvCovUpdateKfacOpt` runs
during its burn-in steps with `calibrate_damping=True`.

Damping rule: rho = (loss after - loss before) / qmodel_change on the same
mini-batch, every damping_adaptation_interval steps (the steps where the
counter is a multiple of it).

* update_damping_immediately=True: on such a step the loss before is the
  passed loss (`minimize`'s loss or `set_loss`; with use_passed_loss=False,
  loss_fn(train_batch) evaluated before the update, or the value of it
  given by `set_train_batch_loss`, e.g. the Keras optimizer's training
  loss), and the loss after is
  loss_fn(train_batch) evaluated after the update, in the same step: one
  extra forward pass on adaptation steps only.
* update_damping_immediately=False: on such a step the loss before and the
  predicted change are kept; at the start of the next step
  loss_fn(prev_train_batch) (the previous step's batch, e.g.
  `CachedDataReader.cached_batch`) is evaluated at the current parameters
  and the damping adapted, before anything of that step reads the damping
  (PeriodicInvCovUpdateKfacOpt: before its inverse updates, so they use the
  new damping, as in kfac 0.2.x). That op is kfac 0.2.x's
  `maybe_pre_update_adapt_damping()`: a script that runs it before the
  step as 0.2.x told (in the same session.run with a control dependency,
  or a session.run of its own) gets the same op the step depends on, and
  it adapts the damping once per adaptation (it runs only while an
  evaluation is pending, and clears it).

Calibration, on each burn-in step (the parameters do not move then): the
step's update delta is tried on the step's batch (the variables are set to
w + delta, loss_fn(train_batch) is evaluated, and the variables get back
their exact previous values), rho of that trial is computed as above, and
`damping_adaptation.calibrated_damping` moves the damping (bisection in log
space towards rho between the thresholds). The inverses are recomputed on
every burn-in step, with the damping of that step.

Under several replicas (tf.distribute) the losses are reduced across the
replicas (the passed loss summed, following the gradients' convention;
loss_fn's value averaged with the replicas' batch sizes as weights). A
reduction cannot run inside a plain conditional there, so the rule's
conditionals that evaluate loss_fn are taken for all replicas at once
(collective.cross_replica_cond), and loss_fn still runs on adaptation steps
only. The damping calibration moves the (mirrored) model variables inside a
conditional and is not supported with several replicas.

Only the chief (is_chief=True) adapts or calibrates the damping. The
damping lives in a float64 state variable (`adaptive/damping`), or in the
scalar variable passed as `damping`, floored at min_damping; the
preconditioner adds l2_reg to it, so the effective damping never falls
below l2_reg + min_damping * precon_damping_mult. With relative_min_damping
r the floor is max(min_damping, r * curvature scale), the scale being the
mean eigenvalue of the K-FAC curvature read from the factors' traces
(recipe/scale.py), evaluated when the rule runs.
"""

import tensorflow as tf

from kfac.python.ops.adaptive import damping_rule as damping_adaptation
from kfac.python.ops.tensors import utils
from kfac.python.ops.distribute import collective
from kfac.python.ops.adaptive.recipe import scale
from kfac.python.ops.compat_utils import introspection


class AdaptiveDampingMixin:
  """The damping rule and the damping calibration (module docstring)."""

  def set_loss(self, loss):
    """The loss before the update for the damping rule (use_passed_loss);
    in a tf.function call it on every trace. `minimize` sets it too."""
    self._loss = loss

  def set_train_batch(self, train_batch):
    """The batch loss_fn evaluates (a structure of tensors or a callable
    returning one); in a tf.function call it on every trace."""
    self._train_batch = train_batch

  def set_prev_train_batch(self, prev_train_batch):
    """The previous step's batch (update_damping_immediately=False)."""
    self._prev_train_batch = prev_train_batch

  def set_train_batch_loss(self, loss):
    """loss_fn(train_batch) at the current parameters, already computed in
    this trace (e.g. the training forward pass's own loss, when loss_fn
    replays that pass), or None.

    With use_passed_loss=False the rule and the calibration then take it as
    the loss before the update instead of evaluating loss_fn(train_batch)
    once more: the same value, without another forward pass of the model
    in the graph and at run time. It must be exactly that value (same
    batch, same parameters, same random draws). One replica only; in a
    tf.function call it on every trace (a tensor of another graph is not
    used)."""
    if loss is not None and collective.is_distributed():
      raise ValueError(
          "set_train_batch_loss is for one replica: under several replicas "
          "loss_fn(train_batch) is evaluated and averaged across them.")
    self._train_batch_loss = (
        None if loss is None else
        (tf.compat.v1.get_default_graph(), loss))

  # ------------------------------------------------------------ losses
  def _adaptation_step(self):
    counter = tf.convert_to_tensor(self.counter)
    now = tf.equal(counter % self.config.damping.damping_adaptation_interval, 0)
    # Under several replicas a step's commit is built unconditionally and
    # says whether it applies (not during burn-in): see
    # optimizers/replicated.py.
    active = getattr(self, "_commit_active", None)
    return now if active is None else tf.logical_and(now, active)

  @staticmethod
  def _batch(batch):
    return batch() if callable(batch) else batch

  def _checked_batch(self, batch, what):
    batch = self._batch(batch)
    if batch is None:
      raise ValueError(
          "The damping rule evaluates loss_fn(%s), but %s is not set: pass "
          "it to the constructor or call set_%s(...) (in a tf.function, on "
          "every trace)." % (what, what, what))
    return batch

  def _loss_value(self, batch, examples=None):
    """loss_fn(batch) in float64; under several replicas averaged across
    them with the replicas' batch sizes `examples` as weights."""
    value = tf.cast(self._loss_fn(batch), tf.float64)
    if collective.is_distributed():
      (value,) = collective.all_reduce([value], collective.MEAN,
                                       weight=examples)
    return value

  def _evaluate_loss_fn(self, batch, what):
    """loss_fn(batch) now (one replica: the calibration)."""
    return self._loss_value(self._checked_batch(batch, what))

  def _given_train_batch_loss(self):
    """The float64 loss set by set_train_batch_loss in this trace (in the
    current graph or one enclosing it), or None."""
    given = getattr(self, "_train_batch_loss", None)
    if given is None:
      return None
    graph, loss = given
    current = tf.compat.v1.get_default_graph()
    while current is not None and current is not graph:
      current = getattr(current, "outer_graph", None)
    if current is None:
      return None  # set in another trace
    return tf.cast(loss, tf.float64)

  def _loss_before_update(self):
    """loss_fn(train_batch) before the update: the loss set by
    set_train_batch_loss, else evaluated now."""
    given = self._given_train_batch_loss()
    if given is not None:
      return given
    return self._evaluate_loss_fn(self._train_batch, "train_batch")

  def _cond_with_loss(self, pred, batch, what, make_op, args=()):
    """An op that, when `pred` holds, evaluates loss_fn(batch) and runs
    make_op(loss, *args). Under several replicas the reduction of the loss
    needs the conditional taken for all replicas at once
    (collective.cross_replica_cond), so everything per-replica that
    make_op uses comes in `args`."""
    batch = self._checked_batch(batch, what)
    if not collective.is_distributed():
      return utils.cond_op(
          pred, lambda: make_op(self._loss_value(batch), *args))
    examples = self._require_estimator().replica_examples()

    def branch(batch, examples, *args):
      return make_op(self._loss_value(batch, examples), *args)
    return collective.cross_replica_cond(pred, branch,
                                         (batch, examples) + tuple(args))

  def _passed_loss_value(self):
    loss = self._loss if self._loss is not None else self._passed_loss
    if loss is None:
      raise ValueError(
          "The damping rule needs the loss before the update: use "
          "minimize(loss), pass loss=... / call set_loss(loss), or pass "
          "use_passed_loss=False to evaluate loss_fn(train_batch).")
    loss = utils.cast(loss, tf.float64)
    if collective.is_distributed():
      loss = collective.all_reduce_one(loss, collective.SUM)
    return loss

  def _loss_before(self):
    if self.config.damping.use_passed_loss:
      return self._passed_loss_value()
    return tf.convert_to_tensor(self._store.get_or_create(
        "adaptive/loss_before", [], tf.float64))

  def _model_change_op(self, update):
    """(predicted change, ops recording it) for use inside a branch."""
    change = update.predicted_change()
    if update.model_change is not None:  # recorded with the step
      return change, []
    return change, [self._record("qmodel_change").assign(change)]

  # ------------------------------------------------------------ the rule
  def _damping_floor(self):
    """The damping's floor (float64): min_damping, or with
    relative_min_damping r the larger of it and r * the curvature scale
    (the mean eigenvalue of the K-FAC curvature, recipe/scale.py)."""
    floor = tf.constant(float(self.config.damping.min_damping), tf.float64)
    if self.config.damping.relative_min_damping is None:
      return floor
    curvature = scale.curvature_scale(self._require_estimator().blocks)
    return tf.maximum(floor, float(self.config.damping.relative_min_damping) * curvature)

  def _apply_rule(self, loss_before, loss_after, model_change, counter,
                  extra_ops=()):
    """Ops that set rho and the new damping."""
    rho = damping_adaptation.reduction_ratio(loss_before, loss_after,
                                             model_change)
    new = damping_adaptation.adapted_damping(
        self._damping, rho, self.config.damping.damping_adaptation_decay,
        self.config.damping.damping_adaptation_interval, self.config.damping.damping_increase_rho_threshold, self.config.damping.damping_decrease_rho_threshold,
        self._damping_floor())
    ops = [self._record("rho").assign(rho),
           self._damping.assign(tf.cast(new, self._damping.dtype))]
    ops.extend(extra_ops)
    if self.config.damping.print_logs:
      ops.append(tf.print("kfac step", counter, "rho", rho, "damping", new,
                          "qmodel_change", model_change, "loss before",
                          loss_before, "after", loss_after))
    return tf.group(*ops)

  def _adaptation_before_update(self, update):
    """Ops to run before the variables change (see the module docstring)."""
    del update  # the ops only need to run before the variables change
    if not (self.config.damping.adapt_damping and self.config.placement.is_chief):
      return []
    ops = []
    adapt_now = self._adaptation_step()
    if not self.config.damping.use_passed_loss:
      keep = self._store.get_or_create("adaptive/loss_before", [], tf.float64)
      given = self._given_train_batch_loss()
      if given is not None:  # no evaluation needed
        ops.append(utils.cond_op(adapt_now, lambda: keep.assign(given)))
      else:
        ops.append(self._cond_with_loss(adapt_now, self._train_batch,
                                        "train_batch", keep.assign))
    return ops

  # ------------------------------------------------------ delayed rule
  def maybe_pre_update_adapt_damping(self):
    """kfac 0.2.x's op that adapts the damping at the start of a step.

    With adapt_damping=True and update_damping_immediately=False (on the
    chief), on the step after a damping adaptation step it evaluates
    loss_fn(prev_train_batch) at the current parameters and moves the
    damping (module docstring). The training step built by minimize /
    apply_gradients runs this same op first, so a script need not run it;
    one that does, as kfac 0.2.x told (every session.run, before the
    inverse updates), adapts the damping once, not twice. Otherwise (and
    on workers that are not the chief) it returns tf.no_op(), as kfac
    0.2.x did. In a TF1 graph or inside a tf.function (one op per graph).
    """
    ops = self._pre_update_ops()
    return ops[0] if ops else tf.no_op()

  def _pre_update_ops(self):
    """[the delayed rule's op of the current graph] (made once per graph
    and replica), or [] when there is no delayed rule."""
    if not (self.config.damping.adapt_damping and self.config.placement.is_chief and
            not self.config.damping.update_damping_immediately):
      return []
    self._check_graph_mode("maybe_pre_update_adapt_damping")
    if (collective.is_distributed() and
        tf.distribute.in_cross_replica_context()):
      raise ValueError(
          "maybe_pre_update_adapt_damping() under a tf.distribute strategy "
          "must be called inside the replica function (strategy.run), like "
          "minimize; the training step runs it anyway.")
    graph = tf.compat.v1.get_default_graph()
    cached = self._pre_update_op
    if cached is not None and cached.graph is graph:
      return [cached]
    with tf.name_scope(self.get_name() + "_pre_update_adapt_damping"):
      op = tf.group(self._delayed_rule_op())
    self._pre_update_op = op
    return [op]

  def _delayed_rule_op(self):
    """When an evaluation is pending: loss_fn(prev_train_batch) now, the
    rule against the kept loss and predicted change, pending cleared."""
    pending = self._store.get_or_create("adaptive/pending", [], tf.int64)
    prev_loss = self._store.get_or_create("adaptive/prev_loss", [],
                                          tf.float64)
    prev_change = self._store.get_or_create("adaptive/prev_change", [],
                                            tf.float64)
    counter = tf.convert_to_tensor(self.counter)

    def evaluate_previous(after, counter):
      with tf.control_dependencies([self._apply_rule(
          tf.convert_to_tensor(prev_loss), after,
          tf.convert_to_tensor(prev_change), counter)]):
        return pending.assign(0)

    return self._cond_with_loss(
        tf.greater(tf.convert_to_tensor(pending), 0),
        self._prev_train_batch, "prev_train_batch", evaluate_previous,
        (counter,))

  def _adaptation_after_update(self, update, step_op):
    """Runs after `step_op` (the variables have changed)."""
    if not (self.config.damping.adapt_damping and self.config.placement.is_chief):
      return step_op
    adapt_now = self._adaptation_step()
    counter = tf.convert_to_tensor(self.counter)
    with tf.control_dependencies([step_op]):
      # Read after step_op, which waits for the ops that store the loss
      # before the update (use_passed_loss=False).
      before = self._loss_before()
      if self.config.damping.update_damping_immediately:
        return self._cond_with_loss(
            adapt_now, self._train_batch, "train_batch",
            lambda after, before, change, counter: self._immediate_rule(
                update, after, before, change, counter),
            (before, update.predicted_change(), counter))

      def keep():
        change, records = self._model_change_op(update)
        store = self._store
        return tf.group(
            store.get("adaptive/prev_loss").assign(before),
            store.get("adaptive/prev_change").assign(change),
            store.get("adaptive/pending").assign(1), *records)
      return utils.cond_op(adapt_now, keep)

  def _immediate_rule(self, update, after, before, change, counter):
    """The rule's ops of an adaptation step (update_damping_immediately),
    given the loss after the update; `change` is update.predicted_change()
    (passed in: under several replicas it comes into the branch as an
    argument)."""
    records = ([self._record("qmodel_change").assign(change)]
               if update.model_change is None else [])  # else recorded
    return self._apply_rule(before, after, change, counter, records)

  # ------------------------------------------------------------ calibration
  def _calibration_op(self, update):
    """One calibration step (module docstring): an op that tries `update`,
    restores the variables and moves the damping."""
    if not self.config.placement.is_chief:
      return tf.no_op()
    before, saved, trial = self._calibration_trial(update)
    with tf.control_dependencies([trial]):
      after = self._evaluate_loss_fn(self._train_batch, "train_batch")
    return self._calibration_finish(update, before, after, saved)

  def _calibration_trial(self, update):
    """(loss before, the variables' values before, the op that sets the
    variables to w + delta after reading both)."""
    variables = [v for _, v in update.deltas]
    deltas = [tf.convert_to_tensor(d) for d, _ in update.deltas]
    if self.config.damping.use_passed_loss:
      before = self._passed_loss_value()
    else:
      before = self._loss_before_update()
    # Copies: a TF1 reference variable's read would show the trial's values
    # after the trial's assign_add (introspection.value_copy).
    saved = [introspection.value_copy(v) for v in variables]
    with tf.control_dependencies(saved + [before]):
      trial = tf.group(*[v.assign_add(d) for d, v in zip(deltas, variables)])
    return before, saved, trial

  def _calibration_finish(self, update, before, after, saved):
    """After the trial's loss `after`: the variables restored to `saved`
    and the damping moved (an op)."""
    counter = tf.convert_to_tensor(self.counter)
    variables = [v for _, v in update.deltas]
    with tf.control_dependencies([after]):
      restored = tf.group(*[v.assign(s) for v, s in zip(variables, saved)])
    change = update.predicted_change()  # no commit records it now
    records = [self._record("qmodel_change").assign(change)]
    rho = damping_adaptation.reduction_ratio(before, after, change)
    log_step = self._store.get_or_create(
        "calibration/log_step", [], tf.float64,
        initial_value=damping_adaptation.CALIBRATION_INITIAL_LOG_STEP)
    direction = self._store.get_or_create("calibration/direction", [],
                                          tf.float64)
    new, new_step, new_direction = damping_adaptation.calibrated_damping(
        self._damping, rho, log_step, direction, self.config.damping.damping_increase_rho_threshold,
        self.config.damping.damping_decrease_rho_threshold, self._damping_floor())
    with tf.control_dependencies([restored]):
      ops = [self._damping.assign(tf.cast(new, self._damping.dtype)),
             log_step.assign(new_step), direction.assign(new_direction),
             self._record("rho").assign(rho)] + records
      if self.config.damping.print_logs:
        ops.append(tf.print("kfac burn-in step", counter, "rho", rho,
                            "damping", new, "qmodel_change", change,
                            "loss before", before, "after", after))
      return tf.group(*ops)
