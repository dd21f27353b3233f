"""Patterns (graph_matcher.py's tuple syntax) for the layers graph search
registers.

Every TensorFlow op type is a pattern constructor of this module named
after the op (`MatMul`, `Conv2D`, `ResourceGather`, ...): `MatMul('op')`
matches a MatMul op and binds it to 'op'; a bare `MatMul` in a pattern
means `MatMul()`. `Op`, `Tensor`, `Variable`, `Const` and `Placeholder`
match any node of that kind.

The layer patterns bind these names (defaults shown):
* `Affine`: 'in' (the layer input), 'weights', 'biases' (optional),
  'linear_op' (the MatMul / BatchMatMul / Conv2D / Conv3D /
  DepthwiseConv2dNative op; for a 1-d convolution, the Conv2D between
  tf.nn.conv1d's ExpandDims and Squeeze), 'block_shape' (the dilation of
  a convolution that TensorFlow dilates by SpaceToBatchND /
  BatchToSpaceND) and 'pre_activations' (the output).
* `Embed`: 'in' (the ids), 'weights' (the table), 'linear_op' (the Gather,
  GatherV2 or ResourceGather op), 'axis' (GatherV2's axis) and
  'pre_activations'.
* `ScaleAndShift`: 'in', 'scale', 'shift' (optional), 'out' for
  in * scale (+ shift) with variables scale and shift.
* `BatchNorm` (tf.nn.batch_normalization) and `FusedBatchNormOutput`
  (tf.nn.fused_batch_norm): 'in', 'scale', 'offset', 'out'.
"""

import tensorflow as tf

from kfac.python.ops.tensormatch import tensorflow_graph_util as util

# pylint: disable=invalid-name


# ------------------------------------------------------- node patterns
def Op(name=None):
  return ("?", name, util.is_op)


def Tensor(name=None):
  return ("?", name, util.is_tensor)


def Variable(name=None):
  return ("?", name, util.is_var)


def Const(name=None):
  return ("?", name, util.is_const)


def Placeholder(name=None):
  return ("?", name, util.is_placeholder)


# One constructor per registered op type (those defined above are kept).
util.import_ops_no_clobber(globals(), dir(tf.raw_ops))

# The op behind tf.unstack is registered as "Unpack".
Unstack = util.make_op_pattern("Unpack")


def _op(typename, name=None):
  return util.make_op_pattern(typename)(name)


def _ops(typenames, name=None):
  return ("?:choice",) + tuple(_op(t, name) for t in typenames)


def _either_order(op_pattern, first, second):
  """op_pattern with inputs (first, second) or (second, first)."""
  return ("?:choice", (op_pattern, ("In", first, second)),
          (op_pattern, ("In", second, first)))


def _value_of(pattern):
  """A tensor produced by the op pattern `pattern` (with its inputs)."""
  return (Tensor(), ("In", pattern))


_ADD_OPS = ("Add", "AddV2", "BiasAdd")


# ------------------------------------------------------ layer patterns
def _reshaped(inner):
  """`inner` through one shape-only op (Reshape, ExpandDims, Squeeze)."""
  return _value_of(("?:choice",
                    (_op("Reshape"), ("In", inner, Tensor())),
                    (_op("ExpandDims"), ("In", inner, Tensor())),
                    (_op("Squeeze"), ("In", inner))))


def _variable_maybe_reshaped(name):
  """A variable, possibly through up to two shape-only ops (Keras 3
  reshapes a convolution's bias to broadcast it, then squeezes it for
  BiasAdd)."""
  var = Variable(name)
  return ("?:choice", var, _reshaped(var), _reshaped(_reshaped(var)))


def Affine(in_pattern=Tensor("in"),
           linear_op_name="linear_op",
           weights_name="weights",
           biases_name="biases",
           output_name="pre_activations"):
  """inputs (x) weights (+ biases): a dense layer (MatMul / BatchMatMul), a
  convolution (Conv2D, Conv3D, DepthwiseConv2dNative, or tf.nn.conv1d's
  ExpandDims -> Conv2D -> Squeeze), possibly dilated through
  SpaceToBatchND -> conv -> BatchToSpaceND (binding 'block_shape'), with an
  optional bias add."""

  def core(inputs):
    direct = (_ops(("MatMul", "BatchMatMulV2", "BatchMatMulV3", "Conv2D",
                    "Conv3D", "DepthwiseConv2dNative"), linear_op_name),
              ("In", inputs, Variable(weights_name)))
    conv1d = (_op("Squeeze"), ("In", _value_of(
        (_op("Conv2D", linear_op_name),
         ("In", _value_of((_op("ExpandDims"), ("In", inputs, Tensor()))),
          _value_of((_op("ExpandDims"),
                     ("In", Variable(weights_name), Tensor()))))))))
    return ("?:choice", direct, conv1d)

  to_batch = _value_of((_op("SpaceToBatchND"),
                        ("In", in_pattern, Tensor("block_shape"), Tensor())))
  dilated = (_op("BatchToSpaceND"),
             ("In", _value_of(core(to_batch)), Tensor(), Tensor()))
  linear = ("?:choice", core(in_pattern), dilated)
  with_bias = _either_order(_ops(_ADD_OPS), _value_of(linear),
                            _variable_maybe_reshaped(biases_name))
  return (Tensor(output_name), ("In", ("?:choice", with_bias, linear)))


def Embed(in_pattern=Tensor("in"),
          linear_op_name="linear_op",
          weights_name="weights",
          axis_name="axis",
          output_name="pre_activations"):
  """An embedding lookup: the rows `in` (integer ids) of a variable table."""
  two_inputs = (_ops(("Gather", "ResourceGather"), linear_op_name),
                ("In", Variable(weights_name), in_pattern))
  with_axis = (_op("GatherV2", linear_op_name),
               ("In", Variable(weights_name), in_pattern, Tensor(axis_name)))
  return (Tensor(output_name), ("In", ("?:choice", two_inputs, with_axis)))


def ScaleAndShift(in_pattern=Tensor("in"),
                  scale_name="scale",
                  shift_name="shift",
                  output_name="out"):
  """in * scale (+ shift), scale and shift variables (either operand
  order)."""
  scale = _either_order(_op("Mul"), in_pattern, Variable(scale_name))
  shifted = _either_order(_ops(_ADD_OPS), _value_of(scale),
                          Variable(shift_name))
  return (Tensor(output_name), ("In", ("?:choice", shifted, scale)))


def BatchNorm(in_pattern=Tensor("in"),
              scale_name="scale",
              offset_name="offset",
              output_name="out"):
  """tf.nn.batch_normalization: in * inv + (offset - mean * inv), where
  inv = rsqrt(variance + eps) (* scale)."""
  inv = (Tensor("inv"), ("In", ("?:choice", _op("Rsqrt"), _either_order(
      _op("Mul"), _value_of(_op("Rsqrt")), Tensor(scale_name)))))
  mean_times_inv = _value_of(_either_order(_op("Mul"), Tensor(), inv))
  shift = ("?:choice",
           _value_of((_op("Sub"), ("In", Tensor(offset_name),
                                   mean_times_inv))),
           mean_times_inv)  # no offset: (-mean) * inv
  scaled = _value_of(_either_order(_op("Mul"), in_pattern, inv))
  return (Tensor(output_name),
          ("In", _either_order(_ops(("Add", "AddV2")), scaled, shift)))


def _first_output(node):
  return util.is_tensor(node) and node.value_index == 0


def FusedBatchNormOutput(in_pattern=Tensor("in"),
                         scale_name="scale",
                         offset_name="offset",
                         output_name="out"):
  """The normalized output of tf.nn.fused_batch_norm (FusedBatchNorm,
  V2 or V3)."""
  return (("?", output_name, util.is_tensor, _first_output),
          ("In", (_ops(("FusedBatchNorm", "FusedBatchNormV2",
                        "FusedBatchNormV3")),
                  ("In", in_pattern, Tensor(scale_name), Tensor(offset_name),
                   Tensor(), Tensor()))))


Nonlinearity = ("?:choice", _op("Relu"), _op("Tanh"))


def Layer(in_pattern=Tensor("in"), **kwargs):
  """nonlinearity(Affine(...)), binding 'activations' to the output."""
  return (Tensor("activations"),
          ("In", (Nonlinearity, ("In", Affine(in_pattern, **kwargs)))))


def LayerWithBatchNorm(in_pattern=Tensor("in")):
  """nonlinearity(BatchNorm(Affine(...))), binding 'final_activations'."""
  return (Tensor("final_activations"),
          ("In", (Nonlinearity, ("In", BatchNorm(Affine(in_pattern))))))
