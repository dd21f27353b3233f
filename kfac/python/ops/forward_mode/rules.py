"""Forward-mode rules: the tangents of one op's outputs from its inputs'.

A rule is `rule(op, tangents) -> [tangent or None per output]`, where
`tangents` holds one tangent (a tensor shaped like the input) or None per
input of `op`. The ops here are those whose generic treatment (the op's
gradient differentiated again, see walk.py) costs more than the direct
formula: the broadcasting adds (their gradient sums over the broadcast
axes and the second pass materialises the broadcast), and the matrix
products and convolutions that dominate a network. The rest are the cheap
ops met on every path, where a direct rule saves a dummy cotangent per op,
among them batch normalization's StopGradient, SquaredDifference and Rsqrt
(on ResNet50, 318 of the 322 ops of its two products that took the generic
path: each built a dummy, the op's gradient and its derivative).

Attention's ops (Einsum, Softmax, Erfc of the exact GELU) have direct
rules too, and the ops keras.applications convnets add on the path:
padding (Pad, PadV2, MirrorPad), Keras 3's dropout (SelectV2), ReLU6,
LeakyReLU, ELU, and swish / SiLU, whose `tf.nn.silu` ends in an IdentityN
carrying a custom gradient (EfficientNetB0: 98 of the 126 ops of its two
products that took the generic path were these IdentityNs).

MaxPool keeps the generic path (MaxPoolGradGrad, about 9 ms per pooling
and tangent on the benchmark convnet): the tangent at each window's first
maximum through strided slices and selects cost 6x that on CPU, and
through an argmax pooling and a gather 1.4x.

Every rule is exact: the derivative of the op, not an approximation.
"""

import math

import tensorflow as tf


def _attr(op, name, default=None):
  try:
    return op.get_attr(name)
  except ValueError:
    return default


def _str(value):
  return value.decode() if isinstance(value, bytes) else value


def _sum(terms):
  terms = [t for t in terms if t is not None]
  if not terms:
    return None
  total = terms[0]
  for t in terms[1:]:
    total = total + t
  return total


def _broadcast_to_output(tangent, source, out):
  """`tangent` (shaped like `source`) broadcast to `out`'s shape."""
  if (source.shape.is_fully_defined() and out.shape.is_fully_defined() and
      source.shape == out.shape):
    return tangent
  return tf.broadcast_to(tangent, tf.shape(out))


# ------------------------------------------------------------ linear in x
def _identity(op, tangents):
  return [tangents[0]]


def _first_input(fn):
  """A rule for an op linear in its first input, the others being shapes,
  axes or indices: the same op applied to the tangent."""
  def rule(op, tangents):
    if tangents[0] is None:
      return [None] * len(op.outputs)
    return [fn(op, tangents[0])]
  return rule


def _pad(op, t):
  """Pad / PadV2 (zeros around the tangent) / MirrorPad (the tangent
  mirrored like the input)."""
  paddings = op.inputs[1]
  if op.type == "MirrorPad":
    return tf.raw_ops.MirrorPad(input=t, paddings=paddings,
                                mode=op.get_attr("mode"))
  return tf.raw_ops.Pad(input=t, paddings=paddings)


def _cast(op, t):
  dtype = op.outputs[0].dtype
  return tf.cast(t, dtype) if dtype.is_floating or dtype.is_complex else None


_LINEAR_IN_FIRST = {
    "Reshape": lambda op, t: tf.reshape(t, op.inputs[1]),
    "Neg": lambda op, t: -t,
    "Cast": _cast,
    "Transpose": lambda op, t: tf.transpose(t, op.inputs[1]),
    "ExpandDims": lambda op, t: tf.expand_dims(t, op.inputs[1]),
    "Squeeze": lambda op, t: tf.squeeze(t, _attr(op, "squeeze_dims") or
                                        None),
    "Sum": lambda op, t: tf.reduce_sum(t, op.inputs[1],
                                       keepdims=op.get_attr("keep_dims")),
    "Mean": lambda op, t: tf.reduce_mean(t, op.inputs[1],
                                         keepdims=op.get_attr("keep_dims")),
    "Pad": _pad,
    "MirrorPad": _pad,
}


# ------------------------------------------------------------ sums, products
def _add(op, tangents):
  x, y = op.inputs[0], op.inputs[1]
  out = op.outputs[0]
  tx, ty = tangents[0], tangents[1]
  if op.type == "Sub" and ty is not None:
    ty = -ty
  if tx is not None and ty is not None:
    return [tx + ty]  # the add broadcasts like the op did
  if tx is not None:
    return [_broadcast_to_output(tx, x, out)]
  return [_broadcast_to_output(ty, y, out)]


def _bias_add(op, tangents):
  tx, tb = tangents[0], tangents[1]
  data_format = _str(_attr(op, "data_format", "NHWC"))
  if tb is None:
    return [tx]
  if tx is None:
    tx = tf.zeros_like(op.outputs[0])
  return [tf.nn.bias_add(tx, tb, data_format=data_format)]


def _mul(op, tangents):
  x, y = op.inputs[0], op.inputs[1]
  tx, ty = tangents[0], tangents[1]
  # Each product broadcasts to the output's shape by itself.
  return [_sum([None if tx is None else tx * y,
                None if ty is None else x * ty])]


def _add_n(op, tangents):
  out = op.outputs[0]
  return [_sum([t if t is None else _broadcast_to_output(t, x, out)
                for t, x in zip(tangents, op.inputs)])]


def _matmul(op, tangents):
  a, b = op.inputs[0], op.inputs[1]
  ta, tb = tangents[0], tangents[1]
  if op.type == "MatMul":
    kw = dict(transpose_a=op.get_attr("transpose_a"),
              transpose_b=op.get_attr("transpose_b"))
  else:  # BatchMatMulV2 / V3 of real types: adjoint is transpose
    kw = dict(adjoint_a=op.get_attr("adj_x"), adjoint_b=op.get_attr("adj_y"))
  return [_sum([None if ta is None else tf.linalg.matmul(ta, b, **kw),
                None if tb is None else tf.linalg.matmul(a, tb, **kw)])]


def _einsum(op, tangents):
  """An einsum is linear in each input: the sum over the inputs with a
  tangent of the same einsum with that input replaced by its tangent (the
  generic path, the second derivative of its gradient, ran einsums of
  other layouts that cost several times the forward one on attention's
  equations)."""
  equation = _str(op.get_attr("equation"))
  terms = []
  for i, t in enumerate(tangents):
    if t is None:
      continue
    inputs = list(op.inputs)
    inputs[i] = t
    terms.append(tf.raw_ops.Einsum(inputs=inputs, equation=equation))
  return [_sum(terms)]


def _conv2d(op, tangents):
  x, w = op.inputs[0], op.inputs[1]
  tx, tw = tangents[0], tangents[1]
  attrs = dict(strides=op.get_attr("strides"),
               padding=_str(op.get_attr("padding")),
               explicit_paddings=_attr(op, "explicit_paddings", []),
               data_format=_str(op.get_attr("data_format")),
               dilations=op.get_attr("dilations"))
  if op.type == "DepthwiseConv2dNative":
    conv = tf.raw_ops.DepthwiseConv2dNative
  else:
    conv = tf.raw_ops.Conv2D
  return [_sum([None if tx is None else conv(input=tx, filter=w, **attrs),
                None if tw is None else conv(input=x, filter=tw, **attrs)])]


def _pad_v2(op, tangents):
  """PadV2(x, paddings, c): the tangent of x padded with zeros, plus the
  tangent of the scalar c on the padded border."""
  x, paddings, c = op.inputs[0], op.inputs[1], op.inputs[2]
  tx, tc = tangents[0], tangents[2]
  border = None
  if tc is not None:
    mask = tf.raw_ops.PadV2(input=tf.zeros_like(x), paddings=paddings,
                            constant_values=tf.ones_like(c))
    border = mask * tc
  return [_sum([None if tx is None else
                tf.raw_ops.Pad(input=tx, paddings=paddings), border])]


def _select(op, tangents):
  """Select / SelectV2(cond, a, b): the same selection of the tangents (a
  missing one is zero; SelectV2 broadcasts them like the op)."""
  cond, a, b = op.inputs
  ta, tb = tangents[1], tangents[2]
  if ta is None and tb is None:
    return [None]
  ta = tf.zeros_like(a) if ta is None else ta
  tb = tf.zeros_like(b) if tb is None else tb
  if op.type == "SelectV2":
    return [tf.raw_ops.SelectV2(condition=cond, t=ta, e=tb)]
  return [tf.raw_ops.Select(condition=cond, x=ta, y=tb)]


def _identity_n(op, tangents):
  """IdentityN passes each input on. With a custom gradient (its
  `_gradient_op_type`) only where that gradient is known to be the
  derivative of the ops that computed the input (tf.nn.silu, `_silu_parts`);
  elsewhere the generic path pushes the tangent through the custom
  gradient, which is what backpropagation, and so the gradient being
  preconditioned, uses. (TensorFlow's eager forward mode follows the
  forward ops instead; the two agree where the custom gradient is the
  derivative.)"""
  parts = _silu_parts(op)
  if parts is None:
    return list(tangents)
  return [_silu_tangent(parts, tangents)] + list(tangents[1:])


def _silu_tangent(parts, tangents):
  """y = x sigmoid(z), z = beta x: dy = s (1 + z (1 - s)) dx
  + x^2 s (1 - s) dbeta, with s the forward pass's sigmoid. The factor of
  dx depends on the forward values only, so the two products of the
  quadratic model share it (one multiply each), where pushing the tangent
  through the forward ops costs five elementwise ops per product."""
  x, s, z, has_beta = parts
  tx, tb = tangents[1], tangents[2] if has_beta else None
  terms = []
  if tx is not None:
    terms.append(tx * (s * (1.0 + z * (1.0 - s))))
  if tb is not None:
    terms.append(tb * (x * x * s * (1.0 - s)))
  return _sum(terms)


def _silu_parts(op):
  """(x, sigmoid output, sigmoid input, whether beta enters) when `op` is
  tf.nn.silu's IdentityN(y, x, beta) with y = x * sigmoid(beta * x) or
  x * sigmoid(x), else None. Its custom gradient is that function's
  derivative (a numerically safer formula for it)."""
  try:
    op.get_attr("_gradient_op_type")
  except ValueError:
    return None  # a plain IdentityN
  if len(op.inputs) != 3:
    return None
  y, x, beta = op.inputs
  if y.op.type != "Mul":
    return None
  for a, b in (tuple(y.op.inputs), tuple(y.op.inputs)[::-1]):
    if a.ref() == x.ref() and b.op.type == "Sigmoid":
      z = b.op.inputs[0]
      if z.ref() == x.ref():
        return x, b, z, False
      if (z.op.type == "Mul" and
          {t.ref() for t in z.op.inputs} == {x.ref(), beta.ref()}):
        return x, b, z, True
  return None


def _identity_n_supported(op):
  try:
    op.get_attr("_gradient_op_type")
  except ValueError:
    return True  # a plain IdentityN
  return _silu_parts(op) is not None


# ------------------------------------------------------------ nonlinear
def _elementwise(derivative):
  """A rule for a one-input elementwise op: derivative(op, t), the
  tangent t scaled by the op's derivative (TensorFlow's *Grad kernels,
  which do exactly that for a gradient)."""
  def rule(op, tangents):
    t = tangents[0]
    return [None if t is None else derivative(op, t)]
  return rule


_ELEMENTWISE = {
    "Relu": lambda op, t: tf.raw_ops.ReluGrad(gradients=t,
                                              features=op.outputs[0]),
    # On the output, as TensorFlow's gradient: 0 < y < 6 exactly where
    # 0 < x < 6. Reading the input instead kept the pre-activation alive
    # and cost 15 % of MobileNetV2's products (products_step_time.py).
    "Relu6": lambda op, t: tf.raw_ops.Relu6Grad(gradients=t,
                                                features=op.outputs[0]),
    "LeakyRelu": lambda op, t: tf.raw_ops.LeakyReluGrad(
        gradients=t, features=op.inputs[0], alpha=op.get_attr("alpha")),
    "Elu": lambda op, t: tf.raw_ops.EluGrad(gradients=t,
                                            outputs=op.outputs[0]),
    "Tanh": lambda op, t: tf.raw_ops.TanhGrad(y=op.outputs[0], dy=t),
    "Sigmoid": lambda op, t: tf.raw_ops.SigmoidGrad(y=op.outputs[0], dy=t),
    # Batch normalization's (Keras 3 builds it from these ops).
    "Rsqrt": lambda op, t: tf.raw_ops.RsqrtGrad(y=op.outputs[0], dy=t),
}


def _squared_difference(op, tangents):
  """d (x - y)^2 = 2 (x - y) (dx - dy); the product with the output-shaped
  x - y broadcasts like the op did."""
  x, y = op.inputs[0], op.inputs[1]
  tx, ty = tangents[0], tangents[1]
  if ty is None:
    t = tx
  elif tx is None:
    t = -ty
  else:
    t = tx - ty
  return [2.0 * (x - y) * t]


def _softmax(op, tangents):
  """y = softmax(x) over the last axis: dy = y * (dx - sum(y * dx))."""
  t = tangents[0]
  if t is None:
    return [None]
  y = op.outputs[0]
  return [y * (t - tf.reduce_sum(y * t, axis=-1, keepdims=True))]


def _erfc(op, tangents):
  """d erfc(x) = -2 / sqrt(pi) exp(-x^2) dx (Keras's exact GELU)."""
  t = tangents[0]
  if t is None:
    return [None]
  x = op.inputs[0]
  scale = tf.constant(-2.0 / math.sqrt(math.pi), x.dtype)
  return [scale * tf.exp(-tf.square(x)) * t]


def _stop_gradient(op, tangents):
  del tangents  # no tangent flows through, as no gradient does
  return [None] * len(op.outputs)


def _batch_matmul_supported(op):
  return op.type != "BatchMatMulV3" or (
      op.get_attr("Ta") == op.get_attr("Tb") == op.get_attr("Tout"))


RULES = {
    "Identity": _identity,
    "Snapshot": _identity,
    "Add": _add,
    "AddV2": _add,
    "Sub": _add,
    "BiasAdd": _bias_add,
    "Mul": _mul,
    "AddN": _add_n,
    "MatMul": _matmul,
    "BatchMatMulV2": _matmul,
    "BatchMatMulV3": _matmul,
    "Einsum": _einsum,
    "Softmax": _softmax,
    "Erfc": _erfc,
    "Conv2D": _conv2d,
    "DepthwiseConv2dNative": _conv2d,
    "PadV2": _pad_v2,
    "Select": _select,
    "SelectV2": _select,
    "IdentityN": _identity_n,
    # Batch normalization's (Keras 3 builds it from these ops).
    "SquaredDifference": _squared_difference,
    "StopGradient": _stop_gradient,
}
RULES.update({name: _first_input(fn) for name, fn in _LINEAR_IN_FIRST.items()})
RULES.update({name: _elementwise(fn) for name, fn in _ELEMENTWISE.items()})

# Rules that apply only to some attribute values; otherwise the generic
# path handles the op.
_CONDITIONS = {
    "BatchMatMulV3": _batch_matmul_supported,
    "IdentityN": _identity_n_supported,
}

# Real dtypes only: the rules above use transpose for adjoint and ignore
# conjugation.
_REAL = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def rule_for(op):
  """The direct rule for `op`, or None (use the generic path)."""
  rule = RULES.get(op.type)
  if rule is None:
    return None
  if any(o.dtype.base_dtype not in _REAL for o in op.outputs
         if o.dtype.is_floating or o.dtype.is_complex):
    return None
  condition = _CONDITIONS.get(op.type)
  if condition is not None and not condition(op):
    return None
  return rule
