"""Tests of kfac.data_reader, kfac.data_reader_alt and batch-size schedules.

The dataset has 11 examples; row i of the features is [i, 100 + i, -i] and
label i is i, so every returned row identifies its example and the
components can be checked against each other (x == X[y]). The readers are
run in a TF1 Graph with a Session ("graph"), in a tf.function called once
per step ("function") and eagerly ("eager"). Comparisons are exact (the
readers copy rows; schedules are compared with numpy float64 formulas).
"""

import numpy as np
import pytest
import tensorflow as tf

from kfac.python.ops.schedules import batch_size as bss
from kfac.python.ops.data import data_reader
from kfac.python.ops.data import data_reader_alt

N = 11
MAX = 5
SIZES = [3, 5, 1, 5, 4, 2, 5, 3]  # sum 28 > 2 epochs
MODULES = {"tf.data": data_reader, "gather": data_reader_alt}
WORLDS = ("graph", "function", "eager")


def dataset(n=N):
  x = np.stack([np.arange(n), 100 + np.arange(n), -np.arange(n)],
               1).astype(np.float64)
  y = np.arange(n, dtype=np.int64)
  return x, y


def to_numpy(structure):
  return tf.nest.map_structure(
      lambda t: None if t is None else t.numpy(), structure)


def run_reader(world, reader_cls, sizes, order="after", seed=3, data=None,
               max_batch_size=MAX):
  """[(batch, cached or None)] per step, numpy lists (one per component).

  One step calls reader(size) once; cached_batch is read before or after
  that call (`order`) for a CachedDataReader.
  """
  data = dataset() if data is None else data
  cached = hasattr(reader_cls, "cached_batch")

  def step(reader, size):
    if cached and order == "before":
      c = reader.cached_batch
      b = reader(size)
    else:
      b = reader(size)
      c = reader.cached_batch if cached else None
    return b, c

  out = []
  if world == "eager":
    reader = reader_cls(data, max_batch_size, seed=seed)
    for size in sizes:
      b, c = step(reader, size)
      out.append(to_numpy((b, c)))
  elif world == "function":
    reader = reader_cls(data, max_batch_size, seed=seed)
    fn = tf.function(lambda size: step(reader, size),
                     input_signature=[tf.TensorSpec([], tf.int32)])
    for size in sizes:
      out.append(to_numpy(fn(size)))
  else:
    with tf.Graph().as_default():
      reader = reader_cls(data, max_batch_size, seed=seed)
      size_ph = tf.compat.v1.placeholder(tf.int32, [])
      batch, cache = step(reader, size_ph)
      fetch = (batch, cache) if cache is not None else batch
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for size in sizes:
          got = sess.run(fetch, {size_ph: size})
          out.append(got if cache is not None else (got, None))
  return out


def check_rows(batch, size):
  x, y = batch
  data_x, _ = dataset()
  assert x.shape == (size, 3) and y.shape == (size,)
  np.testing.assert_array_equal(x, data_x[y])


def check_permutation_stream(labels, n=N):
  """Every consecutive block of n drawn examples is a permutation."""
  full = len(labels) // n
  assert full >= 2
  for e in range(full):
    np.testing.assert_array_equal(np.sort(labels[e * n:(e + 1) * n]),
                                  np.arange(n))


# --------------------------------------------------------------- readers
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", sorted(MODULES))
def test_sizes_and_rows(world, kind):
  out = run_reader(world, MODULES[kind].VariableBatchReader, SIZES)
  for (batch, _), size in zip(out, SIZES):
    check_rows(batch, size)
  if kind == "gather":  # no example skipped: permutation per epoch
    check_permutation_stream(np.concatenate([b[1] for b, _ in out]))


@pytest.mark.parametrize("world", WORLDS)
def test_tf_data_reader_takes_prefix_of_max_batches(world):
  full = run_reader(world, data_reader.VariableBatchReader,
                    [MAX] * len(SIZES), seed=7)
  part = run_reader(world, data_reader.VariableBatchReader, SIZES, seed=7)
  for (f, _), (p, _), size in zip(full, part, SIZES):
    np.testing.assert_array_equal(p[0], f[0][:size])
    np.testing.assert_array_equal(p[1], f[1][:size])
  # The max-size batches are a stream of epoch permutations.
  data = dataset(10)
  out = run_reader(world, data_reader.VariableBatchReader, [MAX] * 6,
                   data=data)
  check_permutation_stream(np.concatenate([b[1] for b, _ in out]), n=10)


# In eager mode every call is a step, so the cache is read after the call
# only; in a graph step it may be read before or after the call.
@pytest.mark.parametrize("world, order", [
    (w, o) for w in WORLDS for o in ("before", "after")
    if not (w == "eager" and o == "before")])
@pytest.mark.parametrize("kind", sorted(MODULES))
def test_cached_batch_is_previous_batch(world, kind, order):
  out = run_reader(world, MODULES[kind].CachedDataReader, SIZES, order=order)
  first_cached = out[0][1]
  assert first_cached[0].shape == (0, 3) and first_cached[1].shape == (0,)
  assert first_cached[0].dtype == np.float64
  assert first_cached[1].dtype == np.int64
  for t, ((batch, cached), size) in enumerate(zip(out, SIZES)):
    check_rows(batch, size)
    if t:
      prev = out[t - 1][0]
      np.testing.assert_array_equal(cached[0], prev[0])
      np.testing.assert_array_equal(cached[1], prev[1])
  # The cached reader returns the same stream as the plain one.
  plain = run_reader(world, MODULES[kind].VariableBatchReader, SIZES)
  for (b, _), (p, _) in zip(out, plain):
    np.testing.assert_array_equal(b[1], p[1])


def test_determinism_and_seeds():
  for kind, module in MODULES.items():
    runs = {}
    for world in ("graph", "function"):
      for seed in (1, 2):
        labels = [b[1] for b, _ in run_reader(
            world, module.VariableBatchReader, SIZES, seed=seed)]
        runs[world, seed] = np.concatenate(labels)
    for world in ("graph", "function"):
      again = np.concatenate([b[1] for b, _ in run_reader(
          world, module.VariableBatchReader, SIZES, seed=1)])
      np.testing.assert_array_equal(again, runs[world, 1])
      assert not np.array_equal(runs[world, 1], runs[world, 2]), kind
    if kind == "gather":  # counter-based permutations: same in every world
      np.testing.assert_array_equal(runs["graph", 1], runs["function", 1])
  r = data_reader_alt.VariableBatchReader(dataset(), MAX)
  assert isinstance(r.seed, int)


def test_gather_reader_without_seed_follows_the_graph_seed():
  """seed=None: a program that sets tf.compat.v1.set_random_seed (TF1) or
  tf.random.set_seed (TF2) reads the same batches on every run, as with
  kfac 0.2.x's reader; another graph seed reads others."""
  def tf1_seed(graph_seed):
    with tf.Graph().as_default():
      tf.compat.v1.set_random_seed(graph_seed)
      return data_reader_alt.VariableBatchReader(
          tf.constant(dataset()[0]), MAX).seed

  def tf2_seed(global_seed):
    tf.random.set_seed(global_seed)
    return data_reader_alt.VariableBatchReader(dataset(), MAX).seed

  try:
    for make in (tf1_seed, tf2_seed):
      assert make(5) == make(5)
      assert make(5) != make(6)
  finally:
    tf.random.set_seed(None)


def test_gather_reader_batches_larger_than_dataset():
  data = dataset(4)
  sizes = [7, 3, 7, 1, 6]
  out = run_reader("function", data_reader_alt.CachedDataReader, sizes,
                   data=data, max_batch_size=7)
  labels = np.concatenate([b[1] for b, _ in out])
  assert [len(b[1]) for b, _ in out] == sizes
  check_permutation_stream(labels, n=4)
  for t in range(1, len(sizes)):
    np.testing.assert_array_equal(out[t][1][1], out[t - 1][0][1])


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_python_int_batch_size_gives_static_shape(kind):
  module = MODULES[kind]
  with tf.Graph().as_default():
    reader = module.CachedDataReader(dataset(), MAX, seed=0)
    batch = reader(3)
    plain = module.VariableBatchReader(dataset(), MAX, seed=0)(4)
    assert batch[0].shape.as_list() == [3, 3]
    assert plain[1].shape.as_list() == [4]
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      b1 = sess.run(batch)
      b2, c2 = sess.run([batch, reader.cached_batch])
  np.testing.assert_array_equal(c2[1], b1[1])
  check_rows(b2, 3)


@pytest.mark.parametrize("kind", sorted(MODULES))
@pytest.mark.parametrize("order", ["before", "after"])
def test_while_loop_iterations_are_steps(kind, order):
  reader = MODULES[kind].CachedDataReader(dataset(), MAX, seed=5)

  @tf.function
  def run(sizes):
    count = tf.shape(sizes)[0]
    arrays = [tf.TensorArray(tf.int64, size=count, infer_shape=False,
                             element_shape=tf.TensorShape([None]))
              for _ in range(2)]

    def body(t, ta_b, ta_c):
      if order == "before":
        c = reader.cached_batch[1]
        b = reader(sizes[t])[1]
      else:
        b = reader(sizes[t])[1]
        c = reader.cached_batch[1]
      return t + 1, ta_b.write(t, b), ta_c.write(t, c)

    _, ta_b, ta_c = tf.while_loop(lambda t, *_: t < count, body,
                                  [tf.constant(0), arrays[0], arrays[1]])
    return ta_b.concat(), ta_c.concat()

  sizes = SIZES[:5]
  batches, cached = run(tf.constant(sizes))
  more, cached_more = run(tf.constant(sizes[:2]))
  batches = np.split(batches.numpy(), np.cumsum(sizes)[:-1])
  cached = np.split(cached.numpy(), np.cumsum([0] + sizes[:-2]))
  assert len(cached[0]) == 0
  for t in range(1, len(sizes)):
    np.testing.assert_array_equal(cached[t], batches[t - 1])
  # The next call continues: its first cached batch is the last batch.
  np.testing.assert_array_equal(cached_more.numpy()[:sizes[-1]], batches[-1])
  assert len(more.numpy()) == sum(sizes[:2])


@pytest.mark.parametrize("world", ["graph", "function"])
@pytest.mark.parametrize("kind", sorted(MODULES))
@pytest.mark.parametrize("order", ["before", "after"])
def test_cached_batch_read_in_cond_branch(world, kind, order):
  """prev_train_batch may be evaluated inside a tf.cond of the step."""

  def step(reader, size, flag):
    def padded():
      labels = reader.cached_batch[1]
      return tf.pad(labels, [[0, MAX - tf.shape(labels)[0]]],
                    constant_values=-1)

    def read():
      return tf.cond(flag, padded, lambda: tf.fill([MAX], tf.constant(
          -2, tf.int64)))

    if order == "before":
      c = read()
      b = reader(size)[1]
    else:
      b = reader(size)[1]
      c = read()
    return b, c

  cls = MODULES[kind].CachedDataReader
  flags = [True, True, False, True, True]
  sizes = SIZES[:5]
  out = []
  if world == "function":
    reader = cls(dataset(), MAX, seed=2)
    fn = tf.function(lambda s, f: step(reader, s, f))
    for size, flag in zip(sizes, flags):
      out.append([t.numpy() for t in fn(tf.constant(size), tf.constant(flag))])
  else:
    with tf.Graph().as_default():
      reader = cls(dataset(), MAX, seed=2)
      size_ph = tf.compat.v1.placeholder(tf.int32, [])
      flag_ph = tf.compat.v1.placeholder(tf.bool, [])
      fetch = step(reader, size_ph, flag_ph)
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for size, flag in zip(sizes, flags):
          out.append(sess.run(fetch, {size_ph: size, flag_ph: flag}))
  np.testing.assert_array_equal(out[0][1], [-1] * MAX)
  for t in range(1, len(sizes)):
    expected = np.full(MAX, -1 if flags[t] else -2)
    if flags[t]:
      expected[:sizes[t - 1]] = out[t - 1][0]
    np.testing.assert_array_equal(out[t][1], expected)


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_eager_and_function_share_state(kind):
  reader = MODULES[kind].CachedDataReader(
      (tf.constant(dataset()[0]), tf.constant(dataset()[1])), MAX, seed=4)
  assert reader.cached_batch[1].shape == (0,)
  b0 = reader(3)
  np.testing.assert_array_equal(reader.cached_batch[1], np.zeros([0]))

  @tf.function
  def step(size):
    return reader(size), reader.cached_batch

  b1, c1 = step(tf.constant(2))
  np.testing.assert_array_equal(c1[1], b0[1])
  # Read outside a step: what the next step will see (the last batch).
  np.testing.assert_array_equal(reader.cached_batch[1], b1[1])
  b2 = reader(4)
  np.testing.assert_array_equal(reader.cached_batch[0], b1[0])
  _, c3 = step(tf.constant(1))
  np.testing.assert_array_equal(c3[1], b2[1])


def test_call_inside_cond_branch_is_an_error():
  reader = data_reader.CachedDataReader(dataset(), MAX, seed=0)

  @tf.function
  def step(flag):
    return tf.cond(flag, lambda: reader(2)[1], lambda: reader(2)[1])

  with pytest.raises(ValueError, match="not inside a tf.cond branch"):
    step(tf.constant(True))
  # The plain readers may be called anywhere.
  plain = data_reader_alt.VariableBatchReader(dataset(), MAX, seed=0)
  fn = tf.function(lambda f: tf.cond(f, lambda: plain(2)[1],
                                     lambda: plain(3)[1][:2]))
  assert fn(tf.constant(True)).shape == (2,)


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_bad_arguments(kind):
  module = MODULES[kind]
  x, y = dataset()
  for cls in (module.VariableBatchReader, module.CachedDataReader):
    with pytest.raises(ValueError, match="same leading dimension"):
      cls((x, y[:-1]), MAX)
    with pytest.raises(ValueError, match="empty"):
      cls((), MAX)
    with pytest.raises(ValueError, match="0 examples"):
      cls((x[:0], y[:0]), MAX)
    with pytest.raises(ValueError, match="scalar"):
      cls((x, 3.0), MAX)
    with pytest.raises(ValueError, match="tuple or list"):
      cls({"x": x}, MAX)
    for bad in (0, -1, 2.5, True, None):
      with pytest.raises(ValueError, match="max_batch_size must be a "
                         "positive int"):
        cls((x, y), bad)
    with pytest.raises(ValueError, match="seed must be an int"):
      cls((x, y), MAX, seed="a")
    reader = cls((x, y), MAX, seed=0)
    for bad in (MAX + 1, 0, tf.constant(MAX + 1)):
      with pytest.raises(ValueError, match=r"between 1 and max_batch_size "
                         r"\(5\), got"):
        reader(bad)
    for bad in (2.0, tf.constant(2.0), tf.constant([2]), "2", True):
      with pytest.raises(ValueError, match="batch_size must be"):
        reader(bad)
    with tf.Graph().as_default():
      with pytest.raises(ValueError, match="symbolic tensor"):
        cls((tf.compat.v1.placeholder(tf.float32, [N, 3]), y), MAX)


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_batch_size_checked_at_run_time(kind):
  module = MODULES[kind]
  reader = module.CachedDataReader(dataset(), MAX, seed=0)
  fn = tf.function(lambda s: reader(s)[1],
                   input_signature=[tf.TensorSpec([], tf.int64)])
  assert fn(tf.constant(MAX, tf.int64)).shape == (MAX,)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"batch_size must be <= max_batch_size \(5\)"):
    fn(tf.constant(MAX + 1, tf.int64))
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match="batch_size must be >= 1"):
    fn(tf.constant(0, tf.int64))
  # A rejected size draws nothing: the stream goes on where it was (a
  # failed check must not cancel a draw in flight and end the iterator).
  for _ in range(30):
    with pytest.raises(tf.errors.InvalidArgumentError):
      fn(tf.constant(MAX + 1, tf.int64))
  assert fn(tf.constant(2, tf.int64)).shape == (2,)
  with tf.Graph().as_default():
    reader = module.VariableBatchReader(dataset(), MAX, seed=0)
    size = tf.compat.v1.placeholder(tf.int32, [])
    batch = reader(size)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      assert sess.run(batch, {size: 2})[1].shape == (2,)
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match=r"<= max_batch_size \(5\)"):
        sess.run(batch, {size: MAX + 1})


# ------------------------------------------------------------- schedules
STEPS = np.arange(-2, 80)


def numpy_exponential(initial, cap, growth, steps):
  steps = np.maximum(steps, 0).astype(np.float64)
  with np.errstate(over="ignore"):  # growth**step may overflow: cap wins
    return np.minimum(cap, np.floor(initial * growth**steps)).astype(
        np.int64)


def numpy_linear(initial, cap, num_steps, steps):
  steps = np.minimum(np.maximum(steps, 0), num_steps).astype(np.float64)
  return np.floor(initial + (cap - initial) * steps / num_steps).astype(
      np.int64)


def numpy_piecewise(boundaries, values, steps):
  return np.asarray(values)[np.searchsorted(boundaries, steps, side="left")]


SCHEDULES = [
    (bss.exponential_batch_size_schedule(3, 200, 1.1),
     lambda s: numpy_exponential(3, 200, 1.1, s)),
    (bss.exponential_batch_size_schedule(5, 1000, 2),
     lambda s: numpy_exponential(5, 1000, 2.0, s)),
    (bss.exponential_batch_size_schedule(7, 7, 1.0),
     lambda s: numpy_exponential(7, 7, 1.0, s)),
    (bss.linear_batch_size_schedule(10, 101, 30),
     lambda s: numpy_linear(10, 101, 30, s)),
    (bss.linear_batch_size_schedule(4, 4, 1),
     lambda s: numpy_linear(4, 4, 1, s)),
    (bss.piecewise_constant_batch_size_schedule([0, 10, 40], [8, 16, 32, 64]),
     lambda s: numpy_piecewise([0, 10, 40], [8, 16, 32, 64], s)),
    (bss.piecewise_constant_batch_size_schedule([], [9]),
     lambda s: numpy_piecewise([], [9], s)),
]


def test_schedules_match_numpy_formulas_eager_and_list():
  for schedule, reference in SCHEDULES:
    expected = reference(STEPS)
    got = np.array([schedule(int(s)).numpy() for s in STEPS])
    np.testing.assert_array_equal(got, expected, err_msg=repr(schedule))
    vector = schedule(tf.constant(STEPS, tf.int64))
    assert vector.dtype == tf.int32
    np.testing.assert_array_equal(vector, expected)
    assert schedule(3).dtype == tf.int32 and schedule(3).shape == ()
    assert bss.make_batch_size_list(schedule, 50) == list(
        reference(np.arange(50)))


@pytest.mark.parametrize("world", ["graph", "function"])
def test_schedules_with_a_counter_variable(world):
  num = len(SCHEDULES)

  def build(variables):
    counter = variables[0]
    sizes = tf.stack([s(counter) for s, _ in SCHEDULES])
    with tf.control_dependencies([sizes]):
      return sizes, counter.assign_add(1)

  for_steps = [0, 1, 2, 9, 10, 11, 35, 70, 10**6]
  got = []
  if world == "graph":
    with tf.Graph().as_default():
      counter = tf.Variable(0, dtype=tf.int64)
      fetch = build([counter])[0]
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for step in for_steps:
          counter.load(step, sess)
          got.append(sess.run(fetch))
  else:
    counter = tf.Variable(0, dtype=tf.int64)
    fn = tf.function(lambda: build([counter]))
    for step in for_steps:
      counter.assign(step)
      got.append(fn()[0].numpy())
  got = np.array(got)
  assert got.shape == (len(for_steps), num)
  for i, (_, reference) in enumerate(SCHEDULES):
    np.testing.assert_array_equal(got[:, i], reference(np.array(for_steps)))
  assert got[-1, 0] == 200 and got[-1, 1] == 1000  # growth**step overflows


def test_make_batch_size_list_any_callable_and_graph_mode():
  assert bss.make_batch_size_list(lambda s: 2 * s + 1, 4) == [1, 3, 5, 7]
  assert bss.make_batch_size_list(lambda s: 3, 3) == [3, 3, 3]
  assert bss.make_batch_size_list(SCHEDULES[0][0], 0) == []
  with tf.Graph().as_default():
    assert bss.make_batch_size_list(
        bss.linear_batch_size_schedule(2, 6, 4), 6) == [2, 3, 4, 5, 6, 6]
  with pytest.raises(ValueError, match="num_steps must be a non-negative"):
    bss.make_batch_size_list(SCHEDULES[0][0], -1)


def test_schedule_bad_arguments():
  exp = bss.exponential_batch_size_schedule
  lin = bss.linear_batch_size_schedule
  pw = bss.piecewise_constant_batch_size_schedule
  cases = [
      (lambda: exp(0, 10, 1.5), "initial_batch_size must be a positive int"),
      (lambda: exp(2.0, 10, 1.5), "initial_batch_size must be a positive"),
      (lambda: exp(2, 0, 1.5), "max_batch_size must be a positive int"),
      (lambda: exp(20, 10, 1.5), r"initial_batch_size \(20\) must be <= "),
      (lambda: exp(2, 10, 0.9), "growth_rate must be a finite number >= 1"),
      (lambda: exp(2, 10, float("inf")), "growth_rate must be a finite"),
      (lambda: exp(2, 10, "2"), "growth_rate must be a finite"),
      (lambda: lin(2, 10, 0), "num_steps must be a positive int"),
      (lambda: lin(11, 10, 5), r"initial_batch_size \(11\) must be <="),
      (lambda: pw([5, 5], [1, 2, 3]), "strictly increasing"),
      (lambda: pw([-1], [1, 2]), r"boundaries\[0\] must be a non-negative"),
      (lambda: pw([1.5], [1, 2]), r"boundaries\[0\] must be a non-negative"),
      (lambda: pw([1, 2], [1, 2]), r"len\(values\) must be len\(boundaries"),
      (lambda: pw([1], [1, 0]), r"values\[1\] must be a positive int"),
      (lambda: SCHEDULES[0][0](1.5), "needs an integer step"),
  ]
  for make, message in cases:
    with pytest.raises(ValueError, match=message):
      make()
  assert "growth_rate=1.1" in repr(SCHEDULES[0][0])
