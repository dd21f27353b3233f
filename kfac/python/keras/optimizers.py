"""kfac 0.2.4's module path `kfac.keras.optimizers` (thin): `Kfac`, K-FAC
as a Keras optimizer, defined in the package kfac/python/keras/optimizer/
(`Kfac` is the class of the Keras flavour and engine in use where it is
looked up: optimizer/classes.py)."""

# pylint: disable=unused-import
from kfac.python.keras.optimizer.engine import KfacOptimizerBase
from kfac.python.keras.optimizer.engine import MUTABLE_HYPERPARAMETERS
from kfac.python.keras.optimizer.classes import kfac_class

# kfac 0.2.x's name of the hyperparameters kept in variables, as it had them
# (weight_decay, AdamW's decoupled decay, is new: in MUTABLE_HYPERPARAMETERS).
_MUTABLE_HYPER_PARAMS = frozenset(MUTABLE_HYPERPARAMETERS) - {"weight_decay"}


def __getattr__(name):
  # `Kfac`, looked up where it is used: the class of the engine in use.
  if name == "Kfac":
    return kfac_class()
  raise AttributeError("module %r has no attribute %r" % (__name__, name))


__all__ = ["Kfac", "kfac_class", "MUTABLE_HYPERPARAMETERS"]
