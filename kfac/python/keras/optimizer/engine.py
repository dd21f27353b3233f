"""KfacEngine: the K-FAC part of the Keras Kfac optimizer, the same for
Keras 3 and tf_keras. The Keras class (keras3.py, legacy_keras.py) builds
one in `__init__` and calls it; the engine holds:

* the set-up from Kfac's arguments (arguments.py: checks, the default
  recipe) and the core PeriodicInvCovUpdateKfacOpt doing the work, with
  its StateStore (a checkpoint dependency of the Keras object);
* the hyperparameter variables (damping, momentum, ...), made by the Keras
  class (`make_variable`, so that Keras tracks them in its own variables);
* the model it serves (a weak reference) and the loss given to Kfac;
* the per-trace step (step.KerasStep) and the registration report.
"""

import weakref

import tensorflow as tf

from kfac.python.keras import keras_flavor
from kfac.python.keras import layer_registration
from kfac.python.keras import loss_registration
from kfac.python.keras import registration_report
from kfac.python.keras import utils as keras_utils
from kfac.python.keras.optimizer import arguments
from kfac.python.keras.optimizer import losses
from kfac.python.keras.optimizer import step as step_lib
from kfac.python.ops.optimizers import periodic as periodic_lib
from kfac.python.ops.tensors import utils as kfac_utils
from kfac.python.ops.reliability import arguments as argument_rules

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
    The others: Kfac's arguments (arguments.CONSTRUCTOR_DOC).
  """

  def __init__(self, name, make_variable, learning_rate_variable,
               learning_rate, damping, model, loss, loss_weights,
               fisher_approx, layer_collection, adaptive, train_batch, seed,
               kfac_kwargs):
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
    self.learning_rate_variable = learning_rate_variable
    self.options = dict(kfac_kwargs.pop("registration_options", None) or {})
    self.kwargs = dict(kfac_kwargs)
    self.loss = loss
    self.loss_weights = loss_weights
    self.adaptive = bool(adaptive)
    # adaptive=True with momentum_type="regular": the recipe at the user's
    # learning rate and momentum; only the damping is adapted.
    self.fixed_rate = arguments.fixed_rate(adaptive, kfac_kwargs)
    self.train_batch = train_batch
    self.fisher_approx = dict(fisher_approx or {})
    if seed is None:
      # Deterministic by default (a run and its resumed copy draw the same
      # samples); tf.random.set_seed / keras.utils.set_random_seed choose
      # another.
      seed = int(global_seed() or 0) % (2**31 - 1)
    self.seed = int(seed)
    self._model_ref = None
    self.report = None
    self.hyper = {}
    values = dict(arguments.CORE_DEFAULTS)
    if adaptive and not self.fixed_rate:
      del values["momentum"]  # qmodel chooses it (qmodel_fixedmu: given)
    values.update({k: kfac_kwargs[k]
                   for k in arguments.MUTABLE_HYPERPARAMETERS
                   if k in kfac_kwargs})
    values["damping"] = damping
    for hp in ("damping", "momentum", "weight_decay_coeff",
               "norm_constraint", "weight_decay"):
      value = values.get(hp)
      if value is None:
        continue
      argument_rules.check("Kfac", hp, value, arguments.RULES[hp])
      if not kfac_utils.is_python_number(value):
        raise ValueError("Kfac's %s must be a number (schedules: use "
                         "kfac.keras.callbacks), got %r." % (hp, value))
      self.hyper[hp] = make_variable(hp, float(value))
    fraction = kfac_kwargs.get("qmodel_batch_fraction")
    # The whole batch: the training collection's losses, no extra pass.
    self.qmodel_fraction = (None if fraction is None or fraction >= 1
                            else float(fraction))
    self.step = step_lib.KerasStep(self)
    core_kwargs = {k: v for k, v in kfac_kwargs.items()
                   if k not in arguments.MUTABLE_HYPERPARAMETERS and
                   k != "qmodel_batch_fraction"}
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
    if adaptive or calibrate:
      # The passed loss is unknown here (and drew other dropout masks):
      # loss_fn evaluates the loss before the update too.
      core_kwargs.update(use_passed_loss=False, loss_fn=self.step.loss_fn)
    self.core = periodic_lib.PeriodicInvCovUpdateKfacOpt(
        learning_rate=(None if adaptive and not self.fixed_rate
                       else self.learning_rate_tensor),
        name=name, **core_kwargs)
    self.state = self.core.state_store
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
    keras_utils.watch(model)
    keras_utils.name_state_by_structure(model)
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
      return registration_report.format_report(rows, loss_lines, memory)
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

  # -------------------------------------------------------------- hyperparameters
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
      argument_rules.check("Kfac", name, value, arguments.RULES[name])
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
