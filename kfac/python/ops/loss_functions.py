"""kfac 0.2.4's module path of the loss functions (kfac.loss_functions).

The losses live in the `losses` package (base classes in losses/base.py,
one family per module); this module keeps the old import path for users.
"""

import tensorflow as tf

from kfac.python.ops.losses.base import DistributionNegativeLogProbLoss
from kfac.python.ops.losses.base import LossFunction
from kfac.python.ops.losses.base import NaturalParamsNegativeLogProbLoss
from kfac.python.ops.losses.base import NegativeLogProbLoss
from kfac.python.ops.losses.base import insert_slice_in_zeros
from kfac.python.ops.losses.bernoulli import MultiBernoulliNegativeLogProbLoss
from kfac.python.ops.losses.categorical import (
    CategoricalLogitsNegativeLogProbLoss)
from kfac.python.ops.losses.categorical import (
    OnehotCategoricalLogitsNegativeLogProbLoss)
from kfac.python.ops.losses.normal import NormalMeanNegativeLogProbLoss
from kfac.python.ops.losses.normal import (
    NormalMeanVarianceNegativeLogProbLoss)
