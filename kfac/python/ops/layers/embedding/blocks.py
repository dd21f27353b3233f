"""Blocks of embedding lookups: K-FAC with a diagonal input factor, and the
exact diagonal.

Both take vectors shaped like the table W [vocab, dim], as a Tensor or as a
`tf.IndexedSlices` (the gradient of `tf.gather` / `tf.nn.embedding_lookup`).
IndexedSlices stay IndexedSlices: the diagonal input factor acts on the
touched rows through a gather and the output factor on the right of those
rows, so no dense [vocab, dim] tensor is built. Duplicate indices are fine:
every product here is linear and acts row by row, so each slice can be
transformed on its own.
"""

import tensorflow as tf

from kfac.python.ops.layers.base import damping as damping_lib
from kfac.python.ops.layers.dense import blocks as dense_blocks
from kfac.python.ops.layers.dense import factors as dense_factors
from kfac.python.ops.layers.embedding import factors as embedding_factors
from kfac.python.ops.tensors import utils
from kfac.python.ops.layers.base.blocks import ElementwiseDiagonalFB
from kfac.python.ops.layers.base.blocks import FisherBlock
from kfac.python.ops.layers.base.blocks import KroneckerProductFB

__all__ = ["EmbeddingKFACFB", "EmbeddingDiagonalFB", "EmbeddingMultiIndepFB"]


class _EmbeddingBlock(FisherBlock):
  """Towers of (ids, outputs) of one table W [vocab, dim].

  Each tower keeps its ids in two layouts: `rows` ([rows] for one id per
  lookup, [rows, k] for a bag of k ids per lookup; rows = examples *
  positions) and `per_example` ([examples, positions, k]).
  """

  supports_indexed_slices = True

  def __init__(self, layer_collection, vocab_size, params=None):
    super().__init__(layer_collection, params)
    self._vocab_size = int(vocab_size)
    self._ids_rows = []
    self._ids_per_example = []
    self._outputs = []

  def register_additional_tower(self, ids_rows, ids_per_example, outputs):
    self._ids_rows.append(ids_rows)
    self._ids_per_example.append(ids_per_example)
    self._outputs.append(outputs)

  @property
  def num_registered_towers(self):
    return len(self._outputs)

  @property
  def vocab_size(self):
    return self._vocab_size

  def tensors_to_compute_grads(self):
    return tuple(self._outputs)

  def _to_mat(self, vector):
    return tf.convert_to_tensor(vector)

  def _from_mat(self, mat, template):
    return tf.reshape(mat, tf.shape(template))


def _slices(values, like):
  return tf.IndexedSlices(values, like.indices, like.dense_shape)


class EmbeddingKFACFB(_EmbeddingBlock, KroneckerProductFB):
  """K-FAC block of an embedding table: F ~= c * (A (x) G).

  A is the diagonal n-hot input second moment
  (`EmbeddingInputKroneckerFactor`), G = E[g g^T] over the gradients w.r.t.
  the outputs (`FullyConnectedKroneckerFactor`, or its diagonal with
  `diagonal_approx_for_output`). For lookups at several positions per
  example (outputs [batch, positions..., dim]) both factors average over
  batch and positions and c is the number of positions (KFAC-expand, as for
  dense layers with rank > 2 inputs); otherwise c = 1. Damping: the pi rule
  on damping / c, as for every `KroneckerProductFB`.

  This is the block of `register_fully_connected` with one-hot inputs
  (exactly, for one id per lookup; for bags of ids A is the diagonal of
  the dense layer's A).
  """

  def __init__(self, layer_collection, vocab_size,
               diagonal_approx_for_output=False, params=None):
    _EmbeddingBlock.__init__(self, layer_collection, vocab_size, params)
    self._diag_out = diagonal_approx_for_output

  @property
  def _renorm_coeff(self):
    return dense_blocks.num_shared_positions(self._outputs[0])

  def instantiate_factors(self, grads_list, damping, weights=None):
    dtype = self._outputs[0].dtype
    self._input_factor = self._make_factor(
        embedding_factors.EmbeddingInputKroneckerFactor,
        (tuple(self._ids_rows), self._vocab_size, dtype), "A")
    out_cls = (dense_factors.DiagonalKroneckerFactor if self._diag_out else
               dense_factors.FullyConnectedKroneckerFactor)
    weights = None if weights is None else tuple(weights)
    self._output_factor = self._make_factor(
        out_cls, (tuple(tuple(g) for g in grads_list), False, weights), "G")
    self._setup_damping(damping)

  def multiply_matpower(self, vector, exp):
    if not isinstance(vector, tf.IndexedSlices):
      return KroneckerProductFB.multiply_matpower(self, vector, exp)
    self._check_instantiated()
    rows = self._input_factor.gathered_matpower(vector.indices, exp,
                                                self._in_damping)
    values = vector.values * rows[:, tf.newaxis]
    values = self._output_factor.right_multiply_matpower(values, exp,
                                                         self._out_damping)
    return _slices(self._scaled(values, exp), vector)

  def _multiply_cholesky(self, vector, transpose, inverse):
    if not isinstance(vector, tf.IndexedSlices):
      return KroneckerProductFB._multiply_cholesky(self, vector, transpose,
                                                   inverse)
    # The Cholesky factor of a diagonal is its square root (its own
    # transpose); G's acts on the right as in KroneckerProductFB.
    self._check_instantiated()
    half = -0.5 if inverse else 0.5
    rows = self._input_factor.gathered_matpower(vector.indices, half,
                                                self._in_damping)
    values = vector.values * rows[:, tf.newaxis]
    values = self._output_factor.right_multiply_cholesky(
        values, self._out_damping, transpose=not transpose, inverse=inverse)
    return _slices(self._scaled(values, half), vector)


class EmbeddingDiagonalFB(ElementwiseDiagonalFB, _EmbeddingBlock):
  """Exact diagonal of an embedding table's Fisher
  (`EmbeddingDiagonalFactor`, [vocab, dim]), plus damping. Lookups at several
  positions add their gradients per example before squaring, so this is
  the exact diagonal for any number of positions."""

  def __init__(self, layer_collection, vocab_size, params=None):
    _EmbeddingBlock.__init__(self, layer_collection, vocab_size, params)
    self._factor = None

  def instantiate_factors(self, grads_list, damping, weights=None):
    weights = None if weights is None else tuple(weights)
    self._factor = self._make_factor(
        embedding_factors.EmbeddingDiagonalFactor,
        (tuple(self._ids_per_example), tuple(tuple(g) for g in grads_list),
         self._vocab_size, weights), "diag")
    self._damping_func = damping_lib.as_damping_func(damping)

  def _to_view(self, vector):
    return self._to_mat(vector)

  def _from_view(self, view, template):
    return self._from_mat(view, template)

  def _apply_power(self, vector, exp):
    if not isinstance(vector, tf.IndexedSlices):
      return ElementwiseDiagonalFB._apply_power(self, vector, exp)
    self._check_instantiated()
    rows = self._factor.gathered_matpower(vector.indices, exp,
                                          self._damping_func)
    return _slices(vector.values * rows, vector)


class EmbeddingMultiIndepFB(EmbeddingKFACFB):
  """kron_indep block of an embedding table looked up several times (one
  lookup per RNN step, tied input/output embeddings):
  F ~= num_uses * (A (x) G).

  A (the diagonal n-hot second moment) and G average over all uses and
  examples, so this is the `FullyConnectedMultiIndepFB` of the one-hot
  inputs, and the same as registering the stacked lookups [batch, uses, dim]
  with `register_fully_connected(..., dense_inputs=False)`. Damping: the pi
  rule on damping / num_uses. A tower is (tuple of per-use ids, tuple of
  per-use outputs), or one folded tensor each.
  """

  def __init__(self, layer_collection, vocab_size, num_uses, params=None):
    EmbeddingKFACFB.__init__(self, layer_collection, vocab_size, params=params)
    self._num_uses = int(num_uses)
    self._num_towers = 0

  @property
  def num_uses(self):
    return self._num_uses

  @property
  def _renorm_coeff(self):
    return self._num_uses

  def register_additional_tower(self, ids_uses, outputs_uses):
    """`ids_uses` / `outputs_uses`: tuples over uses (or one folded tensor)
    of [batch] or [batch, k] ids and [batch, dim] outputs."""
    ids_uses = tuple(utils.ensure_sequence(ids_uses))
    outputs_uses = tuple(utils.ensure_sequence(outputs_uses))
    self._ids_rows.extend(ids_uses)
    self._outputs.extend(outputs_uses)
    self._num_towers += 1

  @property
  def num_registered_towers(self):
    return self._num_towers
