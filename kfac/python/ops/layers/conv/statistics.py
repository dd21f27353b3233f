"""Statistics plumbing shared by the convolution factors (factors.py,
sua_factor.py, depthwise_factors.py, and ekfac's conv blocks): the layer's
patch geometry, towers made channels-last and concatenated, the patch mask,
random subsets of examples, mean outer products, and the output-gradient
sources of a factor (`OutputGradSources`)."""

import tensorflow as tf

from kfac.python.ops.layers.base.factors import normalize_sources
from kfac.python.ops.layers.base.factors import normalize_weights
from kfac.python.ops.layers.conv import patches as patches_lib
from kfac.python.ops.tensors import utils


def conv_spec(filter_shape, padding, strides, dilation_rate, data_format):
  return patches_lib.make_conv_spec(tuple(filter_shape)[:-2], strides,
                                    dilation_rate, padding, data_format)


def concat_channels_last(towers, channels_first):
  towers = [patches_lib.to_channels_last(t, channels_first) for t in towers]
  return towers[0] if len(towers) == 1 else tf.concat(towers, axis=0)


def flat_mask(patch_mask, size, dtype):
  if patch_mask is None:
    return None
  mask = tf.reshape(tf.cast(patch_mask, dtype), [-1])
  if (tf.compat.dimension_value(mask.shape[0]) is not None and
      mask.shape[0] != size):
    raise ValueError("patch_mask has %d entries; the patches have %d "
                     "(shape [k1, ..., kd, in_channels])." %
                     (mask.shape[0], size))
  return mask


def check_sub_sample(value, what):
  if value is None or value is False or value is True:
    return
  if not utils.is_python_number(value) or int(value) != value or value < 1:
    raise ValueError("%s must be None, True or a positive int, got %r." %
                     (what, value))


def patch_row_budget(sub_sample_patches, dim, rows_per_dim):
  """The number of patch rows sub_sample_patches keeps (None: all of
  them): True keeps rows_per_dim * dim (dim: the statistic's dimension),
  an int R keeps R."""
  if sub_sample_patches is None or sub_sample_patches is False:
    return None
  if sub_sample_patches is True:
    return rows_per_dim * dim
  return int(sub_sample_patches)


def sample_examples(x, sub_sample_inputs, options):
  """(x restricted to a random subset of examples, indices or None)."""
  if sub_sample_inputs is None or sub_sample_inputs is False:
    return x, None
  n = tf.shape(x, out_type=tf.int64)[0]
  static_n = tf.compat.dimension_value(x.shape[0])
  if sub_sample_inputs is True and static_n is not None:
    m = tf.constant(options.num_sampled_inputs(static_n), tf.int64)
  elif sub_sample_inputs is True:
    # ceil(f * N) in float64, as options.num_sampled_inputs computes it.
    m = tf.cast(tf.math.ceil(
        tf.cast(n, tf.float64) *
        float(options.inputs_to_extract_patches_factor)), tf.int64)
  else:
    m = tf.minimum(tf.constant(int(sub_sample_inputs), tf.int64), n)
  idx = tf.random.shuffle(tf.range(n))[:m]
  return tf.gather(x, idx), idx


def mean_outer(rows):
  n = tf.cast(tf.shape(rows)[0], rows.dtype)
  return tf.matmul(rows, rows, transpose_a=True) / n


def mean_outer_with_ones(rows):
  """mean_outer of [rows, 1] without building the concatenated copy: the
  ones column only adds the column means and a 1."""
  second = mean_outer(rows)
  means = tf.reduce_mean(rows, axis=0)
  top = tf.concat([second, means[:, tf.newaxis]], axis=1)
  bottom = tf.concat([means, tf.ones([1], rows.dtype)], axis=0)
  return tf.concat([top, bottom[tf.newaxis]], axis=0)


class OutputGradSources:
  """The output gradients of a factor: sources (with their weights) of
  towers of [N, spatial..., O] tensors in `data_format`; `out` is O."""

  def __init__(self, outputs_grads, data_format, weights):
    self.grads = normalize_sources(outputs_grads)
    self.weights = normalize_weights(weights, len(self.grads))
    self.channels_first = patches_lib.data_format_is_channels_first(
        data_format)
    first = self.grads[0][0]
    self.out = int(first.shape[1 if self.channels_first else -1])
    self.dtype = first.dtype

  def tensors(self):
    """One channels-last tensor per source, its towers concatenated."""
    return [concat_channels_last(towers, self.channels_first)
            for towers in self.grads]


def block_diag_kron(a, g, perm):
  """The dense matrix with kron(a[i], g[i]) on its diagonal (a [n, p, p],
  g [n, q, q]: one pair per channel or group), rows and columns taken in
  the order `perm` (the block's flat parameter order)."""
  n_a, n_g = a.shape[-1], g.shape[-1]
  kron = (a[:, :, tf.newaxis, :, tf.newaxis] *
          g[:, tf.newaxis, :, tf.newaxis, :])
  kron = tf.reshape(kron, [a.shape[0], n_a * n_g, n_a * n_g])
  dense = tf.linalg.LinearOperatorBlockDiag(
      [tf.linalg.LinearOperatorFullMatrix(kron[i])
       for i in range(a.shape[0])]).to_dense()
  return tf.gather(tf.gather(dense, perm, axis=0), perm, axis=1)
