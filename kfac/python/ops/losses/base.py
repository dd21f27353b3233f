"""Loss functions: predictive distributions and their curvature (layer 2).

The bases of every loss (this module); the families are in categorical.py
(softmax cross-entropy), bernoulli.py (sigmoid cross-entropy) and normal.py
(squared error: Gaussians), their random draws in sampling.py.

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

import tensorflow as tf

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


def one_hot_last(index, like):
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


def _check_index(index):
  index = tuple(index) if isinstance(index, (list, tuple)) else (index,)
  if len(index) != 1:
    raise ValueError("Expected an index into the last axis (length 1), got "
                     "%s." % (index,))
  return int(index[0])


class NaturalParamsNegativeLogProbLoss(NegativeLogProbLoss):
  """Marker base: inputs are natural parameters, so GGN == Fisher."""


class LogitsLoss(NaturalParamsNegativeLogProbLoss):
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
