"""K-FAC's memory, predicted before allocation (collection/memory.py), equals
what is allocated; the budget stops a build whose state would not fit."""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.ops.collection import memory
from kfac.python.ops.tensors import state


# The module's value, before state_only_budget sets it to 0 in each test.
WORKING_BYTES_PER_ENTRY = memory.WORKING_BYTES_PER_ENTRY


@pytest.fixture(autouse=True)
def state_only_budget(monkeypatch):
  """These tests pin the budget's accounting of the state; the working
  memory of inversions (memory.working_bytes) is tested on its own in
  memory_test.py."""
  monkeypatch.setattr(memory, "WORKING_BYTES_PER_ENTRY", 0)


WORLDS = ("graph", "function")
F32 = 4


def _model(vs, lc, x, ids, img):
  """Several block families: kron dense with bias, diagonal dense, EKFAC
  dense, multi-use (time-shared) dense, conv2d, embedding,
  scale-and-shift, a full generic block."""
  w1, b1, w2, w3, wm, k, emb, scale, shift, wg = vs
  h1 = tf.tanh(tf.matmul(x, w1) + b1)
  lc.register_fully_connected((w1, b1), x, h1)
  h2 = tf.matmul(h1, w2)
  lc.register_fully_connected(w2, h1, h2, approx="diagonal")
  h3 = tf.matmul(h2, w3)
  lc.register_fully_connected(w3, h2, h3, approx="ekfac")
  uses = [h3, tf.tanh(h3)]
  outs = [tf.matmul(u, wm) for u in uses]
  lc.register_fully_connected_multi(wm, uses, outs)
  conv = tf.nn.conv2d(img, k, strides=1, padding="VALID")
  lc.register_conv2d(k, 1, "VALID", img, conv)
  e = tf.nn.embedding_lookup(emb, ids)
  lc.register_embedding(emb, ids, e)
  s = e * scale + shift
  lc.register_scale_and_shift((scale, shift), e, s)
  lc.register_generic(wg, 4, approx="full")
  logits = (outs[0] + outs[1] + tf.reduce_sum(conv, [1, 2])[:, :2] + s[:, :2]
            + wg)
  lc.register_softmax_cross_entropy_loss(logits)
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=tf.constant([0, 1, 1, 0]), logits=logits))


NAMES = ["w1", "b1", "w2", "w3", "wm", "k", "emb", "scale", "shift", "wg"]


def _inits():
  rng = np.random.RandomState(0)
  shapes = [[3, 5], [5], [5, 4], [4, 4], [4, 2], [2, 2, 2, 3], [6, 3], [3],
            [3], [2]]
  return [rng.randn(*s).astype(np.float32) * 0.3 for s in shapes]


def _variables():
  return [tf.Variable(v, name=n) for v, n in zip(_inits(), NAMES)]


def _data():
  rng = np.random.RandomState(1)
  return (rng.randn(4, 3).astype(np.float32), np.array([0, 5, 2, 2]),
          rng.randn(4, 4, 4, 2).astype(np.float32))


def _factor_bytes(store, lc):
  """The bytes of the variables the factors created."""
  names = [f.name + "/" for f in lc.get_factors()]
  total = 0
  for key, var in store.variables_by_name.items():
    if any(key.startswith(n) for n in names):
      total += int(np.prod(var.shape)) * var.dtype.size
  return total


def _make_opt(store=None, **kwargs):
  opt = kfac.PeriodicInvCovUpdateKfacOpt(
      invert_every=1, learning_rate=0.01, damping=0.1, momentum=0.9,
      **kwargs)
  return opt


def _run_one_step(world, **opt_kwargs):
  """(predicted rows, predicted total before the step, allocated bytes
  after it)."""
  x, ids, img = _data()
  if world == "graph":
    with tf.Graph().as_default():
      vs = _variables()
      lc = kfac.LayerCollection()
      loss = _model(vs, lc, tf.constant(x), tf.constant(ids),
                    tf.constant(img))
      opt = _make_opt(layer_collection=lc, **opt_kwargs)
      train_op = opt.minimize(loss, var_list=vs)
      rows, total = lc.memory_usage()
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(train_op)
      return rows, total, _factor_bytes(opt._store, lc)
  vs = _variables()
  opt = _make_opt(**opt_kwargs)
  seen = {}

  @tf.function
  def step():
    lc = kfac.LayerCollection()
    loss = _model(vs, lc, tf.constant(x), tf.constant(ids), tf.constant(img))
    opt.minimize(loss, var_list=vs, layer_collection=lc)
    seen["lc"] = lc
    return loss

  step()
  lc = seen["lc"]
  rows, total = lc.memory_usage()
  return rows, total, _factor_bytes(opt._store, lc)


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("world", WORLDS)
def test_predicted_equals_allocated(world):
  rows, total, allocated = _run_one_step(world)
  assert total == allocated
  assert len(rows) == 8
  # The kron dense layer with bias, by hand: A (3+1)x(3+1) and G 5x5, each
  # with its moving average weight and its damped inverse.
  dense = rows[0]
  assert dense.nbytes == (16 + 1 + 16 + 25 + 1 + 25) * F32
  kinds = dense.by_kind()
  assert kinds["cov"] == (16 + 25) * F32
  assert kinds["matpow"] == (16 + 25) * F32
  # The diagonal dense layer: its 5x4 diagonal and weight, no inverse.
  assert rows[1].nbytes == (20 + 1) * F32


def test_prediction_is_made_before_allocation():
  with tf.Graph().as_default():
    vs = _variables()
    x, ids, img = _data()
    lc = kfac.LayerCollection()
    _model(vs, lc, tf.constant(x), tf.constant(ids), tf.constant(img))
    store = state.StateStore("s")
    est = kfac.estimator.FisherEstimator(
        vs, 0.95, 0.1, lc, state_store=store)
    est.factors  # pylint: disable=pointless-statement
    rows, total = lc.memory_usage()
    assert total > 0
    assert all(not k.startswith(tuple(f.name for f in lc.get_factors()))
               for k in store.variables_by_name)
    # Making the variables afterwards gives exactly the prediction.
    est.make_vars_and_create_op_thunks()
    assert _factor_bytes(store, lc) == total


def test_usage_before_the_factors_exist_is_a_clear_error():
  with tf.Graph().as_default():
    vs = _variables()
    x, ids, img = _data()
    lc = kfac.LayerCollection()
    _model(vs, lc, tf.constant(x), tf.constant(ids), tf.constant(img))
    with pytest.raises(ValueError, match="factors exist"):
      lc.memory_usage()


@pytest.mark.parametrize("world", WORLDS)
def test_over_budget_names_the_largest_layers(world):
  with pytest.raises(ValueError) as info:
    _run_one_step(world, memory_budget=300)
  message = str(info.value)
  assert "1984 bytes), over the memory budget of 300 B" in message
  # Largest first (the five largest): the conv layer k (A 8x8 and G 3x3,
  # each with its inverse, two weights: 148 floats), the EKFAC layer w3
  # (A and G 4x4 with their eigenvectors, eigenvalues and counters, 4x4
  # scalings, three weights: 93 floats), the dense w1 (84), the
  # scale-and-shift layer (full 6x6 and its inverse, one weight: 73), the
  # multi-use wm (A 4x4, G 2x2, inverses, weights: 42).
  listed = message.split("Largest layers: ")[1].split(". Register")[0]
  assert listed == ("k (k:0): 592 B; w3 (w3:0): 372 B; w1 (w1:0, b1:0): "
                    "336 B; scale (scale:0, shift:0): 292 B; wm (wm:0): "
                    "168 B")
  assert "over_budget='fallback'" in message and "'diagonal'" in message


def test_budget_that_fits_and_none_pass():
  for budget in (1984, None):
    with tf.Graph().as_default():
      vs = _variables()
      x, ids, img = _data()
      lc = kfac.LayerCollection()
      _model(vs, lc, tf.constant(x), tf.constant(ids), tf.constant(img))
      est = kfac.estimator.FisherEstimator(vs, 0.95, 0.1, lc,
                                           memory_budget=budget)
      est.factors  # pylint: disable=pointless-statement
      assert lc.memory_usage()[1] == 1984
  with tf.Graph().as_default():
    vs = _variables()
    lc = kfac.LayerCollection()
    _model(vs, lc, tf.constant(x), tf.constant(ids), tf.constant(img))
    est = kfac.estimator.FisherEstimator(vs, 0.95, 0.1, lc, memory_budget=1983)
    with pytest.raises(ValueError, match="over the memory budget"):
      est.factors  # pylint: disable=pointless-statement


def test_budget_counts_the_working_memory_of_the_largest_inversion(
    monkeypatch):
  monkeypatch.setattr(memory, "WORKING_BYTES_PER_ENTRY",
                      WORKING_BYTES_PER_ENTRY)
  # The model's largest square state part is the conv layer's 8x8 input
  # factor: 64 entries of working memory on top of the 1984 bytes of state.
  work = 64 * WORKING_BYTES_PER_ENTRY
  x, ids, img = _data()

  def estimator(budget):
    with tf.Graph().as_default():
      vs = _variables()
      lc = kfac.LayerCollection()
      _model(vs, lc, tf.constant(x), tf.constant(ids), tf.constant(img))
      est = kfac.estimator.FisherEstimator(vs, 0.95, 0.1, lc,
                                           memory_budget=budget)
      est.factors  # pylint: disable=pointless-statement
      rows, total = lc.memory_usage()
      assert total == 1984 and memory.working_bytes(rows) == work
      assert memory.needed_bytes(rows) == 1984 + work

  estimator(1984 + work)
  with pytest.raises(ValueError) as info:
    estimator(1984 + work - 1)
  assert ("1984 bytes) and inverting its largest factor some 3.5 KiB more, "
          "over the memory budget of 5.4 KiB (5567 bytes)") in str(info.value)


@pytest.mark.parametrize("bad", [0, -5, "lots", True])
def test_bad_budget_is_named(bad):
  with pytest.raises(ValueError, match="memory_budget"):
    _make_opt(memory_budget=bad)


def test_default_budget_is_a_fraction_of_physical_memory():
  phys = memory.physical_memory()
  assert phys is not None and phys > 0
  assert memory.default_budget() == int(
      phys * memory.DEFAULT_BUDGET_FRACTION)
  assert memory.resolve_budget("x", "auto") == memory.default_budget()


def _more_families(lc, series=True):
  """Families the first model lacks: conv transpose, depthwise conv (kron
  and diagonal), per-channel scale-and-shift, kron_series (multi-use),
  kron_reduce, SUA conv, EKFAC conv transpose. Returns the variables."""
  rng = np.random.RandomState(2)
  img = tf.constant(rng.randn(4, 5, 5, 2).astype(np.float32))
  seq = [tf.constant(rng.randn(4, 3).astype(np.float32)) for _ in range(2)]
  kt = tf.Variable(rng.randn(2, 2, 3, 2).astype(np.float32), name="kt")
  kte = tf.Variable(rng.randn(2, 2, 3, 2).astype(np.float32), name="kte")
  dk = tf.Variable(rng.randn(2, 2, 2, 2).astype(np.float32), name="dk")
  dkd = tf.Variable(rng.randn(2, 2, 2, 1).astype(np.float32), name="dkd")
  sc = tf.Variable(np.ones(2, np.float32), name="sc")
  sh = tf.Variable(np.zeros(2, np.float32), name="sh")
  ws = tf.Variable(rng.randn(3, 3).astype(np.float32), name="ws")
  wr = tf.Variable(rng.randn(2, 3).astype(np.float32), name="wr")
  ksua = tf.Variable(rng.randn(3, 3, 2, 2).astype(np.float32), name="ksua")
  outs = []
  t = tf.nn.conv2d_transpose(img, kt, [4, 10, 10, 3], 2)
  lc.register_conv2d_transpose(kt, img, t, 2, "SAME")
  te = tf.nn.conv2d_transpose(img, kte, [4, 10, 10, 3], 2)
  lc.register_conv2d_transpose(kte, img, te, 2, "SAME", approx="ekfac")
  d = tf.nn.depthwise_conv2d(img, dk, [1, 1, 1, 1], "VALID")
  lc.register_depthwise_conv2d(dk, img, d, [1, 1, 1, 1], "VALID",
                               approx="kron")
  dd = tf.nn.depthwise_conv2d(img, dkd, [1, 1, 1, 1], "VALID")
  lc.register_depthwise_conv2d(dkd, img, dd, [1, 1, 1, 1], "VALID")
  s = img * sc + sh
  lc.register_scale_and_shift((sc, sh), img, s, approx="per_channel")
  so = [tf.matmul(x, ws) for x in seq]
  # (kron_series defines only the inverse.)
  lc.register_fully_connected_multi(
      ws, seq, so, approx="kron_series_1" if series else "kron_indep")
  r = tf.einsum("bpi,io->bpo", tf.reshape(img, [4, 25, 2]), wr)
  lc.register_fully_connected(wr, tf.reshape(img, [4, 25, 2]), r,
                              approx="kron_reduce")
  u = tf.nn.conv2d(img, ksua, 1, "SAME")
  lc.register_conv2d(ksua, 1, "SAME", img, u, approx="kron_sua")
  logits = (tf.reduce_sum(t, [1, 2])[:, :2] + tf.reduce_sum(te, [1, 2])[:, :2]
            + tf.reduce_sum(d, [1, 2])[:, :2] + tf.reduce_sum(dd, [1, 2])
            + tf.reduce_sum(s, [1, 2]) + so[0][:, :2] + so[1][:, :2]
            + tf.reduce_sum(r, 1)[:, :2] + tf.reduce_sum(u, [1, 2]))
  lc.register_softmax_cross_entropy_loss(logits)
  return [kt, kte, dk, dkd, (sc, sh), ws, wr, ksua]


@pytest.mark.parametrize("options", [
    dict(exps=(-1,)),
    dict(exps=(-1, 0.5, -0.5), compute_cholesky=True,
         compute_cholesky_inverse=True)])
def test_more_families_and_inverse_kinds(options):
  with tf.Graph().as_default():
    lc = kfac.LayerCollection()
    params = _more_families(lc, series=len(options["exps"]) == 1)
    variables = []
    for p in params:
      variables.extend(p if isinstance(p, tuple) else [p])
    store = state.StateStore("s")
    est = kfac.estimator.FisherEstimator(variables, 0.95, 0.1, lc,
                                         state_store=store, **options)
    est.factors  # pylint: disable=pointless-statement
    rows, total = lc.memory_usage()
    assert [r.name for r in rows] == ["kt", "kte", "dk", "dkd", "sc", "ws",
                                      "wr", "ksua"]
    assert all(r.nbytes > 0 for r in rows)
    est.make_vars_and_create_op_thunks()
    assert _factor_bytes(store, lc) == total
    # Every part is accounted for exactly once.
    created = {k for k in store.variables_by_name
               if k.startswith(tuple(f.name + "/" for f in lc.get_factors()))}
    predicted = [p.key for r in rows for p in r.parts]
    assert sorted(predicted) == sorted(created)
