"""Tests of the counter-based generator behind stateless sampled targets.

* identical numbers eagerly, in a tf.function, with XLA, and in a TF1
  Session (bit-for-bit);
* distribution: uniform mean/variance, normal mean/variance/4th moment, and
  Gumbel-max categorical frequencies against softmax probabilities, within
  5 standard errors at 200k samples; Bernoulli frequencies likewise;
* different seeds, counters and streams give different numbers.
"""

import numpy as np
import tensorflow as tf

from kfac.python.ops.tensors import counter_random
from kfac.python.ops.losses import bernoulli
from kfac.python.ops.losses import sampling

SEED = (123, 4)


def _all_modes(fn):
  eager = fn().numpy()
  traced = tf.function(fn)().numpy()
  xla = tf.function(fn, jit_compile=True)().numpy()
  graph = tf.Graph()
  with graph.as_default():
    out = fn()
    with tf.compat.v1.Session(graph=graph) as sess:
      session = sess.run(out)
  return eager, traced, xla, session


def test_same_numbers_in_every_mode():
  logits = np.random.RandomState(0).randn(40, 5).astype(np.float32)
  for fn in (lambda: counter_random.uniform([7, 9], tf.constant(SEED)),
             lambda: counter_random.normal([33], tf.constant(SEED),
                                           tf.float64),
             lambda: sampling.random_categorical(tf.constant(logits),
                                                 tf.constant(SEED, tf.int64))):
    eager, traced, xla, session = _all_modes(fn)
    np.testing.assert_array_equal(eager, traced)
    np.testing.assert_array_equal(eager, xla)
    np.testing.assert_array_equal(eager, session)


def test_uniform_and_normal_moments():
  n = 200000
  u = counter_random.uniform([n], tf.constant(SEED), tf.float64).numpy()
  assert 0.0 < u.min() and u.max() < 1.0
  assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / n)
  assert abs(u.var() - 1 / 12) < 5 * np.sqrt(1 / 180 / n)
  z = counter_random.normal([n], tf.constant(SEED), tf.float64).numpy()
  assert abs(z.mean()) < 5 / np.sqrt(n)
  assert abs(z.var() - 1) < 5 * np.sqrt(2 / n)
  assert abs(np.mean(z**4) - 3) < 5 * np.sqrt(96 / n)
  # Neighbouring elements are uncorrelated.
  assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 5 / np.sqrt(n)


def test_categorical_and_bernoulli_frequencies():
  n = 200000
  logits = np.array([1.0, -0.5, 0.3, 2.0], np.float32)
  ids = sampling.random_categorical(
      tf.constant(np.tile(logits, (n, 1))), tf.constant(SEED)).numpy()[:, 0]
  p = np.exp(logits) / np.exp(logits).sum()
  freq = np.bincount(ids, minlength=4) / n
  assert np.all(np.abs(freq - p) < 5 * np.sqrt(p * (1 - p) / n)), (freq, p)
  bern = bernoulli.MultiBernoulliNegativeLogProbLoss(
      tf.constant(np.full((n, 1), 0.7, np.float32))).sample(
          tf.constant(SEED)).numpy()
  q = 1 / (1 + np.exp(-0.7))
  assert abs(bern.mean() - q) < 5 * np.sqrt(q * (1 - q) / n)


def test_seeds_and_streams_differ():
  a = counter_random.uniform([64], tf.constant([1, 0])).numpy()
  b = counter_random.uniform([64], tf.constant([2, 0])).numpy()
  c = counter_random.uniform([64], tf.constant([1, 1])).numpy()
  d = counter_random.uniform([64], tf.constant([1, 0]), stream=1).numpy()
  again = counter_random.uniform([64], tf.constant([1, 0])).numpy()
  np.testing.assert_array_equal(a, again)
  for other in (b, c, d):
    assert np.mean(a == other) < 0.05


def _reference_uniform(num, seed, stream):
  """The generator's definition in Python integers (MurmurHash3's finaliser
  on (index * 0x9E3779B1 + key0), mixed with key1, 24 top bits)."""
  mask = 0xFFFFFFFF

  def fmix(h):
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & mask
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & mask
    return h ^ (h >> 16)

  s0, s1 = seed[0] & mask, seed[1] & mask
  key0 = fmix(s0 ^ ((0x9E3779B9 + stream) & mask))
  key1 = fmix(s1 ^ 0x5BD1E995)
  out = []
  for i in range(num):
    h = (i * 0x9E3779B1 + key0) & mask
    h = fmix(fmix(h) ^ key1)
    h = fmix((h + key0) & mask)
    out.append(((h >> 8) + 0.5) / 16777216.0)
  return np.array(out)


def test_bits_match_the_definition():
  # The stream is part of resumability: a checkpoint written by an earlier
  # version must continue with the same samples, so the uint32 kernels are
  # pinned to the definition, bit for bit, in float64.
  for seed, stream in (((123, 4), 0), ((2**40 + 7, -3), 1),
                       ((0, 2**32 - 1), 3)):
    got = counter_random.uniform([300], tf.constant(seed, tf.int64),
                                 tf.float64, stream=stream).numpy()
    np.testing.assert_array_equal(got, _reference_uniform(300, seed, stream))
