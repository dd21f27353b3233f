"""How each estimation mode turns registered losses into gradient sources.

A *source* is one backward pass: tensors `ys` (loss inputs, or a scalar
loss), optional `grad_ys`, and a weight. Factor statistics sum
weight * (gradient outer products) over sources, so for a block with
output-gradient statistic G:

* "gradients":  one source, the loss at targets sampled from the model
  (E[g g^T] = Fisher, Martens & Grosse 2015).
* "empirical":  one source, the loss at the data targets (empirical Fisher).
* "curvature_prop" / "curvature_prop_GGN": grad_ys = B r for a random +-1
  vector r, B the Fisher / GGN factor (E[B r r^T B^T] = B B^T; Martens,
  Sutskever & Swersky 2012).
* "exact" / "exact_GGN": one source per output coordinate k with
  grad_ys = B e_k, so sum_k B e_k e_k^T B^T = B B^T exactly.

Coefficients enter as sqrt(coeff) in every source, so statistics scale with
coeff. A GGN with signs (H = B S B^T, see losses/normal.py) produces
separate sources for its positive and negative parts with weights +1 / -1.
"""

import tensorflow as tf

from kfac.python.ops.tensors import counter_random
from kfac.python.ops.collection import losses as collection_losses

ESTIMATION_MODES = ("gradients", "empirical", "curvature_prop",
                    "curvature_prop_GGN", "exact", "exact_GGN")

MAT_TYPES = {
    "gradients": "Fisher",
    "empirical": "Empirical_Fisher",
    "curvature_prop": "Fisher",
    "curvature_prop_GGN": "GGN",
    "exact": "Fisher",
    "exact_GGN": "GGN",
}


class Source:
  """One backward pass of an estimation mode."""

  def __init__(self, ys, grad_ys=None, weight=1.0):
    self.ys = list(ys)
    self.grad_ys = None if grad_ys is None else list(grad_ys)
    self.weight = float(weight)


def check_mode(mode):
  if mode not in ESTIMATION_MODES:
    raise ValueError("Unknown estimation_mode %r; expected one of %s." %
                     (mode, ", ".join(ESTIMATION_MODES)))


def make_sources(mode, layer_collection, seeds=None):
  """The list of `Source`s of `mode` for the collection's losses. `seeds`:
  None, or a function of a loss's index giving the stateless seed of its
  random draws (targets of a loss registered without a seed, the random
  vectors of curvature_prop)."""
  check_mode(mode)
  if mode == "gradients":
    return [Source([layer_collection.total_sampled_loss(coeff_mode="sqrt",
                                                        seeds=seeds)])]
  if mode == "empirical":
    for loss in layer_collection.losses:
      if loss.targets is None:
        raise ValueError(
            "estimation_mode='empirical' uses data targets, but loss %s was "
            "registered without targets=..." % type(loss).__name__)
    return [Source([layer_collection.total_loss(coeff_mode="sqrt")])]
  ggn = mode.endswith("_GGN")
  if mode.startswith("curvature_prop"):
    return _curvature_prop_sources(layer_collection, ggn, seeds)
  return _exact_sources(layer_collection, ggn)


def _factor_ops(loss, ggn):
  if ggn:
    if loss.ggn_requires_targets and loss.targets is None:
      raise ValueError("The GGN of %s is evaluated at the data targets; "
                       "register the loss with targets=..." %
                       type(loss).__name__)
    return (loss.multiply_ggn_factor, loss.multiply_ggn_factor_replicated_one_hot,
            loss.ggn_factor_inner_shape, loss.ggn_factor_inner_static_shape,
            loss.ggn_factor_signs)
  return (loss.multiply_fisher_factor,
          loss.multiply_fisher_factor_replicated_one_hot,
          loss.fisher_factor_inner_shape, loss.fisher_factor_inner_static_shape,
          None)


def _as_list(x):
  return list(x) if isinstance(x, (list, tuple)) else [x]


def _rademacher(shape, dtype, seed):
  """Random +-1 entries (stateless from `seed` when it is given)."""
  if seed is None:
    bits = tf.random.uniform(shape, 0, 2, dtype=tf.int32)
  else:
    bits = tf.cast(counter_random.uniform(shape, seed, tf.float32) < 0.5,
                   tf.int32)
  return tf.cast(2 * bits - 1, dtype)


def _curvature_prop_sources(layer_collection, ggn, seeds=None):
  by_sign = {1.0: ([], []), -1.0: ([], [])}
  for i, (loss, coeff) in enumerate(layer_collection.losses_with_coeffs()):
    multiply, _, inner_shape, _, signs = _factor_ops(loss, ggn)
    scale = collection_losses.sqrt_coeff(coeff, loss.dtype)
    rademacher = _rademacher(inner_shape, loss.dtype,
                             None if seeds is None else seeds(i))
    if signs is None:
      parts = [(1.0, rademacher)]
    else:
      positive = tf.constant(signs > 0, dtype=loss.dtype)
      parts = [(1.0, rademacher * positive),
               (-1.0, rademacher * (1.0 - positive))]
    for sign, vec in parts:
      ys, grad_ys = by_sign[sign]
      ys.extend(loss.inputs)
      grad_ys.extend(tf.stop_gradient(scale * v) for v in _as_list(multiply(vec)))
  return [Source(ys, grad_ys, sign) for sign, (ys, grad_ys) in by_sign.items()
          if ys]


def _exact_sources(layer_collection, ggn):
  sources = []
  for loss, coeff in layer_collection.losses_with_coeffs():
    _, one_hot, _, static_shape, signs = _factor_ops(loss, ggn)
    if (static_shape.rank != 2 or
        tf.compat.dimension_value(static_shape[-1]) is None):
      raise ValueError(
          "The exact modes loop over output coordinates and need a static "
          "[batch, d] factor shape; %s has %s." %
          (type(loss).__name__, static_shape))
    scale = collection_losses.sqrt_coeff(coeff, loss.dtype)
    for k in range(int(static_shape[-1])):
      grad_ys = [tf.stop_gradient(scale * v) for v in _as_list(one_hot([k]))]
      weight = 1.0 if signs is None else float(signs[k])
      sources.append(Source(loss.inputs, grad_ys, weight))
  return sources


def gradients_of_sources(sources, xs, fill=True):
  """tf.gradients of every source w.r.t. xs; missing gradients are zeros
  (None with fill=False)."""
  out = []
  for source in sources:
    grads = tf.gradients(source.ys, xs, grad_ys=source.grad_ys)
    out.append([(tf.zeros_like(x) if fill else None) if g is None
                else tf.convert_to_tensor(g) for g, x in zip(grads, xs)])
  return out
