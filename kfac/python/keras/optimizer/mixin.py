"""`kfac.keras.optimizers.Kfac`: K-FAC as a Keras optimizer.

    model.compile(optimizer=kfac.keras.optimizers.Kfac(
        learning_rate=0.1, damping=0.01, model=model,
        loss="sparse_categorical_crossentropy"), loss=...)
    model.fit(...)

How it works. Creating the optimizer with `model=` installs a recorder on the
model's layers (layer_recorder). Keras traces `fit`'s train step into one
graph: the forward pass records each layer's inputs and pre-activations, and
the optimizer's update, which runs in the same graph, registers the layers
and the loss on a fresh LayerCollection (kfac.keras.utils.
get_layer_collection) and applies one `PeriodicInvCovUpdateKfacOpt` step:
statistics every `cov_update_every` steps, inverses every `invert_every`
steps, then the preconditioned update. All K-FAC state lives in the core
optimizer's StateStore, created on the first step and found again on every
retrace; it is saved by `model.save(...)` (with the Keras optimizer
variables) and by `tf.train.Checkpoint`.

Sampled targets use stateless random ops seeded with (seed, steps taken; the
seed is kept with the K-FAC state), so a run restored from a checkpoint
continues on exactly the same trajectory.

adaptive=True: the learning rate and momentum come from the quadratic model
(momentum_type "qmodel") and the damping from the Levenberg-Marquardt rule
(adapt_damping), optionally calibrated during burn-in (num_burnin_steps,
calibrate_damping=True). The rule evaluates the training loss
(`model.compute_loss` on `model(x, training=True)`) on the step's batch
before and after the update; around each evaluation the model's
non-trainable and metric variables are saved and restored, so BatchNorm
statistics are updated once per step as usual and dropout draws the same
masks before and after (Keras 3 seed generators; tf_keras dropout is
stateful, so there its noise enters rho). The batch is the one `fit` passes
to `compute_loss`; a custom loop calls `optimizer.set_train_batch((x, y))`
before `apply_gradients`. After each step the learning rate the model chose
is written to `optimizer.learning_rate`.

Both Keras flavours: `Kfac` subclasses the optimizer base class of the Keras
that `tf.keras` resolves to (Keras 3, or tf_keras with
TF_USE_LEGACY_KERAS=1).
"""

import contextlib
import warnings
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from kfac.python.keras import keras_flavor
from kfac.python.keras import layer_recorder
from kfac.python.keras import layer_registration
from kfac.python.keras import loss_registration
from kfac.python.keras import utils as keras_utils
from kfac.python.ops.optimizers import periodic as periodic_lib
from kfac.python.ops.adaptive import recipe
from kfac.python.ops.tensors import utils as kfac_utils
from kfac.python.ops.distribute import collective
from kfac.python.ops.reliability import arguments

# Hyperparameters kept in variables, so that callbacks and users can change
# them between steps without retracing.
MUTABLE_HYPERPARAMETERS = ("learning_rate", "damping", "momentum",
                           "weight_decay_coeff", "norm_constraint")
# kfac 0.2.x's name of the same set.
_MUTABLE_HYPER_PARAMS = frozenset(MUTABLE_HYPERPARAMETERS)
_CORE_DEFAULTS = {"momentum": 0.9, "weight_decay_coeff": 0.1}
# Keras optimizer options that do not make sense for K-FAC: rejected.
_KERAS_ONLY_OPTIONS = ("clipnorm", "clipvalue", "global_clipnorm", "use_ema",
                       "ema_momentum", "ema_overwrite_frequency",
                       "loss_scale_factor", "gradient_accumulation_steps",
                       "weight_decay", "jit_compile", "is_legacy_optimizer")
_STATE_PREFIX = "kfac_state:"
# What the hyperparameters must satisfy (reliability/arguments.py).
_RULES = {"damping": arguments.POSITIVE, "momentum": arguments.MOMENTUM,
          "weight_decay_coeff": arguments.NON_NEGATIVE,
          "norm_constraint": arguments.POSITIVE}
# Core arguments that Kfac sets itself (adaptive=True / calibrate_damping).
_OWNED_CORE_ARGUMENTS = ("loss", "loss_fn", "prev_train_batch", "train_batch",
                         "adapt_damping", "use_passed_loss",
                         "update_damping_immediately")


def _check_kwargs(kfac_kwargs):
  bad = [k for k in kfac_kwargs if k in _KERAS_ONLY_OPTIONS]
  if bad:
    raise ValueError(
        "Kfac does not support the Keras optimizer option(s) %s. K-FAC "
        "bounds its steps with norm_constraint=... and decays weights with "
        "use_weight_decay=True, weight_decay_coeff=..." % ", ".join(bad))
  for key in ("layer_collection", "var_list", "name"):
    if key in kfac_kwargs:
      raise ValueError("Pass %s as an argument of Kfac, not in kfac_kwargs."
                       % key)
  for key in _OWNED_CORE_ARGUMENTS:
    if key in kfac_kwargs:
      raise ValueError(
          "Kfac sets %s itself: adaptive=True adapts the damping, and the "
          "damping rule evaluates model.compute_loss on the step's batch "
          "(the one fit passes, or optimizer.set_train_batch((x, y)) in a "
          "custom loop) before and after the update." % key)


def _check_before_base(learning_rate, adaptive, kfac_kwargs):
  """The checks that must come before the Keras base class is built."""
  _check_kwargs(kfac_kwargs)
  momentum_type = kfac_kwargs.get("momentum_type", "qmodel" if adaptive
                                  else "adam")
  if "loss_tensor" in kfac_kwargs:
    raise ValueError(
        "Kfac(loss_tensor=...) is a TF1-graph argument (a loss tensor built "
        "before the optimizer): in TF2 pass the loss to "
        "optimizer.minimize(loss, var_list) inside the tf.function; the "
        "damping rule (adaptive=True) evaluates model.compute_loss itself.")
  if adaptive:
    if learning_rate is not None:
      raise ValueError(
          "learning_rate must be None with adaptive=True, which chooses the "
          "learning rate at every step from the "
          "quadratic model: pass learning_rate=None (got %r)." %
          (learning_rate,))
    if not str(momentum_type).startswith("qmodel"):
      raise ValueError(
          "adaptive=True uses momentum_type 'qmodel' (or 'qmodel_fixedmu' "
          "with a momentum), got %r." % (momentum_type,))
    if momentum_type == "qmodel" and kfac_kwargs.get("momentum") is not None:
      raise ValueError(
          "adaptive=True (momentum_type 'qmodel') chooses the momentum too: "
          "drop momentum=%r, or pass momentum_type='qmodel_fixedmu'." %
          (kfac_kwargs["momentum"],))
  elif learning_rate is None:
    raise ValueError("Kfac needs learning_rate (adaptive=False).")
  if arguments.is_number(learning_rate):
    arguments.check("Kfac", "learning_rate", learning_rate,
                    arguments.NON_NEGATIVE)


class KfacKerasMixin:
  """Everything of the Keras optimizer that does not depend on the flavour.

  Subclasses call `_kfac_init` from `__init__` and `_kfac_apply` where their
  base class applies gradients."""

  # -------------------------------------------------------------- set-up
  def _kfac_init(self, learning_rate, damping, model, loss, loss_weights,
                 fisher_approx, layer_collection, adaptive, train_batch,
                 seed, kfac_kwargs):
    _check_before_base(learning_rate, adaptive, kfac_kwargs)
    kfac_kwargs = dict(kfac_kwargs)
    if adaptive:
      # The default recipe (kfac/python/ops/adaptive/recipe, docs/recipe.md).
      kfac_kwargs.setdefault("relative_min_damping",
                             recipe.RELATIVE_MIN_DAMPING)
      kfac_kwargs.setdefault("cov_update_every", recipe.COV_UPDATE_EVERY)
      if damping is None:
        damping = recipe.INITIAL_DAMPING
        kfac_kwargs.setdefault("calibrate_damping", True)
        kfac_kwargs.setdefault("num_burnin_steps", recipe.NUM_BURNIN_STEPS)
    calibrate = bool(kfac_kwargs.get("calibrate_damping", False))
    if train_batch is not None and not (adaptive or calibrate):
      raise ValueError(
          "train_batch is the batch the damping rule evaluates: it needs "
          "adaptive=True (or calibrate_damping=True).")
    if damping is None:
      raise ValueError(
          "Kfac needs damping (or adaptive=True, which adapts it from an "
          "initial damping calibrated during burn-in).")
    if layer_collection is not None:
      raise ValueError(
          "layer_collection=... is not used by the Keras optimizer: its "
          "collection is rebuilt from the model on every trace. Register "
          "extra layers through fisher_approx, or write a custom loop with "
          "kfac.PeriodicInvCovUpdateKfacOpt.")
    for one_loss in ([] if loss is None else tf.nest.flatten(loss)):
      loss_registration.loss_spec(one_loss)  # unsupported losses fail now
    self._kfac_options = dict(kfac_kwargs.pop("registration_options", None)
                              or {})
    self._kfac_kwargs = dict(kfac_kwargs)
    self._kfac_loss = loss
    self._kfac_loss_weights = loss_weights
    self._kfac_adaptive = bool(adaptive)
    self._kfac_train_batch = train_batch
    self._kfac_fisher_approx = dict(fisher_approx or {})
    if seed is None:
      # Deterministic by default (a run and its resumed copy draw the same
      # samples); tf.random.set_seed / keras.utils.set_random_seed choose
      # another.
      seed = int(_global_seed() or 0) % (2**31 - 1)
    self._kfac_seed = int(seed)
    object.__setattr__(self, "_kfac_model_ref", None)
    self._kfac_report = None
    self._kfac_warned = set()
    self._kfac_hyper = {}
    values = dict(_CORE_DEFAULTS)
    if adaptive:
      del values["momentum"]  # qmodel chooses it (qmodel_fixedmu: given)
    values.update({k: kfac_kwargs[k] for k in MUTABLE_HYPERPARAMETERS
                   if k in kfac_kwargs})
    values["damping"] = damping
    for name in ("damping", "momentum", "weight_decay_coeff",
                 "norm_constraint"):
      value = values.get(name)
      if value is None:
        continue
      arguments.check("Kfac", name, value, _RULES[name])
      if not kfac_utils.is_python_number(value):
        raise ValueError("Kfac's %s must be a number (schedules: use "
                         "kfac.keras.callbacks), got %r." % (name, value))
      self._kfac_hyper[name] = self._kfac_make_variable(name, float(value))
    core_kwargs = {k: v for k, v in kfac_kwargs.items()
                   if k not in MUTABLE_HYPERPARAMETERS}
    for name, var in self._kfac_hyper.items():
      core_kwargs[name] = var
    if adaptive:
      core_kwargs.setdefault("momentum_type", "qmodel")
      core_kwargs.update(adapt_damping=True)
      if core_kwargs["momentum_type"] == "qmodel":
        core_kwargs["momentum"] = None
    if adaptive or calibrate:
      # The passed loss is unknown here (and drew other dropout masks):
      # loss_fn evaluates the loss before the update too.
      core_kwargs.update(use_passed_loss=False, loss_fn=self._kfac_loss_fn)
    core = periodic_lib.PeriodicInvCovUpdateKfacOpt(
        learning_rate=None if adaptive else self._kfac_lr_tensor,
        name=self.name, **core_kwargs)
    # Not a checkpoint dependency (its state is, through _kfac_state).
    object.__setattr__(self, "_kfac_core", core)
    self._kfac_state = core.state_store
    if model is not None:
      self.register_model(model)

  def _kfac_lr_tensor(self):
    return tf.convert_to_tensor(
        keras_flavor.unwrap_variable(self._learning_rate))

  def register_model(self, model):
    """Uses `model` (its layers are watched from now on)."""
    current = self._kfac_model
    if current is not None and current is not model:
      raise ValueError("This Kfac optimizer already serves model %r." %
                       current.name)
    layer_registration.check_fisher_approx(self._kfac_fisher_approx, model)
    layer_registration.check_registration_options(self._kfac_options, model)
    keras_utils.watch(model)
    keras_utils.name_state_by_structure(model)
    # A weak reference: the model owns the optimizer, not the reverse (and
    # the model must not become a checkpoint dependency of the optimizer).
    object.__setattr__(self, "_kfac_model_ref", weakref.ref(model))

  @property
  def _kfac_model(self):
    ref = self._kfac_model_ref
    return None if ref is None else ref()

  @property
  def model(self):
    return self._kfac_model

  @property
  def kfac_optimizer(self):
    """The core PeriodicInvCovUpdateKfacOpt doing the work."""
    return self._kfac_core

  @property
  def optimizer(self):
    """The core PeriodicInvCovUpdateKfacOpt (kfac 0.2.x's name)."""
    return self._kfac_core

  @property
  def mutable_hyperparameters(self):
    """Names of the hyperparameters that can be set between steps."""
    names = set(self._kfac_hyper)
    if not self._kfac_adaptive:
      names.add("learning_rate")
    else:
      names -= {"learning_rate", "damping", "momentum"}
    return names

  def register_layers(self, model=None, loss=None, layer_collection=None):
    """kfac 0.2.x's way to give the model (and its loss) after creation.

    The layers are registered from each traced step, so this records the
    model (as register_model) and the loss (default: the compiled one)."""
    if layer_collection is not None:
      raise ValueError(
          "register_layers(layer_collection=...) is not supported by the "
          "TF2 Keras optimizer: its collection is rebuilt from the model on "
          "every trace. Use register_layers(model=..., loss=...), or a "
          "custom loop with kfac.PeriodicInvCovUpdateKfacOpt and "
          "minimize(..., layer_collection=lc).")
    if model is None:
      raise ValueError("Please provide a model with a loss, a model and loss, "
                       "or a LayerCollection.")
    if loss is not None:
      for one_loss in tf.nest.flatten(loss):
        loss_registration.loss_spec(one_loss)
      if self._kfac_loss is not None and not _same_losses(loss,
                                                          self._kfac_loss):
        raise ValueError("register_layers(loss=%s) disagrees with Kfac(loss="
                         "%s)." % (_describe(loss), _describe(self._kfac_loss)))
      self._kfac_loss = loss
    self.register_model(model)

  def minimize(self, loss, var_list=None, tape=None, **kwargs):
    """One K-FAC step. `loss` may be a tensor computed in the traced step
    (as kfac 0.2.x's minimize: no tape needed inside a tf.function), a
    callable, or a tensor with the tape that recorded it. var_list defaults
    to the model's trainable variables."""
    if var_list is None:
      model = self._kfac_model
      if model is None:
        raise ValueError("minimize needs var_list=... (or Kfac(model=...)).")
      var_list = model.trainable_variables
    if callable(var_list):
      var_list = var_list()
    if tape is not None or callable(loss):
      return super().minimize(loss, var_list, tape=tape, **kwargs)
    if tf.executing_eagerly():
      raise RuntimeError(
          "Kfac.minimize(loss_tensor) without a tape needs the tensor of a "
          "traced step: call it inside a tf.function (or pass tape=..., or a "
          "callable loss).")
    variables = list(var_list)
    grads = tf.gradients(loss, [keras_flavor.unwrap_variable(v)
                                for v in variables])
    return self.apply_gradients(list(zip(grads, variables)))

  @property
  def skipped_steps(self):
    """How many steps the non-finite guard skipped (docs/reliability.md)."""
    return self._kfac_core.skipped_steps

  @property
  def state_store(self):
    """The K-FAC state (factors, inverses, velocities, counter)."""
    return self._kfac_state

  @property
  def registration_report(self):
    """What each layer was registered as, from the last traced step (or the
    plan, before the first step)."""
    if self._kfac_report is not None:
      return self._kfac_report
    if self._kfac_model is None:
      return "(no model yet)"
    plans = layer_registration.plan_layers(self._kfac_model,
                                           self._kfac_fisher_approx)
    rows = [layer_registration.Row(
        keras_flavor.layer_path(p.layer), type(p.layer).__name__,
        "(" + p.kind + ")", p.approx or "default",
        ", ".join(v.name for v in p.params), 0,
        "fallback: " + p.reason if p.kind == "generic" else "")
            for p in plans]
    return layer_registration.format_report(rows) + (
        "\n(planned; blocks and losses are known after the first step)")

  # -------------------------------------------------------------- hyperparameters
  def _kfac_get(self, name):
    return self._kfac_hyper.get(name)

  def _kfac_check_not_adapted(self, name):
    if getattr(self, "_kfac_adaptive", False) and name in (
        "learning_rate", "damping", "momentum"):
      raise ValueError(
          "Kfac(adaptive=True) chooses the %s itself at every step, so it "
          "cannot be set (or scheduled by a callback); its current value is "
          "readable." % name)

  def _kfac_set(self, name, value):
    self._kfac_check_not_adapted(name)
    var = self._kfac_hyper.get(name)
    if var is None:
      raise ValueError(
          "%s was not set when the optimizer was created, so it is not a "
          "variable and cannot be changed now; pass %s=... to Kfac." %
          (name, name))
    var.assign(value)

  def _kfac_base_property(self, name):
    """The property `name` of the Keras optimizer base class."""
    for cls in type(self).__mro__:
      if not issubclass(cls, KfacKerasMixin) and name in vars(cls):
        return vars(cls)[name]
    raise AttributeError(name)

  @property
  def learning_rate(self):
    """The learning rate (with adaptive=True: the one the quadratic model
    chose at the last step)."""
    return self._kfac_base_property("learning_rate").__get__(self)

  @learning_rate.setter
  def learning_rate(self, value):
    self._kfac_check_not_adapted("learning_rate")
    self._kfac_base_property("learning_rate").__set__(self, value)

  # -------------------------------------------------------------- adaptive
  def set_train_batch(self, train_batch):
    """The batch (x, y) or (x, y, sample_weight) the damping rule evaluates
    (adaptive=True or calibrate_damping=True) in a custom tf.function loop:
    call it in the step, before apply_gradients. model.fit needs no call."""
    self._kfac_step_batch = (_current_graph(), train_batch)

  def _kfac_batch(self):
    """(x, y, sample_weight) of this step for the damping rule."""
    pending = getattr(self, "_kfac_step_batch", None)
    batch = None
    if pending is not None and pending[0] is _current_graph():
      batch = pending[1]
    elif self._kfac_train_batch is not None:
      batch = self._kfac_train_batch
    if callable(batch):
      batch = batch()
    if batch is None:
      recorded = layer_recorder.recorder_for(self._kfac_model).loss_args()
      if recorded is None or recorded.get("x") is None:
        raise ValueError(
            "Kfac's damping rule (adaptive=True / calibrate_damping=True) "
            "evaluates the loss on the step's batch, but none was found: in "
            "a custom loop call optimizer.set_train_batch((x, y)) in the "
            "step, before apply_gradients.")
      return (recorded["x"], recorded.get("y"),
              recorded.get("sample_weight"))
    batch = tuple(batch)
    if len(batch) not in (2, 3):
      raise ValueError("train_batch must be (x, y) or (x, y, sample_weight), "
                       "got %d elements." % len(batch))
    return batch if len(batch) == 3 else batch + (None,)

  def _kfac_loss_fn(self, batch):
    """The training loss on `batch`, leaving the model's state as it was
    (see the module docstring)."""
    model = self._kfac_model
    x, y, sample_weight = batch
    state = keras_flavor.state_variables(model)
    saved = [tf.identity(v.read_value()) for v in state]
    with tf.control_dependencies(saved):
      with layer_recorder.recorder_for(model).paused():
        y_pred = model(x, training=True)
        loss = model.compute_loss(x=x, y=y, y_pred=y_pred,
                                  sample_weight=sample_weight)
    with tf.control_dependencies([loss]):
      restored = [v.assign(value, read_value=False)
                  for v, value in zip(state, saved)]
    with tf.control_dependencies(restored):
      return tf.identity(loss)

  # -------------------------------------------------------------- the step
  def _kfac_warn(self, key, message):
    if key not in self._kfac_warned:
      self._kfac_warned.add(key)
      warnings.warn(message, UserWarning, stacklevel=4)

  def _kfac_losses(self):
    """(loss, loss_weights) for the registration: those given to Kfac, or
    else those of model.compile. Given both ways, they must agree."""
    compiled, compiled_weights = _compiled_loss(self._kfac_model)
    loss, weights = self._kfac_loss, self._kfac_loss_weights
    if loss is None:
      loss = compiled
    elif compiled is not None and not _same_losses(loss, compiled):
      raise ValueError(
          "Kfac(loss=%s) disagrees with model.compile(loss=%s): K-FAC would "
          "precondition for another loss than the one the model trains on. "
          "Give the loss once, to model.compile; Kfac(model=...) takes it "
          "from there." % (_describe(loss), _describe(compiled)))
    if weights is None:
      weights = compiled_weights
    elif (compiled_weights is not None and
          not _same_weights(weights, compiled_weights)):
      raise ValueError(
          "Kfac(loss_weights=%r) disagrees with model.compile(loss_weights="
          "%r). Give them once, to model.compile; Kfac(model=...) takes "
          "them from there." % (weights, compiled_weights))
    return loss, weights

  def _kfac_apply(self, grads, variables, iteration):
    """One K-FAC step for Keras (grads, variables); returns the op."""
    if tf.executing_eagerly():
      raise RuntimeError(
          "Kfac needs the forward pass and the update in one traced step: "
          "model.fit with run_eagerly=True, or an eager custom loop, is not "
          "supported. Trace the step with tf.function.")
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if replicas > 1 and self._kfac_adaptive:
      raise NotImplementedError(
          "Kfac(adaptive=True) under a tf.distribute strategy with %d "
          "replicas is not supported yet (it writes the chosen learning rate "
          "into the optimizer's mirrored hyperparameter inside the step). "
          "Use a fixed learning rate, or one replica." % replicas)
    if self._kfac_model is None:
      raise ValueError(
          "Kfac has no model: create it with Kfac(..., model=model), call "
          "optimizer.register_model(model), or load a saved model with "
          "kfac.keras.saving_utils.load_model.")
    # Keras's LossScaleOptimizer (mixed_float16) applies this optimizer in
    # a conditional branch: the statistics' sampled backward pass must be
    # built in the graph of the forward pass, which encloses the branch.
    forward = keras_utils.forward_graph(self._kfac_model)
    current = tf.compat.v1.get_default_graph()
    in_branch = forward is not None and forward is not current
    core = self._kfac_core
    if in_branch and (core._momentum_type.startswith("qmodel") or  # pylint: disable=protected-access
                      core._adapt_damping or core.calibrate_damping):  # pylint: disable=protected-access
      raise NotImplementedError(
          "Kfac with the quadratic model or the damping rule (adaptive=True, "
          "momentum_type='qmodel*', adapt_damping, calibrate_damping) is not "
          "supported under Keras's LossScaleOptimizer (the mixed_float16 "
          "policy) yet: its curvature products would be taken inside the "
          "loss scaling's conditional, away from the forward pass. Use the "
          "mixed_bfloat16 policy, float32, or a fixed learning rate and "
          "damping.")
    with forward.as_default() if in_branch else contextlib.nullcontext():
      lc = self._kfac_register(variables, replicas)
      if self._kfac_adaptive or self._kfac_core.calibrate_damping:
        self._kfac_core.set_train_batch(self._kfac_batch())
      if in_branch:  # the sources and their gradients, built there
        self._kfac_core.set_layer_collection(lc)
        self._kfac_core.estimator.instantiate_variables()
    tf_vars = [keras_flavor.unwrap_variable(v) for v in variables]
    op = self._kfac_core.apply_gradients(list(zip(grads, tf_vars)),
                                         layer_collection=lc)
    return self._kfac_after_apply(op, iteration)

  def _kfac_register(self, variables, replicas):
    """The model's LayerCollection for this trace."""
    # The samples of a step are drawn from (seed, steps taken): a step the
    # non-finite guard skipped (which Keras counts in `iterations`) does
    # not shift the samples of the steps after it.
    # The seed is K-FAC state too: a checkpoint restores it.
    seed_var = self._kfac_state.get_or_create(
        "keras_sample_seed", [], tf.int64, initial_value=self._kfac_seed)
    seed = tf.stack([tf.convert_to_tensor(seed_var),
                     self._kfac_core.steps_taken()])
    if replicas > 1:  # each replica samples its own targets
      seed = seed + tf.stack([
          tf.cast(collective.replica_id(), tf.int64) * 1000003,
          tf.constant(0, tf.int64)])
    keras_utils.name_state_by_structure(self._kfac_model)
    lc, report = keras_utils.register_model(
        self._kfac_model, *self._kfac_losses(),
        fisher_approx=self._kfac_fisher_approx, seed=seed,
        variables=variables, warn=self._kfac_warn,
        registration_options=self._kfac_options,
        # The default recipe was tuned on the Keras loss's own scale; the
        # 0.2.x-style optimizer keeps kfac 0.2.x's coefficients.
        average_over_outputs=self._kfac_adaptive)
    self._kfac_report = report
    return lc

  def _kfac_after_apply(self, op, iteration):
    """The learning rate display, warnings and summaries after the step."""
    if self._kfac_adaptive:  # show the learning rate the model chose
      with tf.control_dependencies([op]):
        lr = keras_flavor.unwrap_variable(self._learning_rate)
        op = tf.group(lr.assign(tf.cast(self._kfac_core.learning_rate,
                                        lr.dtype), read_value=False))
    unused = self._kfac_state.unused_restored_keys
    if unused:
      self._kfac_warn("unused_state", (
          "kfac: %d restored K-FAC state values match no variable of this "
          "model (e.g. %s); they are not used. K-FAC state is keyed by "
          "variable names: give the layers explicit names when rebuilding a "
          "model in the same process." % (len(unused), unused[0])))
    with tf.control_dependencies([op]):
      self._kfac_summaries(iteration)
    return op

  def _kfac_summaries(self, iteration):
    """TensorBoard scalars when a default summary writer is active (a no-op
    otherwise, and inside XLA, which cannot compile summary writes)."""
    if _in_xla_context():
      return
    step = tf.cast(iteration, tf.int64)
    _write_scalar("kfac/learning_rate", self._kfac_lr_tensor(), step)
    _write_scalar("kfac/skipped_steps", self._kfac_core.skipped_steps, step)
    for name in ("damping", "momentum"):
      var = self._kfac_hyper.get(name)
      if var is not None:
        _write_scalar("kfac/" + name, var, step)
    core = self._kfac_core
    if self._kfac_adaptive:
      if "momentum" not in self._kfac_hyper:
        _write_scalar("kfac/momentum", core.momentum, step)
    if self._kfac_adaptive or core.calibrate_damping:
      _write_scalar("kfac/rho", core.rho, step)
      _write_scalar("kfac/qmodel_change", core.qmodel_change, step)

  # -------------------------------------------------------------- config
  def _kfac_config(self, learning_rate):
    config = {
        "learning_rate": None if self._kfac_adaptive else learning_rate,
        "damping": float(self._kfac_hyper["damping"].numpy()),
        "adaptive": self._kfac_adaptive,
        "loss": _serialize_loss(self._kfac_loss),
        "loss_weights": self._kfac_loss_weights,
        "fisher_approx": _encode_layer_keys(self._kfac_fisher_approx),
        "seed": self._kfac_seed,
        "name": self.name,
    }
    kwargs = dict(self._kfac_kwargs)
    for name, var in self._kfac_hyper.items():
      if name != "damping":
        kwargs[name] = float(var.numpy())
    if self._kfac_options:
      kwargs["registration_options"] = _encode_layer_keys(self._kfac_options)
    config.update(kwargs)
    return config

  # -------------------------------------------------------------- state
  def get_config(self):
    return self._kfac_config(float(self._kfac_lr_tensor().numpy()))

  @classmethod
  def from_config(cls, config, custom_objects=None):
    del custom_objects
    config = dict(config)
    config["loss"] = _deserialize_loss(config.get("loss"))
    return cls(**config)

  def save_own_variables(self, store):
    """The Keras variables by index (as Keras does), and every K-FAC state
    variable under "kfac_state:<its key>"."""
    for i, variable in enumerate(self.variables):
      store[str(i)] = variable.numpy()
    for key, value in self._kfac_state.numpy_state().items():
      store[_STATE_PREFIX + _encode(key)] = value

  def load_own_variables(self, store):
    values, rest = {}, []
    for key in store.keys():
      if key.startswith(_STATE_PREFIX):
        values[_decode(key[len(_STATE_PREFIX):])] = np.asarray(store[key])
      else:
        rest.append(key)
    if len(rest) != len(self.variables):
      raise ValueError(
          "The saved optimizer has %d Keras variables but Kfac %r has %d: "
          "was it saved with different Kfac arguments?" %
          (len(rest), self.name, len(self.variables)))
    for i, variable in enumerate(self.variables):
      variable.assign(store[str(i)])
    self._kfac_state.restore(values)

  damping = property(lambda self: self._kfac_get("damping"),
                     lambda self, v: self._kfac_set("damping", v))
  momentum = property(lambda self: self._kfac_get("momentum"),
                      lambda self, v: self._kfac_set("momentum", v))
  weight_decay_coeff = property(
      lambda self: self._kfac_get("weight_decay_coeff"),
      lambda self, v: self._kfac_set("weight_decay_coeff", v))
  norm_constraint = property(
      lambda self: self._kfac_get("norm_constraint"),
      lambda self, v: self._kfac_set("norm_constraint", v))


def _encode_layer_keys(mapping):
  """Layer-class keys as "__class__:Name" strings (JSON-able configs)."""
  return {(layer_registration.CLASS_KEY_PREFIX + k.__name__
           if isinstance(k, type) else k): v for k, v in mapping.items()}


def _encode(key):
  return key.replace("|", "||").replace("/", "|")


def _decode(key):
  out, i = [], 0
  while i < len(key):
    if key.startswith("||", i):
      out.append("|")
      i += 2
    elif key[i] == "|":
      out.append("/")
      i += 1
    else:
      out.append(key[i])
      i += 1
  return "".join(out)


def _compiled_loss(model):
  """(loss, loss_weights) given to model.compile, None where none was."""
  loss = getattr(model, "loss", None)
  if isinstance(loss, dict) and not loss:  # tf_keras: compiled without one
    loss = None
  container = (getattr(model, "_compile_loss", None) or  # Keras 3
               getattr(model, "compiled_loss", None))    # tf_keras
  weights = getattr(container, "_user_loss_weights", None)
  return loss, weights


def _describe(loss):
  if isinstance(loss, str):
    return repr(loss)
  if isinstance(loss, (list, tuple)):
    return "[%s]" % ", ".join(_describe(l) for l in loss)
  if isinstance(loss, dict):
    return "{%s}" % ", ".join("%r: %s" % (k, _describe(v))
                              for k, v in sorted(loss.items()))
  try:
    spec = loss_registration.loss_spec(loss)
  except Exception:  # pylint: disable=broad-except
    return repr(loss)
  return "%s(from_logits=%s)" % (spec.description, spec.from_logits)


def _same_losses(a, b):
  """Whether two loss structures name the same losses (spellings aside:
  "mse", "mean_squared_error" and keras.losses.MeanSquaredError() agree)."""
  if isinstance(a, dict) or isinstance(b, dict):
    if not (isinstance(a, dict) and isinstance(b, dict)) or (
        sorted(a) != sorted(b)):
      return False
    return all(_same_losses(a[k], b[k]) for k in a)
  if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
    a = list(a) if isinstance(a, (list, tuple)) else [a]
    b = list(b) if isinstance(b, (list, tuple)) else [b]
    return len(a) == len(b) and all(_same_losses(x, y) for x, y in zip(a, b))
  if a is b:
    return True
  try:
    sa, sb = loss_registration.loss_spec(a), loss_registration.loss_spec(b)
  except Exception:  # pylint: disable=broad-except
    return False
  return (sa.kind, sa.from_logits, sa.reduction) == (sb.kind, sb.from_logits,
                                                     sb.reduction)


def _same_weights(a, b):
  if isinstance(a, dict) or isinstance(b, dict):
    return (isinstance(a, dict) and isinstance(b, dict) and
            sorted(a) == sorted(b) and
            all(float(a[k]) == float(b[k]) for k in a))
  a = list(a) if isinstance(a, (list, tuple)) else [a]
  b = list(b) if isinstance(b, (list, tuple)) else [b]
  return len(a) == len(b) and all(float(x) == float(y) for x, y in zip(a, b))


def _serialize_loss(loss):
  if loss is None or isinstance(loss, str):
    return loss
  if isinstance(loss, (list, tuple)):
    return [_serialize_loss(l) for l in loss]
  if isinstance(loss, dict):
    return {k: _serialize_loss(v) for k, v in loss.items()}
  return keras_flavor.keras_module().losses.serialize(loss)


def _deserialize_loss(loss):
  if loss is None or isinstance(loss, str):
    return loss
  if isinstance(loss, list):
    return [_deserialize_loss(l) for l in loss]
  if isinstance(loss, dict) and "class_name" not in loss:
    return {k: _deserialize_loss(v) for k, v in loss.items()}
  return keras_flavor.keras_module().losses.deserialize(loss)


def _write_scalar(tag, value, step):
  """tf.summary.scalar without needing the tensorboard package: a float32
  scalar tagged for TensorBoard's scalars plugin (a no-op without a default
  writer)."""
  metadata = summary_pb2.SummaryMetadata()
  metadata.plugin_data.plugin_name = "scalars"
  tf.summary.write(tag, tf.cast(value, tf.float32), step=step,
                   metadata=metadata)


def _global_seed():
  """TensorFlow's global (eager) or graph-level seed, or None; read without
  advancing the op-seed counter as tf.compat.v1.get_seed would."""
  if tf.executing_eagerly():
    from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
    return context.global_seed()
  return tf.compat.v1.get_default_graph().seed


def _current_graph():
  return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


_in_xla_context = kfac_utils.in_xla_context


_CONSTRUCTOR_DOC = """K-FAC as a Keras optimizer.

  Args:
    learning_rate: the step size (a float; change it with
      `optimizer.learning_rate = ...` or kfac.keras.callbacks).
    damping: Tikhonov damping added to the Fisher blocks (a float, kept in a
      variable like learning_rate). With adaptive=True it is the initial
      damping and may be left out: the default recipe then starts from 1.0
      and calibrates it during 5 burn-in steps (calibrate_damping=True,
      num_burnin_steps=5, in which the weights do not move).
    model: the Keras model to train (its layers are watched from now on).
    loss: the model's Keras loss(es) (default: the loss given to compile).
    loss_weights: per-output loss coefficients (as in compile).
    fisher_approx: {layer name or layer class: approximation name}.
    layer_collection: not supported (the collection is built from the
      model); must be None.
    adaptive: True: the default recipe (docs/recipe.md): learning rate
      and momentum from the quadratic model (momentum_type "qmodel"),
      damping adapted by the Levenberg-Marquardt rule and never below
      relative_min_damping=0.1 times the curvature scale (pass
      learning_rate=None; see the module docstring). Its losses are
      registered at the scale of the Keras loss (coefficient: loss weight /
      outputs per example Keras averages over); without adaptive, as in
      kfac 0.2.x, with the loss weight (docs/keras.md, "Coefficients").
    train_batch: the batch the damping rule evaluates, (x, y) or (x, y,
      sample_weight) or a callable returning one (default: fit's batch;
      custom loops call set_train_batch in the step).
    name: the optimizer's name (also the prefix of its state variables).
    seed: seed of the sampled targets (default: TensorFlow's global seed
      when one is set, else 0; kept in the config and in checkpoints).
    **kfac_kwargs: registration_options={layer name or class: {option:
      value}} (convolution statistics options: sub_sample_inputs,
      sub_sample_patches, patch_mask), and the arguments of
      kfac.PeriodicInvCovUpdateKfacOpt
      (momentum, momentum_type, invert_every, cov_update_every,
      num_burnin_steps, calibrate_damping, cov_ema_decay, estimation_mode,
      norm_constraint, use_weight_decay, weight_decay_coeff, l2_reg,
      precon_damping_mult, damping_adaptation_interval, min_damping, ...).
  """


def _make_keras3_class(keras):
  """The Keras 3 optimizer class."""

  @keras.saving.register_keras_serializable(package="kfac", name="Kfac")
  class Kfac(KfacKerasMixin, keras.optimizers.Optimizer):  # pylint: disable=missing-docstring
    __doc__ = _CONSTRUCTOR_DOC

    def __init__(self, learning_rate=None, damping=None, model=None,
                 loss=None, loss_weights=None, fisher_approx=None,
                 layer_collection=None, adaptive=False, train_batch=None,
                 name="Kfac", seed=None, **kfac_kwargs):
      if keras_flavor.v1_graph_mode():
        raise RuntimeError(
            "Keras 3 does not run in TF1 graph mode (v2 behaviour disabled "
            "or inside a tf.compat.v1.Graph). For kfac 0.2.x graph-mode "
            "Keras code set TF_USE_LEGACY_KERAS=1 (tf_keras) before "
            "importing TensorFlow; or run in TF2 (eager + tf.function).")
      _check_before_base(learning_rate, adaptive, kfac_kwargs)
      super().__init__(learning_rate=float(learning_rate or 0.0), name=name)
      self._kfac_init(learning_rate, damping, model, loss, loss_weights,
                      fisher_approx, layer_collection, adaptive,
                      train_batch, seed, kfac_kwargs)

    def _kfac_make_variable(self, name, value):
      var = keras.Variable(value, name=name, dtype="float32",
                           trainable=False)
      self._track_variable(var)
      return keras_flavor.unwrap_variable(var)

    def _backend_apply_gradients(self, grads, trainable_variables):
      self._kfac_apply(grads, trainable_variables,
                       keras_flavor.unwrap_variable(self._iterations))

    def update_step(self, gradient, variable, learning_rate):
      raise NotImplementedError("Kfac updates all variables at once.")

    def stateless_apply(self, optimizer_variables, grads,
                        trainable_variables):
      raise NotImplementedError("Kfac runs on the TensorFlow backend only.")


  return Kfac


class _LegacyKfacMeta(type):
  """isinstance(opt, Kfac) holds for the graph-mode Kfac that Kfac(...)
  builds in a TF1 graph too."""

  def __instancecheck__(cls, obj):
    graph_cls = _CLASSES.get("graph")
    return type.__instancecheck__(cls, obj) or (
        graph_cls is not None and isinstance(obj, graph_cls))


def _make_legacy_class(tf_keras):
  """The tf_keras (Keras 2) optimizer class."""

  @tf_keras.saving.register_keras_serializable(package="kfac", name="Kfac")
  class Kfac(KfacKerasMixin, tf_keras.optimizers.Optimizer,  # pylint: disable=missing-docstring
             metaclass=_LegacyKfacMeta):
    __doc__ = _CONSTRUCTOR_DOC

    def __new__(cls, *args, **kwargs):
      if keras_flavor.v1_graph_mode():
        # tf_keras's v1 engine takes only its legacy optimizers: kfac
        # 0.2.x's graph-mode Kfac (get_updates / minimize return TF1 ops).
        return _graph_class(tf_keras)(*args, **kwargs)
      return super().__new__(cls)

    def __init__(self, learning_rate=None, damping=None, model=None,
                 loss=None, loss_weights=None, fisher_approx=None,
                 layer_collection=None, adaptive=False, train_batch=None,
                 name="Kfac", seed=None, **kfac_kwargs):
      _check_before_base(learning_rate, adaptive, kfac_kwargs)
      super().__init__(name=name, jit_compile=False)
      self._learning_rate = self._build_learning_rate(
          float(learning_rate or 0.0))
      self._kfac_init(learning_rate, damping, model, loss, loss_weights,
                      fisher_approx, layer_collection, adaptive,
                      train_batch, seed, kfac_kwargs)

    def _kfac_make_variable(self, name, value):
      with tf.init_scope():
        var = tf.Variable(value, name=name, dtype=tf.float32,
                          trainable=False)
      self._variables.append(var)
      return var

    def apply_gradients(self, grads_and_vars, name=None,
                        skip_gradients_aggregation=False, **kwargs):
      del name, skip_gradients_aggregation, kwargs
      grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
      grads, variables = zip(*grads_and_vars)
      if not getattr(self, "_built", False):
        with tf.init_scope():
          self.build(list(variables))
      op = self._kfac_apply(list(grads), list(variables), self.iterations)
      with tf.control_dependencies([op]):
        return self.iterations.assign_add(1)

    def update_step(self, gradient, variable):
      raise NotImplementedError("Kfac updates all variables at once.")


  return Kfac


_CLASSES = {}


def _graph_class(tf_keras):
  """The Kfac class of tf_keras's v1 graph engine (graph_optimizer)."""
  if "graph" not in _CLASSES:
    from kfac.python.keras import graph_optimizer  # pylint: disable=g-import-not-at-top
    _CLASSES["graph"] = graph_optimizer.make_graph_class(tf_keras)
  return _CLASSES["graph"]


def kfac_class(legacy=None):
  """The Kfac class of the Keras 3 (legacy=False) or tf_keras flavour
  (default: the one tf.keras resolves to)."""
  if legacy is None:
    legacy = keras_flavor.legacy_keras_active()
  if legacy not in _CLASSES:
    if legacy:
      import tf_keras  # pylint: disable=g-import-not-at-top
      _CLASSES[legacy] = _make_legacy_class(tf_keras)
    else:
      import keras  # pylint: disable=g-import-not-at-top
      _CLASSES[legacy] = _make_keras3_class(keras)
  return _CLASSES[legacy]


Kfac = kfac_class()

__all__ = ["Kfac", "kfac_class", "MUTABLE_HYPERPARAMETERS"]
