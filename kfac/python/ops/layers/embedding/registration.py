"""Registration of embedding lookups (dense layers with integer-id inputs)
on a LayerCollection: the family's declaration (`FAMILY`) and its
registration function, which LayerCollection.register_embedding (and
register_fully_connected with dense_inputs=False) calls with the collection
`lc` first (its registry interface: `lc.linked_approximation`,
`lc.default_approximation`, `lc.register_block`, `lc.record_uses`). A
multi-use embedding (register_fully_connected_multi with
dense_inputs=False) is registered by layers/multi_use/registration.py with
this family's EMBEDDING_MULTI kind.

An embedding lookup is registered with
`register_fully_connected(W, ids, outputs, dense_inputs=False)` or its alias
`register_embedding(W, ids, outputs)`. Supported layouts (W [vocab, dim]):

* ids [batch] -> outputs [batch, dim]: one id per example (one-hot rows);
* ids [batch, k] -> outputs [batch, dim]: a bag of k ids per example whose
  table rows are summed (n-hot rows, repeated ids count twice);
* ids [batch, positions...] -> outputs [batch, positions..., dim]: one
  lookup per position (a sequence), the table shared over positions
  (KFAC-expand: factors averaged over batch * positions, block scaled by the
  number of positions);
* ids [batch, positions..., k] -> outputs [batch, positions..., dim]: a bag
  per position.

So the ids have the outputs' leading shape, with or without a trailing bag
axis.
"""

import tensorflow as tf

from kfac.python.ops.layers.base import registration as registration_base
from kfac.python.ops.tensors import utils

def _embedding_block(diagonal_approx_for_output):
  def make(lc, vocab):
    from kfac.python.ops.layers.embedding import blocks as embedding_blocks  # pylint: disable=g-import-not-at-top
    return embedding_blocks.EmbeddingKFACFB(
        lc, vocab, diagonal_approx_for_output=diagonal_approx_for_output)
  return make


def _diagonal_block(lc, vocab):
  from kfac.python.ops.layers.embedding import blocks as embedding_blocks  # pylint: disable=g-import-not-at-top
  return embedding_blocks.EmbeddingDiagonalFB(lc, vocab)


def _ekfac_block(lc, vocab):
  from kfac.python.ops.ekfac import blocks as ekfac_blocks  # pylint: disable=g-import-not-at-top
  return ekfac_blocks.EmbeddingEKFACFB(lc, vocab)


def _multi_indep_block(lc, vocab, num_uses):
  from kfac.python.ops.layers.embedding import blocks as embedding_blocks  # pylint: disable=g-import-not-at-top
  return embedding_blocks.EmbeddingMultiIndepFB(lc, vocab, num_uses)


# The input factor of an embedding is always diagonal, so kron_in_diag is
# kron and kron_both_diag is kron_out_diag. The default is the collection's
# fully-connected default.
EMBEDDING = registration_base.LayerKind(
    name="embedding", label="embedding", default=None,
    blocks={
        "kron": _embedding_block(False),
        "kron_in_diag": _embedding_block(False),
        "kron_out_diag": _embedding_block(True),
        "kron_both_diag": _embedding_block(True),
        "diagonal": _diagonal_block,
        "ekfac": _ekfac_block,
    })

# An embedding looked up once per use (register_fully_connected_multi with
# dense_inputs=False); the default is the collection's fully-connected
# multi default.
EMBEDDING_MULTI = registration_base.LayerKind(
    name="embedding_multi", label="multi-use embedding", default=None,
    blocks={"kron_indep": _multi_indep_block})

FAMILY = registration_base.LayerFamily(
    name="embedding", kinds=(EMBEDDING, EMBEDDING_MULTI),
    params="the table W [vocab, dim]",
    methods=("register_embedding",))


def _describe(params):
  return registration_base.describe(params)


def register_embedding(lc, params, inputs, outputs, approx=None,
                       reuse=registration_base.VARIABLE_SCOPE):
  """Registers an embedding lookup outputs = W[ids] (summed over a bag).

  Args:
    params: the table W [vocab, dim] (a tf.Variable). A bias is not
      supported (register it with register_generic).
    inputs: integer ids: [batch, positions...] (one id per lookup) or
      [batch, positions..., k] (a bag of k ids per lookup, summed).
    outputs: [batch, positions..., dim], the looked-up (summed) rows.
    approx: "kron" (default when the collection's fully-connected default
      is a Kronecker approximation), "kron_in_diag" (the same: the input
      factor of an embedding is diagonal anyway), "kron_out_diag" /
      "kron_both_diag" (diagonal output factor), "diagonal" (the exact
      diagonal of the table's Fisher) or "ekfac" (EKFAC in the basis
      I (x) Q_G).
    reuse: True adds a tower to an existing registration of `params`.

  Returns:
    The `EmbeddingKFACFB` or `EmbeddingDiagonalFB` block.
  """
  params = check_embedding_params(params)
  bag = check_embedding_shapes(params, inputs, outputs)
  approx = _embedding_approx(lc, params, approx)
  block = EMBEDDING.blocks[approx](lc, int(params.shape[0]))
  block = lc.register_block(params, block, reuse=reuse)
  if block.num_registered_towers:
    _check_same_positions(params, block.tensors_to_compute_grads()[0],
                          outputs)
  ids_rows, ids_per_example = _ids_layouts(inputs, outputs, bag)
  block.register_additional_tower(ids_rows, ids_per_example, outputs)
  registration_base.set_block_params(block, params)
  lc.record_uses(params, 1)
  return block


def _embedding_approx(lc, params, approx):
  from_default = approx is None
  if from_default:
    approx = (lc.linked_approximation(params) or
              lc.default_approximation("fully_connected"))
  if approx not in EMBEDDING.blocks:
    where = (" (the collection's default fully-connected approximation; "
             "pass approx= explicitly)" if from_default else "")
    raise ValueError(
        "Embedding layer (%s) does not support approximation %r%s; "
        "expected one of %s." % (_describe(params), approx, where,
                                 sorted(EMBEDDING.blocks)))
  return approx


def check_embedding_params(params):
  if isinstance(params, (list, tuple)):
    if len(params) == 1:
      params = params[0]
    else:
      raise ValueError(
          "Embedding lookups take the table W alone, got %d variables (%s). "
          "A bias after a lookup is not part of an embedding block: register "
          "it separately (e.g. register_generic(b, batch_size))." %
          (len(params), _describe(params)))
  if not isinstance(params, tf.Variable):
    raise TypeError("Registered parameters must be tf.Variables, got %r." %
                    (params,))
  if params.shape.rank != 2 or tf.compat.dimension_value(params.shape[0]) is None:
    raise ValueError("Embedding table %s must have shape [vocab, dim] with a "
                     "static vocab, got %s." % (_describe(params),
                                                params.shape))
  return params


def check_embedding_shapes(params, inputs, outputs):
  """Validates ids and outputs; returns True for a bag of ids per lookup."""
  name = _describe(params)
  if isinstance(inputs, (tf.SparseTensor, tf.RaggedTensor)) or not (
      utils.is_tensor_or_variable(inputs)):
    raise ValueError("Embedding inputs of %s must be a dense Tensor of "
                     "integer ids, got %r." % (name, inputs))
  if not inputs.dtype.is_integer:
    raise ValueError(
        "Embedding inputs of %s must be integer ids, got dtype %s (for "
        "dense inputs use register_fully_connected(..., dense_inputs=True))."
        % (name, inputs.dtype.name))
  if not utils.is_tensor_or_variable(outputs) or outputs.shape.rank is None:
    raise ValueError("Outputs of embedding %s must be a Tensor of known rank "
                     "[batch, ..., %s], got %r." % (name, params.shape[1],
                                                    outputs))
  rank = outputs.shape.rank
  if rank < 2 or outputs.shape[-1] != params.shape[1]:
    raise ValueError("Outputs of embedding %s must have shape [batch, ..., "
                     "%s] (the table's dim), got %s." %
                     (name, params.shape[1], outputs.shape))
  if outputs.dtype.base_dtype != params.dtype.base_dtype:
    raise ValueError("Outputs of embedding %s have dtype %s, the table %s." %
                     (name, outputs.dtype.name, params.dtype.name))
  ids_rank = inputs.shape.rank
  lead = outputs.shape[:-1]
  if ids_rank == rank - 1 and inputs.shape.is_compatible_with(lead):
    return False
  if ids_rank == rank and inputs.shape[:-1].is_compatible_with(lead):
    return True
  raise ValueError(
      "Embedding ids of %s have shape %s, which does not fit outputs %s: "
      "expected ids of shape %s (one id per lookup) or %s + [k] (a bag of k "
      "ids per lookup)." % (name, inputs.shape, outputs.shape, lead, lead))


def _check_same_positions(params, first_outputs, outputs):
  old, new = first_outputs.shape[1:-1], outputs.shape[1:-1]
  if (old.is_fully_defined() and new.is_fully_defined() and
      old.num_elements() != new.num_elements()):
    raise ValueError("Towers of embedding %s must look up the same number of "
                     "positions per example: %s vs %s." %
                     (_describe(params), old, new))


def _ids_layouts(ids, outputs, bag):
  """(ids per lookup row: [rows] or [rows, k]; ids [examples, positions,
  k])."""
  if bag:
    k = tf.compat.dimension_value(ids.shape[-1])
    if k is None:
      k = tf.shape(ids)[-1]
    rows = tf.reshape(ids, [-1, k]) if ids.shape.rank > 2 else ids
  else:
    k = 1
    rows = tf.reshape(ids, [-1]) if ids.shape.rank > 1 else ids
  positions = utils.dims_product(outputs, 1, -1)
  per_example = tf.reshape(ids, tf.stack([tf.shape(ids)[0], positions, k]))
  return rows, per_example
