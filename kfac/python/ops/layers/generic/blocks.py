"""Blocks of generic parameters: full and diagonal Fisher of the flattened
gradient."""

import tensorflow as tf

from kfac.python.ops.layers.base import damping as damping_lib
from kfac.python.ops.layers.generic import factors as generic_factors
from kfac.python.ops.tensors import utils
from kfac.python.ops.layers.base.blocks import ElementwiseDiagonalFB
from kfac.python.ops.layers.base.blocks import FisherBlock
from kfac.python.ops.layers.base.blocks import SingleFactorFB


class _GenericBlock(FisherBlock):
  """Shared plumbing of blocks for arbitrary parameters: gradients are taken
  w.r.t. the parameters themselves, vectors are flattened into a column."""

  def __init__(self, layer_collection, params):
    super().__init__(layer_collection, params)
    self._batch_sizes = []

  def register_additional_tower(self, batch_size):
    self._batch_sizes.append(batch_size)

  @property
  def num_registered_towers(self):
    return len(self._batch_sizes)

  @property
  def _params_tuple(self):
    return utils.ensure_sequence(self._params)

  def tensors_to_compute_grads(self):
    return self._params_tuple

  def _total_batch_size(self):
    sizes = [tf.cast(b, tf.float64) if utils.is_tensor_or_variable(b) else
             float(b) for b in self._batch_sizes]
    total = sizes[0]
    for b in sizes[1:]:
      total = total + b
    return total

  def _to_view(self, vector):
    vector = utils.ensure_sequence(vector)
    if len(vector) != len(self._params_tuple):
      raise ValueError("Block %s takes %d vector parts, got %d." %
                       (self.name, len(self._params_tuple), len(vector)))
    return utils.tensors_to_column(vector)

  def _from_view(self, view, template):
    out = utils.column_to_tensors(utils.ensure_sequence(template), view)
    return out if isinstance(template, (list, tuple)) else out[0]

  def _make_generic_factor(self, cls, grads_list, weights, role):
    weights = None if weights is None else tuple(weights)
    return self._make_factor(
        cls, (tuple(tuple(g) for g in grads_list), self._total_batch_size(),
              weights), role)


class NaiveFullFB(SingleFactorFB, _GenericBlock):
  """Full Fisher block of arbitrary parameters: E[g g^T] of the flattened
  loss gradient (exact for one example in the 'exact' mode)."""

  def __init__(self, layer_collection, params):
    super().__init__(layer_collection, params)
    self._factor = None

  def instantiate_factors(self, grads_list, damping, weights=None):
    self._factor = self._make_generic_factor(
        generic_factors.NaiveFullFactor, grads_list, weights, "full")
    self._damping_func = damping_lib.as_damping_func(damping)


class NaiveDiagonalFB(ElementwiseDiagonalFB, _GenericBlock):
  """Diagonal Fisher of arbitrary parameters: E[g^2] per entry."""

  def __init__(self, layer_collection, params):
    _GenericBlock.__init__(self, layer_collection, params)
    self._factor = None

  def instantiate_factors(self, grads_list, damping, weights=None):
    self._factor = self._make_generic_factor(
        generic_factors.NaiveDiagonalFactor, grads_list, weights, "diag")
    self._damping_func = damping_lib.as_damping_func(damping)
