"""Grouped convolutions: KFC block-diagonal over groups.

A grouped convolution with G groups has a filter [k1, ..., kd, C/G, O]
applied to inputs with C channels: output channel o belongs to group
j = o // (O/G) and sees only the input channels of group j
(j*C/G .. (j+1)*C/G - 1). Its parameters split into G independent dense
maps (group j: patches of its input channels, K*C/G(+1) entries, to its O/G
outputs), and `GroupedConvKFCBasicFB` ("kron") gives each its own KFC
block: blockdiag_j L * (A_j (x) G_j), with

  A_j = mean over (n, t) of [p_{n,t,j}; 1][p_{n,t,j}; 1]^T
        (p_{n,t,j}: the patch of group j's input channels, ordered (tap,
        channel) like reshape(filter, [K*C/G, O])),
  G_j = sum_s w_s mean over (n, t) of g_{n,t,j} g_{n,t,j}^T
        (g_{n,t,j}: the gradients of group j's O/G outputs),

L the output locations per example (KFAC-expand). The cross-group blocks
of the Fisher are dropped (no coupling assumed across groups, as K-FAC drops
the coupling across layers). With G = 1 this is the ordinary KFC block
(ConvKFCBasicFB). Damping: each group's damped block is
L * (A_j (x) G_j + damping / L), split with that group's pi
(depthwise_factors.per_channel_pi_damping_funcs). Factors are batches of G
matrices (depthwise_factors._BatchedSquareFactor): one batched
eigendecomposition / Cholesky per inverse update.
"""

import numpy as np
import tensorflow as tf

from kfac.python.ops.layers.base import blocks as block_base
from kfac.python.ops.layers.base import damping as damping_lib
from kfac.python.ops.layers.base.blocks import KroneckerProductFB
from kfac.python.ops.layers.base.blocks import LayerTowersFB
from kfac.python.ops.layers.conv import depthwise_factors
from kfac.python.ops.layers.conv import patches as patches_lib
from kfac.python.ops.layers.conv import statistics
from kfac.python.ops.layers.conv.statistics import concat_channels_last
from kfac.python.ops.layers.conv.statistics import conv_spec
from kfac.python.ops.tensors import utils

__all__ = [
    "GroupedConvInputKroneckerFactor",
    "GroupedConvOutputKroneckerFactor",
    "GroupedConvKFCBasicFB",
]


class GroupedConvInputKroneckerFactor(
    depthwise_factors._BatchedSquareFactor):  # pylint: disable=protected-access
  """Per-group patch second moments [G, K*C/G(+1), K*C/G(+1)] (see the
  module docstring)."""

  def __init__(self, inputs, filter_shape, groups, padding="VALID",
               strides=None, dilations=None, data_format=None,
               has_bias=False, name=None):
    self._inputs = utils.ensure_sequence(inputs)
    self._spec = conv_spec(filter_shape, padding, strides, dilations,
                           data_format)
    self._batch = int(groups)
    self._group_channels = int(filter_shape[-2])
    self._has_bias = has_bias
    self._patch_size = self._spec.num_taps * self._group_channels
    self._n = self._patch_size + (1 if has_bias else 0)
    super().__init__(name=name)

  @property
  def _dtype(self):
    return self._inputs[0].dtype

  def _compute_new_cov(self):
    x = concat_channels_last(self._inputs, self._spec.channels_first)
    p = patches_lib.extract_patches(x, self._spec)
    # [rows, K, G, C/G] -> [G, rows, K*C/G]: group j's patch in (tap,
    # channel) order.
    p = tf.reshape(p, [-1, self._spec.num_taps, self._batch,
                       self._group_channels])
    p = tf.reshape(tf.transpose(p, [2, 0, 1, 3]),
                   [self._batch, -1, self._patch_size])
    if self._has_bias:
      p = tf.concat([p, tf.ones_like(p[:, :, :1])], axis=2)
    rows = tf.cast(tf.shape(p)[1], p.dtype)
    return tf.einsum("grk,grj->gkj", p, p) / rows


class GroupedConvOutputKroneckerFactor(
    depthwise_factors.DepthwiseConvOutputKroneckerFactor):
  """Per-group output-gradient second moments [G, O/G, O/G]: output
  channel j*O/G + m is output m of group j, the layout of a depthwise
  conv's outputs with G channels and multiplier O/G."""

  def __init__(self, outputs_grads, groups, out_channels, data_format=None,
               weights=None, name=None):
    super().__init__(outputs_grads, groups, int(out_channels) // int(groups),
                     data_format, weights, name)


class GroupedConvKFCBasicFB(LayerTowersFB, KroneckerProductFB):
  """blockdiag over groups j of L * (A_j (x) G_j); see the module
  docstring. Vectors are (filter [k.., C/G, O], bias [O]) or a filter."""

  def __init__(self, layer_collection, params, groups, padding, strides=None,
               dilation_rate=None, data_format=None):
    super().__init__(layer_collection, params)
    self._has_bias = isinstance(params, (list, tuple))
    self._filter_shape = tuple(
        int(n) for n in utils.ensure_sequence(params)[0].shape)
    self._groups = int(groups)
    self._out_per_group = self._filter_shape[-1] // self._groups
    self._spec = patches_lib.make_conv_spec(
        self._filter_shape[:-2], strides, dilation_rate, padding, data_format)
    self._input_factor = None
    self._output_factor = None
    self._init_towers()

  @property
  def groups(self):
    return self._groups

  @property
  def _data_format(self):
    return "channels_first" if self._spec.channels_first else "channels_last"

  @property
  def num_locations(self):
    out = self._outputs[0]
    if self._spec.channels_first:
      return utils.dims_product(out, 2, out.shape.rank)
    return utils.dims_product(out, 1, -1)

  @property
  def _renorm_coeff(self):
    return self.num_locations

  def instantiate_factors(self, grads_list, damping, weights=None):
    self._input_factor = self._make_factor(
        GroupedConvInputKroneckerFactor,
        (tuple(self._inputs), self._filter_shape, self._groups,
         self._spec.padding, self._spec.strides, self._spec.dilations,
         self._data_format, self._has_bias), "A")
    weights = None if weights is None else tuple(weights)
    self._output_factor = self._make_factor(
        GroupedConvOutputKroneckerFactor,
        (tuple(tuple(g) for g in grads_list), self._groups,
         self._filter_shape[-1], self._data_format, weights), "G")
    self._damping_func = damping_lib.as_damping_func(damping)
    self._in_damping, self._out_damping = block_base.kronecker_damping_funcs(
        self.curvature_options, self._input_factor, self._output_factor,
        self._damping_func, self.num_locations,
        depthwise_factors.per_channel_pi_damping_funcs)

  def _to_mat(self, vector):
    """[G, K*C/G(+1), O/G]: one matrix per group (bias row last)."""
    parts = utils.ensure_sequence(vector)
    if len(parts) != (2 if self._has_bias else 1):
      raise ValueError("Block %s takes %s vectors." % (
          self.name, "(filter, bias)" if self._has_bias else "filter"))
    g, m = self._groups, self._out_per_group
    view = tf.reshape(parts[0], [-1, g, m])
    if self._has_bias:
      view = tf.concat([view, tf.reshape(parts[1], [1, g, m])], axis=0)
    return tf.transpose(view, [1, 0, 2])

  def _from_mat(self, mat, template):
    view = tf.transpose(mat, [1, 0, 2])
    if self._has_bias:
      w, b = template
      return (tf.reshape(view[:-1], tf.shape(w)),
              tf.reshape(view[-1], tf.shape(b)))
    return tf.reshape(view, tf.shape(template))

  def _param_permutation(self):
    """perm[i] = position of flat parameter i in the group-major (group,
    row, output) order of the block-diagonal matrix."""
    rows = (self._spec.num_taps * self._filter_shape[-2] +
            (1 if self._has_bias else 0))
    g, m = self._groups, self._out_per_group
    grid = np.arange(g * rows * m).reshape(g, rows, m)
    return np.transpose(grid, [1, 0, 2]).reshape(-1)

  def full_fisher_block(self):
    self._check_instantiated()
    dense = statistics.block_diag_kron(
        tf.convert_to_tensor(self._input_factor.get_cov()),
        tf.convert_to_tensor(self._output_factor.get_cov()),
        self._param_permutation())
    return self._scaled(dense, 1)
