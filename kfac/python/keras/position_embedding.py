"""Position embeddings: a table looked up with ids that have no batch axis.

The keras.io transformer pattern `x = tok + self.pos_emb(ops.arange(T))`
looks up rows with ids [T] that are the same for every example; the
[T, D] result is broadcast over the batch by the addition. Each example
uses the table once, so its gradient is that of an embedding looked up with
the ids tiled over the batch, [batch, T], whose outputs get the example's
own upstream gradient. Registered on the lookup itself ([T] ids, [T, D]
outputs) K-FAC would take the T positions for the batch and the gradient
w.r.t. the lookup, which is the sum over the batch of the examples'
gradients, for one example's: the statistics would mix the examples
(in the "exact" mode the cross-example products stay in; in the sampled
modes they vanish only on average). So kfac.keras registers it on the sum:
ids broadcast to [batch, T] and, as outputs, the [batch, T, D] tensor the
lookup is added to, whose gradient is each example's own (the addition
passes it through unchanged).

`example_independent(ids)` says whether ids have no batch axis (computed
from constants and shapes only); `broadcast_sum(outputs)` finds the
addition, or says why there is none.
"""

import tensorflow as tf

# Ops whose outputs depend only on the shape of their inputs.
_SHAPE_OPS = ("Shape", "ShapeN", "Size", "Rank")
# How many ops the search looks at before it gives up (then the ids count as
# depending on the example: the ordinary registration).
_MAX_OPS = 64
_ADD_OPS = ("AddV2", "Add")


def example_independent(ids):
  """True when the graph tensor `ids` is computed from constants and the
  shapes of other tensors only (e.g. tf.range(T), T = tf.shape(x)[1])."""
  op = getattr(ids, "op", None)
  if op is None:
    return False
  seen, stack = set(), [op]
  while stack:
    op = stack.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    if len(seen) > _MAX_OPS:
      return False
    if op.type in _SHAPE_OPS:
      continue
    if not op.inputs:
      if op.type != "Const":
        return False  # a placeholder, an iterator, a variable ...
      continue
    if op.type in ("ReadVariableOp", "Placeholder"):
      return False
    stack.extend(t.op for t in op.inputs)
  return True


def broadcast_sum(outputs):
  """(sum, None): the [batch, T..., D] output of the one addition that
  consumes the lookup `outputs` [T..., D] and broadcasts it over a batch
  axis; or (None, reason) when the graph has no such addition."""
  # Shape ops read no value (the addition's gradient takes the shapes of
  # its inputs when the batch size is not static).
  consumers = [op for op in outputs.consumers()
               if op.type not in _SHAPE_OPS]
  if len(consumers) != 1 or consumers[0].type not in _ADD_OPS:
    return None, (
        "a position embedding (ids without a batch axis) whose lookup is "
        "used by %s, not by one addition to a [batch, ...] tensor: its "
        "per-example gradients are out of reach" %
        (", ".join(sorted({op.type for op in consumers})) or "no op"))
  total = consumers[0].outputs[0]
  rank = outputs.shape.rank
  if (total.shape.rank != rank + 1 or
      not total.shape[1:].is_compatible_with(outputs.shape)):
    return None, (
        "a position embedding (ids without a batch axis) whose lookup %s "
        "is added to a tensor of shape %s, not broadcast over a batch axis" %
        (outputs.shape, total.shape))
  return total, None


def tiled_ids(ids, total):
  """ids [T...] broadcast to the leading shape [batch, T...] of `total`."""
  return tf.broadcast_to(ids, tf.shape(total)[:-1])
