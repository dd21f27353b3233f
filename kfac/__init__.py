"""K-FAC (Kronecker-factored approximate curvature) for TensorFlow 2.16+.

Keeps the public interface of the TensorFlow K-FAC library (kfac 0.2.x,
formerly tf.contrib.kfac) and runs in TF1-style Session graphs and inside
TF2 tf.function training steps.
"""

try:
  import tensorflow as _tf  # pylint: disable=unused-import
except ModuleNotFoundError as _error:
  if _error.name != "tensorflow":
    raise
  # TensorFlow is an extra (it comes as tensorflow or tensorflow-cpu), so a
  # misspelled or forgotten extra installs kfac without it.
  raise ModuleNotFoundError(
      "kfac needs TensorFlow (2.16 or newer), which is not installed here. "
      "Install it with kfac: pip install \"kfac[tensorflow-cpu]\" (CPU "
      "only) or \"kfac[tensorflow]\"; from a source tree: pip install -e "
      "\".[tensorflow-cpu]\". (pip older than 23.3 ignores the spelling "
      "\"tensorflow_cpu\" with a warning.)", name="tensorflow") from None
del _tf

from kfac.python.ops.schedules import batch_size as batch_size_schedules
from kfac.python.ops import curvature_matrix_vector_products
from kfac.python.ops.data import data_reader
from kfac.python.ops.data import data_reader_alt
from kfac.python.ops import ekfac
from kfac.python.ops import estimator
from kfac.python.ops import fisher_blocks
from kfac.python.ops import fisher_factors
from kfac.python.ops import layer_collection
from kfac.python.ops import linear_operator
from kfac.python.ops import loss_functions
from kfac.python.ops import op_queue
from kfac.python.ops import optimizer
from kfac.python.ops import placement
from kfac.python.ops.schedules import hyperparameters as schedules
from kfac.python.ops.tensors import state
from kfac.python.ops import utils
from kfac.python.ops.kfac_utils import async_inv_cov_update_kfac_opt
from kfac.python.ops.kfac_utils import periodic_inv_cov_update_kfac_opt
from kfac.python.ops.tensormatch import graph_matcher
from kfac.python.ops.tensormatch import graph_search

LayerCollection = layer_collection.LayerCollection
CurvatureMatrixVectorProductComputer = (
    curvature_matrix_vector_products.CurvatureMatrixVectorProductComputer)
KfacOptimizer = optimizer.KfacOptimizer
StateStore = state.StateStore
PeriodicInvCovUpdateKfacOpt = (
    periodic_inv_cov_update_kfac_opt.PeriodicInvCovUpdateKfacOpt)
AsyncInvCovUpdateKfacOpt = (
    async_inv_cov_update_kfac_opt.AsyncInvCovUpdateKfacOpt)

__version__ = "0.3.0.dev0"

# `import kfac.estimator` (and the other submodules below) works as well as
# attribute access: the modules are registered under their kfac.* names.
import sys as _sys  # pylint: disable=g-import-not-at-top,g-bad-import-order
for _name in ("batch_size_schedules", "curvature_matrix_vector_products",
              "data_reader", "data_reader_alt", "ekfac", "estimator",
              "fisher_blocks",
              "fisher_factors", "layer_collection", "linear_operator",
              "loss_functions", "op_queue", "optimizer",
              "periodic_inv_cov_update_kfac_opt",
              "placement", "schedules", "state", "utils",
              "async_inv_cov_update_kfac_opt", "graph_matcher",
              "graph_search"):
  _sys.modules.setdefault(__name__ + "." + _name, globals()[_name])
del _name, _sys


def __getattr__(name):
  # kfac.keras imports Keras, so it is loaded on first use only.
  if name == "keras":
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module("kfac.keras")
  raise AttributeError("module 'kfac' has no attribute %r" % name)

__all__ = [
    "LayerCollection", "KfacOptimizer", "PeriodicInvCovUpdateKfacOpt",
    "AsyncInvCovUpdateKfacOpt",
    "CurvatureMatrixVectorProductComputer", "batch_size_schedules",
    "curvature_matrix_vector_products", "data_reader", "data_reader_alt",
    "schedules", "estimator", "fisher_blocks", "fisher_factors", "layer_collection",
    "linear_operator", "loss_functions", "op_queue", "optimizer", "placement", "state", "utils", "StateStore",
    "graph_matcher", "graph_search", "keras",
]
