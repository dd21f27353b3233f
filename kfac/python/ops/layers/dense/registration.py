"""Registration of dense (fully-connected) layers on a LayerCollection:
the family's declaration (`FAMILY`: its kind, the block per approximation)
and its registration function, which LayerCollection.register_fully_connected
calls.

The function takes the collection `lc` first and uses its registry
interface: `lc.resolve_approximation(params, approx, kind)`,
`lc.register_block(params, block, reuse)`, `lc.record_uses(params, n)`.
`check_dense_shapes` is shared with the multi-use registrations
(layers/multi_use/registration.py).
"""

import warnings

import tensorflow as tf

from kfac.python.ops.layers.base.approximations import (
    APPROX_DIAGONAL_NAME, APPROX_EKFAC_NAME, APPROX_EKFAC_REDUCE_NAME,
    APPROX_KRONECKER_BOTH_DIAG_NAME, APPROX_KRONECKER_IN_DIAG_NAME,
    APPROX_KRONECKER_NAME, APPROX_KRONECKER_OUT_DIAG_NAME,
    APPROX_KRONECKER_REDUCE_NAME)
from kfac.python.ops.layers.base import registration as registration_base
from kfac.python.ops.layers.base.registration import VARIABLE_SCOPE
from kfac.python.ops.layers.base.registration import describe as _describe
from kfac.python.ops.layers.dense import blocks as dense_blocks
from kfac.python.ops.layers.embedding import registration as embedding_registration
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


FULLY_CONNECTED = registration_base.LayerKind(
    name="fully_connected", label="fully connected",
    default=APPROX_KRONECKER_NAME, blocks=_FULLY_CONNECTED_APPROX_TO_BLOCK,
    settable=True)

FAMILY = registration_base.LayerFamily(
    name="dense", kinds=(FULLY_CONNECTED,),
    params="W [in, out] (or [in_axes..., out_axes...]), or (W, b)",
    methods=("register_fully_connected",))


def register_fully_connected(lc, params, inputs, outputs, approx=None,
                             dense_inputs=True, reuse=VARIABLE_SCOPE,
                             output_axes=1):
  """Registers a dense layer outputs = inputs @ W (+ b).

  Args:
    params: W of shape [in, out], or a tuple (W, b) with b of shape [out].
      A W of rank > 2 is [in_axes..., out_axes...], its last
      `output_axes` axes the output axes (by default W [..., out], as in
      kfac 0.2.x: e.g. a 1x1 convolution kernel), used reshaped to
      [prod(in_axes), prod(out_axes)]; b is then [out_axes...] (or its
      flattening).
    inputs: Tensor [batch, in], the layer inputs. A layer applied at
      several positions (a sequence, a grid) may take [batch, ..., in]
      inputs: the weight sharing is handled by KFAC-expand (kron and its
      diagonal variants, the default) or KFAC-reduce (kron_reduce). With
      a W of rank > 2 the inputs may end in W's input axes
      ([batch, ..., in_axes...]); they are then flattened to
      [batch, ..., prod(in_axes)].
    outputs: Tensor [batch, out] (or [batch, ..., out_axes...]), the
      pre-activations: the tensor the loss depends on, never a reshape
      of it (the output statistics are gradients w.r.t. it).
    approx: one of kron, kron_in_diag, kron_out_diag, kron_both_diag,
      diagonal, kron_reduce, ekfac, ekfac_reduce (default: the
      collection's fully-connected default).
    dense_inputs: False registers an embedding lookup: `inputs` are integer
      ids into the rows of W (see register_embedding in
      layers/embedding/registration.py).
    reuse: True adds a tower to an existing registration of `params`.
    output_axes: how many trailing axes of W (and of `outputs`) are output
      axes (an int >= 1; e.g. 2 for an EinsumDense `abc,cde->abde`
      kernel [dim, heads, head_dim]).
  """
  if not dense_inputs:
    if output_axes != 1:
      raise ValueError("output_axes=%r: an embedding (dense_inputs=False) "
                       "has one output axis." % (output_axes,))
    return embedding_registration.register_embedding(
        lc, params, inputs, outputs, approx=approx, reuse=reuse)
  try:
    inputs = check_dense_shapes(params, inputs, outputs, output_axes)
  except ValueError as e:
    if not _scalar_params(params):
      raise
    # kfac 0.2.x registered any tensors and failed, if ever, when the
    # factors were made; its own tests register scalar constants.
    message = str(e)
    warnings.warn(
        message + " Registered anyway, as kfac 0.2.x did: K-FAC raises this "
        "when it makes the factors (give W [in, out] and b [out]).",
        UserWarning, stacklevel=3)
    lc.record_unusable(message)
  approx = lc.resolve_approximation(params, approx, FULLY_CONNECTED)
  has_bias = isinstance(params, (list, tuple))
  block = FULLY_CONNECTED.blocks[approx](lc, has_bias)
  block = lc.register_block(params, block, reuse=reuse)
  if output_axes != 1 and not hasattr(block, "set_output_axes"):
    raise ValueError("Weight %s with output_axes=%d needs a dense block; "
                     "it is registered with %s." %
                     (_describe(params), output_axes, type(block).__name__))
  if hasattr(block, "set_output_axes"):
    block.set_output_axes(output_axes)
  block.register_additional_tower(inputs, outputs)
  registration_base.set_block_params(block, params)
  lc.record_uses(params, 1)
  return block


def _scalar_params(params):
  """Whether every tensor of a dense layer's params is a scalar."""
  return all(getattr(p, "shape", None) is not None and p.shape.rank == 0
             for p in utils.ensure_sequence(params))


def check_dense_shapes(params, inputs, outputs, output_axes=1):
  """Checks the shapes of a dense layer's params, inputs and outputs and
  returns the inputs, flattened to [batch, ..., in] when they end in the
  input axes of a weight of rank > 2."""
  seq = utils.ensure_sequence(params)
  if len(seq) not in (1, 2):
    raise ValueError("Dense layer params must be W or (W, b), got %d "
                     "variables (%s)." % (len(seq), _describe(params)))
  w = seq[0]
  if (not isinstance(output_axes, int) or isinstance(output_axes, bool) or
      output_axes < 1):
    raise ValueError("output_axes of the layer with weight %s must be an "
                     "int >= 1, got %r." % (utils.variable_name(w),
                                            output_axes))
  # W is [in, out]; as in kfac 0.2.x a higher-rank W [..., out] (e.g. a
  # 1x1 convolution kernel) stands for its [prod(...), out] reshape, and
  # with output_axes = k, W [in_axes..., out_axes (k)...] for its
  # [prod(in_axes), prod(out_axes)] reshape.
  k = output_axes
  if w.shape.rank is None or w.shape.rank < k + 1 or not (
      w.shape[:-k].is_fully_defined() if k == 1 else
      w.shape.is_fully_defined()):
    raise ValueError("Dense layer weight %s must have rank 2 [in, out] (or "
                     "[in_axes..., out_axes...] with %d output axes, used "
                     "reshaped to [in, out]), got shape %s." %
                     (utils.variable_name(w), k, w.shape))
  in_shape, out_shape = w.shape[:-k], w.shape[-k:]
  d_in = int(in_shape.num_elements())
  d_out = w.shape[-1] if k == 1 else int(out_shape.num_elements())
  if len(seq) == 2:
    b_shape = seq[1].shape
    flat_ok = ((b_shape.rank == 1 or (b_shape.rank == 2 and
                                       b_shape[0] == 1)) and
               b_shape[-1] == d_out)
    if not (flat_ok or (k > 1 and b_shape == out_shape)):
      raise ValueError("Bias %s must have shape [%s] (or [1, %s]%s) to match "
                       "weight %s, got %s." %
                       (utils.variable_name(seq[1]), d_out, d_out,
                        "" if k == 1 else " or %s" % out_shape,
                        utils.variable_name(w), b_shape))
  rank = inputs.shape.rank
  n_in = w.shape.rank - k
  if (n_in > 1 and rank is not None and rank > n_in and
      inputs.shape[-1] != d_in and inputs.shape[-n_in:] == in_shape):
    inputs = _flatten_input_axes(inputs, n_in, d_in)
    rank = inputs.shape.rank
  if rank is None or rank < 2 or inputs.shape[-1] != d_in:
    raise ValueError("Inputs of the layer with weight %s must have shape "
                     "[batch, %s] (or [batch, ..., %s] for a layer shared "
                     "over positions%s), got %s." %
                     (utils.variable_name(w), d_in, d_in,
                      "" if n_in == 1 else
                      ", or [batch, ..., %s]" % in_shape.as_list(),
                      inputs.shape))
  expected = inputs.shape[:-1].concatenate(out_shape if k > 1 else [d_out])
  if (outputs.shape.rank != rank - 1 + k or
      outputs.shape[-k:].as_list() != expected[-k:].as_list() or
      not outputs.shape.is_compatible_with(expected)):
    raise ValueError("Outputs of the layer with weight %s must have shape "
                     "%s, matching inputs %s, got %s." %
                     (utils.variable_name(w), expected, inputs.shape,
                      outputs.shape))
  return inputs




def _flatten_input_axes(inputs, num_axes, width):
  """[batch, ..., in_axes (num_axes)...] -> [batch, ..., width]."""
  lead = inputs.shape[:-num_axes]
  if lead.is_fully_defined():
    return tf.reshape(inputs, lead.as_list() + [width])
  flat = tf.reshape(inputs, tf.concat([tf.shape(inputs)[:-num_axes],
                                       [width]], 0))
  flat.set_shape(lead.concatenate([width]))
  return flat
