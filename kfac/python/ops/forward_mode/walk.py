"""Jacobian-vector products on a built graph, op by op.

`jvp(ys, xs, tangents)` pushes the tangents of `xs` forward through the ops
that lie between `xs` and `ys`, in the graph's creation order. Each op uses
its direct rule (rules.py) or, failing one, the generic local trick: the
op's own gradient, built with a dummy cotangent on its outputs, is linear
in that cotangent, and differentiating it again with respect to the dummy
gives the op's forward derivative. Both are exact.

Why not one double-backward pass over the whole network (what kfac 0.2.x
did, and `fwd_gradients` with `local=False` still does): that builds the
full reverse pass with the dummy, and TensorFlow's gradients of broadcasting
adds and sums read the *shape* of the incoming gradient. With a batch
dimension unknown until run time, those Shape ops keep most of the dummy
reverse pass alive, so each product paid for a backward pass it did not
need (on the benchmark convnet, about 70 ms of a 420 ms adaptive step).
Op by op, a dummy is a zeros tensor of one op's output, and Shape ops
read only that.

Graphs whose path holds TF1 control flow (Switch / Merge / Enter / Exit /
NextIteration: while loops with back edges, conds split into frames) go
through the whole-graph method, which handles them.

What the walk refuses (UnsupportedGraph, naming the op; the callers then
use the whole-graph method): TF1 control flow; an op other than a read
taking a source variable's handle (a While or function call capturing the
variable); an op with no registered gradient; and an op fed a tangent with
a variant or resource output leading on to a y. Tangents are kept for
floating tensors only, yet a TensorList (tf.scan's stacked outputs and a
While's accumulators, map_fn's and TensorArray's unstacked inputs) carries
the derivative of what was put in it, so walking on would silently drop it.
Functional While / If / Case and function calls whose outputs on the path
are floating go through the generic trick (their gradients differentiate
through the function bodies, captured inputs included).

Where the walk gives None (a zero tangent) although a y is connected to
the sources, and why that is correct: integer, boolean and string outputs
(piecewise constant); ops registered as not differentiable and inputs
their gradient gives None (TensorFlow's own convention, which
ForwardAccumulator and tf.gradients follow too); `stop_gradients`; and
dependence through state only (a variable assigned from the sources and
read again has no data edge from them, as for tf.gradients).
"""

import weakref

import tensorflow as tf
# The registry of gradient functions (tf.gradients looks them up there).
from tensorflow.python.framework import ops as tf_ops  # pylint: disable=g-direct-tensorflow-import

from kfac.python.ops.forward_mode import rules

# TF1 control-flow ops: the op-by-op walk does not handle frames and back
# edges; the whole-graph double backward does.
_V1_CONTROL_FLOW = frozenset([
    "Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter", "Exit",
    "RefExit", "NextIteration", "RefNextIteration", "LoopCond"])


# Ops whose gradient function needs TensorFlow's gradient machinery
# (function calls and functional control flow, differentiated through their
# function graphs): their local gradient is built by tf.gradients.
_NEEDS_GRADIENTS_MACHINERY = frozenset([
    "If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase",
    "PartitionedCall", "StatefulPartitionedCall", "SymbolicGradient"])


class UnsupportedGraph(Exception):
  """The path holds ops the op-by-op walk does not handle."""


# {graph: {op name: rule}}: rules given for single ops by the code that
# built them (e.g. a function call running a recurrent loop, whose exact
# forward derivative is a tangent loop: kfac/python/keras/recurrent_loop.py).
_OP_RULES = weakref.WeakKeyDictionary()


def register_op_rule(op, rule):
  """Makes `rule(op, tangents) -> [tangent or None per output]` the
  forward derivative of `op` (one op of a built graph) in this walk."""
  _OP_RULES.setdefault(op.graph, {})[op.name] = rule


def _as_list(x):
  return list(x) if isinstance(x, (list, tuple)) else [x]


def _differentiable(t):
  return t.dtype.is_floating or t.dtype.is_complex


def _source(x, graph):
  """The graph tensor standing for `x`: a resource variable's handle (as
  seen from `graph`, capturing it in a function graph), else the tensor."""
  if isinstance(x, tf.Variable) and hasattr(x, "handle"):
    handle = x.handle
    # Eager handles have no graph; a function graph reads a captured copy.
    if getattr(handle, "graph", None) is not graph and hasattr(
        graph, "capture"):
      handle = graph.capture(handle)
    return handle
  if isinstance(x, tf.Variable):  # a TF1 reference variable
    return x._ref()  # pylint: disable=protected-access
  return tf.convert_to_tensor(x)


def _between(sources, ys, stops):
  """The ops on a path from a source to a y (not through `stops`), in
  creation order."""
  graph = ys[0].graph
  forward = set()
  stack = [s.ref() for s in sources]
  seen = set(stack)
  while stack:
    t = stack.pop().deref()
    for op in t.consumers():
      if op in forward:
        continue
      forward.add(op)
      for out in op.outputs:
        if out.ref() not in seen and out.ref() not in stops:
          seen.add(out.ref())
          stack.append(out.ref())
  backward = set()
  stack = [y.op for y in ys]
  while stack:
    op = stack.pop()
    if op in backward or op not in forward:
      continue
    backward.add(op)
    stack.extend(t.op for t in op.inputs if t.ref() not in stops)
  order = {op: i for i, op in enumerate(graph.get_operations())}
  return sorted(backward, key=lambda op: order[op])


def _read_rule(op, tangent):
  """Ops reading a variable's handle: ReadVariableOp and ResourceGather."""
  if op.type == "ReadVariableOp":
    return [tangent]
  if op.type == "ResourceGather":
    return [tf.gather(tangent, op.inputs[1],
                      batch_dims=op.get_attr("batch_dims"))]
  raise UnsupportedGraph("%s reads a variable" % op.type)


def _input_grads(op, dummies):
  """The gradients of `op`'s inputs for the cotangents `dummies` (one per
  differentiable output, None for the others).

  The op's registered gradient function is called directly: tf.gradients
  would first mark every op reachable from the op's inputs (the rest of
  the network downstream), so calling it op by op made building the
  products quadratic in the depth of the network. Ops that need the
  gradients machinery, and gradient functions that fail outside it, go
  through tf.gradients (with stop_gradients on the op's own inputs, so that
  another path from an input to this op is not added in)."""
  grad_fn = None
  if op.type not in _NEEDS_GRADIENTS_MACHINERY:
    try:
      grad_fn = tf_ops.get_gradient_function(op)
    except LookupError as e:  # no gradient registered
      raise UnsupportedGraph(str(e)) from e
    if grad_fn is None:  # registered as not differentiable
      return [None] * len(op.inputs)
  if grad_fn is not None:
    out_grads = [dummies.get(o.ref()) for o in op.outputs]
    try:
      with tf.name_scope(op.name.split("/")[-1] + "_jvp"):
        grads = grad_fn(op, *out_grads)
      grads = list(grads) if isinstance(grads, (list, tuple)) else [grads]
      if len(grads) == len(op.inputs):
        return grads
    except (TypeError, ValueError, AttributeError, NotImplementedError):
      pass  # e.g. a gradient function that wants None replaced by zeros
  outs = [o for o in op.outputs if o.ref() in dummies]
  try:
    return tf.gradients(outs, list(op.inputs),
                        grad_ys=[dummies[o.ref()] for o in outs],
                        stop_gradients=list(op.inputs))
  except LookupError as e:  # no gradient registered
    raise UnsupportedGraph(str(e)) from e


def _generic(op, tangents):
  """The op's forward derivative from its gradient (module docstring)."""
  outs = [o for o in op.outputs if _differentiable(o)]
  if not outs or all(t is None for t in tangents):
    return [None] * len(op.outputs)
  dummies = {o.ref(): tf.zeros_like(o) for o in outs}
  grads = _input_grads(op, dummies)
  pairs = [(tf.convert_to_tensor(g), t) for g, t in zip(grads, tangents)
           if g is not None and t is not None]
  if not pairs:
    return [None] * len(op.outputs)
  dummy_list = [dummies[o.ref()] for o in outs]
  jvps = tf.gradients([g for g, _ in pairs], dummy_list,
                      grad_ys=[tf.cast(t, g.dtype) for g, t in pairs])
  by_out = dict(zip([o.ref() for o in outs], jvps))
  return [by_out.get(o.ref()) for o in op.outputs]


def _check_opaque_outputs(op, on_path, wanted, stops):
  """Raises UnsupportedGraph where `op`, fed a tangent, has a variant or
  resource output that leads on to a y: a TensorList (tf.scan, map_fn,
  TensorArray, a While's accumulators), an optional or a handle carries
  the derivative of what was put in it, and the walk keeps tangents of
  floating tensors only, so it would silently drop that part."""
  for out in op.outputs:
    if out.dtype not in (tf.variant, tf.resource) or out.ref() in stops:
      continue
    if out.ref() in wanted or any(c in on_path for c in out.consumers()):
      raise UnsupportedGraph(
          "%s (%s) takes a tangent and passes it on through its %s output "
          "%s, which the op-by-op walk does not model"
          % (op.name, op.type, out.dtype.name, out.name))


def jvp(ys, xs, tangents, stop_gradients=None):
  """[d y / d xs . tangents for y in ys], None where y does not depend on
  xs; raises UnsupportedGraph where the walk cannot handle the path (the
  caller falls back to the whole-graph method).

  Args:
    ys: tensors of one graph (a TF1 graph or a function being traced).
    xs: tensors or variables.
    tangents: one tensor per x, shaped like it.
    stop_gradients: tensors treated as constants (no tangent flows through).
  """
  ys = [tf.convert_to_tensor(y) for y in _as_list(ys)]
  xs = _as_list(xs)
  tangents = _as_list(tangents)
  if len(xs) != len(tangents):
    raise ValueError("jvp needs one tangent per x: %d xs, %d tangents."
                     % (len(xs), len(tangents)))
  graph = ys[0].graph
  stops = set(tf.convert_to_tensor(s).ref()
              for s in _as_list(stop_gradients or []))
  tangent_of = {}
  handles = {}
  for x, t in zip(xs, tangents):
    src = _source(x, graph)
    if t is None:
      continue
    t = tf.convert_to_tensor(t)
    if src.dtype == tf.resource:
      handles[src.ref()] = t
    elif src.ref() not in stops:
      prev = tangent_of.get(src.ref())
      tangent_of[src.ref()] = t if prev is None else prev + t
  sources = [r.deref() for r in list(tangent_of) + list(handles)]
  if sources:
    path = _between(sources, ys, stops)
    on_path = set(path)
    wanted = set(y.ref() for y in ys)
    for op in path:
      if op.type in _V1_CONTROL_FLOW:
        raise UnsupportedGraph("TF1 control flow (%s) on the path" % op.name)
      if op.inputs and op.inputs[0].ref() in handles and op.type in (
          "ReadVariableOp", "ResourceGather"):
        outs = _read_rule(op, handles[op.inputs[0].ref()])
      elif any(x.ref() in handles for x in op.inputs):
        raise UnsupportedGraph("%s (%s) uses a variable handle" %
                               (op.name, op.type))
      else:
        ins = [tangent_of.get(x.ref()) for x in op.inputs]
        if all(t is None for t in ins):
          continue
        _check_opaque_outputs(op, on_path, wanted, stops)
        if not any(_differentiable(o) for o in op.outputs):
          continue
        rule = (_OP_RULES.get(graph, {}).get(op.name) or
                rules.rule_for(op) or _generic)
        outs = rule(op, ins)
      for out, t in zip(op.outputs, outs):
        if t is not None and _differentiable(out) and (
            out.ref() not in stops):
          tangent_of[out.ref()] = t
  return [tangent_of.get(y.ref()) for y in ys]
