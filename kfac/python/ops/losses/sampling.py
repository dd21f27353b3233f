"""Random draws of the losses: targets sampled from the predictive
distributions, by TensorFlow's stateful random ops or, given a seed of shape
[2], by the stateless counter-based generator (tensors/counter_random.py).
"""

import tensorflow as tf

from kfac.python.ops.tensors import counter_random


def is_stateless_seed(seed):
  """A seed of shape [2] (a Tensor, or a list/tuple of two ints) selects the
  stateless counter-based generator: the same seed gives the same sample in
  every run, trace, process, Session or tf.function, with or without XLA
  (what an exactly resumable training step needs)."""
  if isinstance(seed, (tf.Tensor, tf.Variable)):
    return True
  return isinstance(seed, (list, tuple)) and len(seed) == 2


def random_normal(shape, seed, dtype):
  if is_stateless_seed(seed):
    return counter_random.normal(shape, seed, dtype)
  return tf.random.normal(shape, seed=seed, dtype=dtype)


def random_uniform(shape, seed, dtype):
  if is_stateless_seed(seed):
    return counter_random.uniform(shape, seed, dtype)
  return tf.random.uniform(shape, seed=seed, dtype=dtype)


def samplable_logits(logits):
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


def random_categorical(logits, seed):
  """[n, 1] class ids drawn from the rows of `logits` (see
  samplable_logits). The stateless path uses the Gumbel-max trick (argmax
  of logits + Gumbel noise)."""
  logits = samplable_logits(logits)
  if is_stateless_seed(seed):
    uniform = counter_random.uniform(tf.shape(logits), seed, logits.dtype)
    gumbel = -tf.math.log(-tf.math.log(uniform))
    return tf.argmax(logits + gumbel, axis=-1)[:, tf.newaxis]
  return tf.random.categorical(logits, 1, seed=seed)


def normal_sample(mean, var, seed):
  noise = random_normal(tf.shape(mean), seed, mean.dtype)
  return mean + tf.sqrt(var) * noise
