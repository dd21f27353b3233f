"""A dataset given as graph tensors that hold a new batch at every step
(the old data readers' contract).

The old `kfac` data readers took "a list of tensors representing the
dataset, shuffled, repeated and batched into mini-batches of size at least
max_batch_size", e.g. `iterator.get_next()` of a tf.data pipeline in a TF1
graph: every session.run produces new rows, and a reader call returns the
first `batch_size` of them. `BatchStream` holds such tensors, checks them,
and slices them; `kfac.data_reader` readers use it when given symbolic
tensors (in-memory data takes their own, shuffling path).
"""

import tensorflow as tf


def is_symbolic(component):
  """A graph tensor (TF1 graph or tf.function trace) with no constant value:
  a batch that changes from step to step."""
  if isinstance(component, tf.Variable) or not tf.is_tensor(component):
    return False
  try:
    component.graph  # pylint: disable=pointless-statement
  except AttributeError:  # an eager tensor
    return False
  return tf.get_static_value(component) is None


def _graph_chain(graph):
  while graph is not None:
    yield graph
    graph = getattr(graph, "outer_graph", None)


def check_visible(graph, owner):
  """Raises ValueError unless tensors of `graph` can be used in the current
  graph (the same graph, or a tf.function traced inside it)."""
  current = tf.compat.v1.get_default_graph()
  if graph not in set(_graph_chain(current)):
    raise ValueError(
        "%s: the reader is used in a graph that cannot see its dataset "
        "tensors (they belong to %r); call it in that graph or in a "
        "tf.function traced inside it. A reader made from the tensors of "
        "a tf.function trace belongs to that trace: in TF2 give the "
        "reader in-memory data instead." % (owner, graph))


class BatchStream(object):
  """Per-step batches given as graph tensors.

  Args:
    dataset: tuple or list of graph tensors with the same leading (batch)
      dimension, at least `max_batch_size` rows each, and static
      non-leading dimensions.
    max_batch_size: the largest batch a reader call may ask for.
    owner: the reader's name, for messages.
  """

  def __init__(self, dataset, max_batch_size, owner):
    if tf.is_tensor(dataset):
      dataset = (dataset,)
    if not isinstance(dataset, (tuple, list)) or not dataset:
      raise ValueError("%s: dataset must be a non-empty tuple or list of "
                       "tensors, got %r." % (owner, dataset))
    if not all(is_symbolic(c) for c in dataset):
      raise ValueError(
          "%s: dataset mixes symbolic tensors (per-step batches in a graph) "
          "with in-memory data (arrays, constants, eager tensors or variables); "
          "pass either per-step batch tensors (e.g. iterator.get_next()) or "
          "the whole dataset in memory." % owner)
    graphs = set(c.graph for c in dataset)
    if len(graphs) != 1:
      raise ValueError("%s: the dataset tensors belong to different graphs."
                       % owner)
    self._graph = graphs.pop()
    self._owner = owner
    self._max_batch_size = max_batch_size
    for i, c in enumerate(dataset):
      if c.shape.rank is None or c.shape.rank == 0:
        raise ValueError(
            "%s: dataset component %d (%s) needs a leading (batch) "
            "dimension, got shape %s." % (owner, i, c.name, c.shape))
      if not c.shape[1:].is_fully_defined():
        raise ValueError(
            "%s: dataset component %d (%s) needs static non-batch "
            "dimensions, got shape %s." % (owner, i, c.name, c.shape))
      rows = c.shape[0]
      if rows is not None and rows < max_batch_size:
        raise ValueError(
            "%s: dataset component %d (%s) has batches of %d rows, fewer "
            "than max_batch_size (%d)." % (owner, i, c.name, rows,
                                          max_batch_size))
    self._components = list(dataset)

  @property
  def components(self):
    return list(self._components)

  @property
  def shapes(self):
    """Shapes of the cached batches: [max_batch_size, ...]."""
    return [(self._max_batch_size,) + tuple(c.shape.as_list()[1:])
            for c in self._components]

  @property
  def dtypes(self):
    return [c.dtype for c in self._components]

  def _check_graph(self):
    check_visible(self._graph, self._owner)

  def rows(self, size, static_size):
    """The first `size` rows of every component (after a run-time check
    that there are that many when the batch dimension is not static)."""
    self._check_graph()
    checks = []
    for c in self._components:
      if tf.compat.dimension_value(c.shape[0]) is None:
        checks.append(tf.debugging.assert_greater_equal(
            tf.shape(c, out_type=tf.int32)[0], size,
            message="%s: the dataset batch has fewer rows than the "
            "requested batch_size" % self._owner))
    with tf.control_dependencies(checks):
      if static_size is not None:
        return [tf.identity(c[:static_size]) for c in self._components]
      return [tf.identity(c[:size]) for c in self._components]

  def padded(self, rows, size):
    """`rows` zero-padded to max_batch_size rows (for the cache)."""
    out = []
    for r in rows:
      pad = [[0, self._max_batch_size - size]] + [[0, 0]] * (r.shape.rank - 1)
      padded = tf.pad(r, pad)
      out.append(tf.ensure_shape(
          padded, [self._max_batch_size] + r.shape.as_list()[1:]))
    return out
