"""Factors of dense layers: second moments of inputs and output gradients,
their diagonals, and the exact diagonal of a dense layer's Fisher."""

import tensorflow as tf

from kfac.python.ops.tensors import utils
from kfac.python.ops.layers.base.factors import DenseSquareFactor
from kfac.python.ops.layers.base.factors import DiagonalFactor
from kfac.python.ops.layers.base.factors import InputsGradsDiagonalFactor
from kfac.python.ops.layers.base.factors import concat_towers
from kfac.python.ops.layers.base.factors import merge_trailing_axes
from kfac.python.ops.layers.base.factors import normalize_sources
from kfac.python.ops.layers.base.factors import normalize_weights
from kfac.python.ops.layers.base.factors import weighted_sum


class SecondMomentSources:
  """The tensors of a second-moment factor: sources (with their weights) of
  towers of [batch, ..., n] tensors, the last `output_axes` axes flattened
  into n, with a ones column appended when `has_bias`; `n` counts it."""

  def __init__(self, tensors, has_bias, weights, output_axes=1):
    self.sources = normalize_sources(tensors)
    self.weights = normalize_weights(weights, len(self.sources))
    self.has_bias = has_bias
    # Output gradients of a weight with several output axes are flattened
    # here, when the statistics are computed (not when registered: the
    # lazy statistics rebuild the gradients themselves inside the update's
    # branch, and a reshape made outside it would be read every step).
    self.output_axes = output_axes
    first = self.sources[0][0]
    self.n = (int(first.shape[-output_axes:].num_elements()) +
              (1 if has_bias else 0))
    self.dtype = first.dtype

  def flat(self, x):
    return merge_trailing_axes(x, self.output_axes)

  def matrices(self):
    """One [rows, n] matrix per source, its towers concatenated."""
    return [concat_towers([self.flat(t) for t in towers], self.has_bias)
            for towers in self.sources]


class FullyConnectedKroneckerFactor(DenseSquareFactor):
  """Second moment E[x x^T] of [batch, n] tensors (layer inputs, with a ones
  column when `has_bias`, or output gradients summed over sources).
  `output_axes` > 1: the tensors' last `output_axes` axes are flattened
  into n (the output gradients of a weight with several output axes)."""

  def __init__(self, tensors, has_bias=False, weights=None, name=None,
               output_axes=1):
    self._moments = m = SecondMomentSources(tensors, has_bias, weights,
                                            output_axes)
    self._weights, self._n = m.weights, m.n
    DenseSquareFactor.__init__(self, name=name, weights=self._weights)

  @property
  def _dtype(self):
    return self._moments.dtype

  def _source_matrices(self):
    return self._moments.matrices()

  @property
  def row_weights(self):
    """The weights of statistic_rows' matrices."""
    return self._weights

  def statistic_rows(self):
    """[rows [r, n]] per source (with the ones column of a bias): the
    statistic is sum_s row_weights[s] rows_s^T rows_s / r_s
    (layers/base/block_diagonal.py builds its blocks from them)."""
    return self._source_matrices()

  def _compute_new_cov(self):
    terms = []
    for x in self._source_matrices():
      n = tf.cast(tf.shape(x)[0], x.dtype)
      terms.append(tf.matmul(x, x, transpose_a=True) / n)
    return weighted_sum(terms, self._weights)


class DiagonalKroneckerFactor(DiagonalFactor):
  """Diagonal of the second moment, diag(E[x x^T]) = E[x^2] (an [n] vector):
  the cheap factor behind the kron_*_diag approximations."""

  def __init__(self, tensors, has_bias=False, weights=None, name=None,
               output_axes=1):
    self._moments = m = SecondMomentSources(tensors, has_bias, weights,
                                            output_axes)
    self._weights, self._n = m.weights, m.n
    DiagonalFactor.__init__(self, name=name)

  @property
  def _dtype(self):
    return self._moments.dtype

  @property
  def _cov_shape(self):
    return [self._n]

  def _compute_new_cov(self):
    terms = [tf.reduce_mean(tf.square(x), axis=0)
             for x in self._moments.matrices()]
    return weighted_sum(terms, self._weights)


class FullyConnectedDiagonalFactor(InputsGradsDiagonalFactor):
  """Exact diagonal of a dense layer's Fisher, the "sum of squares" estimator,
  as an [in(+1), out] matrix.

  For [batch, in] inputs this is F[(i, j), (i, j)] = E[a_i^2 g_j^2]. For a
  layer shared over positions ([batch, P..., in] inputs) the per-example
  gradient is the sum over positions, v_n = sum_p a_np g_np^T, so the
  statistic is E_n[v_n^2] (elementwise square; summed over sources): the
  exact diagonal whatever the weight-sharing structure (positions are not
  treated as examples). `output_axes` > 1: the gradients' last
  `output_axes` axes are flattened into the output width.
  """

  def __init__(self, inputs, outputs_grads, has_bias=False, weights=None,
               name=None, output_axes=1):
    first_input = utils.ensure_sequence(inputs)[0]
    first_grad = normalize_sources(outputs_grads)[0][0]
    super().__init__(inputs, outputs_grads, weights,
                     [int(first_input.shape[-1]) + (1 if has_bias else 0),
                      int(first_grad.shape[-output_axes:].num_elements())],
                     name=name)
    self._has_bias = has_bias
    self._output_axes = output_axes

  def _compute_new_cov(self):
    grads = [tuple(merge_trailing_axes(t, self._output_axes) for t in g)
             for g in self._grads]
    if all(x.shape.rank == 2 for x in self._inputs):
      a_sq = tf.square(concat_towers(self._inputs, self._has_bias))
      n = tf.cast(tf.shape(a_sq)[0], a_sq.dtype)
      terms = [tf.matmul(a_sq, tf.square(concat_towers(g)),
                         transpose_a=True) / n for g in grads]
      return weighted_sum(terms, self._weights)
    return weighted_sum([self._shared_positions_stat(g) for g in grads],
                        self._weights)

  def _shared_positions_stat(self, grads_towers):
    """E_n[(sum_p a_np g_np^T)^2] over the examples of all towers."""
    total, count = None, None
    for a, g in zip(self._inputs, grads_towers):
      a = _positions_view(a)
      if self._has_bias:
        a = tf.concat([a, tf.ones_like(a[..., :1])], axis=-1)
      per_example = tf.einsum("bpi,bpj->bij", a, _positions_view(g))
      part = tf.reduce_sum(tf.square(per_example), axis=0)
      rows = tf.cast(tf.shape(a)[0], a.dtype)
      total = part if total is None else total + part
      count = rows if count is None else count + rows
    return total / count


def _positions_view(x):
  """[batch, P..., n] -> [batch, prod(P...), n] (rank 2 -> [batch, 1, n])."""
  return tf.reshape(x, [tf.shape(x)[0], -1, int(x.shape[-1])])
