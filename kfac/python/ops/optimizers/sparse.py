"""Arithmetic on update vectors that may be `tf.IndexedSlices`.

A gradient from `tf.gather` / `tf.nn.embedding_lookup` is a
`tf.IndexedSlices`; the update rules keep it sparse where they can
(optimizers/step.py). These helpers treat Tensors and IndexedSlices
alike.
"""

import tensorflow as tf


def is_slices(x):
  return isinstance(x, tf.IndexedSlices)


def dense(x):
  return tf.convert_to_tensor(x)


def scale(x, coeff):
  """x * coeff, sparse when x is."""
  if is_slices(x):
    return tf.IndexedSlices(x.values * coeff, x.indices, x.dense_shape)
  return x * coeff


def inner(a, b):
  """sum(a * b) for Tensors and/or IndexedSlices. IndexedSlices may repeat
  an index (the row is the sum of its slices): two sparse operands are
  summed per distinct index first; against a dense one, each slice meets
  the dense row it sits on, which is the same thing by linearity."""
  if is_slices(a) and is_slices(b):
    num_a = tf.shape(a.indices)[0]
    uniq, idx = tf.unique(tf.concat(
        [tf.cast(a.indices, tf.int64), tf.cast(b.indices, tf.int64)], 0))
    num = tf.shape(uniq)[0]
    rows_a = tf.math.unsorted_segment_sum(a.values, idx[:num_a], num)
    rows_b = tf.math.unsorted_segment_sum(b.values, idx[num_a:], num)
    return tf.reduce_sum(rows_a * rows_b)
  if is_slices(b):
    a, b = b, a
  if is_slices(a):
    return tf.reduce_sum(a.values * tf.gather(b, a.indices))
  return tf.reduce_sum(a * b)
