"""Embedding lookups against dense one-hot layers and brute-force Fishers.

References (never kfac code for the exact ones):
* the same table registered as a dense layer on explicit one-hot (n-hot)
  inputs, `register_fully_connected(W, one_hot, outputs)`: an independent
  code path (dense factors, Cholesky inverses) for the same matrix;
* the exact Fisher (1/N) sum_n J_n^T F_n J_n from per-example tape
  Jacobians (reference.py), in the "exact" estimation mode.
Identities hold to rounding: float64, rtol 1e-9 (products through inverses
1e-8), atol 1e-12. Training: K-FAC steps with IndexedSlices gradients equal
the dense one-hot model's steps to 1e-10.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref

WORLDS = ref.WORLDS
TOL = dict(rtol=1e-9, atol=1e-12)
INV_TOL = dict(rtol=1e-8, atol=1e-11)
VOCAB, DIM, CLASSES, SEQ = 7, 3, 3, 2


def _table(seed=0):
  return np.random.RandomState(seed).randn(VOCAB, DIM)


def _head(rows, seed=1):
  return tf.constant(0.8 * np.random.RandomState(seed).randn(rows, CLASSES))


def _ids(kind, n, seed):
  rng = np.random.RandomState(seed)
  if kind == "onehot":
    return rng.randint(0, VOCAB, n).astype(np.int32)
  if kind == "bag":  # repeated ids inside a bag on purpose
    ids = rng.randint(0, VOCAB, (n, 3)).astype(np.int32)
    ids[0, 2] = ids[0, 1]
    return ids
  return rng.randint(0, VOCAB, (n, SEQ)).astype(np.int32)  # "seq"


def _labels(n, seed):
  return np.random.RandomState(seed).randint(0, CLASSES, n)


def _forward(kind, w, ids, dense):
  """Returns (registration inputs, outputs, logits). dense=True: explicit
  one-hot (n-hot) float inputs times W."""
  if dense:
    onehot = tf.one_hot(ids, VOCAB, dtype=tf.float64)
    if kind == "bag":
      onehot = tf.reduce_sum(onehot, axis=1)
    inputs = onehot
    outputs = tf.einsum("...v,vd->...d", onehot, w)
  else:
    inputs = ids
    outputs = tf.gather(w, ids)
    if kind == "bag":
      outputs = tf.reduce_sum(outputs, axis=1)
  flat = tf.reshape(tf.tanh(outputs), [tf.shape(ids)[0], -1])
  logits = tf.matmul(flat, _head(SEQ * DIM if kind == "seq" else DIM))
  return inputs, outputs, logits


def _register(lc, kind, w, ids, labels, dense, approx=None):
  inputs, outputs, logits = _forward(kind, w, tf.constant(ids), dense)
  block = lc.register_fully_connected(w, inputs, outputs, approx=approx,
                                      dense_inputs=dense)
  lc.register_softmax_cross_entropy_loss(logits, targets=tf.constant(labels))
  return block


def _exact_fisher(kind, ids, labels):
  del labels  # the Fisher does not depend on the targets

  def forward(vs, x):
    return _forward(kind, vs[0], tf.cast(x, tf.int32), dense=False)[2]

  jacs = ref.per_example_jacobians(forward, [_table()], ids)
  logits = ref.outputs(forward, [_table()], ids)
  return ref.curvature(jacs, [ref.categorical_fisher(z) for z in logits])


def _vectors(seed):
  return np.random.RandomState(seed).randn(VOCAB, DIM)


# ---------------------------------------------------------------- blocks
@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
@pytest.mark.parametrize("kind", ["onehot", "bag", "seq"])
def test_embedding_equals_dense_one_hot_registration(world, kind):
  ids, labels = _ids(kind, 5, seed=2), _labels(5, seed=3)
  damping, exps = 0.04, (-1, -0.5)
  vec = _vectors(4)

  def build_for(dense):
    store = util.new_store()

    def build(vs):
      lc = kfac.LayerCollection()
      _register(lc, kind, vs[0], ids, labels, dense)
      est, ops = util.estimator_stages(store, lc, vs, "exact",
                                       damping=damping, exps=exps)
      (block,) = est.blocks
      pairs = [(tf.constant(vec), vs[0])]
      fetch = {"factors": [tf.identity(f.get_cov()) for f in block.factors()],
               "full": block.full_fisher_block(),
               "mult": est.multiply(pairs)[0][0],
               "inv": est.multiply_inverse(pairs)[0][0],
               "pow": est.multiply_matpower(-0.5, pairs)[0][0],
               "type": tf.constant(type(block).__name__)}
      return ops + [fetch]
    return build

  emb = ref.run_stages(world, [_table()], build_for(False))[-1]
  dense = ref.run_stages(world, [_table()], build_for(True))[-1]
  assert emb["type"] == b"EmbeddingKFACFB"
  a_emb, g_emb = emb["factors"]
  a_dense, g_dense = dense["factors"]
  np.testing.assert_allclose(g_emb, g_dense, **TOL)
  np.testing.assert_allclose(np.diag(a_emb), np.diag(a_dense), **TOL)
  assert np.count_nonzero(a_emb - np.diag(np.diag(a_emb))) == 0
  if kind == "bag":
    # n-hot rows: the dense A has off-diagonal entries the embedding drops.
    assert np.abs(a_dense - np.diag(np.diag(a_dense))).max() > 0.1
    return
  np.testing.assert_allclose(a_emb, a_dense, **TOL)
  np.testing.assert_allclose(emb["full"], dense["full"], **TOL)
  for key in ("mult", "inv", "pow"):
    np.testing.assert_allclose(emb[key], dense[key], **INV_TOL)
  # and both equal the dense pi-damped Kronecker matrix (c = positions).
  c = SEQ if kind == "seq" else 1
  damped = c * ref.pi_damped_kron(a_emb, g_emb, damping / c)
  np.testing.assert_allclose(emb["full"], c * np.kron(a_emb, g_emb), **TOL)
  for key, e in (("mult", 1), ("inv", -1), ("pow", -0.5)):
    np.testing.assert_allclose(emb[key].reshape(-1),
                               ref.sym_matpower(damped, e) @ vec.reshape(-1),
                               **INV_TOL)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", ["onehot", "bag"])
def test_kron_equals_exact_fisher_for_one_example(world, kind):
  """One example: A (x) G is the exact Fisher for one id; for a bag, the
  exact block is c c^T (x) G (c the id counts) and K-FAC keeps the blocks
  of equal ids, diag(c^2) (x) G, i.e. the exact matrix with its
  different-id blocks removed."""
  ids, labels = _ids(kind, 1, seed=5), _labels(1, seed=6)
  if kind == "bag":
    ids = np.array([[2, 5, 2]], np.int32)
  store = util.new_store()

  def build(vs):
    lc = kfac.LayerCollection()
    _register(lc, kind, vs[0], ids, labels, dense=False)
    est, ops = util.estimator_stages(store, lc, vs, "exact")
    return ops + [est.blocks[0].full_fisher_block()]

  block = ref.run_stages(world, [_table()], build)[-1]
  exact = _exact_fisher(kind, ids, labels)
  same_id = np.kron(np.eye(VOCAB), np.ones((DIM, DIM)))
  np.testing.assert_allclose(block, exact * same_id, **TOL)
  if kind == "bag":
    assert np.abs(exact * (1 - same_id)).max() > 1e-3  # really dropped


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
@pytest.mark.parametrize("kind", ["onehot", "bag", "seq"])
def test_diagonal_equals_exact_fisher_diagonal(world, kind):
  ids, labels = _ids(kind, 6, seed=7), _labels(6, seed=8)
  ids[3] = ids[1]  # the same ids in two examples
  damping = 0.02
  vec = _vectors(9)
  store = util.new_store()

  def build(vs):
    lc = kfac.LayerCollection()
    _register(lc, kind, vs[0], ids, labels, dense=False, approx="diagonal")
    est, ops = util.estimator_stages(store, lc, vs, "exact", damping=damping)
    inv = est.multiply_inverse([(tf.constant(vec), vs[0])])[0][0]
    return ops + [(est.blocks[0].full_fisher_block(), inv,
                   tf.constant(type(est.blocks[0]).__name__))]

  block, inv, name = ref.run_stages(world, [_table()], build)[-1]
  assert name == b"EmbeddingDiagonalFB"
  exact = np.diag(_exact_fisher(kind, ids, labels))
  np.testing.assert_allclose(np.diag(block), exact, **TOL)
  assert np.count_nonzero(block - np.diag(np.diag(block))) == 0
  np.testing.assert_allclose(inv.reshape(-1), vec.reshape(-1) /
                             (exact + damping), **INV_TOL)


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
@pytest.mark.parametrize("approx", ["kron", "kron_out_diag", "diagonal"])
def test_indexed_slices_stay_sparse_and_equal_dense_products(world, approx):
  """IndexedSlices in, IndexedSlices out, only the given rows (duplicates
  kept), and densified they equal the products of the dense vector."""
  ids, labels = _ids("onehot", 5, seed=10), _labels(5, seed=11)
  indices = np.array([4, 1, 4, 6], np.int32)  # index 4 twice
  values = np.random.RandomState(12).randn(len(indices), DIM)
  dense_vec = np.zeros((VOCAB, DIM))
  np.add.at(dense_vec, indices, values)
  store = util.new_store()
  shapes = {}

  def build(vs):
    lc = kfac.LayerCollection()
    _register(lc, "onehot", vs[0], ids, labels, dense=False, approx=approx)
    est, ops = util.estimator_stages(store, lc, vs, "exact", damping=0.03,
                                     exps=(-1, 2), compute_cholesky=True,
                                     compute_cholesky_inverse=True)
    block = est.blocks[0]
    slices = tf.IndexedSlices(tf.constant(values), tf.constant(indices),
                              tf.constant([VOCAB, DIM]))
    fetch = {}
    products = {
        "inv": lambda v: est.multiply_inverse([(v, vs[0])])[0][0],
        "mult": lambda v: est.multiply([(v, vs[0])])[0][0],
        "pow2": lambda v: block.multiply_matpower(v, 2),
        "chol": block.multiply_cholesky,
        "chol_t": lambda v: block.multiply_cholesky(v, transpose=True),
        "chol_inv": block.multiply_cholesky_inverse,
    }
    for key, fn in products.items():
      sparse = fn(slices)
      assert isinstance(sparse, tf.IndexedSlices), key
      shapes[key] = sparse.values.shape.as_list()
      fetch[key] = (sparse.values, sparse.indices,
                    fn(tf.constant(dense_vec)))
    return ops + [fetch]

  out = ref.run_stages(world, [_table()], build)[-1]
  for key, (vals, idx, want) in out.items():
    assert shapes[key] == [len(indices), DIM]
    np.testing.assert_array_equal(idx, indices)
    got = np.zeros((VOCAB, DIM))
    np.add.at(got, idx, vals)
    np.testing.assert_allclose(got, want, **INV_TOL)


def test_towers_concatenate_like_one_batch():
  ids, labels = _ids("seq", 6, seed=13), _labels(6, seed=14)
  store = util.new_store()

  def build_towers(vs):
    lc = kfac.LayerCollection()
    for half, reuse in ((slice(0, 2), False), (slice(2, 6), True)):
      _, outputs, logits = _forward("seq", vs[0], tf.constant(ids[half]),
                                    dense=False)
      lc.register_embedding(vs[0], tf.constant(ids[half]), outputs,
                            reuse=reuse)
      lc.register_softmax_cross_entropy_loss(
          logits, targets=tf.constant(labels[half]), name="xent", reuse=reuse)
    assert lc.get_blocks()[0].num_registered_towers == 2
    est, ops = util.estimator_stages(store, lc, vs, "exact")
    return ops + [est.blocks[0].full_fisher_block()]

  towers = ref.run_stages("graph", [_table()], build_towers)[-1]
  store = util.new_store()

  def build_one(vs):
    lc = kfac.LayerCollection()
    _register(lc, "seq", vs[0], ids, labels, dense=False)
    est, ops = util.estimator_stages(store, lc, vs, "exact")
    return ops + [est.blocks[0].full_fisher_block()]

  np.testing.assert_allclose(
      towers, ref.run_stages("graph", [_table()], build_one)[-1], **TOL)


# ---------------------------------------------------------------- training
def _train_model(dense):
  """Embedding (one id per example, duplicates across the batch) -> tanh
  -> dense (W2, b2) -> softmax; the table is registered as an embedding
  (IndexedSlices gradients) or as a dense layer on one-hot inputs."""
  def model(vs, lc, inputs):
    del inputs
    ids = tf.constant([1, 4, 1, 0, 4, 6], tf.int32)
    labels = tf.constant([0, 2, 1, 1, 0, 2])
    w, w2, b2 = vs
    reg_in, out, _ = _forward("onehot", w, ids, dense)
    h = tf.tanh(out)
    logits = tf.matmul(h, w2) + b2
    lc.register_fully_connected(w, reg_in, out, dense_inputs=dense)
    lc.register_fully_connected((w2, b2), h, logits)
    lc.register_softmax_cross_entropy_loss(logits, targets=labels)
    return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits))
  return model


def train(world, inits, model_fn, opt_fn, steps):
  """`steps` minimize steps in a TF1 Session or a tf.function; returns
  [(loss before the step, [variables after it])]."""
  history = []
  if world == "graph":
    with tf.Graph().as_default():
      vs = [tf.Variable(v) for v in inits]
      lc = kfac.LayerCollection()
      loss = model_fn(vs, lc, None)
      train_op = opt_fn(lc).minimize(loss, var_list=vs)
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for _ in range(steps):
          value, _ = sess.run([loss, train_op])
          history.append((value, sess.run(vs)))
    return history
  vs = [tf.Variable(v) for v in inits]
  opt = opt_fn(None)

  @tf.function
  def step():
    lc = kfac.LayerCollection()
    loss = model_fn(vs, lc, None)
    opt.minimize(loss, var_list=vs, layer_collection=lc)
    return loss

  for _ in range(steps):
    value = step()
    history.append((value.numpy(), [v.numpy() for v in vs]))
  return history


_TRAIN_INITS = [_table(20), 0.5 * np.random.RandomState(21).randn(DIM, CLASSES),
                np.zeros(CLASSES)]


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
@pytest.mark.parametrize("config", [
    dict(momentum_type="regular", momentum=0.0, norm_constraint=0.02),
    dict(momentum_type="adam", momentum=0.5),
])
def test_training_with_indexed_slices_equals_dense_one_hot_training(world,
                                                                    config):
  kwargs = dict(learning_rate=0.4, damping=0.05, cov_ema_decay=0.0,
                estimation_mode="empirical", invert_every=1, **config)
  seen = []

  def opt_fn(lc):
    opt = kfac.PeriodicInvCovUpdateKfacOpt(layer_collection=lc, **kwargs)
    original = opt.apply_gradients

    def apply_gradients(grads_and_vars, *args, **kw):
      grads_and_vars = list(grads_and_vars)
      seen.append([type(g).__name__ for g, _ in grads_and_vars])
      return original(grads_and_vars, *args, **kw)
    opt.apply_gradients = apply_gradients
    return opt

  sparse = train(world, _TRAIN_INITS, _train_model(False), opt_fn, 3)
  assert seen[0][0] == "IndexedSlices" and seen[0][1] != "IndexedSlices"
  dense = train(world, _TRAIN_INITS, _train_model(True), opt_fn, 3)
  assert "IndexedSlices" not in seen[-1]
  for (loss_s, vals_s), (loss_d, vals_d) in zip(sparse, dense):
    np.testing.assert_allclose(loss_s, loss_d, rtol=1e-10)
    for a, b in zip(vals_s, vals_d):
      np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
  # the table moved, but untouched rows (2, 3, 5) did not
  table = sparse[-1][1][0]
  assert np.abs(table[[0, 1, 4, 6]] - _TRAIN_INITS[0][[0, 1, 4, 6]]).min() > 0
  np.testing.assert_array_equal(table[[2, 3, 5]], _TRAIN_INITS[0][[2, 3, 5]])


def test_zero_momentum_applies_a_sparse_update_and_clips_on_slices():
  """momentum=0: the step is a scatter_add of the touched rows; the norm
  constraint's <g, F^-1 g> sums duplicate indices first (checked against
  the value computed from the densified vectors)."""
  with tf.Graph().as_default() as graph:
    vs = [tf.Variable(v) for v in _TRAIN_INITS]
    lc = kfac.LayerCollection()
    loss = _train_model(False)(vs, lc, None)
    opt = kfac.KfacOptimizer(learning_rate=0.4, damping=0.05,
                             layer_collection=lc, momentum=0.0,
                             momentum_type="regular", norm_constraint=1e-3,
                             estimation_mode="empirical")
    grads_and_vars = opt.compute_gradients(loss, var_list=vs)
    grad = grads_and_vars[0][0]
    assert isinstance(grad, tf.IndexedSlices)
    precon = opt.estimator.multiply_inverse(grads_and_vars)
    assert isinstance(precon[0][0], tf.IndexedSlices)
    sq_sparse = opt._squared_fisher_norm(grads_and_vars, precon)  # pylint: disable=protected-access
    dense = [(tf.convert_to_tensor(g), v) for g, v in grads_and_vars]
    sq_dense = opt._squared_fisher_norm(  # pylint: disable=protected-access
        dense, [(tf.convert_to_tensor(p), v) for p, v in precon])
    naive = tf.reduce_sum(grad.values * precon[0][0].values)
    sq_other = opt._squared_fisher_norm(  # pylint: disable=protected-access
        grads_and_vars[1:], precon[1:])
    train_op = opt.apply_gradients(grads_and_vars)
    # (The update runs in the non-finite guard's conditional: its ops are
    # in a function of the graph's library.)
    graph_def = graph.as_graph_def()
    ops = [node.op for node in graph_def.node]
    ops += [node.op for fn in graph_def.library.function
            for node in fn.node_def]
    assert "ResourceScatterAdd" in ops
    cov_op = tf.group(*[f.make_covariance_update_op(0.0)
                        for f in opt.factors])
    inv_op = tf.group(*[op for f in opt.factors
                        for op in f.make_inverse_update_ops()])
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      sess.run(cov_op)
      sess.run(inv_op)
      a, b, naive, other = sess.run([sq_sparse, sq_dense, naive, sq_other])
      np.testing.assert_allclose(a, b, rtol=1e-12)
      # duplicates (ids 1 and 4 appear twice) make the per-slice sum wrong
      assert len(set(sess.run(grad.indices))) < len(sess.run(grad.indices))
      assert abs((naive + other) - a) > 1e-3 * abs(a)
      sess.run(train_op)


# ---------------------------------------------------------------- errors
def _graph_lc():
  g = tf.Graph()
  return g, kfac.LayerCollection()


@pytest.mark.parametrize("case,pattern", [
    ("float_ids", "must be integer ids"),
    ("dim", "table's dim"),
    ("ids_shape", "does not fit outputs"),
    ("bias", "table W alone"),
    ("approx", "does not support approximation 'full'"),
    ("default", "default fully-connected approximation"),
    ("table_rank", "shape \\[vocab, dim\\]"),
    ("towers", "same number of positions"),
])
def test_bad_registrations_name_the_table(case, pattern):
  with tf.Graph().as_default():
    w = tf.Variable(_table(), name="my_table")
    lc = kfac.LayerCollection()
    ids = tf.constant(_ids("seq", 4, seed=0))
    out = tf.gather(w, ids)
    args = dict(params=w, inputs=ids, outputs=out)
    if case == "float_ids":
      args["inputs"] = tf.cast(ids, tf.float64)
    elif case == "dim":
      args["outputs"] = out[..., :2]
    elif case == "ids_shape":
      args["inputs"] = ids[:, :1]
    elif case == "bias":
      args["params"] = (w, tf.Variable(np.zeros(DIM), name="my_bias"))
    elif case == "approx":
      args["approx"] = "full"
    elif case == "default":
      lc._defaults["fully_connected"] = "kron_reduce"  # pylint: disable=protected-access
    elif case == "table_rank":
      args["params"] = tf.Variable(np.zeros(VOCAB), name="my_table_1d")
    elif case == "towers":
      lc.register_embedding(w, ids, out)
      args["inputs"] = ids[:, :1]
      args["outputs"] = out[:, :1]
      args["reuse"] = True
    with pytest.raises(ValueError, match=pattern) as err:
      lc.register_fully_connected(dense_inputs=False, **args)
    assert re.search("my_table", str(err.value))


# ------------------------------------------------- multi-use lookups
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("folded", [False, True])
def test_multi_use_embedding_equals_the_per_position_registration(world,
                                                                  folded):
  """register_fully_connected_multi(dense_inputs=False) over T lookups is
  the kron_indep block T * (A (x) G): the same matrix, inverse and damping as
  registering the stacked [batch, T, dim] lookups as one embedding."""
  n, uses, damping = 5, 3, 0.05
  ids = np.random.RandomState(4).randint(0, VOCAB, (n, uses))
  rng = np.random.RandomState(5)
  vec = rng.randn(VOCAB, DIM)
  stores = [util.new_store(), util.new_store()]

  def build(vs):
    (table,) = vs
    ids_t = tf.constant(ids)
    emb = tf.gather(table, ids_t)            # [n, T, dim]
    # Time-major folded lookups [T * n, dim] on the path to the loss.
    folded_emb = tf.reshape(tf.transpose(emb, [1, 0, 2]), [-1, DIM])
    per_use = tf.split(folded_emb, uses)     # T x [n, dim]
    logits = tf.add_n([tf.matmul(tf.tanh(u), _head(DIM, seed=t))
                       for t, u in enumerate(per_use)])
    out = []
    for multi, store in zip((False, True), stores):
      lc = kfac.LayerCollection()
      if not multi:
        lc.register_fully_connected(table, ids_t, emb, dense_inputs=False)
      elif folded:
        lc.register_fully_connected_multi(
            table, tf.reshape(tf.transpose(ids_t), [-1]), folded_emb,
            num_uses=uses, dense_inputs=False)
      else:
        lc.register_fully_connected_multi(
            table, tf.unstack(ids_t, axis=1), per_use, dense_inputs=False)
      lc.register_softmax_cross_entropy_loss(
          logits, targets=tf.constant(np.arange(n) % CLASSES))
      est, ops = util.estimator_stages(store, lc, vs, "exact",
                                       damping=damping)
      (block,) = est.blocks
      out.append((ops, block, est))
    stages = out[0][0] + out[1][0]
    v = [(tf.constant(vec), table)]
    return stages + [[tf.identity(b.full_fisher_block()) for _, b, _ in out],
                     [est.multiply_inverse(v)[0][0] for _, _, est in out]]

  results = ref.run_stages(world, [_table(3)], build)
  blocks, inverses = results[-2], results[-1]
  np.testing.assert_allclose(blocks[1], blocks[0], **TOL)
  np.testing.assert_allclose(inverses[1], inverses[0], **INV_TOL)
  assert np.abs(blocks[0]).max() > 1e-3
  assert not np.allclose(inverses[1], vec, rtol=1e-2)


def test_multi_use_embedding_errors():
  with tf.Graph().as_default():
    table = tf.Variable(_table(), name="emb_table")
    ids = [tf.constant([1, 2]), tf.constant([3, 4])]
    outs = [tf.gather(table, i) for i in ids]
    lc = kfac.LayerCollection()
    with pytest.raises(ValueError, match="emb_table.*'kron_indep' only"):
      lc.register_fully_connected_multi(table, ids, outs, dense_inputs=False,
                                        approx="kron_series_1")
    with pytest.raises(ValueError, match="emb_table.*2 input uses but 1"):
      lc.register_fully_connected_multi(table, ids, outs[:1],
                                        dense_inputs=False)
    with pytest.raises(ValueError, match="emb_table.*integer ids"):
      lc.register_fully_connected_multi(
          table, [tf.ones([2]), tf.ones([2])], outs, dense_inputs=False)
    lc.register_fully_connected_multi(table, ids, outs, dense_inputs=False)
    with pytest.raises(ValueError, match="emb_table.*2 uses.*with 1"):
      lc.register_fully_connected_multi(table, ids[:1], outs[:1],
                                        dense_inputs=False, reuse=True)
