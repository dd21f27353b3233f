"""Fisher factors: one statistic each, its moving average and its inverses.

This module gathers the factor families, each defined in a module of its own:
factor_base (the moving average, dense and diagonal factors and their cached
inverses), dense_factors, generic_factors, and one module per layer family (conv,
embedding, multi_use, scale_shift). Import factors from here.
"""

# pylint: disable=unused-import,g-multiple-import
from kfac.python.ops.factor_base import (DenseSquareFactor, DiagonalFactor,
                                         FisherFactor)
from kfac.python.ops.dense_factors import (DiagonalKroneckerFactor,
                                           FullyConnectedDiagonalFactor,
                                           FullyConnectedKroneckerFactor)
from kfac.python.ops.generic_factors import NaiveDiagonalFactor, NaiveFullFactor

# Each family module lists its public classes in __all__.
from kfac.python.ops.conv_factors import *  # pylint: disable=wildcard-import
from kfac.python.ops.embedding_factors import *  # pylint: disable=wildcard-import
from kfac.python.ops.multi_use_factors import *  # pylint: disable=wildcard-import
from kfac.python.ops.scale_shift_factors import *  # pylint: disable=wildcard-import
