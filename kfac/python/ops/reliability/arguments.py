"""Checks of constructor arguments: a bad value fails at construction with
an error that names the argument, never later as a TensorFlow internal
error or a silently wrong run.

A Python number is checked now. A tensor, a variable or a callable (the
old library accepted them for learning rates, damping and momentum) cannot
be checked statically: `runtime_checks` builds `tf.debugging` assertions
that run with every step and name the argument.
"""

import numbers

import tensorflow as tf

from kfac.python.ops.tensors import utils


class Rule:
  """A range a hyperparameter must lie in: low <= value (< if low_open),
  value <= high (< if high_open); None: unbounded."""

  def __init__(self, low=None, high=None, low_open=False, high_open=False):
    self.low, self.high = low, high
    self.low_open, self.high_open = low_open, high_open

  def holds(self, value):
    if self.low is not None and (value <= self.low if self.low_open
                                 else value < self.low):
      return False
    if self.high is not None and (value >= self.high if self.high_open
                                  else value > self.high):
      return False
    return True

  def describe(self):
    parts = []
    if self.low is not None:
      parts.append("%s %r" % (">" if self.low_open else ">=", self.low))
    if self.high is not None:
      parts.append("%s %r" % ("<" if self.high_open else "<=", self.high))
    return " and ".join(parts)

  def assertion(self, name, owner, value):
    """A tf.debugging assertion of the rule on a tensor value."""
    value = tf.convert_to_tensor(value)
    checks = []
    message = "%s: %s must be %s" % (owner, name, self.describe())
    if self.low is not None:
      low = tf.constant(self.low, value.dtype)
      checks.append(tf.debugging.assert_greater(value, low, message=message)
                    if self.low_open else
                    tf.debugging.assert_greater_equal(value, low,
                                                      message=message))
    if self.high is not None:
      high = tf.constant(self.high, value.dtype)
      checks.append(tf.debugging.assert_less(value, high, message=message)
                    if self.high_open else
                    tf.debugging.assert_less_equal(value, high,
                                                   message=message))
    checks.append(tf.debugging.assert_all_finite(
        value, message="%s: %s is not finite" % (owner, name)))
    return checks


POSITIVE = Rule(low=0.0, low_open=True)
NON_NEGATIVE = Rule(low=0.0)
UNIT_INTERVAL = Rule(low=0.0, high=1.0)
MOMENTUM = Rule(low=0.0, high=1.0, high_open=True)
OPEN_UNIT_INTERVAL = Rule(low=0.0, high=1.0, low_open=True, high_open=True)


def is_number(value):
  return (isinstance(value, numbers.Real) and not isinstance(value, bool)) or (
      hasattr(value, "dtype") and getattr(value, "shape", None) == () and
      not tf.is_tensor(value) and not isinstance(value, tf.Variable))


def check(owner, name, value, rule, allow_none=False):
  """Checks a hyperparameter now when it is a number; returns it. Tensors,
  variables and callables pass (see runtime_checks)."""
  if value is None:
    if allow_none:
      return value
    raise ValueError("%s: %s is required (got None)." % (owner, name))
  if isinstance(value, bool):
    raise ValueError("%s: %s must be a number, got %r." % (owner, name,
                                                           value))
  if is_number(value):
    number = float(value)
    if number != number or number in (float("inf"), float("-inf")):
      raise ValueError("%s: %s must be finite, got %r." % (owner, name,
                                                           value))
    if not rule.holds(number):
      raise ValueError("%s: %s must be %s, got %r." %
                       (owner, name, rule.describe(), value))
    return value
  if isinstance(value, str):
    raise ValueError("%s: %s must be a number, a tensor, a variable or a "
                     "callable, got the string %r." % (owner, name, value))
  if not (callable(value) or utils.is_tensor_or_variable(value)):
    raise ValueError("%s: %s must be a number, a tensor, a variable or a "
                     "callable, got %r." % (owner, name, value))
  return value


def check_count(owner, name, value, minimum, allow_none=False):
  """An integer count >= minimum (Python int, or an integral float); returns
  it as an int."""
  if value is None and allow_none:
    return None
  if (isinstance(value, bool) or not isinstance(value, numbers.Real) or
      int(value) != value or value < minimum):
    raise ValueError("%s: %s must be an integer >= %d, got %r." %
                     (owner, name, minimum, value))
  return int(value)


def runtime_checks(owner, named_values):
  """Assertion ops for the (name, value, rule) whose value is a tensor, a
  variable or a callable (evaluated now); numbers were checked already."""
  ops = []
  for name, value, rule in named_values:
    if value is None or is_number(value):
      continue
    if callable(value) and not isinstance(value, tf.Variable):
      value = value()
    if value is None or is_number(value):
      continue
    ops.extend(rule.assertion(name, owner, value))
  return ops
