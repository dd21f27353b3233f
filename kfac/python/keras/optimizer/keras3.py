"""The Keras 3 Kfac optimizer (`kfac.keras.optimizers.Kfac` where tf.keras
is Keras 3). Imported only where that flavour is used (classes.py)."""

import keras
import tensorflow as tf

from kfac.python.keras import keras_flavor
from kfac.python.keras.optimizer import engine as engine_lib


@keras.saving.register_keras_serializable(package="kfac", name="Kfac")
class Kfac(engine_lib.KfacOptimizerBase, keras.optimizers.Optimizer):  # pylint: disable=missing-docstring
  __doc__ = engine_lib.CONSTRUCTOR_DOC
  __module__ = engine_lib.PUBLIC_MODULE

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
    average, ema_warmup, kfac_kwargs = engine_lib.split_average_options(
        kfac_kwargs)
    engine_lib.check_before_base(learning_rate, adaptive, kfac_kwargs)
    super().__init__(learning_rate=float(learning_rate or 0.0), name=name,
                     **average)
    self._kfac_ema_warmup = ema_warmup
    self._kfac_attach(engine_lib.KfacEngine(
        self.name, self._kfac_make_variable, lambda: self._learning_rate,
        learning_rate, damping, model, loss, loss_weights, fisher_approx,
        layer_collection, adaptive, train_batch, seed, kfac_kwargs))

  def _kfac_make_variable(self, name, value):
    var = keras.Variable(value, name=name, dtype="float32", trainable=False)
    self._track_variable(var)
    return keras_flavor.unwrap_variable(var)

  def _backend_apply_gradients(self, grads, trainable_variables):
    # (Keras's apply counts the step in `iterations` after this.)
    op = self._kfac_apply(grads, trainable_variables,
                          keras_flavor.unwrap_variable(self._iterations))
    if self.use_ema:
      with tf.control_dependencies([op]):
        self._kfac_update_average(self._trainable_variables)

  def _kfac_average_of(self, variable):
    """use_ema: the moving average of `variable` (a model variable)."""
    return self._model_variables_moving_average[
        self._get_variable_index(variable)]

  def update_step(self, gradient, variable, learning_rate):
    raise NotImplementedError("Kfac updates all variables at once.")

  def stateless_apply(self, optimizer_variables, grads, trainable_variables):
    raise NotImplementedError("Kfac runs on the TensorFlow backend only.")
