"""Transposed convolutions (tf.nn.conv_transpose; Keras Conv1DTranspose /
Conv2DTranspose / Conv3DTranspose): KFC with the patches on the output
side.

A transposed convolution with filter W [k1, ..., kd, O, C] (K = k1*...*kd
taps, O output channels, C input channels; Keras' kernel layout) maps
inputs x [N, spatial..., C] to outputs y [N, spatial'..., O]. It is the
gradient of the convolution with the same filter, strides, dilations and
padding from y's shape to x's, so input position p writes
x_p^T W[tap] to output position p * s + tap * d - pad_before. The weight
gradient of example n is therefore

  dW_n = sum_p q_{n,p} x_{n,p}^T      (as the matrix [K*O, C] = reshape(W))

with x_{n,p} the input vector (C) at position p and q_{n,p} the patch
(K*O, ordered (tap, channel) like the reshape) that the forward
convolution's patch extraction takes from the output gradient
g_n = d loss_n / d y_n at p. The roles of the conv KFC factors swap sides:
the patches are on the output-gradient side. KFC over the L input
positions per example (KFAC-expand, as ConvKFCBasicFB) gives

  F_W ~= L * (A (x) G) in the (c, tap, o) order, where
  A = mean over (n, p) of x_{n,p} x_{n,p}^T           [C, C]
  G = sum_s w_s mean over (n, p) of q_{n,p} q_{n,p}^T [K*O, K*O].

It is exact where KFC is (one example with one input position; any
independence of x and q across positions), and otherwise drops the
correlations between positions and between inputs and output gradients.

The bias b [O] is added at every output position, not at the input
positions the Kronecker factors average over (with strides > 1 or
'same' padding an output position is written by several input positions,
or none), so it has no homogeneous coordinate on either side. It gets its
own exact Fisher block instead,

  F_b = sum_s w_s mean over n of (sum_t g_{n,t})(sum_t g_{n,t})^T  [O, O]

(t over output positions; the statistic of
conv_factors.ConvOutputReduceKroneckerFactor), damped by adding the damping
to its diagonal. The coupling between W and b is dropped: the block is
blockdiag(L * (A (x) G) + damping, F_b + damping), the filter's part split
with the pi rule like every Kronecker block (damping / L per factor pair).

`ConvTransposeDiagonalFB` ("diagonal") is the exact diagonal of the
layer's Fisher over (filter, bias): sum_s w_s mean over n of the squared
per-example gradients (dW_n above, db_n = sum_t g_{n,t}), plus the
damping (times L^(1-p) with the collection's normalize_damping_power p,
as ConvDiagonalFB).
"""

import numpy as np
import tensorflow as tf

from kfac.python.ops.layers.base import damping as damping_lib
from kfac.python.ops.layers.base.blocks import ElementwiseDiagonalFB
from kfac.python.ops.layers.base.blocks import FisherBlock
from kfac.python.ops.layers.base.blocks import LayerTowersFB
from kfac.python.ops.layers.base.blocks import KroneckerProductFB
from kfac.python.ops.layers.base.factors import DenseSquareFactor
from kfac.python.ops.layers.base.factors import InputsGradsDiagonalFactor
from kfac.python.ops.layers.base.factors import weighted_sum
from kfac.python.ops.layers.conv import factors as conv_factors
from kfac.python.ops.layers.conv import patches as patches_lib
from kfac.python.ops.layers.conv.statistics import concat_channels_last
from kfac.python.ops.layers.conv.statistics import mean_outer
from kfac.python.ops.tensors import utils

__all__ = [
    "ConvTransposeInputKroneckerFactor",
    "ConvTransposeOutputKroneckerFactor",
    "ConvTransposeKFCBasicFB",
    "ExactBiasFB",
    "ConvTransposeKFCBasicBiasFB",
    "ConvTransposeDiagonalFactor",
    "ConvTransposeDiagonalFB",
]


class ConvTransposeInputKroneckerFactor(DenseSquareFactor):
  """A = mean over examples and input positions of x x^T ([C, C])."""

  def __init__(self, inputs, data_format=None, name=None):
    self._inputs = utils.ensure_sequence(inputs)
    self._channels_first = patches_lib.data_format_is_channels_first(
        data_format)
    first = self._inputs[0]
    self._n = int(first.shape[1 if self._channels_first else -1])
    DenseSquareFactor.__init__(self, name=name)

  @property
  def _dtype(self):
    return self._inputs[0].dtype

  def _compute_new_cov(self):
    x = concat_channels_last(self._inputs, self._channels_first)
    return mean_outer(tf.reshape(x, [-1, self._n]))


class ConvTransposeOutputKroneckerFactor(
    conv_factors._ConvOutputSquareFactor):  # pylint: disable=protected-access
  """G = sum_s w_s mean over (n, p) of q q^T ([K*O, K*O]): q the patches of
  the output gradients under the forward convolution `spec` (one per
  input position p)."""

  def __init__(self, outputs_grads, kernel_shape, padding, strides=None,
               dilations=None, data_format=None, weights=None, name=None):
    super().__init__(outputs_grads, data_format, weights, name=name)
    self._spec = patches_lib.make_conv_spec(tuple(kernel_shape), strides,
                                            dilations, padding, data_format)
    self._n = self._spec.num_taps * self._out

  def _compute_new_cov(self):
    terms = []
    for g in self._output_grads.tensors():
      q = patches_lib.extract_patches(g, self._spec)
      terms.append(mean_outer(tf.reshape(q, [-1, self._n])))
    return weighted_sum(terms, self._weights)


def _init_transpose_block(block, layer_collection, params, padding, strides,
                          dilation_rate, data_format):
  """The parameters, filter shape and conv spec of a transposed
  convolution's block (filter [k.., O, C], optional bias)."""
  FisherBlock.__init__(block, layer_collection, params)
  block._has_bias = isinstance(params, (list, tuple))  # pylint: disable=protected-access
  block._filter_shape = tuple(  # pylint: disable=protected-access
      int(n) for n in utils.ensure_sequence(params)[0].shape)
  block._spec = patches_lib.make_conv_spec(  # pylint: disable=protected-access
      block._filter_shape[:-2], strides, dilation_rate, padding, data_format)  # pylint: disable=protected-access


class ConvTransposeKFCBasicFB(LayerTowersFB, KroneckerProductFB):
  """The filter's KFC block L * (A (x) G) of a transposed convolution
  without bias (see the module docstring). Products act on the [C, K*O]
  view of the filter [k.., O, C] (A on the rows, G on the columns)."""

  def __init__(self, layer_collection, params, padding, strides=None,
               dilation_rate=None, data_format=None):
    _init_transpose_block(self, layer_collection, params, padding, strides,
                          dilation_rate, data_format)
    self._in_channels = self._filter_shape[-1]
    self._patch_size = self._spec.num_taps * self._filter_shape[-2]
    self._init_towers()

  @property
  def _data_format(self):
    return "channels_first" if self._spec.channels_first else "channels_last"

  @property
  def num_locations(self):
    """Input positions per example (an int when static)."""
    x = self._inputs[0]
    if self._spec.channels_first:
      return utils.dims_product(x, 2, x.shape.rank)
    return utils.dims_product(x, 1, -1)

  @property
  def _renorm_coeff(self):
    return self.num_locations

  def instantiate_factors(self, grads_list, damping, weights=None):
    self._input_factor = self._make_factor(
        ConvTransposeInputKroneckerFactor,
        (tuple(self._inputs), self._data_format), "A")
    weights = None if weights is None else tuple(weights)
    self._output_factor = self._make_factor(
        ConvTransposeOutputKroneckerFactor,
        (tuple(tuple(g) for g in grads_list), self._spec.kernel_shape,
         self._spec.padding, self._spec.strides, self._spec.dilations,
         self._data_format, weights), "G")
    self._setup_damping(damping)

  def _filter_view(self, filt):
    return tf.transpose(tf.reshape(filt, [self._patch_size,
                                          self._in_channels]))

  def _to_mat(self, vector):
    if isinstance(vector, (list, tuple)):
      raise ValueError("Block %s (a transposed convolution without bias) "
                       "takes filter vectors, got %d tensors." %
                       (self.name, len(vector)))
    return self._filter_view(vector)

  def _from_mat(self, mat, template):
    return tf.reshape(tf.transpose(mat), tf.shape(template))

  def _filter_permutation(self):
    """perm[i] = position of flat filter entry i ((tap, o, c) order) in the
    (c, tap, o) order of kron(A, G)."""
    grid = np.arange(self._in_channels * self._patch_size).reshape(
        self._in_channels, self._patch_size)
    return grid.T.reshape(-1)

  def _in_filter_order(self, block):
    """A [(c, tap, o)]^2 matrix in the filter's (tap, o, c) order."""
    perm = self._filter_permutation()
    return tf.gather(tf.gather(block, perm, axis=0), perm, axis=1)

  def full_fisher_block(self):
    return self._in_filter_order(KroneckerProductFB.full_fisher_block(self))


class ExactBiasFB(KroneckerProductFB):
  """A transposed convolution's block with the bias's exact block
  F_b + damping next to the filter's Kronecker block: vectors are
  (filter, bias) pairs, the filter part goes to the products of the filter
  block that follows this class in the bases (K-FAC's or EKFAC's). The
  block has no spectral view of its own (the curvature operator uses its
  dense products)."""

  spectral_view = None

  def instantiate_factors(self, grads_list, damping, weights=None):
    super().instantiate_factors(grads_list, damping, weights)
    self._bias_factor = self._make_factor(
        conv_factors.ConvOutputReduceKroneckerFactor,
        (tuple(tuple(g) for g in grads_list), self._data_format,
         None if weights is None else tuple(weights)), "F_bias")

  def factors(self):
    return list(super().factors()) + [self._bias_factor]

  def _split(self, vector):
    if not isinstance(vector, (list, tuple)) or len(vector) != 2:
      raise ValueError("Block %s has a bias and takes (filter, bias) "
                       "vectors." % self.name)
    return vector

  def register_matpower(self, exp):
    super().register_matpower(exp)
    self._bias_factor.register_matpower(exp, self._damping_func)

  def register_cholesky(self):
    super().register_cholesky()
    self._bias_factor.register_cholesky(self._damping_func)

  def register_cholesky_inverse(self):
    super().register_cholesky_inverse()
    self._bias_factor.register_cholesky_inverse(self._damping_func)

  def multiply_matpower(self, vector, exp):
    w, b = self._split(vector)
    col = self._bias_factor.left_multiply_matpower(
        tf.reshape(b, [-1, 1]), exp, self._damping_func)
    return (super().multiply_matpower(w, exp),
            tf.reshape(col, tf.shape(b)))

  def _multiply_cholesky(self, vector, transpose, inverse):
    w, b = self._split(vector)
    col = self._bias_factor.left_multiply_cholesky(
        tf.reshape(b, [-1, 1]), self._damping_func, transpose=transpose,
        inverse=inverse)
    return (super()._multiply_cholesky(w, transpose, inverse),
            tf.reshape(col, tf.shape(b)))

  def full_fisher_block(self):
    filt = tf.convert_to_tensor(super().full_fisher_block())
    bias = tf.convert_to_tensor(self._bias_factor.get_cov())
    return tf.linalg.LinearOperatorBlockDiag(
        [tf.linalg.LinearOperatorFullMatrix(filt),
         tf.linalg.LinearOperatorFullMatrix(tf.cast(bias, filt.dtype))]
    ).to_dense()


class ConvTransposeKFCBasicBiasFB(ExactBiasFB, ConvTransposeKFCBasicFB):
  """blockdiag(L * (A (x) G), F_b) of a transposed convolution with bias
  (see the module docstring); vectors are (filter, bias) pairs."""


class ConvTransposeDiagonalFactor(InputsGradsDiagonalFactor):
  """Exact diagonal of a transposed convolution's Fisher as the column of
  the flat (filter (tap, o, c), bias) vector: sum_s w_s mean over n of the
  squared per-example gradients."""

  def __init__(self, inputs, outputs_grads, filter_shape, padding,
               strides=None, dilations=None, data_format=None,
               has_bias=False, weights=None, name=None):
    self._spec = patches_lib.make_conv_spec(tuple(filter_shape)[:-2],
                                            strides, dilations, padding,
                                            data_format)
    self._out, self._in = int(filter_shape[-2]), int(filter_shape[-1])
    self._patch_size = self._spec.num_taps * self._out
    self._has_bias = has_bias
    size = self._patch_size * self._in + (self._out if has_bias else 0)
    # A column, the shape of the block's view of its vectors.
    super().__init__(inputs, outputs_grads, weights, [size, 1], name=name)

  def _compute_new_cov(self):
    first = self._spec.channels_first
    x = concat_channels_last(self._inputs, first)
    x = tf.reshape(x, [tf.shape(x)[0], -1, self._in])
    terms = []
    for towers in self._grads:
      g = concat_channels_last(towers, first)
      q = patches_lib.extract_patches(g, self._spec)
      q = tf.reshape(q, [tf.shape(q)[0], -1, self._patch_size])
      per_example = tf.reshape(tf.einsum("npk,npc->nkc", q, x),
                               [tf.shape(x)[0], -1])
      if self._has_bias:
        sums = tf.reduce_sum(tf.reshape(g, [tf.shape(g)[0], -1, self._out]),
                             axis=1)
        per_example = tf.concat([per_example, sums], axis=1)
      terms.append(tf.reduce_mean(tf.square(per_example), axis=0)[:, None])
    return weighted_sum(terms, self._weights)


class ConvTransposeDiagonalFB(ElementwiseDiagonalFB, LayerTowersFB):
  """Exact diagonal of a transposed convolution's Fisher, plus damping
  (see the module docstring)."""

  def __init__(self, layer_collection, params, padding, strides=None,
               dilation_rate=None, data_format=None):
    _init_transpose_block(self, layer_collection, params, padding, strides,
                          dilation_rate, data_format)
    self._factor = None
    self._init_towers()

  num_locations = ConvTransposeKFCBasicFB.num_locations

  def instantiate_factors(self, grads_list, damping, weights=None):
    fmt = "channels_first" if self._spec.channels_first else "channels_last"
    self._factor = self._make_factor(
        ConvTransposeDiagonalFactor,
        (tuple(self._inputs), tuple(tuple(g) for g in grads_list),
         self._filter_shape, self._spec.padding, self._spec.strides,
         self._spec.dilations, fmt, self._has_bias,
         None if weights is None else tuple(weights)), "diag")
    self._damping_func = self.damping_func_for(damping)

  def damping_func_for(self, damping):
    """damping * L^(1-p) (the damping itself for p = 1, the default)."""
    damping_func = damping_lib.as_damping_func(damping)
    options = self.curvature_options
    if options.normalize_damping_power == 1:
      return damping_func
    return damping_lib.scaled_damping_func(
        damping_func, options.diagonal_damping_scale(self.num_locations))

  def _to_view(self, vector):
    parts = utils.ensure_sequence(vector)
    if len(parts) != (2 if self._has_bias else 1):
      raise ValueError("Block %s takes %s vectors." % (
          self.name, "(filter, bias)" if self._has_bias else "filter"))
    return tf.concat([tf.reshape(p, [-1, 1]) for p in parts], axis=0)

  def _from_view(self, view, template):
    view = tf.reshape(view, [-1])
    if not self._has_bias:
      return tf.reshape(view, tf.shape(template))
    w, b = template
    size = int(np.prod(self._filter_shape))
    return (tf.reshape(view[:size], tf.shape(w)),
            tf.reshape(view[size:], tf.shape(b)))

