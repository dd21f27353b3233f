"""kfac 0.2.4's module path of the Fisher estimator (kfac.estimator).

The estimator lives in the `estimation` package (estimation/estimator.py
and its parts; the placement strategies' classes and
`make_fisher_estimator` in estimation/strategies.py); this module keeps the
old import path for users.
"""

import tensorflow as tf

from kfac.python.ops import placement
from kfac.python.ops.tensors import utils
from kfac.python.ops.estimation.estimator import FisherEstimator
from kfac.python.ops.estimation.strategies import (
    FisherEstimatorReplicaRoundRobin)
from kfac.python.ops.estimation.strategies import FisherEstimatorRoundRobin
from kfac.python.ops.estimation.strategies import estimator_class
from kfac.python.ops.estimation.strategies import make_fisher_estimator
from kfac.python.ops.estimation.estimator import UpdateOps
