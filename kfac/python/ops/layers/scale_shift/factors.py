"""Factors of scale-and-shift parameters (the affine part of batch / layer
normalization): outputs = inputs * scale (+ shift), with scale and shift
broadcast over the batch and any other axis where their shape is 1 or
missing.

The gradient of example n's loss w.r.t. the parameters is
v_n = (sum over broadcast axes of g_n * x_n, sum over broadcast axes of g_n),
with x_n the inputs and g_n the gradient w.r.t. the outputs. The factors keep
E_n[v v^T] (full) or E_n[v^2] (diagonal), summed over sources with their
weights. In the exact modes these are the exact Fisher (GGN) block and its
diagonal, for any batch size.
"""

import numpy as np
import tensorflow as tf

from kfac.python.ops.layers.base.factors import DenseSquareFactor
from kfac.python.ops.layers.base.factors import DiagonalFactor
from kfac.python.ops.layers.base.factors import normalize_sources
from kfac.python.ops.layers.base.factors import normalize_weights
from kfac.python.ops.layers.base.factors import weighted_sum
from kfac.python.ops.tensors import utils

__all__ = ["ScaleAndShiftFullFactor", "ScaleAndShiftDiagonalFactor"]


def broadcast_axes(input_rank, param_shape):
  """Axes of a [batch, ...] tensor of rank `input_rank` that a parameter of
  shape `param_shape` (aligned with the trailing axes) is broadcast over,
  batch excluded. A parameter of the inputs' full rank has a leading 1."""
  param_shape = list(param_shape)
  if len(param_shape) == input_rank:
    param_shape = param_shape[1:]
  padded = [1] * (input_rank - 1 - len(param_shape)) + param_shape
  return [i + 1 for i, d in enumerate(padded) if d == 1]


def reduce_to_param(tensor, param_shape):
  """Per-example sum of `tensor` [batch, ...] over the axes `param_shape`
  broadcasts over, flattened to [batch, size(param)] (row-major, as the
  parameter flattens)."""
  axes = broadcast_axes(tensor.shape.rank, param_shape)
  if axes:
    tensor = tf.reduce_sum(tensor, axis=axes, keepdims=True)
  return tf.reshape(tensor, [-1, int(np.prod(param_shape, dtype=np.int64))])


class _ScaleShiftMixin:
  """Per-example parameter gradients of a scale-and-shift layer."""

  def _init_scale_shift(self, inputs, outputs_grads, scale_shape, shift_shape,
                        weights):
    self._inputs = utils.ensure_sequence(inputs)
    self._grads = normalize_sources(outputs_grads)
    self._weights = normalize_weights(weights, len(self._grads))
    self._scale_shape = tuple(int(d) for d in scale_shape)
    self._shift_shape = (None if shift_shape is None else
                         tuple(int(d) for d in shift_shape))
    self._n = int(np.prod(self._scale_shape, dtype=np.int64))
    if self._shift_shape is not None:
      self._n += int(np.prod(self._shift_shape, dtype=np.int64))
    self._input_dtype = self._inputs[0].dtype

  @property
  def _dtype(self):
    return self._input_dtype

  def _per_example_grads(self, grads):
    """[examples, n]: the parameter gradient of each example (towers
    concatenated)."""
    rows = []
    for x, g in zip(self._inputs, grads):
      parts = [reduce_to_param(g * x, self._scale_shape)]
      if self._shift_shape is not None:
        parts.append(reduce_to_param(g, self._shift_shape))
      rows.append(parts[0] if len(parts) == 1 else tf.concat(parts, axis=1))
    return rows[0] if len(rows) == 1 else tf.concat(rows, axis=0)


class ScaleAndShiftFullFactor(_ScaleShiftMixin, DenseSquareFactor):
  """E_n[v v^T] for the per-example gradient v of (scale, shift), flattened
  as concat(scale.flatten(), shift.flatten())."""

  def __init__(self, inputs, outputs_grads, scale_shape, shift_shape=None,
               weights=None, name=None):
    """Creates the factor.

    Args:
      inputs: the layer inputs [batch, ...], or a tuple of them (towers).
      outputs_grads: list over sources of tuples over towers of the
        gradients w.r.t. the outputs (shaped like the inputs).
      scale_shape: static shape of scale (a tuple of ints).
      shift_shape: static shape of shift, or None without a shift.
      weights: optional per-source weights.
      name: the factor's name.
    """
    self._init_scale_shift(inputs, outputs_grads, scale_shape, shift_shape,
                           weights)
    DenseSquareFactor.__init__(self, name=name, weights=self._weights)

  def _compute_new_cov(self):
    terms = []
    for grads in self._grads:
      v = self._per_example_grads(grads)
      n = tf.cast(tf.shape(v)[0], v.dtype)
      terms.append(tf.matmul(v, v, transpose_a=True) / n)
    return weighted_sum(terms, self._weights)


class ScaleAndShiftDiagonalFactor(_ScaleShiftMixin, DiagonalFactor):
  """E_n[v^2], the diagonal of `ScaleAndShiftFullFactor`, as an [n, 1]
  column."""

  def __init__(self, inputs, outputs_grads, scale_shape, shift_shape=None,
               weights=None, name=None):
    """Arguments as for `ScaleAndShiftFullFactor`."""
    self._init_scale_shift(inputs, outputs_grads, scale_shape, shift_shape,
                           weights)
    DiagonalFactor.__init__(self, name=name)

  @property
  def _cov_shape(self):
    return [self._n, 1]

  def _compute_new_cov(self):
    terms = []
    for grads in self._grads:
      v = self._per_example_grads(grads)
      n = tf.cast(tf.shape(v)[0], v.dtype)
      terms.append(tf.reduce_sum(tf.square(v), axis=0)[:, tf.newaxis] / n)
    return weighted_sum(terms, self._weights)
