"""kfac 0.2.4's module path `kfac.keras.optimizers` (thin): `Kfac`, K-FAC
as a Keras optimizer, defined in kfac/python/keras/optimizer/."""

# pylint: disable=unused-import
from kfac.python.keras.optimizer.mixin import _MUTABLE_HYPER_PARAMS
from kfac.python.keras.optimizer.mixin import Kfac
from kfac.python.keras.optimizer.mixin import kfac_class
from kfac.python.keras.optimizer.mixin import KfacKerasMixin
from kfac.python.keras.optimizer.mixin import MUTABLE_HYPERPARAMETERS

__all__ = ["Kfac", "kfac_class", "MUTABLE_HYPERPARAMETERS"]
