"""What graph search found: one `MatchRecord` per place a layer pattern
matched, built from the pattern's bindings.

A record says which variables (`params`: a variable or a tuple (weights,
bias) / (scale, shift)) form one layer there, the layer's kind
(`RecordType`), its input and output tensors and, for convolutions, the
op's attributes. `tensor_set` holds the graph nodes the match covered
(keys from `tensorflow_graph_util.node_key`), so that a match contained in
a larger one can be dropped.

Records are grouped by their params in a `ParamsDict`: a mapping keyed by
a variable or a tuple of variables that also works in TF2, where
variables are unhashable (plain dicts keyed by variables work only in TF1
graphs).
"""

import collections
import collections.abc
import enum

import tensorflow as tf

from kfac.python.ops.tensors import utils
from kfac.python.ops.tensormatch import tensorflow_graph_util as graph_util


class RecordType(enum.Enum):
  fully_connected = 1  # dense layers and embedding lookups
  conv2d = 2
  scale_and_shift = 3
  batch_norm = 4
  conv1d = 5
  depthwise_conv2d = 6
  convolution = 7  # N-d (Conv3D)


def ensure_sequence(obj):
  """`obj` if it is a tuple or a list, else the tuple (obj,)."""
  if isinstance(obj, (tuple, list)):
    return obj
  return (obj,)


def variable_refs(variables):
  """The frozenset of the graph keys (`tensorflow_graph_util.node_key`) of
  `variables` (variables or their refs)."""
  return frozenset(graph_util.node_key(v) for v in variables)


def describe(params):
  """Variable names of `params`, for messages."""
  names = [utils.variable_name(v) for v in ensure_sequence(params)]
  if isinstance(params, (tuple, list)):
    return "(%s)" % ", ".join(names)
  return names[0]


class MatchRecord(object):
  """One match of a layer pattern.

  Attributes:
    record_type: a `RecordType`.
    params: the layer's variable, or tuple of variables.
    tensor_set: frozenset of the keys of the graph nodes the match covered
      (tensors, variables and ops may be passed; they are keyed by
      `tensorflow_graph_util.node_key`).
    data: dict of the layer's details: 'inputs', 'outputs', and per kind
      'dense_inputs' (fully connected) or 'strides', 'padding',
      'data_format', 'dilations' (convolutions).
  """

  def __init__(self, record_type, params, tensor_set, data=None):
    self.record_type = record_type
    self.params = params
    self.tensor_set = frozenset(graph_util.node_key(n) for n in tensor_set)
    self.data = dict(data) if data is not None else {}

  def __repr__(self):
    return "MatchRecord(%s, %s)" % (self.record_type.name,
                                     describe(self.params))


class ParamsDict(collections.abc.MutableMapping):
  """An insertion-ordered mapping keyed by params (a variable or a tuple /
  list of variables), stored by `.ref()` so that it works in TF2 too."""

  def __init__(self, items=()):
    self._items = collections.OrderedDict()
    for params, value in (items.items() if isinstance(
        items, collections.abc.Mapping) else items):
      self[params] = value

  @staticmethod
  def _key(params):
    return utils.hashable_key(params)

  def __getitem__(self, params):
    try:
      return self._items[self._key(params)][1]
    except (KeyError, TypeError):
      raise KeyError(params)

  def __setitem__(self, params, value):
    self._items[self._key(params)] = (params, value)

  def __delitem__(self, params):
    try:
      del self._items[self._key(params)]
    except (KeyError, TypeError):
      raise KeyError(params)

  def __contains__(self, params):
    try:
      return self._key(params) in self._items
    except TypeError:
      return False

  def __iter__(self):
    return iter([params for params, _ in self._items.values()])

  def __len__(self):
    return len(self._items)

  def __repr__(self):
    return "ParamsDict({%s})" % ", ".join(
        "%s: %r" % (describe(p), v) for p, v in self._items.values())


def empty_like(mapping):
  """A new empty mapping of the kind of `mapping` (a ParamsDict for a
  ParamsDict, else a dict)."""
  return ParamsDict() if isinstance(mapping, ParamsDict) else {}


class TensorToVariable(object):
  """Finds the variable a graph tensor stands for (`get(tensor)`), for
  the variables of `varlist` in `graph` (see
  tensorflow_graph_util.variable_tensors)."""

  def __init__(self, varlist, graph):
    self._by_key = {}
    for var in varlist:
      for t in graph_util.variable_tensors(var, graph):
        self._by_key.setdefault(graph_util.node_key(t), var)

  def get(self, tensor, default=None):
    if tensor is None:
      return default
    return self._by_key.get(graph_util.node_key(tensor), default)

  def __len__(self):
    return len(self._by_key)


class UnsupportedLayerError(ValueError):
  """A match that looks like a layer K-FAC cannot register this way
  (`params`: its variables)."""

  def __init__(self, message, params):
    super(UnsupportedLayerError, self).__init__(message)
    self.params = params


def _lookup(tensors_to_variables, bindings, name):
  tensor = bindings.get(name)
  if tensor is None:
    return None
  if isinstance(tensor, tf.Variable):
    return tensor
  return tensors_to_variables.get(tensor)


def _attr(op, name, default=None):
  try:
    value = op.get_attr(name)
  except ValueError:
    return default
  if isinstance(value, bytes):
    value = value.decode()
  return value


def _float_tensor(t):
  return graph_util.is_tensor(t) and t.dtype.is_floating


def _conv_padding(op, spatial_axes):
  """The op's padding: "SAME"/"VALID", or (before, after) pairs for the
  spatial axes of an EXPLICIT padding."""
  padding = _attr(op, "padding")
  if padding != "EXPLICIT":
    return padding
  flat = list(_attr(op, "explicit_paddings", []))
  pairs = [tuple(flat[2 * i:2 * i + 2]) for i in range(len(flat) // 2)]
  return [pairs[a] for a in spatial_axes]


_DENSE_OPS = ("MatMul", "BatchMatMulV2", "BatchMatMulV3")
_SPARSE_OPS = ("Gather", "GatherV2", "ResourceGather")


def record_affine_from_bindings(bindings, consumed_tensors,
                                tensors_to_variables):
  """A MatchRecord for a match of `graph_patterns.Affine` or `Embed`.

  Args:
    bindings: the match's bindings (names of the pattern -> nodes).
    consumed_tensors: the nodes the match covered.
    tensors_to_variables: maps a graph tensor to the variable it stands
      for (`.get(tensor)`; a `TensorToVariable`, or in a TF1 graph a dict).

  Returns:
    The record, or None when the match is not a layer K-FAC registers (its
    weights are not among the variables, its inputs are not a floating
    point tensor (integer ids for a lookup), or the op is used in a way
    that is not a layer, e.g. a lookup along another axis).

  Raises:
    ValueError: for a bias without its weights among the variables, a
      matmul with transposed operands, or an unknown linear op.
  """
  weights = _lookup(tensors_to_variables, bindings, "weights")
  biases = _lookup(tensors_to_variables, bindings, "biases")
  inputs = bindings["in"]
  outputs = bindings["pre_activations"]
  linear_op = bindings["linear_op"]
  if biases is not None and weights is None:
    raise UnsupportedLayerError(
        "Can't register linear layer part with only biases: the bias %s is "
        "added to the output of %s (op %s), whose weights are not among the "
        "variables to register. Pass the weights too, or register the bias "
        "yourself (e.g. register_generic) before auto registration." %
        (utils.variable_name(biases), linear_op.type, linear_op.name), biases)
  if weights is None:
    return None
  params = (weights, biases) if biases is not None else weights
  data = dict(inputs=inputs, outputs=outputs)
  op_type = linear_op.type
  rank = weights.shape.rank

  if op_type in _DENSE_OPS or op_type in _SPARSE_OPS:
    sparse = op_type in _SPARSE_OPS
    if sparse:
      if not (graph_util.is_tensor(inputs) and inputs.dtype.is_integer):
        return None
      if op_type == "GatherV2":
        axis = bindings.get("axis")
        if (axis is None or tf.get_static_value(axis) is None or
            int(tf.get_static_value(axis)) != 0 or
            _attr(linear_op, "batch_dims", 0) != 0):
          return None  # not a row lookup
    elif not _float_tensor(inputs):
      return None
    if rank != 2:
      return None  # batched or unusual weights: not a dense layer
    transposed = (_attr(linear_op, "transpose_a") or
                  _attr(linear_op, "transpose_b") or
                  _attr(linear_op, "adj_x") or _attr(linear_op, "adj_y"))
    if transposed:
      raise UnsupportedLayerError(
          "K-FAC's graph search does not support fully-connected layers "
          "whose inputs or weights are transposed inside the op (%s %s, "
          "weights %s). Register this layer yourself with the weights as "
          "[in, out] before auto registration, or compute the matmul "
          "without transposition." % (op_type, linear_op.name,
                                      describe(params)), params)
    data["dense_inputs"] = not sparse
    record_type = RecordType.fully_connected

  elif op_type in ("Conv2D", "DepthwiseConv2dNative", "Conv3D"):
    if not _float_tensor(inputs):
      return None
    record_type = _conv_record_data(linear_op, weights, bindings, data)
    if record_type is None:
      return None
  else:
    raise ValueError("Can't register operation: %r" % (linear_op,))
  if biases is not None and not _bias_fits(biases, weights, record_type):
    return None  # not a per-output bias; the match without it remains
  return MatchRecord(record_type, params, consumed_tensors, data=data)


def _bias_fits(biases, weights, record_type):
  """A bias of the layer's outputs: shape [outputs] (dense layers also
  [1, outputs], which register_fully_connected accepts, as kfac 0.2.x)."""
  dims = weights.shape.as_list()
  if record_type is RecordType.depthwise_conv2d:
    outputs = dims[-2] * dims[-1] if None not in dims[-2:] else None
  else:
    outputs = dims[-1]
  shape = biases.shape.as_list() if biases.shape.rank is not None else None
  if record_type is RecordType.fully_connected and shape == [1, outputs]:
    return True
  return shape == [outputs]


def _conv_record_data(op, weights, bindings, data):
  """Fills `data` with a convolution's attributes; its RecordType, or None
  if the convolution cannot be registered."""
  op_type = op.type
  rank = weights.shape.rank
  data_format = _attr(op, "data_format")
  strides = tuple(int(s) for s in _attr(op, "strides"))
  dilations = tuple(int(d) for d in _attr(op, "dilations",
                                          (1,) * len(strides)))
  first = data_format.startswith("NC")
  spatial = (list(range(2, len(strides))) if first else
             list(range(1, len(strides) - 1)))
  conv1d = op_type == "Conv2D" and rank == 3
  if conv1d:
    # tf.nn.conv1d: the width axis is the last spatial axis of the 2-D op.
    spatial = spatial[-1:]
  elif rank != {"Conv2D": 4, "DepthwiseConv2dNative": 4, "Conv3D": 5}[op_type]:
    return None
  padding = _conv_padding(op, spatial)
  core_input = graph_util.reduce_identity_ops(op.inputs[0])
  if conv1d and core_input.op.type == "ExpandDims":
    core_input = graph_util.reduce_identity_ops(core_input.op.inputs[0])
  if "block_shape" in bindings:
    # Dilated by SpaceToBatchND / BatchToSpaceND around a stride-1,
    # undilated, channels-last convolution.
    block = tf.get_static_value(bindings["block_shape"])
    if (block is None or first or any(s != 1 for s in strides) or
        any(d != 1 for d in dilations)):
      return None
    block = [int(b) for b in block]
    padding = _padding_from_shapes(data["inputs"], data["outputs"], weights,
                                   block)
    if padding is None:
      return None
    if conv1d:
      data.update(strides=1, dilations=block[0], padding=padding,
                  data_format="NWC")
      return RecordType.conv1d
    strides = (1,) * len(strides)
    dilations = (1,) + tuple(block) + (1,)
  elif core_input.op.type == "SpaceToBatchND":
    return None  # a dilated convolution whose pattern did not match
  elif conv1d:
    axis = spatial[0]
    data.update(strides=strides[axis], dilations=dilations[axis],
                padding=padding, data_format="NCW" if first else "NWC")
    return RecordType.conv1d
  data.update(strides=strides, dilations=dilations, padding=padding,
              data_format=data_format)
  return {"Conv2D": RecordType.conv2d,
          "DepthwiseConv2dNative": RecordType.depthwise_conv2d,
          "Conv3D": RecordType.convolution}[op_type]


def _padding_from_shapes(inputs, outputs, weights, dilations):
  """"SAME" or "VALID" from the static spatial sizes of a stride-1
  channels-last convolution (None if they are unknown or fit neither)."""
  num_spatial = len(dilations)
  ins = inputs.shape.as_list()[1:1 + num_spatial]
  outs = outputs.shape.as_list()[1:1 + num_spatial]
  kernel = weights.shape.as_list()[:num_spatial]
  if None in ins or None in outs or len(ins) != num_spatial:
    return None
  same = all(o == i for i, o in zip(ins, outs))
  valid = all(o == i - (k - 1) * d
              for i, o, k, d in zip(ins, outs, kernel, dilations))
  if same:
    return "SAME"
  if valid:
    return "VALID"
  return None


def record_scale_and_shift_from_bindings(bindings, consumed_tensors,
                                         tensors_to_variables):
  """A MatchRecord for a match of `graph_patterns.ScaleAndShift` (None if
  the scale is not among the variables or the inputs are not floating
  point). Arguments as for record_affine_from_bindings.

  Raises:
    ValueError: for a shift whose scale is not among the variables.
  """
  scale = _lookup(tensors_to_variables, bindings, "scale")
  shift = _lookup(tensors_to_variables, bindings, "shift")
  if shift is not None and scale is None:
    raise UnsupportedLayerError(
        "Can't register scale_and_shift with only shift: the shift %s is "
        "added to a product whose scale is not among the variables to "
        "register. Pass the scale too, or register the shift yourself." %
        utils.variable_name(shift), shift)
  if scale is None or not _float_tensor(bindings["in"]):
    return None
  params = (scale, shift) if shift is not None else scale
  return MatchRecord(RecordType.scale_and_shift, params, consumed_tensors,
                     data=dict(inputs=bindings["in"],
                               outputs=bindings["out"]))


def record_batch_norm_from_bindings(bindings, consumed_tensors,
                                    tensors_to_variables):
  """A MatchRecord for a match of `graph_patterns.BatchNorm` or
  `FusedBatchNormOutput` (None if neither scale nor offset is among the
  variables). Arguments as for record_affine_from_bindings."""
  scale = _lookup(tensors_to_variables, bindings, "scale")
  offset = _lookup(tensors_to_variables, bindings, "offset")
  present = tuple(v for v in (scale, offset) if v is not None)
  if not present:
    return None
  params = present if len(present) == 2 else present[0]
  return MatchRecord(RecordType.batch_norm, params, consumed_tensors,
                     data=dict(inputs=bindings["in"],
                               outputs=bindings["out"]))
