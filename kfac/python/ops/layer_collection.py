"""kfac 0.2.4's module path of the LayerCollection (kfac.layer_collection).

The code lives in the collection/ package (kfac.python.ops.collection: the
registry core, losses, the registration check, the default collection) and
in the per-family declarations and registration functions of
layers/<family>/registration.py;
this module keeps the old path importable with every name it had.
"""

# pylint: disable=unused-import,g-bad-import-order,wildcard-import
from kfac.python.ops.layers.base.approximations import *
from kfac.python.ops.collection.default import get_default_layer_collection
from kfac.python.ops.collection.default import set_default_layer_collection
from kfac.python.ops.collection.layer_collection import _DEFAULT_APPROXIMATIONS
from kfac.python.ops.collection.layer_collection import BlocksByParams
from kfac.python.ops.collection.layer_collection import LayerCollection
from kfac.python.ops.collection.losses import sqrt_coeff
from kfac.python.ops.layers.dense.registration import (
    _FULLY_CONNECTED_APPROX_TO_BLOCK)
from kfac.python.ops.layers.generic.registration import (
    _GENERIC_APPROX_TO_BLOCK)
from kfac.python.ops.tensors.layer_params_dict import LayerParametersDict
from kfac.python.ops.layers.base.registration import RegistrationKeyError
from kfac.python.ops.layers.base.registration import VARIABLE_SCOPE
from kfac.python.ops.compat_utils.subgraph import SubGraph
from kfac.python.ops import fisher_blocks as fb
from kfac.python.ops import loss_functions as lf
from kfac.python.ops.tensors import utils
