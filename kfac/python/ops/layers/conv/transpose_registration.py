"""Registration of transposed convolutions (tf.nn.conv_transpose,
tf.nn.conv2d_transpose / conv1d_transpose / conv3d_transpose; Keras
Conv1DTranspose / Conv2DTranspose / Conv3DTranspose) on the LayerCollection.

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
from kfac.python.ops.layers.conv import transpose
from kfac.python.ops.tensors import utils

_VARIABLE_SCOPE = registration_base.VARIABLE_SCOPE
_describe = registration_base.describe
_KRON = "kron"
_DIAGONAL = "diagonal"
_EKFAC = "ekfac"
_APPROXIMATIONS = (_KRON, _DIAGONAL, _EKFAC)


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


class ConvTransposeRegistrationMixin:
  """LayerCollection methods; see the module docstring."""

  def register_conv_transpose(self, params, inputs, outputs, strides,
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
    self._check_params(params)
    if approx is None:
      approx = self._linked_approx(params) or _KRON
    if approx not in _APPROXIMATIONS:
      raise ValueError("Unknown approximation %r for transposed convolution "
                       "layer (%s); expected one of %s." %
                       (approx, _describe(params), list(_APPROXIMATIONS)))
    if approx == _DIAGONAL:
      cls = transpose.ConvTransposeDiagonalFB
    elif approx == _EKFAC:
      cls = (ekfac_blocks.ConvTransposeEKFACBiasFB if bias is not None else
             ekfac_blocks.ConvTransposeEKFACFB)
    elif bias is not None:
      cls = transpose.ConvTransposeKFCBasicBiasFB
    else:
      cls = transpose.ConvTransposeKFCBasicFB
    block = cls(self, params, spec.padding, spec.strides, spec.dilations,
                data_format)
    return self._finish_registration(params, block, reuse, inputs, outputs,
                                     ("transpose", approx, spec))

  def register_conv2d_transpose(self, params, inputs, outputs, strides,
                                padding, data_format=None, dilations=None,
                                approx=None, reuse=_VARIABLE_SCOPE):
    """Registers tf.nn.conv2d_transpose (filter [kh, kw, out, in]); see
    register_conv_transpose."""
    return self.register_conv_transpose(
        params, inputs, outputs, strides, padding, data_format, dilations,
        approx, reuse, num_spatial=2)

  def register_conv1d_transpose(self, params, inputs, outputs, strides,
                                padding, data_format=None, dilations=None,
                                approx=None, reuse=_VARIABLE_SCOPE):
    """Registers tf.nn.conv1d_transpose (filter [k, out, in]); see
    register_conv_transpose."""
    return self.register_conv_transpose(
        params, inputs, outputs, strides, padding, data_format, dilations,
        approx, reuse, num_spatial=1)
