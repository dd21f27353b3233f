"""Factors of generic parameters: the (diagonal of the) second moment of
flattened parameter gradients."""

import tensorflow as tf

from kfac.python.ops.tensors import utils
from kfac.python.ops.layers.base.factors import DenseSquareFactor
from kfac.python.ops.layers.base.factors import DiagonalFactor
from kfac.python.ops.layers.base.factors import normalize_weights
from kfac.python.ops.layers.base.factors import weighted_sum


class ParamsGradsColumns:
  """The parameter gradients of the naive factors: sources (with their
  weights) of gradient tuples, each flattened into one [n, 1] column, and
  the batch size they are summed over."""

  def __init__(self, params_grads, batch_size, weights):
    self.grads = [utils.ensure_sequence(g) for g in params_grads]
    self.weights = normalize_weights(weights, len(self.grads))
    self.batch_size = batch_size
    self.n = sum(int(g.shape.num_elements()) for g in self.grads[0])
    self.dtype = self.grads[0][0].dtype

  def scaled(self, fn):
    """[fn(column) / batch_size] over the sources."""
    batch = utils.cast(self.batch_size, self.dtype)
    return [fn(utils.tensors_to_column(g)) / batch for g in self.grads]


class NaiveFullFactor(DenseSquareFactor):
  """g g^T / batch_size for the flattened gradient g of the summed loss:
  the full Fisher of arbitrary parameters ("generic" layers)."""

  def __init__(self, params_grads, batch_size, weights=None, name=None):
    self._columns = c = ParamsGradsColumns(params_grads, batch_size, weights)
    self._weights, self._n = c.weights, c.n
    DenseSquareFactor.__init__(self, name=name, weights=self._weights)

  @property
  def _dtype(self):
    return self._columns.dtype

  def _compute_new_cov(self):
    terms = self._columns.scaled(lambda c: tf.matmul(c, c, transpose_b=True))
    return weighted_sum(terms, self._weights)


class NaiveDiagonalFactor(DiagonalFactor):
  """g^2 / batch_size: the diagonal version of `NaiveFullFactor` ([n, 1])."""

  def __init__(self, params_grads, batch_size, weights=None, name=None):
    self._columns = c = ParamsGradsColumns(params_grads, batch_size, weights)
    self._weights, self._n = c.weights, c.n
    DiagonalFactor.__init__(self, name=name)

  @property
  def _dtype(self):
    return self._columns.dtype

  @property
  def _cov_shape(self):
    return [self._n, 1]

  def _compute_new_cov(self):
    terms = self._columns.scaled(tf.square)
    return weighted_sum(terms, self._weights)
