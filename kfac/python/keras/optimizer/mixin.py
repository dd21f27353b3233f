"""KfacKerasMixin: the Keras Kfac optimizer apart from its Keras flavour
(classes.py): set-up from the arguments (arguments.py), the model it serves,
its hyperparameter variables and properties. The per-trace step is in
step.py, the config and saved variables in config.py."""

import weakref

import tensorflow as tf

from kfac.python.keras import keras_flavor
from kfac.python.keras import layer_registration
from kfac.python.keras import loss_registration
from kfac.python.keras import registration_report
from kfac.python.keras import utils as keras_utils
from kfac.python.keras.optimizer import arguments
from kfac.python.keras.optimizer import config as config_lib
from kfac.python.keras.optimizer import losses
from kfac.python.keras.optimizer import step as step_lib
from kfac.python.ops.optimizers import periodic as periodic_lib
from kfac.python.ops.tensors import utils as kfac_utils
from kfac.python.ops.reliability import arguments as argument_rules


class KfacKerasMixin(step_lib.KfacStepMixin, config_lib.KfacConfigMixin):
  """Everything of the Keras optimizer that does not depend on the flavour.

  Subclasses call `_kfac_init` from `__init__` and `_kfac_apply` where their
  base class applies gradients."""

  # -------------------------------------------------------------- set-up
  def _kfac_init(self, learning_rate, damping, model, loss, loss_weights,
                 fisher_approx, layer_collection, adaptive, train_batch,
                 seed, kfac_kwargs):
    arguments.check_before_base(learning_rate, adaptive, kfac_kwargs)
    # The default recipe (kfac/python/ops/adaptive/recipe, docs/recipe.md).
    damping, kfac_kwargs = arguments.with_recipe_defaults(damping, adaptive,
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
    self._kfac_options = dict(kfac_kwargs.pop("registration_options", None)
                              or {})
    self._kfac_kwargs = dict(kfac_kwargs)
    self._kfac_loss = loss
    self._kfac_loss_weights = loss_weights
    self._kfac_adaptive = bool(adaptive)
    # adaptive=True with momentum_type="regular": the recipe at the user's
    # learning rate and momentum; only the damping is adapted.
    self._kfac_fixed_rate = arguments.fixed_rate(adaptive, kfac_kwargs)
    self._kfac_train_batch = train_batch
    self._kfac_fisher_approx = dict(fisher_approx or {})
    if seed is None:
      # Deterministic by default (a run and its resumed copy draw the same
      # samples); tf.random.set_seed / keras.utils.set_random_seed choose
      # another.
      seed = int(global_seed() or 0) % (2**31 - 1)
    self._kfac_seed = int(seed)
    object.__setattr__(self, "_kfac_model_ref", None)
    self._kfac_report = None
    self._kfac_warned = set()
    self._kfac_hyper = {}
    values = dict(arguments.CORE_DEFAULTS)
    if adaptive and not self._kfac_fixed_rate:
      del values["momentum"]  # qmodel chooses it (qmodel_fixedmu: given)
    values.update({k: kfac_kwargs[k]
                   for k in arguments.MUTABLE_HYPERPARAMETERS
                   if k in kfac_kwargs})
    values["damping"] = damping
    for name in ("damping", "momentum", "weight_decay_coeff",
                 "norm_constraint", "weight_decay"):
      value = values.get(name)
      if value is None:
        continue
      argument_rules.check("Kfac", name, value, arguments.RULES[name])
      if not kfac_utils.is_python_number(value):
        raise ValueError("Kfac's %s must be a number (schedules: use "
                         "kfac.keras.callbacks), got %r." % (name, value))
      self._kfac_hyper[name] = self._kfac_make_variable(name, float(value))
    fraction = kfac_kwargs.get("qmodel_batch_fraction")
    # The whole batch: the training collection's losses, no extra pass.
    self._kfac_qmodel_fraction = (None if fraction is None or fraction >= 1
                                  else float(fraction))
    core_kwargs = {k: v for k, v in kfac_kwargs.items()
                   if k not in arguments.MUTABLE_HYPERPARAMETERS and
                   k != "qmodel_batch_fraction"}
    for name, var in self._kfac_hyper.items():
      core_kwargs[_CORE_NAMES.get(name, name)] = var
    if "weight_decay" in self._kfac_hyper:
      # Keras's exclude_from_weight_decay (the choice made in _kfac_apply).
      core_kwargs["decoupled_weight_decay_mask"] = self._kfac_decays
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
        learning_rate=(None if adaptive and not self._kfac_fixed_rate
                       else self._kfac_lr_tensor),
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
    elif self._kfac_fixed_rate:
      names.add("learning_rate")
      names -= {"damping"}
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
      if self._kfac_loss is not None and not losses.same_losses(
          loss, self._kfac_loss):
        raise ValueError("register_layers(loss=%s) disagrees with Kfac(loss="
                         "%s)." % (losses.describe(loss),
                                   losses.describe(self._kfac_loss)))
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
      rows, loss_lines, lc = self._kfac_report
      memory = registration_report.memory_of(
          lc, getattr(self._kfac_core, "memory_budget", None))
      return registration_report.format_report(rows, loss_lines, memory)
    if self._kfac_model is None:
      return "(no model yet)"
    plans = layer_registration.plan_layers(self._kfac_model,
                                           self._kfac_fisher_approx)
    rows = [layer_registration.Row(
        keras_flavor.layer_path(p.layer), type(p.layer).__name__,
        "(" + p.kind + ")", p.approx or "default",
        ", ".join(layer_registration.param_names(p)), 0,
        "fallback: " + p.reason if p.kind == "generic" else "")
            for p in plans]
    return layer_registration.format_report(rows) + (
        "\n(planned; blocks and losses are known after the first step)")

  # -------------------------------------------------------------- hyperparameters
  def _kfac_get(self, name):
    return self._kfac_hyper.get(name)

  def _kfac_check_not_adapted(self, name):
    adapted = ("learning_rate", "damping", "momentum")
    if getattr(self, "_kfac_fixed_rate", False):
      adapted = ("damping",)
    if getattr(self, "_kfac_adaptive", False) and name in adapted:
      raise ValueError(
          "Kfac(adaptive=True) chooses the %s itself at every step, so it "
          "cannot be set (or scheduled by a callback); its current value is "
          "readable." % name)

  def _kfac_set(self, name, value):
    self._kfac_check_not_adapted(name)
    if name == "weight_decay":  # (a number: checked now)
      argument_rules.check("Kfac", name, value, arguments.RULES[name])
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

  @property
  def weight_decay(self):
    """AdamW's decoupled weight decay (a variable), or None."""
    return self.__dict__.get("_kfac_hyper", {}).get("weight_decay")

  @weight_decay.setter
  def weight_decay(self, value):
    if "_kfac_hyper" not in self.__dict__ and not value:
      # The Keras base class's __init__ setting its default (None in Keras
      # 3, 0 in tf_keras): Kfac sets its own up in _kfac_init.
      return
    self._kfac_set("weight_decay", value)

  def _kfac_decays(self, variable):
    """Whether the core's `variable` decays: not excluded by
    exclude_from_weight_decay (Keras's own rule, on the Keras variable)."""
    decays = getattr(self, "_kfac_decay_choice", {}).get(variable.ref())
    if decays is None:
      raise ValueError("Kfac's weight decay got the variable %s, which is "
                       "not one of the step's." % variable.name)
    return decays


# Attributes that return the model (hidden from dir(): see __dir__).
_NOT_SAVED_ATTRIBUTES = frozenset(["model", "_kfac_model", "_kfac_model_ref"])

# Kfac's names of the core optimizer's arguments.
_CORE_NAMES = {"weight_decay": "decoupled_weight_decay"}


def global_seed():
  """TensorFlow's global (eager) or graph-level seed, or None; read without
  advancing the op-seed counter as tf.compat.v1.get_seed would."""
  if tf.executing_eagerly():
    from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
    return context.global_seed()
  return tf.compat.v1.get_default_graph().seed
