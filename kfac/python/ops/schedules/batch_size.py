"""Batch-size schedules: callables of the training step.

K-FAC's curvature estimates and its damping adaptation gain from larger
mini-batches later in training. A schedule maps the step (a Python int or an
integer tensor, e.g. the optimizer's `counter`) to an int32 scalar tensor,
usable inside a TF1 graph or a `tf.function`, typically fed to a reader of
`kfac.data_reader`:

    schedule = exponential_batch_size_schedule(32, 1024, growth_rate=1.01)
    batch = reader(schedule(optimizer.counter))

The arithmetic is done in float64 and negative steps count as step 0. The
schedules of this module also accept a tensor of steps and then return a
batch size per step.
"""

import math
import numbers

import tensorflow as tf

__all__ = [
    "exponential_batch_size_schedule", "linear_batch_size_schedule",
    "piecewise_constant_batch_size_schedule", "make_batch_size_list"
]


def _positive_int(value, what):
  if (isinstance(value, bool) or not isinstance(value, numbers.Integral) or
      value < 1):
    raise ValueError("%s must be a positive int, got %r." % (what, value))
  return int(value)


def _step(step):
  step = tf.convert_to_tensor(step)
  if not step.dtype.is_integer:
    raise ValueError("A batch-size schedule needs an integer step, got %s."
                     % step.dtype.name)
  return tf.maximum(tf.cast(step, tf.float64), 0.0)


class _Schedule:
  """A named callable step -> int32 batch size."""

  def __init__(self, name, fn, **config):
    self._name = name
    self._fn = fn
    self.config = config

  def __call__(self, step):
    return tf.cast(self._fn(_step(step)), tf.int32)

  def __repr__(self):
    args = ", ".join("%s=%r" % kv for kv in self.config.items())
    return "%s(%s)" % (self._name, args)


def exponential_batch_size_schedule(initial_batch_size, max_batch_size,
                                    growth_rate):
  """min(max_batch_size, floor(initial_batch_size * growth_rate**step)).

  Args:
    initial_batch_size: positive int, the batch size at step 0.
    max_batch_size: int >= initial_batch_size, the cap.
    growth_rate: finite number >= 1 (1: constant batch size).
  """
  initial = _positive_int(initial_batch_size, "initial_batch_size")
  cap = _positive_int(max_batch_size, "max_batch_size")
  if initial > cap:
    raise ValueError("initial_batch_size (%d) must be <= max_batch_size (%d)."
                     % (initial, cap))
  if (isinstance(growth_rate, bool) or
      not isinstance(growth_rate, numbers.Real) or
      not math.isfinite(growth_rate) or growth_rate < 1):
    raise ValueError("growth_rate must be a finite number >= 1, got %r."
                     % (growth_rate,))
  growth = float(growth_rate)

  def fn(step):
    size = tf.floor(initial * tf.pow(tf.constant(growth, tf.float64), step))
    return tf.minimum(size, float(cap))  # growth**step may overflow to inf

  return _Schedule("exponential_batch_size_schedule", fn,
                   initial_batch_size=initial, max_batch_size=cap,
                   growth_rate=growth)


def linear_batch_size_schedule(initial_batch_size, max_batch_size, num_steps):
  """floor(initial + (max - initial) * min(step, num_steps) / num_steps).

  A linear ramp from `initial_batch_size` at step 0 to `max_batch_size` at
  step `num_steps` (a positive int), constant afterwards.
  """
  initial = _positive_int(initial_batch_size, "initial_batch_size")
  cap = _positive_int(max_batch_size, "max_batch_size")
  steps = _positive_int(num_steps, "num_steps")
  if initial > cap:
    raise ValueError("initial_batch_size (%d) must be <= max_batch_size (%d)."
                     % (initial, cap))

  def fn(step):
    fraction = tf.minimum(step, float(steps)) / float(steps)
    return tf.floor(initial + (cap - initial) * fraction)

  return _Schedule("linear_batch_size_schedule", fn,
                   initial_batch_size=initial, max_batch_size=cap,
                   num_steps=steps)


def piecewise_constant_batch_size_schedule(boundaries, values):
  """values[i] for boundaries[i-1] < step <= boundaries[i].

  As `tf.compat.v1.train.piecewise_constant`: values[0] up to and including
  step boundaries[0], values[1] up to boundaries[1], ..., values[-1] after
  the last boundary. `boundaries` are strictly increasing non-negative ints,
  `values` positive ints, len(values) == len(boundaries) + 1.
  """
  boundaries = list(boundaries)
  values = list(values)
  for i, b in enumerate(boundaries):
    if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 0:
      raise ValueError("boundaries[%d] must be a non-negative int, got %r."
                       % (i, b))
  if any(b >= c for b, c in zip(boundaries, boundaries[1:])):
    raise ValueError("boundaries must be strictly increasing, got %s."
                     % boundaries)
  for i, v in enumerate(values):
    _positive_int(v, "values[%d]" % i)
  if len(values) != len(boundaries) + 1:
    raise ValueError(
        "len(values) must be len(boundaries) + 1, got %d values for %d "
        "boundaries." % (len(values), len(boundaries)))
  boundaries = [int(b) for b in boundaries]
  values = [int(v) for v in values]

  def fn(step):
    table = tf.constant(values, tf.int32)
    if not boundaries:
      return tf.fill(tf.shape(step), table[0])
    edges = tf.constant(boundaries, tf.float64)
    index = tf.reduce_sum(
        tf.cast(step[..., None] > edges, tf.int32), axis=-1)
    return tf.gather(table, index)

  return _Schedule("piecewise_constant_batch_size_schedule", fn,
                   boundaries=tuple(boundaries), values=tuple(values))


def make_batch_size_list(schedule, num_steps):
  """[schedule(0), ..., schedule(num_steps - 1)] as Python ints.

  For planning and printing. `schedule` is any callable of an integer step
  returning an integer scalar (tensor or int); it is evaluated in a
  tf.function (eager programs) or in a fresh graph (TF1 graph mode), so it
  must not need tensors of the caller's graph.
  """
  if (isinstance(num_steps, bool) or
      not isinstance(num_steps, numbers.Integral) or num_steps < 0):
    raise ValueError("num_steps must be a non-negative int, got %r."
                     % (num_steps,))
  num_steps = int(num_steps)
  if num_steps == 0:
    return []

  def all_steps():
    return tf.map_fn(
        lambda s: tf.cast(tf.reshape(schedule(s), []), tf.int32),
        tf.range(num_steps, dtype=tf.int64),
        fn_output_signature=tf.TensorSpec([], tf.int32))

  if tf.executing_eagerly():
    sizes = tf.function(all_steps)().numpy()
  else:
    with tf.Graph().as_default():
      out = all_steps()
      with tf.compat.v1.Session() as sess:
        sizes = sess.run(out)
  return [int(s) for s in sizes]
