"""`ConvInputSUAKroneckerFactor`: the input factor of a convolution under
spatially uncorrelated activations (KFC, Grosse & Martens 2016, section
3.1.2): I_K (x) Sigma + u u^T with the channel covariance Sigma and
u = [1_K (x) mu; 1]; powers without any dense operation on the full
[K*C(+1)]^2 matrix. Notation as in factors.py; examples may be
sub-sampled (sub_sample_inputs) as there.
"""

import math

import tensorflow as tf

from kfac.python.ops.layers.base.factors import SymmetricSqrtFactor
from kfac.python.ops.layers.conv import patches as patches_lib
from kfac.python.ops.layers.conv.statistics import check_sub_sample
from kfac.python.ops.layers.conv.statistics import concat_channels_last
from kfac.python.ops.layers.conv.statistics import mean_outer_with_ones
from kfac.python.ops.layers.conv.statistics import sample_examples
from kfac.python.ops.numerics import linalg
from kfac.python.ops.tensors import utils

__all__ = ["ConvInputSUAKroneckerFactor"]


class ConvInputSUAKroneckerFactor(SymmetricSqrtFactor):
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
    check_sub_sample(sub_sample_inputs, "sub_sample_inputs")
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
    x = concat_channels_last(self._inputs, self._channels_first)
    x, _ = sample_examples(x, self._sub_sample_inputs,
                           self.curvature_options)
    return mean_outer_with_ones(tf.reshape(x, [-1, self._channels]))

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
