"""The small convnet classifier shared by the convnet demo and the benchmarks.

image -> [conv k x k (relu, bias) -> 2x2 max-pool] x len(conv_channels) ->
dense (relu) -> dense num_classes (logits). K-FAC registers the
convolutions with `register_conv2d` and the dense layers with
`register_fully_connected`. Parameters are created from numpy arrays so that
several optimizers can start from exactly the same weights.
"""

import numpy as np
import tensorflow as tf

_STRIDES = [1, 1, 1, 1]
_PADDING = "SAME"


def glorot_uniform(rng, shape, fan_in, fan_out):
  limit = np.sqrt(6.0 / (fan_in + fan_out))
  return rng.uniform(-limit, limit, size=shape).astype(np.float32)


def init_params(conv_channels, kernel_size, dense_units, image_shape,
                num_classes, seed):
  """Glorot-uniform weights and zero biases, float32 numpy, by name."""
  rng = np.random.RandomState(seed)
  params = {}
  channels_in, side = 1, image_shape[0]
  k = kernel_size
  for i, channels in enumerate(int(c) for c in conv_channels):
    params["conv%d/w" % i] = glorot_uniform(
        rng, (k, k, channels_in, channels), k * k * channels_in,
        k * k * channels)
    params["conv%d/b" % i] = np.zeros([channels], np.float32)
    channels_in, side = channels, (side + 1) // 2
  sizes = [side * side * channels_in, dense_units, num_classes]
  for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
    params["dense%d/w" % i] = glorot_uniform(
        rng, (fan_in, fan_out), fan_in, fan_out)
    params["dense%d/b" % i] = np.zeros([fan_out], np.float32)
  return params


def forward(images, variables, layer_collection=None,
            sub_sample_patches=True):
  """Logits [batch, classes] of images [batch, side, side].

  Args:
    images: float32 [batch, side, side].
    variables: {name: tf.Variable} with the names of init_params.
    layer_collection: a kfac.LayerCollection, or None for no registration.
    sub_sample_patches: passed to register_conv2d (True: at most 8 x the
      statistic's dimension random patches per step; None: all patches).
  """
  lc = layer_collection
  h = images[..., tf.newaxis]
  i = 0
  while "conv%d/w" % i in variables:
    w, b = variables["conv%d/w" % i], variables["conv%d/b" % i]
    pre = tf.nn.conv2d(h, w, strides=_STRIDES, padding=_PADDING) + b
    if lc is not None:
      lc.register_conv2d((w, b), _STRIDES, _PADDING, h, pre,
                         sub_sample_patches=sub_sample_patches)
    h = tf.nn.max_pool2d(tf.nn.relu(pre), ksize=2, strides=2,
                         padding=_PADDING)
    i += 1
  h = tf.reshape(h, [-1, int(np.prod(h.shape[1:]))])
  i = 0
  while "dense%d/w" % i in variables:
    w, b = variables["dense%d/w" % i], variables["dense%d/b" % i]
    pre = tf.matmul(h, w) + b
    if lc is not None:
      lc.register_fully_connected((w, b), h, pre)
    h = pre if "dense%d/w" % (i + 1) not in variables else tf.nn.relu(pre)
    i += 1
  return h


def describe(conv_channels, kernel_size, dense_units, image_shape):
  k = kernel_size
  convs = " -> ".join("conv %dx%d (%s) -> pool" % (k, k, c)
                      for c in conv_channels)
  return "%dx%d -> %s -> dense %d -> dense 10" % (
      image_shape[0], image_shape[1], convs, dense_units)
