"""Factors of depthwise convolutions ([k.., C, M] filters, output channel
c*M + m; notation as in factors.py): `DepthwiseConvDiagonalFactor` (the
exact diagonal) and the per-channel Kronecker factors
`DepthwiseConvInputKroneckerFactor` ([C, K(+1), K(+1)]) and
`DepthwiseConvOutputKroneckerFactor` ([C, M, M]), batches of C matrices
with per-channel pi-adjusted damping (`per_channel_pi_damping_funcs`).
"""

import tensorflow as tf

from kfac.python.ops.layers.base import damping as damping_lib
from kfac.python.ops.layers.base.batched_factors import BatchedSquareFactor
from kfac.python.ops.layers.base.batched_factors import per_channel_second_moments
from kfac.python.ops.layers.base.factors import InputsGradsDiagonalFactor
from kfac.python.ops.layers.base.factors import weighted_sum
from kfac.python.ops.layers.conv import patches as patches_lib
from kfac.python.ops.layers.conv.factors import DEFAULT_PATCH_ROWS_PER_DIM
from kfac.python.ops.layers.conv.statistics import check_sub_sample
from kfac.python.ops.layers.conv.statistics import concat_channels_last
from kfac.python.ops.layers.conv.statistics import conv_spec
from kfac.python.ops.layers.conv.statistics import patch_row_budget
from kfac.python.ops.layers.conv.statistics import OutputGradSources
from kfac.python.ops.tensors import utils

__all__ = [
    "DepthwiseConvDiagonalFactor",
    "DepthwiseConvInputKroneckerFactor",
    "DepthwiseConvOutputKroneckerFactor",
]


def _depthwise_patches(x, spec, channels):
  """[N, L, K, C] patches of channels-last x."""
  p = patches_lib.extract_patches(x, spec)
  return tf.reshape(p, [tf.shape(p)[0], -1, spec.num_taps, channels])


class DepthwiseConvDiagonalFactor(InputsGradsDiagonalFactor):
  """Exact diagonal of a depthwise conv layer's Fisher, shaped [K(+1), C, M]
  (the filter [k.., C, M] viewed as [K, C, M], the bias [C*M] as the last
  row): sum_s w_s mean over n of (sum_t p_{n,t,k,c} g_{n,t,c*M+m})^2."""

  def __init__(self, inputs, outputs_grads, filter_shape, strides=None,
               padding="VALID", dilations=None, data_format=None,
               has_bias=False, weights=None, name=None):
    self._spec = conv_spec(filter_shape, padding, strides, dilations,
                           data_format)
    self._channels = int(filter_shape[-2])
    self._mult = int(filter_shape[-1])
    self._has_bias = has_bias
    super().__init__(inputs, outputs_grads, weights,
                     [self._spec.num_taps + (1 if has_bias else 0),
                      self._channels, self._mult], name=name)

  def _compute_new_cov(self):
    first = self._spec.channels_first
    p = _depthwise_patches(concat_channels_last(self._inputs, first),
                           self._spec, self._channels)
    if self._has_bias:
      p = tf.concat([p, tf.ones_like(p[:, :, :1])], axis=2)
    n = tf.cast(tf.shape(p)[0], p.dtype)
    terms = []
    for towers in self._grads:
      g = concat_channels_last(towers, first)
      g = tf.reshape(g, [tf.shape(g)[0], -1, self._channels, self._mult])
      per_example = tf.einsum("nlkc,nlcm->nkcm", p, g)
      terms.append(tf.reduce_sum(tf.square(per_example), axis=0) / n)
    return weighted_sum(terms, self._weights)


# (moved to layers/base/batched_factors.py; the conv family's name kept)
_BatchedSquareFactor = BatchedSquareFactor


class DepthwiseConvInputKroneckerFactor(_BatchedSquareFactor):
  """Per-channel patch second moments of a depthwise conv: [C, K(+1),
  K(+1)], A_c = mean over (n, t) of [p_c; 1][p_c; 1]^T where p_c are the K
  taps of input channel c.

  sub_sample_patches: None/False: all N*L patch rows. True: at most
  DEFAULT_PATCH_ROWS_PER_DIM * K(+1) random rows (without
  replacement; the same rows for every channel, each channel's A_c an
  unbiased estimate of its mean, as for ConvInputKroneckerFactor); an int
  R: at most R rows. The rows are gathered from the input directly."""

  def __init__(self, inputs, filter_shape, strides=None, padding="VALID",
               dilations=None, data_format=None, has_bias=False,
               sub_sample_patches=None, name=None):
    self._inputs = utils.ensure_sequence(inputs)
    self._spec = conv_spec(filter_shape, padding, strides, dilations,
                           data_format)
    self._batch = int(filter_shape[-2])
    self._has_bias = has_bias
    self._n = self._spec.num_taps + (1 if has_bias else 0)
    check_sub_sample(sub_sample_patches, "sub_sample_patches")
    self._sub_sample_patches = sub_sample_patches
    super().__init__(name=name)

  @property
  def _dtype(self):
    return self._inputs[0].dtype

  def max_patch_rows(self):
    """The row budget of sub_sample_patches (None when not sub-sampling)."""
    return patch_row_budget(self._sub_sample_patches, self._n,
                            DEFAULT_PATCH_ROWS_PER_DIM)

  def compute_sampled_statistic(self):
    """(statistic [C, K(+1), K(+1)], patch row indices or None): row r of
    the [N*L, K, C] patches is example r // L at output location r % L."""
    x = concat_channels_last(self._inputs, self._spec.channels_first)
    budget = self.max_patch_rows()
    row_idx = None
    if budget is None:
      p = tf.reshape(_depthwise_patches(x, self._spec, self._batch),
                     [-1, self._spec.num_taps, self._batch])
    else:
      total = (tf.shape(x, out_type=tf.int64)[0] *
               patches_lib.num_locations(x, self._spec))
      row_idx = tf.random.shuffle(tf.range(total))[:budget]
      p = tf.reshape(patches_lib.sample_patch_rows(x, self._spec, row_idx),
                     [-1, self._spec.num_taps, self._batch])
    if self._has_bias:
      p = tf.concat([p, tf.ones_like(p[:, :1])], axis=1)
    rows = tf.cast(tf.shape(p)[0], p.dtype)
    return per_channel_second_moments(p) / rows, row_idx

  def _compute_new_cov(self):
    return self.compute_sampled_statistic()[0]


class DepthwiseConvOutputKroneckerFactor(_BatchedSquareFactor):
  """Per-channel output-gradient second moments of a depthwise conv:
  [C, M, M], G_c = sum_s w_s mean over (n, t) of g_c g_c^T where g_c are
  the M outputs (c*M .. c*M+M-1) of input channel c."""

  def __init__(self, outputs_grads, channels, multiplier, data_format=None,
               weights=None, name=None):
    self._output_grads = OutputGradSources(outputs_grads, data_format,
                                           weights)
    self._weights = self._output_grads.weights
    self._batch = int(channels)
    self._n = int(multiplier)
    _BatchedSquareFactor.__init__(self, name=name, weights=self._weights)

  @property
  def _dtype(self):
    return self._output_grads.dtype

  def _compute_new_cov(self):
    terms = []
    for g in self._output_grads.tensors():
      g = tf.reshape(g, [-1, self._batch, self._n])
      rows = tf.cast(tf.shape(g)[0], g.dtype)
      terms.append(per_channel_second_moments(
          tf.transpose(g, [0, 2, 1])) / rows)
    return weighted_sum(terms, self._weights)


def per_channel_pi_damping_funcs(input_factor, output_factor, damping_func,
                                 pi_type="tracenorm"):
  """Per-channel pi-adjusted damping for a batch of Kronecker products
  A_c (x) G_c: like damping.pi_adjusted_damping_funcs, with one pi per
  channel (scales are [C] vectors); pi_type "off": pi = 1."""
  if pi_type != "tracenorm":
    return damping_lib.pi_adjusted_damping_funcs(
        input_factor, output_factor, damping_func, pi_type)
  key = ("pi_per_channel", input_factor.name, output_factor.name,
         damping_func.key)

  def pi():
    return damping_lib.compute_pi(input_factor.normalized_traces(),
                                  output_factor.normalized_traces())

  def root():
    return tf.sqrt(utils.cast(damping_func(), tf.float64))

  return (damping_lib.DampingFunc(root, key + ("left",),
                                  scale_fn=lambda: 1.0 / pi()),
          damping_lib.DampingFunc(root, key + ("right",), scale_fn=pi))
