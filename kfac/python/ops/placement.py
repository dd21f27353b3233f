"""kfac 0.2.4's module path of the device placement strategies
(kfac.placement).

The placement mixins live in estimation/placement.py and the estimator
classes that use them in estimation/strategies.py; this module keeps the
old import path (and the other names of the estimator classes) for users.
"""

import tensorflow as tf

from kfac.python.ops.estimation.placement import PLACEMENT_KWARGS
from kfac.python.ops.estimation.placement import ReplicaRoundRobinPlacementMixin
from kfac.python.ops.estimation.placement import RoundRobinPlacementMixin
from kfac.python.ops.estimation.strategies import (
    FisherEstimatorReplicaRoundRobin)
from kfac.python.ops.estimation.strategies import FisherEstimatorRoundRobin
from kfac.python.ops.estimation.strategies import estimator_class

RoundRobinFisherEstimator = FisherEstimatorRoundRobin
ReplicaRoundRobinFisherEstimator = FisherEstimatorReplicaRoundRobin
