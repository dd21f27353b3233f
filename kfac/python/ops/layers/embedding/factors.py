"""Factors of embedding lookups.

An embedding lookup of integer ids is a dense layer whose inputs are one-hot
(or n-hot, for a bag of ids summed into one output row) rows:
outputs = n_hot(ids) @ W with W the [vocab, dim] table. Its input second
moment E[a a^T] is diagonal for one-hot rows (one-hot outer products are
diagonal); for n-hot rows K-FAC keeps only its diagonal,
E[n_hot(ids)^2], where n_hot counts how often each id occurs in a row.
Nothing here builds a dense [rows, vocab] one-hot matrix: statistics are
accumulated with segment sums over the ids, so their cost grows with the
number of ids in the batch, not with the vocabulary (only the [vocab] or
[vocab, dim] statistic itself has vocabulary size).

The output factor of an embedding block is the dense layers'
`FullyConnectedKroneckerFactor` on the gradients w.r.t. the outputs.
"""

import tensorflow as tf

from kfac.python.ops.tensors import utils
from kfac.python.ops.layers.base.factors import DiagonalFactor
from kfac.python.ops.layers.base.factors import normalize_sources
from kfac.python.ops.layers.base.factors import normalize_weights
from kfac.python.ops.layers.base.factors import weighted_sum

__all__ = ["EmbeddingInputKroneckerFactor", "EmbeddingDiagonalFactor"]


def _check_ids(ids, what):
  if not utils.is_tensor_or_variable(ids) or isinstance(
      ids, (tf.SparseTensor, tf.RaggedTensor)):
    raise ValueError("%s must be dense integer Tensors, got %r." % (what, ids))
  if not ids.dtype.is_integer:
    raise ValueError("%s must be integer ids, got dtype %s." %
                     (what, ids.dtype.name))


class EmbeddingInputKroneckerFactor(DiagonalFactor):
  """Diagonal n-hot input second moment of an embedding lookup.

  Statistic (a [vocab] vector): (1/rows) sum_i n_hot(ids_i)^2, where row i
  is one lookup: a single id (one-hot row) or a bag of ids whose table rows
  are summed (n-hot row, n_hot counting repeated ids). For one-hot rows this
  is the exact second moment E[a a^T] (a diagonal matrix); for n-hot rows it
  is its diagonal.
  """

  def __init__(self, input_ids, vocab_size, dtype=None, name=None):
    """Creates the factor.

    Args:
      input_ids: an integer Tensor, or a tuple of them (towers, concatenated
        along the rows): shape [rows] for one id per row, or [rows, k] for a
        bag of k ids per row.
      vocab_size: number of rows of the embedding table (a Python int).
      dtype: dtype of the statistic (default float32).
      name: the factor's name.
    """
    super().__init__(name=name)
    self._ids = utils.ensure_sequence(input_ids)
    for ids in self._ids:
      _check_ids(ids, "Embedding input ids")
      if ids.shape.rank not in (1, 2):
        raise ValueError("Embedding input ids must have shape [rows] or "
                         "[rows, k] (a bag per row), got %s." % ids.shape)
    self._vocab_size = int(vocab_size)
    self._stat_dtype = tf.as_dtype(dtype or tf.float32)

  @property
  def vocab_size(self):
    return self._vocab_size

  @property
  def _cov_shape(self):
    return [self._vocab_size]

  @property
  def _dtype(self):
    return self._stat_dtype

  def _tower_sum(self, ids):
    """(sum over rows of n_hot(ids_row)^2 as a [vocab] vector, rows)."""
    vocab = self._vocab_size
    rows = tf.shape(ids, out_type=tf.int64)[0]
    if ids.dtype not in (tf.int32, tf.int64):
      ids = tf.cast(ids, tf.int64)
    if ids.shape.rank == 1:
      ones = tf.ones(tf.shape(ids), self._dtype)
      return tf.math.unsorted_segment_sum(ones, ids, vocab), rows
    # A bag per row: count each id within its row (key = row * vocab + id),
    # then add the squared counts into the id's entry.
    ids = tf.cast(ids, tf.int64)
    row = tf.range(rows, dtype=tf.int64)[:, tf.newaxis]
    keys = tf.reshape(row * vocab + ids, [-1])
    uniq, _, counts = tf.unique_with_counts(keys, out_idx=tf.int64)
    counts = tf.cast(counts, self._dtype)
    return tf.math.unsorted_segment_sum(tf.square(counts), uniq % vocab,
                                        vocab), rows

  def _compute_new_cov(self):
    total, rows = None, None
    for ids in self._ids:
      part, n = self._tower_sum(ids)
      total = part if total is None else total + part
      rows = n if rows is None else rows + n
    return total / tf.cast(rows, self._dtype)


class EmbeddingDiagonalFactor(DiagonalFactor):
  """Exact diagonal of an embedding table's Fisher, as a [vocab, dim] matrix.

  The per-example gradient of row v of the table is
  sum_{positions p, bag entries k with id = v} g_p, with g_p the gradient of
  the summed loss w.r.t. the output at position p. The statistic is the
  mean over examples of its square (summed over sources with their
  weights): the diagonal of (1/N) sum_n J_n^T Lambda_n J_n in the exact
  modes.
  """

  def __init__(self, input_ids, outputs_grads, vocab_size, weights=None,
               name=None):
    """Creates the factor.

    Args:
      input_ids: tuple over towers of integer Tensors [examples, positions,
        k] (k ids per position, summed into the position's output).
      outputs_grads: list over sources of tuples over towers of gradients
        w.r.t. the outputs, [examples, positions..., dim].
      vocab_size: number of rows of the table.
      weights: optional per-source weights.
      name: the factor's name.
    """
    super().__init__(name=name)
    self._ids = utils.ensure_sequence(input_ids)
    for ids in self._ids:
      _check_ids(ids, "Embedding input ids")
      if ids.shape.rank != 3:
        raise ValueError("EmbeddingDiagonalFactor takes ids of shape "
                         "[examples, positions, k], got %s." % ids.shape)
    self._grads = normalize_sources(outputs_grads)
    self._weights = normalize_weights(weights, len(self._grads))
    self._vocab_size = int(vocab_size)
    self._dim = int(self._grads[0][0].shape[-1])

  @property
  def _cov_shape(self):
    return [self._vocab_size, self._dim]

  @property
  def _dtype(self):
    return self._grads[0][0].dtype

  def _statistic_grads(self):
    """The sources' gradients the statistic squares (EKFAC rotates them)."""
    return self._grads

  def _compute_new_cov(self):
    vocab = self._vocab_size
    # Per tower: the (example, id) pair of every entry, made unique, and the
    # gradient row (example, position) each entry takes its gradient from.
    towers = []
    examples = None
    for ids in self._ids:
      ids = tf.cast(ids, tf.int64)
      shape = tf.shape(ids, out_type=tf.int64)
      n, p = shape[0], shape[1]
      example = tf.broadcast_to(
          tf.range(n, dtype=tf.int64)[:, tf.newaxis, tf.newaxis], shape)
      grad_row = tf.broadcast_to(
          tf.reshape(tf.range(n * p, dtype=tf.int64), [n, p, 1]), shape)
      keys = tf.reshape(example * vocab + ids, [-1])
      uniq, idx = tf.unique(keys, out_idx=tf.int64)
      towers.append((uniq % vocab, idx, tf.size(uniq, out_type=tf.int64),
                     tf.reshape(grad_row, [-1])))
      examples = n if examples is None else examples + n
    terms = []
    for source in self._statistic_grads():
      total = None
      for (row_ids, idx, num, grad_row), g in zip(towers, source):
        g = tf.reshape(g, [-1, self._dim])
        per_pair = tf.math.unsorted_segment_sum(tf.gather(g, grad_row), idx,
                                                num)
        part = tf.math.unsorted_segment_sum(tf.square(per_pair), row_ids,
                                            vocab)
        total = part if total is None else total + part
      terms.append(total)
    return weighted_sum(terms, self._weights) / tf.cast(examples, self._dtype)
