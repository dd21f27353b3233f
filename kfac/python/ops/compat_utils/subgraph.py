"""SubGraph: the ops and tensors that a set of outputs depends on."""

import tensorflow as tf

# Ops that pass a variable's value on unchanged: a use of their output is a
# use of the variable. (kfac 0.2.x also relayed ResourceGather, so a lookup
# whose rows fed three ops counted three uses; a gather is one use here, as
# the GatherV2 of a reference variable was there.)
_RELAY_OP_TYPES = frozenset(["Identity", "ReadVariableOp", "Enter"])


def _is_resource_variable(var):
  return getattr(var, "handle", None) is not None and (
      getattr(var.handle, "dtype", None) == tf.resource)


def _key(node):
  """A hashable key: tensors (unhashable in TF2) by reference."""
  return node.ref() if isinstance(node, tf.Tensor) else node


class SubGraph(object):
  """All ancestors (tensors and ops) of `outputs` in their graph.

  Only for graph tensors (a TF1 graph or a tf.function being traced);
  eager tensors have no producing ops.
  """

  def __init__(self, outputs):
    outputs = list(outputs)
    if not outputs:
      raise ValueError("SubGraph needs at least one output tensor.")
    for t in outputs:
      if not hasattr(t, "graph") or not hasattr(t, "op"):
        raise ValueError("SubGraph works on graph tensors and ops, got %r "
                         "(eager tensors have no graph)." % (t,))
    self._members = set()
    stack = list(outputs)
    while stack:
      node = stack.pop()
      if _key(node) in self._members:
        continue
      self._members.add(_key(node))
      if isinstance(node, tf.Tensor):
        stack.append(node.op)
      elif isinstance(node, tf.Operation):
        stack.extend(node.inputs)
        stack.extend(node.control_inputs)
    self._graph = outputs[0].graph

  def is_member(self, node):
    """Whether `node` (a tensor or an op) is in this subgraph."""
    return _key(node) in self._members

  def filter_list(self, node_list):
    """The members of `node_list` that are in this subgraph, in order."""
    return [node for node in node_list if self.is_member(node)]

  def _consumers(self, tensor, found):
    for consumer in tensor.consumers():
      if consumer.type in _RELAY_OP_TYPES:
        for out in consumer.outputs:
          self._consumers(out, found)
      else:
        found.add(consumer)

  def variable_consumers(self, var):
    """The ops of this subgraph that use `var`'s value (through identity
    and read ops), as a list in a stable order.

    Raises:
      ValueError: if `var` is not a variable.
    """
    if not isinstance(var, tf.Variable) and not hasattr(var, "handle"):
      raise ValueError("%s does not appear to be a variable." % (var,))
    consumers = set()
    if _is_resource_variable(var):
      handles = [var.handle]
      captures = getattr(self._graph, "captures", None)
      if captures:  # a FuncGraph: the variable enters as a placeholder
        handles = [inner for outer, inner in captures
                   if outer is var.handle] or handles
      for handle in handles:
        self._consumers(handle, consumers)
    else:  # a TF1 reference variable
      self._consumers(var.value(), consumers)
    return sorted((op for op in consumers if _key(op) in self._members),
                  key=lambda op: op.name)

  def variable_uses(self, var):
    """How many ops of this subgraph use `var`'s value (through identity
    and read ops).

    Raises:
      ValueError: if `var` is not a variable.
    """
    return len(self.variable_consumers(var))
