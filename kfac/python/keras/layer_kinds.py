"""The Keras layer kinds as one table: how each is recognised, its
parameters and how it is registered.

`KINDS` holds one `KerasLayerKind` per kind of Keras layer K-FAC has a
block for, in the order `recognise` tries them. Each names the layer
family of the ops side that registers it (collection/layer_kinds.FAMILIES:
the family's kinds, approximations and blocks), declares how a Keras layer
is recognised as one (`recognise(layer, class_names)`), which of its
variables are the registered parameters, in the order the registration
takes them (`params(layer)`), and the registration from the recorded calls
(`register(lc, plan, calls, **options)`). layer_registration.py plans and
registers layers from this table; a new Keras layer kind is one entry here.

The table lives here, above the ops packages, so that the dependency
direction stays ops -> integrations: the ops families know nothing of
Keras, and this module reads their tables.
"""

import dataclasses
import typing

import tensorflow as tf

from kfac.python.keras import conv_variants
from kfac.python.keras import einsum_equation
from kfac.python.keras import keras_flavor
from kfac.python.keras import normalized_inputs
from kfac.python.keras import position_embedding
from kfac.python.keras import recurrent
from kfac.python.keras.registration_keys import RegistrationError
from kfac.python.ops.collection import layer_kinds as ops_layer_kinds

# Raised by a registration that must fall back to the generic block.
_Fallback = conv_variants.Fallback
_single_call = conv_variants.single_call
_conv_data_format = conv_variants.conv_data_format
_padding = conv_variants.padding_of


@dataclasses.dataclass(frozen=True, eq=False)
class KerasLayerKind:
  """One kind of Keras layer (see the module docstring).

  name: the kind (a Plan's `kind`; the keys of Kfac's default_approx).
  family: the ops family that registers it (a key of
    collection/layer_kinds.FAMILIES).
  recognise: (layer, class names) -> False (not this kind), True (this
    kind) or a string: a layer of this kind that some option puts out of
    reach, registered generically for that reason.
  params: layer -> its registered parameters (None entries are dropped).
  register: (lc, plan, calls, **options) -> the block(s); raises
    conv_variants.Fallback to fall back to the generic block.
  """
  name: str
  family: str
  recognise: typing.Callable
  params: typing.Callable
  register: typing.Callable


def param_arg(params):
  """The `params` argument of a registration: one variable or a tuple."""
  return params[0] if len(params) == 1 else tuple(params)


_CONV_CLASSES = ("Conv1D", "Conv2D", "Conv3D")


# ---------------------------------------------------------------- recognising
def _is_dense(layer, names):
  if "Dense" in names:
    return True
  if "EinsumDense" not in names:
    return False
  equation = getattr(layer, "equation", None)
  kernel = getattr(layer, "kernel", None)
  axes = einsum_equation.dense_axes(equation)
  if axes is None or kernel is None or (
      len(kernel.shape) != axes.input_axes + axes.output_axes):
    return ("EinsumDense equation %r is not a dense map over shared leading "
            "axes" % (equation,))
  bias = getattr(layer, "bias", None)
  if bias is not None and not einsum_equation.bias_is_dense(
      equation, getattr(layer, "bias_axes", None), bias.shape, kernel.shape):
    return ("EinsumDense bias axes %r of equation %r are not its output axes"
            % (layer.bias_axes, equation))
  return True


def _is_separable(layer, names):
  if not conv_variants.is_separable(layer):
    return False
  if "SeparableConv2D" not in names:
    return "%s has no K-FAC block (only SeparableConv2D)" % type(
        layer).__name__
  return True


def _is_conv(layer, names):
  return (any(n in names for n in _CONV_CLASSES) and
          getattr(layer, "groups", 1) == 1)


def _is_grouped_conv(layer, names):
  return (any(n in names for n in _CONV_CLASSES) and
          getattr(layer, "groups", 1) != 1)


def _is_batch_norm(layer, names):
  if "BatchNormalization" not in names:
    return False
  if getattr(layer, "renorm", False) or getattr(
      layer, "virtual_batch_size", None):
    return "BatchNormalization with renorm/virtual batches"
  axis = layer.axis
  if isinstance(axis, (list, tuple)) and len(axis) != 1:
    return "BatchNormalization over several axes %s" % (axis,)
  if not getattr(layer, "scale", True):
    return "BatchNormalization without scale"
  return True


def _is_layer_norm(layer, names):
  if "LayerNormalization" not in names:
    return False
  if not getattr(layer, "scale", True):
    return "LayerNormalization without scale"
  return True


def _is_group_norm(layer, names):
  if "GroupNormalization" not in names:
    return False
  if not getattr(layer, "scale", True):
    return "GroupNormalization without scale"
  if not isinstance(getattr(layer, "axis", -1), int):
    return "GroupNormalization over several axes %s" % (layer.axis,)
  return True


# ---------------------------------------------------------------- parameters
def _kernel_and_bias(layer):
  return [layer.kernel, getattr(layer, "bias", None)]


def _depthwise_params(layer):
  # tf_keras names the filter depthwise_kernel, Keras 3 kernel.
  kernel = getattr(layer, "depthwise_kernel", None)
  if kernel is None:
    kernel = layer.kernel
  return [kernel, getattr(layer, "bias", None)]


def _scale_and_shift_params(layer):
  return [layer.gamma, getattr(layer, "beta", None)]


def _layer_norm_params(layer):
  if getattr(layer, "rms_scaling", False):
    return [layer.gamma]
  return _scale_and_shift_params(layer)


# ---------------------------------------------------------------- registering
def _check_multi_use_positions(plan, calls, shapes):
  """Multi-use blocks take one [batch, ...] lookup / product per use: a
  layer called several times on inputs with positions ([batch, T, in]) has
  no multi-use registration (its outputs cannot be split per position
  without leaving the loss's graph)."""
  ranks = {s.rank for s in shapes}
  if ranks != {2}:
    raise _Fallback(
        "%s called %d times in one step on inputs with positions (outputs "
        "of rank %s); multi-use blocks take [batch, ...] outputs of rank 2 "
        "per call" % (type(plan.layer).__name__, len(calls),
                      "/".join(sorted(str(r) for r in ranks))))


def _register_dense(lc, plan, calls):
  params = param_arg(plan.params)
  axes = einsum_equation.dense_axes(getattr(plan.layer, "equation", None))
  if len(calls) == 1:
    # An EinsumDense kernel [in axes..., out axes...] is the dense weight
    # [prod(in), prod(out)]: its inputs are flattened over the input axes
    # by the registration, its outputs stay the layer's (the loss's).
    return lc.register_fully_connected(
        params, calls[0].inputs, calls[0].preactivations, approx=plan.approx,
        output_axes=axes.output_axes if axes else 1)
  if axes is not None and axes != (1, 1):
    raise _Fallback(
        "EinsumDense %r called %d times in one step; multi-use blocks take "
        "2-d kernels" % (plan.layer.equation, len(calls)))
  _check_multi_use_positions(
      plan, calls, [tf.convert_to_tensor(c.preactivations).shape
                    for c in calls])
  return lc.register_fully_connected_multi(
      params, [c.inputs for c in calls], [c.preactivations for c in calls],
      approx=plan.approx)


def _register_conv(lc, plan, calls, **options):
  layer = plan.layer
  rank = len(layer.kernel.shape) - 2
  params = param_arg(plan.params)
  data_format = _conv_data_format(layer, rank)
  if len(calls) > 1:
    if options:
      raise RegistrationError(
          "registration_options %s for %s: a convolution called several "
          "times in one step (register_conv2d_multi) takes no options." %
          (options, keras_flavor.layer_path(layer)))
    if rank != 2:
      raise _Fallback(
          "%s called %d times in one step; only Conv2D layers have a "
          "multi-use convolution block" % (type(layer).__name__, len(calls)))
    return lc.register_conv2d_multi(
        params, list(layer.strides), _padding(layer),
        [c.inputs for c in calls], [c.preactivations for c in calls],
        data_format=data_format, dilations=list(layer.dilation_rate),
        approx=plan.approx)
  call = calls[0]
  if rank == 1:
    return lc.register_conv1d(
        params, list(layer.strides), _padding(layer), call.inputs,
        call.preactivations, dilations=list(layer.dilation_rate),
        approx=plan.approx, data_format=data_format, **options)
  return lc.register_convolution(
      params, call.inputs, call.preactivations, _padding(layer),
      strides=list(layer.strides), dilation_rate=list(layer.dilation_rate),
      data_format=data_format, approx=plan.approx, **options)


def _register_depthwise(lc, plan, calls, **options):
  layer = plan.layer
  _single_call(plan, calls)
  return lc.register_depthwise_conv2d(
      param_arg(plan.params), calls[0].inputs, calls[0].preactivations,
      list(layer.strides), _padding(layer),
      rate=list(layer.dilation_rate),
      data_format=_conv_data_format(layer, 2),
      approx=plan.approx or conv_variants.DEPTHWISE_DEFAULT, **options)


def _register_embedding(lc, plan, calls):
  def ids(call):
    inputs = tf.convert_to_tensor(call.inputs)
    return inputs if inputs.dtype.is_integer else tf.cast(inputs, tf.int32)
  if len(calls) == 1:
    if position_embedding.example_independent(calls[0].inputs):
      # ids without a batch axis (see position_embedding).
      total, reason = position_embedding.broadcast_sum(
          tf.convert_to_tensor(calls[0].outputs))
      if total is None:
        raise _Fallback(reason)
      return lc.register_embedding(
          plan.params[0], position_embedding.tiled_ids(ids(calls[0]), total),
          total, approx=plan.approx)
    return lc.register_embedding(plan.params[0], ids(calls[0]),
                                 calls[0].outputs, approx=plan.approx)
  _check_multi_use_positions(
      plan, calls, [tf.convert_to_tensor(c.outputs).shape for c in calls])
  return lc.register_fully_connected_multi(
      plan.params[0], [ids(c) for c in calls], [c.outputs for c in calls],
      approx=plan.approx, dense_inputs=False)


def _register_batch_norm(lc, plan, calls):
  layer = plan.layer
  call = _single_call(plan, calls)
  if call.mask is not None:
    raise _Fallback("BatchNormalization called with a mask")
  x = tf.convert_to_tensor(call.inputs)
  axis = layer.axis
  axis = axis[0] if isinstance(axis, (list, tuple)) else axis
  axis = axis % x.shape.rank
  if axis != x.shape.rank - 1:
    # The scale-and-shift block broadcasts its [C] parameters over the last
    # axis. Transposing the outputs would not do: the statistics need the
    # loss's gradient w.r.t. them, and a transpose is not on the path from
    # the parameters to the loss (its gradient would be zero).
    raise _Fallback("BatchNormalization over axis %d, not the last axis "
                    "of its inputs %s" % (axis, x.shape))
  compute = x.dtype if x.dtype.size >= 4 else tf.float32
  if call.from_node and not isinstance(call.training, bool):
    # A tf_keras graph node: the layer ran in the learning phase's mode
    # (a tensor), so undo its scale and shift, which is exact in both.
    return lc.register_scale_and_shift(
        param_arg(plan.params), _undo_scale_and_shift(plan, call.outputs),
        call.outputs, approx=plan.approx)
  x = tf.cast(x, compute)
  if call.training and layer.trainable:
    reduce_axes = [i for i in range(x.shape.rank) if i != axis]
    mean, variance = tf.nn.moments(x, reduce_axes, keepdims=True)
  else:
    shape = [1] * x.shape.rank
    shape[axis] = -1
    mean = tf.reshape(tf.cast(layer.moving_mean, compute), shape)
    variance = tf.reshape(tf.cast(layer.moving_variance, compute), shape)
  normalized = tf.stop_gradient((x - mean) * tf.math.rsqrt(
      variance + layer.epsilon))
  outputs = tf.convert_to_tensor(call.outputs)
  normalized = tf.cast(normalized, outputs.dtype)
  return lc.register_scale_and_shift(param_arg(plan.params), normalized,
                                     outputs, approx=plan.approx)


def _register_layer_norm(lc, plan, calls):
  layer = plan.layer
  call = _single_call(plan, calls)
  x = tf.convert_to_tensor(call.inputs)
  rank = x.shape.rank
  axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
  axes = sorted(a % rank for a in axes)
  if axes != list(range(rank - len(axes), rank)):
    raise _Fallback("LayerNormalization over non-trailing axes %s" % (axes,))
  compute = x.dtype if x.dtype.size >= 4 else tf.float32
  x = tf.cast(x, compute)
  if getattr(layer, "rms_scaling", False):
    normalized = x * tf.math.rsqrt(
        tf.reduce_mean(tf.square(x), axes, keepdims=True) + layer.epsilon)
  else:
    mean, variance = tf.nn.moments(x, axes, keepdims=True)
    normalized = (x - mean) * tf.math.rsqrt(variance + layer.epsilon)
  outputs = tf.convert_to_tensor(call.outputs)
  normalized = tf.cast(tf.stop_gradient(normalized), outputs.dtype)
  return lc.register_scale_and_shift(param_arg(plan.params), normalized,
                                     outputs, approx=plan.approx)


def _register_group_norm(lc, plan, calls):
  layer = plan.layer
  call = _single_call(plan, calls)
  if call.mask is not None:
    raise _Fallback("GroupNormalization called with a mask")
  x = tf.convert_to_tensor(call.inputs)
  rank = x.shape.rank
  if rank is None or layer.axis % rank != rank - 1:
    # As for BatchNormalization: the block's [C] parameters broadcast over
    # the last axis, and a transpose of the outputs would be off the loss's
    # path.
    raise _Fallback("GroupNormalization over axis %d, not the last axis of "
                    "its inputs %s" % (layer.axis, x.shape))
  # Keras computes in float32 at least (float16 overflows).
  compute = x.dtype if x.dtype.size >= 4 else tf.float32
  normalized = normalized_inputs.group_normalized(
      tf.cast(x, compute), layer.groups, layer.epsilon)
  outputs = tf.convert_to_tensor(call.outputs)
  normalized = tf.cast(tf.stop_gradient(normalized), outputs.dtype)
  return lc.register_scale_and_shift(param_arg(plan.params), normalized,
                                     outputs, approx=plan.approx)


def _undo_scale_and_shift(plan, outputs):
  """The normalised inputs of a scale-and-shift layer recovered from its
  outputs: (outputs - beta) / gamma (kfac 0.2.x's registration)."""
  outputs = tf.convert_to_tensor(outputs)
  gamma = tf.cast(plan.params[0], outputs.dtype)
  shifted = outputs
  if len(plan.params) > 1:
    shifted = outputs - tf.cast(plan.params[1], outputs.dtype)
  return tf.stop_gradient(shifted / gamma)


KINDS = {kind.name: kind for kind in (
    KerasLayerKind(
        "conv_transpose", "conv_transpose",
        lambda layer, names: conv_variants.is_transpose(layer),
        _kernel_and_bias, conv_variants.register_transpose),
    KerasLayerKind("dense", "dense", _is_dense, _kernel_and_bias,
                   _register_dense),
    KerasLayerKind(
        "recurrent", "dense",
        lambda layer, names: recurrent.cell_kind(layer) is not None,
        recurrent.cell_params, recurrent.register),
    KerasLayerKind("separable_conv", "conv", _is_separable,
                   conv_variants.separable_params,
                   conv_variants.register_separable),
    KerasLayerKind(
        "depthwise_conv", "conv",
        lambda layer, names: "DepthwiseConv2D" in names,
        _depthwise_params, _register_depthwise),
    KerasLayerKind("conv", "conv", _is_conv, _kernel_and_bias,
                   _register_conv),
    KerasLayerKind("grouped_conv", "conv", _is_grouped_conv,
                   _kernel_and_bias, conv_variants.register_grouped),
    KerasLayerKind(
        "embedding", "embedding", lambda layer, names: "Embedding" in names,
        lambda layer: [layer.embeddings], _register_embedding),
    KerasLayerKind("batch_norm", "scale_shift", _is_batch_norm,
                   _scale_and_shift_params, _register_batch_norm),
    KerasLayerKind("layer_norm", "scale_shift", _is_layer_norm,
                   _layer_norm_params, _register_layer_norm),
    KerasLayerKind("group_norm", "scale_shift", _is_group_norm,
                   _scale_and_shift_params, _register_group_norm),
)}

assert all(kind.family in ops_layer_kinds.FAMILIES for kind in KINDS.values())


def recognise(layer):
  """(kind, reason): the kind of a layer (a key of KINDS), or "generic"
  with the reason it cannot have a specific one."""
  names = keras_flavor.class_names(layer)
  name = type(layer).__name__
  if getattr(layer, "lora_enabled", False) or getattr(
      layer, "quantization_mode", None):
    return "generic", "LoRA / quantized %s" % name
  for kind in KINDS.values():
    found = kind.recognise(layer, names)
    if found is True:
      return kind.name, None
    if found:
      return "generic", found
  return "generic", "no K-FAC block for layer class %s" % name


def layer_params(layer, kind):
  """The parameters of a `kind` layer in the order the registration takes
  them; a generic layer's own trainable variables."""
  if kind in KINDS:
    params = KINDS[kind].params(layer)
  else:
    params = keras_flavor.own_trainable_variables(layer)
  return [p for p in params if p is not None]
