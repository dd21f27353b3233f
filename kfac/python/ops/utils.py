"""kfac 0.2.x's `kfac.utils` (kfac.python.ops.utils): a thin module of names.

The tensor helpers live in `tensors/utils.py`; the rest of the old module's
public names in `compat_utils/` (one concept per module), `numerics/linalg.py`
and `layers/conv/patches.py`. kfac's own modules import those; this is
the old import path, kept for users (kfac.utils is this module).
"""
# pylint: disable=unused-import
from kfac.python.ops.tensors.utils import (
    is_tensor_or_variable,
    ensure_sequence,
    hashable_key,
    variable_name,
    state_name,
    append_homog,
    tensors_to_column,
    column_to_tensors,
    mat_to_params,
    params_to_mat,
    inner_product,
    batch_size,
    is_python_number,
    scalar_identity,
    zeros_like_if_none,
    cast,
    dims_product,
    exclude_from_autograph,
    cond_op,
    in_xla_context,
)
# pylint: disable=g-import-not-at-top,wrong-import-position,unused-import
from kfac.python.ops.compat_utils.accumulators import AccumulatorVariable
from kfac.python.ops.compat_utils.accumulators import MovingAverageVariable
from kfac.python.ops.compat_utils.batch_execute import batch_execute
from kfac.python.ops.compat_utils.forward_gradients import fwd_gradients
from kfac.python.ops.compat_utils.introspection import cls_name
from kfac.python.ops.compat_utils.introspection import get_shape
from kfac.python.ops.compat_utils.introspection import is_reference_variable
from kfac.python.ops.compat_utils.introspection import multiline_print
from kfac.python.ops.compat_utils.layer_params import layer_params_to_mat2d
from kfac.python.ops.compat_utils.layer_params import mat2d_to_layer_params
from kfac.python.ops.compat_utils.legacy_constants import LegacyConstantWarning
from kfac.python.ops.compat_utils.legacy_constants import (
    set_utils_constants as set_global_constants)
from kfac.python.ops.compat_utils.list_algebra import (
    assert_variables_match_pairs_list, ip, ip_p, sprod, sprod_p, sum_, sum_p)
from kfac.python.ops.compat_utils.partitioned_tensor import PartitionedTensor
from kfac.python.ops.compat_utils.replication import (
    all_average, all_sum, generate_random_signs, get_num_replicas,
    get_replica_id, get_tf_replicator, is_replicated, is_tpu_replicated,
    map_gather, preferred_int_dtype, smart_assign, smart_cond)
from kfac.python.ops.compat_utils.sequence_dict import SequenceDict
from kfac.python.ops.compat_utils.sparse_matmul import matmul_diag_sparse
from kfac.python.ops.compat_utils.sparse_matmul import matmul_sparse_dense
from kfac.python.ops.compat_utils.subgraph import SubGraph
from kfac.python.ops.numerics.linalg import (
    cholesky, kronecker_product, posdef_eig, posdef_eig_functions,
    posdef_eig_self_adjoint, posdef_eig_svd, posdef_inv, posdef_inv_cholesky,
    posdef_inv_eig, posdef_inv_functions, posdef_inv_matrix_inverse)
from kfac.python.ops.layers.conv.patches import (
    extract_convolution_patches, extract_pointwise_conv2d_patches,
    is_data_format_channel_last, num_conv_locations)

# The methods the old module-level knobs selected; here fixed defaults of
# posdef_inv(method=...) / posdef_eig(method=...).
POSDEF_INV_METHOD = "cholesky"
POSDEF_EIG_METHOD = "self_adjoint"
