"""Factors of convolution layers.

Notation: a convolution with filter [k1, ..., kd, C, O] (K = k1*...*kd taps)
applied to N examples with L output locations each. p_{n,t} is the patch
(length K*C, see layers/conv/patches.py) at location t of example n, g_{n,t} the
gradient of the loss w.r.t. the pre-activation s_{n,t} (length O; the
estimator's gradients of the summed loss, so g_{n,t} = d loss_n / d s_{n,t}).

* `ConvInputKroneckerFactor`: A = mean over (n, t) of p p^T (a ones entry
  appended for a bias), optionally on a random subset of examples and/or
  patch rows, and with an elementwise patch mask.
* `ConvOutputKroneckerFactor`: G = sum over sources of weight * mean over
  (n, t) of g g^T.
* `ConvDiagonalFactor`: the exact diagonal of the layer's Fisher,
  mean over n of (sum_t p_{n,t} g_{n,t}^T)^2 (elementwise), summed over
  sources with weights.
* `ConvInputSUAKroneckerFactor`: A under spatially uncorrelated activations
  (KFC, Grosse & Martens 2016, section 3.1.2): I_K (x) Sigma + u u^T with
  the channel covariance Sigma and u = [1_K (x) mu; 1]; powers without any
  dense operation on the full [K*C(+1)]^2 matrix.
* `ConvInputReduceKroneckerFactor` / `ConvOutputReduceKroneckerFactor`:
  KFAC-reduce (Eschenhagen et al. 2023): A = mean over n of
  (mean_t p_{n,t})(mean_t p_{n,t})^T, G = mean over n of
  (sum_t g_{n,t})(sum_t g_{n,t})^T.
* Depthwise convolutions ([k.., C, M] filters, output channel c*M + m):
  `DepthwiseConvDiagonalFactor` (exact diagonal) and the per-channel
  Kronecker factors `DepthwiseConvInputKroneckerFactor` ([C, K(+1), K(+1)])
  and `DepthwiseConvOutputKroneckerFactor` ([C, M, M]).

Sub-sampling (`ConvInputKroneckerFactor`, also accepted by the SUA and
reduce input factors for examples), with the factor's CurvatureOptions
(layers/base/curvature_options.py; kfac 0.2.x's rules):
* sub_sample_inputs: None/False: all examples. True: a uniformly random
  subset (without replacement) of ceil(f * N) examples, f =
  inputs_to_extract_patches_factor (0.2). An int m: a random subset of
  min(m, N) examples.
* sub_sample_patches: None/False: all N*L patches (of the kept examples).
  True: at most DEFAULT_PATCH_ROWS_PER_DIM * dim(A) random patch rows
  (without replacement); an int R: at most R rows. The rows are gathered
  from the input directly, so the full patch matrix is never built.
Both statistics are plain means over the chosen subset, hence unbiased
estimates of the full-batch mean. `compute_sampled_statistic()` returns the
statistic together with the chosen indices.
"""

import math

import tensorflow as tf

from kfac.python.ops.layers.base import damping as damping_lib
from kfac.python.ops.numerics import linalg
from kfac.python.ops.layers.conv import patches as patches_lib
from kfac.python.ops.tensors import utils
from kfac.python.ops.layers.base.factors import DenseSquareFactor
from kfac.python.ops.layers.base.factors import FisherFactor
from kfac.python.ops.layers.base.factors import InputsGradsDiagonalFactor
from kfac.python.ops.layers.base.factors import MatmulProductsMixin
from kfac.python.ops.layers.base.factors import SymmetricSqrtCholeskyMixin
from kfac.python.ops.layers.base.factors import normalize_sources
from kfac.python.ops.layers.base.factors import normalize_weights
from kfac.python.ops.layers.base.factors import weighted_sum

__all__ = [
    "ConvInputKroneckerFactor",
    "ConvOutputKroneckerFactor",
    "ConvDiagonalFactor",
    "ConvInputSUAKroneckerFactor",
    "ConvInputReduceKroneckerFactor",
    "ConvOutputReduceKroneckerFactor",
    "DepthwiseConvDiagonalFactor",
    "DepthwiseConvInputKroneckerFactor",
    "DepthwiseConvOutputKroneckerFactor",
]

# sub_sample_patches=True keeps at most this many patch rows per dimension
# of the input factor (kfac 0.2.x: 3, set_global_constants(
# max_num_patches_per_dimension=...), which is ignored here).
DEFAULT_PATCH_ROWS_PER_DIM = 8


def _spec(filter_shape, padding, strides, dilation_rate, data_format):
  return patches_lib.make_conv_spec(tuple(filter_shape)[:-2], strides,
                                    dilation_rate, padding, data_format)


def _concat_channels_last(towers, channels_first):
  towers = [patches_lib.to_channels_last(t, channels_first) for t in towers]
  return towers[0] if len(towers) == 1 else tf.concat(towers, axis=0)


def _flat_mask(patch_mask, size, dtype):
  if patch_mask is None:
    return None
  mask = tf.reshape(tf.cast(patch_mask, dtype), [-1])
  if (tf.compat.dimension_value(mask.shape[0]) is not None and
      mask.shape[0] != size):
    raise ValueError("patch_mask has %d entries; the patches have %d "
                     "(shape [k1, ..., kd, in_channels])." %
                     (mask.shape[0], size))
  return mask


def _check_sub_sample(value, what):
  if value is None or value is False or value is True:
    return
  if not utils.is_python_number(value) or int(value) != value or value < 1:
    raise ValueError("%s must be None, True or a positive int, got %r." %
                     (what, value))


def _sample_examples(x, sub_sample_inputs, options):
  """(x restricted to a random subset of examples, indices or None)."""
  if sub_sample_inputs is None or sub_sample_inputs is False:
    return x, None
  n = tf.shape(x, out_type=tf.int64)[0]
  static_n = tf.compat.dimension_value(x.shape[0])
  if sub_sample_inputs is True and static_n is not None:
    m = tf.constant(options.num_sampled_inputs(static_n), tf.int64)
  elif sub_sample_inputs is True:
    # ceil(f * N) in float64, as options.num_sampled_inputs computes it.
    m = tf.cast(tf.math.ceil(
        tf.cast(n, tf.float64) *
        float(options.inputs_to_extract_patches_factor)), tf.int64)
  else:
    m = tf.minimum(tf.constant(int(sub_sample_inputs), tf.int64), n)
  idx = tf.random.shuffle(tf.range(n))[:m]
  return tf.gather(x, idx), idx


def _mean_outer(rows):
  n = tf.cast(tf.shape(rows)[0], rows.dtype)
  return tf.matmul(rows, rows, transpose_a=True) / n


def _mean_outer_with_ones(rows):
  """_mean_outer of [rows, 1] without building the concatenated copy: the
  ones column only adds the column means and a 1."""
  second = _mean_outer(rows)
  means = tf.reduce_mean(rows, axis=0)
  top = tf.concat([second, means[:, tf.newaxis]], axis=1)
  bottom = tf.concat([means, tf.ones([1], rows.dtype)], axis=0)
  return tf.concat([top, bottom[tf.newaxis]], axis=0)


class ConvInputKroneckerFactor(DenseSquareFactor):
  """A = mean over examples and output locations of p p^T ([K*C(+1)]^2)."""

  def __init__(self, inputs, filter_shape, padding, strides=None,
               dilation_rate=None, data_format=None, extract_patches_fn=None,
               has_bias=False, sub_sample_inputs=None,
               sub_sample_patches=None, patch_mask=None, name=None):
    """Args:
      inputs: a tensor or a tuple of tensors (towers), the layer inputs.
      filter_shape: the filter's shape [k1, ..., kd, C, O].
      padding, strides, dilation_rate, data_format: the convolution's (any
        form accepted by `patches.make_conv_spec`).
      extract_patches_fn: ignored (kept for compatibility; patches are
        extracted by patches.extract_patches).
      has_bias: append a ones entry to every patch.
      sub_sample_inputs, sub_sample_patches: see the module docstring.
      patch_mask: None, or a tensor of K*C entries (shape [k1, .., kd, C]
        or flat) multiplied into every patch (masked convolutions).
    """
    del extract_patches_fn
    self._inputs = utils.ensure_sequence(inputs)
    self._spec = _spec(filter_shape, padding, strides, dilation_rate,
                       data_format)
    self._channels = int(filter_shape[-2])
    self._patch_size = self._spec.num_taps * self._channels
    self._has_bias = has_bias
    _check_sub_sample(sub_sample_inputs, "sub_sample_inputs")
    _check_sub_sample(sub_sample_patches, "sub_sample_patches")
    self._sub_sample_inputs = sub_sample_inputs
    self._sub_sample_patches = sub_sample_patches
    self._patch_mask = patch_mask
    self._n = self._patch_size + (1 if has_bias else 0)
    DenseSquareFactor.__init__(self, name=name)

  @property
  def _dtype(self):
    return self._inputs[0].dtype

  @property
  def spec(self):
    return self._spec

  def max_patch_rows(self):
    """The row budget of sub_sample_patches (None when not sub-sampling)."""
    value = self._sub_sample_patches
    if value is None or value is False:
      return None
    if value is True:
      return DEFAULT_PATCH_ROWS_PER_DIM * self._n
    return int(value)

  def patch_rows(self, x):
    """The [rows, K*C] patch matrix of channels-last x (all rows)."""
    return tf.reshape(patches_lib.extract_patches(x, self._spec),
                      [-1, self._patch_size])

  def compute_sampled_statistic(self):
    """(statistic, example indices or None, patch row indices or None).

    Example indices index the concatenated towers; row indices index the
    [n_kept * L, K*C] patch matrix of the kept examples (row r is kept
    example r // L at output location r % L)."""
    x = _concat_channels_last(self._inputs, self._spec.channels_first)
    x, example_idx = _sample_examples(x, self._sub_sample_inputs,
                                      self.curvature_options)
    row_idx = None
    budget = self.max_patch_rows()
    if budget is None:
      rows = self.patch_rows(x)
    else:
      total = (tf.shape(x, out_type=tf.int64)[0] *
               patches_lib.num_locations(x, self._spec))
      row_idx = tf.random.shuffle(tf.range(total))[:budget]
      rows = patches_lib.sample_patch_rows(x, self._spec, row_idx)
    mask = _flat_mask(self._patch_mask, self._patch_size, rows.dtype)
    if mask is not None:
      rows = rows * mask
    stat = _mean_outer_with_ones(rows) if self._has_bias else _mean_outer(rows)
    return stat, example_idx, row_idx

  def _compute_new_cov(self):
    return self.compute_sampled_statistic()[0]


class _OutputGradsMixin:
  """Output-gradient factors: sources of towers of [N, spatial..., O]."""

  def _init_grads(self, outputs_grads, data_format, weights):
    self._grads = normalize_sources(outputs_grads)
    self._weights = normalize_weights(weights, len(self._grads))
    self._channels_first = patches_lib.data_format_is_channels_first(
        data_format)
    first = self._grads[0][0]
    self._out = int(first.shape[1 if self._channels_first else -1])
    self._grads_dtype = first.dtype

  @property
  def _dtype(self):
    return self._grads_dtype

  def _source_tensors(self):
    return [_concat_channels_last(towers, self._channels_first)
            for towers in self._grads]


class _ConvOutputSquareFactor(_OutputGradsMixin, DenseSquareFactor):
  """[O, O] statistics of the output gradients."""

  def __init__(self, outputs_grads, data_format=None, weights=None,
               name=None):
    self._init_grads(outputs_grads, data_format, weights)
    self._n = self._out
    DenseSquareFactor.__init__(self, name=name, weights=self._weights)


class ConvOutputKroneckerFactor(_ConvOutputSquareFactor):
  """G = sum_s w_s mean over (n, t) of g g^T ([O, O])."""

  def _compute_new_cov(self):
    terms = [_mean_outer(tf.reshape(g, [-1, self._out]))
             for g in self._source_tensors()]
    return weighted_sum(terms, self._weights)


class ConvOutputReduceKroneckerFactor(_ConvOutputSquareFactor):
  """KFAC-reduce G = sum_s w_s mean over n of (sum_t g)(sum_t g)^T."""

  def _compute_new_cov(self):
    terms = []
    for g in self._source_tensors():
      axes = list(range(1, g.shape.rank - 1))
      terms.append(_mean_outer(tf.reduce_sum(g, axis=axes)))
    return weighted_sum(terms, self._weights)


class ConvInputReduceKroneckerFactor(DenseSquareFactor):
  """KFAC-reduce A = mean over n of a_n a_n^T, a_n = mean_t p_{n,t} (with a
  ones entry for a bias, the mean of the ones)."""

  def __init__(self, inputs, filter_shape, padding, strides=None,
               dilation_rate=None, data_format=None, has_bias=False,
               sub_sample_inputs=None, patch_mask=None, name=None):
    self._inputs = utils.ensure_sequence(inputs)
    self._spec = _spec(filter_shape, padding, strides, dilation_rate,
                       data_format)
    self._patch_size = self._spec.num_taps * int(filter_shape[-2])
    self._has_bias = has_bias
    _check_sub_sample(sub_sample_inputs, "sub_sample_inputs")
    self._sub_sample_inputs = sub_sample_inputs
    self._patch_mask = patch_mask
    self._n = self._patch_size + (1 if has_bias else 0)
    DenseSquareFactor.__init__(self, name=name)

  @property
  def _dtype(self):
    return self._inputs[0].dtype

  def _compute_new_cov(self):
    x = _concat_channels_last(self._inputs, self._spec.channels_first)
    x, _ = _sample_examples(x, self._sub_sample_inputs,
                            self.curvature_options)
    if x.shape[1:-1].is_fully_defined():
      sums = patches_lib.patch_location_sums(x, self._spec)
      num_locs = patches_lib.num_locations(x, self._spec)
      means = sums / tf.cast(num_locs, sums.dtype)
    else:
      p = patches_lib.extract_patches(x, self._spec)
      means = tf.reduce_mean(
          p, axis=list(range(1, p.shape.rank - 1)))
    mask = _flat_mask(self._patch_mask, self._patch_size, means.dtype)
    if mask is not None:
      means = means * mask
    if self._has_bias:
      means = utils.append_homog(means)
    return _mean_outer(means)


def _per_example_patches(x, spec, patch_size):
  """[N, L, K*C] patches of channels-last x."""
  p = patches_lib.extract_patches(x, spec)
  return tf.reshape(p, [tf.shape(p)[0], -1, patch_size])


class ConvDiagonalFactor(InputsGradsDiagonalFactor):
  """Exact diagonal of a conv layer's Fisher as a [K*C(+1), O] matrix:
  sum_s w_s mean over n of (sum_t p_{n,t} g_{n,t}^T)^2."""

  def __init__(self, inputs, outputs_grads, filter_shape, strides=None,
               padding="VALID", data_format=None, dilations=None,
               has_bias=False, weights=None, patch_mask=None, name=None):
    self._spec = _spec(filter_shape, padding, strides, dilations, data_format)
    self._patch_size = self._spec.num_taps * int(filter_shape[-2])
    self._has_bias = has_bias
    self._patch_mask = patch_mask
    super().__init__(inputs, outputs_grads, weights,
                     [self._patch_size + (1 if has_bias else 0),
                      int(filter_shape[-1])], name=name)

  def _compute_new_cov(self):
    first = self._spec.channels_first
    x = _concat_channels_last(self._inputs, first)
    p = _per_example_patches(x, self._spec, self._patch_size)
    mask = _flat_mask(self._patch_mask, self._patch_size, p.dtype)
    if mask is not None:
      p = p * mask
    if self._has_bias:
      p = tf.concat([p, tf.ones_like(p[..., :1])], axis=-1)
    n = tf.cast(tf.shape(p)[0], p.dtype)
    terms = []
    for towers in self._grads:
      g = _concat_channels_last(towers, first)
      g = tf.reshape(g, [tf.shape(g)[0], -1, self._shape[1]])
      per_example = tf.einsum("nlk,nlo->nko", p, g)
      terms.append(tf.reduce_sum(tf.square(per_example), axis=0) / n)
    return weighted_sum(terms, self._weights)


# ------------------------------------------------------------------ SUA
class ConvInputSUAKroneckerFactor(SymmetricSqrtCholeskyMixin, FisherFactor):
  """Input factor under spatially uncorrelated activations (KFC's SUA).

  With mu and Sigma the mean and covariance of the layer's input channels
  over examples and input positions, activations that are uncorrelated
  across positions and share one mean give the patch second moment
      A = I_K (x) Sigma + (1_K (x) mu)(1_K (x) mu)^T,
  and with a bias (patches [p; 1])
      A = blockdiag(I_K (x) Sigma, 0) + u u^T,  u = [1_K (x) mu; 1].
  The moving average keeps the [C+1, C+1] second moment of [a; 1] (so
  mu and E[a a^T] average linearly; Sigma = E[a a^T] - mu mu^T).

  Powers of the damped, scaled factor s A + d I use only C x C and
  (C+1) x (C+1) eigendecompositions: with E = [(1_K/sqrt K) (x) I_C, 0;
  0, 1] (orthonormal columns) and M = blockdiag(I_K (x) (s Sigma + d I),
  d), the matrix is M + s u u^T where u = E w, w = [sqrt(K) mu; 1] and
  M E = E M_w (M_w = blockdiag(s Sigma + d I, d)). Hence
      (s A + d I)^p = M^p + E ((M_w + s w w^T)^p - M_w^p) E^T,
  a Kronecker-with-identity power plus a low-rank correction (for p = -1
  this is the Woodbury identity). Cholesky factors are replaced by the
  symmetric square root (C C^T = C^2 = the damped factor).
  """

  def __init__(self, inputs, filter_shape, has_bias=False, data_format=None,
               sub_sample_inputs=None, name=None):
    super().__init__(name=name)
    self._inputs = utils.ensure_sequence(inputs)
    self._taps = int(math.prod(filter_shape[:-2]))
    self._channels = int(filter_shape[-2])
    self._has_bias = has_bias
    self._channels_first = patches_lib.data_format_is_channels_first(
        data_format)
    _check_sub_sample(sub_sample_inputs, "sub_sample_inputs")
    self._sub_sample_inputs = sub_sample_inputs
    self._n = self._taps * self._channels + (1 if has_bias else 0)
    self._matpowers = []  # (exp, damping_func)
    self._vars = {}  # (exp, damping key, "pow" | "corr") -> variable

  @property
  def _cov_shape(self):
    return [self._channels + 1, self._channels + 1]

  @property
  def _dtype(self):
    return self._inputs[0].dtype

  def _compute_new_cov(self):
    x = _concat_channels_last(self._inputs, self._channels_first)
    x, _ = _sample_examples(x, self._sub_sample_inputs,
                            self.curvature_options)
    return _mean_outer_with_ones(tf.reshape(x, [-1, self._channels]))

  # ----------------------------------------------------------- pieces
  def _mean_and_cov(self):
    moments = tf.convert_to_tensor(self.get_cov_var())
    c = self._channels
    mu = moments[:c, c]
    sigma = moments[:c, :c] - mu[:, tf.newaxis] * mu[tf.newaxis, :]
    return mu, linalg.symmetrize(sigma)

  def get_cov(self):
    """The dense A (for full_fisher_block and tests only)."""
    mu, sigma = self._mean_and_cov()
    k = self._taps
    main = linalg.kronecker_product(tf.eye(k, dtype=sigma.dtype), sigma)
    u = tf.tile(mu, [k])
    if self._has_bias:
      main = tf.pad(main, [[0, 1], [0, 1]])
      u = tf.concat([u, tf.ones([1], u.dtype)], axis=0)
    return main + u[:, tf.newaxis] * u[tf.newaxis, :]

  def normalized_trace(self):
    moments = tf.convert_to_tensor(self.get_cov_var())
    c = self._channels
    trace = (self._taps * tf.linalg.trace(moments[:c, :c]) +
             (1.0 if self._has_bias else 0.0))
    return trace / tf.cast(self._n, self._dtype)

  def _w(self, mu):
    w = tf.sqrt(tf.cast(self._taps, mu.dtype)) * mu
    if self._has_bias:
      w = tf.concat([w, tf.ones([1], mu.dtype)], axis=0)
    return w

  def _powers(self, exp, damping_func):
    """((s Sigma + d I)^p [C, C], correction [m, m]) computed now."""
    mu, sigma = self._mean_and_cov()
    dtype = sigma.dtype
    s = damping_func.scale(tf.ones([], dtype))
    d = utils.cast(damping_func(), dtype)
    p = utils.cast(exp, dtype)
    evals, evecs = tf.linalg.eigh(sigma)
    evals = tf.maximum(evals, 0.0)
    sigma_psd = tf.matmul(evecs * evals[tf.newaxis, :], evecs,
                          transpose_b=True)
    s_pow = tf.matmul(evecs * tf.pow(s * evals + d, p)[tf.newaxis, :],
                      evecs, transpose_b=True)
    w = self._w(mu)
    mw = s * sigma_psd
    mw_pow = s_pow
    if self._has_bias:
      mw = tf.pad(mw, [[0, 1], [0, 1]])
      mw_pow = tf.pad(mw_pow, [[0, 1], [0, 1]])
      corner = tf.one_hot(self._channels, self._channels + 1, dtype=dtype)
      mw_pow = mw_pow + tf.pow(d, p) * (corner[:, tf.newaxis] *
                                        corner[tf.newaxis, :])
    r = mw + s * w[:, tf.newaxis] * w[tf.newaxis, :]
    r_pow = linalg.matpower_from_eigh(*linalg.eigh(r), exp, d)
    return s_pow, r_pow - mw_pow

  # ----------------------------------------------------- registration
  def register_matpower(self, exp, damping_func):
    if exp == 1:
      return
    key = (exp, damping_func.key)
    if not any((e, f.key) == key for e, f in self._matpowers):
      self._matpowers.append((exp, damping_func))

  def register_cholesky(self, damping_func):
    self.register_matpower(0.5, damping_func)

  def register_cholesky_inverse(self, damping_func):
    self.register_matpower(-0.5, damping_func)

  def instantiate_inv_variables(self):
    m = self._channels + (1 if self._has_bias else 0)
    for i, (exp, dfunc) in enumerate(self._matpowers):
      key = (exp, dfunc.key)
      if key + ("pow",) not in self._vars:
        self._vars[key + ("pow",)] = self.state_store.get_or_create(
            "%s/sua_pow%d" % (self.name, i),
            [self._channels, self._channels], self._dtype)
        self._vars[key + ("corr",)] = self.state_store.get_or_create(
            "%s/sua_corr%d" % (self.name, i), [m, m], self._dtype)

  def inverse_values(self):
    self.instantiate_inv_variables()
    ops = []
    for exp, dfunc in self._matpowers:
      s_var, c_var = self._get_powers(exp, dfunc)
      s_pow, corr = self._powers(exp, dfunc)
      ops.extend([(s_var, s_pow), (c_var, corr)])
    return ops

  def _get_powers(self, exp, damping_func):
    """The variables (C x C power, low-rank correction) of a registration."""
    key = (exp, damping_func.key)
    if key + ("pow",) not in self._vars:
      self.instantiate_inv_variables()
    if key + ("pow",) not in self._vars:
      raise ValueError("No power %s with damping %r was registered on factor "
                       "%s." % (exp, damping_func.key, self.name))
    return self._vars[key + ("pow",)], self._vars[key + ("corr",)]

  # ---------------------------------------------------------- products
  def _apply(self, x, s_pow, corr, d_pow):
    """(M^p + E corr E^T) x for x [n, cols]."""
    k, c = self._taps, self._channels
    cols = tf.shape(x)[1]
    main = tf.reshape(x[:k * c], [k, c, cols])
    out_main = tf.einsum("ij,kjc->kic", s_pow, main)
    root_k = tf.sqrt(tf.cast(k, x.dtype))
    y = tf.reduce_sum(main, axis=0) / root_k  # E^T x, main part
    if self._has_bias:
      y = tf.concat([y, x[k * c:]], axis=0)
    z = tf.matmul(corr, y)
    out_main = out_main + (z[:c] / root_k)[tf.newaxis]
    out = tf.reshape(out_main, [k * c, cols])
    if self._has_bias:
      out = tf.concat([out, d_pow * x[k * c:] + z[c:]], axis=0)
    return out

  def left_multiply_matpower(self, x, exp, damping_func):
    dtype = x.dtype
    if exp == 1:
      mu, sigma = self._mean_and_cov()
      s = damping_func.scale(tf.ones([], dtype))
      d = utils.cast(damping_func(), dtype)
      k, c = self._taps, self._channels
      main = tf.reshape(x[:k * c], [k, c, -1])
      dx = tf.reshape(tf.einsum("ij,kjc->kic", sigma, main), [k * c, -1])
      if self._has_bias:
        dx = tf.concat([dx, tf.zeros_like(x[k * c:])], axis=0)
      u = tf.tile(mu, [k])
      if self._has_bias:
        u = tf.concat([u, tf.ones([1], dtype)], axis=0)
      ux = tf.matmul(u[tf.newaxis, :], x)
      return s * (dx + u[:, tf.newaxis] * ux) + d * x
    s_pow, corr = self._get_powers(exp, damping_func)
    d_pow = tf.pow(utils.cast(damping_func(), dtype), utils.cast(exp, dtype))
    return self._apply(x, s_pow, corr, d_pow)

  def right_multiply_matpower(self, x, exp, damping_func):
    return tf.transpose(self.left_multiply_matpower(tf.transpose(x), exp,
                                                    damping_func))


# ------------------------------------------------------------ depthwise
def _depthwise_patches(x, spec, channels):
  """[N, L, K, C] patches of channels-last x."""
  p = patches_lib.extract_patches(x, spec)
  return tf.reshape(p, [tf.shape(p)[0], -1, spec.num_taps, channels])


class DepthwiseConvDiagonalFactor(InputsGradsDiagonalFactor):
  """Exact diagonal of a depthwise conv layer's Fisher, shaped [K(+1), C, M]
  (the filter [k.., C, M] viewed as [K, C, M], the bias [C*M] as the last
  row): sum_s w_s mean over n of (sum_t p_{n,t,k,c} g_{n,t,c*M+m})^2."""

  def __init__(self, inputs, outputs_grads, filter_shape, strides=None,
               padding="VALID", dilations=None, data_format=None,
               has_bias=False, weights=None, name=None):
    self._spec = _spec(filter_shape, padding, strides, dilations, data_format)
    self._channels = int(filter_shape[-2])
    self._mult = int(filter_shape[-1])
    self._has_bias = has_bias
    super().__init__(inputs, outputs_grads, weights,
                     [self._spec.num_taps + (1 if has_bias else 0),
                      self._channels, self._mult], name=name)

  def _compute_new_cov(self):
    first = self._spec.channels_first
    p = _depthwise_patches(_concat_channels_last(self._inputs, first),
                           self._spec, self._channels)
    if self._has_bias:
      p = tf.concat([p, tf.ones_like(p[:, :, :1])], axis=2)
    n = tf.cast(tf.shape(p)[0], p.dtype)
    terms = []
    for towers in self._grads:
      g = _concat_channels_last(towers, first)
      g = tf.reshape(g, [tf.shape(g)[0], -1, self._channels, self._mult])
      per_example = tf.einsum("nlkc,nlcm->nkcm", p, g)
      terms.append(tf.reduce_sum(tf.square(per_example), axis=0) / n)
    return weighted_sum(terms, self._weights)


class _BatchedSquareFactor(MatmulProductsMixin, FisherFactor):
  """A factor whose statistic is a batch of C symmetric [n, n] matrices
  (one per channel). Damping functions may scale each matrix differently:
  `damping_func.scale(ones([C]))` gives the per-channel scales (the
  per-channel pi rule). All registered powers come from one batched
  eigendecomposition per inverse update; Cholesky factors from a batched
  Cholesky. Products act on batches x [C, rows, cols] channel by channel
  (left: power_c @ x_c, right: x_c @ power_c)."""

  def __init__(self, name=None, weights=None):
    super().__init__(name=name)
    self._psd = all(w >= 0 for w in (weights or ()))
    self._registered = []  # (kind, exp, damping_func)
    self._vars = {}

  @property
  def _cov_shape(self):
    return [self._batch, self._n, self._n]

  def get_cov(self):
    return self.get_cov_var()

  def normalized_traces(self):
    cov = tf.convert_to_tensor(self.get_cov_var())
    return tf.linalg.trace(cov) / tf.cast(self._n, cov.dtype)

  def normalized_trace(self):
    return tf.reduce_mean(self.normalized_traces())

  def _register(self, kind, exp, damping_func):
    key = (kind, exp, damping_func.key)
    if not any((k, e, f.key) == key for k, e, f in self._registered):
      self._registered.append((kind, exp, damping_func))

  def register_matpower(self, exp, damping_func):
    if exp == 1:
      return
    if not self._psd and exp != int(exp):
      raise ValueError("Factor %s may be indefinite; only integer powers are "
                       "defined, got %s." % (self.name, exp))
    self._register("matpow", exp, damping_func)

  def register_cholesky(self, damping_func):
    self._register("chol", None, damping_func)

  def register_cholesky_inverse(self, damping_func):
    self._register("cholinv", None, damping_func)

  def instantiate_inv_variables(self):
    for i, (kind, exp, dfunc) in enumerate(self._registered):
      key = (kind, exp, dfunc.key)
      if key not in self._vars:
        self._vars[key] = self.state_store.get_or_create(
            "%s/%s%d" % (self.name, kind, i), self._cov_shape, self._dtype)

  def _scales_and_damping(self, damping_func, dtype):
    scales = damping_func.scale(tf.ones([self._batch], dtype))
    return scales, utils.cast(damping_func(), dtype)

  def _damped(self, cov, damping_func):
    scales, d = self._scales_and_damping(damping_func, cov.dtype)
    eye = tf.eye(self._n, dtype=cov.dtype)
    return scales[:, tf.newaxis, tf.newaxis] * cov + d * eye

  def inverse_values(self):
    self.instantiate_inv_variables()
    cov = linalg.symmetrize(tf.convert_to_tensor(self.get_cov_var()))
    eig = None
    ops = []
    for kind, exp, dfunc in self._registered:
      var = self._vars[(kind, exp, dfunc.key)]
      if kind == "matpow":
        if eig is None:
          eig = tf.linalg.eigh(cov)
        scales, d = self._scales_and_damping(dfunc, cov.dtype)
        evals = eig[0]
        if self._psd:
          evals = tf.maximum(evals, 0.0)
        powered = tf.pow(scales[:, tf.newaxis] * evals + d,
                         utils.cast(exp, cov.dtype))
        value = tf.matmul(eig[1] * powered[:, tf.newaxis, :], eig[1],
                          transpose_b=True)
      else:
        chol = tf.linalg.cholesky(self._damped(cov, dfunc))
        if kind == "chol":
          value = chol
        else:
          eye = tf.broadcast_to(tf.eye(self._n, dtype=cov.dtype),
                                tf.shape(chol))
          value = tf.linalg.triangular_solve(chol, eye, lower=True)
      ops.append((var, value))
    return ops

  def _get(self, kind, exp, damping_func):
    key = (kind, exp, damping_func.key)
    if key not in self._vars:
      self.instantiate_inv_variables()
    if key not in self._vars:
      raise ValueError("No %s with exponent %s and damping %r was registered "
                       "on factor %s." % (kind, exp, damping_func.key,
                                          self.name))
    return self._vars[key]

  def get_matpower(self, exp, damping_func):
    if exp == 1:
      return self._damped(tf.convert_to_tensor(self.get_cov_var()),
                          damping_func)
    return self._get("matpow", exp, damping_func)

  def get_cholesky(self, damping_func):
    return self._get("chol", None, damping_func)

  def get_cholesky_inverse(self, damping_func):
    return self._get("cholinv", None, damping_func)


class DepthwiseConvInputKroneckerFactor(_BatchedSquareFactor):
  """Per-channel patch second moments of a depthwise conv: [C, K(+1),
  K(+1)], A_c = mean over (n, t) of [p_c; 1][p_c; 1]^T where p_c are the K
  taps of input channel c."""

  def __init__(self, inputs, filter_shape, strides=None, padding="VALID",
               dilations=None, data_format=None, has_bias=False, name=None):
    self._inputs = utils.ensure_sequence(inputs)
    self._spec = _spec(filter_shape, padding, strides, dilations, data_format)
    self._batch = int(filter_shape[-2])
    self._has_bias = has_bias
    self._n = self._spec.num_taps + (1 if has_bias else 0)
    super().__init__(name=name)

  @property
  def _dtype(self):
    return self._inputs[0].dtype

  def _compute_new_cov(self):
    x = _concat_channels_last(self._inputs, self._spec.channels_first)
    p = tf.reshape(_depthwise_patches(x, self._spec, self._batch),
                   [-1, self._spec.num_taps, self._batch])
    if self._has_bias:
      p = tf.concat([p, tf.ones_like(p[:, :1])], axis=1)
    rows = tf.cast(tf.shape(p)[0], p.dtype)
    return tf.einsum("rkc,rjc->ckj", p, p) / rows


class DepthwiseConvOutputKroneckerFactor(_OutputGradsMixin,
                                         _BatchedSquareFactor):
  """Per-channel output-gradient second moments of a depthwise conv:
  [C, M, M], G_c = sum_s w_s mean over (n, t) of g_c g_c^T where g_c are
  the M outputs (c*M .. c*M+M-1) of input channel c."""

  def __init__(self, outputs_grads, channels, multiplier, data_format=None,
               weights=None, name=None):
    self._init_grads(outputs_grads, data_format, weights)
    self._batch = int(channels)
    self._n = int(multiplier)
    _BatchedSquareFactor.__init__(self, name=name, weights=self._weights)

  def _compute_new_cov(self):
    terms = []
    for g in self._source_tensors():
      g = tf.reshape(g, [-1, self._batch, self._n])
      rows = tf.cast(tf.shape(g)[0], g.dtype)
      terms.append(tf.einsum("rcm,rcn->cmn", g, g) / rows)
    return weighted_sum(terms, self._weights)


def per_channel_pi_damping_funcs(input_factor, output_factor, damping_func,
                                 pi_type="tracenorm"):
  """Per-channel pi-adjusted damping for a batch of Kronecker products
  A_c (x) G_c: like damping.pi_adjusted_damping_funcs, with one pi per
  channel (scales are [C] vectors); pi_type "off": pi = 1."""
  if pi_type != "tracenorm":
    return damping_lib.pi_adjusted_damping_funcs(
        input_factor, output_factor, damping_func, pi_type)
  key = ("pi_per_channel", input_factor.name, output_factor.name,
         damping_func.key)

  def pi():
    return damping_lib.compute_pi(input_factor.normalized_traces(),
                                  output_factor.normalized_traces())

  def root():
    return tf.sqrt(utils.cast(damping_func(), tf.float64))

  return (damping_lib.DampingFunc(root, key + ("left",),
                                  scale_fn=lambda: 1.0 / pi()),
          damping_lib.DampingFunc(root, key + ("right",), scale_fn=pi))
