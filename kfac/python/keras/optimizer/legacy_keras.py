"""The tf_keras (Keras 2) Kfac optimizer of TF2 (`kfac.keras.optimizers.Kfac`
where tf.keras is tf_keras: TF_USE_LEGACY_KERAS=1, eager + tf.function).
Imported only where that flavour is used (classes.py): Keras 3 users never
import tf_keras.

In a TF1 graph (v2 behaviour disabled, or inside a tf.compat.v1.Graph)
tf_keras builds models with its v1 engine, and `kfac.keras.optimizers.Kfac`
is kfac 0.2.x's graph-mode class, keras/graph_optimizer.py's `Kfac`
(classes.kfac_class chooses where `Kfac` is looked up). Why two classes,
and not one serving both engines (measured with tf_keras 2.21):

* the v1 engine trains through `optimizer.get_updates(loss, params)`,
  which only the OptimizerV2 base (`tf_keras.optimizers.legacy.Optimizer`)
  has: given a `tf_keras.optimizers.Optimizer` inside a tf.compat.v1.Graph
  it fails with "'SGD' object has no attribute 'get_updates'", and with v2
  behaviour disabled `optimizers.get` converts such an optimizer to a
  built-in legacy one by its class name (none for Kfac). The graph-mode
  contract (keras_compat_optimizer_test) is an OptimizerV2 (its `_hyper`
  hyperparameters, `weights`, `get_weights` for HDF5 files);
* TF2's `fit` takes an OptimizerV2 too, but the TF2 contract is a
  `tf_keras.optimizers.Optimizer` (isinstance, as the tests check; its
  checkpoints and `.keras` files hold that base's variables);
* one class deriving from both bases (a consistent MRO: Optimizer,
  _BaseOptimizer, AutoTrackable, OptimizerV2, Trackable) is an OptimizerV2
  in TF2 as well: tf_keras then wraps it for mixed_float16 in the
  OptimizerV2 LossScaleOptimizer instead of LossScaleOptimizerV3 (another
  checkpoint layout), revives it from a SavedModel as an OptimizerV2,
  routes every attribute lookup through OptimizerV2.__getattribute__ (a
  missing attribute then reports "no attribute '_hyper'"), and the 12
  names both bases define (__init__, iterations, variables,
  apply_gradients, minimize, get_config, from_config, set_weights,
  _serialize_hyperparameter, ...) would each need a switch by engine.

So each engine has its own class, both defined in source, with no
metaclass and no `__new__`: `kfac.keras.optimizers.Kfac` looked up in a TF1
graph is the graph-mode class, and `isinstance(opt, kfac.keras.optimizers.Kfac)`
holds for an optimizer built in the same mode. This class refuses a TF1
graph with a message naming the graph-mode class; configs that tf_keras's
loaders read there ("kfac>Kfac" is registered to this class) build the
graph-mode class (from_config).
"""

import tensorflow as tf
import tf_keras

from kfac.python.keras import keras_flavor
from kfac.python.keras.optimizer import engine as engine_lib


@tf_keras.saving.register_keras_serializable(package="kfac", name="Kfac")
class Kfac(engine_lib.KfacOptimizerBase, tf_keras.optimizers.Optimizer):  # pylint: disable=missing-docstring
  __doc__ = engine_lib.CONSTRUCTOR_DOC
  __module__ = engine_lib.PUBLIC_MODULE

  def __init__(self, learning_rate=None, damping=None, model=None,
               loss=None, loss_weights=None, fisher_approx=None,
               layer_collection=None, adaptive=False, train_batch=None,
               name="Kfac", seed=None, **kfac_kwargs):
    if keras_flavor.v1_graph_mode():
      raise RuntimeError(
          "This is the TF2 tf_keras Kfac; in a TF1 graph (v2 behaviour "
          "disabled or inside a tf.compat.v1.Graph) tf_keras's v1 engine "
          "takes kfac 0.2.x's graph-mode Kfac: use kfac.keras.optimizers."
          "Kfac looked up there (or kfac.keras.optimizers.kfac_class()). A "
          "name bound before v2 behaviour was disabled (`from "
          "kfac.keras.optimizers import Kfac` above "
          "tf.compat.v1.disable_v2_behavior()) still names this class: "
          "disable v2 behaviour before that import, or look Kfac up after.")
    average, ema_warmup, kfac_kwargs = engine_lib.split_average_options(
        kfac_kwargs)
    engine_lib.check_before_base(learning_rate, adaptive, kfac_kwargs)
    super().__init__(name=name, jit_compile=False, **average)
    self._learning_rate = self._build_learning_rate(
        float(learning_rate or 0.0))
    self._kfac_ema_warmup = ema_warmup
    self._kfac_attach(engine_lib.KfacEngine(
        self.name, self._kfac_make_variable, lambda: self._learning_rate,
        learning_rate, damping, model, loss, loss_weights, fisher_approx,
        layer_collection, adaptive, train_batch, seed, kfac_kwargs))

  def _kfac_make_variable(self, name, value):
    with tf.init_scope():
      var = tf.Variable(value, name=name, dtype=tf.float32, trainable=False)
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
    if self.use_ema:
      with tf.control_dependencies([op]):
        self._kfac_update_average(variables)
    with tf.control_dependencies([op]):
      return self.iterations.assign_add(1)

  def build(self, var_list):
    # (As tf_keras's own optimizers: built once, for the first step's
    # variables; the base class builds the moving average of use_ema.)
    if getattr(self, "_built", False):
      return
    super().build(var_list)
    self._built = True

  def _kfac_average_of(self, variable):
    """use_ema: the moving average of `variable` (a model variable)."""
    return self._model_variables_moving_average[
        self._index_dict[self._var_key(variable)]]

  def update_step(self, gradient, variable):
    raise NotImplementedError("Kfac updates all variables at once.")

  @classmethod
  def from_config(cls, config, custom_objects=None):
    if keras_flavor.v1_graph_mode():
      # A config read by tf_keras's loaders in a TF1 graph ("kfac>Kfac" is
      # registered to this class): the optimizer of the v1 engine there.
      from kfac.python.keras import graph_optimizer  # pylint: disable=g-import-not-at-top
      return graph_optimizer.Kfac.from_config(config, custom_objects)
    return super().from_config(config, custom_objects)
