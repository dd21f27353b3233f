"""Keras SeparableConv2D, grouped Conv1D/2D/3D and Conv1D/2D/3DTranspose on
a LayerCollection.

SeparableConv2D (depthwise_kernel [kh, kw, C, M], pointwise_kernel
[1, 1, C*M, O], bias [O]) is computed by tf.nn.separable_conv2d: a depthwise
convolution, then a 1x1 Conv2D on its outputs. `register_separable` finds
that intermediate tensor in the traced graph as the input of the pointwise
Conv2D op between the layer's inputs and its pre-activations (never
recomputed: a recomputed tensor is off the loss's path and its gradient
would be zero) and calls register_separable_conv2d with the layer's
strides, padding and dilations (the bias belongs to the pointwise output).

Depthwise kernels (DepthwiseConv2D, SeparableConv2D's depthwise part) get
DEPTHWISE_DEFAULT, "kron" (per-channel KFC, DepthwiseConvKFCBasicFB), when
fisher_approx names none: the Keras default, chosen by measurement
(docs/keras.md); the core's register_depthwise_conv2d keeps kfac 0.2.x's
"diagonal". For SeparableConv2D `fisher_approx` is the pointwise layer's, or
a pair (depthwise, pointwise).

A convolution with groups > 1 (kernel [k.., C/groups, O]) is registered
with register_grouped_convolution ("kron": KFC block-diagonal over the
groups).

A transposed convolution (kernel [k.., filters, in_channels]; strides,
padding, output_padding, dilation_rate, either data format) is registered
with register_conv_transpose ("kron": KFC with the output-gradient patches
as G and the bias in an exact block of its own; "diagonal": the exact
diagonal; "ekfac"; layers/conv/transpose.py)
on its inputs and pre-activations; output_padding needs no argument: it
only sets the outputs' size, which the registration checks.

Cases out of reach raise `Fallback` (the layer gets the generic diagonal
block and a warning): a layer called several times, channels_first
separable convolutions (Keras transposes them around a channels-last
computation on CPU), a graph without exactly one such pointwise Conv2D, a
grouped convolution asked for an approximation other than "kron", a
transposed one asked for one other than "kron", "diagonal" and "ekfac", a
transposed convolution with groups > 1.
"""

import tensorflow as tf

from kfac.python.keras import keras_flavor
from kfac.python.ops.layers.conv import transpose_registration


class Fallback(Exception):
  """Raised by a registration that must fall back to the generic block."""


def conv_data_format(layer, rank):
  if getattr(layer, "data_format", "channels_last") == "channels_first":
    return {1: "NCW", 2: "NCHW", 3: "NCDHW"}[rank]
  return None


def padding_of(layer):
  return layer.padding.upper()


def single_call(plan, calls):
  if len(calls) != 1:
    raise Fallback("%s called %d times in one step" %
                   (type(plan.layer).__name__, len(calls)))
  return calls[0]


DEPTHWISE_DEFAULT = "kron"


def _param_arg(params):
  return params[0] if len(params) == 1 else tuple(params)


# Ops between a SeparableConv2D's pre-activations and its pointwise Conv2D
# that the search walks through (bias add, casts, identities).
_MAX_SEARCH_OPS = 64


def _pointwise_conv_op(layer, inputs, preactivations):
  """The Conv2D op of tf.nn.separable_conv2d computing `preactivations`:
  searched upstream from them, not crossing `inputs`."""
  stop = tf.convert_to_tensor(inputs)
  start = tf.convert_to_tensor(preactivations)
  found, seen, frontier = [], set(), [start.op]
  while frontier and len(seen) < _MAX_SEARCH_OPS:
    op = frontier.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    if op.type == "Conv2D":
      found.append(op)
      continue
    for t in op.inputs:
      if t is not stop and t.op.type not in ("ReadVariableOp", "VarHandleOp",
                                             "Placeholder", "Const"):
        frontier.append(t.op)
  if len(found) != 1:
    raise Fallback("%s: found %d Conv2D ops between its inputs and outputs "
                   "in the traced graph (expected tf.nn.separable_conv2d's "
                   "one pointwise convolution)" % (type(layer).__name__,
                                                   len(found)))
  return found[0]


def register_separable(lc, plan, calls):
  layer = plan.layer
  call = single_call(plan, calls)
  if getattr(layer, "data_format", "channels_last") == "channels_first":
    raise Fallback("SeparableConv2D with data_format channels_first")
  if len(layer.depthwise_kernel.shape) != 4:
    raise Fallback("%s has no separable_conv2d block (only 2-d separable "
                   "convolutions)" % type(layer).__name__)
  op = _pointwise_conv_op(layer, call.inputs, call.preactivations)
  depthwise_outputs = op.inputs[0]
  mid = int(layer.depthwise_kernel.shape[-2]) * int(
      layer.depthwise_kernel.shape[-1])
  if (depthwise_outputs.shape.rank != 4 or
      depthwise_outputs.shape[-1] != mid or
      list(op.get_attr("strides")) != [1, 1, 1, 1]):
    raise Fallback("%s: the Conv2D op %s found in the traced graph is not "
                   "a pointwise convolution of the depthwise outputs" %
                   (type(layer).__name__, op.name))
  depthwise, pointwise = plan.params[0], plan.params[1:]
  approx = plan.approx  # the pointwise layer's (a conv2d approximation)
  if not isinstance(approx, (list, tuple)):
    approx = (DEPTHWISE_DEFAULT, approx)
  return lc.register_separable_conv2d(
      depthwise, _param_arg(pointwise), call.inputs, depthwise_outputs,
      call.preactivations, list(layer.strides), padding_of(layer),
      rate=list(layer.dilation_rate), approx=approx)


def register_grouped(lc, plan, calls):
  layer = plan.layer
  call = single_call(plan, calls)
  if plan.approx not in (None, "kron"):
    raise Fallback("grouped convolution (groups=%d) has no %r approximation "
                   "(only 'kron')" % (layer.groups, plan.approx))
  rank = len(layer.kernel.shape) - 2
  padding = padding_of(layer)
  if padding == "CAUSAL" and rank != 1:
    raise Fallback("causal padding of a %d-d grouped convolution" % rank)
  return lc.register_grouped_convolution(
      _param_arg(plan.params), call.inputs, call.preactivations, padding,
      int(layer.groups), strides=list(layer.strides),
      dilation_rate=list(layer.dilation_rate),
      data_format=conv_data_format(layer, rank), approx=plan.approx)


def separable_params(layer):
  return [layer.depthwise_kernel, layer.pointwise_kernel,
          getattr(layer, "bias", None)]


def is_separable(layer):
  return any(n.startswith("SeparableConv")
             for n in keras_flavor.class_names(layer))


def register_transpose(lc, plan, calls):
  layer = plan.layer
  call = single_call(plan, calls)
  if (plan.approx is not None and
      plan.approx not in transpose_registration.CONV_TRANSPOSE.blocks):
    raise Fallback("transposed convolution has no %r approximation (only "
                   "'kron', 'diagonal' and 'ekfac')" % (plan.approx,))
  if getattr(layer, "groups", 1) != 1:
    raise Fallback("transposed convolution with groups=%d" % layer.groups)
  rank = len(layer.kernel.shape) - 2
  return lc.register_conv_transpose(
      _param_arg(plan.params), call.inputs, call.preactivations,
      list(layer.strides), padding_of(layer),
      data_format=conv_data_format(layer, rank),
      dilations=list(layer.dilation_rate), approx=plan.approx)


def is_transpose(layer):
  return any("Transpose" in n for n in keras_flavor.class_names(layer))
