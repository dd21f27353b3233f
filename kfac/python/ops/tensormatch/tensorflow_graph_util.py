"""Graph nodes as the pattern matcher sees them (layer 1 plumbing).

The matcher (graph_matcher.py) walks a graph of *nodes*: operations and
tensors. An operation's neighbours are its input tensors and its output
tensors; a tensor's are its producing operation and its consuming
operations. Ops that only pass a value on (Identity, a resource variable's
ReadVariableOp, a while-loop Enter, ...) are looked through, so that a
pattern "MatMul of some tensor and a variable" matches however the weights
were read.

Variables appear in a graph as one of these tensors:
* a TF1 reference variable: the output of its `VariableV2` op;
* a resource variable in the graph it was created in: its `VarHandleOp`
  output (`var.handle`);
* a resource variable used inside a `tf.function`: the resource-typed
  placeholder through which the FuncGraph captured `var.handle`.
`variable_tensors(var, graph)` gives the ones that stand for `var`.
"""

import tensorflow as tf

# Ops whose output is their (first) input, value-wise.
_PASS_THROUGH_OPS = frozenset(
    ["Identity", "IdentityN", "ReadVariableOp", "Enter", "RefIdentity",
     "Snapshot"])


def is_op(node):
  """Whether `node` is a graph operation."""
  return isinstance(node, tf.Operation)


def is_tensor(node):
  """Whether `node` is a symbolic (graph) tensor."""
  return isinstance(node, tf.Tensor) and hasattr(node, "op") and (
      not isinstance(node, tf.Variable)) and _has_graph(node)


def _has_graph(tensor):
  try:
    return tensor.graph is not None
  except AttributeError:  # an eager tensor
    return False


def is_var(node):
  """Whether the tensor `node` stands for a variable (see module doc)."""
  if isinstance(node, tf.Variable):
    return True
  if not is_tensor(node):
    return False
  op_type = node.op.type
  if op_type.startswith("Variable"):  # VariableV2 / Variable (TF1 refs)
    return True
  if node.dtype == tf.resource and op_type in ("VarHandleOp", "Placeholder"):
    return True
  return False


def is_const(node):
  return is_tensor(node) and node.op.type == "Const"


def is_placeholder(node):
  return is_tensor(node) and node.op.type == "Placeholder"


def is_leaf(node):
  """Variables, constants and placeholders: tensors with no inputs to
  look through."""
  return is_var(node) or is_const(node) or is_placeholder(node)


def is_identity(node):
  """Whether the op `node` passes its input on unchanged."""
  if not is_op(node):
    return False
  return (node.type in _PASS_THROUGH_OPS or
          "convert_gradient_to_tensor" in node.type)


def op_type_is(typename):
  """A predicate: is the node an op of type `typename`?"""

  def predicate(node):
    return is_op(node) and node.type == typename

  predicate.__name__ = "is_%s_op" % typename
  return predicate


def reduce_identity_ops(node):
  """The tensor that `node` is a pass-through copy of (itself if none)."""
  seen = 0
  while is_tensor(node) and is_identity(node.op) and node.op.inputs:
    # IdentityN passes input i to output i.
    index = node.value_index if node.op.type == "IdentityN" else 0
    if index >= len(node.op.inputs):
      break
    node = node.op.inputs[index]
    seen += 1
    if seen > 10000:  # a cycle would be a malformed graph
      raise ValueError("Cycle of identity ops at %s." % node.name)
  return node


def expand_inputs(node):
  """The input nodes of `node`, as the matcher sees them.

  An op: its input tensors (pass-through ops looked through). A tensor
  that is not a leaf: a one-element list with its producing op. A list of
  tensors all produced by one op: that op. Otherwise None (no inputs).

  Raises:
    ValueError: for a list of tensors produced by different ops.
  """
  if is_op(node):
    return [reduce_identity_ops(t) for t in node.inputs]
  if is_tensor(node):
    if is_leaf(node):
      return None
    return [reduce_identity_ops(node).op]
  if isinstance(node, list) and node and all(is_tensor(t) for t in node):
    producers = []
    for t in node:
      op = reduce_identity_ops(t).op
      if not any(op is p for p in producers):
        producers.append(op)
    if len(producers) == 1:
      return producers
    raise ValueError("The tensors %s come from %d different ops." %
                     ([t.name for t in node], len(producers)))
  return None


def expand_outputs(node):
  """The output nodes of `node`: an op's output tensors, a tensor's (or a
  variable's) consuming ops."""
  if is_op(node):
    return list(node.outputs)
  if isinstance(node, tf.Variable):
    return list(node.value().consumers())
  if is_tensor(node):
    return list(node.consumers())
  return None


def make_op_pattern(typename):
  """A pattern constructor for ops of type `typename`: calling it (with an
  optional binding name) gives an element pattern."""

  def op_pattern(name=None):
    return ("?", name, op_type_is(typename))

  op_pattern.__name__ = str(typename)
  op_pattern.__qualname__ = str(typename)
  return op_pattern


def import_ops_no_clobber(dct, op_names):
  """Puts an op pattern constructor into `dct` for each name of `op_names`
  that `dct` does not define yet."""
  for name in op_names:
    if not name.startswith("_") and name not in dct:
      dct[name] = make_op_pattern(name)


def variable_tensors(var, graph):
  """The tensors of `graph` that stand for the variable `var` (see the
  module docstring); empty if `var` does not appear in `graph`."""
  out = []
  handle = getattr(var, "handle", None)
  if handle is not None and getattr(handle, "dtype", None) == tf.resource:
    if _has_graph(handle) and handle.graph is graph:
      out.append(handle)
    for external, internal in _captures(graph):
      if external is handle:
        out.append(internal)
    return out
  op = getattr(var, "op", None)  # a TF1 reference variable
  if op is not None and getattr(op, "graph", None) is graph and op.outputs:
    out.append(op.outputs[0])
  return out


def _captures(graph):
  try:
    return list(getattr(graph, "captures", ()) or ())
  except (AttributeError, TypeError):
    return []


def node_key(node):
  """A hashable stand-in for a node: tensors and variables (unhashable in
  TF2) by `.ref()`, everything else (ops, refs) as it is."""
  if isinstance(node, tf.Variable) or isinstance(node, tf.Tensor):
    return node.ref()
  return node
