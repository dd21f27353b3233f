"""Flat-vector plumbing shared by the curvature operators: flatten /
unflatten per-variable tensors, and argument checks that name the expected
length and the variables."""

import tensorflow as tf

from kfac.python.ops.tensors import utils


def describe(variables, limit=4):
  parts = ["%s %s" % (utils.variable_name(v), v.shape.as_list())
           for v in variables[:limit]]
  if len(variables) > limit:
    parts.append("... %d more" % (len(variables) - limit))
  return ", ".join(parts)


class FlatVectorOperator(tf.linalg.LinearOperator):
  """A LinearOperator over the flattened `variables` (a property of the
  subclass): flattening, unflattening, and products and solves that check
  their argument's length and dtype first."""

  @property
  def num_parameters(self):
    return sum(v.shape.num_elements() for v in self.variables)

  def flatten(self, tensors):
    """One vector (the operator's dtype) from tensors aligned with
    `variables` (a list, or one tensor for one variable)."""
    tensors = list(tensors) if isinstance(tensors, (list, tuple)) else [
        tensors]
    want = self.variables
    if len(tensors) != len(want):
      raise ValueError("%s.flatten takes %d tensors, one per variable (%s); "
                       "got %d." % (self.name, len(want), describe(want),
                                    len(tensors)))
    parts = []
    for t, v in zip(tensors, want):
      if isinstance(t, tf.IndexedSlices):
        t = tf.convert_to_tensor(t)
      t = tf.convert_to_tensor(t, dtype_hint=self.dtype)
      if not t.shape.is_compatible_with(v.shape):
        raise ValueError("%s.flatten: the tensor for variable %s has shape "
                         "%s, expected %s." % (self.name,
                                               utils.variable_name(v),
                                               t.shape, v.shape))
      parts.append(tf.reshape(tf.cast(t, self.dtype), [-1]))
    return tf.concat(parts, axis=0)

  def unflatten(self, vector):
    """Tensors shaped like `variables` from one flat vector."""
    vector = tf.convert_to_tensor(vector, dtype_hint=self.dtype)
    self._check_dim(vector, -1, "unflatten")
    if vector.shape.rank != 1:
      raise ValueError("%s.unflatten takes one vector [%d], got shape %s." %
                       (self.name, self.num_parameters, vector.shape))
    out, start = [], 0
    for v in self.variables:
      size = v.shape.num_elements()
      out.append(tf.reshape(vector[start:start + size], v.shape))
      start += size
    return out

  def _check_dim(self, x, axis, what):
    n = self.num_parameters
    rank = x.shape.rank
    dim = None if not rank else x.shape[axis]
    if rank == 0 or (dim is not None and dim != n):
      raise ValueError(
          "%s.%s: the operator acts on vectors of %d entries (the flattened "
          "variables %s); got a tensor of shape %s." %
          (self.name, what, n, describe(self.variables), x.shape))

  def _checked(self, x, axis, what):
    if isinstance(x, tf.linalg.LinearOperator):
      return x
    x = tf.convert_to_tensor(x, dtype_hint=self.dtype)
    if x.dtype.base_dtype != self.dtype:
      raise TypeError("%s.%s: expected a %s tensor, got %s." %
                      (self.name, what, self.dtype.name, x.dtype.name))
    self._check_dim(x, axis, what)
    return x

  def __tf_tracing_type__(self, context):
    del context
    raise TypeError(
        "%s (a %s) cannot be an argument of a tf.function: it is not a "
        "CompositeTensor. Use it from the function's closure (define the "
        "function where the operator is in scope)." %
        (self.name, type(self).__name__))

  def matmul(self, x, adjoint=False, adjoint_arg=False, name="matmul"):
    x = self._checked(x, -1 if adjoint_arg else -2, "matmul")
    return super().matmul(x, adjoint=adjoint, adjoint_arg=adjoint_arg,
                          name=name)

  def matvec(self, x, adjoint=False, name="matvec"):
    return super().matvec(self._checked(x, -1, "matvec"), adjoint=adjoint,
                          name=name)

  def solve(self, rhs, adjoint=False, adjoint_arg=False, name="solve"):
    rhs = self._checked(rhs, -1 if adjoint_arg else -2, "solve")
    return super().solve(rhs, adjoint=adjoint, adjoint_arg=adjoint_arg,
                         name=name)

  def solvevec(self, rhs, adjoint=False, name="solve"):
    return super().solvevec(self._checked(rhs, -1, "solvevec"),
                            adjoint=adjoint, name=name)
