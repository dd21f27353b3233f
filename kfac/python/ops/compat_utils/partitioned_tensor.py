"""PartitionedTensor: a tensor kept as pieces split along dimension 0."""

import tensorflow as tf


class PartitionedTensor(object):
  """Several tensors that together form one tensor, concatenated along the
  batch (0-th) dimension; converts to that tensor wherever TensorFlow
  expects one (`tf.convert_to_tensor`, ops' arguments).

  Args:
    tensors: a non-empty list of tensors with the same dtype and the same
      shape apart from dimension 0 (and the same `one_hot_depth` attribute,
      if they carry one).
  """

  def __init__(self, tensors):
    tensors = list(tensors) if tensors is not None else []
    if not tensors:
      raise ValueError("tensors must be a list of 1+ Tensors.")
    dtype = tensors[0].dtype
    if any(t.dtype != dtype for t in tensors):
      raise ValueError("All tensors must have the same dtype, got %s." %
                       [t.dtype.name for t in tensors])
    feature_shape = tensors[0].shape[1:]
    if any(t.shape[1:] != feature_shape for t in tensors):
      raise ValueError("All tensors must have shape = %s (excluding batch "
                       "dimension), got %s." %
                       (feature_shape, [t.shape for t in tensors]))
    depth = getattr(tensors[0], "one_hot_depth", None)
    if any(getattr(t, "one_hot_depth", None) != depth for t in tensors):
      raise ValueError("All tensors must have one_hot_depth %s." % depth)
    self.tensors = tensors

  @property
  def shape(self):
    sizes = [t.shape[0] for t in self.tensors]
    batch = (None if any(s is None for s in sizes) else sum(sizes))
    return tf.TensorShape([batch]).concatenate(self.tensors[0].shape[1:])

  def get_shape(self):
    return self.shape

  @property
  def dtype(self):
    return self.tensors[0].dtype

  @property
  def one_hot_depth(self):
    return getattr(self.tensors[0], "one_hot_depth", None)

  @property
  def device(self):
    """The common device of the pieces, or None when they differ."""
    devices = set(t.device for t in self.tensors)
    return devices.pop() if len(devices) == 1 else None

  def __str__(self):
    first = getattr(self.tensors[0], "name", "<eager>")
    return "PartitionedTensor([%s, ...], dtype=%s, shape=%s)" % (
        first, self.dtype.name, self.shape)

  def __hash__(self):
    return hash(tuple(t.ref() for t in self.tensors))

  def __eq__(self, other):
    if not isinstance(other, PartitionedTensor):
      return False
    return (len(self.tensors) == len(other.tensors) and
            all(a is b for a, b in zip(self.tensors, other.tensors)))

  def __ne__(self, other):
    return not self == other

  def __getitem__(self, key):
    return self.as_tensor()[key]

  def as_tensor(self, dtype=None, name=None, as_ref=False):
    if as_ref:
      raise ValueError("A PartitionedTensor cannot be used as a reference.")
    if dtype is not None and tf.as_dtype(dtype) != self.dtype:
      raise ValueError("PartitionedTensor of dtype %s requested as %s." %
                       (self.dtype.name, tf.as_dtype(dtype).name))
    with tf.name_scope(name or "PartitionedTensor_as_tensor"):
      if len(self.tensors) == 1:
        return tf.identity(self.tensors[0])
      return tf.concat(self.tensors, axis=0)


tf.register_tensor_conversion_function(
    PartitionedTensor,
    lambda value, dtype=None, name=None, as_ref=False: value.as_tensor(
        dtype, name, as_ref))
