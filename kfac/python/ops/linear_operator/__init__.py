"""Linear operators of kfac (kfac.linear_operator).

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

# The old module's name for tf.linalg (old code reads
# kfac.linear_operator.linalg.LinearOperator...).
linalg = tf.linalg

__all__ = ["LinearOperatorExtras", "LinearOperatorFullMatrix",
           "LinearOperatorDiag"]
