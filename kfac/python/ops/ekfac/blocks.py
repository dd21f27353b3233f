"""EKFAC blocks (George et al. 2018): K-FAC's Kronecker eigenbasis with the
eigenvalues replaced by the exact second moments of the per-example
gradients in that basis.

In a layer's [rows, cols] matrix view the block is
(Q_A (x) Q_G) diag(vec(S)) (Q_A (x) Q_G)^T, with Q_A, Q_G the eigenvectors of
the layer's K-FAC factors (refreshed with the inverses, float64 retry as
for every eigendecomposition) and S the scalings (`EigenCorrectionFactor`,
a moving average updated with the statistics). Damping adds lambda to S
(no pi split): products are M -> Q_A ((S + lambda)^p * (Q_A^T M Q_G)) Q_G^T.
"Expand" and "reduce" variants differ only in the basis (the K-FAC-expand
or -reduce factors); the scalings always use the true per-example
gradients, so both are the best diagonal in their basis.

Each block is an `EKFACKroneckerFB` over the K-FAC block of the same layer
kind, which gives the registration, the factors A and G and the matrix
view; the layer kind's `EKFACViews` (or the block's own methods) give
`ekfac_shape()`, `ekfac_inputs()` ([N, P, rows]) and `ekfac_grads(source)`
([N, P, cols]).
"""

import typing

import tensorflow as tf

from kfac.python.ops.layers.conv import blocks as conv_blocks
from kfac.python.ops.layers.conv import patches as conv_patches
from kfac.python.ops.layers.conv import statistics as conv_stats
from kfac.python.ops.layers.conv import transpose as conv_transpose
from kfac.python.ops.layers.base import damping as damping_lib
from kfac.python.ops.layers.base.blocks import KroneckerProductFB
from kfac.python.ops.layers.base.factors import merge_trailing_axes
from kfac.python.ops.layers.dense import blocks as dense_blocks
from kfac.python.ops.layers.embedding import blocks as embedding_blocks
from kfac.python.ops.numerics import linalg
from kfac.python.ops.layers.multi_use import blocks as multi_use_blocks
from kfac.python.ops.tensors import utils
from kfac.python.ops.ekfac import factors as ekfac_factors
from kfac.python.ops.ekfac import scalings

__all__ = ["EKFACKroneckerFB", "EKFACViews", "FullyConnectedEKFACFB", "FullyConnectedEKFACReduceFB",
           "FullyConnectedMultiEKFACFB", "ConvEKFACFB", "ConvEKFACReduceFB",
           "EmbeddingEKFACFB", "ConvTransposeEKFACFB",
           "ConvTransposeEKFACBiasFB"]


def _to_basis(mat, q_in, q_out):
  """Q_A^T M Q_G (None: identity)."""
  if q_in is not None:
    mat = tf.matmul(tf.cast(q_in, mat.dtype), mat, transpose_a=True)
  if q_out is not None:
    mat = tf.matmul(mat, tf.cast(q_out, mat.dtype))
  return mat


def _from_basis(mat, q_in, q_out):
  """Q_A M Q_G^T."""
  if q_in is not None:
    mat = tf.matmul(tf.cast(q_in, mat.dtype), mat)
  if q_out is not None:
    mat = tf.matmul(mat, tf.cast(q_out, mat.dtype), transpose_b=True)
  return mat


def _power(values, exp):
  if exp == 1:
    return values
  if exp == -1:
    return 1.0 / values
  return tf.pow(values, utils.cast(exp, values.dtype))


class EKFACViews(typing.NamedTuple):
  """A layer kind's views for the scalings, three functions of the block:
  shape(block) -> [rows, cols], inputs(block) -> [N, P, rows] and
  grads(block, source) -> [N, P, cols]."""
  shape: typing.Callable
  inputs: typing.Callable
  grads: typing.Callable


class EKFACKroneckerFB(KroneckerProductFB):
  """Products and registration of an EKFAC block (see the module
  docstring) in the eigenbasis of the factors of the K-FAC block that
  follows it in the bases; the views come from `_views` (an `EKFACViews`)
  unless the block defines its own."""

  is_ekfac = True
  _correction = None
  _views = None

  def ekfac_shape(self):
    return self._views.shape(self)

  def ekfac_inputs(self):
    return self._views.inputs(self)

  def ekfac_grads(self, source):
    return self._views.grads(self, source)

  def instantiate_factors(self, grads_list, damping, weights=None):
    super().instantiate_factors(grads_list, damping, weights)
    self._damping_func = damping_lib.as_damping_func(damping)
    self._psd = weights is None or all(w >= 0 for w in weights)
    self._correction = self._make_correction(
        tuple(tuple(g) for g in grads_list),
        None if weights is None else tuple(weights))

  def _make_correction(self, grads_list, weights):
    strategy = getattr(self._layer_collection, "ekfac_strategy", "auto")
    return self._make_factor(
        ekfac_factors.EigenCorrectionFactor,
        (self, grads_list, self._input_factor, self._output_factor, weights,
         strategy, self._renorm_coeff), "S")

  @property
  def correction_factor(self):
    return self._correction

  def factors(self):
    return [self._input_factor, self._output_factor, self._correction]

  # ------------------------------------------------------- registration
  def register_matpower(self, exp):
    self._check_instantiated()
    if not self._psd and exp != int(exp):
      raise ValueError("EKFAC block %s may be indefinite (negative-weight "
                       "GGN sources); only integer powers are defined, got "
                       "%s." % (self.name, exp))

  def register_cholesky(self):
    self._check_cholesky()

  def register_cholesky_inverse(self):
    self._check_cholesky()

  def _check_cholesky(self):
    self._check_instantiated()
    if not self._psd:
      raise ValueError("A Cholesky factor of EKFAC block %s is not defined: "
                       "the block may be indefinite (negative-weight GGN "
                       "sources)." % self.name)

  # ------------------------------------------------------------ products
  def _eigen_parts(self, damped=True):
    """(Q_A or None, Q_G or None, eigenvalues [rows, cols])."""
    q_in, q_out = self._correction.bases()
    values = self._correction.effective_scalings()
    if self._psd:
      values = tf.maximum(values, 0.0)
    if damped:
      values = values + utils.cast(self._damping_func(), values.dtype)
    return q_in, q_out, values

  def spectral_view(self, damped=True):
    """(L, R, E): the block is (L (x) R) diag(vec(E)) (L (x) R)^T in its
    matrix view (L or R None for the identity)."""
    self._check_instantiated()
    return self._eigen_parts(damped)

  def multiply_matpower(self, vector, exp):
    self._check_instantiated()
    q_in, q_out, values = self._eigen_parts()
    if isinstance(vector, tf.IndexedSlices):
      return self._slices_product(vector, q_out, values, _power(values, exp),
                                  rotate_first=None)
    mat = self._to_mat(vector)
    scaled = _to_basis(mat, q_in, q_out) * tf.cast(_power(values, exp),
                                                   mat.dtype)
    return self._from_mat(_from_basis(scaled, q_in, q_out), vector)

  def _multiply_cholesky(self, vector, transpose, inverse):
    # C = Q diag(sqrt(S + lambda)) with Q = Q_A (x) Q_G, so C C^T is the
    # block; C^T and C^-1 rotate into the basis first, C and C^-T scale
    # first and rotate back.
    self._check_instantiated()
    q_in, q_out, values = self._eigen_parts()
    power = _power(values, -0.5 if inverse else 0.5)
    rotate_first = transpose != inverse
    if isinstance(vector, tf.IndexedSlices):
      return self._slices_product(vector, q_out, values, power, rotate_first)
    mat = self._to_mat(vector)
    power = tf.cast(power, mat.dtype)
    if rotate_first:
      out = _to_basis(mat, q_in, q_out) * power
    else:
      out = _from_basis(mat * power, q_in, q_out)
    return self._from_mat(out, vector)

  def _slices_product(self, vector, q_out, values, power, rotate_first):
    raise ValueError("EKFAC block %s takes dense vectors, got %r." %
                     (self.name, vector))

  def full_fisher_block(self):
    """The undamped block as a dense matrix over the flattened
    parameters (row-major [rows, cols] view)."""
    self._check_instantiated()
    q_in, q_out, values = self._eigen_parts(damped=False)
    rows, cols = values.shape
    q_in = tf.eye(rows, dtype=values.dtype) if q_in is None else q_in
    q_out = tf.eye(cols, dtype=values.dtype) if q_out is None else q_out
    basis = linalg.kronecker_product(tf.cast(q_in, values.dtype),
                                     tf.cast(q_out, values.dtype))
    return tf.matmul(basis * tf.reshape(values, [1, -1]), basis,
                     transpose_b=True)


# ------------------------------------------------------------------ views
def _concat(tensors):
  tensors = list(tensors)
  return tensors[0] if len(tensors) == 1 else tf.concat(tensors, axis=0)


def _positions_view(x):
  """[N, P..., n] -> [N, P, n] (P static when the middle dims are)."""
  middle = x.shape[1:-1]
  n = int(x.shape[-1])
  if middle.is_fully_defined():
    return tf.reshape(x, [-1, int(middle.num_elements()), n])
  return tf.reshape(x, [tf.shape(x)[0], -1, n])


def _with_ones(x):
  return tf.concat([x, tf.ones_like(x[..., :1])], axis=-1)


# pylint: disable=protected-access
def _dense_shape(block):
  first = block._inputs[0]
  out = block._outputs[0].shape[-block._output_axes:]
  return [int(first.shape[-1]) + (1 if block._has_bias else 0),
          int(out.num_elements())]


def _dense_inputs(block):
  x = _positions_view(_concat(block._inputs))
  return _with_ones(x) if block._has_bias else x


def _dense_grads(block, source):
  # Several output axes (set_output_axes) are flattened into one.
  return _positions_view(_concat(
      merge_trailing_axes(g, block._output_axes) for g in source))
# pylint: enable=protected-access


# Views of a dense layer on [N, P..., in] inputs.
DENSE_VIEWS = EKFACViews(_dense_shape, _dense_inputs, _dense_grads)


class FullyConnectedEKFACFB(EKFACKroneckerFB,
                            dense_blocks.FullyConnectedKFACBasicFB):
  """EKFAC of a dense layer ("ekfac"), in the K-FAC-expand basis (inputs of
  rank > 2 share the weights over positions)."""

  _views = DENSE_VIEWS

  def __init__(self, layer_collection, has_bias=False, params=None):
    dense_blocks.FullyConnectedKFACBasicFB.__init__(
        self, layer_collection, has_bias=has_bias, params=params)


class FullyConnectedEKFACReduceFB(EKFACKroneckerFB,
                                  multi_use_blocks.FullyConnectedKFACReduceFB):
  """EKFAC of a dense layer in the K-FAC-reduce basis ("ekfac_reduce")."""

  _views = DENSE_VIEWS


class FullyConnectedMultiEKFACFB(EKFACKroneckerFB,
                                 multi_use_blocks.FullyConnectedMultiIndepFB):
  """EKFAC of a dense layer used num_uses times ("ekfac" in
  register_fully_connected_multi), in the kron_indep basis; an example's
  gradient sums over its uses."""

  def __init__(self, layer_collection, has_bias=False, num_uses=None,
               params=None):
    multi_use_blocks.FullyConnectedMultiIndepFB.__init__(
        self, layer_collection, has_bias=has_bias, num_uses=num_uses,
        params=params)

  @property
  def approximation(self):
    return "ekfac"

  def _uses_view(self, x):
    """A tower's uses (a tuple of [N, n], or folded [U * N, n]) as
    [N, U, n]."""
    if isinstance(x, tuple) and len(x) > 1:
      return tf.stack(list(x), axis=1)
    x = self._fold(x)
    n = int(x.shape[-1])
    return tf.transpose(tf.reshape(x, [self._num_uses, -1, n]), [1, 0, 2])

  def ekfac_shape(self):
    first = self._fold(self._inputs[0])
    return [int(first.shape[-1]) + (1 if self._has_bias else 0),
            int(self._fold(self._outputs[0]).shape[-1])]

  def ekfac_inputs(self):
    x = _concat(self._uses_view(x) for x in self._inputs)
    return _with_ones(x) if self._has_bias else x

  def ekfac_grads(self, source):
    source, towers, start = tuple(source), [], 0
    for outputs in self._outputs:
      count = len(utils.ensure_sequence(outputs))
      part = source[start:start + count]
      towers.append(self._uses_view(part if count > 1 else part[0]))
      start += count
    return _concat(towers)


# pylint: disable=protected-access
def _conv_shape(block):
  return [int(block._spec.num_taps * block._filter_shape[-2]) +
          (1 if block._has_bias else 0), int(block._filter_shape[-1])]


def _locations(like):
  spatial = like.shape[1:-1]
  return (int(spatial.num_elements()) if spatial.is_fully_defined()
          else -1)


def _conv_inputs(block):
  spec = block._spec
  x = conv_stats.concat_channels_last(block._inputs, spec.channels_first)
  size = int(spec.num_taps * block._filter_shape[-2])
  p = conv_patches.extract_patches(x, spec)
  p = tf.reshape(p, [tf.shape(p)[0], _locations(p), size])
  mask = conv_stats.flat_mask(block._patch_mask, size, p.dtype)
  if mask is not None:
    p = p * mask
  return _with_ones(p) if block._has_bias else p


def _conv_grads(block, source):
  g = conv_stats.concat_channels_last(source, block._spec.channels_first)
  return tf.reshape(g, [tf.shape(g)[0], _locations(g),
                        int(block._filter_shape[-1])])
# pylint: enable=protected-access


# Views of a convolution: per-example patches [N, L, K*C(+1)] and the
# output gradients [N, L, O].
CONV_VIEWS = EKFACViews(_conv_shape, _conv_inputs, _conv_grads)


class ConvEKFACFB(EKFACKroneckerFB, conv_blocks.ConvKFCBasicFB):
  """EKFAC of a convolution ("ekfac"), in the KFC (expand) basis."""

  _views = CONV_VIEWS

  def __init__(self, layer_collection, params, padding, strides=None,
               dilation_rate=None, data_format=None, patch_mask=None):
    conv_blocks.ConvKFCBasicFB.__init__(
        self, layer_collection, params, padding, strides, dilation_rate,
        data_format, patch_mask=patch_mask)


class ConvEKFACReduceFB(EKFACKroneckerFB, conv_blocks.ConvKFCReduceFB):
  """EKFAC of a convolution in the KFAC-reduce basis ("ekfac_reduce")."""

  _views = CONV_VIEWS

  def __init__(self, layer_collection, params, padding, strides=None,
               dilation_rate=None, data_format=None, patch_mask=None):
    conv_blocks.ConvKFCReduceFB.__init__(
        self, layer_collection, params, padding, strides, dilation_rate,
        data_format, patch_mask=patch_mask)


class ConvTransposeEKFACFB(EKFACKroneckerFB,
                           conv_transpose.ConvTransposeKFCBasicFB):
  """EKFAC of a transposed convolution's filter ("ekfac"), in the basis of
  its KFC factors: the [C, K*O] view, per example the inputs [N, P, C] and
  the output-gradient patches [N, P, K*O] over the P input positions."""

  def ekfac_shape(self):
    return [self._in_channels, self._patch_size]

  def ekfac_inputs(self):
    x = conv_stats.concat_channels_last(self._inputs,
                                        self._spec.channels_first)
    return tf.reshape(x, [tf.shape(x)[0], -1, self._in_channels])

  def ekfac_grads(self, source):
    g = conv_stats.concat_channels_last(source, self._spec.channels_first)
    q = conv_patches.extract_patches(g, self._spec)
    return tf.reshape(q, [tf.shape(q)[0], -1, self._patch_size])

  def full_fisher_block(self):
    return self._in_filter_order(EKFACKroneckerFB.full_fisher_block(self))


class ConvTransposeEKFACBiasFB(conv_transpose.ExactBiasFB,
                               ConvTransposeEKFACFB):
  """EKFAC of a transposed convolution's filter and the bias's exact block
  ("ekfac" with a bias)."""


class EmbeddingEKFACFB(EKFACKroneckerFB, embedding_blocks.EmbeddingKFACFB):
  """EKFAC of an embedding table ("ekfac"): the input factor is diagonal,
  so the basis is I (x) Q_G and the scalings are the exact diagonal of the
  table's Fisher in it. Takes `tf.IndexedSlices` vectors without
  densifying them (each slice is a row of the table)."""

  def __init__(self, layer_collection, vocab_size, params=None):
    embedding_blocks.EmbeddingKFACFB.__init__(self, layer_collection,
                                              vocab_size, params=params)

  def _make_correction(self, grads_list, weights):
    return self._make_factor(
        ekfac_factors.EmbeddingEigenCorrectionFactor,
        (tuple(self._ids_per_example), grads_list, self._vocab_size,
         self._input_factor, self._output_factor, weights,
         self._renorm_coeff), "S")

  def _slices_product(self, vector, q_out, values, power, rotate_first):
    rows = tf.gather(tf.cast(power, vector.values.dtype), vector.indices)
    out = vector.values
    if rotate_first is None:   # a power: rotate, scale, rotate back
      out = _from_basis(_to_basis(out, None, q_out) * rows, None, q_out)
    elif rotate_first:
      out = _to_basis(out, None, q_out) * rows
    else:
      out = _from_basis(out * rows, None, q_out)
    return tf.IndexedSlices(out, vector.indices, vector.dense_shape)
