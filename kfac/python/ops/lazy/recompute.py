"""Build an outer graph's tensors again inside a conditional branch.

`recompute_in_branch(tensors, build)` is a context: while it is open in a
function graph (a `tf.cond` branch, in a tf.function or a TF1 graph with
control flow v2), the first op that would capture one of `tensors` from an
outer graph calls `build()` once, in the branch, and every captured tensor
is replaced by its counterpart from `build()`. The outer tensors then have
no consumer inside the branch; if nothing else reads them, TensorFlow
prunes them, so their cost is paid only when the branch runs.

K-FAC uses it for the sampled backward pass of the statistics: built once
at set-up (the factors need tensors to be made), it is needed only on the
steps that update the statistics (`cov_update_every > 1`), inside the
conditional that updates them. `build()` must compute the same values as
the outer tensors (for K-FAC: `tf.gradients` of the same sampled losses,
whose random draws stay outside the branch, so that they are the same).

In a branch of a TF1 (control flow v1) `tf.cond` (a graph built after
`tf.compat.v1.disable_v2_behavior()`) the same happens through the branch's
`CondContext`: an op in the branch reads an outer tensor through
`CondContext.AddValue` (which would insert a Switch); for `tensors`, the
branch's counterpart from `build()` is returned instead, built once in the
branch's context, also when the first read comes from a conditional nested
in it.

Elsewhere (eager, a graph outside any conditional) the context does
nothing and the outer tensors are read as usual: correct, just not lazy.
"""

import contextlib

import tensorflow as tf


def func_graph_class():
  from tensorflow.python.framework import func_graph  # pylint: disable=g-import-not-at-top
  return func_graph.FuncGraph


@contextlib.contextmanager
def recompute_in_branch(tensors, build, home=None):
  """See the module docstring.

  Args:
    tensors: a list of graph tensors (the outer ones).
    build: a function of no arguments returning a list aligned with
      `tensors` (None entries keep the outer tensor).
    home: for stand-ins of `deferred.defer`, the graph that builds them
      where they are read: there the context does nothing.

  Yields:
    None.
  """
  graph = tf.compat.v1.get_default_graph()
  index = {t.ref(): i for i, t in enumerate(tensors)}
  if index and not isinstance(graph, func_graph_class()):
    with _in_v1_cond_branch(graph, index, build):
      yield
    return
  if (not index or not isinstance(graph, func_graph_class()) or
      getattr(graph, "_kfac_recompute_hook", False) or graph is home or
      all(t.graph is graph for t in tensors)):
    yield
    return
  original = graph.capture  # the class's method or a deferred.defer hook
  earlier_hook = getattr(graph, "_kfac_deferred_hook", None)
  built = []

  def capture(tensor, name=None, shape=None):
    i = index.get(tensor.ref()) if hasattr(tensor, "ref") else None
    if i is not None:
      if not built:
        built.append(None)  # re-entrant captures during build() pass by
        # In this graph, also when the first capture comes through a graph
        # nested in it (a conditional inside the branch).
        with graph.as_default():
          built[0] = list(build())
      replacement = built[0][i] if built[0] is not None else None
      if replacement is not None:
        return replacement
    return original(tensor, name=name, shape=shape)

  # An attribute of this graph object only (the class is untouched).
  graph.capture = capture
  graph._kfac_recompute_hook = True  # pylint: disable=protected-access
  try:
    yield
  finally:
    if earlier_hook is None:
      del graph.capture
    else:
      graph.capture = earlier_hook
    del graph._kfac_recompute_hook  # pylint: disable=protected-access


@contextlib.contextmanager
def _in_v1_cond_branch(graph, index, build):
  """recompute_in_branch for a branch of a control flow v1 tf.cond (see the
  module docstring); does nothing elsewhere."""
  # pylint: disable=protected-access
  context = graph._get_control_flow_context()
  if (context is None or not context.IsCondContext() or
      "AddValue" in vars(context)):  # not in a branch, or hooked already
    yield
    return
  original = context.AddValue
  built = []

  def add_value(val):
    i = index.get(val.ref()) if hasattr(val, "ref") else None
    if i is not None:
      if not built:
        built.append(None)  # re-entrant reads during build() pass by
        current = graph._get_control_flow_context()
        # In this branch's context (also when the first read comes from a
        # conditional nested in it), without the control inputs of the op
        # being built (they may live in a nested branch).
        with tf.control_dependencies(None):
          graph._set_control_flow_context(context)
          try:
            built[0] = list(build())
          finally:
            graph._set_control_flow_context(current)
      replacement = built[0][i] if built[0] is not None else None
      if replacement is not None:
        return replacement
    return original(val)

  # An attribute of this context object only (the class is untouched).
  context.AddValue = add_value
  try:
    yield
  finally:
    del context.AddValue
  # pylint: enable=protected-access
