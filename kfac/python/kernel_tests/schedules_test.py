"""Tests of kfac.python.ops.schedules.hyperparameters (hyperparameter schedules of the step).

Every schedule is compared with its formula written here in numpy float64
(never kfac code), at steps before, at and after its boundaries, with the
step given as a Python int, a numpy integer, an int32/int64 tensor (eager),
an int64 tf.Variable read inside one tf.function, and an int64 variable in a
TF1 Graph + Session. Tolerance: float64 values agree to 1e-12 (absolute and
relative); float32 outputs to float32 rounding (1e-6 relative).
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from kfac.python.ops.schedules import hyperparameters as schedules

TOL = 1e-12


# ------------------------------------------------- numpy reference formulas
def np_polynomial(step, init, end, decay_steps, power=1.0, begin=0):
  s = min(max(step - begin, 0), decay_steps)
  return end + (init - end) * (1.0 - s / decay_steps) ** power


def np_exponential(step, init, rate, decay_steps, end=None, staircase=False,
                   begin=0):
  p = max(step - begin, 0) / decay_steps
  if staircase:
    p = math.floor(p)
  value = init * rate ** p
  if end is not None:
    value = max(value, end) if rate < 1 else min(value, end)
  return value


def np_piecewise(step, boundaries, values):
  for b, v in zip(boundaries, values):
    if step < b:
      return v
  return values[-1]


def np_cosine(step, init, decay_steps, end=0.0, begin=0):
  s = min(max(step - begin, 0), decay_steps)
  return end + (init - end) * 0.5 * (1.0 + math.cos(math.pi * s / decay_steps))


def np_warmup(step, warmup, peak, after=None, init=0.0):
  if step < warmup:
    return init + (peak - init) * max(step, 0) / warmup
  return peak if after is None else after(step - warmup)


# (id, schedule, reference, steps)
CASES = [
    ("constant", lambda: schedules.constant_schedule(0.37),
     lambda t: 0.37, [0, 1, 5, 1000]),
    ("polynomial_linear",
     lambda: schedules.polynomial_schedule(1.0, 0.1, 10),
     lambda t: np_polynomial(t, 1.0, 0.1, 10), [0, 1, 3, 9, 10, 11, 50]),
    ("polynomial_power_begin",
     lambda: schedules.polynomial_schedule(0.5, 2.0, 8, power=2.5,
                                           begin_step=3),
     lambda t: np_polynomial(t, 0.5, 2.0, 8, 2.5, 3),
     [0, 2, 3, 4, 7, 10, 11, 12, 100]),
    ("exponential",
     lambda: schedules.exponential_schedule(0.8, 0.3, 7),
     lambda t: np_exponential(t, 0.8, 0.3, 7), [0, 1, 6, 7, 8, 20, 70]),
    ("exponential_staircase_end_begin",
     lambda: schedules.exponential_schedule(1.0, 0.5, 3, end_value=0.2,
                                            staircase=True, begin_step=2),
     lambda t: np_exponential(t, 1.0, 0.5, 3, 0.2, True, 2),
     [0, 1, 2, 4, 5, 7, 8, 10, 11, 13, 14, 100]),
    ("exponential_growth_capped",
     lambda: schedules.exponential_schedule(0.1, 1.5, 2, end_value=0.5),
     lambda t: np_exponential(t, 0.1, 1.5, 2, 0.5), [0, 1, 2, 5, 7, 8, 40]),
    ("piecewise_constant",
     lambda: schedules.piecewise_constant_schedule([3, 7, 12],
                                                   [1.0, 0.5, 0.25, 0.05]),
     lambda t: np_piecewise(t, [3, 7, 12], [1.0, 0.5, 0.25, 0.05]),
     [0, 2, 3, 4, 6, 7, 8, 11, 12, 13, 500]),
    ("piecewise_no_boundaries",
     lambda: schedules.piecewise_constant_schedule([], [0.7]),
     lambda t: 0.7, [0, 9]),
    ("cosine",
     lambda: schedules.cosine_schedule(2.0, 9),
     lambda t: np_cosine(t, 2.0, 9), [0, 1, 4, 5, 8, 9, 10, 99]),
    ("cosine_end_begin",
     lambda: schedules.cosine_schedule(1.0, 6, end_value=0.1, begin_step=4),
     lambda t: np_cosine(t, 1.0, 6, 0.1, 4), [0, 3, 4, 5, 7, 9, 10, 11, 30]),
    ("linear_warmup_constant",
     lambda: schedules.linear_warmup_schedule(4, 0.9),
     lambda t: np_warmup(t, 4, 0.9), [0, 1, 2, 3, 4, 5, 100]),
    ("linear_warmup_then_cosine",
     lambda: schedules.linear_warmup_schedule(
         5, 1.0, after=schedules.cosine_schedule(1.0, 10, end_value=0.01),
         init_value=0.1),
     lambda t: np_warmup(t, 5, 1.0, lambda s: np_cosine(s, 1.0, 10, 0.01),
                         0.1),
     [0, 1, 4, 5, 6, 10, 14, 15, 16, 200]),
    ("linear_warmup_zero_then_piecewise",
     lambda: schedules.linear_warmup_schedule(
         0, 1.0, after=schedules.piecewise_constant_schedule([2], [3., 4.])),
     lambda t: np_piecewise(t, [2], [3., 4.]), [0, 1, 2, 3]),
]
CASE_PARAMS = [pytest.param(c[1], c[2], c[3], id=c[0]) for c in CASES]


def _check(got, want, dtype=np.float64):
  assert got.dtype == dtype
  tol = TOL if dtype == np.float64 else 1e-6
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("make, ref, steps", CASE_PARAMS)
def test_values_eager(make, ref, steps):
  sched = make()
  for t in steps:
    want = ref(t)
    for step in (t, np.int64(t), np.int32(t), tf.constant(t, tf.int32),
                 tf.constant(t, tf.int64)):
      value = sched(step)
      assert isinstance(value, tf.Tensor) and value.shape == ()
      _check(value.numpy(), want)


@pytest.mark.parametrize("make, ref, steps", CASE_PARAMS)
def test_values_tf_function_variable_step(make, ref, steps):
  sched = make()
  counter = tf.Variable(0, dtype=tf.int64)

  @tf.function
  def value_and_increment():
    value = sched(counter)
    with tf.control_dependencies([value]):
      counter.assign_add(1)
    return value

  got = []
  for _ in range(max(steps) + 1):
    got.append(value_and_increment().numpy())
  assert value_and_increment.experimental_get_tracing_count() == 1
  for t in steps:
    _check(got[t], ref(t))


@pytest.mark.parametrize("make, ref, steps", CASE_PARAMS)
def test_values_tf1_graph_session(make, ref, steps):
  sched = make()
  with tf.Graph().as_default():
    step = tf.compat.v1.train.get_or_create_global_step()
    value = sched(step)
    plus_one = sched(step + 1)
    new_step = tf.compat.v1.placeholder(tf.int64, [])
    assign = step.assign(new_step)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      for t in steps:
        sess.run(assign, {new_step: t})
        got, got_next = sess.run([value, plus_one])
        _check(got, ref(t))
        _check(got_next, ref(t + 1))


def test_float32_dtype_and_array_steps():
  sched = schedules.polynomial_schedule(1.0, 0.1, 10, dtype=tf.float32)
  assert sched.dtype == tf.float32
  steps = np.arange(15)
  got = sched(steps).numpy()
  _check(got, [np_polynomial(t, 1.0, 0.1, 10) for t in steps], np.float32)
  # Arrays of steps are computed elementwise, for every schedule.
  for _, make, ref, case_steps in CASES:
    got = make()(np.array(case_steps)).numpy()
    _check(got, [ref(t) for t in case_steps])
    got = make()(tf.constant(case_steps, tf.int64)).numpy()
    _check(got, [ref(t) for t in case_steps])


def test_large_int64_steps_and_float_steps():
  sched = schedules.cosine_schedule(1.0, 3 * 10**10)
  t = 10**10
  _check(sched(tf.constant(t, tf.int64)).numpy(), np_cosine(t, 1.0, 3 * 10**10))
  _check(sched(t).numpy(), np_cosine(t, 1.0, 3 * 10**10))
  # Float steps are taken as they are.
  poly = schedules.polynomial_schedule(1.0, 0.0, 4)
  _check(poly(2.5).numpy(), 1.0 - 2.5 / 4)
  _check(poly(tf.constant(1.5, tf.float32)).numpy(), 1.0 - 1.5 / 4)


def test_warmup_hands_on_the_integer_step():
  seen = []

  def after(step):
    seen.append(step)
    return tf.cast(step, tf.float64) * 10.0

  sched = schedules.linear_warmup_schedule(3, 1.0, after=after)
  _check(sched(tf.constant(7, tf.int64)).numpy(), 40.0)
  assert seen[-1].dtype == tf.int64
  _check(sched(tf.constant(7, tf.int32)).numpy(), 40.0)
  assert seen[-1].dtype == tf.int32
  # During the warm-up the later schedule sees step 0, never a negative one.
  _check(sched(tf.constant(1, tf.int64)).numpy(), 1.0 / 3)
  assert int(seen[-1]) == 0
  _check(sched(5).numpy(), 20.0)
  assert int(seen[-1]) == 2


def test_repr_config_and_construct_schedule_round_trip():
  namespace = {name: getattr(schedules, name) for name in schedules.__all__}
  for _, make, ref, steps in CASES:
    sched = make()
    rebuilt = schedules.construct_schedule(sched.name, **sched.config)
    assert rebuilt == sched
    assert eval(repr(sched), namespace) == sched  # pylint: disable=eval-used
    for t in steps:
      _check(rebuilt(t).numpy(), ref(t))
  assert repr(schedules.polynomial_schedule(0.1, 0.001, 1000)) == (
      "polynomial_schedule(init_value=0.1, end_value=0.001, decay_steps=1000, "
      "power=1.0, begin_step=0)")
  assert repr(schedules.constant_schedule(3, dtype="float32")) == (
      "constant_schedule(value=3.0, dtype='float32')")
  assert repr(schedules.linear_warmup_schedule(
      2, 1.0, after=schedules.constant_schedule(0.5))) == (
          "linear_warmup_schedule(warmup_steps=2, peak_value=1.0, "
          "after=constant_schedule(value=0.5), init_value=0.0)")


def test_construct_schedule_by_name():
  for name in schedules.SCHEDULE_NAMES:
    assert getattr(schedules, name + "_schedule")
  sched = schedules.construct_schedule(
      "linear_warmup", warmup_steps=2, peak_value=1.0,
      after={"name": "exponential", "init_value": 1.0, "decay_rate": 0.5,
             "decay_steps": 1})
  assert sched == schedules.linear_warmup_schedule(
      2, 1.0, after=schedules.exponential_schedule(1.0, 0.5, 1))
  _check(sched(5).numpy(), 0.125)
  sched = schedules.construct_schedule("piecewise_constant", boundaries=[1],
                                       values=[2.0, 3.0], dtype=tf.float32)
  _check(sched(1).numpy(), 3.0, np.float32)
  # Integral floats (as from a config file) are accepted as step counts.
  assert schedules.construct_schedule(
      "cosine", init_value=1.0, decay_steps=1e3).config["decay_steps"] == 1000


BAD = [
    (lambda: schedules.construct_schedule("linear"),
     "Unknown schedule 'linear'; valid names are 'constant', 'polynomial', "
     "'exponential', 'piecewise_constant', 'cosine', 'linear_warmup'"),
    (lambda: schedules.construct_schedule("cosine", init_value=1.0,
                                          decay_steps=5, stop=3),
     "unexpected keyword argument 'stop'"),
    (lambda: schedules.construct_schedule("cosine", init_value=1.0),
     "missing a required argument: 'decay_steps'"),
    (lambda: schedules.constant_schedule("0.1"), "value must be a real number"),
    (lambda: schedules.constant_schedule(True), "value must be a real number"),
    (lambda: schedules.constant_schedule(tf.constant(1.0)),
     "value must be a real number"),
    (lambda: schedules.constant_schedule(float("nan")), "value must be finite"),
    (lambda: schedules.constant_schedule(1.0, dtype=tf.int32),
     "dtype must be a floating dtype, got int32"),
    (lambda: schedules.polynomial_schedule(1.0, 0.0, 0),
     "polynomial_schedule: decay_steps must be positive, got 0"),
    (lambda: schedules.polynomial_schedule(1.0, 0.0, 2.5),
     "decay_steps must be an integer, got 2.5"),
    (lambda: schedules.polynomial_schedule(1.0, 0.0, 5, power=0),
     "power must be positive"),
    (lambda: schedules.polynomial_schedule(1.0, 0.0, 5, begin_step=-1),
     "begin_step must be >= 0, got -1"),
    (lambda: schedules.exponential_schedule(0.0, 0.5, 5),
     "init_value must be positive"),
    (lambda: schedules.exponential_schedule(1.0, -0.5, 5),
     "decay_rate must be positive"),
    (lambda: schedules.exponential_schedule(1.0, 0.5, -3),
     "decay_steps must be positive"),
    (lambda: schedules.exponential_schedule(1.0, 0.5, 5, end_value=2.0),
     "end_value=2.0 is never reached from init_value=1.0 with decay_rate=0.5"),
    (lambda: schedules.exponential_schedule(1.0, 2.0, 5, end_value=0.5),
     "it must be >= init_value"),
    (lambda: schedules.exponential_schedule(1.0, 0.5, 5, staircase="yes"),
     "staircase must be a bool"),
    (lambda: schedules.piecewise_constant_schedule([5, 5], [1., 2., 3.]),
     "boundaries must be strictly increasing, got [5, 5]"),
    (lambda: schedules.piecewise_constant_schedule([1, 2], [1., 2.]),
     "needs one more value than boundaries, got 2 boundaries and 2 values"),
    (lambda: schedules.piecewise_constant_schedule(3, [1., 2.]),
     "boundaries must be a list of integers"),
    (lambda: schedules.piecewise_constant_schedule([1], [1., "x"]),
     "values[1] must be a real number"),
    (lambda: schedules.cosine_schedule(1.0, 0), "decay_steps must be positive"),
    (lambda: schedules.linear_warmup_schedule(-2, 1.0),
     "warmup_steps must be >= 0"),
    (lambda: schedules.linear_warmup_schedule(2, 1.0, after=0.5),
     "after must be a schedule"),
    (lambda: schedules.linear_warmup_schedule(2, 1.0, after={"value": 1.0}),
     "a dict `after` needs a 'name' key"),
    (lambda: schedules.constant_schedule(1.0)(True),
     "the step must be an integer"),
    (lambda: schedules.constant_schedule(1.0)("3"),
     "the step must be an integer"),
    (lambda: schedules.constant_schedule(1.0)(tf.constant(True)),
     "the step must be an integer tensor, got dtype bool"),
]


@pytest.mark.parametrize("build, message", BAD,
                         ids=["bad%d" % i for i in range(len(BAD))])
def test_errors(build, message):
  with pytest.raises(ValueError) as info:
    build()
  assert message in str(info.value)
