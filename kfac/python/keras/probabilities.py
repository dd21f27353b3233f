"""Cross-entropies on probabilities: when a model output is one, and the
logits to register it with.

Keras computes a cross-entropy with from_logits=False from the logits
behind the output when the output comes straight out of a Softmax / Sigmoid
op (see loss_registration.find_logits). Any other output it takes as
probabilities p: it clips them to [eps, 1 - eps] (categorical ones after
dividing by their sum over the class axis) and takes their logs. An
average of sigmoid or softmax outputs (an ensemble), a concatenation of
them or a gate between them are such outputs.

`value_range(tensor)` bounds the values of a graph tensor by following the
ops that make it (interval arithmetic over a small table of ops); it
decides whether an output is a probability:
  * within [0, 1]: probabilities;
  * a bound outside [0, 1] (e.g. a linear layer's output, MatMul / BiasAdd,
    unbounded): not probabilities, and registering them is an error;
  * unknown (an op outside the table on the way): taken as probabilities,
    as Keras does.

`probability_logits(kind, p)` returns logits z whose predictive
distribution is the one Keras's loss uses on p: the Bernoulli of
clip(p) (z = log(p_c) - log(1 - p_c)) and the categorical of
clip(p / sum(p)) (z = log(p_c)). K-FAC registers the logits loss on z; its
Fisher w.r.t. the network is the Fisher of that distribution w.r.t. p (the
Fisher is invariant under the change of parameters p -> z), e.g.
1 / (p (1 - p)) per Bernoulli output.
"""

import math

import numpy as np
import tensorflow as tf

_INF = math.inf
_UNBOUNDED = (-_INF, _INF)
_PROBABILITY = (0.0, 1.0)
# Ops whose output takes the values of their (first) input, or of all of
# their tensor inputs (concatenations, stacks): the hull of those ranges.
_SAME_AS_FIRST = frozenset([
    "Identity", "Snapshot", "StopGradient", "PreventGradient", "Reshape",
    "Squeeze", "ExpandDims", "StridedSlice", "Slice", "GatherV2", "Gather",
    "GatherNd", "Transpose", "Tile", "BroadcastTo", "Mean", "Max", "Min",
    "Cast", "EnsureShape", "CheckNumerics", "CheckNumericsV2", "MaxPool",
    "AvgPool", "MaxPool3D", "AvgPool3D", "ReverseV2", "Roll", "Switch",
    "PlaceholderWithDefault",
])
_SAME_AS_ALL = frozenset(["ConcatV2", "Concat", "Pack", "IdentityN", "AddN",
                          "Merge"])
# Ops with a fixed range whatever their input.
_FIXED = {
    "Sigmoid": _PROBABILITY, "Softmax": _PROBABILITY,
    "Tanh": (-1.0, 1.0), "Softsign": (-1.0, 1.0), "Relu6": (0.0, 6.0),
    "Softplus": (0.0, _INF), "Exp": (0.0, _INF), "Square": (0.0, _INF),
    "Abs": (0.0, _INF), "Sqrt": (0.0, _INF),
}
# Linear algebra / layer ops: unbounded outputs.
_LINEAR = frozenset([
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "BiasAdd",
    "Conv1D", "Conv2D", "Conv3D", "DepthwiseConv2dNative",
    "Conv2DBackpropInput", "Conv3DBackpropInputV2", "Einsum", "XlaEinsum",
    "LeakyRelu", "Elu", "Selu", "Log", "LogSoftmax", "FusedBatchNorm",
    "FusedBatchNormV2", "FusedBatchNormV3",
])
_MAX_OPS = 200  # ops visited before giving up (the range is then unknown)


def _const_range(tensor):
  value = tf.get_static_value(tensor)
  if value is None:
    return None
  value = np.asarray(value, dtype=np.float64)
  if value.size == 0 or not np.all(np.isfinite(value)):
    return None
  return (float(value.min()), float(value.max()))


def _mul(a, b):
  products = []
  for x in a:
    for y in b:
      # 0 * inf: the bound on that side is 0 (a zero factor is exact).
      products.append(0.0 if x == 0 or y == 0 else x * y)
  return (min(products), max(products))


def _div(a, b):
  if b[0] <= 0 <= b[1]:
    return None
  # Each endpoint divided (not multiplied by a reciprocal): n / n is 1.
  quotients = [x / y for x in a for y in b]
  return (min(quotients), max(quotients))


def _hull(ranges):
  if any(r is None for r in ranges) or not ranges:
    return None
  return (min(r[0] for r in ranges), max(r[1] for r in ranges))


class _RangeFinder:
  """Memoised interval bounds of the tensors of one graph."""

  def __init__(self):
    self._ranges = {}
    self._visited = 0

  def range_of(self, tensor):
    key = tensor.ref()
    if key not in self._ranges:
      self._visited += 1
      self._ranges[key] = (None if self._visited > _MAX_OPS
                           else self._compute(tensor))
    return self._ranges[key]

  def _values(self, op):
    """The op's floating-point inputs (axes and shapes excluded)."""
    return [t for t in op.inputs if t.dtype.is_floating]

  def _compute(self, tensor):
    op = tensor.op
    kind = op.type
    if kind == "Const":
      return _const_range(tensor)
    if kind in _FIXED:
      return _FIXED[kind]
    if kind in _LINEAR:
      return _UNBOUNDED
    values = self._values(op)
    if kind in _SAME_AS_FIRST:
      return self.range_of(values[0]) if values else None
    if kind in _SAME_AS_ALL:
      ranges = [self.range_of(t) for t in values]
      if kind == "AddN":
        if any(r is None for r in ranges):
          return None
        return (sum(r[0] for r in ranges), sum(r[1] for r in ranges))
      return _hull(ranges)
    if kind == "Sum" and values:
      return None  # the count of summed entries is not tracked
    if len(values) != 2:
      if kind == "Relu" and values:
        r = self.range_of(values[0])
        return (0.0, _INF) if r is None else (max(r[0], 0.0),
                                              max(r[1], 0.0))
      if kind == "Neg" and values:
        r = self.range_of(values[0])
        return None if r is None else (-r[1], -r[0])
      if kind == "ClipByValue":
        r, lo, hi = [self.range_of(t) for t in op.inputs]
        if lo is None or hi is None:
          return None
        r = r or _UNBOUNDED
        return (min(max(r[0], lo[0]), hi[1]), max(min(r[1], hi[1]), lo[0]))
      return None
    a, b = [self.range_of(t) for t in values]
    if a is None or b is None:
      return None
    if kind == "Maximum":
      return (max(a[0], b[0]), max(a[1], b[1]))
    if kind == "Minimum":
      return (min(a[0], b[0]), min(a[1], b[1]))
    if kind in ("Add", "AddV2"):
      return (a[0] + b[0], a[1] + b[1])
    if kind == "Sub":
      return (a[0] - b[1], a[1] - b[0])
    if kind == "Mul":
      return _mul(a, b)
    if kind in ("RealDiv", "Div", "DivNoNan"):
      return _div(a, b)
    return None


def value_range(tensor):
  """(low, high) bounds of a graph tensor's values, or None if unknown."""
  if not hasattr(tensor, "op") or tensor.op is None:
    return None
  return _RangeFinder().range_of(tensor)


def is_within_probabilities(bounds):
  return bounds is not None and bounds[0] >= 0.0 and bounds[1] <= 1.0


def _epsilon():
  from kfac.python.keras import keras_flavor  # pylint: disable=g-import-not-at-top
  return float(keras_flavor.keras_module().backend.epsilon())


def probability_logits(kind, probabilities):
  """Logits whose distribution is the one Keras's `kind` loss (
  "binary_crossentropy", "categorical_crossentropy" or
  "sparse_categorical_crossentropy") applies to `probabilities`."""
  eps = _epsilon()
  p = probabilities
  if kind != "binary_crossentropy":
    p = p / tf.reduce_sum(p, axis=-1, keepdims=True)
  p = tf.clip_by_value(p, eps, 1.0 - eps)
  if kind == "binary_crossentropy":
    return tf.math.log(p) - tf.math.log1p(-p)
  return tf.math.log(p)
