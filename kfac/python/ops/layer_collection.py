"""kfac 0.2.4's module path of the LayerCollection (kfac.layer_collection).

The code lives in the collection/ package (kfac.python.ops.collection);
this module keeps the old path importable with every name it had.
"""

# pylint: disable=unused-import,g-bad-import-order
from kfac.python.ops.collection.layer_collection import (
    APPROX_DIAGONAL_NAME,
    APPROX_EKFAC_NAME,
    APPROX_EKFAC_REDUCE_NAME,
    APPROX_FULL_NAME,
    APPROX_KRONECKER_BOTH_DIAG_NAME,
    APPROX_KRONECKER_IN_DIAG_NAME,
    APPROX_KRONECKER_INDEP_BOTH_DIAG_NAME,
    APPROX_KRONECKER_INDEP_IN_DIAG_NAME,
    APPROX_KRONECKER_INDEP_NAME,
    APPROX_KRONECKER_INDEP_OUT_DIAG_NAME,
    APPROX_KRONECKER_NAME,
    APPROX_KRONECKER_OUT_DIAG_NAME,
    APPROX_KRONECKER_REDUCE_NAME,
    APPROX_KRONECKER_SERIES_1_NAME,
    APPROX_KRONECKER_SERIES_2_NAME,
    APPROX_KRONECKER_SUA_NAME,
    _DEFAULT_APPROXIMATIONS,
    _FULLY_CONNECTED_APPROX_TO_BLOCK,
    _GENERIC_APPROX_TO_BLOCK,
    BlocksByParams,
    LayerCollection,
    get_default_layer_collection,
    set_default_layer_collection,
    sqrt_coeff,
)
from kfac.python.ops.tensors.layer_params_dict import LayerParametersDict
from kfac.python.ops.layers.base.registration import RegistrationKeyError
from kfac.python.ops.layers.base.registration import VARIABLE_SCOPE
from kfac.python.ops.compat_utils.subgraph import SubGraph
from kfac.python.ops import fisher_blocks as fb
from kfac.python.ops import loss_functions as lf
from kfac.python.ops.tensors import utils
