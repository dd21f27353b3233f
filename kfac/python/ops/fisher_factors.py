"""Fisher factors: one statistic each, its moving average and its inverses.

This module gathers the factor families, each defined in a module of its own:
factor_base (the moving average, dense and diagonal factors and their cached
inverses), dense_factors, generic_factors, and one module per layer family (conv,
embedding, multi_use, scale_shift). Import factors from here.
"""

# pylint: disable=unused-import,g-multiple-import
from kfac.python.ops.layers.base.factors import (DenseSquareFactor, DiagonalFactor,
                                         FisherFactor)
from kfac.python.ops.layers.dense.factors import (DiagonalKroneckerFactor,
                                           FullyConnectedDiagonalFactor,
                                           FullyConnectedKroneckerFactor)
from kfac.python.ops.layers.generic.factors import NaiveDiagonalFactor, NaiveFullFactor

# Each family module lists its public classes in __all__.
from kfac.python.ops.layers.conv.factors import *  # pylint: disable=wildcard-import
from kfac.python.ops.layers.conv.sua_factor import *  # pylint: disable=wildcard-import
from kfac.python.ops.layers.conv.depthwise_factors import *  # pylint: disable=wildcard-import
from kfac.python.ops.layers.embedding.factors import *  # pylint: disable=wildcard-import
from kfac.python.ops.layers.multi_use.factors import *  # pylint: disable=wildcard-import
from kfac.python.ops.layers.scale_shift.factors import *  # pylint: disable=wildcard-import

# ---------------------------------------------------------------------------
# Old module-level names (kfac 0.2.x). The old global constants are fixed
# behaviour here; set_global_constants accepts the old call and warns or
# raises for values we do not offer (compat_utils/legacy_constants.py).
from kfac.python.ops.compat_utils.factor_helpers import append_homog  # pylint: disable=g-import-not-at-top
from kfac.python.ops.compat_utils.factor_helpers import compute_cov  # pylint: disable=g-import-not-at-top
from kfac.python.ops.compat_utils.factor_helpers import maybe_place_on_device  # pylint: disable=g-import-not-at-top
from kfac.python.ops.compat_utils.factor_helpers import list_to_string  # pylint: disable=g-import-not-at-top
from kfac.python.ops.compat_utils.factor_helpers import scalar_or_tensor_to_string  # pylint: disable=g-import-not-at-top
from kfac.python.ops.compat_utils.factor_helpers import scope_string_from_name  # pylint: disable=g-import-not-at-top
from kfac.python.ops.compat_utils.factor_helpers import scope_string_from_params  # pylint: disable=g-import-not-at-top
from kfac.python.ops.compat_utils.legacy_constants import (  # pylint: disable=g-import-not-at-top
    set_fisher_factors_constants as set_global_constants)

DenseSquareMatrixFactor = DenseSquareFactor  # the old name of the base class

INIT_COVARIANCES_AT_ZERO = True
ZERO_DEBIAS = True
INIT_INVERSES_AT_ZERO = True
EIGENVALUE_DECOMPOSITION_THRESHOLD = 4
EIGENVALUE_CLIPPING_THRESHOLD = 0.0
ASSUME_ZERO_MEAN_ACTIVATIONS = False
SUBTRACT_MEAN_CONTRIB_FROM_COV = True
TOWER_STRATEGY = "concat"
