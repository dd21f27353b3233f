"""Blocks of scale-and-shift parameters: the full Fisher block, its
diagonal, and its per-channel [2, 2] blocks (each scale entry with its
shift entry; the couplings between channels dropped).

Vectors are `scale` or `(scale, shift)` shaped like the parameters; the
flattened order is concat(scale.flatten(), shift.flatten()). Damping is
added to the diagonal (there is no Kronecker split).
"""

import tensorflow as tf

from kfac.python.ops.layers.base import damping as damping_lib
from kfac.python.ops.layers.scale_shift import factors as scale_shift_factors
from kfac.python.ops.tensors import utils
from kfac.python.ops.layers.base.blocks import ElementwiseDiagonalFB
from kfac.python.ops.layers.base.blocks import LayerTowersFB
from kfac.python.ops.layers.base.blocks import SingleFactorFB

__all__ = ["ScaleAndShiftFullFB", "ScaleAndShiftDiagonalFB",
           "ScaleAndShiftPerChannelFB"]


class _ScaleShiftBlock(LayerTowersFB):
  """Towers of (inputs, outputs) of one scale-and-shift layer."""

  def __init__(self, layer_collection, params):
    super().__init__(layer_collection, params)
    seq = utils.ensure_sequence(params)
    self._scale_shape = tuple(int(d) for d in seq[0].shape)
    self._shift_shape = (tuple(int(d) for d in seq[1].shape)
                         if len(seq) == 2 else None)
    self._init_towers()
    self._factor = None

  @property
  def has_shift(self):
    return self._shift_shape is not None

  _has_shift = has_shift  # kfac 0.2.x's name

  def _make_scale_shift_factor(self, cls, grads_list, weights, role):
    weights = None if weights is None else tuple(weights)
    return self._make_factor(
        cls, (tuple(self._inputs), tuple(tuple(g) for g in grads_list),
              self._scale_shape, self._shift_shape, weights), role)

  def _to_view(self, vector):
    parts = utils.ensure_sequence(vector)
    want = 2 if self.has_shift else 1
    if len(parts) != want:
      raise ValueError("Block %s takes %s vectors, got %d parts." %
                       (self.name, "(scale, shift)" if self.has_shift else
                        "scale", len(parts)))
    return utils.tensors_to_column(parts)

  def _from_view(self, view, template):
    out = utils.column_to_tensors(utils.ensure_sequence(template), view)
    return out if isinstance(template, (list, tuple)) else out[0]

  def factors(self):
    return [self._factor]


class ScaleAndShiftFullFB(SingleFactorFB, _ScaleShiftBlock):
  """Full Fisher block of (scale, shift): E_n[v v^T] of the per-example
  parameter gradients (exact in the exact modes, for any batch), plus
  damping * I."""

  def instantiate_factors(self, grads_list, damping, weights=None):
    self._factor = self._make_scale_shift_factor(
        scale_shift_factors.ScaleAndShiftFullFactor, grads_list, weights,
        "full")
    self._damping_func = damping_lib.as_damping_func(damping)


class ScaleAndShiftDiagonalFB(ElementwiseDiagonalFB, _ScaleShiftBlock):
  """Diagonal Fisher of (scale, shift): E_n[v^2] per entry, plus damping."""

  def instantiate_factors(self, grads_list, damping, weights=None):
    self._factor = self._make_scale_shift_factor(
        scale_shift_factors.ScaleAndShiftDiagonalFactor, grads_list, weights,
        "diag")
    self._damping_func = damping_lib.as_damping_func(damping)


class ScaleAndShiftPerChannelFB(SingleFactorFB, _ScaleShiftBlock):
  """Per-channel Fisher blocks of (scale, shift): for each entry i of the
  scale, the [2, 2] block E_n[(v_scale_i, v_shift_i)(...)^T] of the full
  block (exact in the exact modes, for any batch), plus damping * I; the
  entries between channels are dropped. Its inverse costs O(channels), the
  full block's O(channels^3)."""

  def instantiate_factors(self, grads_list, damping, weights=None):
    self._factor = self._make_scale_shift_factor(
        scale_shift_factors.ScaleAndShiftPerChannelFactor, grads_list,
        weights, "per_channel")
    self._damping_func = damping_lib.as_damping_func(damping)

  def full_fisher_block(self):
    self._check_instantiated()
    return self._factor.dense(tf.convert_to_tensor(self._factor.get_cov()))
