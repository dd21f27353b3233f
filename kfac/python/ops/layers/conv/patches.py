"""Patches of N-d convolutions (layer 1 tensor plumbing).

A convolution with filter W of shape [k1, ..., kd, in, out] computes, at
every output location t, s_t = p_t^T W_mat where p_t is the *patch* of the
input under the filter at t and W_mat = reshape(W, [k1*...*kd*in, out]).
The patch vector is ordered like that reshape (row-major over
(k1, ..., kd, in)), so Kronecker statistics over patches act directly on
W_mat.

`ConvSpec` describes a convolution (kernel shape, strides, dilations,
padding, data format) in a normalised, hashable form; `make_conv_spec`
builds one from the many argument forms users pass (ints, [s, s],
[1, s, s, 1], "NHWC"/"NCHW", ...). Everything here works on channels-last
tensors after `to_channels_last`; channels-first inputs and output gradients
are transposed once.

Patch extraction:
* 2-d convolutions use `tf.image.extract_patches` (one fused kernel; works
  with dynamic spatial sizes);
* other ranks (1-d, 3-d) pad the input and take one strided slice per
  filter tap, stacked (no arithmetic, K = k1*...*kd copies of the output
  grid; needs static spatial sizes);
* `sample_patch_rows` gathers only a chosen subset of patches (rows of the
  [batch*locations, K*in] patch matrix) straight from the input, so a
  sub-sampled statistic never materialises all patches;
* `patch_location_sums` sums patches over output locations with one
  reduction per tap (KFAC-reduce needs only these sums).
"""

import collections
import math

import tensorflow as tf

from kfac.python.ops.tensors import utils

_CHANNELS_FIRST_FORMATS = ("NCW", "NCHW", "NCDHW", "channels_first")
_CHANNELS_LAST_FORMATS = ("NWC", "NHWC", "NDHWC", "channels_last")


class ConvSpec(collections.namedtuple(
    "ConvSpec",
    ["kernel_shape", "strides", "dilations", "padding", "channels_first"])):
  """A normalised, hashable description of an N-d convolution.

  kernel_shape, strides, dilations: tuples of d ints (spatial dimensions).
  padding: "SAME", "VALID" or a tuple of d (before, after) pairs.
  channels_first: False for [batch, spatial..., channels] tensors.
  """

  @property
  def num_spatial(self):
    return len(self.kernel_shape)

  @property
  def num_taps(self):
    return int(math.prod(self.kernel_shape))


def data_format_is_channels_first(data_format, num_spatial=None):
  """True for NCHW-like formats, False for None / NHWC-like ones."""
  if data_format is None:
    return False
  if data_format in _CHANNELS_FIRST_FORMATS:
    fmt_first = True
  elif data_format in _CHANNELS_LAST_FORMATS:
    fmt_first = False
  else:
    raise ValueError("Unknown data_format %r; expected one of %s." %
                     (data_format,
                      ", ".join(_CHANNELS_LAST_FORMATS + _CHANNELS_FIRST_FORMATS)))
  if (num_spatial is not None and not data_format.startswith("channels") and
      len(data_format) != num_spatial + 2):
    raise ValueError("data_format %r does not describe a %d-d convolution." %
                     (data_format, num_spatial))
  return fmt_first


def normalize_spatial_arg(value, num_spatial, channels_first, what,
                          default=1):
  """Ints, [s]*d or the full [1, s..., 1] form -> tuple of d ints."""
  if value is None:
    return (default,) * num_spatial
  if hasattr(value, "numpy") or hasattr(value, "tolist"):
    value = value.numpy() if hasattr(value, "numpy") else value
    value = value.tolist()
  if isinstance(value, int):
    values = [value] * num_spatial
  else:
    values = [int(v) for v in value]
    if len(values) == 1:
      values = values * num_spatial
    elif len(values) == num_spatial + 2:
      outer = ((values[0], values[1]) if channels_first else
               (values[0], values[-1]))
      if outer != (1, 1):
        raise ValueError("%s %s must be 1 in the batch and channel "
                         "dimensions." % (what, list(value)))
      values = values[2:] if channels_first else values[1:-1]
    elif len(values) != num_spatial:
      raise ValueError("%s %s: expected an int, %d ints or %d ints." %
                       (what, list(value), num_spatial, num_spatial + 2))
  if any(v < 1 for v in values):
    raise ValueError("%s must be positive, got %s." % (what, list(values)))
  return tuple(values)


def normalize_padding(padding, num_spatial, channels_first):
  """"SAME"/"VALID" (any case), "CAUSAL" (1-d) or explicit pairs -> the
  ConvSpec padding form ("CAUSAL" is returned as is and resolved by
  `make_conv_spec`)."""
  if isinstance(padding, str):
    upper = padding.upper()
    if upper not in ("SAME", "VALID", "CAUSAL"):
      raise ValueError("Unknown padding %r; expected 'SAME', 'VALID', "
                       "'CAUSAL' (1-d) or explicit pairs." % padding)
    if upper == "CAUSAL" and num_spatial != 1:
      raise ValueError("CAUSAL padding is for 1-d convolutions only.")
    return upper
  pairs = [tuple(int(p) for p in pair) for pair in padding]
  if any(len(p) != 2 for p in pairs):
    raise ValueError("Explicit padding must be (before, after) pairs, got %r."
                     % (padding,))
  if len(pairs) == num_spatial + 2:
    outer = ((pairs[0], pairs[1]) if channels_first else
             (pairs[0], pairs[-1]))
    if outer != ((0, 0), (0, 0)):
      raise ValueError("Explicit padding %r must be zero in the batch and "
                       "channel dimensions." % (padding,))
    pairs = pairs[2:] if channels_first else pairs[1:-1]
  elif len(pairs) != num_spatial:
    raise ValueError("Explicit padding %r: expected %d or %d pairs." %
                     (padding, num_spatial, num_spatial + 2))
  if any(p < 0 for pair in pairs for p in pair):
    raise ValueError("Explicit padding must be non-negative, got %r." %
                     (padding,))
  return tuple(pairs)


def make_conv_spec(kernel_shape, strides=None, dilations=None,
                   padding="VALID", data_format=None):
  """A ConvSpec from user arguments (see `normalize_spatial_arg`)."""
  kernel_shape = tuple(int(k) for k in kernel_shape)
  d = len(kernel_shape)
  first = data_format_is_channels_first(data_format, d)
  strides = normalize_spatial_arg(strides, d, first, "strides")
  dilations = normalize_spatial_arg(dilations, d, first, "dilations")
  padding = normalize_padding(padding, d, first)
  if padding == "CAUSAL":
    padding = (((kernel_shape[0] - 1) * dilations[0], 0),)
  return ConvSpec(kernel_shape, strides, dilations, padding, first)


def _effective_kernel(k, d):
  return (k - 1) * d + 1


def padding_amounts(in_size, k, s, d, padding, axis=0):
  """(before, after) zero padding of one spatial dimension."""
  if isinstance(padding, tuple):
    return padding[axis]
  if padding == "VALID":
    return (0, 0)
  out = -(-in_size // s)
  total = max((out - 1) * s + _effective_kernel(k, d) - in_size, 0)
  return (total // 2, total - total // 2)


def output_size(in_size, k, s, d, padding, axis=0):
  """Output length of one spatial dimension (TensorFlow's conv rules)."""
  if padding == "SAME":
    return -(-in_size // s)
  before, after = padding_amounts(in_size, k, s, d, padding, axis)
  return max((in_size + before + after - _effective_kernel(k, d)) // s + 1, 0)


def output_spatial_shape(spec, in_spatial):
  return tuple(output_size(n, k, s, d, spec.padding, i) for i, (n, k, s, d)
               in enumerate(zip(in_spatial, spec.kernel_shape, spec.strides,
                                spec.dilations)))


def to_channels_last(x, channels_first):
  """[N, C, spatial...] -> [N, spatial..., C] when channels_first."""
  if not channels_first:
    return x
  rank = x.shape.rank
  return tf.transpose(x, [0] + list(range(2, rank)) + [1])


def static_spatial_shape(x, what="inputs"):
  """Spatial sizes of a channels-last tensor as ints (ValueError if not
  statically known)."""
  spatial = x.shape[1:-1]
  if not spatial.is_fully_defined():
    raise ValueError("This operation needs static spatial sizes of the "
                     "convolution %s, got shape %s." % (what, x.shape))
  return tuple(int(n) for n in spatial)


def _pad(x, spec):
  in_spatial = static_spatial_shape(x)
  pads = [padding_amounts(n, k, s, d, spec.padding, i) for i, (n, k, s, d)
          in enumerate(zip(in_spatial, spec.kernel_shape, spec.strides,
                           spec.dilations))]
  if any(p != (0, 0) for p in pads):
    x = tf.pad(x, [[0, 0]] + [list(p) for p in pads] + [[0, 0]])
  return x, output_spatial_shape(spec, in_spatial)


def _taps(spec):
  """Tap offsets (k indices) in row-major order over (k1, ..., kd)."""
  taps = [()]
  for k in spec.kernel_shape:
    taps = [t + (i,) for t in taps for i in range(k)]
  return taps


def _tap_slice(xp, spec, tap, out_shape):
  begin = [0] + [i * d for i, d in zip(tap, spec.dilations)] + [0]
  end = ([0] + [b + (o - 1) * s + 1 for b, o, s in
                zip(begin[1:-1], out_shape, spec.strides)] + [0])
  strides = [1] + list(spec.strides) + [1]
  mask = 1 | (1 << (spec.num_spatial + 1))  # batch and channels: full range
  return tf.strided_slice(xp, begin, end, strides, begin_mask=mask,
                          end_mask=mask)


def extract_patches(x, spec):
  """Patches of channels-last inputs x [N, spatial..., C].

  Returns [N, out_spatial..., K*C] with the patch vector ordered like
  reshape(filter, [k1*...*kd*C, out]).
  """
  if spec.num_spatial == 2:
    padding = spec.padding
    if isinstance(padding, tuple):
      x = tf.pad(x, [[0, 0]] + [list(p) for p in padding] + [[0, 0]])
      padding = "VALID"
    return tf.image.extract_patches(
        x, sizes=[1] + list(spec.kernel_shape) + [1],
        strides=[1] + list(spec.strides) + [1],
        rates=[1] + list(spec.dilations) + [1], padding=padding)
  xp, out_shape = _pad(x, spec)
  if spec.num_taps == 1:
    return _tap_slice(xp, spec, _taps(spec)[0], out_shape)
  slices = [_tap_slice(xp, spec, tap, out_shape) for tap in _taps(spec)]
  stacked = tf.stack(slices, axis=-2)  # [N, out..., K, C]
  channels = x.shape[-1]
  if channels is None:
    raise ValueError("Convolution inputs need a static channel dimension, "
                     "got shape %s." % x.shape)
  return tf.reshape(stacked, [-1] + list(out_shape) +
                    [spec.num_taps * int(channels)])


def _valid_tap_range(n, out, s, offset):
  """(begin, end) of the input positions offset + t*s, 0 <= t < out, that
  fall inside [0, n) (padding positions hold zeros and add nothing)."""
  t_min = max(0, -(offset // s))  # ceil(-offset / s), at least 0
  t_max = min(out - 1, (n - 1 - offset) // s)
  if t_min > t_max:
    return None
  return offset + t_min * s, offset + t_max * s + 1


def patch_location_sums(x, spec):
  """sum over output locations of the patches: [N, K*C].

  The sum is separable over spatial axes: for the last axis, one strided
  slice-and-sum per tap offset gives [N, ..., k_d, C]; then the next axis,
  and so on (k_1 + ... + k_d reductions, most of them on small tensors; no
  patch matrix and no padded copy)."""
  in_spatial = static_spatial_shape(x)
  out_shape = output_spatial_shape(spec, in_spatial)
  d = spec.num_spatial
  y = x  # [N, P1, ..., Pd, C]; summed axes become tap axes, kept in place
  for axis in reversed(range(d)):
    n, k = in_spatial[axis], spec.kernel_shape[axis]
    s, dil = spec.strides[axis], spec.dilations[axis]
    before = padding_amounts(n, k, s, dil, spec.padding, axis)[0]
    sums = []
    for tap in range(k):
      rng = _valid_tap_range(n, out_shape[axis], s, tap * dil - before)
      if rng is None:
        shape = tf.concat([tf.shape(y)[:axis + 1], tf.shape(y)[axis + 2:]], 0)
        sums.append(tf.zeros(shape, y.dtype))
        continue
      begin = [0] * (axis + 1) + [rng[0]]
      end = [0] * (axis + 1) + [rng[1]]
      strides = [1] * (axis + 1) + [s]
      full_before = (1 << (axis + 1)) - 1  # all leading axes: full range
      piece = tf.strided_slice(y, begin, end, strides, begin_mask=full_before,
                               end_mask=full_before)
      sums.append(tf.reduce_sum(piece, axis=axis + 1))
    y = tf.stack(sums, axis=axis + 1)  # the spatial axis is now a tap axis
  return tf.reshape(y, [tf.shape(x)[0], spec.num_taps * int(x.shape[-1])])


def num_locations(x_channels_last, spec):
  """Number of output locations per example (an int; static shapes)."""
  return int(math.prod(output_spatial_shape(
      spec, static_spatial_shape(x_channels_last))))


def sample_patch_rows(x, spec, row_indices):
  """Rows `row_indices` of the [N*L, K*C] patch matrix of x, gathered
  straight from the input (zero-padding positions are masked, the padded
  input is never built). Row r is example r // L at output location r % L
  (row-major over the output grid)."""
  in_spatial = static_spatial_shape(x)
  out_shape = output_spatial_shape(spec, in_spatial)
  before = [padding_amounts(n, k, s, d, spec.padding, i)[0]
            for i, (n, k, s, d) in enumerate(zip(
                in_spatial, spec.kernel_shape, spec.strides, spec.dilations))]
  # The index arithmetic's constants are shared by every convolution of
  # the graph with the same geometry (utils.shared_constant): a model's
  # dozens of convolutions would otherwise build a few dozen Consts each.
  const = lambda value: utils.shared_constant(value, tf.int64)  # pylint: disable=unnecessary-lambda-assignment
  row_indices = tf.cast(row_indices, tf.int64)
  num_locs = int(math.prod(out_shape))
  example = tf.math.floordiv(row_indices, const(num_locs))
  loc = tf.math.floormod(row_indices, const(num_locs))
  coords = []
  for size in reversed(out_shape):
    coords.append(tf.math.floormod(loc, const(size)))
    loc = tf.math.floordiv(loc, const(size))
  coords = coords[::-1]  # d tensors [R]
  # [R, 1, d] origins plus the [K, d] taps (dilated): [R, K, d] positions.
  origin = (tf.stack(coords, axis=1) * const(list(spec.strides)) -
            const(before))
  offsets = const([[t * d for t, d in zip(tap, spec.dilations)]
                   for tap in _taps(spec)])
  positions = tf.expand_dims(origin, 1) + offsets
  valid = tf.reduce_all(
      tf.logical_and(positions >= const(0), positions < const(in_spatial)),
      axis=-1)
  positions = tf.clip_by_value(positions, const(0),
                               const([n - 1 for n in in_spatial]))
  example = tf.broadcast_to(
      tf.reshape(example, const([-1, 1, 1])),
      tf.stack([tf.size(row_indices, out_type=tf.int64),
                const(spec.num_taps), const(1)]))
  gathered = tf.gather_nd(x, tf.concat([example, positions], axis=-1))
  gathered = gathered * tf.expand_dims(tf.cast(valid, x.dtype), -1)
  return tf.reshape(gathered, const([-1, spec.num_taps * int(x.shape[-1])]))


# ------------------------------------------------ the old utils.* patch API
def is_data_format_channel_last(data_format):
  """True when `data_format` puts channels last (None counts as NHWC)."""
  if data_format is None:
    return True
  return data_format.endswith("C") or data_format == "channels_last"


def extract_convolution_patches(inputs, filter_shape, padding, strides=None,
                                dilation_rate=None, name=None,
                                data_format=None):
  """The input patch under the filter at every output location of
  `tf.nn.convolution(inputs, filter, padding, strides, dilation_rate)`.

  Args:
    inputs: [batch, spatial..., in_channels] tensor (any number of spatial
      dimensions; channels last).
    filter_shape: [k..., in_channels, out_channels] ints.
    padding: "SAME", "VALID" or explicit pairs.
    strides, dilation_rate: None, spatial ints, or the full
      [1, s..., 1] form.
    name: name scope.
    data_format: None or a channels-last format.

  Returns:
    [batch, out_spatial..., k..., in_channels]: reshaped to
    [-1, prod(k) * in_channels] and multiplied by the filter reshaped to
    [-1, out_channels] it gives the convolution's outputs.

  Raises:
    ValueError: channels-first `data_format`, or `inputs` and
      `filter_shape` disagree on in_channels.
  """
  if not is_data_format_channel_last(data_format):
    raise ValueError("Channel must be last dimension (data_format %r)." %
                     data_format)
  filter_shape = [int(d) for d in filter_shape]
  inputs = tf.convert_to_tensor(inputs)
  spatial_kernel = filter_shape[:-2]
  if inputs.shape.rank is not None and (
      inputs.shape.rank != len(spatial_kernel) + 2):
    raise ValueError("inputs of shape %s do not match a filter of shape %s."
                     % (inputs.shape, filter_shape))
  in_channels = inputs.shape[-1]
  if in_channels != filter_shape[-2]:
    raise ValueError("inputs and filter_shape must agree on in_channels "
                     "(%s vs %d)." % (in_channels, filter_shape[-2]))
  with tf.name_scope(name or "extract_convolution_patches"):
    spec = make_conv_spec(spatial_kernel, strides, dilation_rate, padding)
    patches = extract_patches(inputs, spec)  # [N, out..., K*C]
    out_shape = patches.shape[1:-1]
    if out_shape.is_fully_defined():
      out_dims = out_shape.as_list()
    else:
      out_dims = tf.unstack(tf.shape(patches)[1:-1])
    batch = tf.compat.dimension_value(inputs.shape[0])
    if batch is None:
      batch = -1
    return tf.reshape(patches, [batch] + list(out_dims) +
                      list(spatial_kernel) + [int(in_channels)])


def extract_pointwise_conv2d_patches(inputs, filter_shape, name=None,
                                     data_format=None):
  """Patches of a 1x1 conv2d: [batch, height, width, 1, 1, in_channels]
  (each pixel's channels), for `filter_shape` [1, 1, in, out]."""
  inputs = tf.convert_to_tensor(inputs)
  if inputs.shape.rank != 4:
    raise ValueError("inputs must have 4 dims, got shape %s." % inputs.shape)
  if len(filter_shape) != 4:
    raise ValueError("filter_shape must have 4 dims, got %s." %
                     (filter_shape,))
  if filter_shape[0] != 1 or filter_shape[1] != 1:
    raise ValueError("filter_shape must have shape 1 along spatial "
                     "dimensions, got %s." % (filter_shape,))
  if not is_data_format_channel_last(data_format):
    raise ValueError("data_format must be channels last, got %r." %
                     data_format)
  if inputs.shape[-1] != filter_shape[2]:
    raise ValueError("inputs and filter_shape must agree on in_channels "
                     "(%s vs %s)." % (inputs.shape[-1], filter_shape[2]))
  with tf.name_scope(name or "extract_pointwise_conv2d_patches"):
    return inputs[:, :, :, tf.newaxis, tf.newaxis, :]


def num_conv_locations(input_shape, filter_shape, strides, padding):
  """Number of output locations of a 1-d or 2-d convolution.

  Args:
    input_shape: [batch, spatial..., in] ints (length 3 or 4).
    filter_shape: [k..., in, out] ints (same length).
    strides: None or [1, s..., 1] ints.
    padding: "SAME" or "VALID" (None counts as SAME).
  """
  if len(input_shape) not in (3, 4):
    raise ValueError("input_shape must be length 4, corresponding to a "
                     "Conv2D, or length 3, corresponding to a Conv1D; got "
                     "%s." % (input_shape,))
  if len(input_shape) != len(filter_shape):
    raise ValueError("Inconsistent number of dimensions between input and "
                     "filter for convolution: %s vs %s." %
                     (input_shape, filter_shape))
  d = len(input_shape) - 2
  strides = [1] * (d + 2) if strides is None else list(strides)
  valid = padding is not None and padding.upper() == "VALID"
  total = 1
  for i in range(d):
    n, k, s = input_shape[1 + i], filter_shape[i], strides[1 + i]
    total *= -(-(n - k + 1) // s) if valid else -(-n // s)
  return total
