"""Registration of convolution layers (conv1d/2d/N-d, depthwise, separable,
grouped, conv2d multi-use) on a LayerCollection: the family's declaration
(`FAMILY`: its kinds, the block per approximation) and its registration
functions, which LayerCollection's register_conv* / register_convolution /
register_depthwise_conv2d / register_separable_conv2d /
register_grouped_convolution call with the collection `lc` first (its
registry interface: `lc.resolve_approximation`, `lc.linked_approximation`,
`lc.register_block`, `lc.record_uses`).

Approximations of a convolution (register_conv1d / conv2d / convolution):
  "kron" (default: the collection's conv2d default)  KFC, L * (A (x) G)
  "diagonal"     exact diagonal
  "kron_sua"     KFC with the spatially-uncorrelated-activations input factor
  "kron_reduce"  KFAC-reduce (Eschenhagen et al. 2023)
  "ekfac" / "ekfac_reduce"  EKFAC in the KFC / KFAC-reduce eigenbasis
                 (George et al. 2018; ekfac/blocks.py)
Depthwise convolutions: "diagonal" (default) or "kron" (per-channel KFC).
Grouped convolutions (register_grouped_convolution; filter [k.., C/G, O] on
inputs with C channels): "kron" (KFC block-diagonal over the G groups,
layers/conv/grouped.py).
A conv2d used several times (register_conv2d_multi): "kron_indep".

strides / dilations accept an int, one int per spatial dimension, or the
TensorFlow form with batch and channel entries ([1, s, s, 1] for NHWC,
[1, 1, s, s] for NCHW). padding: "SAME", "VALID", explicit (before, after)
pairs (per spatial dimension, or TensorFlow's per-dimension list), and
"CAUSAL" for conv1d.
"""

import numpy as np

from kfac.python.ops.layers.conv import blocks as conv_blocks
from kfac.python.ops.layers.conv import grouped as grouped_conv
from kfac.python.ops.layers.conv import patches as patches_lib
from kfac.python.ops.layers.base import registration as registration_base
from kfac.python.ops.tensors import utils
from kfac.python.ops.ekfac import blocks as ekfac_blocks

_VARIABLE_SCOPE = registration_base.VARIABLE_SCOPE
_describe = registration_base.describe

_KRON = "kron"
_DIAGONAL = "diagonal"
_KRON_SUA = "kron_sua"
_KRON_REDUCE = "kron_reduce"
_KRON_INDEP = "kron_indep"
_EKFAC = "ekfac"
_EKFAC_REDUCE = "ekfac_reduce"


def _kfc(lc, params, spec, data_format, sub_sample_inputs=None,
         sub_sample_patches=None, patch_mask=None, sua=False):
  return conv_blocks.ConvKFCBasicFB(
      lc, params, spec.padding, spec.strides, spec.dilations, data_format,
      sub_sample_inputs=sub_sample_inputs,
      sub_sample_patches=sub_sample_patches,
      use_sua_approx_for_input_factor=sua, patch_mask=patch_mask)


def _kfc_sua(lc, params, spec, data_format, sub_sample_inputs=None,
             sub_sample_patches=None, patch_mask=None):
  return _kfc(lc, params, spec, data_format, sub_sample_inputs,
              sub_sample_patches, patch_mask, sua=True)


def _diagonal(lc, params, spec, data_format, sub_sample_inputs=None,
              sub_sample_patches=None, patch_mask=None):
  del sub_sample_inputs, sub_sample_patches  # not taken (see _ACCEPTS)
  return conv_blocks.ConvDiagonalFB(
      lc, params, spec.strides, spec.padding, data_format, spec.dilations,
      patch_mask=patch_mask)


def _kfc_reduce(lc, params, spec, data_format, sub_sample_inputs=None,
                sub_sample_patches=None, patch_mask=None):
  del sub_sample_patches  # not taken (see _ACCEPTS)
  return conv_blocks.ConvKFCReduceFB(
      lc, params, spec.padding, spec.strides, spec.dilations, data_format,
      sub_sample_inputs=sub_sample_inputs, patch_mask=patch_mask)


def _ekfac(cls):
  def make(lc, params, spec, data_format, sub_sample_inputs=None,
           sub_sample_patches=None, patch_mask=None):
    del sub_sample_inputs, sub_sample_patches  # not taken (see _ACCEPTS)
    return cls(lc, params, spec.padding, spec.strides, spec.dilations,
               data_format, patch_mask=patch_mask)
  return make


def _multi_indep(lc, params, spec, data_format, num_uses):
  return conv_blocks.ConvKFCBasicMultiIndepFB(
      lc, params, spec.padding, spec.strides, spec.dilations, data_format,
      num_uses=num_uses)


def _depthwise(cls):
  def make(lc, params, spec, data_format, **options):
    return cls(lc, params, spec.strides, spec.padding, spec.dilations,
               data_format, **options)
  return make


def _grouped_kfc(lc, params, groups, spec, data_format):
  return grouped_conv.GroupedConvKFCBasicFB(
      lc, params, groups, spec.padding, spec.strides, spec.dilations,
      data_format)


# register_conv1d / conv2d / convolution (and the pointwise layer of
# register_separable_conv2d).
CONV2D = registration_base.LayerKind(
    name="conv2d", label="conv2d", default=_KRON, settable=True, blocks={
        _KRON: _kfc,
        _DIAGONAL: _diagonal,
        _KRON_SUA: _kfc_sua,
        _KRON_REDUCE: _kfc_reduce,
        _EKFAC: _ekfac(ekfac_blocks.ConvEKFACFB),
        _EKFAC_REDUCE: _ekfac(ekfac_blocks.ConvEKFACReduceFB),
    })
# register_conv2d_multi.
CONV2D_MULTI = registration_base.LayerKind(
    name="conv2d_multi", label="conv2d multi", default=_KRON_INDEP,
    settable=True, blocks={_KRON_INDEP: _multi_indep})
# register_depthwise_conv2d (and the depthwise layer of
# register_separable_conv2d).
DEPTHWISE_CONV2D = registration_base.LayerKind(
    name="depthwise_conv2d", label="depthwise conv2d", default=_DIAGONAL,
    blocks={
        _DIAGONAL: _depthwise(conv_blocks.DepthwiseConvDiagonalFB),
        _KRON: _depthwise(conv_blocks.DepthwiseConvKFCBasicFB),
    })
# register_grouped_convolution.
GROUPED_CONVOLUTION = registration_base.LayerKind(
    name="grouped_convolution", label="grouped convolution", default=_KRON,
    blocks={_KRON: _grouped_kfc})

FAMILY = registration_base.LayerFamily(
    name="conv", kinds=(CONV2D, CONV2D_MULTI, DEPTHWISE_CONV2D,
                        GROUPED_CONVOLUTION),
    params="the filter [k1, ..., kd, in, out] (depthwise: [kh, kw, in, "
    "multiplier]; grouped: [k.., in/groups, out]), or (filter, bias)",
    methods=("register_conv1d", "register_conv2d", "register_convolution",
             "register_depthwise_conv2d", "register_separable_conv2d",
             "register_grouped_convolution", "register_conv2d_multi"))

# Which approximations accept the optional statistics arguments.
_ACCEPTS = {
    "sub_sample_inputs": (_KRON, _KRON_SUA, _KRON_REDUCE),
    "sub_sample_patches": (_KRON,),
    "patch_mask": (_KRON, _DIAGONAL, _KRON_REDUCE, _EKFAC, _EKFAC_REDUCE),
}


def _name(var):
  return utils.variable_name(var)


def _split_params(params, what):
  seq = utils.ensure_sequence(params)
  if len(seq) not in (1, 2):
    raise ValueError("%s params must be a filter or (filter, bias), got %d "
                     "variables (%s)." % (what, len(seq), _describe(params)))
  return seq[0], (seq[1] if len(seq) == 2 else None)


def _make_spec(filt, strides, dilations, padding, data_format):
  try:
    return patches_lib.make_conv_spec(filt.shape[:-2], strides, dilations,
                                      padding, data_format)
  except ValueError as e:
    raise ValueError("Convolution with filter %s: %s" % (_name(filt), e))


def _check_shapes(filt, bias, inputs, outputs, spec, out_channels, what,
                  in_channels=None):
  """Ranks, channels, bias and output spatial sizes (ValueError naming the
  filter). in_channels: the inputs' channels (default the filter's)."""
  d = spec.num_spatial
  first = spec.channels_first
  fname = _name(filt)
  for tensor, role in ((inputs, "inputs"), (outputs, "outputs")):
    if tensor.shape.rank != d + 2:
      raise ValueError(
          "%s with filter %s (shape %s) needs %s of rank %d ([batch, "
          "spatial x %d, channels] or channels-first), got shape %s." %
          (what, fname, filt.shape, role, d + 2, d, tensor.shape))
  in_c = inputs.shape[1 if first else -1]
  want_in = filt.shape[-2] if in_channels is None else in_channels
  if in_c is not None and in_c != want_in:
    raise ValueError("%s with filter %s expects %d input channels (filter "
                     "shape %s), but its inputs have shape %s." %
                     (what, fname, want_in, filt.shape, inputs.shape))
  out_c = outputs.shape[1 if first else -1]
  if out_c is not None and out_c != out_channels:
    raise ValueError("%s with filter %s produces %d output channels (filter "
                     "shape %s), but its outputs have shape %s." %
                     (what, fname, out_channels, filt.shape, outputs.shape))
  if bias is not None and (bias.shape.rank != 1 or
                           bias.shape[0] != out_channels):
    raise ValueError("Bias %s must have shape [%d] to match filter %s, got "
                     "%s." % (_name(bias), out_channels, fname, bias.shape))
  if not inputs.shape[:1].is_compatible_with(outputs.shape[:1]):
    raise ValueError("%s with filter %s: inputs %s and outputs %s have "
                     "different batch sizes." % (what, fname, inputs.shape,
                                                 outputs.shape))
  in_spatial = inputs.shape[2:] if first else inputs.shape[1:-1]
  out_spatial = outputs.shape[2:] if first else outputs.shape[1:-1]
  if in_spatial.is_fully_defined():
    want = patches_lib.output_spatial_shape(spec, in_spatial.as_list())
    if not out_spatial.is_compatible_with(want):
      raise ValueError(
          "%s with filter %s: inputs of spatial shape %s with strides %s, "
          "dilations %s and padding %s give outputs of spatial shape %s, but "
          "the outputs have spatial shape %s." %
          (what, fname, in_spatial.as_list(), list(spec.strides),
           list(spec.dilations), spec.padding, list(want),
           out_spatial.as_list()))
    if any(n == 0 for n in want):
      raise ValueError("%s with filter %s has no output locations." %
                       (what, fname))
  elif d != 2:
    raise ValueError("%s with filter %s: %d-d convolutions need static "
                     "spatial input sizes, got %s." %
                     (what, fname, d, inputs.shape))


def _check_options(approx, params, patch_size, **options):
  for option, value in options.items():
    if value is None or value is False:
      continue
    if approx not in _ACCEPTS[option]:
      raise ValueError("%s is not supported by approximation %r (layer %s); "
                       "it is used by %s." %
                       (option, approx, _describe(params),
                        ", ".join(_ACCEPTS[option])))
    if option == "patch_mask":
      size = (int(np.prod(value.shape.as_list())) if hasattr(value, "shape")
              and hasattr(value.shape, "as_list") else np.size(value))
      if size != patch_size:
        raise ValueError("patch_mask of layer %s has %d entries; its patches "
                         "have %d (shape [k1, ..., kd, in_channels])." %
                         (_describe(params), size, patch_size))
    elif value is not True and (not utils.is_python_number(value) or
                                int(value) != value or value < 1):
      raise ValueError("%s of layer %s must be None, True or a positive "
                       "int, got %r." % (option, _describe(params), value))


# ---------------------------------------------------------- helpers
def register_with_signature(lc, params, block, reuse, signature,
                            mismatch_message):
  """Registers `block` (or finds the block registered for `params`) and
  checks that it was registered with the same `signature`; raises
  ValueError(mismatch_message(old_signature)) otherwise."""
  block._registration_signature = signature  # pylint: disable=protected-access
  registered = lc.register_block(params, block, reuse=reuse)
  old = getattr(registered, "_registration_signature", signature)
  if old != signature:
    raise ValueError(mismatch_message(old))
  return registered


def finish_registration(lc, params, block, reuse, inputs, outputs,
                        signature):
  registered = register_with_signature(
      lc, params, block, reuse, signature,
      lambda old: ("Layer %s was registered with %s and is now reused with "
                   "%s; towers of a layer must use the same convolution "
                   "and approximation." % (_describe(params), old,
                                           signature)))
  registered.register_additional_tower(inputs, outputs)
  registration_base.set_block_params(registered, params)
  lc.record_uses(params, 1)
  return registered


def _register_conv(lc, params, inputs, outputs, padding, strides,
                   dilations, data_format, approx, reuse, num_spatial,
                   what, sub_sample_inputs=None, sub_sample_patches=None,
                   patch_mask=None):
  filt, bias = _split_params(params, what)
  if num_spatial is None:
    if filt.shape.rank is None or filt.shape.rank < 3:
      raise ValueError("%s filter %s must have rank >= 3 [k.., in, out], "
                       "got shape %s." % (what, _name(filt), filt.shape))
    num_spatial = filt.shape.rank - 2
  if filt.shape.rank != num_spatial + 2:
    raise ValueError("%s filter %s must have rank %d [%s, in_channels, "
                     "out_channels], got shape %s." %
                     (what, _name(filt), num_spatial + 2,
                      ", ".join("k%d" % (i + 1) for i in range(num_spatial)),
                      filt.shape))
  spec = _make_spec(filt, strides, dilations, padding, data_format)
  _check_shapes(filt, bias, inputs, outputs, spec, int(filt.shape[-1]), what)
  approx = lc.resolve_approximation(params, approx, CONV2D)
  _check_options(approx, params, spec.num_taps * int(filt.shape[-2]),
                 sub_sample_inputs=sub_sample_inputs,
                 sub_sample_patches=sub_sample_patches,
                 patch_mask=patch_mask)
  block = CONV2D.blocks[approx](
      lc, params, spec, data_format, sub_sample_inputs=sub_sample_inputs,
      sub_sample_patches=sub_sample_patches, patch_mask=patch_mask)
  signature = (approx, spec, sub_sample_inputs, sub_sample_patches,
               patch_mask is not None)
  return finish_registration(lc, params, block, reuse, inputs, outputs,
                             signature)

# ---------------------------------------------------------- layers
def register_conv2d(lc, params, strides, padding, inputs, outputs,
                    data_format=None, dilations=None, approx=None,
                    reuse=_VARIABLE_SCOPE, sub_sample_inputs=None,
                    sub_sample_patches=None, patch_mask=None):
  """Registers a call to tf.nn.conv2d (plus an optional bias add).

  Args:
    params: the filter [kh, kw, in, out], or (filter, bias [out]).
    strides: an int, [sh, sw], or [1, sh, sw, 1] ([1, 1, sh, sw] NCHW).
    padding: "SAME", "VALID" or explicit pairs.
    inputs: [batch, h, w, in] (NHWC) or [batch, in, h, w] (NCHW).
    outputs: the pre-activations, [batch, h', w', out] (or NCHW).
    data_format: None/"NHWC" or "NCHW".
    dilations: like strides (default 1).
    approx: "kron" (KFC; default: the collection's conv2d default),
      "diagonal", "kron_sua", "kron_reduce", "ekfac" or "ekfac_reduce".
    reuse: True adds a tower to an existing registration of `params`.
    sub_sample_inputs: (kron, kron_sua, kron_reduce) None, True or an
      int m: the input statistic uses a random subset of at most m
      examples; True: ceil(f * N) of the N examples, f the collection's
      curvature_options.inputs_to_extract_patches_factor (0.2, kfac
      0.2.x's rule). None: for kron, the collection's
      curvature_options.sub_sample_inputs (False unless changed).
    sub_sample_patches: (kron) None, True (at most 8 * dim(A) rows) or an
      int R: the input statistic uses a random subset of at most R patches.
    patch_mask: (kron, diagonal, kron_reduce) K*in values (shape
      [kh, kw, in]) multiplied into every patch, for masked convolutions.

  Returns:
    The layer's FisherBlock.
  """
  return _register_conv(lc, 
      params, inputs, outputs, padding, strides, dilations, data_format,
      approx, reuse, 2, "Conv2d layer", sub_sample_inputs,
      sub_sample_patches, patch_mask)


def register_conv1d(lc, params, strides, padding, inputs, outputs,
                    dilations=None, approx=None, reuse=_VARIABLE_SCOPE,
                    sub_sample_inputs=None, sub_sample_patches=None,
                    patch_mask=None, data_format=None):
  """Registers a 1-d convolution (tf.nn.conv1d; filter [k, in, out]).

  inputs [batch, width, in] (or NCW with data_format="NCW"); padding
  "SAME", "VALID", "CAUSAL" or pairs. Otherwise like register_conv2d.
  """
  return _register_conv(lc, 
      params, inputs, outputs, padding, strides, dilations, data_format,
      approx, reuse, 1, "Conv1d layer", sub_sample_inputs,
      sub_sample_patches, patch_mask)


def register_convolution(lc, params, inputs, outputs, padding,
                         strides=None, dilation_rate=None, data_format=None,
                         approx=None, reuse=_VARIABLE_SCOPE,
                         sub_sample_inputs=None, sub_sample_patches=None,
                         patch_mask=None):
  """Registers a call to tf.nn.convolution (any number d of spatial
  dimensions, from the filter's rank d + 2). Otherwise like
  register_conv2d."""
  return _register_conv(lc, 
      params, inputs, outputs, padding, strides, dilation_rate, data_format,
      approx, reuse, None, "Convolution layer", sub_sample_inputs,
      sub_sample_patches, patch_mask)


def register_depthwise_conv2d(lc, params, inputs, outputs, strides,
                              padding, rate=None, data_format=None,
                              approx=None, reuse=_VARIABLE_SCOPE,
                              sub_sample_patches=None):
  """Registers a call to tf.nn.depthwise_conv2d.

  Args:
    params: the filter [kh, kw, in, multiplier], or (filter, bias
      [in * multiplier]).
    inputs: [batch, h, w, in] (or NCHW).
    outputs: [batch, h', w', in * multiplier] (output channel c * M + m).
    strides, padding, data_format: as in register_conv2d.
    rate: dilation rates (int, [rh, rw] or 4 entries).
    approx: "diagonal" (default, the exact diagonal) or "kron"
      (per-channel KFC, see conv_blocks.DepthwiseConvKFCBasicFB).
    reuse: True adds a tower.
    sub_sample_patches: (kron) None, True (at most 8 * (K(+1)) random
      patch rows, K the filter's taps, shared by the channels) or an int
      R (at most R rows): the per-channel input statistics on a random
      subset of the N*L patch rows (depthwise_factors.py).
  """
  filt, bias = _split_params(params, "Depthwise conv2d layer")
  if filt.shape.rank != 4:
    raise ValueError("Depthwise conv2d filter %s must have rank 4 [kh, kw, "
                     "in_channels, multiplier], got shape %s." %
                     (_name(filt), filt.shape))
  spec = _make_spec(filt, strides, rate, padding, data_format)
  _check_shapes(filt, bias, inputs, outputs, spec,
                int(filt.shape[-2]) * int(filt.shape[-1]),
                "Depthwise conv2d layer")
  if approx is None:
    approx = (lc.linked_approximation(params) or
              DEPTHWISE_CONV2D.default)
  if approx not in DEPTHWISE_CONV2D.blocks:
    raise ValueError("Unknown approximation %r for depthwise conv2d layer "
                     "(%s); expected one of %s." %
                     (approx, _describe(params),
                      sorted(DEPTHWISE_CONV2D.blocks)))
  _check_options(approx, params, None,
                 sub_sample_patches=sub_sample_patches)
  options = ({} if sub_sample_patches in (None, False) else
             {"sub_sample_patches": sub_sample_patches})
  block = DEPTHWISE_CONV2D.blocks[approx](lc, params, spec, data_format,
                                         **options)
  return finish_registration(lc, params, block, reuse, inputs, outputs,
                             ("depthwise", approx, spec,
                                    sub_sample_patches or None))


def register_grouped_convolution(lc, params, inputs, outputs, padding,
                                 groups, strides=None, dilation_rate=None,
                                 data_format=None, approx=None,
                                 reuse=_VARIABLE_SCOPE):
  """Registers a grouped convolution (tf.nn.convolution with a filter
  whose input channels are 1/groups of the inputs'; any number d of
  spatial dimensions, from the filter's rank d + 2).

  Args:
    params: the filter [k1, ..., kd, C/groups, O], or (filter, bias [O]).
    inputs: [batch, spatial..., C] (or channels-first).
    outputs: the pre-activations [batch, spatial'..., O].
    padding, strides, dilation_rate, data_format: as in
      register_convolution.
    groups: G >= 1, dividing O; the inputs must have G * C/G channels.
    approx: "kron" (default): KFC block-diagonal over the groups
      (grouped.GroupedConvKFCBasicFB); with groups=1 it equals the KFC
      block of register_convolution.
    reuse: True adds a tower.
  """
  what = "Grouped convolution layer"
  filt, bias = _split_params(params, what)
  if filt.shape.rank is None or filt.shape.rank < 3:
    raise ValueError("%s filter %s must have rank >= 3 [k.., in/groups, "
                     "out], got shape %s." % (what, _name(filt),
                                              filt.shape))
  if (not utils.is_python_number(groups) or int(groups) != groups or
      groups < 1):
    raise ValueError("%s %s: groups must be a positive int, got %r." %
                     (what, _name(filt), groups))
  groups = int(groups)
  out_c = int(filt.shape[-1])
  if out_c % groups:
    raise ValueError("%s %s: its %d output channels (filter shape %s) are "
                     "not divisible by groups=%d." %
                     (what, _name(filt), out_c, filt.shape, groups))
  spec = _make_spec(filt, strides, dilation_rate, padding, data_format)
  _check_shapes(filt, bias, inputs, outputs, spec, out_c, what,
                in_channels=groups * int(filt.shape[-2]))
  if approx is None:
    approx = (lc.linked_approximation(params) or
              GROUPED_CONVOLUTION.default)
  if approx not in GROUPED_CONVOLUTION.blocks:
    raise ValueError("Unknown approximation %r for grouped convolution "
                     "layer (%s); expected one of %s." %
                     (approx, _describe(params),
                      sorted(GROUPED_CONVOLUTION.blocks)))
  block = GROUPED_CONVOLUTION.blocks[approx](lc, params, groups, spec,
                                            data_format)
  return finish_registration(lc, params, block, reuse, inputs, outputs,
                             ("grouped", approx, spec, groups))


def register_separable_conv2d(lc, depthwise_params, pointwise_params,
                              inputs, depthwise_outputs, pointwise_outputs,
                              strides, padding, rate=None, data_format=None,
                              approx=None, reuse=_VARIABLE_SCOPE):
  """Registers a call to tf.nn.separable_conv2d: the depthwise layer and
  the 1x1 pointwise conv2d (stride 1, VALID) on its outputs.

  `approx` applies to the pointwise layer (a conv2d approximation;
  default the collection's conv2d default); the depthwise layer uses its
  own default ("diagonal"). A pair (depthwise_approx, pointwise_approx)
  chooses both. Returns (depthwise block, pointwise block).
  """
  if isinstance(approx, (list, tuple)):
    depthwise_approx, pointwise_approx = approx
  else:
    depthwise_approx, pointwise_approx = None, approx
  first = patches_lib.data_format_is_channels_first(data_format, 2)
  dw_block = register_depthwise_conv2d(lc, 
      depthwise_params, inputs, depthwise_outputs, strides, padding,
      rate=rate, data_format=data_format, approx=depthwise_approx,
      reuse=reuse)
  pw_block = register_conv2d(lc, 
      pointwise_params, [1, 1, 1, 1], "VALID", depthwise_outputs,
      pointwise_outputs, data_format="NCHW" if first else "NHWC",
      approx=pointwise_approx, reuse=reuse)
  return dw_block, pw_block


def register_conv2d_multi(lc, params, strides, padding, inputs, outputs,
                          num_uses=None, data_format=None, dilations=None,
                          approx=None, reuse=_VARIABLE_SCOPE):
  """Registers a conv2d applied several times with the same filter.

  Args:
    inputs, outputs: lists over uses of [batch, ...] tensors, or single
      tensors [num_uses * batch, ...] (uses folded into the batch).
    num_uses: needed with folded tensors; checked against list lengths.
    approx: "kron_indep" (default: the collection's conv2d multi default).
    Others as in register_conv2d.
  """
  filt, bias = _split_params(params, "Conv2d multi-use layer")
  what = "Conv2d multi-use layer"
  fname = _name(filt)
  if filt.shape.rank != 4:
    raise ValueError("%s filter %s must have rank 4, got shape %s." %
                     (what, fname, filt.shape))
  listed = isinstance(inputs, (list, tuple))
  if listed != isinstance(outputs, (list, tuple)):
    raise ValueError("%s %s: inputs and outputs must both be lists over "
                     "uses or both single (folded) tensors." %
                     (what, fname))
  if listed:
    if len(inputs) != len(outputs) or not inputs:
      raise ValueError("%s %s: got %d inputs and %d outputs; there must be "
                       "one of each per use." % (what, fname, len(inputs),
                                                 len(outputs)))
    if num_uses is not None and num_uses != len(inputs):
      raise ValueError("%s %s: num_uses=%s but %d uses were passed." %
                       (what, fname, num_uses, len(inputs)))
    num_uses = len(inputs)
    pairs = list(zip(inputs, outputs))
  else:
    if num_uses is None:
      raise ValueError("%s %s: folded [num_uses * batch, ...] inputs need "
                       "num_uses." % (what, fname))
    if not utils.is_python_number(num_uses) or num_uses < 1:
      raise ValueError("%s %s: num_uses must be a positive int, got %r." %
                       (what, fname, num_uses))
    for tensor in (inputs, outputs):
      rows = tensor.shape[0]
      if rows is not None and rows % num_uses:
        raise ValueError("%s %s: the folded batch of %d rows is not "
                         "divisible by num_uses=%d." %
                         (what, fname, rows, num_uses))
    pairs = [(inputs, outputs)]
  spec = _make_spec(filt, strides, dilations, padding, data_format)
  for x, y in pairs:
    _check_shapes(filt, bias, x, y, spec, int(filt.shape[-1]), what)
  approx = lc.resolve_approximation(params, approx, CONV2D_MULTI)
  block = CONV2D_MULTI.blocks[approx](lc, params, spec, data_format,
                                      num_uses)
  signature = ("multi", approx, spec, num_uses)
  registered = register_with_signature(
      lc, params, block, reuse, signature,
      lambda old: ("Layer %s was registered with %d uses (%s) and is now "
                   "reused with %d uses (%s); every tower must have the "
                   "same number of uses." % (_describe(params), old[-1], old,
                                             num_uses, signature)))
  registered.register_additional_tower(
      list(inputs) if listed else inputs,
      list(outputs) if listed else outputs)
  registration_base.set_block_params(registered, params)
  # A folded registration is one op of the graph.
  lc.record_uses(params, len(inputs) if listed else 1)
  return registered
