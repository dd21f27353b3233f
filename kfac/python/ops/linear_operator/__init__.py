"""Linear operators of kfac (kfac.linear_operator).

`CurvatureOperator` is K-FAC's (damped) block-diagonal curvature
approximation of a registered model as a `tf.linalg.LinearOperator` over
the flattened parameters (from an estimator's statistics, or from one pass
over a dataset: `CurvatureOperator.from_data`); `ExactCurvatureOperator`
is the exact Fisher / GGN / Hessian in the same interface. See
docs/linear_operator.md.

`LinearOperatorFullMatrix` and `LinearOperatorDiag` are the operators of the
old library's public module of this name: tf.linalg operators that also
multiply from the right (`matmul_right`) and multiply `tf.IndexedSlices`
(sparse rows, as embedding gradients come) without densifying them.
"""

import tensorflow as tf

from kfac.python.ops.linear_operator.sparse_aware import LinearOperatorDiag
from kfac.python.ops.linear_operator.sparse_aware import LinearOperatorExtras
from kfac.python.ops.linear_operator.sparse_aware import (
    LinearOperatorFullMatrix)

from kfac.python.ops.linear_operator.curvature import CurvatureOperator
from kfac.python.ops.linear_operator.exact import ExactCurvatureOperator
from kfac.python.ops.linear_operator.curvature import curvature_from_data
from kfac.python.ops.linear_operator.spectral import EigenvalueDamping
from kfac.python.ops.linear_operator.spectral import SpectralView
from kfac.python.ops.linear_operator.spectral import spectral_view

# The old module's name for tf.linalg (old code reads
# kfac.linear_operator.linalg.LinearOperator...).
linalg = tf.linalg

__all__ = ["LinearOperatorExtras", "LinearOperatorFullMatrix",
           "LinearOperatorDiag", "CurvatureOperator", "ExactCurvatureOperator",
           "curvature_from_data", "EigenvalueDamping", "SpectralView",
           "spectral_view"]
