"""fwd_gradients: forward-mode directional derivatives in a graph."""

import tensorflow as tf

from kfac.python.ops import forward_mode


def _as_list(x):
  return list(x) if isinstance(x, (list, tuple)) else [x]


def fwd_gradients(ys, xs, grad_xs=None, stop_gradients=None,
                  colocate_gradients_with_ops=True):
  """Jacobian-vector products d ys / d xs . grad_xs.

  Pushes the tangents forward op by op (`kfac.python.ops.forward_mode`);
  where the path holds TF1 control flow it uses the whole-graph double
  reverse-mode trick instead (the reverse-mode gradient w.r.t. a dummy
  cotangent u is linear in u; differentiating it again w.r.t. u gives the
  forward-mode product). Both need graph tensors: a TF1 graph or a
  tf.function being traced (`tf.autodiff.ForwardAccumulator` is the eager
  alternative).

  Args:
    ys: tensor or list of tensors.
    xs: tensor or list of tensors (or variables).
    grad_xs: tangents, one per x (like xs); None means ones.
    stop_gradients: as in `tf.gradients`.
    colocate_gradients_with_ops: ignored (TensorFlow 2 always colocates).

  Returns:
    A list with one tensor per y (None where a y does not depend on xs).
  """
  del colocate_gradients_with_ops
  if tf.executing_eagerly():
    raise ValueError("fwd_gradients needs graph tensors (a TF1 graph or a "
                     "tf.function); eagerly use tf.autodiff."
                     "ForwardAccumulator.")
  ys = _as_list(ys)
  xs = _as_list(xs)
  try:
    tangents = (list(grad_xs) if isinstance(grad_xs, (list, tuple)) else
                [grad_xs] if grad_xs is not None else
                [tf.ones_like(tf.convert_to_tensor(x)) for x in xs])
    return forward_mode.jvp(ys, xs, tangents, stop_gradients=stop_gradients)
  except forward_mode.UnsupportedGraph:
    return whole_graph_jvp(ys, xs, grad_xs, stop_gradients)


def whole_graph_jvp(ys, xs, grad_xs=None, stop_gradients=None):
  """fwd_gradients by one double backward over the whole graph."""
  ys = _as_list(ys)
  xs = _as_list(xs)
  # The dummy cotangents' value is irrelevant (the result does not depend
  # on it); NaN makes any accidental use visible.
  us = [tf.zeros_like(y) + float("nan") for y in ys]
  dydxs = tf.gradients(ys, xs, grad_ys=us, stop_gradients=stop_gradients)
  dydxs = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
           for g in dydxs]
  dydxs = [tf.zeros_like(x) if g is None else g for x, g in zip(xs, dydxs)]
  return tf.gradients(dydxs, us, grad_ys=grad_xs)
