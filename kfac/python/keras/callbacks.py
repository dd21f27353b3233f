"""Keras callbacks that schedule an optimizer hyperparameter by step.

`PolynomialDecay` and `ExponentialDecay` set one attribute of
`model.optimizer` (named by the string `hyperparameter`: "learning_rate",
"damping", "momentum", "weight_decay_coeff", "norm_constraint", ...) from
the optimizer's step counter, at the start of every training batch:

    t = int(model.optimizer.iterations)       # steps taken so far
    if 0 < t - num_delay_steps <= num_decay_steps:
      setattr(model.optimizer, hyperparameter, schedule(t))

As in kfac 0.2.x, the callback sets nothing until the delay has passed (the
optimizer's own value is used until then, also at t = num_delay_steps,
where the schedule is init_value) nor after the decay has ended (the value
set last stays; a schedule without an end, ExponentialDecay with
decay_rate and final_value, sets it at every step after the delay). So a
second callback may schedule the same hyperparameter after the first one's
window. The schedule is a function of t only, so resuming training (a
second `fit`, a restored optimizer) continues where the counter is. The new value reaches
a compiled train step only if the attribute is backed by a variable (a
property whose setter assigns to a `tf.Variable` / `keras.Variable`, as for
`kfac.keras.optimizers.Kfac`'s `learning_rate`, `damping`, `momentum`,
`weight_decay_coeff`, `norm_constraint`, `weight_decay` (when given) and
every Keras optimizer's
`learning_rate`); a plain Python number attribute is baked into the traced
step, and the callbacks warn when they are asked to drive one.

Keras flavours: the callbacks derive from `tf.keras.callbacks.Callback` of
the flavour `tf.keras` resolves to (Keras 3 by default; `tf_keras` when
TF_USE_LEGACY_KERAS=1), and also carry the few private hooks `tf_keras`'s
`CallbackList` asks of a callback, so one instance works in the `fit` of
either flavour. `tf_keras` is imported only to read the step counter in a
TF1 graph (tf_keras's v1 engine, v2 behaviour disabled), where only it can
be training.
"""

import math
import numbers
import warnings

import numpy as np

__all__ = ["HyperparameterDecay", "PolynomialDecay", "ExponentialDecay"]


def _callback_base():
  """`Callback` of the Keras flavour that `tf.keras` resolves to."""
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return tf.keras.callbacks.Callback
  except (ImportError, AttributeError):
    # TF_USE_LEGACY_KERAS=1 without tf_keras installed: tf.keras is broken,
    # but Keras 3 models still work.
    import keras  # pylint: disable=g-import-not-at-top
    return keras.callbacks.Callback


_Callback = _callback_base()


def _get_value(value):
  """The numpy value of an int, numpy value, tensor or (Keras) variable, also
  in a TF1 graph (tf_keras with v2 behaviour disabled: read in the Keras
  session)."""
  if hasattr(value, "numpy"):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    if tf.executing_eagerly() or not isinstance(value, (tf.Tensor,
                                                        tf.Variable)):
      return np.asarray(value.numpy())
    # Only tf_keras trains in a TF1 graph (Keras 3 is eager/tf.function).
    import tf_keras  # pylint: disable=g-import-not-at-top
    return np.asarray(tf_keras.backend.get_value(value))
  return np.asarray(value)


def _to_int(value):
  """A Python int from an int, numpy value, tensor or (Keras) variable."""
  return int(_get_value(value))


def _check_number(name, value, positive=False):
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError("%s must be a real number, got %r." % (name, value))
  value = float(value)
  if not math.isfinite(value):
    raise ValueError("%s must be finite, got %r." % (name, value))
  if positive and value <= 0:
    raise ValueError("%s must be > 0, got %r." % (name, value))
  return value


def _check_int(name, value, minimum):
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise ValueError("%s must be an integer, got %r." % (name, value))
  value = int(value)
  if value < minimum:
    raise ValueError("%s must be >= %d, got %d." % (name, minimum, value))
  return value


class HyperparameterDecay(_Callback):
  """Base class: sets `optimizer.<hyperparameter>` from its step counter.

  Subclasses implement `value_at(step)` and `decay_steps()`. On
  `on_train_begin` the optimizer is checked (it must have the attribute and
  an `iterations` counter, else ValueError); at the start of training, of
  every epoch and of every training batch, with t = int(optimizer.iterations)
  and `applies_at(t)` (after the delay, until the decay ends: kfac 0.2.x),
  `value_at(t)` is set with `setattr`. With `verbose > 0` the optimizer's
  value is printed at the start of every epoch; at the end of every epoch
  it is added to the epoch logs under the hyperparameter's name (so
  `History` records it).
  """

  # What tf_keras's CallbackList reads from every callback (Keras 3 ignores
  # them), so an instance also works in the other flavour's `fit`.
  _supports_tf_logs = False
  _chief_worker_only = None

  def __init__(self, hyperparameter, num_delay_steps=0, verbose=0):
    super().__init__()
    if not isinstance(hyperparameter, str) or not hyperparameter:
      raise ValueError("hyperparameter must be the name of an optimizer "
                       "attribute (a non-empty string), got %r." %
                       (hyperparameter,))
    self._hyperparameter = hyperparameter
    self._num_delay_steps = _check_int("num_delay_steps", num_delay_steps, 0)
    self.verbose = int(verbose)
    self._last_value = None

  # -- the schedule ---------------------------------------------------------

  @property
  def hyperparameter(self):
    return self._hyperparameter

  def value_at(self, step):
    """The schedule's value at optimizer step `step` (an int >= 0); it is
    set only where `applies_at(step)`."""
    raise NotImplementedError

  def decay_steps(self):
    """Steps the decay lasts after the delay (None: no end)."""
    raise NotImplementedError

  def applies_at(self, step):
    """Whether the callback sets the value at optimizer step `step`: after
    the delay (step > num_delay_steps) until the decay has ended
    (step <= num_delay_steps + decay_steps()), as kfac 0.2.x did."""
    s = int(step) - self._num_delay_steps
    n = self.decay_steps()
    return s > 0 and (n is None or s <= n)

  def get_config(self):
    """The constructor arguments: `type(self)(**get_config())` is a copy."""
    raise NotImplementedError

  # -- Keras hooks ----------------------------------------------------------

  def _optimizer(self):
    model = self.model
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
      raise ValueError("%s(%r) needs a compiled model with an optimizer." %
                       (type(self).__name__, self._hyperparameter))
    return optimizer

  def _current_value(self, optimizer):
    """The optimizer's value of the hyperparameter as a float (None when it
    is not a number, e.g. a learning-rate schedule object)."""
    try:
      return float(_get_value(getattr(optimizer, self._hyperparameter)))
    except (TypeError, ValueError):
      return None

  def _set_value(self):
    """Sets the schedule's value where it applies; returns the optimizer's
    value."""
    optimizer = self._optimizer()
    step = _to_int(optimizer.iterations)
    if self.applies_at(step):
      value = self.value_at(step)
      setattr(optimizer, self._hyperparameter, value)
    else:
      value = self._current_value(optimizer)
    self._last_value = value
    return value

  def on_train_begin(self, logs=None):
    optimizer = self._optimizer()
    name = type(optimizer).__name__
    if not hasattr(optimizer, self._hyperparameter):
      raise ValueError(
          "%s cannot schedule %r: Optimizer must have a \"%s\" attribute; "
          "%s has no attribute %r." % (type(self).__name__,
                                       self._hyperparameter,
                                       self._hyperparameter, name,
                                       self._hyperparameter))
    if not hasattr(optimizer, "iterations"):
      raise ValueError(
          "%s needs the optimizer's step counter: Optimizer must have a "
          "\"iterations\" attribute; %s has no 'iterations' attribute." %
          (type(self).__name__, name))
    if not isinstance(getattr(type(optimizer), self._hyperparameter, None),
                      property):
      current = getattr(optimizer, self._hyperparameter)
      if isinstance(current, (numbers.Number, np.number)):
        warnings.warn(
            "%s: %s.%s is a plain Python number, not a variable; a train "
            "step that was already traced keeps using the old value." %
            (type(self).__name__, name, self._hyperparameter), stacklevel=2)
    self._set_value()

  def on_epoch_begin(self, epoch, logs=None):
    value = self._set_value()
    if self.verbose > 0 and value is not None:
      print("Epoch %05d: %s is %.6g." %
            (epoch + 1, self._hyperparameter, value))

  def on_train_batch_begin(self, batch, logs=None):
    self._set_value()

  def on_epoch_end(self, epoch, logs=None):
    if logs is not None and self._last_value is not None:
      logs[self._hyperparameter] = self._last_value

  # tf_keras's CallbackList asks which batch hooks a callback implements.
  def _implements_train_batch_hooks(self):
    return True

  def _implements_test_batch_hooks(self):
    return False

  def _implements_predict_batch_hooks(self):
    return False


class PolynomialDecay(HyperparameterDecay):
  """Polynomial decay of an optimizer hyperparameter over optimizer steps.

  At optimizer step t (the optimizer's `iterations` when a training batch
  begins):

      s = clip(t - num_delay_steps, 0, num_decay_steps)
      value = (init_value - final_value) * (1 - s / num_decay_steps)**power
              + final_value

  so the schedule is `init_value` until the delay ends, moves to
  `final_value` over `num_decay_steps` steps (linearly for power=1), and
  stays there. The callback sets it for num_delay_steps < t <=
  num_delay_steps + num_decay_steps (kfac 0.2.x): build the optimizer with
  `init_value`. `final_value` may be larger than `init_value` (a polynomial
  increase).
  """

  def __init__(self, hyperparameter, init_value, final_value, power=1.0,
               num_decay_steps=None, num_delay_steps=0, verbose=0):
    """Creates the callback.

    Args:
      hyperparameter: name of the optimizer attribute to set, e.g.
        "learning_rate" or "damping".
      init_value: the schedule's value at the start of the decay (the
        optimizer's own value is used until the delay has passed).
      final_value: value at the end of the decay (kept afterwards).
      power: exponent of the polynomial, > 0.
      num_decay_steps: number of steps the decay lasts, a positive int
        (required; it follows `power` to keep the original argument order).
      num_delay_steps: steps to wait before decaying, >= 0 (the callback
        sets nothing until then).
      verbose: if > 0, print the value at the start of every epoch.

    Raises:
      ValueError: on a missing or invalid argument.
    """
    super().__init__(hyperparameter, num_delay_steps=num_delay_steps,
                     verbose=verbose)
    self._init_value = _check_number("init_value", init_value)
    self._final_value = _check_number("final_value", final_value)
    self._power = _check_number("power", power, positive=True)
    if num_decay_steps is None:
      raise ValueError("PolynomialDecay needs num_decay_steps.")
    self._num_decay_steps = _check_int("num_decay_steps", num_decay_steps, 1)

  def decay_steps(self):
    return self._num_decay_steps

  def value_at(self, step):
    n = self._num_decay_steps
    s = min(max(int(step) - self._num_delay_steps, 0), n)
    if s == n:
      return self._final_value
    return ((self._init_value - self._final_value) * (1.0 - s / n)**self._power
            + self._final_value)

  def get_config(self):
    return {"hyperparameter": self._hyperparameter,
            "init_value": self._init_value,
            "final_value": self._final_value,
            "power": self._power,
            "num_decay_steps": self._num_decay_steps,
            "num_delay_steps": self._num_delay_steps,
            "verbose": self.verbose}


class ExponentialDecay(HyperparameterDecay):
  """Exponential decay of an optimizer hyperparameter over optimizer steps.

  At optimizer step t, with s = max(t - num_delay_steps, 0), the schedule is
  given by exactly two of final_value, decay_rate and num_decay_steps (as
  in kfac 0.2.x; one or all three is a ValueError):

  (a) `decay_rate` with `num_decay_steps` or `final_value`:
          value = init_value * decay_rate**s
      with s capped at `num_decay_steps` (the value stops changing after
      that many steps), or the value never passing `final_value` in the
      direction of the decay (max(value, final_value) for decay_rate < 1,
      min for decay_rate > 1; decay_rate = 1 keeps init_value). A
      final_value on the wrong side of init_value for the direction of
      decay_rate is a ValueError.
  (b) `final_value` and `num_decay_steps` given, no `decay_rate`:
          value = init_value * (final_value / init_value)**(s' / num_decay_steps)
      with s' = min(s, num_decay_steps): the rate
      (final_value / init_value)**(1 / num_decay_steps) per step brings the
      value to `final_value` exactly at the end of the decay; it stays
      there.

  Values must be > 0. The callback sets the value for t > num_delay_steps
  (kfac 0.2.x: build the optimizer with `init_value`) and, where
  `num_decay_steps` is given, up to t = num_delay_steps + num_decay_steps
  (the value set last stays afterwards).
  """

  def __init__(self, hyperparameter, init_value, final_value=None,
               decay_rate=None, num_decay_steps=None, num_delay_steps=0,
               verbose=0):
    """Creates the callback.

    Args:
      hyperparameter: name of the optimizer attribute to set.
      init_value: the schedule's value at the start of the decay, > 0
        (the optimizer's own value is used until the delay has passed).
      final_value: the bound (mode a) or the value at the end (mode b), > 0.
      decay_rate: factor per step, > 0 (mode a).
      num_decay_steps: positive int: steps the decay lasts.
      num_delay_steps: steps to wait before decaying, >= 0 (the callback
        sets nothing until then).
      verbose: if > 0, print the value at the start of every epoch.

    Raises:
      ValueError: on an invalid argument or combination of arguments.
    """
    super().__init__(hyperparameter, num_delay_steps=num_delay_steps,
                     verbose=verbose)
    self._init_value = _check_number("init_value", init_value, positive=True)
    self._final_value = (None if final_value is None else
                         _check_number("final_value", final_value,
                                       positive=True))
    self._decay_rate = (None if decay_rate is None else
                        _check_number("decay_rate", decay_rate, positive=True))
    self._num_decay_steps = (None if num_decay_steps is None else
                             _check_int("num_decay_steps", num_decay_steps, 1))
    given = [v is not None for v in (self._final_value, self._decay_rate,
                                     self._num_decay_steps)]
    if sum(given) != 2:
      raise ValueError(
          "ExponentialDecay: you must specify exactly two of final_value, "
          "decay_rate, and num_decay_steps; got final_value=%r, "
          "decay_rate=%r, num_decay_steps=%r." %
          (final_value, decay_rate, num_decay_steps))
    if self._decay_rate is not None and self._final_value is not None:
      if ((self._decay_rate < 1 and self._final_value > self._init_value) or
          (self._decay_rate > 1 and self._final_value < self._init_value)):
        raise ValueError(
            "ExponentialDecay: decay_rate=%r moves the value away from "
            "final_value=%r (init_value=%r)." %
            (decay_rate, final_value, init_value))

  def decay_steps(self):
    return self._num_decay_steps

  def value_at(self, step):
    s = max(int(step) - self._num_delay_steps, 0)
    if self._num_decay_steps is not None:
      s = min(s, self._num_decay_steps)
    init, final = self._init_value, self._final_value
    if self._decay_rate is None:  # mode (b)
      n = self._num_decay_steps
      if s == n:
        return final
      return init * (final / init)**(s / n)
    value = init * self._decay_rate**s
    if final is not None and self._decay_rate < 1:
      value = max(value, final)
    elif final is not None and self._decay_rate > 1:
      value = min(value, final)
    return value

  def get_config(self):
    return {"hyperparameter": self._hyperparameter,
            "init_value": self._init_value,
            "final_value": self._final_value,
            "decay_rate": self._decay_rate,
            "num_decay_steps": self._num_decay_steps,
            "num_delay_steps": self._num_delay_steps,
            "verbose": self.verbose}
