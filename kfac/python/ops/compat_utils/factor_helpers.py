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
    normalizer = tf.compat.dimension_value(tensor.shape[0])
    if normalizer is None:
      normalizer = tf.shape(tensor)[0]
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


# ------------------------------------------------ scope names of the old API
def _sanitized(text):
  """Keeps letters, digits and '_.-' (what variable scope names accept)."""
  return "".join(c if (c.isalnum() or c in "_.-") else "_" for c in text)


def scope_string_from_name(tensor):
  """A scope-safe string from a tensor's (or variable's) name, e.g.
  "dense/kernel:0" -> "dense_kernel_0"; a tuple / list joins with '__'."""
  if isinstance(tensor, (tuple, list)):
    return "__".join(scope_string_from_name(t) for t in tensor)
  return _sanitized(tensor.name.replace("/", "_").replace(":", "_"))


def scalar_or_tensor_to_string(val):
  """repr of a Python / numpy scalar, else the tensor's scope string."""
  if isinstance(val, (bool, int, float, str)) or (
      hasattr(val, "shape") and hasattr(val, "dtype") and
      not hasattr(val, "name") and getattr(val, "ndim", None) == 0):
    return repr(val)
  return scope_string_from_name(val)


def list_to_string(lst):
  """'_'-joined strings (as they are) and scalars / tensors."""
  return "_".join(v if isinstance(v, str) else scalar_or_tensor_to_string(v)
                  for v in lst)


def scope_string_from_params(params):
  """A variable-scope string for factor parameters: None, bools, ints,
  strings, tuples of ints ('-'-joined), tensors and variables (their names)
  and sequences of them.

  Raises:
    ValueError: for any other type, naming it.
  """
  params = params if isinstance(params, (tuple, list)) else (params,)
  parts = []
  for param in params:
    if param is None:
      parts.append("None")
    elif isinstance(param, (tuple, list)):
      if all(isinstance(p, int) and not isinstance(p, bool) for p in param):
        parts.append("-".join(str(p) for p in param))
      else:
        parts.append(scope_string_from_name(param))
    elif isinstance(param, (str, int, bool)):
      parts.append(str(param))
    elif isinstance(param, (tf.Tensor, tf.Variable)) or hasattr(param,
                                                                "op"):
      parts.append(scope_string_from_name(param))
    elif hasattr(param, "tensors"):  # utils.PartitionedTensor
      parts.append(scope_string_from_name(param.tensors))
    else:
      raise ValueError("scope_string_from_params: unsupported parameter %r "
                       "of type %s (use tensors, variables, None, bools, "
                       "ints, strings or tuples of them)." %
                       (param, type(param).__name__))
  return "_".join(parts)
