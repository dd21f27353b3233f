"""Readers of datasets whose batch size may change every step.

`VariableBatchReader(dataset, max_batch_size)` streams shuffled batches of
`max_batch_size` rows from a `tf.data` pipeline (shuffle over the whole
dataset, reshuffled every epoch, repeated forever) and `reader(batch_size)`
returns the first `batch_size` rows of the next such batch; the other rows
of that batch are skipped. `batch_size` may be a Python int or a scalar
integer tensor (e.g. from `kfac.batch_size_schedules`) and may change from
step to step.

`CachedDataReader` also keeps the batch it returned in variables, so that the
next step can read it again as `cached_batch`: the previous step's mini-batch,
which K-FAC's delayed Levenberg-Marquardt damping rule evaluates at the new
parameters (`KfacOptimizer(adapt_damping=True,
update_damping_immediately=False, prev_train_batch=reader.cached_batch)`).

A step is one `session.run` of a TF1 graph, one call of a `tf.function`, or
one iteration of a `tf.while_loop` that calls the reader. Ordering contract
of `CachedDataReader`: in a step that calls `reader(batch_size)` once,
`reader.cached_batch` is the batch that the previous step's call returned,
whether it is read before or after the call in the Python code and also when
it is read inside a `tf.cond` branch of the step. Before the first call the
cached batch has 0 rows. In eager mode each call is a step: `cached_batch`
read after a call is the batch returned by the call before it.

The iterator and the cache variables are created outside any trace
(`tf.init_scope`): at construction in eager mode, otherwise once per TF1
graph on first use, so a `tf.function` that calls the reader keeps its state
across calls and retraces.

The old library's contract is kept too: a dataset of symbolic graph
tensors holding one batch of at least `max_batch_size` rows that changes at
every step (e.g. `iterator.get_next()` of a shuffled, repeated, batched
`tf.data` pipeline in a TF1 graph; see compat_utils/batch_stream.py): a call
returns their first `batch_size` rows, and `CachedDataReader` caches those
rows (zero-padded to `max_batch_size`) with the same ordering contract.

`kfac.data_reader_alt` has gather-based readers (no `tf.data`) whose cache
holds only the indices of the previous batch.
"""

import contextlib
import numbers
import weakref

import numpy as np
import tensorflow as tf

from kfac.python.ops.compat_utils import batch_stream

__all__ = ["VariableBatchReader", "CachedDataReader"]


# ------------------------------------------------------------ validation
def as_components(dataset, owner):
  """The dataset as a list of numpy arrays with one leading dimension.

  `dataset` is a tuple or list of arrays / eager tensors / constant tensors
  (a single array is a one-component dataset)."""
  if isinstance(dataset, (np.ndarray, tf.Tensor, tf.Variable)):
    dataset = (dataset,)
  if not isinstance(dataset, (tuple, list)):
    raise ValueError(
        "%s: dataset must be a tuple or list of arrays with the same leading "
        "dimension (e.g. (images, labels)), got %r." % (owner, type(dataset)))
  if not dataset:
    raise ValueError("%s: dataset is empty (no components)." % owner)
  components = []
  for i, component in enumerate(dataset):
    if isinstance(component, tf.Variable):
      component = component.read_value() if tf.executing_eagerly() else (
          tf.get_static_value(component.initial_value))
    if tf.is_tensor(component):
      value = tf.get_static_value(component)
      if value is None:
        raise ValueError(
            "%s: dataset component %d is a symbolic tensor without a "
            "constant value; this reader holds the dataset in memory: pass "
            "numpy arrays or eager tensors (kfac.data_reader's readers also "
            "take per-step batch tensors, e.g. iterator.get_next())."
            % (owner, i))
      component = value
    array = np.asarray(component)
    if array.ndim == 0:
      raise ValueError(
          "%s: dataset component %d is a scalar; every component needs a "
          "leading (example) dimension." % (owner, i))
    if array.dtype == object or array.dtype.kind in "US":
      raise ValueError("%s: dataset component %d has unsupported dtype %s."
                       % (owner, i, array.dtype))
    components.append(array)
  sizes = [c.shape[0] for c in components]
  if len(set(sizes)) != 1:
    raise ValueError(
        "%s: dataset components must have the same leading dimension "
        "(number of examples), got %s." % (owner, sizes))
  if sizes[0] == 0:
    raise ValueError("%s: dataset has 0 examples." % owner)
  return components


def check_max_batch_size(max_batch_size, owner):
  if (isinstance(max_batch_size, bool) or
      not isinstance(max_batch_size, numbers.Integral) or max_batch_size < 1):
    raise ValueError("%s: max_batch_size must be a positive int, got %r."
                     % (owner, max_batch_size))
  return int(max_batch_size)


def check_seed(seed, owner):
  if seed is None:
    return None
  if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
    raise ValueError("%s: seed must be an int or None, got %r." %
                     (owner, seed))
  return int(seed)


def batch_size_tensor(batch_size, max_batch_size, owner):
  """(int32 scalar batch size, checks to run before using it).

  A Python int (or a tensor with a constant value) is checked now; any other
  tensor by assertions at run time."""
  if isinstance(batch_size, bool):
    raise ValueError("%s: batch_size must be an int, got %r." %
                     (owner, batch_size))
  static = batch_size
  if tf.is_tensor(batch_size):
    if not (batch_size.dtype.is_integer and batch_size.shape.rank == 0):
      raise ValueError(
          "%s: batch_size must be a scalar integer tensor, got %s with "
          "shape %s." % (owner, batch_size.dtype.name, batch_size.shape))
    static = tf.get_static_value(batch_size)
  elif not isinstance(batch_size, numbers.Integral):
    raise ValueError("%s: batch_size must be an int or a scalar integer "
                     "tensor, got %r." % (owner, batch_size))
  if static is not None:
    static = int(static)
    if not 1 <= static <= max_batch_size:
      raise ValueError(
          "%s: batch_size must be between 1 and max_batch_size (%d), got %d."
          % (owner, max_batch_size, static))
    return tf.constant(static, tf.int32), []
  size = tf.cast(batch_size, tf.int32)
  checks = [
      tf.debugging.assert_less_equal(
          size, tf.constant(max_batch_size, tf.int32),
          message="%s: batch_size must be <= max_batch_size (%d)" %
          (owner, max_batch_size)),
      tf.debugging.assert_positive(
          size, message="%s: batch_size must be >= 1" % owner),
  ]
  return size, checks


# ------------------------------------------------------- execution contexts
def outer_context_key():
  """None in eager mode, else the graph that owns state made now (the TF1
  graph, also while tracing a tf.function inside it)."""
  with tf.init_scope():
    if tf.executing_eagerly():
      return None
    return tf.compat.v1.get_default_graph()


def step_graph():
  """The graph of the current step: the current graph, or for a tf.cond
  branch the graph around the tf.cond (a while-loop body is a step)."""
  graph = tf.compat.v1.get_default_graph()
  while type(graph).__name__ == "CondBranchFuncGraph":
    graph = graph.outer_graph
  return graph


def _names(tensors):
  return [t.name for t in tensors]


def _by_name(graph, names):
  return [graph.get_tensor_by_name(n) for n in names]


class StepCache:
  """Variables holding one step's rows for the next step, with ordering.

  `buffers` are [rows, ...] variables written whole by `write(values, size)`;
  `read()` gives each buffer's first `size` rows as they were when the
  current step started (see the module docstring). Per step graph it keeps
  the names (not the tensors, so traced graphs can be freed) of the reads
  made before a write, which the write waits for, and of the snapshot the
  first write of the graph reads before assigning, which later reads return.
  """

  def __init__(self, shapes, dtypes, name):
    self._shapes = [tf.TensorShape(s) for s in shapes]
    self._dtypes = [tf.as_dtype(d) for d in dtypes]
    self._name = name
    self._vars = {}  # outer context key -> (buffers, size, writes)
    self._records = weakref.WeakKeyDictionary()
    self._eager_snapshot = None  # (writes count, tensors)

  def variables(self):
    key = outer_context_key()
    found = self._vars.get(key)
    if found is None:
      with tf.init_scope():
        buffers = [
            tf.Variable(tf.zeros(s, d), trainable=False,
                        name="%s/cached_%d" % (self._name, i))
            for i, (s, d) in enumerate(zip(self._shapes, self._dtypes))]
        size = tf.Variable(0, dtype=tf.int32, trainable=False,
                           name=self._name + "/cached_size")
        writes = tf.Variable(0, dtype=tf.int64, trainable=False,
                             name=self._name + "/writes")
      found = (buffers, size, writes)
      self._vars[key] = found
    return found

  @staticmethod
  def _read_now(variables):
    buffers, size, _ = variables
    n = size.read_value()
    return [b.read_value()[:n] for b in buffers]

  def _record(self, graph):
    record = self._records.get(graph)
    if record is None:
      record = {"reads": [], "snapshot": None, "writes": []}
      self._records[graph] = record
    return record

  def read(self):
    variables = self.variables()
    if tf.executing_eagerly():
      snap = self._eager_snapshot
      if snap is not None and snap[0] == int(variables[2].numpy()):
        return list(snap[1])
      return self._read_now(variables)
    graph = step_graph()
    record = self._record(graph)
    if record["snapshot"] is not None:
      return _by_name(graph, record["snapshot"])
    current = tf.compat.v1.get_default_graph()
    with (graph.as_default() if graph is not current else
          contextlib.nullcontext()):
      tensors = self._read_now(variables)
    record["reads"].extend(_names(tensors))
    return tensors

  def write(self, values, size):
    """Stores `values` (full [rows, ...] tensors) and `size`; returns the
    write op (None in eager mode, where it has run)."""
    variables = self.variables()
    buffers, size_var, writes = variables
    if tf.executing_eagerly():
      before = self._read_now(variables)
      for b, v in zip(buffers, values):
        b.assign(v)
      size_var.assign(size)
      count = writes.assign_add(1)
      self._eager_snapshot = (int(count.numpy()), before)
      return None
    graph = tf.compat.v1.get_default_graph()
    if graph is not step_graph():
      raise ValueError(
          "%s: call the reader at the top level of the training step (or of "
          "a tf.while_loop body), not inside a tf.cond branch: the cached "
          "batch could not be ordered before the new one." % self._name)
    record = self._record(graph)
    if record["snapshot"] is None:
      record["snapshot"] = _names(self._read_now(variables))
    deps = _by_name(graph, record["snapshot"] + record["reads"])
    deps += [graph.get_operation_by_name(n) for n in record["writes"]]
    with tf.control_dependencies(deps):
      ops = [b.assign(v, read_value=False) for b, v in zip(buffers, values)]
      ops.append(size_var.assign(size, read_value=False))
      ops.append(writes.assign_add(1, read_value=False))
      op = tf.group(*ops)
    record["writes"].append(op.name)
    return op


# ---------------------------------------------------------------- readers
class ReaderBase:
  """The validated dataset and sizes every reader has."""

  _owner = "reader"

  def __init__(self, dataset, max_batch_size, seed):
    self._components = as_components(dataset, self._owner)
    self._max_batch_size = check_max_batch_size(max_batch_size, self._owner)
    self._seed = check_seed(seed, self._owner)

  @property
  def max_batch_size(self):
    return self._max_batch_size

  @property
  def num_examples(self):
    return self._components[0].shape[0]

  def _size(self, batch_size):
    """(int32 batch size, its run-time checks); see batch_size_tensor."""
    return batch_size_tensor(batch_size, self._max_batch_size, self._owner)


class VariableBatchReader(ReaderBase):
  """Batches of a variable size from an in-memory dataset (tf.data), or from
  graph tensors that hold a new batch every step.

  Args:
    dataset: tuple or list of arrays (numpy arrays or eager tensors) with
      the same leading dimension, e.g. (images, labels); or (the old
      library's contract) a tuple or list of graph tensors holding one
      mini-batch of at least `max_batch_size` rows that changes at every
      step, e.g. `iterator.get_next()` of a shuffled, repeated, batched
      tf.data pipeline in a TF1 graph.
    max_batch_size: positive int, the largest batch size a call may ask for.
    seed: int or None, the shuffle seed of in-memory data (None: `tf.data`'s
      default, which follows `tf.random.set_seed`); unused for graph
      tensors.

  `reader(batch_size)` returns a list of tensors (one per component), each
  with `batch_size` rows. In-memory data: the first `batch_size` rows of the
  next batch of `max_batch_size` rows from the shuffled, repeated dataset
  (the other rows of that batch are skipped). Graph tensors: their first
  `batch_size` rows (call the reader in their graph, or in a tf.function
  traced inside it). Rows of all components come from the same examples. A
  Python int `batch_size` gives a static leading dimension and is checked
  now (ValueError outside [1, max_batch_size]); an integer tensor is checked
  at run time (InvalidArgumentError).
  """

  _owner = "VariableBatchReader"

  def __init__(self, dataset, max_batch_size, seed=None):
    self._stream = None
    self._iterators = {}  # outer context key -> iterator
    if _is_stream(dataset):
      self._max_batch_size = check_max_batch_size(max_batch_size,
                                                  self._owner)
      self._seed = check_seed(seed, self._owner)
      self._stream = batch_stream.BatchStream(dataset, self._max_batch_size,
                                              self._owner)
      self._components = None
      return
    super().__init__(dataset, max_batch_size, seed)
    if tf.executing_eagerly():
      self._iterator()

  @property
  def num_examples(self):
    """Examples of an in-memory dataset (None for per-step graph tensors)."""
    if self._stream is not None:
      return None
    return super().num_examples

  def _make_dataset(self):
    data = tf.data.Dataset.from_tensor_slices(tuple(self._components))
    data = data.shuffle(self.num_examples, seed=self._seed,
                        reshuffle_each_iteration=True)
    return data.repeat().batch(self._max_batch_size, drop_remainder=True)

  def _iterator(self):
    key = outer_context_key()
    iterator = self._iterators.get(key)
    if iterator is None:
      with tf.init_scope():
        data = self._make_dataset()
        if key is None:
          iterator = iter(data)
        else:
          iterator = tf.compat.v1.data.make_one_shot_iterator(data)
      self._iterators[key] = iterator
    return iterator

  def _next_max_batch(self):
    return list(self._iterator().get_next())

  def _rows(self, size, checks):
    """(the rows a call returns, rows for the cache: [max_batch_size, ...]
    tensors) for the checked int32 `size`."""
    static = tf.get_static_value(size)
    static = int(static) if static is not None else None
    if self._stream is not None:
      with tf.control_dependencies(checks):
        rows = self._stream.rows(size, static)
      return rows, self._stream.padded(rows, size)
    # The batch is drawn only after the checks pass: a failed check must not
    # cancel a draw in flight, which would leave the iterator at its end.
    with tf.control_dependencies(checks):
      full = self._next_max_batch()
      end = static if static is not None else size
      return ([tf.identity(f[:end]) for f in full],
              [tf.identity(f) for f in full])

  def __call__(self, batch_size):
    size, checks = self._size(batch_size)
    return self._rows(size, checks)[0]


def _is_stream(dataset):
  """Whether `dataset` holds per-step graph tensors (the old contract)."""
  parts = dataset if isinstance(dataset, (tuple, list)) else (dataset,)
  return any(batch_stream.is_symbolic(p) for p in parts)


class CachedDataReader(VariableBatchReader):
  """A `VariableBatchReader` that keeps each batch for the next step.

  Each call stores the batch it drew (its max-size batch for in-memory
  data; the returned rows, zero-padded, for graph tensors) and the batch
  size in variables (shapes [max_batch_size, ...] and []); `cached_batch`
  is the previous step's batch (0 rows before the first call), under the
  ordering contract of the module docstring.
  """

  _owner = "CachedDataReader"

  def __init__(self, dataset, max_batch_size, seed=None):
    super().__init__(dataset, max_batch_size, seed=seed)
    if self._stream is not None:
      shapes, dtypes = self._stream.shapes, self._stream.dtypes
    else:
      shapes = [(self._max_batch_size,) + c.shape[1:]
                for c in self._components]
      dtypes = [c.dtype for c in self._components]
    self._cache = StepCache(shapes, dtypes, self._owner)
    if tf.executing_eagerly():
      self._cache.variables()

  def __call__(self, batch_size):
    size, checks = self._size(batch_size)
    # The stored rows depend on the checks; the write itself is made outside
    # them, so that reading `cached_batch` in a later run needs no feeds of
    # this call's batch size.
    rows, full = self._rows(size, checks)
    write = self._cache.write(full, size)
    with tf.control_dependencies([write] if write is not None else []):
      return [tf.identity(r) for r in rows]

  @property
  def cached_batch(self):
    """The previous step's batch: a list of tensors, one per component."""
    return self._cache.read()
