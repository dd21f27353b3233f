"""Registration of dense (fully-connected) layers on the LayerCollection.

The mixin's methods run on a `LayerCollection` and use its core helpers:
`self._resolve_approx(params, approx, kind, table)`,
`self.register_block(params, block, reuse)`, `self._set_default(kind, value,
table)`, `self._block_params_set(block, params)`, `self._add_uses(params, n)`.
`_check_dense_shapes` is shared with the multi-use registrations
(layers/multi_use/registration.py).
"""

from kfac.python.ops.layers.base.approximations import (
    APPROX_DIAGONAL_NAME, APPROX_EKFAC_NAME, APPROX_EKFAC_REDUCE_NAME,
    APPROX_KRONECKER_BOTH_DIAG_NAME, APPROX_KRONECKER_IN_DIAG_NAME,
    APPROX_KRONECKER_NAME, APPROX_KRONECKER_OUT_DIAG_NAME,
    APPROX_KRONECKER_REDUCE_NAME)
from kfac.python.ops.layers.base.registration import VARIABLE_SCOPE
from kfac.python.ops.layers.base.registration import describe as _describe
from kfac.python.ops.layers.dense import blocks as dense_blocks
from kfac.python.ops.layers.multi_use import blocks as multi_use_blocks
from kfac.python.ops.tensors import utils


def _ekfac_block(name):
  # ekfac/ builds on the layer families: imported when a block is made.
  def make(lc, bias):
    from kfac.python.ops.ekfac import blocks as ekfac_blocks  # pylint: disable=g-import-not-at-top
    return getattr(ekfac_blocks, name)(lc, has_bias=bias)
  return make


_FULLY_CONNECTED_APPROX_TO_BLOCK = {
    APPROX_KRONECKER_NAME:
        lambda lc, bias: dense_blocks.FullyConnectedKFACBasicFB(
            lc, has_bias=bias),
    APPROX_KRONECKER_IN_DIAG_NAME:
        lambda lc, bias: dense_blocks.FullyConnectedKFACBasicFB(
            lc, has_bias=bias, diagonal_approx_for_input=True),
    APPROX_KRONECKER_OUT_DIAG_NAME:
        lambda lc, bias: dense_blocks.FullyConnectedKFACBasicFB(
            lc, has_bias=bias, diagonal_approx_for_output=True),
    APPROX_KRONECKER_BOTH_DIAG_NAME:
        lambda lc, bias: dense_blocks.FullyConnectedKFACBasicFB(
            lc, has_bias=bias, diagonal_approx_for_input=True,
            diagonal_approx_for_output=True),
    APPROX_DIAGONAL_NAME:
        lambda lc, bias: dense_blocks.FullyConnectedDiagonalFB(
            lc, has_bias=bias),
    APPROX_KRONECKER_REDUCE_NAME:
        lambda lc, bias: multi_use_blocks.FullyConnectedKFACReduceFB(
            lc, has_bias=bias),
    APPROX_EKFAC_NAME: _ekfac_block("FullyConnectedEKFACFB"),
    APPROX_EKFAC_REDUCE_NAME: _ekfac_block("FullyConnectedEKFACReduceFB"),
}


class DenseRegistrationMixin:
  """LayerCollection methods; see the module docstring."""

  def set_default_fully_connected_approximation(self, value):
    self._set_default("fully_connected", value,
                      _FULLY_CONNECTED_APPROX_TO_BLOCK)

  @property
  def default_fully_connected_approximation(self):
    return self._defaults["fully_connected"]

  def register_fully_connected(self, params, inputs, outputs, approx=None,
                               dense_inputs=True, reuse=VARIABLE_SCOPE):
    """Registers a dense layer outputs = inputs @ W (+ b).

    Args:
      params: W of shape [in, out], or a tuple (W, b) with b of shape [out].
      inputs: Tensor [batch, in], the layer inputs. A layer applied at
        several positions (a sequence, a grid) may take [batch, ..., in]
        inputs: the weight sharing is handled by KFAC-expand (kron and its
        diagonal variants, the default) or KFAC-reduce (kron_reduce).
      outputs: Tensor [batch, out] (or [batch, ..., out]), the
        pre-activations.
      approx: one of kron, kron_in_diag, kron_out_diag, kron_both_diag,
        diagonal, kron_reduce, ekfac, ekfac_reduce (default: the
        collection's fully-connected default).
      dense_inputs: False registers an embedding lookup: `inputs` are integer
        ids into the rows of W (see register_embedding in
        layers/embedding/registration.py).
      reuse: True adds a tower to an existing registration of `params`.
    """
    if not dense_inputs:
      return self._register_embedding(params, inputs, outputs, approx=approx,
                                      reuse=reuse)
    self._check_dense_shapes(params, inputs, outputs)
    approx = self._resolve_approx(params, approx, "fully_connected",
                                  _FULLY_CONNECTED_APPROX_TO_BLOCK)
    has_bias = isinstance(params, (list, tuple))
    block = _FULLY_CONNECTED_APPROX_TO_BLOCK[approx](self, has_bias)
    block = self.register_block(params, block, reuse=reuse)
    block.register_additional_tower(inputs, outputs)
    self._block_params_set(block, params)
    self._add_uses(params, 1)
    return block

  @staticmethod
  def _check_dense_shapes(params, inputs, outputs):
    seq = utils.ensure_sequence(params)
    if len(seq) not in (1, 2):
      raise ValueError("Dense layer params must be W or (W, b), got %d "
                       "variables (%s)." % (len(seq), _describe(params)))
    w = seq[0]
    # W is [in, out]; as in kfac 0.2.x a higher-rank W [..., out] (e.g. a
    # 1x1 convolution kernel) stands for its [prod(...), out] reshape.
    if w.shape.rank is None or w.shape.rank < 2 or not (
        w.shape[:-1].is_fully_defined()):
      raise ValueError("Dense layer weight %s must have rank 2 [in, out] (or "
                       "[..., out], used reshaped to [in, out]), got shape "
                       "%s." % (utils.variable_name(w), w.shape))
    d_in = int(w.shape[:-1].num_elements())
    d_out = w.shape[-1]
    if len(seq) == 2:
      b_shape = seq[1].shape
      if not (b_shape.rank == 1 or (b_shape.rank == 2 and b_shape[0] == 1)) \
          or b_shape[-1] != d_out:
        raise ValueError("Bias %s must have shape [%s] (or [1, %s]) to match "
                         "weight %s, got %s." %
                         (utils.variable_name(seq[1]), d_out, d_out,
                          utils.variable_name(w), b_shape))
    rank = inputs.shape.rank
    if rank is None or rank < 2 or inputs.shape[-1] != d_in:
      raise ValueError("Inputs of the layer with weight %s must have shape "
                       "[batch, %s] (or [batch, ..., %s] for a layer shared "
                       "over positions), got %s." %
                       (utils.variable_name(w), d_in, d_in, inputs.shape))
    if (outputs.shape.rank != rank or outputs.shape[-1] != d_out or
        not outputs.shape[:-1].is_compatible_with(inputs.shape[:-1])):
      raise ValueError("Outputs of the layer with weight %s must have shape "
                       "%s, matching inputs %s, got %s." %
                       (utils.variable_name(w),
                        inputs.shape[:-1].concatenate([d_out]),
                        inputs.shape, outputs.shape))
