"""Spectral views of Fisher blocks: one uniform form for every block.

A block's vectors are mapped to a matrix view M (the block's own
`_to_mat` / `_to_view`, shaped [rows, cols], or [C, rows, cols] for blocks
made of one Kronecker product per channel). In that view the block's
matrix is

    B = (L (x) R) diag(vec(E)) (L (x) R)^T,
    B^p v = from_view(L (E^p o (L^T M R)) R^T)

with L [rows, rows] and R [cols, cols] orthogonal (None stands for the
identity) and E [rows, cols] the eigenvalues of B. A `SpectralView(left,
right, eigenvalues)` holds (L, R, E). Views per block type:

* Kronecker blocks (`KroneckerProductFB`: dense, conv, embedding,
  multi-use and reduce variants, the per-channel depthwise conv): L and R
  are the eigenvectors of the input and output factors (None for a
  `DiagonalFactor`: the kron_*_diag variants and the embedding input
  factor), and with the block's pi-adjusted damping functions (value d,
  scale s) E = c (s_A lambda_A + d_A) (x) (s_G lambda_G + d_G), c the
  block's `_renorm_coeff`: exactly the matrix `multiply_matpower` applies.
  Undamped: E = c lambda_A (x) lambda_G.
* Elementwise diagonal blocks: L = R = None, E = diagonal + damping.
* Full blocks (`SingleFactorFB`: generic "full",
  scale-and-shift "full"): the column view, L = eigenvectors of the
  factor, E = eigenvalues + damping.
* Blocks with a `spectral_view(damped)` method (EKFAC) give their own view.
* Anything else (e.g. the kron_series blocks, which define only an
  inverse) falls back to a dense view: the block's matrix (or its inverse)
  built column by column from the block's own products on unit vectors,
  then eigendecomposed. Correct for any block, but costs one product per
  parameter: it is refused above `DENSE_FALLBACK_LIMIT` parameters.

Eigenvalues of factors that are positive semidefinite are clipped at zero
(rounding noise), as the factors' own matrix powers do.
"""

import collections

import numpy as np
import tensorflow as tf

from kfac.python.ops.layers.base import blocks as block_base
from kfac.python.ops.layers.conv import depthwise_factors
from kfac.python.ops.layers.base import damping as damping_lib
from kfac.python.ops.layers.dense import blocks as dense_blocks
from kfac.python.ops.layers.embedding import blocks as embedding_blocks
from kfac.python.ops.numerics import linalg
from kfac.python.ops.tensors import utils
from kfac.python.ops.layers.base.blocks import ElementwiseDiagonalFB
from kfac.python.ops.layers.base.blocks import KroneckerProductFB
from kfac.python.ops.layers.base.blocks import SingleFactorFB
from kfac.python.ops.layers.base.factors import DiagonalFactor

__all__ = ["SpectralView", "spectral_view", "block_kind", "EigenvalueDamping", "apply_view",
           "DENSE_FALLBACK_LIMIT"]

# The dense fallback makes one block product per parameter of the block.
DENSE_FALLBACK_LIMIT = 4096

SpectralView = collections.namedtuple("SpectralView",
                                      ["left", "right", "eigenvalues"])


def eigen_power(evals, exp):
  if exp == 1:
    return evals
  if exp == -1:
    return tf.math.reciprocal(evals)
  return tf.pow(evals, utils.cast(exp, evals.dtype))


def apply_view(left, right, evals, mats, exp):
  """L (E^exp o (L^T M R)) R^T for a batch of views M [m, *view]."""
  if left is not None:
    mats = tf.matmul(left, mats, transpose_a=True)
  if right is not None:
    mats = tf.matmul(mats, right)
  mats = mats * eigen_power(evals, exp)
  if left is not None:
    mats = tf.matmul(left, mats)
  if right is not None:
    mats = tf.matmul(mats, right, transpose_b=True)
  return mats


def _kronecker_products_are_standard(block):
  """Whether the block multiplies with KroneckerProductFB's product (a
  subclass overriding it, like the kron_series blocks, does not; the dense
  block's override applies the same matrix, in a cheaper order for some
  gradients)."""
  own = type(block).multiply_matpower
  return own in (KroneckerProductFB.multiply_matpower,
                 embedding_blocks.EmbeddingKFACFB.multiply_matpower,
                 dense_blocks.FullyConnectedKFACBasicFB.multiply_matpower)


def block_kind(block):
  """"custom" (the block's own spectral_view), "kronecker", "diagonal",
  "full" or "dense" (the fallback)."""
  if callable(getattr(block, "spectral_view", None)):
    return "custom"
  if isinstance(block, KroneckerProductFB):
    return "kronecker" if _kronecker_products_are_standard(block) else "dense"
  if isinstance(block, ElementwiseDiagonalFB):
    return "diagonal"
  if isinstance(block, SingleFactorFB):
    return "full"
  return "dense"


def view_functions(block, kind):
  """(to_view(vector), from_view(view, template)) of the block's matrix
  view for `kind`; None for the dense fallback (a flat column)."""
  if kind in ("diagonal", "full"):
    return block._to_view, block._from_view  # pylint: disable=protected-access
  if kind in ("kronecker", "custom"):
    if hasattr(block, "_to_mat"):
      return block._to_mat, block._from_mat  # pylint: disable=protected-access
    return block._to_view, block._from_view  # pylint: disable=protected-access
  return None


def block_dtype(block):
  """The dtype the block's statistics (and so its products) use."""
  factors = []
  try:
    factors = [f for f in block.factors() if f is not None]
  except Exception:  # pylint: disable=broad-except
    pass
  if factors:
    return tf.as_dtype(factors[0].dtype)
  return tf.as_dtype(utils.ensure_sequence(block.params)[0].dtype)


def _check_instantiated(block):
  if getattr(block, "_damping_func", None) is None:
    raise ValueError(
        "Block %s has no statistics yet: build a FisherEstimator (or "
        "KfacOptimizer) on its LayerCollection before making a curvature "
        "operator of it." % block.name)


class EigenvalueDamping:
  """Damping added to the eigenvalues of every block: a Kronecker block
  becomes c lambda_A lambda_G^T + value in its eigenbasis, as EKFAC's
  damping is, i.e. the block plus value * I exactly, instead of the pi
  split between the factors that K-FAC's products (and the default
  `damping=`) use, which adds more than value * I. Use it to compare
  approximations at the same damping, or for a prior precision (Laplace).
  """

  def __init__(self, value):
    self.value = value

  def __repr__(self):
    return "EigenvalueDamping(%r)" % (self.value,)


def spectral_view(block, damped=True, damping=None):
  """The `SpectralView` (L, R, E) of `block` (see the module docstring).

  Args:
    block: an instantiated Fisher block.
    damped: False gives the undamped block.
    damping: None uses the block's own damping (the estimator's); a number,
      tensor, variable or DampingFunc replaces it (split between Kronecker
      factors with the pi rule as the block does); an `EigenvalueDamping`
      adds its value to every eigenvalue of the undamped block instead.
  """
  _check_instantiated(block)
  if isinstance(damping, EigenvalueDamping):
    view = spectral_view(block, damped=False)
    if not damped:
      return view
    value = damping_lib.as_damping_func(damping.value)()
    return view._replace(eigenvalues=view.eigenvalues + utils.cast(
        value, view.eigenvalues.dtype))
  kind = block_kind(block)
  if kind == "custom":
    if damping is None or not damped:
      left, right, evals = block.spectral_view(damped=damped)
    else:
      # EKFAC damping is added to the eigenvalues in the eigenbasis.
      left, right, evals = block.spectral_view(damped=False)
      evals = evals + utils.cast(damping_lib.as_damping_func(damping)(),
                                 evals.dtype)
    return SpectralView(left, right, evals)
  if kind == "kronecker":
    return _kronecker_view(block, damped, damping)
  if kind == "diagonal":
    return _diagonal_view(block, damped, damping)
  if kind == "full":
    return _full_view(block, damped, damping)
  return _dense_view(block, damped, damping)


# ---------------------------------------------------------------- Kronecker
def _factor_eig(factor):
  """(eigenvalues, eigenvectors or None) of a factor's statistic; batched
  factors ([C, n, n]) give batched results."""
  if isinstance(factor, DiagonalFactor):
    return tf.reshape(tf.convert_to_tensor(factor.get_cov_var()), [-1]), None
  cov = tf.convert_to_tensor(factor.get_cov())
  evals, evecs = linalg.eigh(cov)
  if getattr(factor, "_psd", True):
    evals = tf.maximum(evals, 0.0)
  return evals, evecs


def _damped_evals(evals, damping_func):
  dtype = evals.dtype
  scale = damping_func.scale(tf.ones(tf.shape(evals)[:-1], dtype))
  return (scale[..., tf.newaxis] * evals +
          utils.cast(damping_func(), dtype))


def _kronecker_damping(block, damping):
  """The block's (input, output) damping functions, or the ones it would
  have with `damping` (mirrors KroneckerProductFB._setup_damping and the
  per-channel set-up of DepthwiseConvKFCBasicFB)."""
  # pylint: disable=protected-access
  if damping is None:
    return block._in_damping, block._out_damping
  in_f, out_f = block._input_factor, block._output_factor
  per_channel = hasattr(in_f, "normalized_traces")
  return block_base.kronecker_damping_funcs(
      block.curvature_options, in_f, out_f,
      damping_lib.as_damping_func(damping), block._renorm_coeff,
      depthwise_factors.per_channel_pi_damping_funcs if per_channel else None)


def _kronecker_view(block, damped, damping):
  # pylint: disable=protected-access
  in_evals, in_vecs = _factor_eig(block._input_factor)
  out_evals, out_vecs = _factor_eig(block._output_factor)
  dtype = in_evals.dtype
  if damped:
    in_d, out_d = _kronecker_damping(block, damping)
    in_evals = _damped_evals(in_evals, in_d)
    out_evals = _damped_evals(out_evals, out_d)
  evals = in_evals[..., :, tf.newaxis] * out_evals[..., tf.newaxis, :]
  coeff = block._renorm_coeff
  if not (utils.is_python_number(coeff) and coeff == 1):
    evals = evals * utils.cast(coeff, dtype)
  return SpectralView(in_vecs, out_vecs, evals)


# ---------------------------------------------------------------- diagonal
def _damping_func_of(block, damping):
  if damping is None:
    return block._damping_func  # pylint: disable=protected-access
  if hasattr(block, "damping_func_for"):  # conv diagonals (positions)
    return block.damping_func_for(damping)
  return damping_lib.as_damping_func(damping)


def _diagonal_view(block, damped, damping):
  factor = block._factor  # pylint: disable=protected-access
  diag = tf.convert_to_tensor(factor.get_cov_var())
  if damped:
    dfunc = _damping_func_of(block, damping)
    diag = dfunc.scale(diag) + utils.cast(dfunc(), diag.dtype)
  return SpectralView(None, None, diag)


def _full_view(block, damped, damping):
  factor = block._factor  # pylint: disable=protected-access
  evals, evecs = linalg.eigh(tf.convert_to_tensor(factor.get_cov()))
  if getattr(factor, "_psd", True):
    evals = tf.maximum(evals, 0.0)
  if damped:
    evals = _damped_evals(evals, _damping_func_of(block, damping))
  return SpectralView(evecs, None, evals[:, tf.newaxis])


# ---------------------------------------------------------------- fallback
def _param_shapes(block):
  return [v.shape.as_list() for v in utils.ensure_sequence(block.params)]


def _from_flat(flat, shapes, as_tuple):
  parts, start = [], 0
  for shape in shapes:
    size = int(np.prod(shape))
    parts.append(tf.reshape(flat[start:start + size], shape))
    start += size
  return tuple(parts) if as_tuple else parts[0]


def _to_flat(vector):
  return tf.concat([tf.reshape(t, [-1]) for t in utils.ensure_sequence(
      vector)], axis=0)


def _dense_matrix(block, exp):
  """The block's damped matrix power `exp` in the flattened parameter
  order, one product per unit vector."""
  shapes = _param_shapes(block)
  size = sum(int(np.prod(s)) for s in shapes)
  if size > DENSE_FALLBACK_LIMIT:
    raise ValueError(
        "Block %s (%s) has no structured spectral view, and its dense view "
        "(one product per parameter) is limited to DENSE_FALLBACK_LIMIT=%d "
        "parameters; it has %d." % (block.name, type(block).__name__,
                                    DENSE_FALLBACK_LIMIT, size))
  as_tuple = isinstance(block.params, (list, tuple))
  eye = tf.eye(size, dtype=block_dtype(block))

  def column(unit):
    return _to_flat(block.multiply_matpower(_from_flat(unit, shapes,
                                                       as_tuple), exp))
  try:  # all unit vectors at once
    return tf.transpose(tf.vectorized_map(column, eye,
                                          fallback_to_while_loop=False))
  except Exception:  # pylint: disable=broad-except
    return tf.stack([column(eye[i]) for i in range(size)], axis=1)


def _dense_view(block, damped, damping):
  what = "%s (%s)" % (block.name, type(block).__name__)
  if damping is not None and damped:
    raise ValueError(
        "Block %s has no structured spectral view, so its curvature can "
        "only be used with the estimator's own damping (damping=None), "
        "not damping=%r." % (what, damping))
  inverse = False
  try:
    if damped:
      mat = _dense_matrix(block, 1)
    else:
      mat = tf.convert_to_tensor(block.full_fisher_block())
  except NotImplementedError as error:
    if not damped:
      raise ValueError("The undamped curvature of block %s is not "
                       "available: %s" % (what, error)) from None
    mat = _dense_matrix(block, -1)  # blocks that define only the inverse
    inverse = True
  evals, evecs = tf.linalg.eigh(linalg.symmetrize(mat))
  if inverse:
    evals = 1.0 / evals
  return SpectralView(evecs, None, evals[:, tf.newaxis])
