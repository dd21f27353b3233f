"""Fisher blocks: one layer's curvature approximation, built from factors.

This module gathers the block families, each defined in a module of its own:
block_base (the block interface, Kronecker and elementwise-diagonal blocks),
dense_blocks, generic_blocks and one module per layer family (conv,
embedding, multi_use, scale_shift). Import blocks from here.
"""

# pylint: disable=unused-import,g-multiple-import
from kfac.python.ops.block_base import FisherBlock, KroneckerProductFB
from kfac.python.ops.dense_blocks import (FullyConnectedDiagonalFB,
                                          FullyConnectedKFACBasicFB)
from kfac.python.ops.generic_blocks import NaiveDiagonalFB, NaiveFullFB

# Each family module lists its public classes in __all__.
from kfac.python.ops.conv_blocks import *  # pylint: disable=wildcard-import
from kfac.python.ops.embedding_blocks import *  # pylint: disable=wildcard-import
from kfac.python.ops.multi_use_blocks import *  # pylint: disable=wildcard-import
from kfac.python.ops.scale_shift_blocks import *  # pylint: disable=wildcard-import
