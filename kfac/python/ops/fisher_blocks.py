"""Fisher blocks: one layer's curvature approximation, built from factors.

This module gathers the block families, each defined in a module of its own:
block_base (the block interface, Kronecker and elementwise-diagonal blocks),
dense_blocks, generic_blocks and one module per layer family (conv,
embedding, multi_use, scale_shift). Import blocks from here.
"""

# pylint: disable=unused-import,g-multiple-import
from kfac.python.ops.layers.base.blocks import FisherBlock, KroneckerProductFB
from kfac.python.ops.layers.dense.blocks import (FullyConnectedDiagonalFB,
                                          FullyConnectedKFACBasicFB)
from kfac.python.ops.layers.generic.blocks import NaiveDiagonalFB, NaiveFullFB

# Each family module lists its public classes in __all__.
from kfac.python.ops.layers.conv.blocks import *  # pylint: disable=wildcard-import
from kfac.python.ops.layers.embedding.blocks import *  # pylint: disable=wildcard-import
from kfac.python.ops.layers.multi_use.blocks import *  # pylint: disable=wildcard-import
from kfac.python.ops.layers.scale_shift.blocks import *  # pylint: disable=wildcard-import

# ---------------------------------------------------------------------------
# Old module-level names (kfac 0.2.x); set_global_constants accepts the old
# call and warns or raises for values we do not offer
# (compat_utils/legacy_constants.py).
# pylint: disable=g-import-not-at-top,g-multiple-import
from kfac.python.ops.compat_utils.block_helpers import (
    PI_OFF_NAME, PI_TRACENORM_NAME, PackagedFunc, compute_pi_adjusted_damping,
    compute_pi_tracenorm, conv2d_filter_to_depthwise_conv2d_filter,
    depthwise_conv2d_filter_to_conv2d_filter, maybe_tuple, normalize_damping)
from kfac.python.ops.compat_utils.legacy_constants import (
    set_fisher_blocks_constants as set_global_constants)

NORMALIZE_DAMPING_POWER = 1.0
PI_TYPE = PI_TRACENORM_NAME

# kfac 0.2.x's full generic block base class; its only full block is
# NaiveFullFB (isinstance(block, FullFB) holds for generic "full" blocks).
FullFB = NaiveFullFB
# Likewise kfac 0.2.x's diagonal base class: the generic diagonal block.
DiagonalFB = NaiveDiagonalFB
