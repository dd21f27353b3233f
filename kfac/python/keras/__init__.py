"""K-FAC for Keras: kfac.keras.optimizers.Kfac and its helpers."""

from kfac.python.keras import callbacks
from kfac.python.keras import optimizers
from kfac.python.keras import saving_utils
from kfac.python.keras import utils
