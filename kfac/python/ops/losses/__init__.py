"""The loss functions: predictive distributions and their curvature.

base.py has the bases (LossFunction, NegativeLogProbLoss, ...); the
families are categorical.py (softmax cross-entropy), bernoulli.py (sigmoid
cross-entropy) and normal.py (Gaussians: squared error), and their random
draws are in sampling.py. The package names the public classes of all of
them.
"""

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
