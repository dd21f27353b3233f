"""The Kfac class the user sees, in the flavour of Keras that `tf.keras`
resolves to: a Keras 3 optimizer, or a tf_keras (Keras 2) one, which in a
TF1 graph builds kfac 0.2.x's graph-mode Kfac (keras/graph_optimizer.py).
Both are registered for Keras serialization as "kfac>Kfac"."""

import tensorflow as tf

from kfac.python.keras import keras_flavor
from kfac.python.keras.optimizer import arguments
from kfac.python.keras.optimizer import mixin

# The module users import Kfac from (kfac 0.2.4's path): the classes report
# it as their __module__, so that Keras configs name it as before.
PUBLIC_MODULE = "kfac.python.keras.optimizers"


def _make_keras3_class(keras):
  """The Keras 3 optimizer class."""

  @keras.saving.register_keras_serializable(package="kfac", name="Kfac")
  class Kfac(mixin.KfacKerasMixin, keras.optimizers.Optimizer):  # pylint: disable=missing-docstring
    __doc__ = arguments.CONSTRUCTOR_DOC
    __module__ = PUBLIC_MODULE

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
      arguments.check_before_base(learning_rate, adaptive, kfac_kwargs)
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
  class Kfac(mixin.KfacKerasMixin, tf_keras.optimizers.Optimizer,  # pylint: disable=missing-docstring
             metaclass=_LegacyKfacMeta):
    __doc__ = arguments.CONSTRUCTOR_DOC
    __module__ = PUBLIC_MODULE

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
      arguments.check_before_base(learning_rate, adaptive, kfac_kwargs)
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
