"""KfacEngine: the K-FAC part of the Keras Kfac optimizer, the same for
Keras 3 and tf_keras. The Keras class (keras3.py, legacy_keras.py) builds
one in `__init__` and calls it; the engine holds:

* the set-up from Kfac's arguments (checked against the rules at the end
  of this module, which also fills in the default recipe) and the core
  PeriodicInvCovUpdateKfacOpt doing the work, with its StateStore (a
  checkpoint dependency of the Keras object);
* the hyperparameter variables (damping, momentum, ...), made by the Keras
  class (`make_variable`, so that Keras tracks them in its own variables);
* the model it serves (a weak reference) and the loss given to Kfac;
* the per-trace step (`KerasStep`) and the registration report.

The module holds, in this order: `KfacEngine`; `KfacOptimizerBase`, what
both Keras classes show to Keras and to the user, forwarded to their
engine; `KerasStep`, the step inside the traced train step; the arguments
Kfac accepts and their checks.
"""

import contextlib
import warnings
import weakref

import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from kfac.python.keras import keras_flavor
from kfac.python.keras import layer_registration
from kfac.python.keras import loss_registration
from kfac.python.keras import registration_report
from kfac.python.keras.optimizer import config as config_lib
from kfac.python.keras.optimizer import losses
from kfac.python.ops.adaptive import noise_scale
from kfac.python.ops.adaptive import recipe
from kfac.python.ops.collection import layer_collection as lc_lib
from kfac.python.ops.layers.base import curvature_options as options_lib
from kfac.python.ops.distribute import collective
from kfac.python.ops.optimizers import kfac_optimizer
from kfac.python.ops.reliability import arguments as argument_rules
from kfac.python.ops.tensors import utils as kfac_utils


# Kfac's names of the core optimizer's arguments.
_CORE_NAMES = {"weight_decay": "decoupled_weight_decay"}


class KfacEngine:
  """Set-up, model and hyperparameters of the Keras Kfac optimizer, and
  its step (`step.apply`).

  Args:
    name: the Keras optimizer's name (the core optimizer's).
    make_variable: (name, value) -> a float32 tf.Variable the Keras
      optimizer tracks (a hyperparameter).
    learning_rate_variable: () -> the Keras optimizer's learning-rate
      tf.Variable.
    The others: Kfac's arguments (CONSTRUCTOR_DOC).
  """

  def __init__(self, name, make_variable, learning_rate_variable,
               learning_rate, damping, model, loss, loss_weights,
               fisher_approx, layer_collection, adaptive, train_batch, seed,
               kfac_kwargs):
    check_before_base(learning_rate, adaptive, kfac_kwargs)
    # The default recipe (kfac/python/ops/adaptive/recipe, docs/recipe.md).
    damping, kfac_kwargs = with_recipe_defaults(damping, adaptive,
                                                          kfac_kwargs)
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
    self.learning_rate_variable = learning_rate_variable
    self.options = dict(kfac_kwargs.pop("registration_options", None) or {})
    self.kwargs = dict(kfac_kwargs)
    self.loss = loss
    self.loss_weights = loss_weights
    self.adaptive = bool(adaptive)
    # adaptive=True with momentum_type="regular": the recipe at the user's
    # learning rate and momentum; only the damping is adapted.
    self.fixed_rate = fixed_rate(adaptive, kfac_kwargs)
    self.train_batch = train_batch
    self.fisher_approx = dict(fisher_approx or {})
    # Kronecker factors wider than this keep their diagonal blocks
    # (layers/base/block_diagonal.py; 0: off).
    self.curvature_options = options_lib.CurvatureOptions(
        factor_block_size=int(kfac_kwargs.get("factor_block_size") or 0))
    if seed is None:
      # Deterministic by default (a run and its resumed copy draw the same
      # samples); tf.random.set_seed / keras.utils.set_random_seed choose
      # another.
      seed = int(global_seed() or 0) % (2**31 - 1)
    self.seed = int(seed)
    self._model_ref = None
    self.report = None
    self.hyper = {}
    values = dict(CORE_DEFAULTS)
    if adaptive and not self.fixed_rate:
      del values["momentum"]  # qmodel chooses it (qmodel_fixedmu: given)
    values.update({k: kfac_kwargs[k]
                   for k in MUTABLE_HYPERPARAMETERS
                   if k in kfac_kwargs})
    values["damping"] = damping
    for hp in ("damping", "momentum", "weight_decay_coeff",
               "norm_constraint", "weight_decay"):
      value = values.get(hp)
      if value is None:
        continue
      argument_rules.check("Kfac", hp, value, RULES[hp])
      if not kfac_utils.is_python_number(value):
        raise ValueError("Kfac's %s must be a number (schedules: use "
                         "kfac.keras.callbacks), got %r." % (hp, value))
      self.hyper[hp] = make_variable(hp, float(value))
    fraction = kfac_kwargs.get("qmodel_batch_fraction")
    # The whole batch: the training collection's losses, no extra pass.
    self.qmodel_fraction = (None if fraction is None or fraction >= 1
                            else float(fraction))
    self.step = KerasStep(self)
    core_kwargs = {k: v for k, v in kfac_kwargs.items()
                   if k not in MUTABLE_HYPERPARAMETERS and
                   k not in KFAC_ONLY_ARGUMENTS}
    for hp, var in self.hyper.items():
      core_kwargs[_CORE_NAMES.get(hp, hp)] = var
    if "weight_decay" in self.hyper:
      # Keras's exclude_from_weight_decay (the choice made in the step).
      core_kwargs["decoupled_weight_decay_mask"] = self.step.decays
    if adaptive:
      core_kwargs.setdefault("momentum_type", "qmodel")
      core_kwargs.update(adapt_damping=True)
      if core_kwargs["momentum_type"] == "qmodel":
        core_kwargs["momentum"] = None
    if kfac_kwargs.get("recipe") == "auto":
      core_kwargs["minibatch_phase"] = recipe.minibatch_phase(
          kfac_kwargs["minibatch_learning_rate"])
    if adaptive or calibrate:
      # The passed loss is unknown here (and drew other dropout masks):
      # loss_fn evaluates the loss before the update too.
      core_kwargs.update(use_passed_loss=False, loss_fn=self.step.loss_fn)
    self.core = kfac_optimizer.PeriodicInvCovUpdateKfacOpt(
        learning_rate=(None if adaptive and not self.fixed_rate
                       else self.learning_rate_tensor),
        name=name, **core_kwargs)
    self.state = self.core.state_store
    # recipe="auto": the switch to the minibatch recipe (its flag is set
    # by the noise measurement, KerasStep._measure_noise); None otherwise.
    self.switch = self.core.recipe_switch
    # The gradient noise scale, measured on the first steps (0: never).
    self.noise = noise_scale.NoiseScale(
        self.state, kfac_kwargs.get("noise_scale_steps") or 0,
        kfac_kwargs.get("noise_scale_every") or 0)
    if model is not None:
      self.register_model(model)

  # -------------------------------------------------------------- model
  @property
  def model(self):
    ref = self._model_ref
    return None if ref is None else ref()

  def register_model(self, model):
    """Uses `model` (its layers are watched from now on)."""
    current = self.model
    if current is not None and current is not model:
      raise ValueError("This Kfac optimizer already serves model %r." %
                       current.name)
    layer_registration.check_fisher_approx(self.fisher_approx, model)
    layer_registration.check_registration_options(self.options, model)
    layer_registration.watch(model)
    layer_registration.name_state_by_structure(model)
    # A weak reference: the model owns the optimizer, not the reverse (and
    # the model must not become a checkpoint dependency of the optimizer).
    self._model_ref = weakref.ref(model)

  def register_layers(self, model=None, loss=None, layer_collection=None):
    """kfac 0.2.x's register_layers (see the Keras class)."""
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
      if self.loss is not None and not losses.same_losses(loss, self.loss):
        raise ValueError("register_layers(loss=%s) disagrees with Kfac(loss="
                         "%s)." % (losses.describe(loss),
                                   losses.describe(self.loss)))
      self.loss = loss
    self.register_model(model)

  def registration_report(self):
    """What each layer was registered as (see the Keras class)."""
    if self.report is not None:
      rows, loss_lines, lc = self.report
      memory = registration_report.memory_of(
          lc, getattr(self.core, "memory_budget", None))
      return registration_report.format_report(
          rows, loss_lines, memory) + self._noise_report() + (
              self._recipe_report())
    if self.model is None:
      return "(no model yet)"
    plans = layer_registration.plan_layers(self.model, self.fisher_approx)
    rows = [layer_registration.Row(
        keras_flavor.layer_path(p.layer), type(p.layer).__name__,
        "(" + p.kind + ")", p.approx or "default",
        ", ".join(layer_registration.param_names(p)), 0,
        "fallback: " + p.reason if p.kind == "generic" else "")
            for p in plans]
    return layer_registration.format_report(rows) + (
        "\n(planned; blocks and losses are known after the first step)")

  def _recipe_report(self):
    """The report's line on recipe="auto" ("" for the other recipes)."""
    if self.switch is None:
      return ""
    line = ("\nrecipe: auto (exact until the gradient noise scale passes the "
            "batch size, then minibatch at learning rate %g)" %
            self.switch.phase.learning_rate)
    if tf.executing_eagerly():
      line += "; now: %s" % (
          "minibatch" if bool(self.switch.active().numpy()) else "exact")
    return line

  def _noise_report(self):
    """The report's line on the gradient noise scale ("" when not
    measured)."""
    noise = self.noise
    if not noise.enabled:
      return ""
    when = "the first %d steps" % noise.steps
    if noise.every:
      when = ("%s, then one step in %d" % (when, noise.every) if noise.steps
              else "one step in %d" % noise.every)
    if not tf.executing_eagerly():
      return ("\ngradient noise scale: measured on %s (read "
              "optimizer.noise_scale in the session)" % when)
    measured = int(noise.measured.numpy())
    if not measured:
      return "\ngradient noise scale: not measured yet (measured on %s)" % (
          when)
    return ("\ngradient noise scale: B_simple = %.4g at batch size %d "
            "(%d measurements; measured on %s)" % (
                float(noise.b_simple().numpy()),
                int(noise.batch_size.numpy()), measured, when))

  # ------------------------------------------------------- hyperparameters
  def learning_rate_tensor(self):
    return tf.convert_to_tensor(
        keras_flavor.unwrap_variable(self.learning_rate_variable()))

  @property
  def mutable_hyperparameters(self):
    names = set(self.hyper)
    if not self.adaptive:
      names.add("learning_rate")
    elif self.fixed_rate:
      names.add("learning_rate")
      names -= {"damping"}
    else:
      names -= {"learning_rate", "damping", "momentum"}
    return names

  def check_not_adapted(self, name):
    adapted = ("damping",) if self.fixed_rate else (
        "learning_rate", "damping", "momentum")
    if self.adaptive and name in adapted:
      raise ValueError(
          "Kfac(adaptive=True) chooses the %s itself at every step, so it "
          "cannot be set (or scheduled by a callback); its current value is "
          "readable." % name)

  def set_hyper(self, name, value):
    self.check_not_adapted(name)
    if name == "weight_decay":  # (a number: checked now)
      argument_rules.check("Kfac", name, value, RULES[name])
    var = self.hyper.get(name)
    if var is None:
      raise ValueError(
          "%s was not set when the optimizer was created, so it is not a "
          "variable and cannot be changed now; pass %s=... to Kfac." %
          (name, name))
    var.assign(value)


def global_seed():
  """TensorFlow's global (eager) or graph-level seed, or None; read without
  advancing the op-seed counter as tf.compat.v1.get_seed would."""
  if tf.executing_eagerly():
    from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
    return context.global_seed()
  return tf.compat.v1.get_default_graph().seed


# --------------------------------------------------------------------------
# KfacOptimizerBase: what the Keras Kfac classes of both flavours
# (keras3.py, legacy_keras.py) show to Keras and to the user, delegated to
# their K-FAC engine (`KfacEngine`): the model, the hyperparameter
# properties, kfac 0.2.x's names, minimize, the config and the saved
# variables.
#
# A Keras class derives from this base and from its Keras optimizer base
# class, builds its engine in `__init__` (`_kfac_attach`) and calls
# `_kfac_apply` where its Keras base applies the gradients.


# The module users import Kfac from (kfac 0.2.4's path): the Kfac classes
# report it as their __module__, so that Keras configs name it as before.
PUBLIC_MODULE = "kfac.python.keras.optimizers"

# Attributes that return the model (hidden from dir(): see __dir__).
_NOT_SAVED_ATTRIBUTES = frozenset(["model", "_kfac_engine"])


class KfacOptimizerBase:
  """The Keras Kfac optimizer apart from its Keras flavour."""

  def _kfac_attach(self, engine):
    """Makes `engine` this optimizer's K-FAC part."""
    # Not a checkpoint dependency (a plain object; the model it serves
    # must not be one). Its state is, through _kfac_state.
    object.__setattr__(self, "_kfac_engine", engine)
    self._kfac_state = engine.state

  def _kfac_apply(self, grads, variables, iteration):
    """One K-FAC step for Keras (grads, variables); returns the op."""
    return self._kfac_engine.step.apply(grads, variables, iteration,
                                        self._use_weight_decay)

  def _kfac_update_average(self, variables):
    """use_ema=True: Keras's moving average of the weights after the K-FAC
    step (and, every ema_overwrite_frequency steps, the weights set to it),
    as Keras's own optimizers do after theirs: the Keras base class keeps
    the average (`_model_variables_moving_average`, which
    keras.callbacks.SwapEMAWeights and finalize_variable_values read) and
    updates it (`_update_model_variables_moving_average`). Called before
    `iterations` counts the step, as Keras does (Keras 3 takes the step
    with iterations == 0 as the first, whose average is the weights).

    With ema_warmup=True the decay follows EMA_WARMUP_OFFSET's rule
    instead of Keras's fixed ema_momentum.

    Under a tf.distribute strategy both run in cross-replica context
    (merge_call), where the weights are one mirrored value and the
    overwrite's per-device updates may sit in a conditional (Keras 3's own
    optimizers fail there with ema_overwrite_frequency under
    MirroredStrategy)."""
    frequency = self.ema_overwrite_frequency

    def update(strategy, variables):
      if self._kfac_ema_warmup:
        # min(ema_momentum, (1 + t) / (10 + t)), 0 at the first step.
        t = tf.cast(self.iterations, tf.float32)
        decay = tf.where(t > 0, tf.minimum(
            tf.cast(self.ema_momentum, tf.float32),
            (1.0 + t) / (EMA_WARMUP_OFFSET + t)), 0.0)
        for var in variables:
          strategy.extended.update(
              keras_flavor.unwrap_variable(self._kfac_average_of(var)),
              lambda average, value: average.assign(
                  tf.cast(decay, average.dtype) * average +
                  tf.cast(1.0 - decay, average.dtype) * value),
              args=(keras_flavor.unwrap_variable(var),), group=False)
      else:
        self._update_model_variables_moving_average(variables)
      if frequency:
        def overwrite():
          self._overwrite_model_variables_with_average_value(variables)
          return tf.no_op()
        now = tf.equal(
            (tf.cast(self.iterations, tf.int64) + 1) % int(frequency), 0)
        kfac_utils.cond_op(now, overwrite)
    tf.__internal__.distribute.interim.maybe_merge_call(
        update, self._distribution_strategy, list(variables))

  # (Read by weight_decay_test; build_cost_test wraps _kfac_apply.)
  def _kfac_lr_tensor(self):
    return self._kfac_engine.learning_rate_tensor()

  @property
  def _kfac_adaptive(self):
    return self._kfac_engine.adaptive

  # -------------------------------------------------------------- model
  def register_model(self, model):
    """Uses `model` (its layers are watched from now on)."""
    self._kfac_engine.register_model(model)

  def register_layers(self, model=None, loss=None, layer_collection=None):
    """kfac 0.2.x's way to give the model (and its loss) after creation.

    The layers are registered from each traced step, so this records the
    model (as register_model) and the loss (default: the compiled one)."""
    self._kfac_engine.register_layers(model, loss, layer_collection)

  def __dir__(self):
    # Keras's saving walks (keras saving_lib._walk_saveable, tf_keras's
    # _walk_trackable) visit every attribute dir() lists and recurse into
    # the Keras objects they return. The model owns the optimizer: reaching
    # it back through `model` made load_weights recurse without end (the
    # loader marks an object visited only after its children). The model
    # is no part of the optimizer's saved state, so the walk must not see
    # the attributes that return it.
    return [name for name in super().__dir__()
            if name not in _NOT_SAVED_ATTRIBUTES]

  @property
  def model(self):
    return self._kfac_engine.model

  @property
  def kfac_optimizer(self):
    """The core PeriodicInvCovUpdateKfacOpt doing the work."""
    return self._kfac_engine.core

  @property
  def optimizer(self):
    """The core PeriodicInvCovUpdateKfacOpt (kfac 0.2.x's name)."""
    return self._kfac_engine.core

  @property
  def mutable_hyperparameters(self):
    """Names of the hyperparameters that can be set between steps."""
    return self._kfac_engine.mutable_hyperparameters

  @property
  def skipped_steps(self):
    """How many steps the non-finite guard skipped (docs/reliability.md)."""
    return self._kfac_engine.core.skipped_steps

  @property
  def noise_scale(self):
    """The gradient noise scale B_simple = tr(Sigma) / |G|^2 measured on
    the first noise_scale_steps steps (a float64 tensor; NaN before the
    first; docs/recipe.md, "The gradient noise scale")."""
    return self._kfac_engine.noise.b_simple()

  @property
  def recipe_in_use(self):
    """The recipe of the next step: "exact" or "minibatch" (a string
    tensor; with recipe="auto" "exact" until the switch, then
    "minibatch"); None without adaptive=True."""
    engine = self._kfac_engine
    if engine.switch is not None:
      return tf.where(engine.switch.active(), "minibatch", "exact")
    if not engine.adaptive:
      return None
    return tf.constant("minibatch" if engine.fixed_rate else "exact")

  @property
  def recipe_switched_at(self):
    """recipe="auto": the step (optimizer.iterations) whose noise
    measurement switched to the minibatch recipe, -1 before the switch (an
    int64 tensor); None with the other recipes."""
    switch = self._kfac_engine.switch
    return None if switch is None else tf.convert_to_tensor(
        switch.switched_at())

  @property
  def state_store(self):
    """The K-FAC state (factors, inverses, velocities, counter)."""
    return self._kfac_engine.state

  @property
  def registration_report(self):
    """What each layer was registered as, from the last traced step (or the
    plan, before the first step)."""
    return self._kfac_engine.registration_report()

  def set_train_batch(self, train_batch):
    """The batch (x, y) or (x, y, sample_weight) the damping rule evaluates
    (adaptive=True or calibrate_damping=True) in a custom tf.function loop:
    call it in the step, before apply_gradients. model.fit needs no call."""
    self._kfac_engine.step.set_train_batch(train_batch)

  def minimize(self, loss, var_list=None, tape=None, **kwargs):
    """One K-FAC step. `loss` may be a tensor computed in the traced step
    (as kfac 0.2.x's minimize: no tape needed inside a tf.function), a
    callable, or a tensor with the tape that recorded it. var_list defaults
    to the model's trainable variables."""
    if var_list is None:
      model = self._kfac_engine.model
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

  # ------------------------------------------------------- hyperparameters
  def _kfac_base_property(self, name):
    """The property `name` of the Keras optimizer base class."""
    for cls in type(self).__mro__:
      if not issubclass(cls, KfacOptimizerBase) and name in vars(cls):
        return vars(cls)[name]
    raise AttributeError(name)

  @property
  def learning_rate(self):
    """The learning rate (with adaptive=True: the one the quadratic model
    chose at the last step)."""
    return self._kfac_base_property("learning_rate").__get__(self)

  @learning_rate.setter
  def learning_rate(self, value):
    engine = self.__dict__.get("_kfac_engine")
    if engine is not None:
      engine.check_not_adapted("learning_rate")
    self._kfac_base_property("learning_rate").__set__(self, value)

  damping = property(lambda self: self._kfac_engine.hyper.get("damping"),
                     lambda self, v: self._kfac_engine.set_hyper("damping", v))
  momentum = property(
      lambda self: self._kfac_engine.hyper.get("momentum"),
      lambda self, v: self._kfac_engine.set_hyper("momentum", v))
  weight_decay_coeff = property(
      lambda self: self._kfac_engine.hyper.get("weight_decay_coeff"),
      lambda self, v: self._kfac_engine.set_hyper("weight_decay_coeff", v))
  norm_constraint = property(
      lambda self: self._kfac_engine.hyper.get("norm_constraint"),
      lambda self, v: self._kfac_engine.set_hyper("norm_constraint", v))

  @property
  def weight_decay(self):
    """AdamW's decoupled weight decay (a variable), or None."""
    engine = self.__dict__.get("_kfac_engine")
    return None if engine is None else engine.hyper.get("weight_decay")

  @weight_decay.setter
  def weight_decay(self, value):
    engine = self.__dict__.get("_kfac_engine")
    if engine is None and not value:
      # The Keras base class's __init__ setting its default (None in Keras
      # 3, 0 in tf_keras): Kfac sets its own up in its engine.
      return
    self._kfac_engine.set_hyper("weight_decay", value)

  # ------------------------------------------------ Keras's saving API
  def get_config(self):
    config = config_lib.get_config(self._kfac_engine, self.name,
                                   float(self._kfac_lr_tensor().numpy()))
    if self.use_ema:
      config.update(use_ema=True, ema_momentum=float(self.ema_momentum),
                    ema_overwrite_frequency=self.ema_overwrite_frequency,
                    ema_warmup=self._kfac_ema_warmup)
    return config

  @classmethod
  def from_config(cls, config, custom_objects=None):
    del custom_objects
    return cls(**config_lib.arguments_from_config(config))

  def save_own_variables(self, store):
    """The Keras variables by index (as Keras does), and every K-FAC state
    variable under "kfac_state:<its key>"."""
    config_lib.save_variables(self.variables, self._kfac_engine.state, store)

  def load_own_variables(self, store):
    config_lib.load_variables(self.variables, self._kfac_engine.state, store,
                              self.name)


# --------------------------------------------------------------------------
# The Keras Kfac optimizer's step inside the traced train step: the
# model's LayerCollection for this trace (registered from the layers the
# forward pass recorded, with the compiled or given losses), the batch and
# loss the damping rule evaluates, the core K-FAC update, and the TensorBoard
# scalars after it: KerasStep, a part of the engine (`KfacEngine`, above).


class KerasStep:
  """The per-trace work of the Keras Kfac optimizer: `apply` builds one
  K-FAC step in the traced train step; `loss_fn` is the damping rule's
  loss, `decays` the weight decay's mask (both given to the core)."""

  def __init__(self, engine):
    self._engine = engine
    self._warned = set()
    self._step_batch = None  # (graph, batch) given by set_train_batch
    self._decay_choice = {}  # Keras variable ref -> decays (this trace)

  # -------------------------------------------------------------- adaptive
  def set_train_batch(self, train_batch):
    """The batch (x, y) or (x, y, sample_weight) the damping rule evaluates
    (adaptive=True or calibrate_damping=True) in a custom tf.function loop:
    call it in the step, before apply_gradients. model.fit needs no call."""
    self._step_batch = (current_graph(), train_batch)

  def _batch(self):
    """(x, y, sample_weight) of this step for the damping rule."""
    pending = self._step_batch
    batch = None
    if pending is not None and pending[0] is current_graph():
      batch = pending[1]
    elif self._engine.train_batch is not None:
      batch = self._engine.train_batch
    if callable(batch):
      batch = batch()
    if batch is None:
      recorded = layer_registration.recorder_for(self._engine.model).loss_args()
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

  def _training_loss(self, batch, replicas):
    """The training forward pass's own loss (model.compute_loss in this
    trace) when it is loss_fn(batch) before the update: computed on
    this very batch, Keras 3 (whose random layers draw from seed states,
    which loss_fn replays: same masks), one replica; else None, and
    the damping rule evaluates loss_fn(batch) before the update.
    Saves a forward pass of the model, in the graph and on each step that
    evaluates the loss (adaptation and burn-in steps)."""
    if replicas > 1 or keras_flavor.legacy_keras_active():
      return None  # tf_keras's default dropout is not replayed
    recorded = layer_registration.recorder_for(self._engine.model).loss_args()
    if not recorded or recorded.get("loss") is None:
      return None
    same = all(recorded.get(name) is value for name, value in zip(
        ("x", "y", "sample_weight"), batch))
    return recorded["loss"] if same else None

  def loss_fn(self, batch):
    """The training loss on `batch` with the dropout masks of the step's
    training forward pass, leaving the model's state as it was (see the
    package docstring)."""
    x, y, sample_weight = batch
    model = self._engine.model

    def loss():
      y_pred = model(x, training=True)
      return model.compute_loss(x=x, y=y, y_pred=y_pred,
                                sample_weight=sample_weight)
    return self._stateless(loss)

  def _stateless(self, compute):
    """compute() -- a training-mode call of the model, unrecorded -- run
    with the random layers' seed states of the step's training forward pass
    and the model's state restored after it; its output (a structure of
    tensors) once restored."""
    model = self._engine.model
    recorder = layer_registration.recorder_for(model)
    state = keras_flavor.state_variables(model)
    known = {v.ref() for v in state}
    replay = recorder.random_states()
    state += [v for v, _ in replay if v.ref() not in known]
    saved = [tf.identity(v.read_value()) for v in state]
    with tf.control_dependencies(saved):
      # The seed states as the training forward pass found them: the
      # evaluation draws the same masks.
      replayed = [v.assign(value, read_value=False) for v, value in replay]
    with tf.control_dependencies(saved + replayed):
      with recorder.paused():
        out = compute()
    with tf.control_dependencies(tf.nest.flatten(out)):
      restored = [v.assign(value, read_value=False)
                  for v, value in zip(state, saved)]
    with tf.control_dependencies(restored):
      return tf.nest.map_structure(tf.identity, out)

  def _qmodel_collection(self, batch=None):
    """A LayerCollection with the model's losses on the first
    ceil(qmodel_batch_fraction * batch) examples of the step's batch, from
    an extra training-mode forward pass of those rows (state left as it
    was): the quadratic model's exact curvature products are taken there
    (the core's qmodel_layer_collection)."""
    x, y, _ = self._batch() if batch is None else batch
    first = tf.nest.flatten(x)[0]
    rows = tf.cast(tf.math.ceil(
        (self._engine.qmodel_fraction or 1.0) *
        tf.cast(tf.shape(first)[0], tf.float64)), tf.int32)
    head = lambda t: t[:rows]  # pylint: disable=unnecessary-lambda-assignment
    x_rows = tf.nest.map_structure(head, x)
    y_rows = None if y is None else tf.nest.map_structure(head, y)
    model = self._engine.model
    y_pred = self._stateless(lambda: model(x_rows, training=True))
    loss, weights = self.losses()
    lc = lc_lib.LayerCollection()
    layer_registration.register_loss_pairs(
        lc, layer_registration.loss_pairs(model, loss, weights, y_pred), y_rows,
        average_over_outputs=self._engine.adaptive)
    return lc

  # -------------------------------------------------------------- the step
  def _warn(self, key, message):
    if key not in self._warned:
      self._warned.add(key)
      warnings.warn(message, UserWarning, stacklevel=4)

  def losses(self):
    """(loss, loss_weights) for the registration: those given to Kfac, or
    else those of model.compile. Given both ways, they must agree."""
    compiled, compiled_weights = losses.compiled_loss(self._engine.model)
    loss, weights = self._engine.loss, self._engine.loss_weights
    if loss is None:
      loss = compiled
    elif compiled is not None and not losses.same_losses(loss, compiled):
      raise ValueError(
          "Kfac(loss=%s) disagrees with model.compile(loss=%s): K-FAC would "
          "precondition for another loss than the one the model trains on. "
          "Give the loss once, to model.compile; Kfac(model=...) takes it "
          "from there." % (losses.describe(loss), losses.describe(compiled)))
    if weights is None:
      weights = compiled_weights
    elif (compiled_weights is not None and
          not losses.same_weights(weights, compiled_weights)):
      raise ValueError(
          "Kfac(loss_weights=%r) disagrees with model.compile(loss_weights="
          "%r). Give them once, to model.compile; Kfac(model=...) takes "
          "them from there." % (weights, compiled_weights))
    return loss, weights

  def apply(self, grads, variables, iteration, use_weight_decay):
    """One K-FAC step for Keras (grads, variables); returns the op."""
    if tf.executing_eagerly():
      raise RuntimeError(
          "Kfac needs the forward pass and the update in one traced step: "
          "model.fit with run_eagerly=True, or an eager custom loop, is not "
          "supported. Trace the step with tf.function.")
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if replicas > 1 and self._engine.adaptive:
      raise NotImplementedError(
          "Kfac(adaptive=True) under a tf.distribute strategy with %d "
          "replicas is not supported yet (it writes the chosen learning rate "
          "into the optimizer's mirrored hyperparameter inside the step). "
          "Use a fixed learning rate, or one replica." % replicas)
    if self._engine.model is None:
      raise ValueError(
          "Kfac has no model: create it with Kfac(..., model=model), call "
          "optimizer.register_model(model), or load a saved model with "
          "kfac.keras.saving_utils.load_model.")
    # Keras's LossScaleOptimizer (mixed_float16) applies this optimizer in
    # a conditional branch: the statistics' sampled backward pass must be
    # built in the graph of the forward pass, which encloses the branch.
    forward = layer_registration.forward_graph(self._engine.model)
    current = tf.compat.v1.get_default_graph()
    in_branch = forward is not None and forward is not current
    config = self._engine.core.config
    if in_branch and (config.update.qmodel or config.damping.adapt_damping
                      or config.damping.calibrate_damping):
      raise NotImplementedError(
          "Kfac with the quadratic model or the damping rule (adaptive=True, "
          "momentum_type='qmodel*', adapt_damping, calibrate_damping) is not "
          "supported under Keras's LossScaleOptimizer (the mixed_float16 "
          "policy) yet: its curvature products would be taken inside the "
          "loss scaling's conditional, away from the forward pass. Use the "
          "mixed_bfloat16 policy, float32, or a fixed learning rate and "
          "damping.")
    with forward.as_default() if in_branch else contextlib.nullcontext():
      lc = self._register(variables, replicas)
      if self._engine.adaptive or self._engine.core.calibrate_damping:
        batch = self._batch()
        self._engine.core.set_train_batch(batch)
        self._engine.core.set_train_batch_loss(
            self._training_loss(batch, replicas))
      if self._engine.switch is not None:
        # Built in the exact recipe's conditional branch (the minibatch
        # steps build no curvature products): adaptive/recipe/switch.py.
        step_batch = self._batch()  # (found in the step's graph)
        self._engine.core.set_qmodel_layer_collection(
            lambda: self._qmodel_collection(step_batch))
      elif self._engine.qmodel_fraction is not None:
        self._engine.core.set_qmodel_layer_collection(
            self._qmodel_collection())
      if in_branch:  # the sources and their gradients, built there
        self._engine.core.set_layer_collection(lc)
        self._engine.core.estimator.instantiate_variables()
    measured = []
    if self._engine.noise.enabled and replicas == 1:
      with forward.as_default() if in_branch else contextlib.nullcontext():
        measured = [self._measure_noise(variables, iteration)]
    tf_vars = [keras_flavor.unwrap_variable(v) for v in variables]
    if self._engine.hyper.get("weight_decay") is not None:
      # Keras's exclude_from_weight_decay, read on the Keras variables.
      self._decay_choice = {t.ref(): bool(use_weight_decay(v))
                            for v, t in zip(variables, tf_vars)}
    with tf.control_dependencies(measured):  # at the step's parameters
      op = self._engine.core.apply_gradients(list(zip(grads, tf_vars)),
                                           layer_collection=lc)
    return self._after_apply(op, iteration)

  def _measure_noise(self, variables, iteration):
    """On the first noise_scale_steps steps (then one in
    noise_scale_every): the gradients of the loss on
    the two halves of the step's batch (training mode, the model's state
    left as it was) and their tr(Sigma), |G|^2 estimates added to the
    noise scale's sums (ops/adaptive/noise_scale.py); an op."""
    noise = self._engine.noise
    model = self._engine.model

    x, y, sample_weight = self._batch()  # (found in the step's graph)

    def measure():
      batch_size = tf.shape(tf.nest.flatten(x)[0])[0]
      size = noise_scale.part_size(batch_size)
      parts = list(zip(*(noise_scale.split(t, size)
                         for t in (x, y, sample_weight))))

      def estimates():
        grads = []
        for px, py, pw in parts:
          with tf.GradientTape() as tape:
            y_pred = model(px, training=True)
            part_loss = model.compute_loss(x=px, y=py, y_pred=y_pred,
                                           sample_weight=pw)
          grads.append(tape.gradient(part_loss, variables))
        return noise_scale.estimates(grads[0], grads[1], size)
      trace_sigma, grad_sq = self._stateless(estimates)
      added = noise.add(trace_sigma, grad_sq, batch_size)
      if self._engine.switch is not None:
        with tf.control_dependencies([added]):
          added = self._maybe_switch(batch_size, iteration)
      if kfac_utils.in_xla_context():  # (XLA compiles no print)
        return added
      with tf.control_dependencies([added]):
        # One line in the logs when the measurement is complete.
        done = tf.equal(tf.convert_to_tensor(noise.measured), noise.steps)
        return kfac_utils.cond_op(done, lambda: tf.print(
            "kfac: gradient noise scale B_simple =", noise.b_simple(),
            "at batch size", batch_size, "(measured over", noise.steps,
            "steps)"))
    return kfac_utils.cond_op(noise.measuring(iteration), measure)

  def _maybe_switch(self, batch_size, iteration):
    """recipe="auto": the op that switches to the minibatch recipe once the
    noise scale, measured over the first noise_scale_steps steps (and the
    later ones), is larger than the batch: the batch is then small against
    the gradient noise (docs/recipe.md, "The automatic recipe")."""
    noise, switch = self._engine.noise, self._engine.switch
    b_simple = noise.b_simple()
    now = tf.logical_and(
        tf.logical_not(switch.active()),
        tf.logical_and(
            tf.greater_equal(tf.convert_to_tensor(noise.measured),
                             noise.steps),
            b_simple > self._engine.kwargs["auto_switch_ratio"] *
            tf.cast(batch_size, tf.float64)))

    def activate():
      if kfac_utils.in_xla_context():
        return switch.activate(iteration)
      with tf.control_dependencies([switch.activate(iteration)]):
        return tf.print(
            "kfac: recipe='auto' switches to the minibatch recipe at step",
            iteration, "(gradient noise scale B_simple =", b_simple,
            "> %g x batch size" % self._engine.kwargs["auto_switch_ratio"],
            batch_size, ")")
    return kfac_utils.cond_op(now, activate)

  def decays(self, variable):
    """Whether the core's `variable` decays: not excluded by
    exclude_from_weight_decay (Keras's own rule, on the Keras variable)."""
    decays = self._decay_choice.get(variable.ref())
    if decays is None:
      raise ValueError("Kfac's weight decay got the variable %s, which is "
                       "not one of the step's." % variable.name)
    return decays

  def _register(self, variables, replicas):
    """The model's LayerCollection for this trace."""
    # The samples of a step are drawn from (seed, steps taken): a step the
    # non-finite guard skipped (which Keras counts in `iterations`) does
    # not shift the samples of the steps after it.
    # The seed is K-FAC state too: a checkpoint restores it.
    seed_var = self._engine.state.get_or_create(
        "keras_sample_seed", [], tf.int64, initial_value=self._engine.seed)
    seed = tf.stack([tf.convert_to_tensor(seed_var),
                     self._engine.core.steps_taken()])
    if replicas > 1:  # each replica samples its own targets
      seed = seed + tf.stack([
          tf.cast(collective.replica_id(), tf.int64) * 1000003,
          tf.constant(0, tf.int64)])
    layer_registration.name_state_by_structure(self._engine.model)
    lc, rows, loss_lines = layer_registration.register_model_rows(
        self._engine.model, *self.losses(),
        layer_collection=lc_lib.LayerCollection(
            curvature_options=self._engine.curvature_options),
        fisher_approx=self._engine.fisher_approx, seed=seed,
        variables=variables, warn=self._warn,
        registration_options=self._engine.options,
        default_conv_options=(recipe.conv_registration_options()
                              if self._engine.adaptive else None),
        default_approx=(recipe.keras_default_approx()
                        if self._engine.adaptive else None),
        # The default recipe was tuned on the Keras loss's own scale; the
        # 0.2.x-style optimizer keeps kfac 0.2.x's coefficients.
        average_over_outputs=self._engine.adaptive)
    # Formatted when read (the memory column needs the factors, which the
    # core optimizer makes from the collection).
    self._engine.report = (rows, loss_lines, lc)
    return lc

  def _after_apply(self, op, iteration):
    """The learning rate display, warnings and summaries after the step."""
    if self._engine.adaptive and not self._engine.fixed_rate:
      # Show the learning rate the quadratic model chose.
      with tf.control_dependencies([op]):
        lr = keras_flavor.unwrap_variable(
            self._engine.learning_rate_variable())
        op = tf.group(lr.assign(tf.cast(self._engine.core.learning_rate,
                                        lr.dtype), read_value=False))
    unused = self._engine.state.unused_restored_keys
    if unused:
      self._warn("unused_state", (
          "kfac: %d restored K-FAC state values match no variable of this "
          "model (e.g. %s); they are not used. K-FAC state is keyed by "
          "variable names: give the layers explicit names when rebuilding a "
          "model in the same process." % (len(unused), unused[0])))
    with tf.control_dependencies([op]):
      self._summaries(iteration)
    return op

  def _summaries(self, iteration):
    """TensorBoard scalars when a default summary writer is active (a no-op
    otherwise, and inside XLA, which cannot compile summary writes)."""
    if kfac_utils.in_xla_context():
      return
    step = tf.cast(iteration, tf.int64)
    write_scalar("kfac/learning_rate", self._engine.learning_rate_tensor(),
                 step)
    write_scalar("kfac/skipped_steps", self._engine.core.skipped_steps, step)
    if self._engine.noise.enabled:
      write_scalar("kfac/noise_scale", self._engine.noise.b_simple(), step)
    for name in ("damping", "momentum"):
      var = self._engine.hyper.get(name)
      if var is not None:
        write_scalar("kfac/" + name, var, step)
    core = self._engine.core
    if self._engine.adaptive:  # (the quadratic model's momentum)
      if "momentum" not in self._engine.hyper:
        write_scalar("kfac/momentum", core.momentum, step)
    if self._engine.adaptive or core.calibrate_damping:
      write_scalar("kfac/rho", core.rho, step)
      write_scalar("kfac/qmodel_change", core.qmodel_change, step)


def write_scalar(tag, value, step):
  """tf.summary.scalar without needing the tensorboard package: a float32
  scalar tagged for TensorBoard's scalars plugin (a no-op without a default
  writer)."""
  metadata = summary_pb2.SummaryMetadata()
  metadata.plugin_data.plugin_name = "scalars"
  tf.summary.write(tag, tf.cast(value, tf.float32), step=step,
                   metadata=metadata)


def current_graph():
  return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


# --------------------------------------------------------------------------
# The arguments of the Keras Kfac optimizer: which it accepts, what they
# must satisfy, and the default recipe's values for adaptive=True.


# Hyperparameters kept in variables, so that callbacks and users can change
# them between steps without retracing.
MUTABLE_HYPERPARAMETERS = ("learning_rate", "damping", "momentum",
                           "weight_decay_coeff", "norm_constraint",
                           "weight_decay")
CORE_DEFAULTS = {"momentum": 0.9, "weight_decay_coeff": 0.1}
# Keras optimizer options that do not make sense for K-FAC: rejected.
KERAS_ONLY_OPTIONS = ("clipnorm", "clipvalue", "global_clipnorm",
                      "loss_scale_factor", "gradient_accumulation_steps",
                      "jit_compile", "is_legacy_optimizer")
# Keras's moving average of the weights: options of the Keras base class,
# which keeps the average; Kfac updates it after each K-FAC step
# (KfacOptimizerBase._kfac_update_average). Their Keras defaults.
KERAS_AVERAGE_OPTIONS = {"use_ema": False, "ema_momentum": 0.99,
                         "ema_overwrite_frequency": None}
# Kfac's own averaging option: ema_warmup=True decays the average with
# min(ema_momentum, (1 + t) / (10 + t)) at step t (t = 0 the first step,
# whose average is its weights), the rule of
# tf.compat.v1.train.ExponentialMovingAverage(decay, num_updates=t), so
# that the average follows the weights early in training.
EMA_WARMUP_OFFSET = 10.0
# What the hyperparameters must satisfy (reliability/arguments.py).
RULES = {"damping": argument_rules.POSITIVE,
         "momentum": argument_rules.MOMENTUM,
         "weight_decay_coeff": argument_rules.NON_NEGATIVE,
         "norm_constraint": argument_rules.POSITIVE,
         "weight_decay": argument_rules.NON_NEGATIVE}
# Kfac's own arguments (in kfac_kwargs, kept in its config; not the
# core's).
KFAC_ONLY_ARGUMENTS = ("qmodel_batch_fraction", "recipe", "noise_scale_steps",
                       "noise_scale_every", "minibatch_learning_rate",
                       "auto_switch_ratio", "factor_block_size")
# Core arguments that Kfac sets itself (adaptive=True / calibrate_damping).
OWNED_CORE_ARGUMENTS = ("loss", "loss_fn", "prev_train_batch", "train_batch",
                        "adapt_damping", "use_passed_loss",
                        "update_damping_immediately")


def split_average_options(kfac_kwargs):
  """(Keras's averaging options for the base class, ema_warmup, the other
  kwargs).

  The options are checked here (Keras checks their ranges): an averaging
  option other than its default without use_ema=True has no effect in
  Keras, so it is an error here."""
  defaults = dict(KERAS_AVERAGE_OPTIONS, ema_warmup=False)
  average = {k: kfac_kwargs[k] for k in defaults if k in kfac_kwargs}
  rest = {k: v for k, v in kfac_kwargs.items() if k not in defaults}
  for key in ("use_ema", "ema_warmup"):
    if not isinstance(average.get(key, False), bool):
      raise ValueError("Kfac(%s=%r): %s must be True or False."
                       % (key, average[key], key))
  warmup = average.pop("ema_warmup", False)
  if not average.get("use_ema", False):
    ignored = sorted(k for k, v in dict(average, ema_warmup=warmup).items()
                     if k != "use_ema" and v != defaults[k])
    if ignored:
      raise ValueError(
          "Kfac(%s) sets the moving average of the weights, which needs "
          "use_ema=True (without it Keras ignores it)." % ", ".join(
              "%s=%r" % (k, dict(average, ema_warmup=warmup)[k])
              for k in ignored))
    return {}, False, rest
  return average, warmup, rest


def _check_kwargs(kfac_kwargs):
  bad = [k for k in kfac_kwargs if k in KERAS_ONLY_OPTIONS]
  if bad:
    raise ValueError(
        "Kfac does not support the Keras optimizer option(s) %s. K-FAC "
        "bounds its steps with norm_constraint=... and decays weights with "
        "weight_decay=... (AdamW's)." % ", ".join(bad))
  if (kfac_kwargs.get("weight_decay") is not None and
      kfac_kwargs.get("use_weight_decay")):
    raise ValueError(
        "Kfac got weight_decay=%r (AdamW's decoupled weight decay) and "
        "use_weight_decay=True (kfac 0.2.x's, with weight_decay_coeff): both "
        "decay the weights; choose one (weight_decay also works with "
        "adaptive=True)." % (kfac_kwargs["weight_decay"],))
  if "qmodel_layer_collection" in kfac_kwargs:
    raise ValueError(
        "Kfac builds the quadratic model's collection itself: pass "
        "qmodel_batch_fraction=... (the share of each batch its curvature "
        "products use) instead of qmodel_layer_collection.")
  for key in ("layer_collection", "var_list", "name"):
    if key in kfac_kwargs:
      raise ValueError("Pass %s as an argument of Kfac, not in kfac_kwargs."
                       % key)
  for key in OWNED_CORE_ARGUMENTS:
    if key in kfac_kwargs:
      raise ValueError(
          "Kfac sets %s itself: adaptive=True adapts the damping, and the "
          "damping rule evaluates model.compute_loss on the step's batch "
          "(the one fit passes, or optimizer.set_train_batch((x, y)) in a "
          "custom loop) before and after the update." % key)


def fixed_rate(adaptive, kfac_kwargs):
  """Whether adaptive=True runs the recipe with a fixed learning rate and
  momentum (momentum_type="regular", or recipe="minibatch"): only the
  damping is adapted."""
  return bool(adaptive) and (
      kfac_kwargs.get("momentum_type") == "regular" or
      kfac_kwargs.get("recipe") == "minibatch")


def _check_recipe(adaptive, kfac_kwargs):
  if "recipe" not in kfac_kwargs:
    return
  name = kfac_kwargs["recipe"]
  if name not in recipe.RECIPES:
    raise ValueError("Kfac's recipe must be one of %s, got %r." % (
        ", ".join(repr(r) for r in recipe.RECIPES), name))
  if not adaptive:
    raise ValueError(
        "Kfac(recipe=%r) chooses how adaptive=True adapts: pass "
        "adaptive=True too." % (name,))
  momentum_type = kfac_kwargs.get("momentum_type")
  if name == "minibatch" and momentum_type not in (None, "regular"):
    raise ValueError(
        "recipe='minibatch' uses momentum_type 'regular' (no quadratic "
        "model); got momentum_type=%r (the quadratic model is "
        "recipe='exact')." % (momentum_type,))
  if name in ("exact", "auto") and momentum_type == "regular":
    raise ValueError(
        "recipe=%r chooses the learning rate with the quadratic model; "
        "momentum_type='regular' is recipe='minibatch'." % (name,))
  for key, what in (("minibatch_learning_rate", "the learning rate "
                      "recipe='auto' uses once it switches to the minibatch "
                      "recipe"),
                     ("auto_switch_ratio", "recipe='auto''s threshold: it "
                      "switches when the noise scale passes this times the "
                      "batch size")):
    value = kfac_kwargs.get(key)
    if value is None:
      continue
    if name != "auto":
      raise ValueError("%s is %s; got recipe=%r." % (key, what, name))
    if (not argument_rules.is_number(value) or isinstance(value, bool) or
        not value > 0):
      raise ValueError("Kfac's %s must be a number > 0, got %r." %
                       (key, value))
  if name == "auto" and kfac_kwargs.get("noise_scale_steps") == 0:
    raise ValueError(
        "recipe='auto' switches to the minibatch recipe when the measured "
        "gradient noise scale passes the batch size: noise_scale_steps=0 "
        "measures none (pass a number >= 1, or recipe='exact').")


def check_before_base(learning_rate, adaptive, kfac_kwargs):
  """The checks that must come before the Keras base class is built."""
  _check_kwargs(kfac_kwargs)
  _check_recipe(adaptive, kfac_kwargs)
  momentum_type = kfac_kwargs.get(
      "momentum_type", "adam" if not adaptive else
      "regular" if kfac_kwargs.get("recipe") == "minibatch" else "qmodel")
  if "loss_tensor" in kfac_kwargs:
    raise ValueError(
        "Kfac(loss_tensor=...) is a TF1-graph argument (a loss tensor built "
        "before the optimizer): in TF2 pass the loss to "
        "optimizer.minimize(loss, var_list) inside the tf.function; the "
        "damping rule (adaptive=True) evaluates model.compute_loss itself.")
  if fixed_rate(adaptive, kfac_kwargs):
    if not argument_rules.is_number(learning_rate) or isinstance(
        learning_rate, bool):
      raise ValueError(
          "Kfac(adaptive=True, %s) takes the learning rate from you (the "
          "recipe adapts only the damping): pass learning_rate=<a number>, "
          "e.g. 0.05 (docs/keras.md), got %r." % (
              "recipe='minibatch'" if kfac_kwargs.get("recipe") ==
              "minibatch" else "momentum_type='regular'", learning_rate))
  elif adaptive:
    if learning_rate is not None:
      raise ValueError(
          "learning_rate must be None with adaptive=True, which chooses the "
          "learning rate at every step from the "
          "quadratic model: pass learning_rate=None (got %r)." %
          (learning_rate,))
    if not str(momentum_type).startswith("qmodel"):
      raise ValueError(
          "adaptive=True uses momentum_type 'qmodel' (or 'qmodel_fixedmu' "
          "with a momentum, or 'regular' with a learning_rate), got %r."
          % (momentum_type,))
    if momentum_type == "qmodel" and kfac_kwargs.get("momentum") is not None:
      raise ValueError(
          "adaptive=True (momentum_type 'qmodel') chooses the momentum too: "
          "drop momentum=%r, or pass momentum_type='qmodel_fixedmu'." %
          (kfac_kwargs["momentum"],))
  elif learning_rate is None:
    raise ValueError("Kfac needs learning_rate (adaptive=False).")
  fraction = kfac_kwargs.get("qmodel_batch_fraction")
  if fraction is not None:
    if (not argument_rules.is_number(fraction) or isinstance(fraction, bool) or
        not 0 < fraction <= 1):
      raise ValueError("Kfac's qmodel_batch_fraction must be a number in "
                       "(0, 1] (the share of each batch the quadratic "
                       "model's curvature products use), got %r."
                       % (fraction,))
    if not str(momentum_type).startswith("qmodel"):
      raise ValueError(
          "qmodel_batch_fraction is used by the quadratic model only "
          "(adaptive=True, or momentum_type 'qmodel' / 'qmodel_fixedmu'); "
          "got momentum_type=%r." % (momentum_type,))
  block_size = kfac_kwargs.get("factor_block_size")
  if block_size is not None and (
      not argument_rules.is_number(block_size) or
      isinstance(block_size, bool) or int(block_size) != block_size or
      block_size < 0 or block_size == 1):
    raise ValueError("Kfac's factor_block_size must be 0 (off) or an integer "
                     ">= 2 (the most rows a Kronecker factor keeps whole; "
                     "wider ones keep their diagonal blocks), got %r." %
                     (block_size,))
  for name, what in (("noise_scale_steps", "the first steps that measure "
                       "the gradient noise scale; 0: none"),
                     ("noise_scale_every", "then one step in this many "
                      "measures it; 0: none")):
    steps = kfac_kwargs.get(name)
    if steps is not None and (not argument_rules.is_number(steps) or
                              isinstance(steps, bool) or
                              int(steps) != steps or steps < 0):
      raise ValueError("Kfac's %s must be an integer >= 0 (%s), got %r." %
                       (name, what, steps))
  if argument_rules.is_number(learning_rate):
    argument_rules.check("Kfac", "learning_rate", learning_rate,
                         argument_rules.NON_NEGATIVE)


def with_recipe_defaults(damping, adaptive, kfac_kwargs):
  """(damping, kfac_kwargs) with the default recipe's values filled in where
  adaptive=True and the user left them out (kfac/python/ops/adaptive/recipe,
  docs/recipe.md)."""
  kfac_kwargs = dict(kfac_kwargs)
  if adaptive:
    if kfac_kwargs.get("recipe") == "minibatch":
      for key, value in recipe.keras_minibatch_defaults().items():
        kfac_kwargs.setdefault(key, value)
    if kfac_kwargs.get("recipe") == "auto":
      kfac_kwargs.setdefault("minibatch_learning_rate",
                             recipe.AUTO_MINIBATCH_LEARNING_RATE)
      kfac_kwargs.setdefault("auto_switch_ratio", recipe.AUTO_SWITCH_RATIO)
      if kfac_kwargs.get("noise_scale_every") is None:
        kfac_kwargs["noise_scale_every"] = recipe.AUTO_NOISE_SCALE_EVERY
    kfac_kwargs.setdefault("relative_min_damping",
                           recipe.RELATIVE_MIN_DAMPING)
    if kfac_kwargs.get("momentum_type", "regular" if kfac_kwargs.get(
        "recipe") == "minibatch" else "qmodel") == "qmodel":
      kfac_kwargs.setdefault("qmodel_momentum_bound",
                             recipe.QMODEL_MOMENTUM_BOUND)
    # The noise scale is measured where it decides something (the
    # automatic recipe) or where asked: its halves' passes are a second
    # copy of the model in the traced step (recipe.NOISE_SCALE_STEPS).
    if kfac_kwargs.get("noise_scale_steps") is None:
      kfac_kwargs["noise_scale_steps"] = (
          recipe.NOISE_SCALE_STEPS if kfac_kwargs.get("recipe") == "auto"
          else 0)
    if kfac_kwargs.get("noise_scale_every") is None:
      kfac_kwargs["noise_scale_every"] = (
          recipe.NOISE_SCALE_EVERY if kfac_kwargs["noise_scale_steps"]
          else 0)
    kfac_kwargs.setdefault("cov_update_every", recipe.COV_UPDATE_EVERY)
    if damping is None:
      damping = recipe.INITIAL_DAMPING
      if not fixed_rate(adaptive, kfac_kwargs):
        # (With a fixed learning rate the calibration judges a single step
        # without its momentum, and chose dampings 100x too large:
        # docs/recipe.md.)
        kfac_kwargs.setdefault("calibrate_damping", True)
        if "num_burnin_steps" not in kfac_kwargs:
          kfac_kwargs["num_burnin_steps"] = recipe.NUM_BURNIN_STEPS
          # (A num_burnin_steps of the user's calibrates on all of them,
          # unless num_calibration_steps says otherwise.)
          if kfac_kwargs["calibrate_damping"]:
            kfac_kwargs.setdefault("num_calibration_steps",
                                   recipe.NUM_CALIBRATION_STEPS)
  return damping, kfac_kwargs


CONSTRUCTOR_DOC = """K-FAC as a Keras optimizer.

  Args:
    learning_rate: the step size (a float; change it with
      `optimizer.learning_rate = ...` or kfac.keras.callbacks).
    damping: Tikhonov damping added to the Fisher blocks (a float, kept in a
      variable like learning_rate). With adaptive=True it is the initial
      damping and may be left out: the default recipe then starts from 1.0
      and calibrates it during 5 burn-in steps, in which the weights do not
      move (calibrate_damping=True, num_burnin_steps=5; the first only
      gathers statistics, the other 4 try the step: num_calibration_steps=4).
    model: the Keras model to train (its layers are watched from now on).
    loss: the model's Keras loss(es) (default: the loss given to compile).
    loss_weights: per-output loss coefficients (as in compile).
    fisher_approx: {layer name or layer class: approximation name}.
    layer_collection: not supported (the collection is built from the
      model); must be None.
    adaptive: True: the default recipe (docs/recipe.md): learning rate
      and momentum from the quadratic model (momentum_type "qmodel"; the
      momentum kept in [-1, 1], qmodel_momentum_bound=1), damping
      adapted by the Levenberg-Marquardt rule and never below
      relative_min_damping=0.1 times the curvature scale (pass
      learning_rate=None; see the module docstring). With
      momentum_type="regular" and a learning_rate (and momentum, default
      0.9): the recipe with that fixed rate and momentum, only the damping
      adapted (docs/keras.md: better on keras.applications convnets with
      depthwise convolutions, and no curvature products). Its losses are
      registered at the scale of the Keras loss (coefficient: loss weight /
      outputs per example Keras averages over); without adaptive, as in
      kfac 0.2.x, with the loss weight (docs/keras.md, "Coefficients").
    train_batch: the batch the damping rule evaluates, (x, y) or (x, y,
      sample_weight) or a callable returning one (default: fit's batch;
      custom loops call set_train_batch in the step).
    name: the optimizer's name (also the prefix of its state variables).
    seed: seed of the sampled targets (default: TensorFlow's global seed
      when one is set, else 0; kept in the config and in checkpoints).
    weight_decay: AdamW's decoupled weight decay (default None: none), as
      Keras's optimizers apply it: every trainable variable w that
      `optimizer.exclude_from_weight_decay(var_list=..., var_names=...)`
      does not exclude gets w <- w - lr * wd * w once per step, lr being
      the step's learning rate (adaptive=True: the one the quadratic model
      chose for this step). It is not preconditioned and enters neither the
      momentum nor the quadratic model nor the damping rule's predicted
      change (kfac/python/ops/optimizers/weight_decay.py says why this
      step's rate). A variable like damping: `optimizer.weight_decay = ...`
      or a kfac.keras.callbacks schedule changes it between steps. Not with
      use_weight_decay=True.
    **kfac_kwargs: recipe="exact" (the default of adaptive=True, above) or
      "minibatch": the recipe for noisy minibatch training, at the
      learning_rate you give (docs/recipe.md, "The minibatch recipe"):
      momentum 0.9 (momentum_type "regular", no quadratic model), a norm
      constraint of 0.01 on the update, statistics every 10 steps,
      inverses and the damping rule every 50 (moving the damping by at
      most 2% each time); any of these given explicitly wins. Or "auto":
      the exact recipe until the measured gradient noise scale passes the
      batch size, then the minibatch recipe at minibatch_learning_rate
      (default 0.1), switched inside the traced step and logged once
      (noise measured one step in 10 after the first 5;
      optimizer.recipe_in_use, recipe_switched_at; docs/recipe.md, "The
      automatic recipe").
      noise_scale_steps=N, noise_scale_every=k: the first N steps, then
      one step in k, also measure the gradient noise scale B_simple on the
      two halves of the step's batch (about one more forward and backward
      pass on those steps; the later measurements in a moving window of
      about 5; the optimizer's noise_scale, the registration report, the
      TensorBoard scalar kfac/noise_scale and one log line after the first
      N give it; docs/recipe.md, "The gradient noise scale"): 5 and 10
      with recipe="auto", else 0 and 0 (none: the measurement adds a copy
      of the model's forward and backward pass to the traced step, about
      half again the first call's time); given noise_scale_steps alone
      with adaptive=True, noise_scale_every is 50.
      factor_block_size=b (default 0: off): the Kronecker factors of Dense
      and convolution layers with more than b rows keep only their
      diagonal blocks of at most b rows (state, statistics, inverses and
      products about n*b instead of n^2: docs/approximations.md,
      "Block-diagonal factors").
      registration_options={layer name or class: {option:
      value}} (convolution statistics options: sub_sample_inputs,
      sub_sample_patches, patch_mask; DepthwiseConv2D: sub_sample_patches),
      and the arguments of
      kfac.PeriodicInvCovUpdateKfacOpt
      (momentum, momentum_type, invert_every, cov_update_every,
      num_burnin_steps, calibrate_damping, num_calibration_steps,
      cov_ema_decay, estimation_mode,
      norm_constraint, use_weight_decay and weight_decay_coeff (kfac
      0.2.x's weight decay: not with weight_decay), l2_reg,
      precon_damping_mult, damping_adaptation_interval, min_damping, ...).
  """
