"""`kfac.keras.optimizers.Kfac` in a TF1 graph (tf_keras, v2 behaviour off).

With TF_USE_LEGACY_KERAS=1 and `tf.compat.v1.disable_v2_behavior()` (or
inside a `tf.compat.v1.Graph`), tf_keras compiles models with its v1 engine,
which accepts only its legacy (OptimizerV2) optimizers and trains through
`optimizer.get_updates(loss, params)`. `kfac.keras.optimizers.Kfac` (looked
up there: optimizer/classes.kfac_class) is then this class, defined here in
source (optimizer/legacy_keras.py says why it is not the TF2 tf_keras
class), with the contract of kfac 0.2.x's Keras optimizer:

* keyword arguments only (a positional argument is a ValueError);
* `model=` and `loss=` (or `register_layers(...)`, or `layer_collection=`)
  give the layers to register; the registration happens when the core
  optimizer is first needed (`optimizer.optimizer`, `get_updates`,
  `minimize`, `apply_gradients`), from the model's last call in the graph;
* `optimizer.optimizer` is the core `kfac.PeriodicInvCovUpdateKfacOpt`
  doing the work, created on first use;
* `minimize(loss, var_list)` / `apply_gradients(grads_and_vars)` /
  `get_updates(loss, params)` return TF1 ops (`minimize` in a custom
  Session loop needs no tape);
* `learning_rate`, `damping`, `momentum`, `weight_decay_coeff` and
  `norm_constraint` are Keras hyperparameters (`mutable_hyperparameters`
  lists those that can be changed: set them with a Python number);
* `weight_decay=wd` (not in kfac 0.2.x) is AdamW's decoupled weight decay,
  the core's `decoupled_weight_decay` (all registered variables; a
  constructor argument, not a mutable hyperparameter here);
* `loss_tensor=` is the loss the damping rule uses with adapt_damping
  (default: the loss given to `minimize`); `train_batch=` (or
  `register_train_batch`) is the batch it evaluates.

The K-FAC state lives in the core optimizer's variables; they are tracked
by the Keras session (initialised by `fit`) and listed in
`optimizer.weights` after the first update op is built.
"""

import inspect
import numbers

import tensorflow as tf
import tf_keras
from tf_keras.src.backend import track_variable

from kfac.python.keras import utils as keras_utils
from kfac.python.ops.reliability import arguments
from kfac.python.ops.optimizers import kfac_optimizer as optimizer_lib

_DOC = __doc__
# The hyperparameters Keras keeps (kfac 0.2.x: _MUTABLE_HYPER_PARAMS).
MUTABLE_HYPER_PARAMS = frozenset({"learning_rate", "momentum", "damping",
                                  "weight_decay_coeff", "norm_constraint"})
_EMA_MESSAGE = (
    "Argument \"%s\" is not supported by the graph-mode Kfac (tf_keras's "
    "v1 engine keeps no moving average of the weights). Use the TF2 Kfac "
    "(use_ema=True there), or tf.compat.v1.train.ExponentialMovingAverage "
    "over model.trainable_weights.")
_REJECTED = {
    "clipvalue": "Argument \"clipvalue\" is not supported.",
    "clipnorm": "Argument \"clipnorm\" is not supported. Use "
                "\"norm_constraint\" instead.",
    "global_clipnorm": "Argument \"global_clipnorm\" is not supported. Use "
                       "\"norm_constraint\" instead.",
    "use_ema": _EMA_MESSAGE % "use_ema",
    "ema_momentum": _EMA_MESSAGE % "ema_momentum",
    "ema_overwrite_frequency": _EMA_MESSAGE % "ema_overwrite_frequency",
    "ema_warmup": _EMA_MESSAGE % "ema_warmup",
}
# Core arguments that are structure, not configuration.
_NOT_IN_CONFIG = ("layer_collection", "var_list", "loss", "loss_fn",
                  "train_batch", "prev_train_batch", "self", "kfac_kwargs",
                  "placement_kwargs", "decoupled_weight_decay_mask")


def _core_defaults():
  """Default values of the core optimizer's arguments (JSON-able ones)."""
  out = {}
  for fn in (optimizer_lib.KfacOptimizer.__init__,
             optimizer_lib.PeriodicInvCovUpdateKfacOpt.__init__):
    for name, param in inspect.signature(fn).parameters.items():
      if name in _NOT_IN_CONFIG or param.default is inspect.Parameter.empty:
        continue
      value = param.default
      if value is None or isinstance(value, (bool, numbers.Number, str)):
        out[name] = value
  return out


def _is_qmodel(momentum_type):
  return str(momentum_type or "").lower().startswith("qmodel")


def _decoupled_weight_decay(kfac_kwargs):
  """kfac_kwargs with Keras's weight_decay as the core's
  decoupled_weight_decay (checked now: the core is built at first use)."""
  wd = kfac_kwargs.pop("weight_decay", None)
  if wd is None:
    return kfac_kwargs
  arguments.check("Kfac", "weight_decay", wd, arguments.NON_NEGATIVE)
  if kfac_kwargs.get("use_weight_decay"):
    raise ValueError(
        "Kfac got weight_decay=%r (AdamW's decoupled weight decay) and "
        "use_weight_decay=True (kfac 0.2.x's, with weight_decay_coeff): both "
        "decay the weights; choose one." % (wd,))
  if kfac_kwargs.get("decoupled_weight_decay") is not None:
    raise ValueError("Pass weight_decay or decoupled_weight_decay, not "
                     "both.")
  kfac_kwargs["decoupled_weight_decay"] = wd
  return kfac_kwargs


class Kfac(tf_keras.optimizers.legacy.Optimizer):  # pylint: disable=missing-docstring
  __doc__ = _DOC

  def __init__(self, _sentinel=None, learning_rate=None, damping=None,
               model=None, loss=None, loss_weights=None, fisher_approx=None,
               layer_collection=None, adaptive=False, train_batch=None,
               name=None, seed=None, **kfac_kwargs):
    if _sentinel is not None:
      raise ValueError("Do not pass positional arguments, only use keyword "
                       "arguments (Kfac(learning_rate=..., damping=..., "
                       "model=..., loss=...)).")
    if damping is None:
      raise ValueError("Please provide a value for damping.")
    for key, message in _REJECTED.items():
      if key in kfac_kwargs:
        raise ValueError(message)
    super().__init__(name=name or "Kfac")
    kfac_kwargs = _decoupled_weight_decay(dict(kfac_kwargs))
    if "loss_tensor" in kfac_kwargs:
      kfac_kwargs["loss"] = kfac_kwargs.pop("loss_tensor")
    kfac_kwargs.update(name=self._name, learning_rate=learning_rate,
                       damping=damping)
    if adaptive:
      kfac_kwargs.update(adapt_damping=True, momentum_type="qmodel",
                         momentum=None)
    if _is_qmodel(kfac_kwargs.get("momentum_type")):
      if kfac_kwargs["learning_rate"] is not None:
        raise ValueError("learning_rate must be None to use adaptive/qmodel "
                         "(the quadratic model chooses it).")
      if kfac_kwargs.get("momentum") is not None and (
          kfac_kwargs["momentum_type"] == "qmodel"):
        raise ValueError("momentum must be None to use adaptive/qmodel "
                         "(or use momentum_type='qmodel_fixedmu').")
      kfac_kwargs.setdefault("momentum", None)
    if kfac_kwargs.get("adapt_damping"):
      kfac_kwargs.setdefault("use_passed_loss", True)
      kfac_kwargs.setdefault("update_damping_immediately", True)
      if not ("invert_every" in kfac_kwargs and
              "damping_adaptation_interval" in kfac_kwargs):
        # the damping is adapted on steps where the inverses are fresh
        kfac_kwargs["invert_every"] = 5
        kfac_kwargs["damping_adaptation_interval"] = 5
    self._optimizer = None
    self._layer_collection = None
    self._model = model
    self._loss = loss
    self._kfac_kwargs = kfac_kwargs
    self._layer_collection_kwargs = {
        "loss_weights": loss_weights,
        "fisher_approx": fisher_approx,
        "seed": seed,
    }
    self._config = _core_defaults()
    self._config.update({k: v for k, v in kfac_kwargs.items()
                         if k not in _NOT_IN_CONFIG})
    self._config.update(loss_weights=loss_weights,
                        fisher_approx=keras_utils.serialize_fisher_approx(
                            fisher_approx),
                        seed=seed, adaptive=bool(adaptive),
                        loss=keras_utils.serialize_loss(loss))
    mutable = set(MUTABLE_HYPER_PARAMS)
    if kfac_kwargs.get("adapt_damping"):
      mutable.discard("damping")
    if _is_qmodel(self._config.get("momentum_type")):
      mutable -= {"learning_rate", "momentum"}
    for hp in sorted(mutable):
      value = kfac_kwargs.get(hp, self._config.get(hp))
      if value is None:
        mutable.discard(hp)
      else:
        self._set_hyper(hp, value)
    self._mutable_hypers = mutable
    if layer_collection is not None:
      self.register_layers(layer_collection=layer_collection)
    if train_batch is not None and kfac_kwargs.get("adapt_damping"):
      self.register_train_batch(train_batch)

  # ------------------------------------------------------------ properties
  @property
  def name(self):
    return self._name

  @name.setter
  def name(self, value):
    if self._optimizer is not None:
      raise ValueError("Can't change the optimizer's name after the "
                       "variables are created.")
    self._name = value
    self._config["name"] = value
    self._kfac_kwargs["name"] = value

  @property
  def optimizer(self):
    """The core kfac.PeriodicInvCovUpdateKfacOpt (created on first use)."""
    self._create_optimizer()
    return self._optimizer

  @property
  def layers(self):
    """The LayerCollection (None before the layers are registered)."""
    return self._layer_collection

  @property
  def loss_tensor(self):
    """The loss given as loss_tensor= (or to minimize, with
    adapt_damping), None otherwise."""
    return self._kfac_kwargs.get("loss")

  @property
  def mutable_hyperparameters(self):
    """Names of the hyperparameters that can be set after creation."""
    return set(self._mutable_hypers)

  # ------------------------------------------------------------ set-up
  def register_layers(self, model=None, loss=None, layer_collection=None):
    """Registers `model`'s layers and `loss` (default: the compiled
    loss), or uses `layer_collection`."""
    if layer_collection is None:
      if not loss and model is not None:
        loss = getattr(model, "loss", None)
      if model is None or not loss:
        raise ValueError("Please provide a model with a loss, a model and "
                         "loss, or a LayerCollection.")
      layer_collection = keras_utils.get_layer_collection(
          model, loss=loss, **self._layer_collection_kwargs)
      if isinstance(layer_collection, tuple):
        layer_collection = layer_collection[0]
      self._model, self._loss = model, loss
    self._layer_collection = layer_collection
    self._kfac_kwargs["var_list"] = list(
        layer_collection.registered_variables)

  def register_train_batch(self, train_batch, batch_size=None):
    """The (inputs, labels) tensors the damping rule evaluates the loss
    on (adaptive=True / adapt_damping=True)."""
    if not isinstance(train_batch, tuple):
      raise ValueError("You must provide the train_batch tuple of inputs "
                       "to use adaptive/adapt_damping mode.")
    if not all(tf.is_tensor(t) for t in tf.nest.flatten(train_batch)):
      raise ValueError("You must use TF tensors as input (train_batch).")
    self._kfac_kwargs["train_batch"] = train_batch
    if batch_size:
      self._kfac_kwargs["batch_size"] = batch_size
    elif "batch_size" not in self._kfac_kwargs:
      first = tf.nest.flatten(train_batch)[0]
      inferred = first.shape[0] if first.shape.rank else None
      if not inferred:
        raise ValueError(
            "Could not infer batch_size from the train_batch. Please "
            "provide it in the optimizer constructor (batch_size=...) or "
            "through register_train_batch.")
      self._kfac_kwargs["batch_size"] = int(inferred)

  def _create_optimizer(self):
    if self._optimizer is not None:
      return
    if self._layer_collection is None:
      self.register_layers(self._model, self._loss)
    # loss_tensor (kwargs["loss"]) is the damping rule's loss; without
    # adapt_damping / calibrate_damping the core keeps it, as kfac 0.2.x did
    # (readable as opt.optimizer._loss_tensor), and warns that it is unused.
    kwargs = dict(self._kfac_kwargs)
    if kwargs.get("adapt_damping"):
      if "train_batch" not in kwargs:
        raise ValueError(
            "Must provide a train_batch tuple to use adaptive damping. Use "
            "register_train_batch or pass it in during optimizer "
            "construction.")
      if kwargs.get("loss_fn") is None:
        if self._model is None or self._loss is None:
          raise ValueError("adapt_damping needs loss_fn=..., or model=... "
                           "and loss=... to build it.")
        kwargs["loss_fn"] = keras_utils.get_loss_fn(
            self._model, self._loss,
            loss_weights=self._layer_collection_kwargs["loss_weights"])
    with tf.name_scope(self._name):
      with tf.init_scope():
        _ = self.iterations
        self._create_hypers()
    kwargs.update(self._hyper)
    self._optimizer = optimizer_lib.PeriodicInvCovUpdateKfacOpt(
        layer_collection=self._layer_collection, **kwargs)

  def _track_new_variables(self):
    """Gives the Keras session (and optimizer.weights) the K-FAC state
    variables, in the order the core optimizer created them."""
    known = {id(w) for w in self._weights}
    for var in self._optimizer.state_store.variables_by_name.values():
      if id(var) not in known:
        track_variable(var)
        self._weights.append(var)

  # ------------------------------------------------------------ updates
  def minimize(self, loss, var_list=None, grad_loss=None, name=None,
               tape=None):
    """One K-FAC step on `loss` (a tensor of this graph); returns the op."""
    if tape is not None:
      raise ValueError("Kfac in a TF1 graph computes the gradients with "
                       "tf.gradients: drop tape=.")
    if (self._optimizer is None and self._kfac_kwargs.get("adapt_damping")
        and self._kfac_kwargs.get("use_passed_loss", True)
        and self._kfac_kwargs.get("loss") is None):
      self._kfac_kwargs["loss"] = loss
    self._create_optimizer()
    if var_list is None:
      var_list = self._kfac_kwargs["var_list"]
    if callable(var_list):
      var_list = var_list()
    op = self._optimizer.minimize(loss, var_list=list(var_list),
                                  grad_loss=grad_loss, name=name,
                                  global_step=self.iterations)
    self._track_new_variables()
    return op

  def apply_gradients(self, grads_and_vars, name=None, **kwargs):
    del kwargs  # experimental_aggregate_gradients: one replica here
    self._create_optimizer()
    op = self._optimizer.apply_gradients(list(grads_and_vars),
                                         global_step=self.iterations,
                                         name=name)
    self._track_new_variables()
    return op

  def get_updates(self, loss, params):
    return [self.minimize(loss, params)]

  # ------------------------------------------------------------ hypers
  def _set_hyper(self, name, value):
    if getattr(self, "_hypers_created", False) and name in self._hyper:
      if not isinstance(self._hyper[name], tf.Variable):
        raise AttributeError("Can't set attribute: {}".format(name))
      if isinstance(value, bool) or not isinstance(value, numbers.Number):
        raise ValueError(
            "Dynamic reassignment only supports setting with a number. "
            "tf.Tensors and tf.Variables can only be used before the "
            "internal kfac optimizer is created (got %r for %s)." %
            (value, name))
      tf_keras.backend.set_value(self._hyper[name], value)
    else:
      super()._set_hyper(name, value)

  # ------------------------------------------------------------ config
  def get_config(self):
    config = dict(self._config)
    for param in self._hyper:
      value = self._serialize_hyperparameter(param)
      if hasattr(value, "item"):  # a numpy scalar read from the session
        value = value.item()
      config[param] = value
    return config

  @classmethod
  def from_config(cls, config, custom_objects=None):
    del custom_objects
    config = dict(config)
    if isinstance(config.get("loss"), dict) and "class_name" in config[
        "loss"]:
      config["loss"] = tf_keras.losses.deserialize(config["loss"])
    return cls(**config)
