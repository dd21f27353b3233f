"""kfac.keras: the Keras integration (kfac.python.keras under its public
name). `import kfac.keras.optimizers` and `kfac.keras.optimizers.Kfac` both
work."""

import sys as _sys

from kfac.python.keras import callbacks
from kfac.python.keras import optimizers
from kfac.python.keras import saving_utils
from kfac.python.keras import utils

for _name, _module in (("callbacks", callbacks), ("optimizers", optimizers),
                       ("saving_utils", saving_utils), ("utils", utils)):
  _sys.modules[__name__ + "." + _name] = _module
del _name, _module
