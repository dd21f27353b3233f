"""Factors of scale-and-shift parameters (the affine part of batch / layer
normalization): outputs = inputs * scale (+ shift), with scale and shift
broadcast over the batch and any other axis where their shape is 1 or
missing.

The gradient of example n's loss w.r.t. the parameters is
v_n = (sum over broadcast axes of g_n * x_n, sum over broadcast axes of g_n),
with x_n the inputs and g_n the gradient w.r.t. the outputs. The factors keep
E_n[v v^T] (full), E_n[v^2] (diagonal), or the [2, 2] blocks of E_n[v v^T]
that pair each scale entry with its shift entry (per channel), summed over
sources with their weights. In the exact modes these are the exact Fisher
(GGN) block, its diagonal and its per-channel blocks, for any batch size.
"""

import numpy as np
import tensorflow as tf

from kfac.python.ops.layers.base.factors import DenseSquareFactor
from kfac.python.ops.layers.base.factors import DiagonalFactor
from kfac.python.ops.layers.base.factors import normalize_sources
from kfac.python.ops.layers.base.factors import normalize_weights
from kfac.python.ops.layers.base.factors import weighted_sum
from kfac.python.ops.tensors import utils

from kfac.python.ops.layers.base.batched_factors import BatchedSquareFactor
from kfac.python.ops.layers.base.batched_factors import per_channel_second_moments

__all__ = ["ScaleAndShiftFullFactor", "ScaleAndShiftDiagonalFactor",
           "ScaleAndShiftPerChannelFactor"]


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


class ScaleShiftGrads:
  """The per-example parameter gradients of a scale-and-shift layer, from
  its inputs (a tuple over towers) and the sources (with their weights) of
  the gradients w.r.t. its outputs; `size` counts the parameters."""

  def __init__(self, inputs, outputs_grads, scale_shape, shift_shape,
               weights):
    self.inputs = utils.ensure_sequence(inputs)
    self.grads = normalize_sources(outputs_grads)
    self.weights = normalize_weights(weights, len(self.grads))
    self.scale_shape = tuple(int(d) for d in scale_shape)
    self.shift_shape = (None if shift_shape is None else
                        tuple(int(d) for d in shift_shape))
    self.size = int(np.prod(self.scale_shape, dtype=np.int64))
    if self.shift_shape is not None:
      self.size += int(np.prod(self.shift_shape, dtype=np.int64))
    self.dtype = self.inputs[0].dtype

  def per_example(self, grads):
    """[examples, size]: the parameter gradient of each example for one
    source's `grads` (towers concatenated)."""
    rows = []
    for x, g in zip(self.inputs, grads):
      parts = [reduce_to_param(g * x, self.scale_shape)]
      if self.shift_shape is not None:
        parts.append(reduce_to_param(g, self.shift_shape))
      rows.append(parts[0] if len(parts) == 1 else tf.concat(parts, axis=1))
    return rows[0] if len(rows) == 1 else tf.concat(rows, axis=0)

  def per_source(self):
    """[(per-example gradients [examples, size], examples)] per source."""
    out = []
    for grads in self.grads:
      v = self.per_example(grads)
      out.append((v, tf.cast(tf.shape(v)[0], v.dtype)))
    return out


class ScaleAndShiftFullFactor(DenseSquareFactor):
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
    self._params_grads = g = ScaleShiftGrads(inputs, outputs_grads,
                                             scale_shape, shift_shape,
                                             weights)
    self._weights, self._n = g.weights, g.size
    DenseSquareFactor.__init__(self, name=name, weights=self._weights)

  @property
  def _dtype(self):
    return self._params_grads.dtype

  def _compute_new_cov(self):
    terms = [tf.matmul(v, v, transpose_a=True) / n
             for v, n in self._params_grads.per_source()]
    return weighted_sum(terms, self._weights)


class ScaleAndShiftDiagonalFactor(DiagonalFactor):
  """E_n[v^2], the diagonal of `ScaleAndShiftFullFactor`, as an [n, 1]
  column."""

  def __init__(self, inputs, outputs_grads, scale_shape, shift_shape=None,
               weights=None, name=None):
    """Arguments as for `ScaleAndShiftFullFactor`."""
    self._params_grads = g = ScaleShiftGrads(inputs, outputs_grads,
                                             scale_shape, shift_shape,
                                             weights)
    self._weights, self._n = g.weights, g.size
    DiagonalFactor.__init__(self, name=name)

  @property
  def _dtype(self):
    return self._params_grads.dtype

  @property
  def _cov_shape(self):
    return [self._n, 1]

  def _compute_new_cov(self):
    terms = [tf.reduce_sum(tf.square(v), axis=0)[:, tf.newaxis] / n
             for v, n in self._params_grads.per_source()]
    return weighted_sum(terms, self._weights)


class ScaleAndShiftPerChannelFactor(BatchedSquareFactor):
  """The per-channel blocks of `ScaleAndShiftFullFactor`: [m, k, k] with m
  the scale's size and k = 2 (scale_i, shift_i) with a shift (of the
  scale's shape), 1 without one. Products take and give the block's column
  view concat(scale.flatten(), shift.flatten()) [k m, cols]."""

  def __init__(self, inputs, outputs_grads, scale_shape, shift_shape=None,
               weights=None, name=None):
    """Arguments as for `ScaleAndShiftFullFactor`; the shift, if any, must
    have the scale's shape."""
    if shift_shape is not None and tuple(shift_shape) != tuple(scale_shape):
      raise ValueError(
          "The per-channel scale-and-shift approximation pairs each scale "
          "entry with its shift entry: their shapes must agree, got scale "
          "%s and shift %s (factor %s)." % (tuple(scale_shape),
                                            tuple(shift_shape), name))
    self._params_grads = g = ScaleShiftGrads(inputs, outputs_grads,
                                             scale_shape, shift_shape,
                                             weights)
    self._weights = g.weights
    self._batch = int(np.prod(g.scale_shape, dtype=np.int64))
    self._n = 1 if shift_shape is None else 2
    BatchedSquareFactor.__init__(self, name=name, weights=self._weights)

  @property
  def _dtype(self):
    return self._params_grads.dtype

  def _compute_new_cov(self):
    terms = []
    for v, n in self._params_grads.per_source():  # v: [examples, k m]
      pairs = tf.reshape(v, [-1, self._n, self._batch])
      terms.append(per_channel_second_moments(pairs) / n)
    return weighted_sum(terms, self._weights)

  def _pairs(self, col):
    """[k m, cols] -> [m, k, cols]."""
    return tf.transpose(tf.reshape(col, [self._n, self._batch, -1]),
                        [1, 0, 2])

  def _col(self, pairs):
    return tf.reshape(tf.transpose(pairs, [1, 0, 2]),
                      [self._n * self._batch, -1])

  def left_multiply_matpower(self, x, exp, damping_func):
    return self._col(BatchedSquareFactor.left_multiply_matpower(
        self, self._pairs(x), exp, damping_func))

  def left_multiply_cholesky(self, x, damping_func, transpose=False,
                             inverse=False):
    return self._col(BatchedSquareFactor.left_multiply_cholesky(
        self, self._pairs(x), damping_func, transpose=transpose,
        inverse=inverse))

  def dense(self, blocks):
    """The [k m, k m] matrix (in the column view's order) of [m, k, k]
    per-channel blocks."""
    eye = tf.eye(self._batch, dtype=blocks.dtype)
    # entry (i m + a, j m + b) = blocks[a, i, j] * [a == b]
    full = tf.einsum("aij,ab->iajb", blocks, eye)
    return tf.reshape(full, [self._n * self._batch, self._n * self._batch])
