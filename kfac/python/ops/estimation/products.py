"""The Fisher estimator's products part: vectors times the damped
approximate Fisher / GGN, its powers and its Cholesky factors, block by
block.

`Products` is made by `estimator.FisherEstimator` once its blocks have
their factors; it gets the (parameters, block) pairs of the
LayerCollection in its constructor. `apply(fn, vecs_and_vars)` applies a
block product to every registered layer's vectors (the estimator's
multiply* methods name the product); `gradient_operands` finds the dense
weight gradients that their blocks precondition without the product.
"""

import tensorflow as tf

from kfac.python.ops.tensors import utils


class Products:
  """The FisherEstimator's products (see module docstring)."""

  def __init__(self, blocks_and_params):
    """`blocks_and_params`: the LayerCollection's (parameters, block)
    pairs, its `blocks_and_params()`."""
    self._blocks_and_params = list(blocks_and_params)

  def apply(self, fn, vecs_and_vars):
    """Applies fn(block, vector) blockwise; returns [(result, var)] in the
    order of `vecs_and_vars`. `tf.IndexedSlices` vectors reach blocks with
    `supports_indexed_slices = True` unchanged (their results may be
    IndexedSlices too) and are densified for the other blocks."""
    by_ref = {}
    for vec, var in vecs_and_vars:
      if vec is None:
        raise ValueError("No vector (gradient) for variable %s." %
                         utils.variable_name(var))
      by_ref[var.ref()] = (vec if isinstance(vec, tf.IndexedSlices) else
                           tf.convert_to_tensor(vec))
    results = {}
    for params, block in self._blocks_and_params:
      seq = utils.ensure_sequence(params)
      present = [v.ref() in by_ref for v in seq]
      if not any(present):
        continue
      if not all(present):
        missing = [utils.variable_name(v) for v, p in zip(seq, present) if not p]
        raise ValueError("Variables %s are registered in one layer with %s "
                         "but have no vector." %
                         (", ".join(missing), _names(seq)))
      vec = tuple(by_ref[v.ref()] for v in seq)
      if not getattr(block, "supports_indexed_slices", False):
        # Blocks that declare `supports_indexed_slices` (embedding tables)
        # take IndexedSlices as they are; the others get dense tensors.
        vec = tuple(tf.convert_to_tensor(v) for v in vec)
      # Half-precision vectors meet float32 factors (see
      # LayerCollection._full_precision); results go back to their dtype.
      dtypes = [v.dtype for v in vec]
      vec = tuple(_cast_vector(v, tf.float32) if d in _HALF else v
                  for v, d in zip(vec, dtypes))
      out = fn(block, vec if isinstance(params, (list, tuple)) else vec[0])
      for v, r, d in zip(seq, utils.ensure_sequence(out), dtypes):
        results[v.ref()] = _cast_vector(r, d) if d in _HALF else r
    unknown = [utils.variable_name(var) for _, var in vecs_and_vars
               if var.ref() not in results]
    if unknown:
      raise ValueError("Variables %s are not registered with the "
                       "LayerCollection of this estimator." %
                       ", ".join(unknown))
    return [(results[var.ref()], var) for _, var in vecs_and_vars]

  def gradient_operands(self, vecs_and_vars):
    """{weight variable ref: (x, d)} for the dense weight gradients x^T d
    that their blocks may precondition through x and d without reading
    the product (FullyConnectedKFACBasicFB.gradient_operands)."""
    by_ref = {var.ref(): vec for vec, var in vecs_and_vars}
    found = {}
    for params, block in self._blocks_and_params:
      seq = utils.ensure_sequence(params)
      vec = tuple(by_ref.get(v.ref()) for v in seq)
      if (not hasattr(block, "gradient_operands") or
          not all(tf.is_tensor(v) and v.dtype not in _HALF for v in vec)):
        continue
      pair = block.gradient_operands(
          vec if isinstance(params, (list, tuple)) else vec[0])
      if pair is not None:
        found[seq[0].ref()] = pair
    return found


_HALF = (tf.float16, tf.bfloat16)


def _cast_vector(vec, dtype):
  if isinstance(vec, tf.IndexedSlices):
    return tf.IndexedSlices(tf.cast(vec.values, dtype), vec.indices,
                            vec.dense_shape)
  return tf.cast(vec, dtype)


def _names(variables):
  return ", ".join(utils.variable_name(v) for v in variables)
