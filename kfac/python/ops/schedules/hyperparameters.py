"""Hyperparameter schedules: functions of the optimizer's step number.

As in kfac-jax, the learning rate, momentum and damping of K-FAC can be
schedules instead of constants. A schedule is a callable `fn(step)`:

- `step` is a Python int, a numpy integer, or an integer scalar tensor (for
  example an optimizer's int64 step counter read inside a tf.function or in a
  TF1 graph). Float steps are accepted too, and so are arrays of steps (the
  value is computed elementwise, handy for plotting a schedule).
- The value is computed in float64 and returned as a float64 tensor, or in
  the `dtype=` given to the schedule's constructor.

Every schedule is a small object with a readable `repr` (the call that builds
it), a `name` and a `config` dict, so that
`construct_schedule(s.name, **s.config)` builds an equal schedule. Steps
before a schedule's `begin_step` get its initial value; after the end of a
decay the value stays at the end value.
"""

import inspect
import math
import numbers

import numpy as np
import tensorflow as tf

__all__ = [
    "Schedule",
    "constant_schedule",
    "polynomial_schedule",
    "exponential_schedule",
    "piecewise_constant_schedule",
    "cosine_schedule",
    "linear_warmup_schedule",
    "construct_schedule",
    "SCHEDULE_NAMES",
]

_F64 = tf.float64


# ----------------------------------------------------------- validation
def _number(fn_name, arg, value):
  """A finite real number (not a bool, not a tensor) as a Python float."""
  if (isinstance(value, (bool, np.bool_)) or
      not isinstance(value, numbers.Real)):
    raise ValueError("%s: %s must be a real number, got %r." %
                     (fn_name, arg, value))
  value = float(value)
  if not math.isfinite(value):
    raise ValueError("%s: %s must be finite, got %r." % (fn_name, arg, value))
  return value


def _integer(fn_name, arg, value, minimum):
  """An integer >= minimum (an integral float such as 1e3 is accepted)."""
  if (isinstance(value, (bool, np.bool_)) or
      not isinstance(value, numbers.Real) or
      not math.isfinite(float(value)) or not float(value).is_integer()):
    raise ValueError("%s: %s must be an integer, got %r." %
                     (fn_name, arg, value))
  value = int(value)
  if value < minimum:
    raise ValueError("%s: %s must be %s, got %d." %
                     (fn_name, arg,
                      "positive" if minimum == 1 else ">= %d" % minimum,
                      value))
  return value


def _float_dtype(fn_name, dtype):
  try:
    dtype = tf.as_dtype(dtype)
  except TypeError as e:
    raise ValueError("%s: dtype must be a floating dtype, got %r." %
                     (fn_name, dtype)) from e
  if not dtype.is_floating:
    raise ValueError("%s: dtype must be a floating dtype, got %s." %
                     (fn_name, dtype.name))
  return dtype


def _step_as_float64(step, schedule):
  """The step (number, numpy value, tensor or variable) as a float64 tensor."""
  if isinstance(step, (bool, np.bool_)):
    raise ValueError("%r: the step must be an integer, got %r." %
                     (schedule, step))
  if isinstance(step, (numbers.Real, np.ndarray, list, tuple)):
    array = np.asarray(step)
    if array.dtype.kind not in "iuf":
      raise ValueError("%r: the step must be an integer, got %r." %
                       (schedule, step))
    return tf.constant(array.astype(np.float64), _F64)
  step = tf.convert_to_tensor(step)
  if not (step.dtype.is_integer or step.dtype.is_floating):
    raise ValueError("%r: the step must be an integer tensor, got dtype %s." %
                     (schedule, step.dtype.name))
  return tf.cast(step, _F64)


# ------------------------------------------------------------ base class
class Schedule:
  """Base class: `schedule(step)` is the value at `step`, a tensor.

  Subclasses set `name` and implement `_value(step)`, which gets the step as
  a float64 tensor and returns the float64 value.
  """

  name = None

  def __init__(self, config, dtype=_F64):
    self._config = dict(config)
    self.dtype = _float_dtype("%s_schedule" % self.name, dtype)
    if self.dtype != _F64:
      self._config["dtype"] = self.dtype.name

  @property
  def config(self):
    """The keyword arguments of `construct_schedule(self.name, ...)`."""
    return dict(self._config)

  def __call__(self, step):
    with tf.name_scope("%s_schedule" % self.name):
      value = self._value(_step_as_float64(step, self))
      return tf.cast(value, self.dtype)

  def _value(self, step):
    raise NotImplementedError

  def __repr__(self):
    args = ", ".join("%s=%r" % (k, v) for k, v in self._config.items())
    return "%s_schedule(%s)" % (self.name, args)

  def __eq__(self, other):
    return (type(self) is type(other) and  # pylint: disable=unidiomatic-typecheck
            self._config == other._config)  # pylint: disable=protected-access

  def __hash__(self):
    return hash((type(self), repr(self)))


def _const(x):
  return tf.constant(x, _F64)


def _progress(step, begin_step, decay_steps):
  """clip(step - begin_step, 0, decay_steps) / decay_steps, in [0, 1]."""
  t = tf.clip_by_value(step - _const(begin_step), _const(0.0),
                       _const(decay_steps))
  return t / _const(decay_steps)


# --------------------------------------------------------------- schedules
class _Constant(Schedule):
  name = "constant"

  def __init__(self, value, dtype=_F64):
    self._v = _number("constant_schedule", "value", value)
    super().__init__({"value": self._v}, dtype)

  def _value(self, step):
    return tf.fill(tf.shape(step), _const(self._v))


def constant_schedule(value, dtype=_F64):
  """`value` at every step."""
  return _Constant(value, dtype)


class _Polynomial(Schedule):
  name = "polynomial"

  def __init__(self, init_value, end_value, decay_steps, power=1.0,
               begin_step=0, dtype=_F64):
    fn = "polynomial_schedule"
    self._init = _number(fn, "init_value", init_value)
    self._end = _number(fn, "end_value", end_value)
    self._steps = _integer(fn, "decay_steps", decay_steps, 1)
    self._power = _number(fn, "power", power)
    if self._power <= 0:
      raise ValueError("%s: power must be positive, got %r." %
                       (fn, self._power))
    self._begin = _integer(fn, "begin_step", begin_step, 0)
    super().__init__(
        {"init_value": self._init, "end_value": self._end,
         "decay_steps": self._steps, "power": self._power,
         "begin_step": self._begin}, dtype)

  def _value(self, step):
    frac = _progress(step, self._begin, self._steps)
    return (_const(self._end) + _const(self._init - self._end) *
            tf.pow(_const(1.0) - frac, _const(self._power)))


def polynomial_schedule(init_value, end_value, decay_steps, power=1.0,
                        begin_step=0, dtype=_F64):
  """Polynomial decay from `init_value` to `end_value`.

  With s = clip(step - begin_step, 0, decay_steps):
  value = end_value + (init_value - end_value) * (1 - s / decay_steps)**power.
  `init_value` before `begin_step`, `end_value` from
  `begin_step + decay_steps` on (linear for power=1; end_value > init_value
  gives an increase).
  """
  return _Polynomial(init_value, end_value, decay_steps, power, begin_step,
                     dtype)


class _Exponential(Schedule):
  name = "exponential"

  def __init__(self, init_value, decay_rate, decay_steps, end_value=None,
               staircase=False, begin_step=0, dtype=_F64):
    fn = "exponential_schedule"
    self._init = _number(fn, "init_value", init_value)
    if self._init <= 0:
      raise ValueError("%s: init_value must be positive, got %r." %
                       (fn, self._init))
    self._rate = _number(fn, "decay_rate", decay_rate)
    if self._rate <= 0:
      raise ValueError("%s: decay_rate must be positive, got %r." %
                       (fn, self._rate))
    self._steps = _integer(fn, "decay_steps", decay_steps, 1)
    self._end = None
    if end_value is not None:
      self._end = _number(fn, "end_value", end_value)
      if self._end <= 0:
        raise ValueError("%s: end_value must be positive, got %r." %
                         (fn, self._end))
      if ((self._rate < 1 and self._end > self._init) or
          (self._rate > 1 and self._end < self._init)):
        raise ValueError(
            "%s: end_value=%r is never reached from init_value=%r with "
            "decay_rate=%r (it must be %s init_value)." %
            (fn, self._end, self._init, self._rate,
             "<=" if self._rate < 1 else ">="))
    if not isinstance(staircase, (bool, np.bool_)):
      raise ValueError("%s: staircase must be a bool, got %r." %
                       (fn, staircase))
    self._staircase = bool(staircase)
    self._begin = _integer(fn, "begin_step", begin_step, 0)
    super().__init__(
        {"init_value": self._init, "decay_rate": self._rate,
         "decay_steps": self._steps, "end_value": self._end,
         "staircase": self._staircase, "begin_step": self._begin}, dtype)

  def _value(self, step):
    t = tf.maximum(step - _const(self._begin), _const(0.0))
    exponent = t / _const(self._steps)
    if self._staircase:
      exponent = tf.floor(exponent)
    value = _const(self._init) * tf.pow(_const(self._rate), exponent)
    if self._end is not None:
      if self._rate < 1:
        value = tf.maximum(value, _const(self._end))
      elif self._rate > 1:
        value = tf.minimum(value, _const(self._end))
    return value


def exponential_schedule(init_value, decay_rate, decay_steps, end_value=None,
                         staircase=False, begin_step=0, dtype=_F64):
  """Exponential decay: init_value * decay_rate**(s / decay_steps).

  s = max(step - begin_step, 0) (floor(s / decay_steps) with staircase). With
  `end_value` the value never passes it: a floor when decay_rate < 1, a
  ceiling when decay_rate > 1. init_value, decay_rate and end_value must be
  positive.
  """
  return _Exponential(init_value, decay_rate, decay_steps, end_value,
                      staircase, begin_step, dtype)


class _PiecewiseConstant(Schedule):
  name = "piecewise_constant"

  def __init__(self, boundaries, values, dtype=_F64):
    fn = "piecewise_constant_schedule"
    if (isinstance(boundaries, (str, bytes)) or
        not isinstance(boundaries, (list, tuple, np.ndarray))):
      raise ValueError("%s: boundaries must be a list of integers, got %r." %
                       (fn, boundaries))
    if (isinstance(values, (str, bytes)) or
        not isinstance(values, (list, tuple, np.ndarray))):
      raise ValueError("%s: values must be a list of numbers, got %r." %
                       (fn, values))
    self._bounds = tuple(_integer(fn, "boundaries[%d]" % i, b, 0)
                         for i, b in enumerate(boundaries))
    self._values = tuple(_number(fn, "values[%d]" % i, v)
                         for i, v in enumerate(values))
    if len(self._values) != len(self._bounds) + 1:
      raise ValueError(
          "%s: needs one more value than boundaries, got %d boundaries and "
          "%d values." % (fn, len(self._bounds), len(self._values)))
    for i in range(1, len(self._bounds)):
      if self._bounds[i] <= self._bounds[i - 1]:
        raise ValueError("%s: boundaries must be strictly increasing, got %r."
                         % (fn, list(self._bounds)))
    super().__init__({"boundaries": list(self._bounds),
                      "values": list(self._values)}, dtype)

  def _value(self, step):
    values = tf.constant(self._values, _F64)
    if not self._bounds:
      return tf.fill(tf.shape(step), values[0])
    bounds = tf.constant(self._bounds, _F64)
    # index = number of boundaries <= step.
    index = tf.reduce_sum(
        tf.cast(step[..., tf.newaxis] >= bounds, tf.int32), axis=-1)
    return tf.gather(values, index)


def piecewise_constant_schedule(boundaries, values, dtype=_F64):
  """values[i] for boundaries[i-1] <= step < boundaries[i].

  values[0] before boundaries[0], values[-1] from boundaries[-1] on;
  `values` has one more entry than `boundaries`, which are strictly
  increasing integers >= 0.
  """
  return _PiecewiseConstant(boundaries, values, dtype)


class _Cosine(Schedule):
  name = "cosine"

  def __init__(self, init_value, decay_steps, end_value=0.0, begin_step=0,
               dtype=_F64):
    fn = "cosine_schedule"
    self._init = _number(fn, "init_value", init_value)
    self._steps = _integer(fn, "decay_steps", decay_steps, 1)
    self._end = _number(fn, "end_value", end_value)
    self._begin = _integer(fn, "begin_step", begin_step, 0)
    super().__init__(
        {"init_value": self._init, "decay_steps": self._steps,
         "end_value": self._end, "begin_step": self._begin}, dtype)

  def _value(self, step):
    frac = _progress(step, self._begin, self._steps)
    cosine = _const(0.5) * (_const(1.0) + tf.cos(_const(math.pi) * frac))
    return _const(self._end) + _const(self._init - self._end) * cosine


def cosine_schedule(init_value, decay_steps, end_value=0.0, begin_step=0,
                    dtype=_F64):
  """Half-cosine decay from `init_value` to `end_value`.

  With s = clip(step - begin_step, 0, decay_steps):
  value = end_value + (init_value - end_value) * (1 + cos(pi s / decay_steps)) / 2.
  """
  return _Cosine(init_value, decay_steps, end_value, begin_step, dtype)


class _LinearWarmup(Schedule):
  name = "linear_warmup"

  def __init__(self, warmup_steps, peak_value, after=None, init_value=0.0,
               dtype=_F64):
    fn = "linear_warmup_schedule"
    self._warmup = _integer(fn, "warmup_steps", warmup_steps, 0)
    self._peak = _number(fn, "peak_value", peak_value)
    self._init = _number(fn, "init_value", init_value)
    if isinstance(after, dict):
      after = dict(after)
      if "name" not in after:
        raise ValueError("%s: a dict `after` needs a 'name' key (the "
                         "construct_schedule arguments), got %r." %
                         (fn, after))
      after = construct_schedule(**after)
    if after is not None and not callable(after):
      raise ValueError("%s: after must be a schedule (a callable of the "
                       "step), a dict of construct_schedule arguments or "
                       "None, got %r." % (fn, after))
    self._after = after
    super().__init__(
        {"warmup_steps": self._warmup, "peak_value": self._peak,
         "after": self._after, "init_value": self._init}, dtype)

  def __call__(self, step):
    if self._after is None:
      return super().__call__(step)
    with tf.name_scope("linear_warmup_schedule"):
      float_step = _step_as_float64(step, self)
      warm = self._warm(float_step)
      if self._warmup == 0:
        later_step = step
      else:
        # The step handed on keeps its type (an integer tensor stays one).
        if isinstance(step, (numbers.Real, np.ndarray, list, tuple)):
          later_step = np.maximum(np.asarray(step) - self._warmup, 0)
        else:
          step_t = tf.convert_to_tensor(step)
          later_step = tf.maximum(
              step_t - tf.cast(self._warmup, step_t.dtype),
              tf.zeros([], step_t.dtype))
      later = tf.cast(self._after(later_step), _F64)
      if self._warmup == 0:
        value = later + tf.zeros_like(float_step)
      else:
        value = tf.where(float_step < _const(self._warmup), warm, later)
      return tf.cast(value, self.dtype)

  def _warm(self, step):
    if self._warmup == 0:
      return tf.fill(tf.shape(step), _const(self._peak))
    frac = _progress(step, 0, self._warmup)
    return _const(self._init) + _const(self._peak - self._init) * frac

  def _value(self, step):
    return self._warm(step)


def linear_warmup_schedule(warmup_steps, peak_value, after=None,
                           init_value=0.0, dtype=_F64):
  """Linear warm-up from `init_value` to `peak_value` over `warmup_steps`.

  For step < warmup_steps: init_value + (peak_value - init_value) *
  max(step, 0) / warmup_steps. From step warmup_steps on: `after(step -
  warmup_steps)` when `after` is a schedule (any callable of the step; a
  dict of `construct_schedule` arguments is built first), else peak_value.
  """
  return _LinearWarmup(warmup_steps, peak_value, after, init_value, dtype)


# -------------------------------------------------------------- by name
_CONSTRUCTORS = {
    "constant": constant_schedule,
    "polynomial": polynomial_schedule,
    "exponential": exponential_schedule,
    "piecewise_constant": piecewise_constant_schedule,
    "cosine": cosine_schedule,
    "linear_warmup": linear_warmup_schedule,
}
SCHEDULE_NAMES = tuple(_CONSTRUCTORS)


def construct_schedule(name, **kwargs):
  """The schedule `name` ("constant", "polynomial", "exponential",
  "piecewise_constant", "cosine", "linear_warmup") built from `kwargs`, the
  arguments of the matching `<name>_schedule` function."""
  if name not in _CONSTRUCTORS:
    raise ValueError("Unknown schedule %r; valid names are %s." %
                     (name, ", ".join(repr(n) for n in SCHEDULE_NAMES)))
  constructor = _CONSTRUCTORS[name]
  signature = inspect.signature(constructor)
  try:
    signature.bind(**kwargs)
  except TypeError as e:
    raise ValueError("construct_schedule(%r, ...): %s; the arguments of %s "
                     "are %s." % (name, e, constructor.__name__,
                                  ", ".join(signature.parameters))) from e
  return constructor(**kwargs)
