"""Gaussian losses (squared error): learned mean with a fixed variance, and
learned mean and variance (whose GGN differs from the Fisher)."""

import math

import numpy as np
import tensorflow as tf

from kfac.python.ops.tensors import utils
from kfac.python.ops.losses import base
from kfac.python.ops.losses import sampling


def _one_of(vecs, vector):
  if (vecs is None) == (vector is None):
    raise TypeError("Pass the vectors once, as `vecs` (the old name) or "
                    "`vector`.")
  return vector if vecs is None else vecs


def _normal_nll(targets, mean, var):
  return 0.5 * (tf.square(targets - mean) / var +
                tf.math.log(var) + math.log(2.0 * math.pi))


class NormalMeanNegativeLogProbLoss(base.NaturalParamsNegativeLogProbLoss):
  """Gaussian with learned mean and fixed variance `var`; F = I / var."""

  def __init__(self, mean, var=0.5, targets=None, seed=None):
    super().__init__(seed)
    self._mean = mean
    self._var = var
    self._targets = targets

  @property
  def inputs(self):
    return (self._mean,)

  @property
  def targets(self):
    return self._targets

  def _make_dist(self, tfd):
    scale = tf.sqrt(utils.cast(self._var, self._mean.dtype))
    return tfd.Normal(loc=self._mean, scale=scale)

  def _nll(self, targets):
    return _normal_nll(targets, self._mean,
                       utils.cast(self._var, self._mean.dtype))

  def _sample(self, seed):
    return sampling.normal_sample(
        self._mean, utils.cast(self._var, self._mean.dtype), seed)

  @property
  def _inv_var(self):
    return 1.0 / utils.cast(self._var, self._mean.dtype)

  def _multiply_fisher(self, vectors):
    return (self._inv_var * vectors[0],)

  def _multiply_fisher_factor(self, vector):
    return (tf.sqrt(self._inv_var) * vector,)

  def _multiply_fisher_factor_transpose(self, vectors):
    return tf.sqrt(self._inv_var) * vectors[0]

  def _fisher_factor_one_hot(self, index):
    ones = tf.ones_like(self._mean)
    return (base.one_hot_last(index, ones) * tf.sqrt(self._inv_var),)


class NormalMeanVarianceNegativeLogProbLoss(base.NegativeLogProbLoss):
  """Gaussian with learned mean and variance (inputs: mean, variance).

  Fisher per output dimension, on (mean, variance): diag(1/v, 1/(2 v^2)).
  Fisher-factor space is [batch, 2*d]: mean components, then variance.

  GGN: the Hessian of -log N(t; mu, v) w.r.t. (mu, v) at the data targets,
  with r = t - mu,
      H = [[1/v,      r/v^2             ],
           [r/v^2,    r^2/v^3 - 1/(2v^2)]],
  which is indefinite (det H = -1/(2 v^3) < 0) and differs from the Fisher.
  Its eigenpairs (lambda+ > 0 > lambda-) give H = B S B^T with
  B = [e+ sqrt(lambda+), e- sqrt(-lambda-)] and S = diag(+1, -1). GGN-factor
  space is [batch, 2*d]: the positive components, then the negative ones, so
  the signs are the same for every example.
  """

  def __init__(self, mean, variance, targets=None, seed=None):
    super().__init__(seed)
    if mean.shape.rank != 2 or variance.shape.rank != 2:
      raise ValueError("NormalMeanVarianceNegativeLogProbLoss expects 2-D "
                       "mean and variance, got %s and %s." %
                       (mean.shape, variance.shape))
    self._mean = mean
    self._variance = variance
    self._targets = targets

  # The old library named the argument of these `vecs` (a (mean, variance)
  # pair of vectors); keyword calls with either name work.
  def multiply_fisher(self, vecs=None, vector=None):
    return super().multiply_fisher(_one_of(vecs, vector))

  def multiply_fisher_factor(self, vecs=None, vector=None):
    return super().multiply_fisher_factor(_one_of(vecs, vector))

  def multiply_fisher_factor_transpose(self, vecs=None, vector=None):
    return super().multiply_fisher_factor_transpose(_one_of(vecs, vector))

  @property
  def inputs(self):
    return (self._mean, self._variance)

  @property
  def targets(self):
    return self._targets

  def _make_dist(self, tfd):
    return tfd.Normal(loc=self._mean, scale=tf.sqrt(self._variance))

  def _nll(self, targets):
    return _normal_nll(targets, self._mean, self._variance)

  def _sample(self, seed):
    return sampling.normal_sample(self._mean, self._variance, seed)

  @property
  def _dim(self):
    return int(self._mean.shape[-1])

  # Fisher.
  def _fisher_diag_factor(self):
    v = self._variance
    return 1.0 / tf.sqrt(v), 1.0 / (np.sqrt(2.0) * v)

  def _multiply_fisher(self, vectors):
    vm, vv = vectors
    v = self._variance
    return (vm / v, vv / (2.0 * tf.square(v)))

  def _multiply_fisher_factor(self, vector):
    fm, fv = self._fisher_diag_factor()
    um, uv = tf.split(vector, 2, axis=-1)
    return (fm * um, fv * uv)

  def _multiply_fisher_factor_transpose(self, vectors):
    fm, fv = self._fisher_diag_factor()
    return tf.concat([fm * vectors[0], fv * vectors[1]], axis=-1)

  def _fisher_factor_one_hot(self, index):
    fm, fv = self._fisher_diag_factor()
    d = self._dim
    if index < d:
      out = base.one_hot_last(index, fm) * fm[:, index:index + 1]
      return (out, tf.zeros_like(out))
    out = base.one_hot_last(index - d, fv) * fv[:, index - d:index - d + 1]
    return (tf.zeros_like(out), out)

  @property
  def fisher_factor_inner_shape(self):
    shape = tf.shape(self._mean)
    return tf.concat([shape[:-1], 2 * shape[-1:]], axis=0)

  @property
  def fisher_factor_inner_static_shape(self):
    return tf.TensorShape([self._mean.shape[0], 2 * self._dim])

  # GGN (Hessian at the data targets).
  @property
  def ggn_requires_targets(self):
    return True

  def _hessian_entries(self):
    if self.targets is None:
      raise ValueError(
          "The GGN of NormalMeanVarianceNegativeLogProbLoss is the Hessian at "
          "the data targets: register the loss with targets=... to use GGN "
          "products or the 'exact_GGN' / 'curvature_prop_GGN' modes.")
    v = self._variance
    r = self._cast_targets(self.targets) - self._mean
    h_mm = 1.0 / v
    h_mv = r / tf.square(v)
    h_vv = tf.square(r) / (v * tf.square(v)) - 0.5 / tf.square(v)
    return h_mm, h_mv, h_vv

  def _hessian_eig(self):
    """Per-entry eigenpairs of the 2x2 Hessians via a Jacobi rotation."""
    a, b, c = self._hessian_entries()
    theta = 0.5 * tf.atan2(2.0 * b, a - c)
    cos, sin = tf.cos(theta), tf.sin(theta)
    lam_pos = a * cos * cos + 2.0 * b * sin * cos + c * sin * sin
    lam_neg = a * sin * sin - 2.0 * b * sin * cos + c * cos * cos
    root_pos = tf.sqrt(tf.maximum(lam_pos, 0.0))
    root_neg = tf.sqrt(tf.maximum(-lam_neg, 0.0))
    # Columns of B: e+ = (cos, sin) * root_pos, e- = (-sin, cos) * root_neg.
    return (cos * root_pos, sin * root_pos), (-sin * root_neg, cos * root_neg)

  def _multiply_ggn(self, vectors):
    vm, vv = vectors
    a, b, c = self._hessian_entries()
    return (a * vm + b * vv, b * vm + c * vv)

  def _multiply_ggn_factor(self, vector):
    (pm, pv), (nm, nv) = self._hessian_eig()
    up, un = tf.split(vector, 2, axis=-1)
    return (pm * up + nm * un, pv * up + nv * un)

  def _multiply_ggn_factor_transpose(self, vectors):
    (pm, pv), (nm, nv) = self._hessian_eig()
    xm, xv = vectors
    return tf.concat([pm * xm + pv * xv, nm * xm + nv * xv], axis=-1)

  def _ggn_factor_one_hot(self, index):
    d = self._dim
    e = tf.ones_like(self._mean)
    if index < d:
      onehot = base.one_hot_last(index, e)
      vector = tf.concat([onehot, tf.zeros_like(e)], axis=-1)
    else:
      onehot = base.one_hot_last(index - d, e)
      vector = tf.concat([tf.zeros_like(e), onehot], axis=-1)
    return self._multiply_ggn_factor(vector)

  @property
  def ggn_factor_signs(self):
    d = self._dim
    return np.concatenate([np.ones(d), -np.ones(d)])


# Virtual subclasses of the old library's distribution base, so that
# isinstance(loss, DistributionNegativeLogProbLoss) holds (base.py).
for _cls in (NormalMeanNegativeLogProbLoss,
             NormalMeanVarianceNegativeLogProbLoss):
  base.DistributionNegativeLogProbLoss.register(_cls)
del _cls
