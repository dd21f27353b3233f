"""Registers Keras layers on a LayerCollection from a recorded forward pass.

`plan_layers` decides, from the layers alone, how each one is registered
(the registration report users can print before training). `register_layers`
then registers them on a `LayerCollection` with the tensors a
`ModelRecorder` captured in the current trace.

Supported layers and what K-FAC sees:
  Dense, EinsumDense (when its equation is a dense map over shared leading
    axes, bias on the output axes: einsum_equation.py; e.g. the four
    projections of MultiHeadAttention, whose sublayers are recorded as
    layers of their own)  register_fully_connected, inputs [batch, ...,
    in axes...] (flattened to [batch, ..., in]) and the pre-activations
    [batch, ..., out axes...] (fused activations are skipped; the kernel's
    output axes are `output_axes`); called several times in one step on
    [batch, in] inputs (2-d kernels): register_fully_connected_multi
    (kron_indep)
  Conv1D/2D/3D (groups=1)   register_conv1d / register_convolution; a Conv2D
                            called several times: register_conv2d_multi
  Conv1D/2D/3D (groups>1)   register_grouped_convolution (KFC block-diagonal
                            over the groups)
  DepthwiseConv2D           register_depthwise_conv2d ("kron" unless
                            fisher_approx says "diagonal")
  SeparableConv2D (channels_last)  register_separable_conv2d: the depthwise
                            outputs are found in the traced graph as the
                            input of the pointwise Conv2D (conv_variants)
  Conv1D/2D/3DTranspose     register_conv_transpose (KFC, the patches on
                            the output-gradient side; conv_variants)
  Embedding                 register_embedding; called several times with
                            one id per example and call:
                            register_fully_connected_multi(dense_inputs=False);
                            a position embedding (ids without a batch axis,
                            added to [batch, ...] tensors): on the ids
                            tiled over the batch and the sum (see
                            position_embedding)
  LSTM, GRU (their cells)   register_fully_connected over time of the
                            input and recurrent kernels (recurrent.py)
  BatchNormalization (channel axis last), LayerNormalization (trailing
    normalised axes), GroupNormalization (channel axis last)
                            register_scale_and_shift on the normalised inputs
                            (recomputed from the layer's input as the layer
                            does) and the layer's outputs
Anything else with trainable weights (and any case above the layer's options
put out of reach: SeparableConv1D, masks, renorm,
BatchNormalization / GroupNormalization over another axis, norms without
scale, layers called several times on inputs
with positions, other layers called several times) falls back to
`register_generic` with the GENERIC_FALLBACK approximation, and a warning
names the layer and the reason. Every registered tensor is one the loss
depends on: K-FAC's output statistics are gradients w.r.t. them, and the
gradient w.r.t. a tensor off that path (a transpose or a slice made here)
would silently be zero.
"""

import collections
import warnings

import tensorflow as tf

from kfac.python.keras import conv_variants
from kfac.python.keras import einsum_equation
from kfac.python.keras import keras_flavor
from kfac.python.keras import normalized_inputs
from kfac.python.keras import position_embedding
from kfac.python.keras import recurrent
from kfac.python.keras.registration_keys import CLASS_KEY_PREFIX  # noqa: F401 pylint: disable=unused-import
from kfac.python.keras.registration_keys import CONV_OPTIONS  # noqa: F401 pylint: disable=unused-import
from kfac.python.keras.registration_keys import DEPTHWISE_OPTIONS
from kfac.python.keras.registration_keys import OLD_CLASS_KEY_PREFIX  # noqa: F401 pylint: disable=unused-import
from kfac.python.keras.registration_keys import RegistrationError
from kfac.python.keras.registration_keys import check_depthwise_options
from kfac.python.keras.registration_keys import check_fisher_approx  # noqa: F401 pylint: disable=unused-import
from kfac.python.keras.registration_keys import check_registration_options  # noqa: F401 pylint: disable=unused-import
from kfac.python.keras.registration_keys import class_key_name  # noqa: F401 pylint: disable=unused-import
from kfac.python.keras.registration_keys import resolve_fisher_approx
from kfac.python.keras.registration_report import Row  # pylint: disable=unused-import
from kfac.python.keras.registration_report import format_report  # pylint: disable=unused-import

GENERIC_FALLBACK = "diagonal"
# params: the tf.Variables; names: their Keras paths (for the report).
Plan = collections.namedtuple(
    "Plan", ["layer", "kind", "approx", "params", "reason", "names"])
Plan.__new__.__defaults__ = (None,)


def variable_name(var):
  """A variable's own path for reports: a Keras 3 variable's `path`
  ("outer/dense_1/kernel"; the tf.Variable behind it is named after the
  outermost model only: "outer/kernel:0"), else its name."""
  return getattr(var, "path", None) or keras_flavor.unwrap_variable(var).name


def param_names(plan):
  """The names of a plan's parameters for the report."""
  if plan.names is not None:
    return list(plan.names)
  return [p.name for p in plan.params]

_CONV_CLASSES = ("Conv1D", "Conv2D", "Conv3D")


# ---------------------------------------------------------------- planning
def _kind_of(layer):
  """(kind, reason): the registration kind of a layer, or "generic" with the
  reason it cannot have a specific one."""
  names = keras_flavor.class_names(layer)
  name = type(layer).__name__
  if getattr(layer, "lora_enabled", False) or getattr(
      layer, "quantization_mode", None):
    return "generic", "LoRA / quantized %s" % name
  if conv_variants.is_transpose(layer):
    return "conv_transpose", None
  if "Dense" in names:
    return "dense", None
  if recurrent.cell_kind(layer):
    return "recurrent", None
  if "EinsumDense" in names:
    equation = getattr(layer, "equation", None)
    kernel = getattr(layer, "kernel", None)
    axes = einsum_equation.dense_axes(equation)
    if axes is None or kernel is None or (
        len(kernel.shape) != axes.input_axes + axes.output_axes):
      return "generic", ("EinsumDense equation %r is not a dense map over "
                         "shared leading axes" % (equation,))
    bias = getattr(layer, "bias", None)
    if bias is not None and not einsum_equation.bias_is_dense(
        equation, getattr(layer, "bias_axes", None), bias.shape,
        kernel.shape):
      return "generic", ("EinsumDense bias axes %r of equation %r are not "
                         "its output axes" % (layer.bias_axes, equation))
    return "dense", None
  if conv_variants.is_separable(layer):
    if "SeparableConv2D" not in names:
      return "generic", "%s has no K-FAC block (only SeparableConv2D)" % name
    return "separable_conv", None
  if "DepthwiseConv2D" in names:
    return "depthwise_conv", None
  if any(n in names for n in _CONV_CLASSES):
    if getattr(layer, "groups", 1) != 1:
      return "grouped_conv", None
    return "conv", None
  if "Embedding" in names:
    return "embedding", None
  if "BatchNormalization" in names:
    if getattr(layer, "renorm", False) or getattr(
        layer, "virtual_batch_size", None):
      return "generic", "BatchNormalization with renorm/virtual batches"
    axis = layer.axis
    if isinstance(axis, (list, tuple)) and len(axis) != 1:
      return "generic", "BatchNormalization over several axes %s" % (axis,)
    if not getattr(layer, "scale", True):
      return "generic", "BatchNormalization without scale"
    return "batch_norm", None
  if "LayerNormalization" in names:
    if not getattr(layer, "scale", True):
      return "generic", "LayerNormalization without scale"
    return "layer_norm", None
  if "GroupNormalization" in names:
    if not getattr(layer, "scale", True):
      return "generic", "GroupNormalization without scale"
    if not isinstance(getattr(layer, "axis", -1), int):
      return "generic", "GroupNormalization over several axes %s" % (
          layer.axis,)
    return "group_norm", None
  return "generic", "no K-FAC block for layer class %s" % name


def _layer_params(layer, kind):
  """The layer's parameters in the order the registration takes them."""
  if kind in ("dense", "conv", "grouped_conv", "conv_transpose"):
    params = [layer.kernel, getattr(layer, "bias", None)]
  elif kind == "depthwise_conv":
    # tf_keras names the filter depthwise_kernel, Keras 3 kernel.
    kernel = getattr(layer, "depthwise_kernel", None)
    if kernel is None:
      kernel = layer.kernel
    params = [kernel, getattr(layer, "bias", None)]
  elif kind == "separable_conv":
    params = conv_variants.separable_params(layer)
  elif kind == "recurrent":
    params = recurrent.cell_params(layer)
  elif kind == "embedding":
    params = [layer.embeddings]
  elif kind in ("batch_norm", "layer_norm", "group_norm"):
    params = [layer.gamma, getattr(layer, "beta", None)]
    if kind == "layer_norm" and getattr(layer, "rms_scaling", False):
      params = [layer.gamma]
  else:
    params = keras_flavor.own_trainable_variables(layer)
  return [p for p in params if p is not None]


def plan_layer(layer, fisher_approx=None, trainable=None):
  """The Plan of one layer, or None if it has no trainable parameters
  (in `trainable`, a set of variable refs, when given)."""
  own = keras_flavor.own_trainable_variables(layer)
  if trainable is not None:
    own = [v for v in own
           if keras_flavor.unwrap_variable(v).ref() in trainable]
  if not own:
    return None
  kind, reason = _kind_of(layer)
  params = _layer_params(layer, kind) if kind != "generic" else own
  own_refs = {keras_flavor.unwrap_variable(v).ref() for v in own}
  param_refs = {keras_flavor.unwrap_variable(v).ref() for v in params}
  if kind != "generic" and own_refs != param_refs:
    kind, reason = "generic", "only some of its parameters are trainable"
    params = own
  approx = resolve_fisher_approx(fisher_approx, layer)
  if kind == "generic" and approx is None:
    approx = GENERIC_FALLBACK
  return Plan(layer, kind, approx, [keras_flavor.unwrap_variable(p)
                                    for p in params], reason,
              [variable_name(p) for p in params])


def plan_layers(model, fisher_approx=None, trainable=None):
  plans = []
  for layer in keras_flavor.leaf_layers(model):
    plan = plan_layer(layer, fisher_approx, trainable)
    if plan is not None:
      plans.append(plan)
  return plans


def _param_arg(params):
  return params[0] if len(params) == 1 else tuple(params)


# ---------------------------------------------------------------- registering
_conv_data_format = conv_variants.conv_data_format
_padding = conv_variants.padding_of


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
  params = _param_arg(plan.params)
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
  params = _param_arg(plan.params)
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
      _param_arg(plan.params), calls[0].inputs, calls[0].preactivations,
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
        _param_arg(plan.params), _undo_scale_and_shift(plan, call.outputs),
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
  return lc.register_scale_and_shift(_param_arg(plan.params), normalized,
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
  return lc.register_scale_and_shift(_param_arg(plan.params), normalized,
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
  return lc.register_scale_and_shift(_param_arg(plan.params), normalized,
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


# Raised by a registration that must fall back to the generic block.
_Fallback = conv_variants.Fallback
_single_call = conv_variants.single_call


_REGISTER = {
    "dense": _register_dense,
    "conv": _register_conv,
    "depthwise_conv": _register_depthwise,
    "separable_conv": conv_variants.register_separable,
    "grouped_conv": conv_variants.register_grouped,
    "conv_transpose": conv_variants.register_transpose,
    "embedding": _register_embedding,
    "batch_norm": _register_batch_norm,
    "layer_norm": _register_layer_norm,
    "group_norm": _register_group_norm,
    "recurrent": recurrent.register,
}

def register_layers(lc, plans, recorder, batch_size, warn=None,
                    registration_options=None, default_conv_options=None,
                    default_approx=None):
  """Registers every plan on `lc` from the calls `recorder` holds for the
  current graph. Returns the report rows. `warn(key, message)` reports a
  generic fallback (default: warnings.warn). `registration_options` maps
  layer names / classes to extra arguments of a convolution's registration
  (CONV_OPTIONS). The default recipe's (Kfac(adaptive=True)): options of
  single-call kron convolutions without registration_options
  (`default_conv_options`), {kind: approximation} of layers without
  fisher_approx (`default_approx`)."""
  warn = warn or (lambda key, message: warnings.warn(message, stacklevel=3))
  rows = []
  for plan in plans:
    layer = plan.layer
    calls = recorder.calls(layer)
    if default_approx and plan.approx is None and plan.kind in default_approx:
      plan = plan._replace(approx=default_approx[plan.kind])
    kind, approx, reason = plan.kind, plan.approx, plan.reason
    options = dict(resolve_fisher_approx(registration_options, layer) or {})
    if kind == "depthwise_conv":
      check_depthwise_options(layer, options, True)
    elif options and kind != "conv":
      raise RegistrationError(
          "registration_options %s for layer %s (%s): only Conv1D/2D/3D "
          "and DepthwiseConv2D layers take options (%s)." %
          (options, keras_flavor.layer_path(layer), type(layer).__name__,
           ", ".join(CONV_OPTIONS)))
    if kind != "generic" and not calls:
      kind, reason = "generic", (recurrent.no_call_reason(layer) if kind ==
                                 "recurrent" else "its parameters are used "
                                 "outside its call")
    if (default_conv_options and not options and len(calls) == 1 and
        (kind == "conv" and approx in (None, "kron") or
         kind == "depthwise_conv" and
         (approx or conv_variants.DEPTHWISE_DEFAULT) == "kron")):
      options = {k: v for k, v in default_conv_options.items()
                 if kind == "conv" or k in DEPTHWISE_OPTIONS}
    if kind != "generic":
      try:
        block = _REGISTER[kind](lc, plan, calls, **options)
      except _Fallback as e:
        kind, reason = "generic", str(e)
    if kind == "generic":
      approx = (plan.approx if plan.kind == "generic" and plan.approx
                else GENERIC_FALLBACK)
      block = lc.register_generic(_param_arg(plan.params), batch_size,
                                  approx=approx)
      warn(keras_flavor.layer_path(layer),
           "kfac: layer %r (%s) is registered with the generic %r "
           "approximation: %s." % (keras_flavor.layer_path(layer),
                                   type(layer).__name__, approx, reason))
    rows.append(Row(keras_flavor.layer_path(layer), type(layer).__name__,
                    "+".join(type(b).__name__ for b in
                             (block if isinstance(block, tuple) else
                              (block,))), approx or "default",
                    ", ".join(param_names(plan)), len(calls),
                    "fallback: " + reason if kind == "generic" else
                    ", ".join("%s=%r" % kv for kv in sorted(options.items())),
                    block if isinstance(block, tuple) else (block,)))
  return rows
