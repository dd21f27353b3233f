"""Registers Keras layers on a LayerCollection from a recorded forward pass.

`plan_layers` decides, from the layers alone, how each one is registered
(the registration report users can print before training). `register_layers`
then registers them on a `LayerCollection` with the tensors a
`ModelRecorder` captured in the current trace. Both read the table of Keras
layer kinds (layer_kinds.KINDS: how each kind is recognised, its
parameters, its registration, its family on the ops side).

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

from kfac.python.keras import conv_variants
from kfac.python.keras import keras_flavor
from kfac.python.keras import layer_kinds
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


# ---------------------------------------------------------------- planning
def plan_layer(layer, fisher_approx=None, trainable=None):
  """The Plan of one layer, or None if it has no trainable parameters
  (in `trainable`, a set of variable refs, when given)."""
  own = keras_flavor.own_trainable_variables(layer)
  if trainable is not None:
    own = [v for v in own
           if keras_flavor.unwrap_variable(v).ref() in trainable]
  if not own:
    return None
  kind, reason = layer_kinds.recognise(layer)
  params = layer_kinds.layer_params(layer, kind) if kind != "generic" else own
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


_param_arg = layer_kinds.param_arg
# Raised by a registration that must fall back to the generic block.
_Fallback = conv_variants.Fallback


# ---------------------------------------------------------------- registering
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
        block = layer_kinds.KINDS[kind].register(lc, plan, calls, **options)
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
