"""kfac 0.2.4's module path `kfac.keras.optimizers` (thin): `Kfac`, K-FAC
as a Keras optimizer, defined in the package kfac/python/keras/optimizer/."""

# pylint: disable=unused-import
from kfac.python.keras.optimizer.arguments import MUTABLE_HYPERPARAMETERS
from kfac.python.keras.optimizer.classes import Kfac
from kfac.python.keras.optimizer.classes import kfac_class
from kfac.python.keras.optimizer.mixin import KfacKerasMixin

# kfac 0.2.x's name of the hyperparameters kept in variables, as it had them
# (weight_decay, AdamW's decoupled decay, is new: in MUTABLE_HYPERPARAMETERS).
_MUTABLE_HYPER_PARAMS = frozenset(MUTABLE_HYPERPARAMETERS) - {"weight_decay"}

__all__ = ["Kfac", "kfac_class", "MUTABLE_HYPERPARAMETERS"]
