"""Registration of dense layers used several times (time steps, tied
weights) on a LayerCollection: the family's declaration (`FAMILY`) and its
registration function, which LayerCollection.register_fully_connected_multi
calls with the collection `lc` first (its registry interface:
`lc.resolve_approximation`, `lc.linked_approximation`,
`lc.default_approximation`, `lc.register_block`, `lc.record_uses`). With
dense_inputs=False it registers an embedding looked up once per use (the
embedding family's EMBEDDING_MULTI kind).
"""

import tensorflow as tf

from kfac.python.ops.layers.base import registration as registration_base
from kfac.python.ops.layers.dense import registration as dense_registration
from kfac.python.ops.layers.embedding import registration as embedding_registration
from kfac.python.ops.layers.multi_use import blocks as multi_use_blocks
from kfac.python.ops.tensors import utils


def _indep(diag_in, diag_out):
  def make(lc, has_bias, num_uses):
    return multi_use_blocks.FullyConnectedMultiIndepFB(
        lc, has_bias=has_bias, num_uses=num_uses,
        diagonal_approx_for_input=diag_in,
        diagonal_approx_for_output=diag_out)
  return make


def _ekfac(lc, has_bias, num_uses):
  from kfac.python.ops.ekfac import blocks as ekfac_blocks  # pylint: disable=g-import-not-at-top
  return ekfac_blocks.FullyConnectedMultiEKFACFB(lc, has_bias=has_bias,
                                                 num_uses=num_uses)


def _series(option):
  def make(lc, has_bias, num_uses):
    return multi_use_blocks.FullyConnectedSeriesFB(
        lc, has_bias=has_bias, num_uses=num_uses, option=option)
  return make


# Approximation names (the APPROX_*_NAME constants of
# layers/base/approximations.py).
_FULLY_CONNECTED_MULTI_APPROX_TO_BLOCK = {
    "kron_indep": _indep(False, False),
    "kron_indep_in_diag": _indep(True, False),
    "kron_indep_out_diag": _indep(False, True),
    "kron_indep_both_diag": _indep(True, True),
    "kron_series_1": _series(1),
    "kron_series_2": _series(2),
    "ekfac": _ekfac,
}


def _is_uses_list(x):
  return isinstance(x, (list, tuple))


FULLY_CONNECTED_MULTI = registration_base.LayerKind(
    name="fully_connected_multi", label="fully connected multi",
    default="kron_indep", blocks=_FULLY_CONNECTED_MULTI_APPROX_TO_BLOCK,
    settable=True)

FAMILY = registration_base.LayerFamily(
    name="multi_use", kinds=(FULLY_CONNECTED_MULTI,),
    params="W [in, out] or (W, b); the table W [vocab, dim] of an embedding",
    methods=("register_fully_connected_multi",))


def register_fully_connected_multi(lc, params, inputs, outputs,
                                   num_uses=None, approx=None,
                                   dense_inputs=True,
                                   reuse=registration_base.VARIABLE_SCOPE):
  """Registers a dense layer used several times (RNN steps, tied weights).

  Args:
    params: W [in, out] or (W, b).
    inputs: a list over uses of [batch, in] tensors, or one folded
      [num_uses * batch, in] tensor (time-major: rows
      [t * batch, (t + 1) * batch) are use t).
    outputs: the pre-activations, in the same form ([batch, out] per use
      or folded [num_uses * batch, out]).
    num_uses: the number of uses; required for folded tensors, optional
      (but checked) for lists.
    approx: kron_indep (default: the collection's fully-connected-multi
      default), kron_indep_in_diag, kron_indep_out_diag,
      kron_indep_both_diag, kron_series_1 or kron_series_2. The series
      approximations treat the uses as ordered in time.
    dense_inputs: False registers an embedding table looked up once per
      use: inputs are integer ids ([batch] or a bag [batch, k] per use),
      params the table W [vocab, dim]; only kron_indep (see
      `EmbeddingMultiIndepFB`).
    reuse: True adds a tower (with the same number of uses) to an existing
      registration of `params`.

  Returns:
    The layer's block.
  """
  names = registration_base.describe(params)
  if not dense_inputs:
    return _register_embedding_multi(lc, params, inputs, outputs, num_uses,
                                    approx, reuse)
  approx = lc.resolve_approximation(params, approx, FULLY_CONNECTED_MULTI)
  inputs, outputs, num_uses = _normalize_uses(names, inputs, outputs,
                                              num_uses)
  for x, y in zip(utils.ensure_sequence(inputs),
                  utils.ensure_sequence(outputs)):
    if x.shape.rank != 2:
      raise ValueError(
          "Inputs of the multi-use layer %s must be [batch, in] per use or "
          "folded [num_uses * batch, in], got shape %s." % (names, x.shape))
    dense_registration.check_dense_shapes(params, x, y)
  _check_outputs_depend_on_params(params, outputs)
  has_bias = isinstance(params, (list, tuple))
  block = FULLY_CONNECTED_MULTI.blocks[approx](lc, has_bias, num_uses)
  block = lc.register_block(params, block, reuse=reuse)
  if block.num_uses != num_uses:
    raise ValueError(
        "Layer %s was registered with %d uses and is now registered (as a "
        "new tower) with %d." % (names, block.num_uses, num_uses))
  if block.approximation != approx:
    raise ValueError(
        "Layer %s was registered with approximation %s and is now "
        "registered (as a new tower) with %s." %
        (names, block.approximation, approx))
  block.register_additional_tower(inputs, outputs)
  registration_base.set_block_params(block, params)
  # A folded registration is one op of the graph.
  lc.record_uses(params, len(inputs) if isinstance(inputs, tuple) else 1)
  return block




def _register_embedding_multi(lc, params, inputs, outputs, num_uses, approx,
                              reuse):
  """register_fully_connected_multi(..., dense_inputs=False)."""
  params = embedding_registration.check_embedding_params(params)
  name = registration_base.describe(params)
  if approx is None:
    approx = (lc.linked_approximation(params) or
              lc.default_approximation("fully_connected_multi"))
  if approx not in embedding_registration.EMBEDDING_MULTI.blocks:
    raise ValueError(
        "Multi-use embedding %s supports approximation 'kron_indep' only, "
        "got %r." % (name, approx))
  inputs, outputs, num_uses = _normalize_uses(name, inputs, outputs, num_uses)
  for ids, out in zip(utils.ensure_sequence(inputs),
                      utils.ensure_sequence(outputs)):
    embedding_registration.check_embedding_shapes(params, ids, out)
    if out.shape.rank != 2:
      raise ValueError(
          "Outputs of the multi-use embedding %s must be [batch, %s] per "
          "use (or folded [num_uses * batch, %s]), got %s." %
          (name, params.shape[1], params.shape[1], out.shape))
  _check_outputs_depend_on_params(params, outputs)
  block = embedding_registration.EMBEDDING_MULTI.blocks[approx](
      lc, int(params.shape[0]), num_uses)
  block = lc.register_block(params, block, reuse=reuse)
  if block.num_uses != num_uses:
    raise ValueError(
        "Embedding %s was registered with %d uses and is now registered (as "
        "a new tower) with %d." % (name, block.num_uses, num_uses))
  block.register_additional_tower(inputs, outputs)
  registration_base.set_block_params(block, params)
  # A folded registration is one op of the graph.
  lc.record_uses(params, len(inputs) if isinstance(inputs, tuple) else 1)
  return block


def _check_num_uses(names, num_uses):
  if (not isinstance(num_uses, int) or isinstance(num_uses, bool) or
      num_uses < 1):
    raise ValueError("num_uses of layer %s must be a positive Python int, "
                     "got %r." % (names, num_uses))


def _normalize_uses(names, inputs, outputs, num_uses):
  """-> (inputs, outputs, num_uses) with lists as tuples; checks counts."""
  if _is_uses_list(inputs) != _is_uses_list(outputs):
    raise ValueError(
        "Inputs and outputs of layer %s must both be lists over uses or both "
        "folded tensors." % names)
  if _is_uses_list(inputs):
    inputs, outputs = tuple(inputs), tuple(outputs)
    if not inputs:
      raise ValueError("Layer %s was registered with no uses." % names)
    if len(inputs) != len(outputs):
      raise ValueError(
          "Layer %s has %d input uses but %d output uses; the lists must "
          "have one entry per use." % (names, len(inputs), len(outputs)))
    if num_uses is not None:
      _check_num_uses(names, num_uses)
      if num_uses != len(inputs):
        raise ValueError(
            "Layer %s: num_uses=%d but %d uses were given as lists." %
            (names, num_uses, len(inputs)))
    batches = set(tf.compat.dimension_value(x.shape[0])
                  for x in inputs + outputs if x.shape.rank)
    batches.discard(None)
    if len(batches) > 1:
      raise ValueError("The uses of layer %s have different batch sizes %s." %
                       (names, sorted(batches)))
    return inputs, outputs, len(inputs)
  if num_uses is None:
    raise ValueError(
        "Layer %s: folded [num_uses * batch, ...] inputs need num_uses (or "
        "pass lists over uses)." % names)
  _check_num_uses(names, num_uses)
  for what, x in (("inputs", inputs), ("outputs", outputs)):
    rows = tf.compat.dimension_value(x.shape[0]) if x.shape.rank else None
    if rows is not None and rows % num_uses:
      raise ValueError(
          "Layer %s: the folded %s have %d rows, not a multiple of "
          "num_uses=%d." % (names, what, rows, num_uses))
  if (num_uses > 1 and inputs.shape.rank and
      tf.compat.dimension_value(inputs.shape[0]) is None):
    # An unknown batch dimension: checked when the statistics are computed
    # (the inputs feed only them; the outputs' gradients must stay on the
    # tensors the loss uses).
    check = tf.debugging.assert_equal(
        tf.math.floormod(tf.shape(inputs)[0], num_uses), 0,
        message="Layer %s: the folded inputs' rows are not a multiple of "
        "num_uses=%d" % (names, num_uses))
    with tf.control_dependencies([check]):
      inputs = tf.identity(inputs)
  return inputs, outputs, num_uses


def _check_outputs_depend_on_params(params, outputs):
  """Every use's output must depend on every parameter (graph mode only).

  A breadth-first walk up the graph from the output finds the variable's
  read in a few steps in the usual case, without building ops; only when it
  does not (e.g. a variable captured in an unusual way) does
  `tf.gradients` decide. Calling `tf.gradients` for every use would build
  gradient ops through the whole recurrence: quadratic in the number of
  uses for an RNN.
  """
  if tf.executing_eagerly():
    return
  uses = utils.ensure_sequence(outputs)
  for var in utils.ensure_sequence(params):
    for t, y in enumerate(uses):
      if _reaches_variable(y, var):
        continue
      if tf.gradients(y, var)[0] is None:
        raise ValueError(
            "Output %s of use %d of the multi-use layer does not depend on "
            "variable %s; every use's outputs must be computed from the "
            "layer's parameters." % (getattr(y, "name", y), t,
                                     utils.variable_name(var)))


def _variable_ops(var, graph):
  """Ops of `graph` that stand for `var`: its handle (or, inside a
  tf.function, the placeholder capturing it), or its ref-variable op."""
  ops = []
  handle = getattr(var, "handle", None)
  if handle is not None:
    try:
      if handle.graph is graph:
        ops.append(handle.op)
    except AttributeError:  # an eager handle has no graph
      pass
    for external, internal in getattr(graph, "captures", ()):
      if external is handle:
        ops.append(internal.op)
  op = getattr(var, "op", None)
  if op is not None and getattr(op, "graph", None) is graph:
    ops.append(op)
  return ops


def _reaches_variable(tensor, var, max_ops=20000):
  targets = set(id(op) for op in _variable_ops(var, tensor.graph))
  if not targets:
    return False
  queue = [tensor.op]
  seen = {id(tensor.op)}
  for op in queue:  # the list grows while it is walked: breadth first
    if id(op) in targets:
      return True
    if len(seen) > max_ops:
      return False
    for x in op.inputs:
      if id(x.op) not in seen:
        seen.add(id(x.op))
        queue.append(x.op)
  return False
