"""The normalised inputs of Keras group normalisation, recomputed.

A normalisation layer computes outputs = normalized * gamma + beta; K-FAC
registers gamma and beta with register_scale_and_shift on `normalized` and
the layer's outputs, so `normalized` must be what the layer multiplies by
gamma. `group_normalized` recomputes it from the layer's input the way
Keras's GroupNormalization does (Keras 3 and tf_keras alike): the channels
(last axis) split into `groups` consecutive groups, each example's group
normalised by its mean and variance over the group's channels and every
spatial axis.
"""

import tensorflow as tf


def group_normalized(x, groups, epsilon):
  """(x - mean) / sqrt(variance + epsilon) per example and channel group.

  Args:
    x: [batch, ..., channels] with static rank and channel count.
    groups: the number of groups (divides channels).
    epsilon: added to the variance.

  Returns:
    A tensor shaped like x, in x's dtype.
  """
  rank = x.shape.rank
  channels = int(x.shape[-1])
  if channels % groups:
    raise ValueError("%d channels do not split into %d groups." %
                     (channels, groups))
  shape = tf.shape(x)
  grouped = tf.reshape(x, tf.concat(
      [shape[:-1], [groups, channels // groups]], axis=0))
  # The spatial axes 1..rank-2 and the channels within a group (axis rank).
  axes = list(range(1, rank - 1)) + [rank]
  mean, variance = tf.nn.moments(grouped, axes, keepdims=True)
  normalized = (grouped - mean) * tf.math.rsqrt(variance + epsilon)
  return tf.reshape(normalized, shape)
