"""Registration of transposed convolutions (tf.nn.conv_transpose,
tf.nn.conv2d_transpose / conv1d_transpose / conv3d_transpose; Keras
Conv1DTranspose / Conv2DTranspose / Conv3DTranspose) on a LayerCollection:
the family's declaration (`FAMILY`) and its registration functions, which
LayerCollection's register_conv_transpose / register_conv2d_transpose /
register_conv1d_transpose call with the collection `lc` first.

Approximations (layers/conv/transpose.py): "kron" (default): KFC with the
patches on the output-gradient side, the bias in an exact block of its
own; "diagonal": the exact diagonal; "ekfac": EKFAC of the filter in the
KFC eigenbasis (ekfac/blocks.py), the bias's exact block as with "kron".

The filter is TensorFlow's and Keras' [k1, ..., kd, out_channels,
in_channels]; strides / dilations / padding / data_format are the
transposed convolution's own (those of the convolution it is the gradient
of), in any form register_conv2d accepts, except "CAUSAL".
"""

from kfac.python.ops.ekfac import blocks as ekfac_blocks
from kfac.python.ops.layers.base import registration as registration_base
from kfac.python.ops.layers.conv import patches as patches_lib
from kfac.python.ops.layers.conv import registration as conv_registration
from kfac.python.ops.layers.conv import transpose
from kfac.python.ops.tensors import utils

_VARIABLE_SCOPE = registration_base.VARIABLE_SCOPE
_describe = registration_base.describe
_KRON = "kron"
_DIAGONAL = "diagonal"
_EKFAC = "ekfac"


def _transpose_block(plain, with_bias):
  def make(lc, params, spec, data_format, has_bias):
    cls = with_bias if has_bias else plain
    return cls(lc, params, spec.padding, spec.strides, spec.dilations,
               data_format)
  return make


# The error message lists the approximations in this order.
CONV_TRANSPOSE = registration_base.LayerKind(
    name="conv_transpose", label="transposed convolution", default=_KRON,
    blocks={
        _KRON: _transpose_block(transpose.ConvTransposeKFCBasicFB,
                                transpose.ConvTransposeKFCBasicBiasFB),
        _DIAGONAL: _transpose_block(transpose.ConvTransposeDiagonalFB,
                                    transpose.ConvTransposeDiagonalFB),
        _EKFAC: _transpose_block(ekfac_blocks.ConvTransposeEKFACFB,
                                 ekfac_blocks.ConvTransposeEKFACBiasFB),
    })

FAMILY = registration_base.LayerFamily(
    name="conv_transpose", kinds=(CONV_TRANSPOSE,),
    params="the filter [k1, ..., kd, out_channels, in_channels], or "
    "(filter, bias [out_channels])",
    methods=("register_conv_transpose", "register_conv2d_transpose",
             "register_conv1d_transpose"))


def _check(filt, bias, inputs, outputs, spec, what):
  """Ranks, channels, bias and spatial sizes (ValueError naming the
  filter): the convolution `spec` maps the outputs' spatial shape to the
  inputs'."""
  d = spec.num_spatial
  name = utils.variable_name(filt)
  first = spec.channels_first
  for tensor, role in ((inputs, "inputs"), (outputs, "outputs")):
    if tensor.shape.rank != d + 2:
      raise ValueError(
          "%s with filter %s (shape %s) needs %s of rank %d ([batch, "
          "spatial x %d, channels] or channels-first), got shape %s." %
          (what, name, filt.shape, role, d + 2, d, tensor.shape))
  out_c, in_c = int(filt.shape[-2]), int(filt.shape[-1])
  for tensor, role, want in ((inputs, "inputs", in_c),
                             (outputs, "outputs", out_c)):
    have = tensor.shape[1 if first else -1]
    if have is not None and have != want:
      raise ValueError(
          "%s with filter %s (shape %s: [k.., out_channels, in_channels]) "
          "needs %s with %d channels, got shape %s." %
          (what, name, filt.shape, role, want, tensor.shape))
  if bias is not None and (bias.shape.rank != 1 or bias.shape[0] != out_c):
    raise ValueError("Bias %s must have shape [%d] (the output channels of "
                     "filter %s), got %s." % (utils.variable_name(bias),
                                              out_c, name, bias.shape))
  if not inputs.shape[:1].is_compatible_with(outputs.shape[:1]):
    raise ValueError("%s with filter %s: inputs %s and outputs %s have "
                     "different batch sizes." % (what, name, inputs.shape,
                                                 outputs.shape))
  in_spatial = inputs.shape[2:] if first else inputs.shape[1:-1]
  out_spatial = outputs.shape[2:] if first else outputs.shape[1:-1]
  if out_spatial.is_fully_defined():
    want = patches_lib.output_spatial_shape(spec, out_spatial.as_list())
    if not in_spatial.is_compatible_with(want):
      raise ValueError(
          "%s with filter %s: outputs of spatial shape %s are not what "
          "inputs of spatial shape %s give with strides %s, dilations %s "
          "and padding %s (the convolution with these arguments maps the "
          "outputs' shape to %s)." %
          (what, name, out_spatial.as_list(), in_spatial.as_list(),
           list(spec.strides), list(spec.dilations), spec.padding,
           list(want)))
  elif d != 2:
    raise ValueError("%s with filter %s: %d-d transposed convolutions need "
                     "static spatial output sizes, got %s." %
                     (what, name, d, outputs.shape))


def register_conv_transpose(lc, params, inputs, outputs, strides,
                            padding, data_format=None, dilations=None,
                            approx=None, reuse=_VARIABLE_SCOPE,
                            num_spatial=None):
  """Registers a transposed convolution (plus an optional bias add).

  Args:
    params: the filter [k1, ..., kd, out_channels, in_channels], or
      (filter, bias [out_channels]).
    inputs: [batch, spatial..., in_channels] (or channels-first).
    outputs: the pre-activations [batch, spatial'..., out_channels].
    strides, dilations: an int, d ints or the TensorFlow form with batch
      and channel entries (default 1).
    padding: "SAME", "VALID" or explicit (before, after) pairs, as given
      to tf.nn.conv_transpose.
    data_format: None / channels-last ("NWC", "NHWC", "NDHWC") or
      channels-first ("NCW", "NCHW", "NCDHW").
    approx: "kron" (default), "diagonal" or "ekfac": see
      layers/conv/transpose.py.
    reuse: True adds a tower to an existing registration of `params`.
    num_spatial: d, checked against the filter's rank (default: the
      filter's rank - 2).

  Returns:
    The layer's FisherBlock (transpose.ConvTransposeKFCBasicFB, or
    ConvTransposeKFCBasicBiasFB with a bias; ConvTransposeDiagonalFB;
    ekfac_blocks.ConvTransposeEKFACFB / ConvTransposeEKFACBiasFB).
  """
  what = "Transposed convolution layer"
  seq = utils.ensure_sequence(params)
  if len(seq) not in (1, 2):
    raise ValueError("%s params must be a filter or (filter, bias), got "
                     "%d variables (%s)." % (what, len(seq),
                                             _describe(params)))
  filt, bias = seq[0], (seq[1] if len(seq) == 2 else None)
  rank = filt.shape.rank
  if rank is None or rank < 3 or (num_spatial is not None and
                                  rank != num_spatial + 2):
    raise ValueError(
        "%s filter %s must have rank %s [k.., out_channels, in_channels], "
        "got shape %s." % (what, utils.variable_name(filt),
                           num_spatial + 2 if num_spatial else ">= 3",
                           filt.shape))
  if isinstance(padding, str) and padding.upper() == "CAUSAL":
    raise ValueError("%s %s: CAUSAL padding is for convolutions, not "
                     "transposed ones." % (what, utils.variable_name(filt)))
  try:
    spec = patches_lib.make_conv_spec(filt.shape[:-2], strides, dilations,
                                      padding, data_format)
  except ValueError as e:
    raise ValueError("%s with filter %s: %s" %
                     (what, utils.variable_name(filt), e)) from None
  _check(filt, bias, inputs, outputs, spec, what)
  registration_base.check_params(params)
  if approx is None:
    approx = lc.linked_approximation(params) or CONV_TRANSPOSE.default
  if approx not in CONV_TRANSPOSE.blocks:
    raise ValueError("Unknown approximation %r for transposed convolution "
                     "layer (%s); expected one of %s." %
                     (approx, _describe(params), list(CONV_TRANSPOSE.blocks)))
  block = CONV_TRANSPOSE.blocks[approx](lc, params, spec, data_format,
                                       bias is not None)
  return conv_registration.finish_registration(
      lc, params, block, reuse, inputs, outputs, ("transpose", approx, spec))

def register_conv2d_transpose(lc, params, inputs, outputs, strides,
                              padding, data_format=None, dilations=None,
                              approx=None, reuse=_VARIABLE_SCOPE):
  """Registers tf.nn.conv2d_transpose (filter [kh, kw, out, in]); see
  register_conv_transpose."""
  return register_conv_transpose(
      lc, params, inputs, outputs, strides, padding, data_format, dilations,
      approx, reuse, num_spatial=2)

def register_conv1d_transpose(lc, params, inputs, outputs, strides,
                              padding, data_format=None, dilations=None,
                              approx=None, reuse=_VARIABLE_SCOPE):
  """Registers tf.nn.conv1d_transpose (filter [k, out, in]); see
  register_conv_transpose."""
  return register_conv_transpose(
      lc, params, inputs, outputs, strides, padding, data_format, dilations,
      approx, reuse, num_spatial=1)
