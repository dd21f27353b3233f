"""The gradient noise scale of a training run (McCandlish et al. 2018,
"An Empirical Model of Large-Batch Training", app. A).

With G the full gradient and Sigma the covariance of one example's
gradient, the *simple noise scale*

    B_simple = tr(Sigma) / |G|^2

is the batch size at which the gradient's noise (tr(Sigma) / B) is as
large as its signal (|G|^2). A batch much smaller than B_simple gives a
gradient dominated by noise, where an exact quadratic model of each batch
chooses steps for that batch's noise; a batch much larger gives nearly the
full gradient (docs/recipe.md, "The gradient noise scale").

The estimate here takes the gradients g_a, g_b of the loss on two disjoint
parts of b examples each of one batch, at the same parameters:

    tr(Sigma) ~ b / 2 * |g_a - g_b|^2,      |G|^2 ~ <g_a, g_b>.

Over the random splits of a batch of B = 2b examples with per-example
gradients x_i (mean x, sample covariance S with the 1 / (B - 1)
normalisation) both are exact in expectation:
E[b / 2 |g_a - g_b|^2] = tr(S) and E[<g_a, g_b>] = |x|^2 - tr(S) / B, the
unbiased estimate of |G|^2 (kernel_tests/noise_scale_test.py checks both
over every split of a small batch in float64). `NoiseScale` sums the two
over several steps and reports the ratio of the sums, as McCandlish et al.
advise (each sum is unbiased; their ratio is less noisy than a mean of
ratios).
"""

import tensorflow as tf

from kfac.python.ops.tensors import utils


def part_size(batch_size):
  """The examples in each of the two parts of a batch (an int tensor):
  the first and the next batch_size // 2 rows (an odd batch leaves its
  last row out)."""
  return tf.cast(batch_size, tf.int32) // 2


def split(structure, size):
  """(first part, second part): rows [0, size) and [size, 2 size) of each
  tensor of a structure (None stays None)."""
  def first(t):
    return None if t is None else t[:size]

  def second(t):
    return None if t is None else t[size:2 * size]
  return (tf.nest.map_structure(first, structure),
          tf.nest.map_structure(second, structure))


def estimates(grads_a, grads_b, size):
  """(tr(Sigma), |G|^2) of one batch, float64 scalars, from the gradients
  (lists of tensors or None, matching) of its two parts of `size` examples
  each (module docstring)."""
  diff_sq = []
  inner = []
  for a, b in zip(grads_a, grads_b):
    if a is None or b is None:
      continue
    a = tf.cast(tf.convert_to_tensor(a), tf.float64)
    b = tf.cast(tf.convert_to_tensor(b), tf.float64)
    diff_sq.append(tf.reduce_sum(tf.square(a - b)))
    inner.append(tf.reduce_sum(a * b))
  if not inner:
    raise ValueError("The gradient noise scale needs the gradient of at "
                     "least one variable; every gradient was None.")
  half = utils.cast(size, tf.float64) / 2.0
  return half * tf.add_n(diff_sq), tf.add_n(inner)


class NoiseScale:
  """Sums of tr(Sigma) and |G|^2 estimates over the measured steps, in
  K-FAC's state (so a checkpoint keeps them): `b_simple` is their ratio.

  The first `steps` steps are measured and summed; after them, with
  `every` > 0, one step in `every` is measured and the sums decay by
  `decay` before each of these is added (a moving window of about
  1 / (1 - decay) measurements: the noise scale grows as training goes
  on, docs/recipe.md)."""

  def __init__(self, store, steps, every=0, decay=0.8):
    """store: the optimizer's StateStore; steps: how many steps measure
    (the first ones); every: then one step in this many (0: none);
    decay: the sums' decay per later measurement, in [0, 1)."""
    for name, value in (("noise_scale_steps", steps),
                        ("noise_scale_every", every)):
      if int(value) != value or value < 0:
        raise ValueError("%s must be an integer >= 0, got %r." %
                         (name, value))
    if not 0.0 <= decay < 1.0:
      raise ValueError("The noise scale's decay must be in [0, 1), got %r."
                       % (decay,))
    self.steps = int(steps)
    self.every = int(every)
    self.decay = float(decay)
    self._store = store

  @property
  def enabled(self):
    """Whether any step measures."""
    return self.steps > 0 or self.every > 0

  def _var(self, name, dtype):
    return self._store.get_or_create("noise_scale/" + name, [], dtype)

  @property
  def trace_sigma_sum(self):
    return self._var("trace_sigma_sum", tf.float64)

  @property
  def grad_sq_sum(self):
    return self._var("grad_sq_sum", tf.float64)

  @property
  def measured(self):
    """How many steps have been measured (int64 variable)."""
    return self._var("measured", tf.int64)

  @property
  def batch_size(self):
    """The batch size of the last measured step (int64 variable)."""
    return self._var("batch_size", tf.int64)

  def _first_done(self):
    return tf.convert_to_tensor(self.measured) >= tf.constant(self.steps,
                                                              tf.int64)

  def measuring(self, step=None):
    """Whether this step measures (a boolean tensor): one of the first
    `steps` measured, or, after them, a `step` (the optimizer's step
    count, an integer tensor) that is a multiple of `every`."""
    first = tf.logical_not(self._first_done())
    if not self.every or step is None:
      return first
    periodic = tf.equal(tf.cast(step, tf.int64) % self.every, 0)
    return tf.logical_or(first, periodic)

  def add(self, trace_sigma, grad_sq, batch_size):
    """An op that adds one step's estimates (finite ones of a batch of at
    least 2: another step changes nothing) at batch_size examples;
    after the first `steps` measurements the sums decay by `decay` first."""
    trace_sigma = tf.cast(trace_sigma, tf.float64)
    grad_sq = tf.cast(grad_sq, tf.float64)
    # A step counts when both estimates are finite and each half had an
    # example (an empty batch's zero gradients say nothing).
    finite = tf.logical_and(
        tf.logical_and(tf.math.is_finite(trace_sigma),
                       tf.math.is_finite(grad_sq)),
        tf.cast(batch_size, tf.int64) >= 2)
    zero = tf.constant(0.0, tf.float64)
    # Every read before any assignment (a TF1 graph orders only what its
    # control dependencies say).
    measured = tf.identity(self.measured.read_value())
    first_done = measured >= tf.constant(self.steps, tf.int64)
    keep = tf.where(tf.logical_and(finite, first_done),
                    tf.constant(self.decay, tf.float64),
                    tf.constant(1.0, tf.float64))
    new = [keep * tf.identity(self.trace_sigma_sum.read_value()) +
           tf.where(finite, trace_sigma, zero),
           keep * tf.identity(self.grad_sq_sum.read_value()) +
           tf.where(finite, grad_sq, zero),
           measured + tf.cast(finite, tf.int64),
           tf.where(finite, tf.cast(batch_size, tf.int64),
                    tf.identity(self.batch_size.read_value()))]
    with tf.control_dependencies(new):
      return tf.group(
          self.trace_sigma_sum.assign(new[0]),
          self.grad_sq_sum.assign(new[1]),
          self.measured.assign(new[2]),
          self.batch_size.assign(new[3]))

  def b_simple(self):
    """tr(Sigma) / |G|^2 over the measured steps (float64): NaN before any
    step was measured, +inf where the summed |G|^2 is not positive (the
    gradient's signal is below its noise at this batch size). NaN, and no
    state created, when no step measures: Keras's saving walks the
    optimizer's properties, and reading one must not add variables."""
    nan = tf.constant(float("nan"), tf.float64)
    if not self.enabled:
      return nan
    num = tf.convert_to_tensor(self.trace_sigma_sum)
    den = tf.convert_to_tensor(self.grad_sq_sum)
    inf = tf.constant(float("inf"), tf.float64)
    measured = tf.convert_to_tensor(self.measured) > 0
    positive = den > 0
    ratio = num / tf.where(positive, den, tf.ones_like(den))
    return tf.where(measured, tf.where(positive, ratio, inf), nan)
