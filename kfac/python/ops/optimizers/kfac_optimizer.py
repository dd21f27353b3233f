"""The K-FAC optimizer (layer 7).

`KfacOptimizer` is a `tf.compat.v1.train.Optimizer`: in a TF1 graph it is
used exactly like the old library's (`minimize` / `compute_gradients` /
`apply_gradients`, plus the estimator's update ops). In a TF2 program,
create it once without a layer collection and pass a fresh collection,
built during the trace, to `minimize(..., layer_collection=lc)` inside a
`tf.function`; all state lives in the optimizer's `StateStore` and is found
again on every retrace (see docs/tf2.md).

Update rules, with g the gradient, F^-1 the damped approximate inverse
Fisher (damping * precon_damping_mult + l2_reg on the diagonal), mu the
momentum, eta the learning rate and v the velocity:

* "regular": p = F^-1 g (then norm constraint), v <- mu v + p, step = v.
* "adam":    v <- mu v + g, p = F^-1 v (then norm constraint), step = p.

then step += weight_decay_coeff * w with use_weight_decay (decoupled weight
decay) and w <- w - eta * step. The norm constraint scales p by
min(1, sqrt(C / (eta^2 <g', p>))) where g' is the vector p came from, so the
approximate squared Fisher norm of the update is at most C.

"qmodel" / "qmodel_fixedmu" choose eta (and mu) from the exact quadratic
model, and `adapt_damping` moves the damping by the Levenberg-Marquardt
rule: see adaptive/mixin.py. A step is built in two halves: `_compute_update`
makes the change of every variable without touching any state, and
`_commit` applies it (after the damping rule's "before" ops, if any).

Sparse gradients: a `tf.IndexedSlices` gradient (from `tf.gather` /
`tf.nn.embedding_lookup`) stays sparse through a block that supports it (an
embedding table; other blocks get it densified). With a Python momentum of
0 the change -eta * step is applied with `scatter_add` to the touched rows
only. With momentum, the velocity is dense (every row decays): it is updated as
mu * v followed by a scatter-add of the slices, so the dense gradient is
never built, but the step is dense. Decoupled weight decay touches every
row, so it densifies the step. The norm constraint's <g', p> is computed on
the slices after summing duplicate indices.

Several replicas (tf.distribute): see distribute/collective.py and
docs/distributed.md; `lazy_statistics_sync=True` reduces the statistics
only at inversion steps (distribute/lazy_sync.py), and
`placement_strategy="replica_round_robin"` computes each factor's inverses
on one replica (distribute/inverse_placement.py).
"""

import tensorflow as tf

from kfac.python.ops.adaptive import mixin as adaptive
from kfac.python.ops.layers.base import damping as damping_lib
from kfac.python.ops.estimation import modes as estimation_modes
from kfac.python.ops import estimator as est_lib
from kfac.python.ops.layers.dense import factored_grads
from kfac.python.ops.tensors import state
from kfac.python.ops.tensors import utils
from kfac.python.ops.compat_utils import legacy_constants
from kfac.python.ops.compat_utils import list_algebra
from kfac.python.ops.distribute import collective
from kfac.python.ops.distribute import replicas
from kfac.python.ops.reliability import arguments
from kfac.python.ops.reliability import nonfinite

# kfac 0.2.x's module-level names: list algebra and set_global_constants
# (include_damping_in_qmodel_change: the default of the constructor's
# argument of that name for optimizers made afterwards).
ip = list_algebra.ip
ip_p = list_algebra.ip_p
sprod = list_algebra.sprod
sprod_p = list_algebra.sprod_p
set_global_constants = legacy_constants.set_optimizer_constants

_MOMENTUM_TYPES = ("regular", "adam", "qmodel", "qmodel_fixedmu")


@utils.exclude_from_autograph
class KfacOptimizer(adaptive.AdaptiveMixin, tf.compat.v1.train.Optimizer):
  """The K-FAC optimizer."""

  # Set while building a step; under MirroredStrategy each replica thread
  # builds its own (see distribute/replicas.py).
  _layers = replicas.PerReplicaAttribute()
  _estimator = replicas.PerReplicaAttribute()
  _passed_loss = replicas.PerReplicaAttribute()
  _loss = replicas.PerReplicaAttribute()
  _train_batch = replicas.PerReplicaAttribute()
  _prev_train_batch = replicas.PerReplicaAttribute()
  _commit_active = replicas.PerReplicaAttribute()
  _pre_update_op = replicas.PerReplicaAttribute()

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
               **placement_kwargs):
    """Creates the optimizer; see the module docstring for the update rule.

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
    from the factors' traces: kfac.python.ops.adaptive.recipe.curvature_scale) nor
    below min_damping. A floor that follows the curvature's scale, where
    min_damping is absolute (docs/recipe.md).

    `include_damping_in_qmodel_change` (kfac 0.2.x's
    optimizer.set_global_constants option; None: the value set there, else
    False): whether qmodel_change, the predicted change the damping rule
    compares with the actual one, includes the damping term (adaptive/mixin.py).

    `tf_replicator`: kfac 0.2.x's TF-Replicator object. TF-Replicator no
    longer exists; only None is accepted (use a tf.distribute strategy,
    docs/distributed.md).
    """
    if tf_replicator is not None:
      raise ValueError(
          "tf_replicator=%r: TF-Replicator is not supported by this version "
          "of kfac (it no longer exists). Run the step under a "
          "tf.distribute strategy instead (e.g. MirroredStrategy or "
          "TPUStrategy, see docs/distributed.md); K-FAC then reduces its "
          "statistics across replicas itself." % (tf_replicator,))
    super().__init__(use_locking=False, name=name)
    if momentum_type not in _MOMENTUM_TYPES:
      raise ValueError("Unknown momentum_type %r; expected one of %s." %
                       (momentum_type, ", ".join(_MOMENTUM_TYPES)))
    learning_rate = self._from_schedule("learning_rate", learning_rate,
                                        learning_rate_schedule)
    momentum = self._from_schedule("momentum", momentum, momentum_schedule)
    damping = self._from_schedule("damping", damping, damping_schedule)
    if momentum_type == "qmodel":
      for arg, value in (("learning_rate", learning_rate),
                         ("momentum", momentum)):
        if value is not None:
          raise ValueError(
              "momentum_type='qmodel' chooses the %s from the quadratic model "
              "at every step: pass %s=None (got %r)." % (arg, arg, value))
    elif momentum_type == "qmodel_fixedmu":
      if learning_rate is not None:
        raise ValueError(
            "momentum_type='qmodel_fixedmu' chooses the learning rate from the "
            "quadratic model (the momentum is fixed): pass learning_rate=None "
            "(got %r)." % (learning_rate,))
    elif learning_rate is None:
      raise ValueError("learning_rate is required with momentum_type=%r." %
                       momentum_type)
    if momentum is None and momentum_type != "qmodel":
      raise ValueError("momentum is required with momentum_type=%r." %
                       momentum_type)
    if damping is None:
      raise ValueError("damping is required.")
    self._check_arguments(locals())
    # Unknown strategies fail here, not at the first step; so do arguments
    # the strategy's estimator does not take.
    est_class = est_lib.estimator_class(placement_strategy)
    _check_estimator_kwargs(est_class, placement_kwargs)

    self._learning_rate = learning_rate
    self._damping = damping
    self._layers = None
    self._cov_ema_decay = cov_ema_decay
    self._var_list = None if var_list is None else list(var_list)
    # kfac 0.2.x's default in a TF1 graph: the graph's trainable variables,
    # now; a var_list given to minimize / compute_gradients before the
    # estimator is set up replaces it (so a trainable variable that is not
    # a parameter, e.g. a damping variable, need not be registered).
    self._default_var_list = (tf.compat.v1.trainable_variables()
                              if var_list is None and _in_tf1_graph()
                              else None)
    self._momentum = momentum
    self._momentum_type = momentum_type
    self._use_weight_decay = use_weight_decay
    self._weight_decay_coeff = weight_decay_coeff
    self._norm_constraint = norm_constraint
    self._estimation_mode = estimation_mode
    self._colocate_gradients_with_ops = colocate_gradients_with_ops
    self._batch_size = batch_size
    self._placement_strategy = placement_strategy
    self._placement_kwargs = placement_kwargs
    self._lazy_statistics_sync = lazy_statistics_sync
    self._skip_non_finite = bool(skip_non_finite_steps)
    self._compute_params_stats = compute_params_stats
    self._dtype = tf.as_dtype(dtype)
    self._store = state.StateStore(name)
    # tf.train.Checkpoint(optimizer=opt) saves every K-FAC variable.
    self._track_trackable(self._store, name="kfac_state")
    self._guard = nonfinite.NonFiniteGuard(
        self._store, max_consecutive_skipped_steps, name)
    self._var_keys = {}
    self._estimator = None
    self._exps = (-1,)
    self._compute_norm_stats = compute_norm_stats
    arguments = locals()
    self._init_adaptive({name: arguments[name]
                         for name in adaptive.ARGUMENTS})
    if layer_collection is not None:
      self.set_layer_collection(layer_collection)

  def _check_arguments(self, args):
    """Checks the hyperparameters (reliability/arguments.py): numbers now,
    tensors, variables and callables with every step (_runtime_checks)."""
    owner = type(self).__name__
    floor = args["min_damping"]
    adaptive_floor = (args["adapt_damping"] and
                      arguments.is_number(floor) and floor > 0)
    self._checked_hyperparameters = [
        ("learning_rate", args["learning_rate"], arguments.NON_NEGATIVE),
        # The damping rule keeps the damping >= min_damping: with a positive
        # floor it may start at 0.
        ("damping", args["damping"], arguments.NON_NEGATIVE
         if adaptive_floor else arguments.POSITIVE),
        ("momentum", args["momentum"], arguments.MOMENTUM),
        ("weight_decay_coeff", args["weight_decay_coeff"],
         arguments.NON_NEGATIVE),
        ("norm_constraint", args["norm_constraint"], arguments.POSITIVE),
    ]
    for name, value, rule in self._checked_hyperparameters:
      arguments.check(owner, name, value, rule, allow_none=True)
    for name, rule in (("cov_ema_decay", arguments.UNIT_INTERVAL),
                       ("l2_reg", arguments.NON_NEGATIVE),
                       ("min_damping", arguments.NON_NEGATIVE),
                       ("relative_min_damping", arguments.NON_NEGATIVE),
                       ("precon_damping_mult", arguments.POSITIVE),
                       ("qmodel_update_rescale", arguments.POSITIVE)):
      if not arguments.is_number(args[name]) and args[name] is not None:
        raise ValueError("%s: %s must be a number, got %r." %
                         (owner, name, args[name]))
      arguments.check(owner, name, args[name], rule, allow_none=True)
    if not utils.is_tensor_or_variable(args["batch_size"]):
      arguments.check_count(owner, "batch_size", args["batch_size"], 1,
                            allow_none=True)
    arguments.check_count(owner, "damping_adaptation_interval",
                          args["damping_adaptation_interval"], 1)
    estimation_modes.check_mode(args["estimation_mode"])
    try:
      tf.as_dtype(args["dtype"])
    except TypeError:
      raise ValueError("%s: dtype must be a floating-point dtype, got %r." %
                       (owner, args["dtype"])) from None
    if not tf.as_dtype(args["dtype"]).is_floating:
      raise ValueError("%s: dtype must be a floating-point dtype, got %r." %
                       (owner, args["dtype"]))

  def _runtime_checks(self):
    """Assertions of the hyperparameters given as tensors, variables or
    callables (the optimizer's own adapted values excepted)."""
    owned = {"damping"} if self._damping_is_stored else set()
    if self._momentum_type.startswith("qmodel"):
      owned.update(("learning_rate", "momentum"))
    return arguments.runtime_checks(
        type(self).__name__,
        [(n, v, r) for n, v, r in self._checked_hyperparameters
         if n not in owned])

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
        placement_strategy=self._placement_strategy,
        variables=var_list,
        cov_ema_decay=self._cov_ema_decay,
        damping=damping_lib.DampingFunc(self._precon_damping,
                                        ("optimizer", self.get_name())),
        layer_collection=layer_collection,
        exps=self._exps,
        estimation_mode=self._estimation_mode,
        colocate_gradients_with_ops=self._colocate_gradients_with_ops,
        name=self.get_name(),
        compute_params_stats=self._compute_params_stats,
        batch_size=self._batch_size,
        lazy_statistics_sync=self._lazy_statistics_sync,
        skip_non_finite=self._skip_non_finite,
        sample_step=self.steps_taken,
        state_store=self._store,
        **self._placement_kwargs)

  def _precon_damping(self):
    damping = self._read(self._damping)
    if self._precon_damping_mult != 1.0:
      damping = damping * self._precon_damping_mult
    if self._l2_reg:
      damping = damping + self._l2_reg
    return damping

  @staticmethod
  def _read(value):
    return value() if callable(value) and not isinstance(
        value, tf.Variable) else value

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
    return utils.cast(self._read(self._damping), self._dtype)

  @property
  def learning_rate(self):
    """The learning rate; with momentum_type 'qmodel' / 'qmodel_fixedmu'
    the one the quadratic model chose at the last step (0 before it)."""
    if self._momentum_type.startswith("qmodel"):
      return utils.cast(self._record("learning_rate"), self._dtype)
    return utils.cast(self._read(self._learning_rate), self._dtype)

  @property
  def momentum(self):
    """The momentum; with momentum_type 'qmodel' the one the quadratic
    model chose at the last step (0 before it)."""
    if self._momentum_type == "qmodel":
      return utils.cast(self._record("momentum"), self._dtype)
    return utils.cast(self._read(self._momentum), self._dtype)

  @property
  def counter(self):
    return self._store.get_or_create("counter", [], tf.int64)

  def steps_taken(self):
    """An int64 tensor: the training steps this optimizer has taken
    (counter, plus the burn-in steps of PeriodicInvCovUpdateKfacOpt);
    steps skipped by the non-finite guard are not counted. A stateless
    sampling seed made from it repeats after a checkpoint restore and is
    not shifted by a skipped step."""
    return tf.convert_to_tensor(self.counter)

  @property
  def skipped_steps(self):
    """How many steps the non-finite guard skipped (an int64 variable)."""
    return self._guard.skipped_steps

  @property
  def consecutive_skipped_steps(self):
    """Steps skipped since the last step that was taken."""
    return self._guard.consecutive_skipped_steps

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
    with tf.control_dependencies(self._pre_update_ops()):
      return self._checked_step(grads_and_vars, global_step, name)

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
    return checks.ok()

  def _input_checks(self, grads_and_vars):
    """The non-finite guard's checks of the step's loss and gradients
    (reliability/nonfinite.py); None without the guard. Under several
    replicas only the summed gradients decide (the same on every
    replica)."""
    if not self._skip_non_finite:
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

  def _gradients_read_once(self):
    """Whether nothing in the step but the preconditioning reads the
    gradients (momentum "regular" without the norm constraint, norm
    statistics, damping model or cross-replica sums): then the dense
    blocks need not compute a weight gradient that they can precondition
    through the operands of its product (factored_grads/match.py)."""
    return (self._momentum_type == "regular" and
            self._norm_constraint is None and
            not self._compute_norm_stats and
            not self._uses_damping_model and
            not collective.is_distributed())

  def _prepare(self, grads_and_vars, layer_collection=None):
    """Checks the graph mode and the variables; densifies the gradients
    (IndexedSlices stay sparse, see the module docstring)."""
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
    grads_and_vars = self._reduce_gradients(grads_and_vars)
    if self._momentum_type.startswith("qmodel") or self._uses_damping_model:
      # The quadratic model takes inner products with the gradient.
      return [(tf.convert_to_tensor(g), v) for g, v in grads_and_vars]
    return [(g if _is_slices(g) else tf.convert_to_tensor(g), v)
            for g, v in grads_and_vars]

  def _check_distributable(self):
    """Raises NotImplementedError for what does not run on several
    replicas yet."""
    unsupported = []
    if getattr(self, "_calibrate_damping", False):
      unsupported.append(
          "calibrate_damping=True (the calibration tries the update on the "
          "model's variables inside a conditional, where mirrored variables "
          "cannot change; use adapt_damping=True or choose the initial "
          "damping)")
    if self._adapt_damping and not self._damping_is_stored:
      unsupported.append(
          "adapt_damping=True with the damping in your variable %s (the "
          "replicas would each adapt it; pass the initial damping as a "
          "number, and K-FAC keeps the adapted one per replica)" %
          utils.variable_name(self._damping))
    if self._placement_strategy == "round_robin":
      unsupported.append(
          "placement_strategy='round_robin' (in-graph device placement; "
          "under a strategy each replica places its own ops on its device)")
    if unsupported:
      raise NotImplementedError(
          "%s with several replicas (%s): %s %s not supported yet." %
          (type(self).__name__, type(tf.distribute.get_strategy()).__name__,
           "; ".join(unsupported),
           "is" if len(unsupported) == 1 else "are"))

  def _reduce_gradients(self, grads_and_vars):
    """Sums the replicas' gradients (tf.compat.v1 Optimizer convention:
    each replica's loss is scaled so that the sum is the global one, e.g.
    by 1 / num_replicas for a mean loss; `compute_gradients` does this under
    an Estimator). Dense tensors: one collective per dtype."""
    if not collective.is_distributed():
      return grads_and_vars
    grads = [tf.convert_to_tensor(g) for g, _ in grads_and_vars]
    with tf.name_scope("cross_replica_gradients"):
      grads = collective.all_reduce(grads, collective.SUM)
    return [(g, v) for g, (_, v) in zip(grads, grads_and_vars)]

  def _compute_update(self, grads_and_vars):
    """Builds (without changing any state) what this step will do: an
    `_Update` with the change of each variable, the new velocities, the
    values to record, and the predicted change of the loss."""
    update = _Update()
    update.checks = self._runtime_checks()
    if self._momentum_type.startswith("qmodel"):
      return self._qmodel_update(grads_and_vars, update)
    est = self._require_estimator()
    update.grads = [tf.convert_to_tensor(g) for g, _ in grads_and_vars]
    if self._momentum_type == "regular":
      with factored_grads.gradients_read_only_here(
          self._gradients_read_once()):
        precon = est.multiply_inverse(grads_and_vars)
      if self._norm_constraint is not None:
        precon = self._clip_updates(grads_and_vars, precon)
      steps = self._new_velocities(precon, self._momentum, update)
      update.precon = precon
    else:  # adam
      velocities = self._new_velocities(grads_and_vars, self._momentum,
                                        update)
      steps = est.multiply_inverse(velocities)
      if self._norm_constraint is not None:
        steps = self._clip_updates(velocities, steps)
      update.precon = steps
    if self._use_weight_decay:
      coeff = self._read(self._weight_decay_coeff)
      steps = [(_dense(s) + utils.cast(coeff, v.dtype) * v, v)
               for s, v in steps]
    lr = self._read(self._learning_rate)
    update.deltas = [(_scale(s, -utils.cast(lr, v.dtype)), v)
                     for s, v in steps]
    self._set_model_change(grads_and_vars, update)
    return update

  def _commit(self, update, active=None):
    """The op that carries out `update` (plus the damping rule); with a
    boolean tensor `active`, only when it holds."""
    if collective.is_distributed():
      return self._commit_replicated(update, active)
    if active is not None:
      return utils.cond_op(active, lambda: self._commit(update))
    # The damping rule may change the damping before the variables change:
    # only once everything this step computes from it is ready.
    with tf.control_dependencies(update.dependencies()):
      before = self._adaptation_before_update(update)
    with tf.control_dependencies(before):
      ops = [velocity.assign(value)
             for velocity, value in update.velocity_assigns]
      for delta, var in update.deltas:
        if _is_slices(delta):
          ops.append(var.scatter_add(delta))
        else:
          ops.append(var.assign_add(delta))
      ops.extend(self._record_ops(update))
      step_op = tf.group(*ops)
    return self._adaptation_after_update(update, step_op)

  def _commit_replicated(self, update, active):
    """`_commit` under several replicas: the K-FAC state (replica-local)
    changes inside the conditions; the model's mirrored variables through
    one merge_call outside them (a zero change when `active` is false).
    The damping rule's conditions include `active`."""
    self._commit_active = active
    with tf.control_dependencies(update.dependencies()):
      before = self._adaptation_before_update(update)
    with tf.control_dependencies(before):
      def state_ops():
        ops = [velocity.assign(value)
               for velocity, value in update.velocity_assigns]
        ops.extend(self._record_ops(update))
        return tf.group(*ops)
      if active is None:
        state_op = state_ops()
      else:
        state_op = utils.cond_op(active, state_ops)
    updates = []
    with tf.control_dependencies([state_op]):
      for delta, var in update.deltas:
        delta = tf.identity(_dense(delta))
        if active is not None:
          delta = tf.where(active, delta, tf.zeros_like(delta))
        updates.append((_assign_add, var, (delta,)))
    with tf.name_scope("apply_to_replicas"):
      step_op = collective.apply_updates(updates)
    result = self._adaptation_after_update(update, step_op)
    self._commit_active = None
    return result

  def _finish(self, step_op, global_step, active=None, checks=None,
              ok=None):
    """After `step_op`: counter += 1 and global_step += 1 (with a boolean
    tensor `active`, only when it holds: burn-in steps and skipped steps
    count neither); with the guard's `checks`, the step is counted as
    skipped unless `ok` (nonfinite.NonFiniteGuard.record)."""
    self._passed_loss = None
    if checks is not None:
      with tf.control_dependencies([step_op]):
        step_op = self._guard.record(ok, checks, self.counter)
    with tf.control_dependencies([step_op]):
      def one(dtype):
        if active is None:
          return tf.ones([], dtype)
        return tf.cast(active, dtype)
      incs = [self.counter.assign_add(one(tf.int64))]
      if global_step is not None:
        inc = one(global_step.dtype.base_dtype)
        if collective.is_distributed():
          incs.append(collective.apply_updates(
              [(_assign_add, global_step, (tf.identity(inc),))]))
        else:
          incs.append(global_step.assign_add(inc))
      return tf.group(*incs)

  def _var_key(self, var):
    key = self._var_keys.get(var.ref())
    if key is None:
      used = set(self._var_keys.values())
      base = "velocity/" + utils.state_name(var)
      key, i = base, 1
      while key in used:
        key = "%s_%d" % (base, i)
        i += 1
      self._var_keys[var.ref()] = key
    return key

  def _velocity(self, var):
    return self._store.get_or_create(self._var_key(var), var.shape,
                                     var.dtype.base_dtype)

  def _new_velocities(self, vecs_and_vars, decay, update):
    """decay * v + vec for each variable: returns the new velocities and
    adds their assignments to `update`."""
    out = []
    decay = self._read(decay)
    for vec, var in vecs_and_vars:
      if _is_slices(vec) and utils.is_python_number(decay) and decay == 0:
        out.append((vec, var))  # no momentum: the step stays sparse
        continue
      velocity = self._velocity(var)
      new = utils.cast(decay, velocity.dtype) * velocity
      if _is_slices(vec):
        new = tf.tensor_scatter_nd_add(new, vec.indices[:, tf.newaxis],
                                       vec.values)
      else:
        new = new + vec
      update.velocity_assigns.append((velocity, new))
      out.append((new, var))
    return out

  def _squared_fisher_norm(self, vecs_and_vars, precon_and_vars):
    terms = [tf.cast(_inner(v, p), tf.float64)
             for (v, _), (p, _) in zip(vecs_and_vars, precon_and_vars)]
    return tf.add_n(terms)

  def _update_clip_coeff(self, vecs_and_vars, precon_and_vars):
    """min(1, sqrt(C / (lr^2 <v, F^-1 v>))) (float64; 1 when the norm is
    0), the factor that puts the update on the norm constraint C."""
    lr = utils.cast(self._read(self._learning_rate), tf.float64)
    sq_norm = self._squared_fisher_norm(vecs_and_vars, precon_and_vars)
    bound = utils.cast(self._read(self._norm_constraint), tf.float64)
    sq_update = lr * lr * sq_norm
    one = tf.ones_like(sq_update)
    positive = sq_update > 0
    return tf.where(
        positive,
        tf.minimum(one, tf.sqrt(bound / tf.where(positive, sq_update, one))),
        one)

  def _clip_updates(self, vecs_and_vars, precon_and_vars):
    """Scales the preconditioned vectors so that lr^2 <v, F^-1 v> <= C."""
    coeff = self._update_clip_coeff(vecs_and_vars, precon_and_vars)
    return [(_scale(p, tf.cast(coeff, p.dtype)), v)
            for p, v in precon_and_vars]

  def _update_velocities(self, vecs_and_vars, decay, vec_coeff=1.0):
    """kfac 0.2.x helper: assigns v <- decay * v + vec_coeff * vec to each
    variable's velocity now; returns [(new velocity, var)] (reading a new
    velocity runs its assignment)."""
    out = []
    decay = self._read(decay)
    for vec, var in vecs_and_vars:
      velocity = self._velocity(var)
      new = (utils.cast(decay, velocity.dtype) * velocity +
             utils.cast(vec_coeff, velocity.dtype) * tf.convert_to_tensor(vec))
      with tf.control_dependencies([velocity.assign(new)]):
        out.append((tf.identity(new), var))
    return out


def _in_tf1_graph():
  """Whether ops go to a TF1 graph (not eager, not a tf.function trace)."""
  if tf.executing_eagerly():
    return False
  graph = tf.compat.v1.get_default_graph()
  return not getattr(graph, "building_function", False)


def _check_estimator_kwargs(est_class, kwargs):
  """Raises TypeError for keyword arguments neither KfacOptimizer nor the
  placement strategy's estimator takes."""
  if not kwargs:
    return
  import inspect  # pylint: disable=g-import-not-at-top
  accepted = set()
  for cls in est_class.__mro__:
    init = cls.__dict__.get("__init__")
    if init is not None:
      accepted.update(inspect.signature(init).parameters)
  unknown = sorted(set(kwargs) - accepted)
  if unknown:
    raise TypeError("KfacOptimizer got unexpected keyword arguments %s ("
                    "placement "
                    "arguments: cov_devices, inv_devices, trans_devices for "
                    "the round-robin placement, distribute_transformations "
                    "for replica_round_robin)." % ", ".join(unknown))


class _Update:
  """What one step does (see KfacOptimizer._compute_update)."""

  def __init__(self):
    self.deltas = []            # (change, variable): variable += change
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

  def dependencies(self):
    """The tensors of the update (to order state changes after them)."""
    out = [d.values if _is_slices(d) else d for d, _ in self.deltas]
    out.extend(self.checks)
    if self.model_change is not None:
      out.append(self.model_change)
    return out


def _is_slices(x):
  return isinstance(x, tf.IndexedSlices)


def _assign_add(var, delta):
  return var.assign_add(delta)


def _dense(x):
  return tf.convert_to_tensor(x)


def _scale(x, coeff):
  if _is_slices(x):
    return tf.IndexedSlices(x.values * coeff, x.indices, x.dense_shape)
  return x * coeff


def _inner(a, b):
  """sum(a * b) for Tensors and/or IndexedSlices. IndexedSlices may repeat
  an index (the row is the sum of its slices): two sparse operands are
  summed per distinct index first; against a dense one, each slice meets
  the dense row it sits on, which is the same thing by linearity."""
  if _is_slices(a) and _is_slices(b):
    num_a = tf.shape(a.indices)[0]
    uniq, idx = tf.unique(tf.concat(
        [tf.cast(a.indices, tf.int64), tf.cast(b.indices, tf.int64)], 0))
    num = tf.shape(uniq)[0]
    rows_a = tf.math.unsorted_segment_sum(a.values, idx[:num_a], num)
    rows_b = tf.math.unsorted_segment_sum(b.values, idx[num_a:], num)
    return tf.reduce_sum(rows_a * rows_b)
  if _is_slices(b):
    a, b = b, a
  if _is_slices(a):
    return tf.reduce_sum(a.values * tf.gather(b, a.indices))
  return tf.reduce_sum(a * b)
