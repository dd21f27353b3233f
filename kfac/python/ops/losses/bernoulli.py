"""Independent Bernoulli losses over logits (sigmoid cross-entropy)."""

import tensorflow as tf

from kfac.python.ops.losses import base
from kfac.python.ops.losses import sampling


class MultiBernoulliNegativeLogProbLoss(base.LogitsLoss):
  """Independent Bernoullis with logits; F = diag(p (1 - p))."""

  def _make_dist(self, tfd):
    return tfd.Bernoulli(logits=self._logits, dtype=self._logits.dtype)

  def _sample(self, seed):
    uniform = sampling.random_uniform(tf.shape(self._logits), seed,
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
    return (base.one_hot_last(index, s) * s[..., index:index + 1],)


# Virtual subclasses of the old library's distribution base, so that
# isinstance(loss, DistributionNegativeLogProbLoss) holds (base.py).
for _cls in (MultiBernoulliNegativeLogProbLoss,):
  base.DistributionNegativeLogProbLoss.register(_cls)
del _cls
