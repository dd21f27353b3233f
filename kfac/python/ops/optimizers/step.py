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
given in `Parts`; each is an object with a small interface, and all but the
damping live in this module, in the order a step uses them:
* `compute_update`: grads_and_vars -> `Update`, the change of every
  variable, without changing any state (`UpdateRule` and `Velocities`: the
  momentum types "regular" and "adam"; or the quadratic model,
  adaptive/quadratic_model.py);
* `guard` (`StepGuard`): the non-finite checks of the loss, the gradients,
  the statistics and the update;
* `damping` (adaptive/quadratic_model.DampingController): the damping, its
  rule and its calibration (`shares_evaluation`, `calibration_op`);
* `commit` (`Commit`): the op that carries out an Update, with the damping
  rule's ops around it (`commit`, `commit_sharing_evaluation`) and the
  values kept readable (`Records`);
* `counters` (`Counters`): the step counters.
"""

from typing import Any, Callable, NamedTuple, Optional

import tensorflow as tf

from kfac.python.ops.distribute import collective
from kfac.python.ops.layers.dense import factored_grads
from kfac.python.ops.numerics.inner_products import gram64
from kfac.python.ops.optimizers import config as config_lib
from kfac.python.ops.optimizers import sparse
from kfac.python.ops.reliability import nonfinite
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
  """The non-finite guard (`StepGuard`)."""
  passed_loss: Any
  """The loss of this step (checked by the guard), or None."""
  gradient_operands: Callable[[Any], Any]
  """grads_and_vars -> {var ref: (x, d)} of factored weight gradients."""
  compute_update: Callable[[Any], Any]
  """grads_and_vars -> Update, without changing any state."""
  damping: Any
  """The damping controller (adaptive/quadratic_model.py: the rule and
  the calibration)."""
  commit: Any
  """The commit (`Commit`: the op that carries out an
  update, with the damping rule around it)."""
  counters: Any
  """The step counters (`Counters`)."""
  switch: Any = None
  """The switch to the minibatch recipe (adaptive/recipe/switch.py), whose
  periods replace `periods`' once it is active; None: no switch."""


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
    restarted = []
    if parts.switch is not None:
      # The minibatch recipe calibrates nothing; its first step restarts
      # from its own damping (adaptive/recipe/switch.py).
      if calibrating is not None:
        calibrating = tf.logical_and(calibrating,
                                     tf.logical_not(parts.switch.active()))
      restarted = [parts.switch.restart_damping(parts.damping.damping)]
    # 1. Statistics.
    with tf.control_dependencies(restarted):
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
  do_cov = tf.equal(counter % _period(parts, "cov_update_every"), 0)
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
      True if periods.cov_update_every == 1 and parts.switch is None
      else do_cov, gate,
      scope=parts.scope,
      conditional_reduction=periods.cov_update_every > 1)


def _inverses(parts, periods, counter, in_burnin, calibrating, ok):
  """The inverses' update of this step (an op)."""
  est = parts.estimator
  do_inv = tf.logical_and(
      tf.logical_not(in_burnin),
      tf.equal(counter % _period(parts, "invert_every"), 0))
  if calibrating is not None:
    do_inv = tf.logical_or(calibrating, do_inv)
  if parts.switch is not None:  # with the restarted damping
    do_inv = tf.logical_or(parts.switch.first_step(), do_inv)
  if ok is not None:
    do_inv = tf.logical_and(do_inv, ok)
  # Inverse updates that talk to other replicas (replica_round_robin) need
  # the conditional taken for all replicas at once.
  cond = (collective.cross_replica_cond
          if est.inverse_update_uses_collectives else utils.cond_op)
  return cond(do_inv, lambda: est.inverse_update_op(scope=parts.scope))


def _period(parts, name):
  """The period `name` of this step: the optimizer's, or the minibatch
  recipe's once the switch is active (an int64 tensor then)."""
  mine = getattr(parts.periods, name)
  if parts.switch is None:
    return mine
  return parts.switch.pick(mine, getattr(parts.switch.phase, name), tf.int64)


def _commit(parts, update, trial, active):
  """The calibration's trial (burn-in), the commit and the damping rule."""
  if parts.damping.shares_evaluation(trial):
    # The calibration's trial and the damping rule evaluate the loss in
    # one conditional (adaptive/py).
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


# --------------------------------------------------------------------------
# The Update: what one K-FAC step does, built before any state changes.
#
# `KfacOptimizer._compute_update` (the `UpdateRule` below, or the quadratic
# model in adaptive/quadratic_model.py) fills one in without touching any
# state; `Commit` (below) then carries it out.


def read(value):
  """A hyperparameter's value now: a callable (not a variable) is called
  (a schedule, or a function the user gave)."""
  return value() if callable(value) and not isinstance(
      value, tf.Variable) else value


class Update:
  """The changes of one step (see the module docstring)."""

  def __init__(self):
    self.deltas = []            # (change, variable): variable += change
    # (change, variable) of the decoupled weight decay (weight_decay.py),
    # applied after the damping rule's evaluation; not part of the step
    # the quadratic model and the damping rule see.
    self.decay_deltas = []
    self.velocity_assigns = []  # (velocity variable, new value)
    self.grads = []             # the gradients (dense)
    self.precon = None          # (preconditioned vector, variable)
    self.records = {}           # name -> float64 value to keep readable
    self.model_change = None    # q(delta) for the damping rule, or
    self.model_change_fn = None  # a function building it where it is used
    self.checks = []            # assertions of tensor hyperparameters

  def predicted_change(self):
    """q(delta): the tensor computed with the update, or built now (inside
    the branch of a step that uses it)."""
    if self.model_change is not None:
      return self.model_change
    if self.model_change_fn is None:
      raise ValueError("This update has no predicted change.")
    return self.model_change_fn()

  def decay_inputs(self):
    """The decay's changes, computed from the variables before the step:
    the step's assignments must wait for them."""
    return [d for d, _ in self.decay_deltas]

  def dependencies(self):
    """The tensors of the update (to order state changes after them)."""
    out = [d.values if sparse.is_slices(d) else d for d, _ in self.deltas]
    out.extend(d for d, _ in self.decay_deltas)
    out.extend(self.checks)
    if self.model_change is not None:
      out.append(self.model_change)
    return out


# --------------------------------------------------------------------------
# The update rules: KfacOptimizer's "regular" and "adam", with the norm
# constraint, decoupled weight decay and the velocities (momentum).
#
# With g the gradient, F^-1 the damped approximate inverse Fisher (damping *
# precon_damping_mult + l2_reg on the diagonal), mu the momentum, eta the
# learning rate and v the velocity:
#
# * "regular": p = F^-1 g (then norm constraint), v <- mu v + p, step = v.
# * "adam":    v <- mu v + g, p = F^-1 v (then norm constraint), step = p.
#
# then step += weight_decay_coeff * w with use_weight_decay (kfac 0.2.x's
# weight decay) and the change of w is -eta * step. (AdamW's
# decoupled_weight_decay is added apart from the step: weight_decay.py.)
# The norm constraint scales p by
# min(1, sqrt(C / (eta^2 <g', p>))) where g' is the vector p came from, so the
# approximate squared Fisher norm of the update is at most C. ("qmodel" /
# "qmodel_fixedmu": adaptive/quadratic_model.py.)
#
# Sparse gradients (`tf.IndexedSlices`, optimizers/sparse.py): with a Python
# momentum of 0 the step stays sparse (it is applied to the touched rows
# only). With momentum, the velocity is dense (every row decays): it is
# updated as mu * v followed by a scatter-add of the slices, so the dense
# gradient is never built, but the step is dense. use_weight_decay
# touches every row, so it densifies the step (decoupled_weight_decay is a
# dense change of its own). The norm constraint's
# <g', p> is computed on the slices after summing duplicate indices.
#
# Nothing here changes state: the rule fills an `Update` that `Commit`
# carries out. Two parts of the step live here: `Velocities`, the momentum's
# state of each variable (shared with the quadratic model), and
# `UpdateRule`, the rule itself.


class Velocities:
  """The velocity (momentum state) of each variable, in the StateStore
  under a name made from the variable's (made unique once per variable)."""

  def __init__(self, store):
    self._store = store
    self._keys = {}

  def key(self, var):
    key = self._keys.get(var.ref())
    if key is None:
      used = set(self._keys.values())
      base = "velocity/" + utils.state_name(var)
      key, i = base, 1
      while key in used:
        key = "%s_%d" % (base, i)
        i += 1
      self._keys[var.ref()] = key
    return key

  def get(self, var):
    return self._store.get_or_create(self.key(var), var.shape,
                                     var.dtype.base_dtype)


class UpdateRule:
  """The momentum types "regular" and "adam" (module docstring)."""

  def __init__(self, settings, velocities, learning_rate, momentum):
    """settings: a config.UpdateRuleConfig; velocities: a `Velocities`;
    learning_rate, momentum: numbers, tensors, variables or callables
    (schedules) read when the step is built."""
    self._settings = settings
    self._velocities = velocities
    self._learning_rate = learning_rate
    self._momentum = momentum

  def compute(self, grads_and_vars, estimator, update, read_once=False,
              restart=None):
    """Fills `update` with the step of momentum "regular" / "adam";
    `read_once`: nothing but the preconditioning reads the gradients
    (factored_grads/match.py); `restart`: a boolean tensor, True where the
    velocities are taken as zero (the automatic recipe's first minibatch
    step, adaptive/recipe/switch.py)."""
    settings = self._settings
    update.grads = [tf.convert_to_tensor(g) for g, _ in grads_and_vars]
    if settings.momentum_type == "regular":
      with factored_grads.gradients_read_only_here(read_once):
        precon = estimator.multiply_inverse(grads_and_vars)
      if settings.norm_constraint is not None:
        precon = self.clip(grads_and_vars, precon)
      steps = self.new_velocities(precon, self._momentum, update, restart)
      update.precon = precon
    else:  # adam
      velocities = self.new_velocities(grads_and_vars, self._momentum,
                                       update, restart)
      steps = estimator.multiply_inverse(velocities)
      if settings.norm_constraint is not None:
        steps = self.clip(velocities, steps)
      update.precon = steps
    if settings.use_weight_decay:
      coeff = read(settings.weight_decay_coeff)
      steps = [(sparse.dense(s) + utils.cast(coeff, v.dtype) * v, v)
               for s, v in steps]
    lr = read(self._learning_rate)
    update.deltas = [(sparse.scale(s, -utils.cast(lr, v.dtype)), v)
                     for s, v in steps]

  # ------------------------------------------------------------ velocities
  def new_velocities(self, vecs_and_vars, decay, update, restart=None):
    """decay * v + vec for each variable: returns the new velocities and
    adds their assignments to `update`; with `restart` (a boolean tensor)
    true, v is taken as zero."""
    out = []
    decay = read(decay)
    for vec, var in vecs_and_vars:
      if (sparse.is_slices(vec) and utils.is_python_number(decay) and
          decay == 0):
        out.append((vec, var))  # no momentum: the step stays sparse
        continue
      velocity = self._velocities.get(var)
      old = tf.convert_to_tensor(velocity)
      if restart is not None:
        old = old * tf.cast(tf.logical_not(restart), old.dtype)
      new = utils.cast(decay, velocity.dtype) * old
      if sparse.is_slices(vec):
        new = tf.tensor_scatter_nd_add(new, vec.indices[:, tf.newaxis],
                                       vec.values)
      else:
        new = new + vec
      update.velocity_assigns.append((velocity, new))
      out.append((new, var))
    return out

  def update_velocities(self, vecs_and_vars, decay, vec_coeff=1.0):
    """kfac 0.2.x helper: assigns v <- decay * v + vec_coeff * vec to each
    variable's velocity now; returns [(new velocity, var)] (reading a new
    velocity runs its assignment)."""
    out = []
    decay = read(decay)
    for vec, var in vecs_and_vars:
      velocity = self._velocities.get(var)
      new = (utils.cast(decay, velocity.dtype) * velocity +
             utils.cast(vec_coeff, velocity.dtype) * tf.convert_to_tensor(vec))
      with tf.control_dependencies([velocity.assign(new)]):
        out.append((tf.identity(new), var))
    return out

  # ------------------------------------------------------------ norm constraint
  @staticmethod
  def squared_fisher_norm(vecs_and_vars, precon_and_vars):
    terms = [tf.cast(sparse.inner(v, p), tf.float64)
             for (v, _), (p, _) in zip(vecs_and_vars, precon_and_vars)]
    return tf.add_n(terms)

  def clip_coeff(self, vecs_and_vars, precon_and_vars):
    """min(1, sqrt(C / (lr^2 <v, F^-1 v>))) (float64; 1 when the norm is
    0), the factor that puts the update on the norm constraint C."""
    lr = utils.cast(read(self._learning_rate), tf.float64)
    sq_norm = self.squared_fisher_norm(vecs_and_vars, precon_and_vars)
    bound = utils.cast(read(self._settings.norm_constraint),
                       tf.float64)
    sq_update = lr * lr * sq_norm
    one = tf.ones_like(sq_update)
    positive = sq_update > 0
    return tf.where(
        positive,
        tf.minimum(one, tf.sqrt(bound / tf.where(positive, sq_update, one))),
        one)

  def clip(self, vecs_and_vars, precon_and_vars):
    """Scales the preconditioned vectors so that lr^2 <v, F^-1 v> <= C."""
    coeff = self.clip_coeff(vecs_and_vars, precon_and_vars)
    return [(sparse.scale(p, tf.cast(coeff, p.dtype)), v)
            for p, v in precon_and_vars]


# --------------------------------------------------------------------------
# The non-finite guard of a K-FAC step (reliability/nonfinite.py,
# docs/reliability.md): a step whose loss, gradients, statistics or update
# are not all finite changes no variable and is counted as skipped.
#
# `StepGuard` is the part of the step that says which
# values are checked; with `skip_non_finite_steps=False` it checks nothing
# and the step is always taken.


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


# --------------------------------------------------------------------------
# The commit: carrying out a K-FAC step. The `Update` becomes
# the ops that change the velocities and the variables (with the damping
# rule's ops before and after, adaptive/), then the step counters.
#
# A step is built in two halves: `_compute_update` makes the change of every
# variable without touching any state, and `Commit.commit` applies it, only
# when a boolean `active` holds if one is given (the non-finite guard's
# verdict, `StepGuard`). A sparse change (`tf.IndexedSlices`)
# is applied with `scatter_add` to the touched rows only. Under several
# replicas the model's variables change through a merge_call
# (`Commit.commit_replicated`; optimizers/replicated.py). `Counters` counts
# the steps.


def assign_add(var, delta):
  return var.assign_add(delta)


class Commit:
  """The part of the step that carries out an
  `Update`: `commit` (with the damping rule's ops before and after it and
  the decoupled weight decay after them), `step_op` (one replica, the
  update alone) and `commit_replicated` (several replicas)."""

  def __init__(self, damping, weight_decay, records):
    """damping: the adaptive/quadratic_model.DampingController;
    weight_decay: the optimizers/weight_decay.WeightDecay; records: the
    `Records`."""
    self._damping = damping
    self._weight_decay = weight_decay
    self._records = records

  def commit(self, update, active=None):
    """The op that carries out `update` (plus the damping rule); with a
    boolean tensor `active`, only when it holds."""
    if collective.is_distributed():
      return self.commit_replicated(update, active)
    if active is not None:
      return utils.cond_op(active, lambda: self.commit(update))
    step_op = self.step_op(update)
    # The decoupled weight decay after the damping rule (weight_decay.py).
    return self._weight_decay.commit(
        update, self._damping.after_update(update, step_op))

  def step_op(self, update):
    """One replica: the damping rule's ops before the update, then the
    velocities' and the variables' changes (an op)."""
    # The damping rule may change the damping before the variables change:
    # only once everything this step computes from it is ready.
    with tf.control_dependencies(update.dependencies()):
      before = self._damping.before_update(update)
    # The decay is computed from the variables before the step: in a TF1
    # graph nothing else orders those reads before the assignments.
    with tf.control_dependencies(before + update.decay_inputs()):
      ops = [velocity.assign(value)
             for velocity, value in update.velocity_assigns]
      for delta, var in update.deltas:
        if sparse.is_slices(delta):
          ops.append(var.scatter_add(delta))
        else:
          ops.append(var.assign_add(delta))
      ops.extend(self._records.ops(update))
      return tf.group(*ops)

  def commit_sharing_evaluation(self, update, trial, active):
    """The commit whose damping rule shares one loss evaluation with the
    calibration's trial (adaptive/py)."""
    return commit_sharing_evaluation(
        self._damping, self.step_op, self._weight_decay.commit, update,
        trial, active)

  def commit_replicated(self, update, active):
    """`commit` under several replicas: the K-FAC state (replica-local)
    changes inside the conditions; the model's mirrored variables through
    one merge_call outside them (a zero change when `active` is false).
    The damping rule's conditions include `active`."""
    self._damping.commit_active = active
    with tf.control_dependencies(update.dependencies()):
      before = self._damping.before_update(update)
    with tf.control_dependencies(before):
      def state_ops():
        ops = [velocity.assign(value)
               for velocity, value in update.velocity_assigns]
        ops.extend(self._records.ops(update))
        return tf.group(*ops)
      if active is None:
        state_op = state_ops()
      else:
        state_op = utils.cond_op(active, state_ops)
    updates = []
    # (After the decay's reads of the variables, as in step_op.)
    with tf.control_dependencies([state_op] + update.decay_inputs()):
      for delta, var in update.deltas:
        delta = tf.identity(sparse.dense(delta))
        if active is not None:
          delta = tf.where(active, delta, tf.zeros_like(delta))
        updates.append((assign_add, var, (delta,)))
    with tf.name_scope("apply_to_replicas"):
      step_op = collective.apply_updates(updates)
    result = self._weight_decay.commit(
        update, self._damping.after_update(update, step_op), active)
    self._damping.commit_active = None
    return result


class Counters:
  """The step counters (a part of the step): `counter`
  (steps taken), `burnin_counter` (burn-in steps of the periodic
  optimizer) and `finish`, which advances them after a step."""

  def __init__(self, store, guard):
    """store: the optimizer's StateStore; guard: its `StepGuard`
    (which counts skipped steps)."""
    self._store = store
    self._guard = guard

  @property
  def counter(self):
    return self._store.get_or_create("counter", [], tf.int64)

  @property
  def burnin_counter(self):
    return self._store.get_or_create("burnin_counter", [], tf.int64)

  def finish(self, step_op, global_step, active=None, checks=None, ok=None):
    """After `step_op`: counter += 1 and global_step += 1 (with a boolean
    tensor `active`, only when it holds: burn-in steps and skipped steps
    count neither); with the guard's `checks`, the step is counted as
    skipped unless `ok` (nonfinite.NonFiniteGuard.record)."""
    if checks is not None:
      with tf.control_dependencies([step_op]):
        step_op = self._guard.record(ok, checks, self.counter)
    with tf.control_dependencies([step_op] + _global_step_reads(global_step)):
      def one(dtype):
        if active is None:
          return tf.ones([], dtype)
        return tf.cast(active, dtype)
      incs = [self.counter.assign_add(one(tf.int64))]
      if global_step is not None:
        inc = one(global_step.dtype.base_dtype)
        if collective.is_distributed():
          incs.append(collective.apply_updates(
              [(assign_add, global_step, (tf.identity(inc),))]))
        else:
          incs.append(global_step.assign_add(inc))
      return tf.group(*incs)


# tf.compat.v1.train's collection of the global step's cached read (the
# value Estimator's and MonitoredSession's hooks fetch).
_GLOBAL_STEP_READ_KEY = "global_step_read_op_cache"


def _global_step_reads(global_step):
  """The cached read of the graph's global step (TF1), to increment it
  after: the hooks that fetch it beside the training op then see the step
  before the increment in every run, as TensorFlow's own
  _increment_global_step orders it (unordered, either value could be
  read)."""
  if global_step is None or tf.executing_eagerly() or tf.inside_function():
    return []
  graph = tf.compat.v1.get_default_graph()
  if tf.compat.v1.train.get_global_step(graph) is not global_step:
    return []
  return [t for t in graph.get_collection(_GLOBAL_STEP_READ_KEY)
          if isinstance(t, tf.Tensor)]


# --------------------------------------------------------------------------
# The commit sharing one evaluation of the loss after the update between
# the calibration and the damping rule.
#
# With `calibrate_damping=True` and the immediate damping rule
# (`adapt_damping=True`, `update_damping_immediately=True`, the default
# recipe) a training step holds two evaluations of loss_fn(train_batch) at
# changed variables: the burn-in calibration's trial (w + delta, then
# restored) and the rule's loss after the update. They never run in the same
# step (the calibration runs on burn-in steps, the update after them), but
# each was a conditional of its own with its own copy of the model's forward
# pass in the graph: on a keras.applications model some 3k ops traced,
# optimized and placed for nothing on every first call.
#
# `commit_sharing_evaluation` builds the step's tail with one evaluation,
# for one replica (the calibration is not supported under several):
#
# 1. on a calibration step, the trial: the variables' values kept (as the
#    outputs of a conditional; a step without a trial keeps nothing) and
#    the variables set to w + delta;
# 2. the update itself (`active`: after burn-in, finite values), without
#    the rule;
# 3. loss_fn(train_batch), in one conditional taken on a calibration step or
#    an adaptation step of the rule;
# 4. the calibration's end (the variables restored, the damping moved), the
#    rule, and the decoupled weight decay, each in its conditional.
#
# The values are those of the separate evaluations (the tests compare every
# variable and the damping in float64, in TF1 Sessions and tf.functions).


def commit_sharing_evaluation(damping, step_op, commit_decay, update, trial,
                              active):
  """The op of steps 1-4 of the module docstring. `damping`: the step's
  adaptive/quadratic_model.DampingController; `step_op(update)`: the
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


# --------------------------------------------------------------------------
# The records: the values an optimizer keeps readable after each step
# (learning rate, momentum, rho, qmodel_change, norms): `Records`, a part of
# the step, in the optimizer's StateStore under "records/".


# Values an optimizer keeps readable after each step, with their initial
# value (NaN: not computed yet).
RECORDS = {
    "learning_rate": 0.0,
    "momentum": 0.0,
    "qmodel_change": float("nan"),
    "rho": float("nan"),
    "grad_norm": float("nan"),
    "precon_grad_norm": float("nan"),
    "update_norm": float("nan"),
}
NORM_RECORDS = ("grad_norm", "precon_grad_norm", "update_norm")


class Records:
  """The records of a step, as float64 state variables."""

  def __init__(self, store, compute_norm_stats=False):
    """store: the optimizer's StateStore; compute_norm_stats: whether each
    step records its norms (grad_norm, precon_grad_norm, update_norm)."""
    self._store = store
    self._compute_norm_stats = compute_norm_stats

  def get(self, name):
    """The variable of the record `name` (one of RECORDS)."""
    return self._store.get_or_create("records/" + name, [], tf.float64,
                                     initial_value=RECORDS[name])

  def ops(self, update):
    """The assignments of the records of `update` (a step's Update)."""
    for name in RECORDS:  # all readable from the first step on
      self.get(name)
    if self._compute_norm_stats:
      deltas = [tf.convert_to_tensor(d) for d, _ in update.deltas]
      inner = gram64([update.grads, [p for p, _ in update.precon], deltas])
      for i, name in enumerate(("grad_norm", "precon_grad_norm",
                                "update_norm")):
        update.records[name] = tf.sqrt(inner[i][i])
    if update.model_change is not None:
      update.records["qmodel_change"] = update.model_change
    return [self.get(name).assign(utils.cast(value, tf.float64))
            for name, value in sorted(update.records.items())]

  def norm_stats(self):
    """{name: float64 tensor} of the norms."""
    return {name: tf.convert_to_tensor(self.get(name))
            for name in NORM_RECORDS}
