"""Gather-based readers: variable batch sizes without tf.data.

The dataset stays in memory as constant tensors; each call draws
`batch_size` example indices and returns `tf.gather` of every component.

Indices come from a stream of random permutations of the examples, one per
epoch (sampling without replacement): a call takes the next `batch_size`
indices of the stream, continuing into the next epoch's permutation when the
current one runs out (a batch larger than the dataset spans several epochs).
Every example therefore appears exactly once in each consecutive block of
`num_examples` drawn indices, whatever the batch sizes were; nothing is
skipped. The permutation of epoch e is the stable argsort of kfac's
counter-based uniforms for the seed (`counter_random`), so the stream depends
only on `seed` and the batch sizes, in a TF1 graph, a `tf.function` or
eagerly alike. The state (current permutation, epoch, position) lives in
variables created outside any trace (see `kfac.data_reader`).

Old scripts may also pass graph tensors that hold the whole dataset and
stay the same at every step (the old library's contract for these readers):
they are gathered from directly, in their graph or a tf.function traced
inside it.

`CachedDataReader` caches only the indices of the last batch (an int32
variable [max_batch_size] and the batch size) and `cached_batch` gathers
them again, with the ordering contract of `kfac.data_reader`: in a step that
calls the reader once, `cached_batch` is the previous step's batch (0 rows
before the first call), whether it is read before or after the call.
"""

import contextlib
import random

import tensorflow as tf

from kfac.python.ops.tensors import counter_random
from kfac.python.ops.data import data_reader
from kfac.python.ops.compat_utils import batch_stream

__all__ = ["VariableBatchReader", "CachedDataReader"]


def _max_batch_size_arg(max_batch_size, num_examples, owner):
  if max_batch_size is not None and num_examples is not None:
    raise TypeError("%s: pass max_batch_size (or num_examples, its old "
                    "name) once." % owner)
  # Neither: None, which the max_batch_size check rejects.
  return num_examples if max_batch_size is None else max_batch_size


class VariableBatchReader(data_reader.ReaderBase):
  """Batches of a variable size drawn by index from an in-memory dataset.

  Args:
    dataset: tuple or list of arrays (numpy arrays or eager tensors) with
      the same leading dimension, e.g. (images, labels); or (the old
      library's contract) graph tensors holding the whole dataset, the same
      at every step, with a static number of examples (gathered from
      directly; call the reader in their graph).
    max_batch_size: positive int, the largest batch size a call may ask for
      (old scripts pass the number of examples here, which works).
    seed: int or None (None: derived from the graph-level / global seed
      when one is set, `tf.compat.v1.set_random_seed` / `tf.random.set_seed`,
      as kfac 0.2.x's reader followed it; otherwise a random seed; see
      `seed`).

  `reader(batch_size)` returns a list of tensors (one per component) with
  `batch_size` rows, the examples at the next `batch_size` indices of the
  epoch-wise permutation stream (module docstring). `batch_size` is a Python
  int (checked now: ValueError outside [1, max_batch_size]) or a scalar
  integer tensor (checked at run time).
  """

  _owner = "data_reader_alt.VariableBatchReader"

  def __init__(self, dataset, max_batch_size=None, seed=None,
               num_examples=None):
    # Old scripts name the second argument num_examples (then the largest
    # batch a call may ask for).
    max_batch_size = _max_batch_size_arg(max_batch_size, num_examples,
                                         self._owner)
    self._graph = None
    if data_reader._is_stream(dataset):  # pylint: disable=protected-access
      self._init_graph_tensors(dataset, max_batch_size, seed)
    else:
      super().__init__(dataset, max_batch_size, seed)
    if self._seed is None:
      self._seed = _default_seed(self._graph)
    self._state = {}  # outer context key -> (constants, perm, epoch, pos)
    if tf.executing_eagerly():
      self._get_state()

  def _init_graph_tensors(self, dataset, max_batch_size, seed):
    """The old contract: graph tensors holding the whole dataset, the same
    at every step (e.g. read from a file in the graph); gathered from
    directly."""
    owner = self._owner
    self._max_batch_size = data_reader.check_max_batch_size(max_batch_size,
                                                            owner)
    self._seed = data_reader.check_seed(seed, owner)
    parts = list(dataset) if isinstance(dataset, (tuple, list)) else [dataset]
    if not all(batch_stream.is_symbolic(p) for p in parts):
      raise ValueError(
          "%s: dataset mixes symbolic tensors with in-memory data (arrays, "
          "constants, eager tensors or variables); pass one kind." % owner)
    graphs = set(p.graph for p in parts)
    if len(graphs) != 1:
      raise ValueError("%s: the dataset tensors belong to different graphs."
                       % owner)
    sizes = set()
    for i, p in enumerate(parts):
      if (p.shape.rank is None or p.shape.rank == 0 or
          tf.compat.dimension_value(p.shape[0]) is None):
        raise ValueError(
            "%s: dataset component %d (%s) needs a static leading (number "
            "of examples) dimension, got shape %s." % (owner, i, p.name,
                                                       p.shape))
      sizes.add(int(p.shape[0]))
    if len(sizes) != 1:
      raise ValueError(
          "%s: dataset components must have the same leading dimension "
          "(number of examples), got %s." % (owner, sorted(sizes)))
    self._graph = graphs.pop()
    self._components = parts

  @property
  def seed(self):
    """The seed in use (derived from the global seed, or drawn at random,
    when None was passed)."""
    return self._seed

  def _get_state(self):
    key = data_reader.outer_context_key()
    state = self._state.get(key)
    if state is None:
      n = self.num_examples
      with tf.init_scope():
        if self._graph is not None:  # graph tensors: gathered directly
          constants = list(self._components)
        else:
          constants = [tf.constant(c) for c in self._components]
        # Epoch -1 fully consumed: the first call starts epoch 0.
        perm = tf.Variable(tf.range(n, dtype=tf.int32), trainable=False,
                           name="data_reader_alt/permutation")
        epoch = tf.Variable(-1, dtype=tf.int64, trainable=False,
                            name="data_reader_alt/epoch")
        pos = tf.Variable(n, dtype=tf.int64, trainable=False,
                          name="data_reader_alt/position")
      state = (constants, perm, epoch, pos)
      self._state[key] = state
    return state

  def _permutation(self, epoch):
    """The permutation of `epoch` (int64 scalar) as int32 [num_examples]."""
    n = self.num_examples
    seed = tf.stack([tf.constant(self._seed, tf.int64), epoch])
    hi = counter_random.uniform([n], seed, tf.float64, stream=0)
    lo = counter_random.uniform([n], seed, tf.float64, stream=3)
    # 48 random bits per key; ties (left to the stable sort) are rare.
    return tf.argsort(hi + lo * (1.0 / 16777216.0), stable=True)

  def _next_indices(self, size):
    """Int32 [size] indices and the op that advances the stream."""
    _, perm_var, epoch_var, pos_var = self._get_state()
    n = tf.constant(self.num_examples, tf.int64)
    perm = perm_var.read_value()
    epoch = epoch_var.read_value()
    pos = pos_var.read_value()
    size64 = tf.cast(size, tf.int64)
    rest = perm[pos:]
    needed = tf.maximum(size64 - (n - pos), 0)
    extra_epochs = (needed + n - 1) // n
    epochs = epoch + 1 + tf.range(extra_epochs, dtype=tf.int64)
    extra = tf.map_fn(
        self._permutation, epochs,
        fn_output_signature=tf.TensorSpec([self.num_examples], tf.int32))
    stream = tf.concat([rest, tf.reshape(extra, [-1])], 0)
    indices = stream[:size]
    last = tf.concat([perm[None], extra], 0)[-1]
    new_pos = tf.where(extra_epochs > 0, needed - (extra_epochs - 1) * n,
                       pos + size64)
    advance = tf.group(
        perm_var.assign(last, read_value=False),
        epoch_var.assign(epoch + extra_epochs, read_value=False),
        pos_var.assign(new_pos, read_value=False))
    return indices, advance

  def _gather(self, indices):
    if self._graph is not None:
      batch_stream.check_visible(self._graph, self._owner)
    constants = self._get_state()[0]
    return [tf.gather(c, indices) for c in constants]

  def __call__(self, batch_size):
    size, checks = self._size(batch_size)
    with tf.control_dependencies(checks):
      indices, advance = self._next_indices(size)
    indices = self._after(indices, advance, size)
    static = tf.get_static_value(size)
    if static is not None:
      indices = tf.reshape(indices, [int(static)])
    return self._gather(indices)

  def _after(self, indices, advance, size):
    del size
    with tf.control_dependencies([advance]):
      return tf.identity(indices)


class CachedDataReader(VariableBatchReader):
  """A gather-based reader that keeps the last batch's indices.

  `cached_batch` gathers the previous step's indices again (0 rows before
  the first call); ordering contract as in `kfac.data_reader`.
  """

  _owner = "data_reader_alt.CachedDataReader"

  def __init__(self, dataset, max_batch_size=None, seed=None,
               num_examples=None):
    super().__init__(dataset, max_batch_size, seed=seed,
                     num_examples=num_examples)
    self._cache = data_reader.StepCache(
        [(self._max_batch_size,)], [tf.int32], "data_reader_alt")
    if tf.executing_eagerly():
      self._cache.variables()

  def _after(self, indices, advance, size):
    padded = tf.pad(indices, [[0, self._max_batch_size - size]])
    with tf.control_dependencies([advance]):
      write = self._cache.write([padded], size)
    with tf.control_dependencies([advance] +
                                 ([write] if write is not None else [])):
      return tf.identity(indices)

  @property
  def cached_batch(self):
    """The previous step's batch: a list of tensors, one per component."""
    indices = self._cache.read()[0]
    return self._gather(indices)


def _default_seed(graph=None):
  """The reader's seed when none was passed: from the graph-level (TF1) or
  global (TF2) seed and the op count, as TensorFlow derives an op's seed,
  so that a program that sets one reads the same batches on every run;
  random otherwise."""
  context = (graph.as_default() if graph is not None else
             contextlib.nullcontext())
  with context:
    global_seed, op_seed = tf.compat.v1.get_seed(None)
  if global_seed is None:
    return random.SystemRandom().randrange(2**31)
  return (int(global_seed) * 1000003 + int(op_seed or 0)) % (2**31)

