"""Factors of dense layers: second moments of inputs and output gradients,
their diagonals, and the exact diagonal of a dense layer's Fisher."""

import tensorflow as tf

from kfac.python.ops import utils
from kfac.python.ops.factor_base import DenseSquareFactor
from kfac.python.ops.factor_base import DiagonalFactor
from kfac.python.ops.factor_base import concat_towers
from kfac.python.ops.factor_base import normalize_sources
from kfac.python.ops.factor_base import normalize_weights
from kfac.python.ops.factor_base import weighted_sum


class _SecondMomentMixin:
  """Shared set-up of factors over [batch, n] tensors from several sources."""

  def _init_sources(self, tensors, has_bias, weights):
    self._sources = normalize_sources(tensors)
    self._weights = normalize_weights(weights, len(self._sources))
    self._has_bias = has_bias
    first = self._sources[0][0]
    self._n = int(first.shape[-1]) + (1 if has_bias else 0)
    self._tensor_dtype = first.dtype

  @property
  def _dtype(self):
    return self._tensor_dtype

  def _source_matrices(self):
    return [concat_towers(towers, self._has_bias) for towers in self._sources]


class FullyConnectedKroneckerFactor(_SecondMomentMixin, DenseSquareFactor):
  """Second moment E[x x^T] of [batch, n] tensors (layer inputs, with a ones
  column when `has_bias`, or output gradients summed over sources)."""

  def __init__(self, tensors, has_bias=False, weights=None, name=None):
    self._init_sources(tensors, has_bias, weights)
    DenseSquareFactor.__init__(self, name=name, weights=self._weights)

  def _compute_new_cov(self):
    terms = []
    for x in self._source_matrices():
      n = tf.cast(tf.shape(x)[0], x.dtype)
      terms.append(tf.matmul(x, x, transpose_a=True) / n)
    return weighted_sum(terms, self._weights)


class DiagonalKroneckerFactor(_SecondMomentMixin, DiagonalFactor):
  """Diagonal of the second moment, diag(E[x x^T]) = E[x^2] (an [n] vector):
  the cheap factor behind the kron_*_diag approximations."""

  def __init__(self, tensors, has_bias=False, weights=None, name=None):
    self._init_sources(tensors, has_bias, weights)
    DiagonalFactor.__init__(self, name=name)

  @property
  def _cov_shape(self):
    return [self._n]

  def _compute_new_cov(self):
    terms = [tf.reduce_mean(tf.square(x), axis=0)
             for x in self._source_matrices()]
    return weighted_sum(terms, self._weights)


class FullyConnectedDiagonalFactor(DiagonalFactor):
  """Exact diagonal of a dense layer's Fisher, the "sum of squares" estimator:
  F[(i, j), (i, j)] = E[a_i^2 g_j^2] as an [in(+1), out] matrix."""

  def __init__(self, inputs, outputs_grads, has_bias=False, weights=None,
               name=None):
    super().__init__(name=name)
    self._inputs = utils.ensure_sequence(inputs)
    self._grads = normalize_sources(outputs_grads)
    self._weights = normalize_weights(weights, len(self._grads))
    self._has_bias = has_bias
    self._shape = [int(self._inputs[0].shape[-1]) + (1 if has_bias else 0),
                   int(self._grads[0][0].shape[-1])]

  @property
  def _cov_shape(self):
    return self._shape

  @property
  def _dtype(self):
    return self._inputs[0].dtype

  def _compute_new_cov(self):
    a_sq = tf.square(concat_towers(self._inputs, self._has_bias))
    n = tf.cast(tf.shape(a_sq)[0], a_sq.dtype)
    terms = [tf.matmul(a_sq, tf.square(concat_towers(g)), transpose_a=True) / n
             for g in self._grads]
    return weighted_sum(terms, self._weights)
