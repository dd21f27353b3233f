"""Which EinsumDense layers are dense layers, and how their axes split.

An EinsumDense equation `lhs,rhs->out` is a dense map over shared leading
axes when lhs = S I, rhs = I O and out = S O (S: the shared leading axes,
the batch first, or "..." followed by letters; I: the contracted input
axes; O: the output axes; every letter distinct): the kernel is then the
[prod(I), prod(O)] weight of a dense layer applied at every position of S,
reshaped. MultiHeadAttention's projections are such maps: the query, key
and value projections `abc,cde->abde` (S = ab, I = c, O = de) and the
output projection `abcd,cde->abe` (S = ab, I = cd, O = e). A bias is a
dense layer's bias when it spans exactly the output axes O.
"""

import collections

DenseAxes = collections.namedtuple("DenseAxes", ["input_axes", "output_axes"])


def dense_axes(equation):
  """DenseAxes(number of input axes, number of output axes) of an EinsumDense
  equation that is a dense map over shared leading axes, else None."""
  if not isinstance(equation, str) or "->" not in equation or (
      equation.count(",") != 1):
    return None
  operands, out = equation.replace(" ", "").split("->")
  lhs, rhs = operands.split(",")
  ellipsis = lhs.startswith("...")
  if ellipsis != out.startswith("..."):
    return None
  if ellipsis:
    lhs, out = lhs[3:], out[3:]
  for part in (lhs, rhs, out):
    if not part.isalpha() or not part.islower() or (
        len(set(part)) != len(part)):
      return None
  # Shared axes S: the batch axis at least (or the ellipsis holds it).
  for shared in range(0 if ellipsis else 1, len(lhs)):
    inputs = lhs[shared:]
    outputs = rhs[len(inputs):]
    if (rhs.startswith(inputs) and outputs and
        out == lhs[:shared] + outputs and
        not set(outputs) & set(lhs)):
      return DenseAxes(len(inputs), len(outputs))
  return None


def bias_is_dense(equation, bias_axes, bias_shape, kernel_shape):
  """Whether an EinsumDense bias (axes `bias_axes`, shape `bias_shape`) is
  the bias of the dense map: over exactly the output axes."""
  axes = dense_axes(equation)
  if axes is None or not bias_axes:
    return False
  out = equation.replace(" ", "").split("->")[1]
  outputs = out[len(out) - axes.output_axes:]
  return (sorted(bias_axes) == sorted(outputs) and
          tuple(bias_shape) == tuple(kernel_shape[-axes.output_axes:]))
