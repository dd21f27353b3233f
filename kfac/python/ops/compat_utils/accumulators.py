"""Variables that average what is added to them: AccumulatorVariable (plain
mean since the last reset) and MovingAverageVariable (weighted, decayed)."""

import tensorflow as tf

from kfac.python.ops.compat_utils import replication


def _make_variable(name, shape, dtype, initial):
  with tf.init_scope():
    if callable(initial):
      value = initial(shape, dtype)
    else:
      value = tf.fill(shape, tf.constant(initial, dtype))
    return tf.Variable(value, trainable=False, name=name)


def _as_dtype(value, dtype):
  """value in `dtype`; Python numbers directly (not rounded via float32)."""
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return tf.constant(value, dtype)
  return tf.cast(value, dtype)


def _zeros(shape, dtype):
  return tf.zeros(shape, dtype)


class AccumulatorVariable(object):
  """Accumulates values and returns their mean since the last reset.

  Args:
    name: name scope of the two variables (the sum and the count).
    shape: shape of the accumulated values.
    dtype: their dtype.

  The variables are created outside any trace, so the object can be made
  in a TF1 graph, eagerly, or inside a tf.function's first trace.
  """

  def __init__(self, name, shape, dtype):
    self._acc_var = _make_variable(name + "/acc_var", shape, dtype, 0)
    self._counter = _make_variable(name + "/counter", [], tf.float32, 0)

  def accumulate(self, value):
    """Adds `value` (same shape as the variable) to the sum; an op."""
    add = lambda var, val: var.assign_add(val)  # pylint: disable=g-long-lambda
    return tf.group(
        replication.smart_assign(self._counter, 1.0, assign_fn=add),
        replication.smart_assign(self._acc_var, value, assign_fn=add,
                                 force_cast=True))

  @property
  def value(self):
    """The mean of the values accumulated since the last reset (NaN when
    none were)."""
    return self._acc_var / tf.cast(self._counter, self._acc_var.dtype)

  def read_value_and_reset(self):
    """`value`, then a reset (in one op)."""
    value = self.value
    with tf.control_dependencies([value]):
      reset = self.reset()
    with tf.control_dependencies([reset]):
      return tf.identity(value)

  def reset(self):
    """Sets the sum and the count to zero; an op."""
    return tf.group(
        replication.smart_assign(self._acc_var,
                                 tf.zeros_like(self._acc_var)),
        replication.smart_assign(self._counter, tf.constant(0.0)))


class MovingAverageVariable(object):
  """A weighted moving average: `add_to_average(value, decay, weight)` sets
  var <- decay * var + weight * value and total <- decay * total + weight;
  `value` is var / total (zero-debiased) with `normalize_value`, else var.

  Args:
    name: name scope of the variables.
    shape, dtype: of the averaged values.
    initializer: (shape, dtype) -> initial value of the average's
      numerator, e.g. `tf.zeros_initializer()` (default zeros).
    normalize_value: divide by the total weight when reading `value`.
  """

  def __init__(self, name, shape, dtype, initializer=None,
               normalize_value=True):
    self._normalize_value = normalize_value
    init = _zeros if initializer is None else (
        lambda s, d: initializer(s, dtype=d))  # pylint: disable=g-long-lambda
    self._var = _make_variable(name + "/var", shape, dtype, init)
    self._total_weight = _make_variable(name + "/total_weight", [], dtype, 0)

  @property
  def dtype(self):
    return self._var.dtype.base_dtype

  @property
  def value(self):
    if self._normalize_value:
      return self._var / self._total_weight
    return tf.identity(self._var)

  def add_to_average(self, value, decay=1.0, weight=1.0):
    decay = _as_dtype(decay, self.dtype)
    weight = _as_dtype(weight, self.dtype)
    value = tf.cast(value, self.dtype)
    return tf.group(
        replication.smart_assign(self._var, decay * self._var + weight * value),
        replication.smart_assign(self._total_weight,
                                 decay * self._total_weight + weight))

  def reset(self):
    return tf.group(
        replication.smart_assign(self._var, tf.zeros_like(self._var)),
        replication.smart_assign(self._total_weight,
                                 tf.zeros_like(self._total_weight)))
