"""Categorical losses over logits (softmax cross-entropy): integer targets
or one-hot (soft) targets."""

import tensorflow as tf

from kfac.python.ops.losses import base
from kfac.python.ops.losses import sampling


class CategoricalLogitsNegativeLogProbLoss(base.LogitsLoss):
  """Categorical over the last axis of `logits`, integer targets.

  F = diag(p) - p p^T with factor B = diag(q) - p q^T, q = sqrt(p).
  """

  def _make_dist(self, tfd):
    return tfd.Categorical(logits=self._logits)

  def _sample_ids(self, seed):
    logits = self._logits
    flat = tf.reshape(logits, [-1, tf.shape(logits)[-1]])
    ids = sampling.random_categorical(flat, seed)[:, 0]
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
    return (base.one_hot_last(index, p) * q_k - p * q_k,)


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


# Virtual subclasses of the old library's distribution base, so that
# isinstance(loss, DistributionNegativeLogProbLoss) holds (base.py).
for _cls in (CategoricalLogitsNegativeLogProbLoss,
             OnehotCategoricalLogitsNegativeLogProbLoss):
  base.DistributionNegativeLogProbLoss.register(_cls)
del _cls
