"""Row checks of registered tensors: a layer's inputs and outputs, or a
loss's predictions and targets, must have the same number of rows (the
leading, batch dimension). Registration checks it when both sizes are
known; otherwise the statistics (or the loss) computed from the tensor
carry a `tf.debugging` assertion that names the layer, so a mismatch is an
error at the step instead of statistics of the wrong rows."""

import tensorflow as tf


def _has_rows(tensor):
  return tensor.shape.rank is not None and tensor.shape.rank > 0


def _dynamic_rows(tensor):
  return tf.shape(tensor)[0]


def row_check(tensor, other, what, tensor_name, other_name):
  """The check that `tensor` has as many rows as `other`.

  Raises ValueError now when both row counts are static and differ;
  returns None when they are static and equal (or a tensor has no rows),
  else a run-time assertion op. `what` names the layer or loss in messages
  ("layer dense/kernel").
  """
  if not (tf.is_tensor(tensor) and tf.is_tensor(other)):
    return None
  if not (_has_rows(tensor) and _has_rows(other)):
    return None
  static_a, static_b = tensor.shape[0], other.shape[0]
  if static_a is not None and static_b is not None:
    if static_a != static_b:
      raise ValueError(
          "%s: %s have %d rows but %s have %d; they must be the same "
          "examples (shapes %s and %s)." % (what, tensor_name, static_a,
                                            other_name, static_b,
                                            tensor.shape, other.shape))
    return None
  if getattr(tensor, "graph", None) is not getattr(other, "graph", None):
    return None
  message = "%s: %s and %s have different numbers of rows (examples)" % (
      what, tensor_name, other_name)
  # Row counts read at run time only here (none for static shapes).
  check = tf.debugging.assert_equal(_dynamic_rows(tensor),
                                    _dynamic_rows(other), message=message)
  # TF1 graphs log an error for an assertion no op uses; a collection
  # that never builds statistics (an optimizer that failed, curvature
  # products only) need not.
  getattr(check, "mark_used", lambda: None)()
  return check


def checked_rows(tensor, other, what, tensor_name, other_name):
  """`tensor`, behind row_check(...) when that is a run-time check."""
  check = row_check(tensor, other, what, tensor_name, other_name)
  if check is None:
    return tensor
  with tf.control_dependencies([check]):
    return tf.identity(tensor)


def layer_row_checks(inputs, outputs, layer):
  """The run-time checks that a layer's `inputs` (a tensor, or a tuple over
  uses) have as many rows as its `outputs`; static mismatches raise
  ValueError now (see row_check)."""
  what = "layer %s" % layer
  if isinstance(inputs, (tuple, list)):
    outs = outputs if isinstance(outputs, (tuple, list)) else ()
    pairs = list(zip(inputs, outs)) if len(outs) == len(inputs) else []
  else:
    pairs = [(inputs, outputs)]
  checks = [row_check(i, o, what, "inputs", "outputs") for i, o in pairs]
  return [c for c in checks if c is not None]
