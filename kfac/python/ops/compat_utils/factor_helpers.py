"""Module-level helpers of the old fisher_factors module."""

import contextlib

import tensorflow as tf


def compute_cov(tensor, tensor_right=None, normalizer=None):
  """tensor^T tensor / normalizer (symmetrised), or tensor^T tensor_right /
  normalizer; normalizer defaults to the number of rows."""
  tensor = tf.convert_to_tensor(tensor)
  if tensor.shape.rank != 2:
    raise ValueError("compute_cov needs a 2-d tensor, got shape %s." %
                     tensor.shape)
  if normalizer is None:
    normalizer = (tensor.shape[0] if tensor.shape[0] is not None else
                  tf.shape(tensor)[0])
  normalizer = tf.cast(normalizer, tensor.dtype)
  if tensor_right is None:
    cov = tf.matmul(tensor, tensor, transpose_a=True) / normalizer
    return 0.5 * (cov + tf.transpose(cov))
  return tf.matmul(tensor, tensor_right, transpose_a=True) / normalizer


def append_homog(tensor, homog_value=None):
  """tensor with one more entry along the last dimension, equal to
  homog_value (default 1)."""
  tensor = tf.convert_to_tensor(tensor)
  value = 1.0 if homog_value is None else homog_value
  ones = tf.ones_like(tensor[..., :1]) * tf.cast(value, tensor.dtype)
  return tf.concat([tensor, ones], axis=-1)


@contextlib.contextmanager
def maybe_place_on_device(device):
  """`tf.device(device)` when device is a non-empty string, else nothing."""
  if device:
    with tf.device(device):
      yield
  else:
    yield
