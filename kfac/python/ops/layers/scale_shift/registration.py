"""Registration of scale-and-shift (normalization affine) parameters on a
LayerCollection: the family's declaration (`FAMILY`) and its registration
function, which LayerCollection.register_scale_and_shift calls with the
collection `lc` first (its registry interface: `lc.resolve_approximation`,
`lc.register_block`, `lc.record_uses`).

`register_scale_and_shift(params, inputs, outputs)` registers
outputs = inputs * scale (+ shift) with `params` = `scale` or
`(scale, shift)`. The parameters broadcast like numpy against the inputs
[batch, ...] without the batch axis: their shape aligns with the inputs'
trailing axes, and each of their axes is 1 (broadcast) or the input's size.
Examples: inputs [N, H, W, C] with scale [C], [1, 1, C] or [H, W, C];
LayerNorm-style inputs [N, T, D] with scale [D]. A parameter of the inputs'
full rank must have a leading 1 (it cannot differ per example).
"""

from kfac.python.ops.layers.base import registration as registration_base
from kfac.python.ops.tensors import utils


def _block(name):
  # The blocks module is imported when a block is made.
  def make(lc, params):
    from kfac.python.ops.layers.scale_shift import blocks as scale_shift_blocks  # pylint: disable=g-import-not-at-top
    return getattr(scale_shift_blocks, name)(lc, params)
  return make


SCALE_AND_SHIFT = registration_base.LayerKind(
    name="scale_and_shift", label="scale and shift", default="full",
    blocks={
        "full": _block("ScaleAndShiftFullFB"),
        "diagonal": _block("ScaleAndShiftDiagonalFB"),
        "per_channel": _block("ScaleAndShiftPerChannelFB"),
    },
    settable=True)

FAMILY = registration_base.LayerFamily(
    name="scale_shift", kinds=(SCALE_AND_SHIFT,),
    params="scale, or (scale, shift)",
    methods=("register_scale_and_shift",))


def register_scale_and_shift(lc, params, inputs, outputs, approx=None,
                             reuse=registration_base.VARIABLE_SCOPE):
  """Registers outputs = inputs * scale (+ shift).

  Args:
    params: `scale`, or a tuple `(scale, shift)` (tf.Variables).
    inputs: Tensor [batch, ...], the normalized inputs.
    outputs: Tensor shaped like `inputs`.
    approx: "full" (the default scale-and-shift approximation unless
      changed): the exact Fisher block of the parameters' per-example
      gradients; "diagonal": its diagonal; or "per_channel": its [2, 2]
      blocks pairing each scale entry with its shift entry (scale and
      shift of one shape), the couplings between channels dropped.
    reuse: True adds a tower to an existing registration of `params`.

  Returns:
    The `ScaleAndShiftFullFB`, `ScaleAndShiftDiagonalFB` or
    `ScaleAndShiftPerChannelFB` block.
  """
  _check_scale_shift(params, inputs, outputs)
  approx = lc.resolve_approximation(params, approx, SCALE_AND_SHIFT)
  seq = utils.ensure_sequence(params)
  if (approx == "per_channel" and len(seq) == 2 and
      tuple(seq[0].shape) != tuple(seq[1].shape)):
    raise ValueError(
        "register_scale_and_shift(approx='per_channel') pairs each scale "
        "entry with its shift entry: scale %s has shape %s, shift %s has "
        "shape %s." % (seq[0].name, tuple(seq[0].shape), seq[1].name,
                       tuple(seq[1].shape)))
  block = SCALE_AND_SHIFT.blocks[approx](lc, params)
  block = lc.register_block(params, block, reuse=reuse)
  block.register_additional_tower(inputs, outputs)
  registration_base.set_block_params(block, params)
  lc.record_uses(params, 1)
  return block


def _check_scale_shift(params, inputs, outputs):
  seq = utils.ensure_sequence(params)
  name = registration_base.describe(params)
  if len(seq) not in (1, 2):
    raise ValueError("Scale-and-shift params must be scale or (scale, shift), "
                     "got %d variables (%s)." % (len(seq), name))
  if not utils.is_tensor_or_variable(inputs) or inputs.shape.rank is None:
    raise ValueError("Inputs of the scale-and-shift layer (%s) must be a "
                     "Tensor of known rank [batch, ...], got %r." %
                     (name, inputs))
  if not utils.is_tensor_or_variable(outputs) or (
      not outputs.shape.is_compatible_with(inputs.shape)):
    raise ValueError("Outputs of the scale-and-shift layer (%s) must have the "
                     "inputs' shape %s, got %s." %
                     (name, inputs.shape, getattr(outputs, "shape", outputs)))
  rank = inputs.shape.rank
  if rank < 1:
    raise ValueError("Inputs of the scale-and-shift layer (%s) need a batch "
                     "axis, got shape %s." % (name, inputs.shape))
  for role, var in zip(("scale", "shift"), seq):
    vname = utils.variable_name(var)
    shape = var.shape
    if not shape.is_fully_defined():
      raise ValueError("The %s %s needs a static shape, got %s." %
                       (role, vname, shape))
    if var.dtype.base_dtype != inputs.dtype.base_dtype:
      raise ValueError("The %s %s has dtype %s but the inputs %s." %
                       (role, vname, var.dtype.name, inputs.dtype.name))
    dims = shape.as_list()
    if len(dims) > rank or (len(dims) == rank and dims[0] != 1):
      raise ValueError(
          "The %s %s of shape %s does not broadcast over the batch of inputs "
          "%s: it must align with the inputs' trailing axes (a parameter of "
          "the inputs' rank needs a leading 1)." %
          (role, vname, shape, inputs.shape))
    in_dims = inputs.shape.as_list()[rank - len(dims):]
    for d, i in zip(dims, in_dims):
      if d != 1 and i is not None and d != i:
        raise ValueError(
            "The %s %s of shape %s does not broadcast against inputs of shape "
            "%s: each of its axes must be 1 or the size of the input axis it "
            "aligns with (trailing axes)." % (role, vname, shape,
                                              inputs.shape))
