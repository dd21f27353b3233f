"""Blocks of convolution layers.

Parameters of a convolution with filter W [k1, ..., kd, C, O] (and bias b
[O]) are viewed as the matrix [K*C(+1), O] = [reshape(W, [K*C, O]); b]
(K = k1*...*kd), the same row-major order as the flattened (W, b) vector.
Notation and statistics are defined in layers/conv/factors.py; L is the number of
output locations per example.

* `ConvKFCBasicFB` ("kron"): KFC (Grosse & Martens 2016), the block
  L * (A (x) G) with A, G averages over examples and locations
  (KFAC-expand). Damping is normalised by L and split with the pi rule, so
  the damped block is L * (A (x) G + damping / L) up to the pi split
  (see block_base.KroneckerProductFB). With
  `use_sua_approx_for_input_factor` ("kron_sua") A is the SUA factor.
* `ConvKFCReduceFB` ("kron_reduce"): KFAC-reduce (Eschenhagen et al.
  2023), coefficient 1 with the reduce factors.
* `ConvDiagonalFB` ("diagonal"): the exact diagonal.
* `ConvKFCBasicMultiIndepFB` ("kron_indep" for a conv used several times):
  factors over all uses, coefficient L * num_uses.
* `DepthwiseConvDiagonalFB`: exact diagonal of a depthwise conv.
* `DepthwiseConvKFCBasicFB`: per-channel KFC of a depthwise conv: the
  block-diagonal (over input channels c) matrix with blocks
  L * (A_c (x) G_c), damping normalised by L and split with one pi per
  channel. It drops the cross-channel blocks of the Fisher.
"""

import numpy as np
import tensorflow as tf

from kfac.python.ops.layers.base import block_diagonal
from kfac.python.ops.layers.base import blocks as block_base
from kfac.python.ops.layers.conv import depthwise_factors
from kfac.python.ops.layers.conv import factors as conv_factors
from kfac.python.ops.layers.conv import sua_factor
from kfac.python.ops.layers.base import damping as damping_lib
from kfac.python.ops.layers.conv import patches as patches_lib
from kfac.python.ops.layers.conv import statistics
from kfac.python.ops.tensors import utils
from kfac.python.ops.layers.base.blocks import ElementwiseDiagonalFB
from kfac.python.ops.layers.base.blocks import LayerTowersFB
from kfac.python.ops.layers.base.blocks import KroneckerProductFB
from kfac.python.ops.reliability import shapes

__all__ = [
    "ConvKFCBasicFB",
    "ConvKFCReduceFB",
    "ConvDiagonalFB",
    "ConvKFCBasicMultiIndepFB",
    "DepthwiseConvDiagonalFB",
    "DepthwiseConvKFCBasicFB",
]


def _num_locations(outputs, channels_first):
  """Output locations per example: an int for static shapes, else a
  scalar tensor."""
  if channels_first:
    return utils.dims_product(outputs, 2, outputs.shape.rank)
  return utils.dims_product(outputs, 1, -1)


def _as_mask_tensor(patch_mask):
  if patch_mask is None or utils.is_tensor_or_variable(patch_mask):
    return patch_mask
  return tf.constant(np.asarray(patch_mask, np.float64))


def _filter_of(params):
  return utils.ensure_sequence(params)[0]


class _ConvLayerBlock(LayerTowersFB):
  """Shared plumbing: the convolution, towers of (inputs, outputs), the
  [K*C(+1), O] matrix view of vectors."""

  def __init__(self, layer_collection, params, padding, strides=None,
               dilation_rate=None, data_format=None):
    super().__init__(layer_collection, params)
    self._has_bias = isinstance(params, (list, tuple))
    self._filter_shape = tuple(int(n) for n in _filter_of(params).shape)
    self._spec = patches_lib.make_conv_spec(
        self._filter_shape[:-2], strides, dilation_rate, padding, data_format)
    self._init_towers()

  @property
  def _data_format(self):
    return "channels_first" if self._spec.channels_first else "channels_last"

  def _conv_args(self):
    """(filter_shape, padding, strides, dilations, data_format): hashable."""
    return (self._filter_shape, self._spec.padding, self._spec.strides,
            self._spec.dilations, self._data_format)

  @property
  def num_locations(self):
    return _num_locations(self._outputs[0], self._spec.channels_first)

  def _to_mat(self, vector):
    if self._has_bias and (not isinstance(vector, (list, tuple)) or
                           len(vector) != 2):
      raise ValueError("Block %s has a bias and takes (filter, bias) vectors."
                       % self.name)
    return utils.params_to_mat(vector)

  def _from_mat(self, mat, template):
    return utils.mat_to_params(mat, template)

  @staticmethod
  def _grads_tuple(grads_list):
    return tuple(tuple(g) for g in grads_list)


def _diagonal_damping_func(block, damping):
  damping_func = damping_lib.as_damping_func(damping)
  options = block.curvature_options
  if options.normalize_damping_power == 1:
    return damping_func
  scale = options.diagonal_damping_scale(block.num_locations)
  return damping_lib.scaled_damping_func(damping_func, scale)


class ConvKFCBasicFB(_ConvLayerBlock, KroneckerProductFB):
  """KFC block of a convolution: L * (A (x) G) (see the module docstring)."""

  def __init__(self, layer_collection, params, padding, strides=None,
               dilation_rate=None, data_format=None, extract_patches_fn=None,
               sub_sample_inputs=None, sub_sample_patches=None,
               use_sua_approx_for_input_factor=False, patch_mask=None):
    del extract_patches_fn
    _ConvLayerBlock.__init__(self, layer_collection, params, padding, strides,
                             dilation_rate, data_format)
    self._sub_sample_inputs = sub_sample_inputs
    self._sub_sample_patches = sub_sample_patches
    self._use_sua = use_sua_approx_for_input_factor
    self._patch_mask = _as_mask_tensor(patch_mask)

  approx_name = "kron"

  def cheaper_variant(self, level):
    """(the exact diagonal block of the same layer, not yet instantiated,
    and "diagonal") at level 0, else None (collection/memory_fallback.py)."""
    if type(self) is not ConvKFCBasicFB or level != 0:  # pylint: disable=unidiomatic-typecheck
      return None  # (subclasses hold more than these options)
    spec = self._spec
    new = ConvDiagonalFB(
        self._layer_collection, self.params, strides=spec.strides,
        padding=spec.padding, dilations=spec.dilations,
        data_format=self._data_format, patch_mask=self._patch_mask)
    return new.take_towers_of(self), "diagonal"

  @property
  def _renorm_coeff(self):
    return self.num_locations

  def _input_tensors(self):
    return tuple(self._inputs)

  def _output_grads(self, grads_list):
    return self._grads_tuple(grads_list)

  def instantiate_factors(self, grads_list, damping, weights=None):
    inputs = self._input_tensors()
    if self._use_sua:
      self._input_factor = self._make_factor(
          sua_factor.ConvInputSUAKroneckerFactor,
          (inputs, self._filter_shape, self._has_bias, self._data_format,
           self._sub_sample_inputs), "A_sua")
    else:
      # The collection's CurvatureOptions give the default of sub-sampling
      # (kfac 0.2.x's set_global_constants(sub_sample_inputs=...)).
      sub_inputs = self._sub_sample_inputs
      if sub_inputs is None and self.curvature_options.sub_sample_inputs:
        sub_inputs = True
      filter_shape, padding, strides, dilations, fmt = self._conv_args()
      # (Kept as its diagonal blocks when the CurvatureOptions'
      # factor_block_size says so: layers/base/block_diagonal.py.)
      self._input_factor = block_diagonal.block_diagonal_factor(
          self, conv_factors.ConvInputKroneckerFactor,
          (inputs, filter_shape, padding, strides, dilations, fmt, None,
           self._has_bias, sub_inputs, self._sub_sample_patches,
           self._patch_mask), "A")
    weights = None if weights is None else tuple(weights)
    self._output_factor = block_diagonal.block_diagonal_factor(
        self, conv_factors.ConvOutputKroneckerFactor,
        (self._output_grads(grads_list), self._data_format, weights), "G")
    self._setup_damping(damping)


class ConvKFCReduceFB(_ConvLayerBlock, KroneckerProductFB):
  """KFAC-reduce block of a convolution: A_reduce (x) G_reduce, coefficient
  1 (exact for deep linear networks whose loss sees the layer only through
  a sum/mean over locations, e.g. global average pooling)."""

  def __init__(self, layer_collection, params, padding, strides=None,
               dilation_rate=None, data_format=None, sub_sample_inputs=None,
               patch_mask=None):
    _ConvLayerBlock.__init__(self, layer_collection, params, padding, strides,
                             dilation_rate, data_format)
    self._sub_sample_inputs = sub_sample_inputs
    self._patch_mask = _as_mask_tensor(patch_mask)

  def instantiate_factors(self, grads_list, damping, weights=None):
    filter_shape, padding, strides, dilations, fmt = self._conv_args()
    self._input_factor = self._make_factor(
        conv_factors.ConvInputReduceKroneckerFactor,
        (tuple(self._inputs), filter_shape, padding, strides, dilations, fmt,
         self._has_bias, self._sub_sample_inputs, self._patch_mask),
        "A_reduce")
    weights = None if weights is None else tuple(weights)
    self._output_factor = self._make_factor(
        conv_factors.ConvOutputReduceKroneckerFactor,
        (self._grads_tuple(grads_list), fmt, weights), "G_reduce")
    self._setup_damping(damping)


class ConvDiagonalFB(ElementwiseDiagonalFB, _ConvLayerBlock):
  """Exact diagonal of a conv layer's Fisher, plus damping."""

  def __init__(self, layer_collection, params, strides, padding,
               data_format=None, dilations=None, patch_mask=None):
    _ConvLayerBlock.__init__(self, layer_collection, params, padding, strides,
                             dilations, data_format)
    self._patch_mask = _as_mask_tensor(patch_mask)
    self._factor = None

  def instantiate_factors(self, grads_list, damping, weights=None):
    filter_shape, padding, strides, dilations, fmt = self._conv_args()
    weights = None if weights is None else tuple(weights)
    self._factor = self._make_factor(
        conv_factors.ConvDiagonalFactor,
        (tuple(self._inputs), self._grads_tuple(grads_list), filter_shape,
         strides, padding, fmt, dilations, self._has_bias, weights,
         self._patch_mask), "diag")
    self._damping_func = self.damping_func_for(damping)

  def damping_func_for(self, damping):
    """The damping added to the diagonal: damping * L^(1-p) (L locations,
    p the collection's normalize_damping_power; damping itself for p = 1,
    the default), kfac 0.2.x's ConvDiagonalFB."""
    return _diagonal_damping_func(self, damping)

  def _to_view(self, vector):
    return self._to_mat(vector)

  def _from_view(self, view, template):
    return self._from_mat(view, template)


class ConvKFCBasicMultiIndepFB(ConvKFCBasicFB):
  """KFC block of a convolution used num_uses times with the same filter
  ("kron_indep"): A and G average over examples, uses and locations, and
  the block is L * num_uses * (A (x) G) (uses treated like extra
  locations, i.e. independent).

  Towers: `register_additional_tower(inputs, outputs)` takes lists over
  uses of [batch, ...] tensors, or single tensors [num_uses * batch, ...]
  (the uses folded into the batch, use-major) when `num_uses` was given.
  """

  def __init__(self, layer_collection, params, padding, strides=None,
               dilation_rate=None, data_format=None, extract_patches_fn=None,
               num_uses=None):
    ConvKFCBasicFB.__init__(self, layer_collection, params, padding, strides,
                            dilation_rate, data_format, extract_patches_fn)
    self._num_uses = num_uses

  @property
  def num_uses(self):
    return self._num_uses

  def register_additional_tower(self, inputs, outputs):
    if isinstance(inputs, (list, tuple)):
      if self._num_uses is None:
        self._num_uses = len(inputs)
      inputs, outputs = tuple(inputs), tuple(outputs)
    else:
      inputs, outputs = (inputs,), (outputs,)
    self._row_checks.extend(shapes.layer_row_checks(inputs, outputs,
                                                    self.name))
    self._inputs.append(inputs)
    self._outputs.append(outputs)

  @property
  def num_locations(self):
    return _num_locations(self._outputs[0][0], self._spec.channels_first)

  @property
  def _renorm_coeff(self):
    locs = self.num_locations
    return locs * self._num_uses

  def tensors_to_compute_grads(self):
    return tuple(t for tower in self._outputs for t in tower)

  def _input_tensors(self):
    return tuple(t for tower in self._inputs for t in tower)


# ------------------------------------------------------------ depthwise
class _DepthwiseConvBlock(LayerTowersFB):
  """Depthwise conv [k.., C, M] (optional bias [C*M]): towers and the
  [K(+1), C, M] view of vectors."""

  def __init__(self, layer_collection, params, strides, padding, rate=None,
               data_format=None):
    super().__init__(layer_collection, params)
    self._has_bias = isinstance(params, (list, tuple))
    self._filter_shape = tuple(int(n) for n in _filter_of(params).shape)
    self._channels, self._mult = self._filter_shape[-2:]
    self._spec = patches_lib.make_conv_spec(
        self._filter_shape[:-2], strides, rate, padding, data_format)
    self._init_towers()

  @property
  def _data_format(self):
    return "channels_first" if self._spec.channels_first else "channels_last"

  @property
  def num_locations(self):
    return _num_locations(self._outputs[0], self._spec.channels_first)

  def _to_kcm(self, vector):
    """[K(+1), C, M] view."""
    parts = utils.ensure_sequence(vector)
    if len(parts) != (2 if self._has_bias else 1):
      raise ValueError("Block %s takes %s vectors." % (
          self.name, "(filter, bias)" if self._has_bias else "filter"))
    view = tf.reshape(parts[0], [-1, self._channels, self._mult])
    if self._has_bias:
      view = tf.concat([view, tf.reshape(parts[1],
                                         [1, self._channels, self._mult])],
                       axis=0)
    return view

  def _from_kcm(self, view, template):
    if self._has_bias:
      w, b = template
      return (tf.reshape(view[:-1], tf.shape(w)),
              tf.reshape(view[-1], tf.shape(b)))
    return tf.reshape(view, tf.shape(template))


class DepthwiseConvDiagonalFB(ElementwiseDiagonalFB,
                              _DepthwiseConvBlock):
  """Exact diagonal of a depthwise conv layer's Fisher, plus damping."""

  def __init__(self, layer_collection, params, strides, padding, rate=None,
               data_format=None):
    _DepthwiseConvBlock.__init__(self, layer_collection, params, strides,
                                 padding, rate, data_format)
    self._factor = None

  def instantiate_factors(self, grads_list, damping, weights=None):
    weights = None if weights is None else tuple(weights)
    self._factor = self._make_factor(
        depthwise_factors.DepthwiseConvDiagonalFactor,
        (tuple(self._inputs), tuple(tuple(g) for g in grads_list),
         self._filter_shape, self._spec.strides, self._spec.padding,
         self._spec.dilations, self._data_format, self._has_bias, weights),
        "diag")
    self._damping_func = self.damping_func_for(damping)

  def damping_func_for(self, damping):
    """See ConvDiagonalFB.damping_func_for."""
    return _diagonal_damping_func(self, damping)

  def _to_view(self, vector):
    return self._to_kcm(vector)

  def _from_view(self, view, template):
    return self._from_kcm(view, template)


class DepthwiseConvKFCBasicFB(_DepthwiseConvBlock, KroneckerProductFB):
  """Per-channel KFC of a depthwise conv: blockdiag_c L * (A_c (x) G_c).

  A_c ([K(+1)]^2) is the second moment of the K taps of input channel c
  (and a ones entry for the bias), G_c ([M, M]) that of the gradients of
  the M outputs of channel c, both averaged over examples and locations.
  Each channel is the KFC block of a single-channel convolution; the
  cross-channel blocks of the Fisher are dropped. Damping: each channel's
  damped block is L * (A_c (x) G_c + damping / L), split with that
  channel's pi.
  """

  def __init__(self, layer_collection, params, strides, padding, rate=None,
               data_format=None, sub_sample_patches=None):
    _DepthwiseConvBlock.__init__(self, layer_collection, params, strides,
                                 padding, rate, data_format)
    self._sub_sample_patches = sub_sample_patches
    self._input_factor = None
    self._output_factor = None

  @property
  def _renorm_coeff(self):
    return self.num_locations

  def instantiate_factors(self, grads_list, damping, weights=None):
    self._input_factor = self._make_factor(
        depthwise_factors.DepthwiseConvInputKroneckerFactor,
        (tuple(self._inputs), self._filter_shape, self._spec.strides,
         self._spec.padding, self._spec.dilations, self._data_format,
         self._has_bias, self._sub_sample_patches), "A")
    weights = None if weights is None else tuple(weights)
    self._output_factor = self._make_factor(
        depthwise_factors.DepthwiseConvOutputKroneckerFactor,
        (tuple(tuple(g) for g in grads_list), self._channels, self._mult,
         self._data_format, weights), "G")
    self._damping_func = damping_lib.as_damping_func(damping)
    self._in_damping, self._out_damping = block_base.kronecker_damping_funcs(
        self.curvature_options, self._input_factor, self._output_factor,
        self._damping_func, self.num_locations,
        depthwise_factors.per_channel_pi_damping_funcs)

  def _to_mat(self, vector):
    """[C, K(+1), M] view: one [K(+1), M] matrix per input channel."""
    return tf.transpose(self._to_kcm(vector), [1, 0, 2])

  def _from_mat(self, view, template):
    return self._from_kcm(tf.transpose(view, [1, 0, 2]), template)

  def _param_permutation(self):
    """perm[i] = position of flat parameter i in the channel-major
    (c, k, m) order of the block-diagonal matrix."""
    k = self._spec.num_taps + (1 if self._has_bias else 0)
    c, m = self._channels, self._mult
    grid = np.arange(c * k * m).reshape(c, k, m)  # channel-major positions
    kcm = np.transpose(grid, [1, 0, 2])  # indexed [k, c, m] like the view
    return kcm.reshape(-1)

  def full_fisher_block(self):
    self._check_instantiated()
    dense = statistics.block_diag_kron(
        tf.convert_to_tensor(self._input_factor.get_cov()),
        tf.convert_to_tensor(self._output_factor.get_cov()),
        self._param_permutation())
    return self._scaled(dense, 1)
