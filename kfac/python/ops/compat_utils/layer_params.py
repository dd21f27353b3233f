"""Layer parameters (W or (W, b)) as one 2-d matrix and back."""

import tensorflow as tf


def _last_dim(tensor):
  last = tensor.shape[-1]
  return int(last) if last is not None else tf.shape(tensor)[-1]


def layer_params_to_mat2d(vector):
  """W (any rank) -> reshape(W, [-1, out]); (W, b) -> that with b appended
  as the last row; a tf.IndexedSlices is returned as is."""
  if isinstance(vector, (tuple, list)):
    if len(vector) != 2:
      raise ValueError("layer_params_to_mat2d takes W or a (W, b) pair, got "
                       "%d tensors." % len(vector))
    w, b = vector
    w = tf.convert_to_tensor(w)
    w2d = tf.reshape(w, [-1, _last_dim(w)])
    return tf.concat([w2d, tf.reshape(b, [1, -1])], axis=0)
  if isinstance(vector, tf.IndexedSlices):
    return vector
  vector = tf.convert_to_tensor(vector)
  return tf.reshape(vector, [-1, _last_dim(vector)])


def mat2d_to_layer_params(vector_template, mat2d):
  """Inverse of `layer_params_to_mat2d`, shaped like `vector_template`
  (a (W, b) template gives a (W, b) tuple)."""
  if isinstance(vector_template, (tuple, list)):
    w_template = vector_template[0]
    w_shape = (w_template.shape if w_template.shape.is_fully_defined() else
               tf.shape(w_template))
    return tf.reshape(mat2d[:-1], w_shape), mat2d[-1]
  if isinstance(vector_template, tf.IndexedSlices):
    if not isinstance(mat2d, tf.IndexedSlices):
      raise TypeError(
          "If vector_template is an IndexedSlices, so should mat2d.")
    return mat2d
  shape = (vector_template.shape if vector_template.shape.is_fully_defined()
           else tf.shape(vector_template))
  return tf.reshape(mat2d, shape)
