"""fwd_gradients: forward-mode directional derivatives in a graph."""

import tensorflow as tf


def _as_list(x):
  return list(x) if isinstance(x, (list, tuple)) else [x]


def fwd_gradients(ys, xs, grad_xs=None, stop_gradients=None,
                  colocate_gradients_with_ops=True):
  """Jacobian-vector products d ys / d xs . grad_xs.

  Uses the double reverse-mode trick (the reverse-mode gradient w.r.t. a
  dummy cotangent u is linear in u; differentiating it again w.r.t. u gives
  the forward-mode product), so it needs graph tensors: a TF1 graph or a
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
  # The dummy cotangents' value is irrelevant (the result does not depend
  # on it); NaN makes any accidental use visible.
  us = [tf.zeros_like(y) + float("nan") for y in ys]
  dydxs = tf.gradients(ys, xs, grad_ys=us, stop_gradients=stop_gradients)
  dydxs = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
           for g in dydxs]
  dydxs = [tf.zeros_like(x) if g is None else g for x, g in zip(xs, dydxs)]
  return tf.gradients(dydxs, us, grad_ys=grad_xs)
