"""Counter-based random numbers that are the same in every execution mode.

TensorFlow's stateless random ops are reproducible for a given kernel, but
the XLA-compiled kernels and the plain ones generate different streams for
the same seed (checked on TF 2.21 CPU: equal for 5 numbers, different for
48). K-FAC's sampled targets must not depend on jit_compile (a run restored
with XLA must continue the trajectory of one run without it), so the
stateless path hashes (seed, element index) with integer ops that every
backend computes bit-for-bit alike: the 32-bit finaliser of MurmurHash3
applied to the index mixed with two seed-derived keys. The uniforms have 24
random bits (float32 resolution), which is plenty for Monte Carlo
curvature estimates.
"""

import math

import tensorflow as tf

_MASK = 0xFFFFFFFF


def _fmix32(h):
  """MurmurHash3's 32-bit finaliser on int64 tensors holding 32-bit values
  (products wrap modulo 2^64 and are masked back to 32 bits)."""
  h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, 16))
  h = tf.bitwise.bitwise_and(h * 0x85EBCA6B, _MASK)
  h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, 13))
  h = tf.bitwise.bitwise_and(h * 0xC2B2AE35, _MASK)
  return tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, 16))


def _bits(num, seed, stream):
  """`num` hashed 32-bit values (int64) for `seed` ([2] ints) and a stream
  number (distinct streams are independent)."""
  seed = tf.bitwise.bitwise_and(tf.cast(seed, tf.int64), _MASK)
  key0 = _fmix32(tf.bitwise.bitwise_xor(seed[0], 0x9E3779B9 + stream))
  key1 = _fmix32(tf.bitwise.bitwise_xor(seed[1], 0x5BD1E995))
  index = tf.range(tf.cast(num, tf.int64), dtype=tf.int64)
  h = tf.bitwise.bitwise_and(index * 0x9E3779B1 + key0, _MASK)
  h = _fmix32(tf.bitwise.bitwise_xor(_fmix32(h), key1))
  return _fmix32(tf.bitwise.bitwise_and(h + key0, _MASK))


def uniform(shape, seed, dtype=tf.float32, stream=0):
  """Uniform numbers in the open interval (0, 1), of `shape`."""
  shape = tf.convert_to_tensor(shape, tf.int32)
  bits = _bits(tf.reduce_prod(shape), seed, stream)
  top = tf.cast(tf.bitwise.right_shift(bits, 8), dtype)  # 24 bits
  values = (top + 0.5) * (1.0 / 16777216.0)
  return tf.reshape(values, shape)


def normal(shape, seed, dtype=tf.float32):
  """Standard normal numbers of `shape` (Box-Muller on two streams)."""
  u1 = uniform(shape, seed, dtype, stream=1)
  u2 = uniform(shape, seed, dtype, stream=2)
  return tf.sqrt(-2.0 * tf.math.log(u1)) * tf.cos(2.0 * math.pi * u2)
