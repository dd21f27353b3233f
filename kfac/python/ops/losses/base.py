"""Loss functions: predictive distributions and their curvature (layer 2).

Every loss is a negative log-likelihood summed over the batch. Its *inputs*
are the network outputs it consumes (logits, means, variances). For each loss
we provide products with

* the Fisher F of the predictive distribution w.r.t. the inputs, and a
  factor B with F = B B^T ("Fisher factor"), and
* the GGN, i.e. the Hessian H of the loss w.r.t. its inputs at the data
  targets, and a factor with H = B S B^T where S is a constant diagonal of
  +-1 signs ("GGN factor"; S = I for every loss convex in its inputs).

For losses whose inputs are natural parameters (categorical and Bernoulli
logits, the Gaussian mean with fixed variance) the GGN equals the Fisher.
For the Gaussian with learned mean and variance it does not: its Hessian is
indefinite, so its GGN factor carries signs (see
`NormalMeanVarianceNegativeLogProbLoss`).

Vectors in input space are a Tensor for single-input losses and a tuple of
Tensors otherwise. Vectors in factor space are a Tensor of shape
`fisher_factor_inner_shape` (whose first dimension is the batch).
"""

import abc
import math

import numpy as np
import tensorflow as tf

from kfac.python.ops.tensors import counter_random
from kfac.python.ops.tensors import utils
from kfac.python.ops.reliability import shapes


def _tfp_distributions():
  """tfp.distributions, imported only when a `.dist` is asked for.

  The core samples and evaluates likelihoods with plain TensorFlow ops:
  tensorflow-probability 0.25's distributions cannot be imported without
  the `tf_keras` package, which depends on the full `tensorflow` wheel and
  so would install a second TensorFlow next to `tensorflow-cpu`.
  """
  try:
    import tensorflow_probability as tfp  # pylint: disable=g-import-not-at-top
    return tfp.distributions
  except ImportError as e:
    raise ImportError(
        "loss.dist needs tensorflow-probability (and, for tfp >= 0.24, the "
        "tf-keras package); kfac itself does not use it: %s" % e) from e


def insert_slice_in_zeros(slice_to_insert, dim, dim_size, position):
  """Pads a tensor whose `dim` has size 1 with zeros to size `dim_size`,
  leaving the slice at `position`."""
  if slice_to_insert.shape[dim] != 1:
    raise ValueError("Expected dimension %d of the slice to be 1, got %s." %
                     (dim, slice_to_insert.shape))
  paddings = [[0, 0] for _ in range(slice_to_insert.shape.rank)]
  paddings[dim] = [position, dim_size - position - 1]
  return tf.pad(slice_to_insert, paddings)


def _one_hot_last(index, like):
  """A tensor shaped like `like` that is 1 at last-axis `index`, 0 elsewhere."""
  depth = like.shape[-1]
  return tf.broadcast_to(tf.one_hot(index, depth, dtype=like.dtype),
                         tf.shape(like))


class LossFunction(abc.ABC):
  """Base class: a loss of some network outputs ("inputs")."""

  @property
  @abc.abstractmethod
  def inputs(self):
    """Tuple of the tensors the loss takes from the network."""

  @property
  def targets(self):
    return None

  @property
  def dtype(self):
    return self.inputs[0].dtype

  @property
  def batch_size(self):
    return tf.shape(self.inputs[0])[0]

  @abc.abstractmethod
  def evaluate(self):
    """The loss at the data targets, summed over the batch."""

  # GGN products: the Hessian of the loss w.r.t. its inputs (the old
  # library's LossFunction interface). A subclass supplies _multiply_ggn,
  # _multiply_ggn_factor, _multiply_ggn_factor_transpose and
  # _ggn_factor_one_hot.
  def multiply_ggn(self, vector):
    return self._from_tuple(self._multiply_ggn(self._to_tuple(vector)))

  def multiply_hessian(self, vector):
    return self.multiply_ggn(vector)

  def multiply_ggn_factor(self, vector):
    return self._from_tuple(self._multiply_ggn_factor(vector))

  def multiply_ggn_factor_transpose(self, vector):
    return self._multiply_ggn_factor_transpose(self._to_tuple(vector))

  def multiply_ggn_factor_replicated_one_hot(self, index):
    return self._from_tuple(self._ggn_factor_one_hot(_check_index(index)))

  @property
  def ggn_factor_inner_shape(self):
    return tf.shape(self.inputs[0])

  @property
  def ggn_factor_inner_static_shape(self):
    return self.inputs[0].shape

  @property
  def ggn_factor_signs(self):
    """None when the GGN is B B^T; else a numpy vector of +-1 over the last
    axis of the GGN factor space with GGN = B diag(signs) B^T."""
    return None

  @property
  def ggn_requires_targets(self):
    return False

  def _multiply_ggn(self, vectors):
    raise NotImplementedError("%s does not implement GGN products." %
                              type(self).__name__)

  def _multiply_ggn_factor(self, vector):
    raise NotImplementedError("%s does not implement GGN products." %
                              type(self).__name__)

  def _multiply_ggn_factor_transpose(self, vectors):
    raise NotImplementedError("%s does not implement GGN products." %
                              type(self).__name__)

  def _ggn_factor_one_hot(self, index):
    raise NotImplementedError("%s does not implement GGN products." %
                              type(self).__name__)

  # Structure helpers: public input-space vectors are a Tensor when the loss
  # has one input and a tuple otherwise.
  def _to_tuple(self, vector):
    if isinstance(vector, (list, tuple)):
      if len(vector) != len(self.inputs):
        raise ValueError("%s takes %d input vectors, got %d." %
                         (type(self).__name__, len(self.inputs), len(vector)))
      return tuple(vector)
    return (vector,)

  def _from_tuple(self, vectors):
    return vectors[0] if len(self.inputs) == 1 else tuple(vectors)


class NegativeLogProbLoss(LossFunction):
  """Negative log-probability of targets under a predictive distribution."""

  def __init__(self, seed=None):
    self._default_seed = seed

  @property
  def dist(self):
    """The predictive distribution as a tfp distribution (for users that
    want one; needs tensorflow-probability)."""
    return self._make_dist(_tfp_distributions())

  @abc.abstractmethod
  def _make_dist(self, tfd):
    pass

  @abc.abstractmethod
  def _sample(self, seed):
    """Targets drawn from the predictive distribution."""

  @property
  def params(self):
    return self.inputs[0] if len(self.inputs) == 1 else self.inputs

  @abc.abstractmethod
  def _nll(self, targets):
    """Per-element negative log-likelihood of `targets`."""

  def evaluate(self):
    if self.targets is None:
      raise ValueError(
          "%s has no targets: register the loss with targets=... to evaluate "
          "it on data (needed by estimation_mode='empirical', "
          "eval_losses(target_mode='data') and total_loss())." %
          type(self).__name__)
    return tf.reduce_sum(self._nll(self._cast_targets(self.targets)))

  def _cast_targets(self, targets):
    """Floating-point targets take the dtype of the predictions (as Keras
    does with y_true); integer labels stay integers."""
    targets = shapes.checked_rows(
        tf.convert_to_tensor(targets), self.inputs[0],
        "loss %s" % type(self).__name__, "targets", "predictions")
    if targets.dtype.is_floating and targets.dtype != self.dtype:
      targets = tf.cast(targets, self.dtype)
    return targets

  def evaluate_on_sample(self, seed=None):
    """The loss at targets sampled from the model (no gradient through them)."""
    return tf.reduce_sum(self._nll(tf.stop_gradient(self.sample(seed))))

  def sample(self, seed=None):
    return self._sample(self._default_seed if seed is None else seed)

  # Fisher products.
  def multiply_fisher(self, vector):
    return self._from_tuple(self._multiply_fisher(self._to_tuple(vector)))

  def multiply_fisher_factor(self, vector):
    return self._from_tuple(self._multiply_fisher_factor(vector))

  def multiply_fisher_factor_transpose(self, vector):
    return self._multiply_fisher_factor_transpose(self._to_tuple(vector))

  def multiply_fisher_factor_replicated_one_hot(self, index):
    return self._from_tuple(self._fisher_factor_one_hot(_check_index(index)))

  @property
  def fisher_factor_inner_shape(self):
    return tf.shape(self.inputs[0])

  @property
  def fisher_factor_inner_static_shape(self):
    return self.inputs[0].shape

  @property
  def ggn_factor_inner_shape(self):
    return self.fisher_factor_inner_shape

  @property
  def ggn_factor_inner_static_shape(self):
    return self.fisher_factor_inner_static_shape

  @abc.abstractmethod
  def _multiply_fisher(self, vectors):
    pass

  @abc.abstractmethod
  def _multiply_fisher_factor(self, vector):
    pass

  @abc.abstractmethod
  def _multiply_fisher_factor_transpose(self, vectors):
    pass

  @abc.abstractmethod
  def _fisher_factor_one_hot(self, index):
    pass

  # For natural-parameter losses the GGN is the Fisher.
  def _multiply_ggn(self, vectors):
    return self._multiply_fisher(vectors)

  def _multiply_ggn_factor(self, vector):
    return self._multiply_fisher_factor(vector)

  def _multiply_ggn_factor_transpose(self, vectors):
    return self._multiply_fisher_factor_transpose(vectors)

  def _ggn_factor_one_hot(self, index):
    return self._fisher_factor_one_hot(index)


def _one_of(vecs, vector):
  if (vecs is None) == (vector is None):
    raise TypeError("Pass the vectors once, as `vecs` (the old name) or "
                    "`vector`.")
  return vector if vecs is None else vecs


def _normal_nll(targets, mean, var):
  return 0.5 * (tf.square(targets - mean) / var +
                tf.math.log(var) + math.log(2.0 * math.pi))


def _is_stateless_seed(seed):
  """A seed of shape [2] (a Tensor, or a list/tuple of two ints) selects the
  stateless counter-based generator: the same seed gives the same sample in
  every run, trace, process, Session or tf.function, with or without XLA
  (what an exactly resumable training step needs)."""
  if isinstance(seed, (tf.Tensor, tf.Variable)):
    return True
  return isinstance(seed, (list, tuple)) and len(seed) == 2


def _random_normal(shape, seed, dtype):
  if _is_stateless_seed(seed):
    return counter_random.normal(shape, seed, dtype)
  return tf.random.normal(shape, seed=seed, dtype=dtype)


def _random_uniform(shape, seed, dtype):
  if _is_stateless_seed(seed):
    return counter_random.uniform(shape, seed, dtype)
  return tf.random.uniform(shape, seed=seed, dtype=dtype)


def _samplable_logits(logits):
  """`logits` with each row that has a NaN or +Inf, or no finite entry,
  replaced by zeros: sampling from such a row would give an out-of-range
  class id (an error in the loss of the sample). The statistics of such a
  step are not finite anyway, and the non-finite guard discards them
  (reliability/nonfinite.py). -Inf entries (masked classes) are kept."""
  finite = tf.math.is_finite(logits)
  usable = tf.logical_or(finite, tf.equal(logits, -float("inf")))
  row_ok = tf.logical_and(tf.reduce_all(usable, axis=-1, keepdims=True),
                          tf.reduce_any(finite, axis=-1, keepdims=True))
  return tf.where(row_ok, logits, tf.zeros_like(logits))


def _random_categorical(logits, seed):
  """[n, 1] class ids drawn from the rows of `logits` (see
  _samplable_logits). The stateless path uses the Gumbel-max trick (argmax
  of logits + Gumbel noise)."""
  logits = _samplable_logits(logits)
  if _is_stateless_seed(seed):
    uniform = counter_random.uniform(tf.shape(logits), seed, logits.dtype)
    gumbel = -tf.math.log(-tf.math.log(uniform))
    return tf.argmax(logits + gumbel, axis=-1)[:, tf.newaxis]
  return tf.random.categorical(logits, 1, seed=seed)


def _normal_sample(mean, var, seed):
  noise = _random_normal(tf.shape(mean), seed, mean.dtype)
  return mean + tf.sqrt(var) * noise


def _check_index(index):
  index = tuple(index) if isinstance(index, (list, tuple)) else (index,)
  if len(index) != 1:
    raise ValueError("Expected an index into the last axis (length 1), got "
                     "%s." % (index,))
  return int(index[0])


class NaturalParamsNegativeLogProbLoss(NegativeLogProbLoss):
  """Marker base: inputs are natural parameters, so GGN == Fisher."""


class _LogitsLoss(NaturalParamsNegativeLogProbLoss):
  """Shared plumbing of the losses parameterised by logits."""

  def __init__(self, logits, targets=None, seed=None):
    super().__init__(seed)
    self._logits = logits
    self._targets = targets

  @property
  def inputs(self):
    return (self._logits,)

  @property
  def targets(self):
    return self._targets


class CategoricalLogitsNegativeLogProbLoss(_LogitsLoss):
  """Categorical over the last axis of `logits`, integer targets.

  F = diag(p) - p p^T with factor B = diag(q) - p q^T, q = sqrt(p).
  """

  def _make_dist(self, tfd):
    return tfd.Categorical(logits=self._logits)

  def _sample_ids(self, seed):
    logits = self._logits
    flat = tf.reshape(logits, [-1, tf.shape(logits)[-1]])
    ids = _random_categorical(flat, seed)[:, 0]
    return tf.reshape(ids, tf.shape(logits)[:-1])

  def _sample(self, seed):
    return self._sample_ids(seed)

  @property
  def _probs(self):
    return tf.nn.softmax(self._logits)

  def _nll(self, targets):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.cast(targets, tf.int32), logits=self._logits)

  def _multiply_fisher(self, vectors):
    (v,) = vectors
    p = self._probs
    return (p * v - p * tf.reduce_sum(p * v, axis=-1, keepdims=True),)

  def _multiply_fisher_factor(self, vector):
    p = self._probs
    q = tf.sqrt(p)
    return (q * vector - p * tf.reduce_sum(q * vector, axis=-1, keepdims=True),)

  def _multiply_fisher_factor_transpose(self, vectors):
    (v,) = vectors
    p = self._probs
    q = tf.sqrt(p)
    return q * v - q * tf.reduce_sum(p * v, axis=-1, keepdims=True)

  def _fisher_factor_one_hot(self, index):
    p = self._probs
    q_k = tf.sqrt(p[..., index:index + 1])
    return (_one_hot_last(index, p) * q_k - p * q_k,)


class OnehotCategoricalLogitsNegativeLogProbLoss(
    CategoricalLogitsNegativeLogProbLoss):
  """Categorical over logits with one-hot (or soft) targets."""

  def _make_dist(self, tfd):
    return tfd.OneHotCategorical(logits=self._logits, dtype=self._logits.dtype)

  def _sample(self, seed):
    return tf.one_hot(self._sample_ids(seed), tf.shape(self._logits)[-1],
                      dtype=self._logits.dtype)

  def _nll(self, targets):
    return tf.nn.softmax_cross_entropy_with_logits(
        labels=tf.cast(targets, self._logits.dtype), logits=self._logits)


class MultiBernoulliNegativeLogProbLoss(_LogitsLoss):
  """Independent Bernoullis with logits; F = diag(p (1 - p))."""

  def _make_dist(self, tfd):
    return tfd.Bernoulli(logits=self._logits, dtype=self._logits.dtype)

  def _sample(self, seed):
    uniform = _random_uniform(tf.shape(self._logits), seed,
                              self._logits.dtype)
    return tf.cast(uniform < tf.sigmoid(self._logits), self._logits.dtype)

  @property
  def _variance(self):
    p = tf.sigmoid(self._logits)
    return p * (1.0 - p)

  def _nll(self, targets):
    return tf.nn.sigmoid_cross_entropy_with_logits(
        labels=tf.cast(targets, self._logits.dtype), logits=self._logits)

  def _multiply_fisher(self, vectors):
    return (self._variance * vectors[0],)

  def _multiply_fisher_factor(self, vector):
    return (tf.sqrt(self._variance) * vector,)

  def _multiply_fisher_factor_transpose(self, vectors):
    return tf.sqrt(self._variance) * vectors[0]

  def _fisher_factor_one_hot(self, index):
    s = tf.sqrt(self._variance)
    return (_one_hot_last(index, s) * s[..., index:index + 1],)


class NormalMeanNegativeLogProbLoss(NaturalParamsNegativeLogProbLoss):
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
    return _normal_sample(self._mean, utils.cast(self._var, self._mean.dtype),
                          seed)

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
    return (_one_hot_last(index, ones) * tf.sqrt(self._inv_var),)


class NormalMeanVarianceNegativeLogProbLoss(NegativeLogProbLoss):
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
    return _normal_sample(self._mean, self._variance, seed)

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
      out = _one_hot_last(index, fm) * fm[:, index:index + 1]
      return (out, tf.zeros_like(out))
    out = _one_hot_last(index - d, fv) * fv[:, index - d:index - d + 1]
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
      onehot = _one_hot_last(index, e)
      vector = tf.concat([onehot, tf.zeros_like(e)], axis=-1)
    else:
      onehot = _one_hot_last(index - d, e)
      vector = tf.concat([tf.zeros_like(e), onehot], axis=-1)
    return self._multiply_ggn_factor(vector)

  @property
  def ggn_factor_signs(self):
    d = self._dim
    return np.concatenate([np.ones(d), -np.ones(d)])


class DistributionNegativeLogProbLoss(NegativeLogProbLoss):
  """The old library's base of negative log-probability losses defined by a
  distribution object (kfac 0.2.x).

  A subclass implements the `dist` property (any object with `log_prob`
  and `sample(seed=...)`, e.g. a tfp distribution) plus `inputs`, `targets`
  and the Fisher products (`_multiply_fisher`, `_multiply_fisher_factor`,
  `_multiply_fisher_factor_transpose`, `_fisher_factor_one_hot`), like any
  `NegativeLogProbLoss`; the loss and sampling come from `dist`.

  The package's own negative log-probability losses are registered as
  virtual subclasses, so `isinstance(loss, DistributionNegativeLogProbLoss)`
  holds for them as it did in the old library (they compute log-probabilities
  with plain TensorFlow ops and build a tfp `dist` only when asked).
  """

  @property
  @abc.abstractmethod
  def dist(self):
    """The predictive distribution (log_prob, sample)."""

  def _make_dist(self, tfd):
    del tfd
    return self.dist

  def _nll(self, targets):
    return -self.dist.log_prob(targets)

  def _sample(self, seed):
    return self.dist.sample(seed=seed)


for _cls in (CategoricalLogitsNegativeLogProbLoss,
             OnehotCategoricalLogitsNegativeLogProbLoss,
             MultiBernoulliNegativeLogProbLoss, NormalMeanNegativeLogProbLoss,
             NormalMeanVarianceNegativeLogProbLoss):
  DistributionNegativeLogProbLoss.register(_cls)
del _cls
