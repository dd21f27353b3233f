"""kfac 0.2.4's module path of the loss functions (kfac.loss_functions).

The losses live in the `losses` package; this module keeps the old import
path for users.
"""

import tensorflow as tf

from kfac.python.ops.losses.base import CategoricalLogitsNegativeLogProbLoss
from kfac.python.ops.losses.base import DistributionNegativeLogProbLoss
from kfac.python.ops.losses.base import LossFunction
from kfac.python.ops.losses.base import MultiBernoulliNegativeLogProbLoss
from kfac.python.ops.losses.base import NaturalParamsNegativeLogProbLoss
from kfac.python.ops.losses.base import NegativeLogProbLoss
from kfac.python.ops.losses.base import NormalMeanNegativeLogProbLoss
from kfac.python.ops.losses.base import NormalMeanVarianceNegativeLogProbLoss
from kfac.python.ops.losses.base import (
    OnehotCategoricalLogitsNegativeLogProbLoss)
from kfac.python.ops.losses.base import insert_slice_in_zeros
