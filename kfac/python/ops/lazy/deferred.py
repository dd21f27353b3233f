"""Tensors of a tf.function's trace that are built only where they are read.

`defer(like, build)`, called while a function graph is being traced (the
step of a `tf.function` or of Keras's `fit`), returns stand-ins for the
tensors `build()` would return, one per tensor of `like`, with its shape
and dtype, without building anything. The stand-ins live in a child
function graph of the trace that is never called; they are what objects
made at set-up keep (K-FAC's factors keep the sampled backward pass's
gradients, to compute their statistics from later).

Where a stand-in is first read in the trace's own graph, `build()` runs
there once (free of the control dependencies in scope) and every read of a
stand-in gets its counterpart from it. A read inside a conditional branch
goes through `recompute.recompute_in_branch` when one is open there (the
statistics update of K-FAC opens it: the branch builds its own copy);
otherwise the branch captures the stand-in and the conditional's op, made
in the trace's graph, reads it there. So a trace in which every read is
inside a branch builds `build()` only inside the branches, and the trace's
own graph has none of it (before, the outer copy was built at set-up and
pruned by TensorFlow when the function was instantiated: traced for
nothing, 4.4k ops on EfficientNetB0).

Outside a function graph (eager, a TF1 graph) `defer` builds at once and
returns `build()`'s tensors: TF1 graphs and Sessions are unchanged.

A read of a stand-in from any other graph (a later trace) fails with
TensorFlow's error for a tensor out of scope, never silently.
"""

import tensorflow as tf

from kfac.python.ops.lazy import recompute


def defer(like, build):
  """Stand-ins for `build()` in a function graph (see module docstring).

  Args:
    like: a list of graph tensors; stand-in i has like[i]'s shape and dtype,
      which must be those of build()[i].
    build: a function of no arguments returning a list aligned with `like`
      (no None entries).

  Returns:
    (tensors, home): the stand-ins and the graph whose reads build them;
    outside a function graph, (build(), None).
  """
  graph = tf.compat.v1.get_default_graph()
  if not like or not isinstance(graph, recompute.func_graph_class()):
    return list(build()), None
  scratch = recompute.func_graph_class()("kfac_deferred")  # never called
  with scratch.as_default():
    stand_ins = [
        tf.compat.v1.placeholder(x.dtype, x.shape,
                                 name="deferred_%d" % i)
        for i, x in enumerate(like)]
  index = {t.ref(): i for i, t in enumerate(stand_ins)}
  previous = graph.capture  # the class's method or an earlier hook
  built = []

  def capture(tensor, name=None, shape=None):
    if getattr(tensor, "graph", None) is not scratch:  # (every op input)
      return previous(tensor, name=name, shape=shape)
    i = index.get(tensor.ref())
    if i is None:
      return previous(tensor, name=name, shape=shape)
    if not built:
      with graph.as_default(), tf.control_dependencies(None):
        tensors = list(build())
      if len(tensors) != len(stand_ins) or any(t is None for t in tensors):
        raise ValueError("defer: build() must return %d tensors, got %r." %
                         (len(stand_ins), tensors))
      built.append(tensors)
    return built[0][i]

  # An attribute of this graph object only (the class is untouched); kept
  # for the rest of the trace.
  graph.capture = capture
  graph._kfac_deferred_hook = capture  # pylint: disable=protected-access
  return stand_ins, graph
