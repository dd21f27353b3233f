"""Loading models saved with a Kfac optimizer (kfac.keras.saving_utils).

`model.save("m.keras")` stores the Kfac optimizer's config and all of its
state (Keras variables and the K-FAC factors, inverses, velocities and
counter). `load_model` loads such a file with the Kfac class known to Keras
and gives the optimizer its model back (the optimizer keeps only a weak
reference to the model, so the file cannot hold it), so `fit` continues
exactly where the saved run stopped.
"""

from kfac.python.keras import keras_flavor
from kfac.python.keras import optimizers


def load_model(filepath, custom_objects=None, compile=True, **kwargs):  # pylint: disable=redefined-builtin
  """keras.saving.load_model with Kfac registered and wired to the model.

  Args:
    filepath: a `.keras` file written by model.save(...).
    custom_objects: extra custom objects, as for keras.saving.load_model.
    compile: False loads the model without its optimizer.
    **kwargs: passed on to the Keras loader.

  Returns:
    The model, compiled with its restored Kfac optimizer (when compile).
  """
  keras = keras_flavor.keras_module()
  objects = {"Kfac": optimizers.Kfac, "kfac>Kfac": optimizers.Kfac}
  objects.update(custom_objects or {})
  model = keras.saving.load_model(filepath, custom_objects=objects,
                                  compile=compile, **kwargs)
  optimizer = getattr(model, "optimizer", None)
  if isinstance(optimizer, optimizers.KfacKerasMixin):
    if optimizer.model is None:
      optimizer.register_model(model)
  return model
