"""Factors of generic parameters: the (diagonal of the) second moment of
flattened parameter gradients."""

import tensorflow as tf

from kfac.python.ops.tensors import utils
from kfac.python.ops.layers.base.factors import DenseSquareFactor
from kfac.python.ops.layers.base.factors import DiagonalFactor
from kfac.python.ops.layers.base.factors import normalize_weights
from kfac.python.ops.layers.base.factors import weighted_sum


class _ParamsGradsMixin:
  """Shared set-up of the naive factors over flattened parameter gradients."""

  def _init_params_grads(self, params_grads, batch_size, weights):
    self._grads = [utils.ensure_sequence(g) for g in params_grads]
    self._weights = normalize_weights(weights, len(self._grads))
    self._batch_size = batch_size
    self._n = sum(int(g.shape.num_elements()) for g in self._grads[0])
    self._grads_dtype = self._grads[0][0].dtype

  @property
  def _dtype(self):
    return self._grads_dtype

  def _columns(self):
    return [utils.tensors_to_column(g) for g in self._grads]

  def _batch(self):
    return utils.cast(self._batch_size, self._grads_dtype)


class NaiveFullFactor(_ParamsGradsMixin, DenseSquareFactor):
  """g g^T / batch_size for the flattened gradient g of the summed loss:
  the full Fisher of arbitrary parameters ("generic" layers)."""

  def __init__(self, params_grads, batch_size, weights=None, name=None):
    self._init_params_grads(params_grads, batch_size, weights)
    DenseSquareFactor.__init__(self, name=name, weights=self._weights)

  def _compute_new_cov(self):
    terms = [tf.matmul(c, c, transpose_b=True) / self._batch()
             for c in self._columns()]
    return weighted_sum(terms, self._weights)


class NaiveDiagonalFactor(_ParamsGradsMixin, DiagonalFactor):
  """g^2 / batch_size: the diagonal version of `NaiveFullFactor` ([n, 1])."""

  def __init__(self, params_grads, batch_size, weights=None, name=None):
    self._init_params_grads(params_grads, batch_size, weights)
    DiagonalFactor.__init__(self, name=name)

  @property
  def _cov_shape(self):
    return [self._n, 1]

  def _compute_new_cov(self):
    terms = [tf.square(c) / self._batch() for c in self._columns()]
    return weighted_sum(terms, self._weights)
