"""Loading models saved with a Kfac optimizer (kfac.keras.saving_utils).

TF2 (Keras 3, or tf_keras with v2 behaviour): `model.save("m.keras")`
stores the Kfac optimizer's config and all of its state (Keras variables
and the K-FAC factors, inverses, velocities and counter). `load_model`
loads such a file with the Kfac class known to Keras and gives the
optimizer its model back (the optimizer keeps only a weak reference to the
model, so the file cannot hold it), so `fit` continues exactly where the
saved run stopped.

TF1 graph mode (tf_keras with v2 behaviour disabled, kfac 0.2.x's setting):
an HDF5 file written by `model.save` / `tf.keras.models.save_model` is
loaded as kfac 0.2.x did: the model without its optimizer, compiled again
from the file's training config with a new Kfac, whose layers are then
registered on the loaded model; the optimizer's saved weights are set after
the train function is built (a mismatch is logged and the optimizer starts
afresh).
"""

import json
import logging

from kfac.python.keras import keras_flavor
from kfac.python.keras.optimizer import classes as kfac_classes
from kfac.python.keras.optimizer import engine as kfac_engine


def load_model(filepath, custom_objects=None, optimizer_name=None,
               compile=True, **kwargs):  # pylint: disable=redefined-builtin
  """keras.saving.load_model with Kfac registered and wired to the model.

  Args:
    filepath: a `.keras` file written by model.save(...) (TF2), or an HDF5
      file path or `h5py.File` (TF1 graph mode, as kfac 0.2.x).
    custom_objects: extra custom objects, as for keras.saving.load_model.
    optimizer_name: TF1 graph mode: the name (variable scope) of the
      loaded Kfac optimizer, to keep several in one graph apart. In TF2 the
      optimizers' state variables never clash and the name is only the
      optimizer's `name` where the Keras flavour lets it be set.
    compile: False loads the model without its optimizer.
    **kwargs: passed on to the Keras loader.

  Returns:
    The model, compiled with its restored Kfac optimizer (when compile).
  """
  keras = keras_flavor.keras_module()
  objects = {"Kfac": kfac_classes.Kfac, "kfac>Kfac": kfac_classes.Kfac}
  objects.update(custom_objects or {})
  if keras_flavor.v1_graph_mode() and compile:
    # Only tf_keras builds models in a TF1 graph.
    import tf_keras  # pylint: disable=g-import-not-at-top
    legacy_kfac = kfac_classes.kfac_class(legacy=True)
    objects = {"Kfac": legacy_kfac, "kfac>Kfac": legacy_kfac}
    objects.update(custom_objects or {})
    return _load_hdf5_graph_mode(tf_keras, filepath, objects, optimizer_name)
  model = keras.saving.load_model(filepath, custom_objects=objects,
                                  compile=compile, **kwargs)
  optimizer = getattr(model, "optimizer", None)
  if isinstance(optimizer, kfac_engine.KfacOptimizerBase):
    if optimizer.model is None:
      optimizer.register_model(model)
  if optimizer_name and optimizer is not None:
    try:
      optimizer.name = optimizer_name
    except AttributeError:  # Keras 3: name is read-only; nothing clashes
      pass
  return model


def _load_hdf5_graph_mode(keras, filepath, custom_objects, optimizer_name):
  """kfac 0.2.x's loader: compile from the training config, register the
  layers of the loaded model, then set the optimizer weights."""
  import h5py  # pylint: disable=g-import-not-at-top
  from tf_keras.src.saving.legacy import hdf5_format  # pylint: disable=g-import-not-at-top
  from tf_keras.src.saving.legacy import saving_utils as keras_saving  # pylint: disable=g-import-not-at-top

  opened = not isinstance(filepath, h5py.File)
  model_file = h5py.File(filepath, mode="r") if opened else filepath
  try:
    model = keras.models.load_model(model_file, custom_objects=custom_objects,
                                    compile=False)
    config = model_file.attrs.get("training_config")
    if hasattr(config, "decode"):
      config = config.decode("utf-8")
    if config is None:
      raise ValueError(
          "No training configuration found in save file, meaning the model "
          "was not compiled. Please use tf.keras.models.load_model instead.")
    model.compile(**keras_saving.compile_args_from_training_config(
        json.loads(config), custom_objects))
    optimizer = model.optimizer
    if hasattr(optimizer, "register_layers"):
      optimizer.register_layers(model)
    if optimizer_name:
      optimizer.name = optimizer_name
    if "optimizer_weights" in model_file:
      model._make_train_function()  # pylint: disable=protected-access
      values = hdf5_format.load_optimizer_weights_from_hdf5_group(model_file)
      try:
        optimizer.set_weights(values)
      except ValueError:
        logging.warning("kfac: the saved optimizer state does not fit the "
                        "loaded Kfac optimizer; it starts afresh.")
  finally:
    if opened:
      model_file.close()
  return model
