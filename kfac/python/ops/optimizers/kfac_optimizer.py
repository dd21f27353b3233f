"""The K-FAC optimizer (layer 7).

`KfacOptimizer` is a `tf.compat.v1.train.Optimizer`: in a TF1 graph it is
used exactly like the old library's (`minimize` / `compute_gradients` /
`apply_gradients`, plus the estimator's update ops). In a TF2 program,
create it once without a layer collection and pass a fresh collection,
built during the trace, to `minimize(..., layer_collection=lc)` inside a
`tf.function`; all state lives in the optimizer's `StateStore` and is found
again on every retrace (see docs/tf2.md).

This module holds the optimizers users construct: `KfacOptimizer`, a
facade that builds its configuration and its parts and composes them into
a step, and `PeriodicInvCovUpdateKfacOpt`, the same facade with periods
(statistics, inverses and burn-in inside `minimize`; kfac 0.2.4's
`kfac_utils/periodic_inv_cov_update_kfac_opt.py` path re-exports it). The
step is one function, `step.build_step` (optimizers/step.py), over parts
that each take what they need explicitly:
* config.py: the typed configuration (`KfacConfig`, kept as
  `optimizer.config`) that the constructor builds from its arguments, with
  every argument check;
* step.py: the rest of the step's parts: the momentum types "regular" and
  "adam" (`UpdateRule`, `Velocities`; with the norm constraint and kfac
  0.2.x's weight decay), the non-finite guard (`StepGuard`), the `Update`
  a step builds without touching any state, the `Commit` that applies it
  (after the damping rule's "before" ops, if any), the `Counters` and the
  `Records` (values readable after a step); sparse gradients: sparse.py;
* adaptive/quadratic_model.py: "qmodel" / "qmodel_fixedmu"
  (`QuadraticModel`) and the damping, its rule (`adapt_damping`) and its
  calibration (`calibrate_damping`) (`DampingController`);
* weight_decay.py: AdamW's decoupled weight decay
  (`decoupled_weight_decay`);
* replicated.py: several replicas (tf.distribute, docs/distributed.md).
"""

import dataclasses

import tensorflow as tf

from kfac.python.ops.adaptive import quadratic_model
from kfac.python.ops.adaptive.recipe import switch as switch_lib
from kfac.python.ops.compat_utils import introspection
from kfac.python.ops.distribute import collective
from kfac.python.ops.distribute import replicas
from kfac.python.ops.estimation import strategies as est_lib
from kfac.python.ops.layers.base import damping as damping_lib
from kfac.python.ops.optimizers import config as config_lib
from kfac.python.ops.optimizers import replicated
from kfac.python.ops.optimizers import sparse
from kfac.python.ops.optimizers import step as step_lib
from kfac.python.ops.optimizers import weight_decay
from kfac.python.ops.reliability import arguments
from kfac.python.ops.tensors import state
from kfac.python.ops.tensors import utils


# The private keyword argument through which PeriodicInvCovUpdateKfacOpt
# gives its config.PeriodicArguments (the signature stays kfac 0.2.x's).
PERIODIC_ARGUMENTS = "_kfac_periodic_arguments"


@utils.exclude_from_autograph
class KfacOptimizer(tf.compat.v1.train.Optimizer):
  """The K-FAC optimizer."""

  # Set while building a step; under MirroredStrategy each replica thread
  # builds its own (see distribute/replicas.py).
  _layers = replicas.PerReplicaAttribute()
  _estimator = replicas.PerReplicaAttribute()
  _qmodel_layers = replicas.PerReplicaAttribute()

  def __init__(self,
               learning_rate,
               damping,
               layer_collection=None,
               cov_ema_decay=0.95,
               var_list=None,
               momentum=0.9,
               momentum_type="adam",
               use_weight_decay=False,
               weight_decay_coeff=0.1,
               qmodel_update_rescale=None,
               norm_constraint=None,
               name="KFAC",
               estimation_mode="gradients",
               colocate_gradients_with_ops=True,
               batch_size=None,
               placement_strategy=None,
               compute_params_stats=False,
               adapt_damping=False,
               update_damping_immediately=True,
               is_chief=True,
               prev_train_batch=None,
               loss=None,
               loss_fn=None,
               min_damping=1e-8,
               l2_reg=0.0,
               damping_adaptation_decay=0.95,
               damping_adaptation_interval=5,
               damping_decrease_rho_threshold=0.75,
               damping_increase_rho_threshold=0.25,
               precon_damping_mult=1.0,
               use_passed_loss=True,
               train_batch=None,
               print_logs=False,
               tf_replicator=None,
               dtype="float32",
               learning_rate_schedule=None,
               momentum_schedule=None,
               damping_schedule=None,
               compute_norm_stats=False,
               always_use_exact_qmodel_for_damping_adjustment=False,
               lazy_statistics_sync=False,
               skip_non_finite_steps=True,
               max_consecutive_skipped_steps=10,
               relative_min_damping=None,
               include_damping_in_qmodel_change=None,
               decoupled_weight_decay=None,
               decoupled_weight_decay_mask=None,
               memory_budget="auto",
               over_budget="raise",
               qmodel_layer_collection=None,
               qmodel_momentum_bound=None,
               **placement_kwargs):
    """Creates the optimizer; see optimizers/step.py for the update
    rule.

    `layer_collection` may be None in TF2 programs, where a collection is
    passed to `minimize` / `apply_gradients` on every trace instead. As in
    kfac 0.2.x, the collection need not be complete yet: it is finalized
    (and checked against the variables) when the optimizer first uses it.

    `var_list` (default: in a TF1 graph the trainable variables when the
    optimizer is created, as in kfac 0.2.x; in a TF2 trace the registered
    variables) must equal the registered variables.

    `skip_non_finite_steps` (default True): a step whose loss, gradients
    or new statistics are not all finite changes no state and no variable;
    it is counted in `skipped_steps`, the first one prints a warning, and
    `max_consecutive_skipped_steps` in a row raise an error naming what was
    not finite (reliability/nonfinite.py, docs/reliability.md). False
    removes the checks (a little faster; one bad batch then poisons the
    statistics).

    `relative_min_damping` (not in kfac 0.2.x; default None): with the
    damping rule or its calibration, the damping never falls below
    relative_min_damping * (mean eigenvalue of the K-FAC curvature, read
    from the factors' traces: recipe.curvature_scale in ops/adaptive) nor
    below min_damping. A floor that follows the curvature's scale, where
    min_damping is absolute (docs/recipe.md).

    `include_damping_in_qmodel_change` (kfac 0.2.x's
    optimizer.set_global_constants option; None: the value set there, else
    False): whether qmodel_change, the predicted change the damping rule
    compares with the actual one, includes the damping term
    (adaptive/quadratic_model.py).

    `decoupled_weight_decay` (not in kfac 0.2.x; default None: none):
    AdamW's weight decay, w <- w - lr * wd * w once per step with this
    step's learning rate (with the quadratic model, the one it chose),
    apart from the gradient, the curvature, the momentum, the quadratic
    model and the damping rule's predicted change; a number >= 0, a
    tensor, a variable or a callable. `decoupled_weight_decay_mask`: a
    callable variable -> bool choosing the decayed variables (default:
    all). Not with use_weight_decay=True (optimizers/weight_decay.py).

    `tf_replicator`: kfac 0.2.x's TF-Replicator object. TF-Replicator no
    longer exists; only None is accepted (use a tf.distribute strategy,
    docs/distributed.md).

    `memory_budget` (default "auto": memory.DEFAULT_BUDGET_FRACTION of the
    machine's physical memory; bytes; None for no check): the most K-FAC's
    state may take, checked from static shapes before it is allocated
    (collection/memory.py, docs/reliability.md "Memory"). Over it,
    `over_budget="raise"` (default) raises a ValueError naming the largest
    layers; "fallback" re-registers them with a cheaper approximation
    (collection/memory_fallback.py).

    `qmodel_layer_collection` (not in kfac 0.2.x; default None): a
    LayerCollection whose registered losses, and nothing else of it, define
    the exact curvature of the quadratic model (momentum types "qmodel*"
    and always_use_exact_qmodel_for_damping_adjustment) in place of
    `layer_collection`'s losses: register the loss on the model's outputs
    for a part of the batch (its first rows, say) and the curvature
    products, the largest cost of an adaptive step, are paid on that part
    only (adaptive/quadratic_model.py; `set_qmodel_layer_collection` sets it per
    trace).

    `qmodel_momentum_bound` (not in kfac 0.2.x; default None: unbounded, as
    there): with momentum_type="qmodel", the momentum the quadratic model
    chooses is kept in [-bound, bound] and the learning rate is then the
    model's best for that momentum: the exact minimiser of the model under
    the bound (adaptive/quadratic_model.py). With |momentum| > 1 the
    velocity can grow geometrically from step to step; the default recipe
    (recipe.adaptive_kwargs, kfac.keras's Kfac(adaptive=True)) bounds it
    by 1 (docs/recipe.md, "The momentum bound").
    """
    config_lib.reject_tf_replicator(tf_replicator)
    super().__init__(use_locking=False, name=name)
    # PeriodicInvCovUpdateKfacOpt's periods and calibration (a
    # config.PeriodicArguments) come as a private keyword argument.
    periodic = placement_kwargs.pop(PERIODIC_ARGUMENTS, None)
    self._config = config_lib.build(
        type(self).__name__, learning_rate=learning_rate, damping=damping,
        cov_ema_decay=cov_ema_decay, momentum=momentum,
        momentum_type=momentum_type, use_weight_decay=use_weight_decay,
        weight_decay_coeff=weight_decay_coeff,
        qmodel_update_rescale=qmodel_update_rescale,
        qmodel_momentum_bound=qmodel_momentum_bound,
        norm_constraint=norm_constraint, name=name,
        estimation_mode=estimation_mode,
        colocate_gradients_with_ops=colocate_gradients_with_ops,
        batch_size=batch_size, placement_strategy=placement_strategy,
        compute_params_stats=compute_params_stats,
        adapt_damping=adapt_damping,
        update_damping_immediately=update_damping_immediately,
        is_chief=is_chief, min_damping=min_damping, l2_reg=l2_reg,
        damping_adaptation_decay=damping_adaptation_decay,
        damping_adaptation_interval=damping_adaptation_interval,
        damping_decrease_rho_threshold=damping_decrease_rho_threshold,
        damping_increase_rho_threshold=damping_increase_rho_threshold,
        precon_damping_mult=precon_damping_mult,
        use_passed_loss=use_passed_loss, print_logs=print_logs, dtype=dtype,
        learning_rate_schedule=learning_rate_schedule,
        momentum_schedule=momentum_schedule,
        damping_schedule=damping_schedule,
        compute_norm_stats=compute_norm_stats,
        always_use_exact_qmodel_for_damping_adjustment=(
            always_use_exact_qmodel_for_damping_adjustment),
        lazy_statistics_sync=lazy_statistics_sync,
        skip_non_finite_steps=skip_non_finite_steps,
        max_consecutive_skipped_steps=max_consecutive_skipped_steps,
        relative_min_damping=relative_min_damping,
        include_damping_in_qmodel_change=include_damping_in_qmodel_change,
        decoupled_weight_decay=decoupled_weight_decay,
        decoupled_weight_decay_mask=decoupled_weight_decay_mask,
        memory_budget=memory_budget, over_budget=over_budget,
        placement_kwargs=placement_kwargs, periodic=periodic, loss=loss,
        loss_fn=loss_fn, train_batch=train_batch,
        prev_train_batch=prev_train_batch, stacklevel=3)
    update = self._config.update
    self._learning_rate = self._scheduled(update.learning_rate,
                                          update.learning_rate_schedule)
    self._momentum = self._scheduled(update.momentum,
                                     update.momentum_schedule)
    self._layers = None
    self._var_list = None if var_list is None else list(var_list)
    self._default_var_list = config_lib.default_var_list(var_list)
    # The objects the damping rule evaluates are not settings: the damping
    # controller keeps them (set_* replace them per trace).
    self._make_parts(loss_fn=loss_fn, loss=loss, train_batch=train_batch,
                     prev_train_batch=prev_train_batch)
    self._qmodel_layers = None
    if qmodel_layer_collection is not None:
      self.set_qmodel_layer_collection(qmodel_layer_collection)
    if layer_collection is not None:
      self.set_layer_collection(layer_collection)

  @property
  def config(self):
    """The optimizer's settings (a frozen config.KfacConfig)."""
    return self._config

  def _make_parts(self, loss_fn, loss, train_batch, prev_train_batch):
    """The StateStore of every K-FAC variable, and the parts of the step
    (optimizers/step.py); the damping controller keeps what the damping
    rule evaluates."""
    name = self.config.name
    self._store = state.StateStore(name)
    # tf.train.Checkpoint(optimizer=opt) saves every K-FAC variable.
    self._track_trackable(self._store, name="kfac_state")
    self._step_guard = step_lib.StepGuard(self.config.guard, self._store,
                                              name)
    self._counters = step_lib.Counters(self._store, self._step_guard)
    self._weight_decay = weight_decay.WeightDecay(self.config.update,
                                                  self._learning_rate)
    self._velocities = step_lib.Velocities(self._store)
    self._update_rule = step_lib.UpdateRule(
        self.config.update, self._velocities, self._learning_rate,
        self._momentum)
    self._quadratic_model = quadratic_model.QuadraticModel(
        self.config, self._velocities, self._momentum)
    self._records = step_lib.Records(self._store,
                                    self.config.update.compute_norm_stats)
    self._damping_controller = quadratic_model.DampingController(
        self.config, self._store, self._records, self._require_estimator,
        lambda: self.counter, name, self._check_graph_mode, loss_fn=loss_fn,
        loss=loss, train_batch=train_batch, prev_train_batch=prev_train_batch)
    self._commit_part = step_lib.Commit(self._damping_controller,
                                      self._weight_decay, self._records)
    self._switch = None
    phase = self.config.minibatch_phase
    if phase is not None:
      # The minibatch recipe's rule (adaptive/recipe/switch.py), beside
      # the quadratic model; the same velocities.
      self._switch = switch_lib.RecipeSwitch(phase, self._store)
      self._minibatch_rule = step_lib.UpdateRule(
          dataclasses.replace(self.config.update, momentum_type="regular",
                              learning_rate=phase.learning_rate,
                              momentum=phase.momentum,
                              norm_constraint=phase.norm_constraint),
          self._velocities, phase.learning_rate, phase.momentum)
      self._damping_controller.switch = self._switch
    self._estimator = None
    self._exps = (-1,)

  def _runtime_checks(self):
    """Assertions of the hyperparameters given as tensors, variables or
    callables (the optimizer's own adapted values excepted)."""
    owned = {"damping"} if self._damping_is_stored else set()
    if self.config.update.qmodel:
      owned.update(("learning_rate", "momentum"))
    checked = self.config.step_hyperparameters(
        self._learning_rate,
        None if self._damping_is_stored else self._damping, self._momentum)
    return arguments.runtime_checks(
        type(self).__name__, [(n, v, r) for n, v, r in checked
                              if n not in owned])

  # ------------------------------------------------------------ damping
  def _scheduled(self, value, schedule):
    """`value`, or a function of the step counter when `schedule` (a
    callable step -> value, kfac-jax style; checked by config.build) is
    given."""
    if schedule is None:
      return value
    return lambda: schedule(tf.convert_to_tensor(self.counter))

  @property
  def _damping(self):
    """The damping now (the damping controller's)."""
    return self._damping_controller.damping

  @property
  def _damping_is_stored(self):
    """Whether the adapted damping is K-FAC's (not the user's variable)."""
    return self._damping_controller.owns_damping

  def set_loss(self, loss):
    """The loss before the update for the damping rule (use_passed_loss);
    in a tf.function call it on every trace. `minimize` sets it too."""
    self._damping_controller.loss = loss

  def set_train_batch(self, train_batch):
    """The batch loss_fn evaluates (a structure of tensors or a callable
    returning one); in a tf.function call it on every trace."""
    self._damping_controller.train_batch = train_batch

  def set_prev_train_batch(self, prev_train_batch):
    """The previous step's batch (update_damping_immediately=False)."""
    self._damping_controller.prev_train_batch = prev_train_batch

  def set_train_batch_loss(self, loss):
    """See DampingController.set_train_batch_loss
    (adaptive/quadratic_model.py)."""
    self._damping_controller.set_train_batch_loss(loss)

  def maybe_pre_update_adapt_damping(self):
    """kfac 0.2.x's op that adapts the damping at the start of a step
    (DampingController.maybe_pre_update_adapt_damping)."""
    return self._damping_controller.maybe_pre_update_adapt_damping()

  def _pre_update_ops(self):
    return self._damping_controller.pre_update_ops()

  def set_qmodel_layer_collection(self, layer_collection):
    """The LayerCollection whose losses define the quadratic model's
    exact curvature (the constructor's qmodel_layer_collection; None: the
    training collection's); in a tf.function set it on every trace."""
    if layer_collection is not None:
      if not (self.config.update.qmodel or self.config.damping.
              always_use_exact_qmodel_for_damping_adjustment):
        raise ValueError(
            "qmodel_layer_collection is used by the quadratic model only "
            "(momentum_type 'qmodel' / 'qmodel_fixedmu', or "
            "always_use_exact_qmodel_for_damping_adjustment=True); got "
            "momentum_type=%r." % self.config.update.momentum_type)
      if callable(layer_collection) and self.config.minibatch_phase is not None:
        pass  # built in the exact recipe's branch (_switched_update)
      elif not hasattr(layer_collection, "losses_with_coeffs"):
        raise ValueError("qmodel_layer_collection must be a LayerCollection "
                         "with the loss registered on it, got %r."
                         % (layer_collection,))
    self._qmodel_layers = layer_collection

  # Private names that code outside the optimizer reads (kfac/python/keras,
  # tests, kfac 0.2.x programs): read-only views of the config and parts.
  @property
  def _momentum_type(self):
    return self.config.update.momentum_type

  @property
  def _adapt_damping(self):
    return self.config.damping.adapt_damping

  @property
  def _calibrate_damping(self):
    return self.config.damping.calibrate_damping

  @property
  def _l2_reg(self):
    return self.config.damping.l2_reg

  @property
  def _include_damping_in_qmodel_change(self):
    return self.config.update.include_damping_in_qmodel_change

  @property
  def _damping_adaptation_interval(self):
    return self.config.damping.damping_adaptation_interval

  @property
  def _loss(self):
    """The `loss` given to the constructor or set_loss."""
    return self._damping_controller.loss

  # kfac 0.2.x's private name of it, read by code written for it.
  _loss_tensor = _loss

  @property
  def _min_damping(self):
    """kfac 0.2.x's private name of min_damping, read by code written for
    it."""
    return self.config.damping.min_damping

  @property
  def _passed_loss(self):
    """The loss of this step's compute_gradients."""
    return self._damping_controller.passed_loss

  @_passed_loss.setter
  def _passed_loss(self, value):
    self._damping_controller.passed_loss = value

  @property
  def _train_batch(self):
    return self._damping_controller.train_batch

  @property
  def _prev_train_batch(self):
    return self._damping_controller.prev_train_batch

  def _record(self, name):
    return self._records.get(name)

  @property
  def damping_adaptation_interval(self):
    """How many steps apart the damping rule runs (an int)."""
    return self.config.damping.damping_adaptation_interval

  @property
  def rho(self):
    """The last reduction ratio of the damping rule (NaN before the first)."""
    return utils.cast(self._records.get("rho"), self.config.dtype)

  @property
  def qmodel_change(self):
    """The change of the loss the quadratic model predicted for the last
    update (qmodel*: every step; regular / adam: the last step the damping
    rule used it; NaN before)."""
    return utils.cast(self._records.get("qmodel_change"), self.config.dtype)

  @property
  def norm_stats(self):
    """{"grad_norm", "precon_grad_norm", "update_norm"}: Euclidean norms of
    the last step's gradient, preconditioned vector and update (float64);
    needs compute_norm_stats=True."""
    if not self.config.update.compute_norm_stats:
      raise ValueError("norm_stats needs KfacOptimizer(..., "
                       "compute_norm_stats=True).")
    return self._records.norm_stats()

  def _check_distributable(self):
    """Raises NotImplementedError for what does not run on several
    replicas yet (optimizers/replicated.py)."""
    replicated.check_distributable(
        type(self).__name__, self.config,
        None if self._damping_is_stored else self._damping)

  # ------------------------------------------------------------ set-up
  def set_layer_collection(self, layer_collection):
    """Uses `layer_collection` from now on (a TF2 program calls this, through
    minimize(..., layer_collection=lc), on every trace). The estimator is
    rebuilt on the new collection; its state is kept."""
    if layer_collection is self._layers and self._estimator is not None:
      return
    self._layers = layer_collection
    var_list = self._var_list
    if var_list is None:
      # Resolved when the estimator is first used (the collection is
      # finalized then).
      var_list = lambda: list(  # pylint: disable=g-long-lambda
          self._var_list or self._default_var_list or
          layer_collection.registered_variables)
    self._estimator = est_lib.make_fisher_estimator(
        placement_strategy=self.config.placement.placement_strategy,
        variables=var_list,
        cov_ema_decay=self.config.curvature.cov_ema_decay,
        damping=damping_lib.DampingFunc(self._precon_damping,
                                        ("optimizer", self.get_name())),
        layer_collection=layer_collection,
        exps=self._exps,
        estimation_mode=self.config.curvature.estimation_mode,
        colocate_gradients_with_ops=(
            self.config.curvature.colocate_gradients_with_ops),
        name=self.get_name(),
        compute_params_stats=self.config.curvature.compute_params_stats,
        batch_size=self.config.curvature.batch_size,
        lazy_statistics_sync=self.config.placement.lazy_statistics_sync,
        skip_non_finite=self.config.guard.skip_non_finite_steps,
        sample_step=self.steps_taken,
        state_store=self._store,
        memory_budget=self.config.placement.memory_budget,
        over_budget=self.config.placement.over_budget,
        **self.config.placement.placement_kwargs)

  def _precon_damping(self):
    damping = self._read(self._damping)
    if self.config.damping.precon_damping_mult != 1.0:
      damping = damping * self.config.damping.precon_damping_mult
    if self.config.damping.l2_reg:
      damping = damping + self.config.damping.l2_reg
    return damping

  _read = staticmethod(step_lib.read)

  def _require_estimator(self):
    if self._estimator is None:
      raise ValueError(
          "KfacOptimizer has no LayerCollection: pass layer_collection=... "
          "to the constructor (TF1 graphs) or to minimize()/"
          "apply_gradients() inside the tf.function (TF2).")
    return self._estimator

  def _check_graph_mode(self, what):
    if tf.executing_eagerly():
      raise RuntimeError(
          "KfacOptimizer.%s builds graph ops: call it inside a tf.function "
          "(TF2) or while building a tf.Graph for a Session (TF1)." % what)
    if collective.replica_context() is not None:
      self._check_distributable()

  # ------------------------------------------------------------ properties
  @property
  def estimator(self):
    return self._require_estimator()

  @property
  def layers(self):
    return self._layers

  @property
  def registered_variables(self):
    return self._require_estimator().variables

  @property
  def variables(self):
    return self.registered_variables

  @property
  def memory_budget(self):
    """The memory budget in bytes (None: no check; collection/memory.py)."""
    return self.config.placement.memory_budget

  @property
  def factors(self):
    return self._require_estimator().factors

  @property
  def mat_type(self):
    return self._require_estimator().mat_type

  @property
  def params_stats(self):
    return self._require_estimator().params_stats

  @property
  def damping(self):
    """The damping (the adapted value with adapt_damping=True)."""
    return utils.cast(self._read(self._damping), self.config.dtype)

  @property
  def learning_rate(self):
    """The learning rate; with momentum_type 'qmodel' / 'qmodel_fixedmu'
    the one the quadratic model chose at the last step (0 before it)."""
    if self._switch is not None:  # the phase's once switched
      return self._switch.pick(self._record("learning_rate"),
                               self._switch.phase.learning_rate,
                               self.config.dtype)
    if self.config.update.momentum_type.startswith("qmodel"):
      return utils.cast(self._record("learning_rate"), self.config.dtype)
    return utils.cast(self._read(self._learning_rate), self.config.dtype)

  @property
  def momentum(self):
    """The momentum; with momentum_type 'qmodel' the one the quadratic
    model chose at the last step (0 before it)."""
    if self._switch is not None:  # the phase's once switched
      return self._switch.pick(
          self._record("momentum") if self.config.update.momentum_type ==
          "qmodel" else self._read(self._momentum),
          self._switch.phase.momentum, self.config.dtype)
    if self.config.update.momentum_type == "qmodel":
      return utils.cast(self._record("momentum"), self.config.dtype)
    return utils.cast(self._read(self._momentum), self.config.dtype)

  @property
  def counter(self):
    return self._counters.counter

  def steps_taken(self):
    """An int64 tensor: the training steps this optimizer has taken
    (counter, plus the burn-in steps of PeriodicInvCovUpdateKfacOpt);
    steps skipped by the non-finite guard are not counted. A stateless
    sampling seed made from it repeats after a checkpoint restore and is
    not shifted by a skipped step."""
    taken = tf.convert_to_tensor(self.counter)
    periods = self.config.curvature.periods
    if periods is not None and periods.num_burnin_steps > 0:
      taken += tf.convert_to_tensor(self._counters.burnin_counter)
    return taken

  @property
  def skipped_steps(self):
    """How many steps the non-finite guard skipped (an int64 variable)."""
    return self._step_guard.skipped_steps

  @property
  def consecutive_skipped_steps(self):
    """Steps skipped since the last step that was taken."""
    return self._step_guard.consecutive_skipped_steps

  @property
  def state_store(self):
    """Every variable the optimizer owns (for tf.train.Checkpoint)."""
    return self._store

  def make_vars_and_create_op_thunks(self):
    """Makes the K-FAC variables; returns (cov_update_thunks,
    inv_update_thunks), one thunk per factor (see
    FisherEstimator.make_vars_and_create_op_thunks)."""
    return self._require_estimator().make_vars_and_create_op_thunks(
        scope=self.get_name())

  def make_vars_and_create_ops(self):
    """Makes the K-FAC variables and all update ops now; returns the
    estimator's `UpdateOps` (cov_update_ops, cov_update_op, inv_update_ops,
    inv_update_op, cov_update_thunks, inv_update_thunks)."""
    return self._require_estimator().make_vars_and_create_ops(
        scope=self.get_name())

  def create_ops_and_vars_thunks(self):
    """See FisherEstimator.create_ops_and_vars_thunks."""
    return self._require_estimator().create_ops_and_vars_thunks(
        scope=self.get_name())

  def get_cov_vars(self):
    return self._require_estimator().get_cov_vars()

  def get_inv_vars(self):
    return self._require_estimator().get_inv_vars()

  def check_var_list(self, var_list):
    """Raises ValueError unless var_list equals the registered variables."""
    self._require_estimator()
    self._layers.check_registration(var_list, check_uses=False)

  # ------------------------------------------------------------ gradients
  def compute_gradients(self, loss, var_list=None,
                        gate_gradients=tf.compat.v1.train.Optimizer.GATE_OP,
                        aggregation_method=None,
                        colocate_gradients_with_ops=True, grad_loss=None,
                        layer_collection=None):
    """Gradients of `loss` w.r.t. var_list (default: registered variables)."""
    del gate_gradients, colocate_gradients_with_ops
    self._check_graph_mode("compute_gradients")
    if layer_collection is not None:
      self.set_layer_collection(layer_collection)
    if var_list is None:
      var_list = (self._var_list or self._default_var_list or
                  list(self.registered_variables))
    elif (self._var_list is None and self._default_var_list is not None and
          not getattr(self._estimator, "_finalized", False) and
          self._layers is not None and
          {v.ref() for v in var_list} ==
          {v.ref() for v in self._layers.registered_variables}):
      self._var_list = list(var_list)  # (a wrong one is reported below)
    var_list = list(var_list)
    # Under an Estimator with a distribution strategy, a mean loss is
    # scaled by 1 / replicas (tf.compat.v1.train.Optimizer's rule), so
    # that the summed gradients are the global batch's.
    if callable(loss):
      with tf.GradientTape() as tape:
        loss_value = self._scale_loss(loss())
      grads = tape.gradient(loss_value, var_list, output_gradients=grad_loss)
    else:
      loss_value = self._scale_loss(loss)
      grads = tf.gradients(loss_value, var_list, grad_ys=grad_loss,
                           aggregation_method=aggregation_method)
    # The loss of this step, for the damping rule (use_passed_loss).
    self._passed_loss = loss_value
    return list(zip(grads, var_list))

  def minimize(self, loss, global_step=None, var_list=None,
               gate_gradients=tf.compat.v1.train.Optimizer.GATE_OP,
               aggregation_method=None, colocate_gradients_with_ops=True,
               name=None, grad_loss=None, layer_collection=None):
    """compute_gradients + apply_gradients; returns the training op."""
    grads_and_vars = self.compute_gradients(
        loss, var_list=var_list, gate_gradients=gate_gradients,
        aggregation_method=aggregation_method,
        colocate_gradients_with_ops=colocate_gradients_with_ops,
        grad_loss=grad_loss, layer_collection=layer_collection)
    return self.apply_gradients(grads_and_vars, global_step=global_step,
                                name=name)

  # ------------------------------------------------------------ updates
  def apply_gradients(self, grads_and_vars, global_step=None, name=None,
                      layer_collection=None):
    """Applies one K-FAC step with the current factors/inverses (after the
    delayed damping rule, maybe_pre_update_adapt_damping, if any)."""
    grads_and_vars = self._prepare(grads_and_vars, layer_collection)
    return self._step(grads_and_vars, global_step, name)

  def _step(self, grads_and_vars, global_step, name):
    """The training op (optimizers/step.py), after the delayed damping rule
    (maybe_pre_update_adapt_damping) if any: the inverses of this step use
    the damping it sets, as in kfac 0.2.x."""
    with tf.control_dependencies(self._pre_update_ops()):
      op = step_lib.build_step(self._step_parts(), grads_and_vars,
                               global_step, name or self.get_name())
    # The next step's loss is set by its own trace.
    self._damping_controller.passed_loss = None
    return op

  def _step_parts(self):
    """The parts build_step composes, for this trace."""
    return step_lib.Parts(
        estimator=self._require_estimator(),
        periods=self.config.curvature.periods,
        num_calibration_steps=self.config.damping.num_calibration_steps,
        scope=self.get_name(),
        guard=self._step_guard,
        passed_loss=self._damping_controller.passed_loss,
        gradient_operands=self._gradient_operands,
        compute_update=self._compute_update,
        damping=self._damping_controller,
        commit=self._commit_part,
        counters=self._counters,
        switch=self._switch)

  def _compute_update(self, grads_and_vars):
    """Builds (without changing any state) what this step will do: an
    `Update` with the change of each variable, the new velocities, the
    values to record, and the predicted change of the loss (the update
    rule, or the quadratic model; AdamW's decay apart from the step)."""
    update = step_lib.Update()
    update.checks = self._runtime_checks()
    source = quadratic_model.CurvatureSource(
        self._layers, self._qmodel_layers, self._require_estimator())
    damping = lambda: self._read(self._damping)
    if self._switch is not None:
      self._switched_update(grads_and_vars, update, source, damping)
    elif self.config.update.qmodel:
      self._quadratic_model.compute(grads_and_vars, update, source, damping)
    else:
      self._update_rule.compute(grads_and_vars, source.estimator, update,
                                read_once=self._gradients_read_once())
      self._quadratic_model.set_model_change(grads_and_vars, update, source,
                                             damping)
    # AdamW's decay, apart from the step (optimizers/weight_decay.py).
    self._weight_decay.add(update, [v for _, v in grads_and_vars])
    return update

  def _switched_update(self, grads_and_vars, update, source, damping):
    """Fills `update` with the exact recipe's step (the quadratic model on
    the forward pass qmodel_layer_collection() builds in its branch) or,
    once switched, the minibatch recipe's (adaptive/recipe/switch.py): one
    conditional, whose branches give the same values."""
    variables = [v for _, v in grads_and_vars]
    dense = [(tf.convert_to_tensor(g), v) for g, v in grads_and_vars]
    velocities = [self._velocities.get(v) for v in variables]  # made here
    n = len(variables)
    build = self._qmodel_layers
    if not callable(build):
      raise ValueError(
          "minibatch_phase: the quadratic model's curvature is taken in a "
          "conditional branch, on a forward pass of its own: pass "
          "qmodel_layer_collection=<a callable that builds the model's "
          "forward pass and returns a LayerCollection with the loss "
          "registered on its outputs> (or set_qmodel_layer_collection), got "
          "%r." % (build,))

    def outputs(branch_update):
      by_var = {v.ref(): d for d, v in branch_update.deltas}
      new_v = {v.ref(): d for v, d in branch_update.velocity_assigns}
      precon = {v.ref(): p for p, v in branch_update.precon}
      change = branch_update.model_change
      return ([tf.convert_to_tensor(by_var[v.ref()]) for v in variables] +
              [tf.convert_to_tensor(new_v[u.ref()]) for u in velocities] +
              [tf.convert_to_tensor(precon[v.ref()]) for v in variables] +
              [utils.cast(branch_update.records["learning_rate"],
                          tf.float64),
               utils.cast(branch_update.records["momentum"], tf.float64),
               utils.cast(0.0 if change is None else change, tf.float64)])

    def exact():
      branch_update = step_lib.Update()
      self._quadratic_model.compute(
          dense, branch_update, source._replace(qmodel_layers=build()),
          damping)
      return outputs(branch_update)

    def minibatch():
      branch_update = step_lib.Update()
      # The momentum restarts at the first switched step (switch.py).
      self._minibatch_rule.compute(dense, source.estimator, branch_update,
                                   restart=self._switch.first_step())
      phase = self._switch.phase
      branch_update.records["learning_rate"] = phase.learning_rate
      branch_update.records["momentum"] = phase.momentum
      return outputs(branch_update)

    active = self._switch.active()
    out = tf.cond(active, minibatch, exact)
    update.deltas = list(zip(out[:n], variables))
    update.velocity_assigns = list(zip(velocities, out[n:2 * n])) + [
        self._switch.committed()]
    update.precon = list(zip(out[2 * n:3 * n], variables))
    update.grads = [g for g, _ in dense]
    update.records["learning_rate"] = out[3 * n]
    update.records["momentum"] = out[3 * n + 1]
    exact_change = out[3 * n + 2]
    # The damping rule's predicted change: the quadratic model's (with the
    # exact curvature) before the switch, the K-FAC matrix's after it,
    # built where the rule uses it.
    minibatch_update = step_lib.Update()
    minibatch_update.deltas = update.deltas
    self._quadratic_model.set_model_change(dense, minibatch_update, source,
                                           damping)
    approximate = minibatch_update.model_change_fn
    update.model_change_fn = lambda: tf.cond(
        self._switch.active(), approximate, lambda: exact_change)

  def _gradients_read_once(self):
    """Whether nothing in the step but the preconditioning reads the
    gradients (momentum "regular" without the norm constraint, norm
    statistics, damping model or cross-replica sums): then the dense
    blocks need not compute a weight gradient that they can precondition
    through the operands of its product (factored_grads/match.py)."""
    settings = self.config
    return (settings.update.momentum_type == "regular" and
            settings.update.norm_constraint is None and
            not settings.update.compute_norm_stats and
            not settings.damping.uses_model and
            not collective.is_distributed())

  # kfac 0.2.x's helpers of the update rule.
  def _update_velocities(self, vecs_and_vars, decay, vec_coeff=1.0):
    return self._update_rule.update_velocities(vecs_and_vars, decay,
                                               vec_coeff)

  def _squared_fisher_norm(self, vecs_and_vars, precon_and_vars):
    return self._update_rule.squared_fisher_norm(vecs_and_vars,
                                                 precon_and_vars)

  def _update_clip_coeff(self, vecs_and_vars, precon_and_vars):
    return self._update_rule.clip_coeff(vecs_and_vars, precon_and_vars)

  def _clip_updates(self, vecs_and_vars, precon_and_vars):
    return self._update_rule.clip(vecs_and_vars, precon_and_vars)

  def _gradient_operands(self, grads_and_vars):
    """{var ref: (x, d)} of the dense weight gradients the preconditioning
    reads through the operands of their product (when nothing else reads
    the gradients: factored_grads/match.py)."""
    if not self._gradients_read_once():
      return {}
    return self._require_estimator().gradient_operands(grads_and_vars)

  def _prepare(self, grads_and_vars, layer_collection=None):
    """Checks the graph mode and the variables; densifies the gradients
    (IndexedSlices stay sparse, see optimizers/step.py)."""
    self._check_graph_mode("apply_gradients")
    if layer_collection is not None:
      self.set_layer_collection(layer_collection)
    self._require_estimator()
    grads_and_vars = list(grads_and_vars)
    none = [utils.variable_name(v) for g, v in grads_and_vars if g is None]
    if none:
      raise ValueError("No gradient for variables %s: they do not affect the "
                       "loss." % ", ".join(none))
    self._layers.check_registration([v for _, v in grads_and_vars],
                                    check_uses=False)
    _check_reference_variables([v for _, v in grads_and_vars])
    grads_and_vars = replicated.reduce_gradients(grads_and_vars)
    if self.config.update.qmodel or self.config.damping.uses_model:
      # The quadratic model takes inner products with the gradient.
      return [(tf.convert_to_tensor(g), v) for g, v in grads_and_vars]
    return [(g if sparse.is_slices(g) else tf.convert_to_tensor(g), v)
            for g, v in grads_and_vars]


def _check_reference_variables(variables):
  """A TF1 reference variable cannot be assigned inside a control flow v2
  conditional (its ref type does not cross into the branch's function),
  and the step assigns every variable in one (the non-finite guard's):
  a clear error instead of TensorFlow's TypeError about AssignAdd."""
  if tf.executing_eagerly() or not tf.compat.v1.control_flow_v2_enabled():
    return
  refs = [utils.variable_name(v) for v in variables
          if introspection.is_reference_variable(v)]
  if refs:
    raise ValueError(
        "K-FAC cannot update the TF1 reference variables %s with control "
        "flow v2 (TensorFlow cannot assign them inside its conditionals). "
        "Use resource variables (tf.compat.v1.get_variable(..., "
        "use_resource=True), or tf.compat.v1.enable_resource_variables()), "
        "or control flow v1 (tf.compat.v1.disable_control_flow_v2(), which "
        "tf.compat.v1.disable_v2_behavior() includes)." % ", ".join(refs))


# --------------------------------------------------------------------------
# PeriodicInvCovUpdateKfacOpt: K-FAC with the statistic and inverse updates
# inside `minimize`.
#
# `PeriodicInvCovUpdateKfacOpt` is a facade: a `KfacOptimizer` whose
# configuration has periods (`config.Periods`), so that its step
# (optimizers/step.py) builds one training op. As in kfac 0.2.x:
# 1. during the first `num_burnin_steps` calls (counted by `burnin_counter`)
#    it only adds the mini-batch statistics to an arithmetic mean (no
#    parameter update, no inverses; with `calibrate_damping=True`, also the
#    inverses and a trial of the update that calibrates the damping, see
#    adaptive/quadratic_model.py, on the last `num_calibration_steps` of them:
#    by default all). These calls do not advance the optimizer's `counter`
#    nor `global_step`;
# 2. afterwards, at step t (the `counter`, which starts at 0 after burn-in),
#    it updates the statistics' moving averages when t % cov_update_every ==
#    0,
# 3. recomputes the inverses when t % invert_every == 0 (so the first real
#    step already uses fresh inverses),
# 4. applies the K-FAC step, and increments the counter (and global_step).
# All of it is one `session.run` / one `tf.function` call per step; the
# inverse work is amortised over `invert_every` steps.
#
# A `cov_ema_decay` passed explicitly is raised to the power
# `cov_update_every` (kfac 0.2.x did this so that the average forgets at the
# same rate per step whatever the update interval); the default 0.95 is
# used as it is.


@utils.exclude_from_autograph
class PeriodicInvCovUpdateKfacOpt(KfacOptimizer):
  """KfacOptimizer that updates statistics and inverses periodically."""

  def __init__(self, invert_every=10, cov_update_every=1, num_burnin_steps=0,
               calibrate_damping=False, num_calibration_steps=None,
               minibatch_phase=None, **kfac_kwargs):
    """See the module docstring; `calibrate_damping=True` needs
    num_burnin_steps > 0 and loss_fn / train_batch (as adapt_damping).

    num_calibration_steps: with calibrate_damping, how many of the burn-in
      steps (the last ones) try the update and move the damping, each
      recomputing every inverse; the ones before only gather statistics,
      so that the first call returns without inverting anything. None: all
      of them.

    minibatch_phase (not in kfac 0.2.x; default None): a
      recipe.MinibatchPhase: the step runs the exact recipe (this
      optimizer's quadratic model, periods and damping rule) until
      `recipe_switch.activate()` runs, then the minibatch recipe with the
      phase's settings (adaptive/recipe/switch.py). It needs
      momentum_type 'qmodel*', adapt_damping=True and a
      qmodel_layer_collection that is a callable building the forward pass
      the quadratic model's curvature is taken on."""
    periodic = config_lib.periods(invert_every, cov_update_every,
                                  num_burnin_steps, calibrate_damping,
                                  num_calibration_steps, minibatch_phase)
    if kfac_kwargs.get("cov_ema_decay") is not None:
      kfac_kwargs["cov_ema_decay"] = config_lib.periodic_cov_ema_decay(
          type(self).__name__, kfac_kwargs["cov_ema_decay"],
          periodic.periods.cov_update_every)
    kfac_kwargs[PERIODIC_ARGUMENTS] = periodic
    super().__init__(**kfac_kwargs)

  @property
  def recipe_switch(self):
    """The switch to the minibatch recipe (adaptive/recipe/switch.py:
    `activate()`, `active()`), or None without minibatch_phase."""
    return self._switch

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
