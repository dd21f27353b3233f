"""Kronecker and diagonal factors of convolution layers (KFC).

Notation: a convolution with filter [k1, ..., kd, C, O] (K = k1*...*kd taps)
applied to N examples with L output locations each. p_{n,t} is the patch
(length K*C, see layers/conv/patches.py) at location t of example n, g_{n,t} the
gradient of the loss w.r.t. the pre-activation s_{n,t} (length O; the
estimator's gradients of the summed loss, so g_{n,t} = d loss_n / d s_{n,t}).

* `ConvInputKroneckerFactor`: A = mean over (n, t) of p p^T (a ones entry
  appended for a bias), optionally on a random subset of examples and/or
  patch rows, and with an elementwise patch mask.
* `ConvOutputKroneckerFactor`: G = sum over sources of weight * mean over
  (n, t) of g g^T.
* `ConvDiagonalFactor`: the exact diagonal of the layer's Fisher,
  mean over n of (sum_t p_{n,t} g_{n,t}^T)^2 (elementwise), summed over
  sources with weights.
* `ConvInputReduceKroneckerFactor` / `ConvOutputReduceKroneckerFactor`:
  KFAC-reduce (Eschenhagen et al. 2023): A = mean over n of
  (mean_t p_{n,t})(mean_t p_{n,t})^T, G = mean over n of
  (sum_t g_{n,t})(sum_t g_{n,t})^T.
The input factor under spatially uncorrelated activations
(`ConvInputSUAKroneckerFactor`) is in sua_factor.py; the depthwise
convolution factors in depthwise_factors.py; what they share (patch
geometry, towers, masks, sub-sampled examples) in statistics.py.

Sub-sampling (`ConvInputKroneckerFactor`, also accepted by the SUA and
reduce input factors for examples), with the factor's CurvatureOptions
(layers/base/curvature_options.py; kfac 0.2.x's rules):
* sub_sample_inputs: None/False: all examples. True: a uniformly random
  subset (without replacement) of ceil(f * N) examples, f =
  inputs_to_extract_patches_factor (0.2). An int m: a random subset of
  min(m, N) examples.
* sub_sample_patches: None/False: all N*L patches (of the kept examples).
  True: at most DEFAULT_PATCH_ROWS_PER_DIM * dim(A) random patch rows
  (without replacement); an int R: at most R rows. The rows are gathered
  from the input directly, so the full patch matrix is never built.
Both statistics are plain means over the chosen subset, hence unbiased
estimates of the full-batch mean. `compute_sampled_statistic()` returns the
statistic together with the chosen indices.
"""

import tensorflow as tf

from kfac.python.ops.layers.base.factors import DenseSquareFactor
from kfac.python.ops.layers.base.factors import InputsGradsDiagonalFactor
from kfac.python.ops.layers.base.factors import weighted_sum
from kfac.python.ops.layers.conv import patches as patches_lib
from kfac.python.ops.layers.conv.statistics import check_sub_sample
from kfac.python.ops.layers.conv.statistics import concat_channels_last
from kfac.python.ops.layers.conv.statistics import conv_spec
from kfac.python.ops.layers.conv.statistics import flat_mask
from kfac.python.ops.layers.conv.statistics import mean_outer
from kfac.python.ops.layers.conv.statistics import mean_outer_with_ones
from kfac.python.ops.layers.conv.statistics import OutputGradSources
from kfac.python.ops.layers.conv.statistics import patch_row_budget
from kfac.python.ops.layers.conv.statistics import sample_examples
from kfac.python.ops.tensors import utils

__all__ = [
    "ConvInputKroneckerFactor",
    "ConvOutputKroneckerFactor",
    "ConvDiagonalFactor",
    "ConvInputReduceKroneckerFactor",
    "ConvOutputReduceKroneckerFactor",
]

# sub_sample_patches=True keeps at most this many patch rows per dimension
# of the input factor (kfac 0.2.x: 3, set_global_constants(
# max_num_patches_per_dimension=...), which is ignored here).
DEFAULT_PATCH_ROWS_PER_DIM = 8


class ConvInputKroneckerFactor(DenseSquareFactor):
  """A = mean over examples and output locations of p p^T ([K*C(+1)]^2)."""

  def __init__(self, inputs, filter_shape, padding, strides=None,
               dilation_rate=None, data_format=None, extract_patches_fn=None,
               has_bias=False, sub_sample_inputs=None,
               sub_sample_patches=None, patch_mask=None, name=None):
    """Args:
      inputs: a tensor or a tuple of tensors (towers), the layer inputs.
      filter_shape: the filter's shape [k1, ..., kd, C, O].
      padding, strides, dilation_rate, data_format: the convolution's (any
        form accepted by `patches.make_conv_spec`).
      extract_patches_fn: ignored (kept for compatibility; patches are
        extracted by patches.extract_patches).
      has_bias: append a ones entry to every patch.
      sub_sample_inputs, sub_sample_patches: see the module docstring.
      patch_mask: None, or a tensor of K*C entries (shape [k1, .., kd, C]
        or flat) multiplied into every patch (masked convolutions).
    """
    del extract_patches_fn
    self._inputs = utils.ensure_sequence(inputs)
    self._spec = conv_spec(filter_shape, padding, strides, dilation_rate,
                           data_format)
    self._channels = int(filter_shape[-2])
    self._patch_size = self._spec.num_taps * self._channels
    self._has_bias = has_bias
    check_sub_sample(sub_sample_inputs, "sub_sample_inputs")
    check_sub_sample(sub_sample_patches, "sub_sample_patches")
    self._sub_sample_inputs = sub_sample_inputs
    self._sub_sample_patches = sub_sample_patches
    self._patch_mask = patch_mask
    self._n = self._patch_size + (1 if has_bias else 0)
    DenseSquareFactor.__init__(self, name=name)

  @property
  def _dtype(self):
    return self._inputs[0].dtype

  @property
  def spec(self):
    return self._spec

  def max_patch_rows(self):
    """The row budget of sub_sample_patches (None when not sub-sampling)."""
    return patch_row_budget(self._sub_sample_patches, self._n,
                            DEFAULT_PATCH_ROWS_PER_DIM)

  def patch_rows(self, x):
    """The [rows, K*C] patch matrix of channels-last x (all rows)."""
    return tf.reshape(patches_lib.extract_patches(x, self._spec),
                      [-1, self._patch_size])

  def compute_sampled_statistic(self):
    """(statistic, example indices or None, patch row indices or None).

    Example indices index the concatenated towers; row indices index the
    [n_kept * L, K*C] patch matrix of the kept examples (row r is kept
    example r // L at output location r % L)."""
    rows, example_idx, row_idx = self._sampled_rows()
    stat = mean_outer_with_ones(rows) if self._has_bias else mean_outer(rows)
    return stat, example_idx, row_idx

  row_weights = (1.0,)

  def statistic_rows(self):
    """[the (sampled, masked) patch rows [r, n]], with the ones column of
    a bias: the statistic is their mean outer product
    (layers/base/block_diagonal.py builds its blocks from them)."""
    rows = self._sampled_rows()[0]
    if self._has_bias:
      rows = tf.concat([rows, tf.ones_like(rows[:, :1])], axis=1)
    return [rows]

  def _sampled_rows(self):
    """(patch rows, example indices or None, patch row indices or None):
    compute_sampled_statistic's rows, masked."""
    x = concat_channels_last(self._inputs, self._spec.channels_first)
    x, example_idx = sample_examples(x, self._sub_sample_inputs,
                                     self.curvature_options)
    row_idx = None
    budget = self.max_patch_rows()
    if budget is None:
      rows = self.patch_rows(x)
    else:
      total = (tf.shape(x, out_type=tf.int64)[0] *
               patches_lib.num_locations(x, self._spec))
      row_idx = tf.random.shuffle(tf.range(total))[:budget]
      rows = patches_lib.sample_patch_rows(x, self._spec, row_idx)
    mask = flat_mask(self._patch_mask, self._patch_size, rows.dtype)
    if mask is not None:
      rows = rows * mask
    return rows, example_idx, row_idx

  def _compute_new_cov(self):
    return self.compute_sampled_statistic()[0]


class _ConvOutputSquareFactor(DenseSquareFactor):
  """[O, O] statistics of the output gradients (`_n` = O unless a subclass
  sets another size after this constructor)."""

  def __init__(self, outputs_grads, data_format=None, weights=None,
               name=None):
    self._output_grads = OutputGradSources(outputs_grads, data_format,
                                           weights)
    self._weights = self._output_grads.weights
    self._out = self._n = self._output_grads.out
    DenseSquareFactor.__init__(self, name=name, weights=self._weights)

  @property
  def _dtype(self):
    return self._output_grads.dtype


class ConvOutputKroneckerFactor(_ConvOutputSquareFactor):
  """G = sum_s w_s mean over (n, t) of g g^T ([O, O])."""

  @property
  def row_weights(self):
    return self._weights

  def statistic_rows(self):
    """[the [N * L, O] output gradients] per source (weights row_weights;
    layers/base/block_diagonal.py builds its blocks from them)."""
    return [tf.reshape(g, [-1, self._out])
            for g in self._output_grads.tensors()]

  def _compute_new_cov(self):
    terms = [mean_outer(tf.reshape(g, [-1, self._out]))
             for g in self._output_grads.tensors()]
    return weighted_sum(terms, self._weights)


class ConvOutputReduceKroneckerFactor(_ConvOutputSquareFactor):
  """KFAC-reduce G = sum_s w_s mean over n of (sum_t g)(sum_t g)^T."""

  def _compute_new_cov(self):
    terms = []
    for g in self._output_grads.tensors():
      axes = list(range(1, g.shape.rank - 1))
      terms.append(mean_outer(tf.reduce_sum(g, axis=axes)))
    return weighted_sum(terms, self._weights)


class ConvInputReduceKroneckerFactor(DenseSquareFactor):
  """KFAC-reduce A = mean over n of a_n a_n^T, a_n = mean_t p_{n,t} (with a
  ones entry for a bias, the mean of the ones)."""

  def __init__(self, inputs, filter_shape, padding, strides=None,
               dilation_rate=None, data_format=None, has_bias=False,
               sub_sample_inputs=None, patch_mask=None, name=None):
    self._inputs = utils.ensure_sequence(inputs)
    self._spec = conv_spec(filter_shape, padding, strides, dilation_rate,
                           data_format)
    self._patch_size = self._spec.num_taps * int(filter_shape[-2])
    self._has_bias = has_bias
    check_sub_sample(sub_sample_inputs, "sub_sample_inputs")
    self._sub_sample_inputs = sub_sample_inputs
    self._patch_mask = patch_mask
    self._n = self._patch_size + (1 if has_bias else 0)
    DenseSquareFactor.__init__(self, name=name)

  @property
  def _dtype(self):
    return self._inputs[0].dtype

  def _compute_new_cov(self):
    x = concat_channels_last(self._inputs, self._spec.channels_first)
    x, _ = sample_examples(x, self._sub_sample_inputs,
                           self.curvature_options)
    if x.shape[1:-1].is_fully_defined():
      sums = patches_lib.patch_location_sums(x, self._spec)
      num_locs = patches_lib.num_locations(x, self._spec)
      means = sums / tf.cast(num_locs, sums.dtype)
    else:
      p = patches_lib.extract_patches(x, self._spec)
      means = tf.reduce_mean(
          p, axis=list(range(1, p.shape.rank - 1)))
    mask = flat_mask(self._patch_mask, self._patch_size, means.dtype)
    if mask is not None:
      means = means * mask
    if self._has_bias:
      means = utils.append_homog(means)
    return mean_outer(means)


def _per_example_patches(x, spec, patch_size):
  """[N, L, K*C] patches of channels-last x."""
  p = patches_lib.extract_patches(x, spec)
  return tf.reshape(p, [tf.shape(p)[0], -1, patch_size])


class ConvDiagonalFactor(InputsGradsDiagonalFactor):
  """Exact diagonal of a conv layer's Fisher as a [K*C(+1), O] matrix:
  sum_s w_s mean over n of (sum_t p_{n,t} g_{n,t}^T)^2."""

  def __init__(self, inputs, outputs_grads, filter_shape, strides=None,
               padding="VALID", data_format=None, dilations=None,
               has_bias=False, weights=None, patch_mask=None, name=None):
    self._spec = conv_spec(filter_shape, padding, strides, dilations,
                           data_format)
    self._patch_size = self._spec.num_taps * int(filter_shape[-2])
    self._has_bias = has_bias
    self._patch_mask = patch_mask
    super().__init__(inputs, outputs_grads, weights,
                     [self._patch_size + (1 if has_bias else 0),
                      int(filter_shape[-1])], name=name)

  def _compute_new_cov(self):
    first = self._spec.channels_first
    x = concat_channels_last(self._inputs, first)
    p = _per_example_patches(x, self._spec, self._patch_size)
    mask = flat_mask(self._patch_mask, self._patch_size, p.dtype)
    if mask is not None:
      p = p * mask
    if self._has_bias:
      p = tf.concat([p, tf.ones_like(p[..., :1])], axis=-1)
    n = tf.cast(tf.shape(p)[0], p.dtype)
    terms = []
    for towers in self._grads:
      g = concat_channels_last(towers, first)
      g = tf.reshape(g, [tf.shape(g)[0], -1, self._shape[1]])
      per_example = tf.einsum("nlk,nlo->nko", p, g)
      terms.append(tf.reduce_sum(tf.square(per_example), axis=0) / n)
    return weighted_sum(terms, self._weights)
