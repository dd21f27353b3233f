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

Outside a function graph (eager, a TF1 graph with TF1 control flow) the
context does nothing and the outer tensors are read as usual: correct, just
not lazy.
"""

import contextlib

import tensorflow as tf


def _func_graph_class():
  from tensorflow.python.framework import func_graph  # pylint: disable=g-import-not-at-top
  return func_graph.FuncGraph


@contextlib.contextmanager
def recompute_in_branch(tensors, build):
  """See the module docstring.

  Args:
    tensors: a list of graph tensors (the outer ones).
    build: a function of no arguments returning a list aligned with
      `tensors` (None entries keep the outer tensor).

  Yields:
    None.
  """
  graph = tf.compat.v1.get_default_graph()
  index = {t.ref(): i for i, t in enumerate(tensors)}
  if (not index or not isinstance(graph, _func_graph_class()) or
      getattr(graph, "_kfac_recompute_hook", False) or
      all(t.graph is graph for t in tensors)):
    yield
    return
  original = graph.capture
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
    del graph.capture
    del graph._kfac_recompute_hook  # pylint: disable=protected-access
