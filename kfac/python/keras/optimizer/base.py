"""KfacOptimizerBase: what the Keras Kfac classes of both flavours
(keras3.py, legacy_keras.py) show to Keras and to the user, delegated to
their K-FAC engine (engine.KfacEngine): the model, the hyperparameter
properties, kfac 0.2.x's names, minimize, the config and the saved
variables.

A Keras class derives from this base and from its Keras optimizer base
class, builds its engine in `__init__` (`_kfac_attach`) and calls
`_kfac_apply` where its Keras base applies the gradients."""

import tensorflow as tf

from kfac.python.keras import keras_flavor
from kfac.python.keras.optimizer import config as config_lib

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

  # -------------------------------------------------------------- hyperparameters
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
    return config_lib.get_config(self._kfac_engine, self.name,
                                 float(self._kfac_lr_tensor().numpy()))

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
