"""kfac 0.2.4's module path of the device placement strategies
(kfac.placement).

They live in the `estimation` package (estimation/placement.py); this
module keeps the old import path for users.
"""

import tensorflow as tf

from kfac.python.ops.estimation import placement as _placement
from kfac.python.ops.estimation.placement import PLACEMENT_KWARGS
from kfac.python.ops.estimation.placement import ReplicaRoundRobinPlacementMixin
from kfac.python.ops.estimation.placement import RoundRobinPlacementMixin
from kfac.python.ops.estimation.placement import estimator_class


def __getattr__(name):  # the estimator classes, as estimation/placement.py
  return getattr(_placement, name)
