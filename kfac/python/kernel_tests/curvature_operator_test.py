"""kfac.linear_operator.CurvatureOperator / ExactCurvatureOperator against
dense float64 references.

The reference of a CurvatureOperator is built without the operator's
spectral views: each block's damped matrix from the block's own products
on unit vectors (`block.multiply(e_i)`), the undamped one from
`full_fisher_block()`, placed on the diagonal in the flattened order. Every
operator method is compared with the numpy computation on that matrix.
The exact GGN is compared with per-example Jacobians (reference.py).

Tolerances (float64): products, solves, powers, eigenvalues, trace,
determinant, Frobenius norm, diagonal and condition number within
RTOL = 1e-10 of the reference's largest entry (measured: at most 2.4e-15,
the determinant 1.4e-13), the log-determinant within 1e-10 absolute;
from_data and the EKFAC operator within 1e-10 (measured 9e-16; EKFAC
scalings against the exact Fisher 3e-15); conjugate gradients within 1e-8
of the direct solve (measured 7e-12; the exact GGN's K-FAC-preconditioned
CG 1.1e-10); the exact GGN against Jacobians within 1e-10 (measured
4e-16).
"""

import os
import tempfile

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import reference as ref
from kfac.python.ops.linear_operator import CurvatureOperator
from kfac.python.ops.linear_operator import ExactCurvatureOperator
from kfac.python.ops.linear_operator import spectral

RTOL = 1e-10
DAMPING = 0.05
N = 6


def _close(actual, expected, rtol=RTOL, what=""):
  actual, expected = np.asarray(actual), np.asarray(expected)
  scale = max(1e-300, float(np.max(np.abs(expected))))
  err = float(np.max(np.abs(actual - expected))) / scale
  assert err <= rtol, "%s: relative error %.3g > %.1g" % (what, err, rtol)
  return err


# ------------------------------------------------------------------ models
def _zoo_inits(seed=0):
  rng = np.random.RandomState(seed)
  shapes = [[2, 2, 2, 3], [3], [2, 2, 3, 1], [5, 2], [5, 4], [4], [4, 3],
            [3], [3]]
  return [0.6 * rng.randn(*s) for s in shapes]


def _zoo_data(seed=1, n=N):
  rng = np.random.RandomState(seed)
  return (rng.randn(n, 4, 4, 2), rng.randint(0, 5, n),
          rng.randint(0, 3, n))


def _zoo_model(vs, data, lc):
  """conv (kron) -> depthwise (per-channel kron) -> pool, embedding (kron,
  diagonal input factor), dense (kron), dense (diagonal), generic scale
  (full) and shift (diagonal)."""
  f1, c1, dw, table, w1, b1, w2, s, t = vs
  x, ids, labels = [tf.convert_to_tensor(d) for d in data]
  out1 = tf.nn.conv2d(x, f1, [1, 1, 1, 1], "VALID") + c1
  lc.register_conv2d((f1, c1), [1, 1, 1, 1], "VALID", x, out1)
  a1 = tf.tanh(out1)
  out2 = tf.nn.depthwise_conv2d(a1, dw, [1, 1, 1, 1], "VALID")
  lc.register_depthwise_conv2d(dw, a1, out2, [1, 1, 1, 1], "VALID",
                               approx="kron")
  pooled = tf.reduce_mean(tf.tanh(out2), axis=[1, 2])
  emb = tf.gather(table, ids)
  lc.register_embedding(table, ids, emb)
  h = tf.concat([pooled, emb], axis=1)
  pre = tf.matmul(h, w1) + b1
  lc.register_fully_connected((w1, b1), h, pre)
  a2 = tf.tanh(pre)
  z = tf.matmul(a2, w2)
  lc.register_fully_connected(w2, a2, z, approx="diagonal")
  logits = z * s + t
  lc.register_generic(s, N, approx="full")
  lc.register_generic(t, N, approx="diagonal")
  lc.register_softmax_cross_entropy_loss(logits, targets=labels)


def _variants_inits(seed=2):
  rng = np.random.RandomState(seed)
  shapes = [[4, 3], [3], [3], [3], [2, 2, 2, 1], [5, 4], [4], [4, 4],
            [4, 3], [2, 2, 2, 2], [2]]
  return [0.6 * rng.randn(*s) for s in shapes]


def _variants_data(seed=3, n=N):
  rng = np.random.RandomState(seed)
  return (rng.randn(n, 3, 4), rng.randn(n, 3, 3, 2), rng.randint(0, 3, n))


def _variants_model(vs, data, lc):
  """dense kron_reduce over positions, scale-and-shift (full), depthwise
  (diagonal, a rank-3 view), conv kron_sua, dense kron_in_diag and
  kron_out_diag, a tied dense layer (kron_indep)."""
  w0, b0, g, beta, dw, w1, b1, w2, w3, f, fb = vs
  seq, img, labels = [tf.convert_to_tensor(d) for d in data]
  pre0 = tf.matmul(seq, w0) + b0
  lc.register_fully_connected((w0, b0), seq, pre0, approx="kron_reduce")
  h = tf.reduce_mean(tf.tanh(pre0), axis=1)
  hs = h * g + beta
  lc.register_scale_and_shift((g, beta), h, hs, approx="full")
  d_out = tf.nn.depthwise_conv2d(img, dw, [1, 1, 1, 1], "VALID")
  lc.register_depthwise_conv2d(dw, img, d_out, [1, 1, 1, 1], "VALID",
                               approx="diagonal")
  c_out = tf.nn.conv2d(img, f, [1, 1, 1, 1], "VALID") + fb
  lc.register_conv2d((f, fb), [1, 1, 1, 1], "VALID", img, c_out,
                     approx="kron_sua")
  pooled = tf.reduce_mean(tf.tanh(d_out), axis=[1, 2])  # [N, 2]
  cpool = tf.reduce_mean(tf.tanh(c_out), axis=[1, 2])  # [N, 2]
  u = tf.concat([tf.tanh(hs), pooled], axis=1)  # [N, 5]
  p1 = tf.matmul(u, w1) + b1
  lc.register_fully_connected((w1, b1), u, p1, approx="kron_in_diag")
  a1 = tf.tanh(p1)
  p2 = tf.matmul(a1, w2)
  lc.register_fully_connected(w2, a1, p2, approx="kron_out_diag")
  a2 = tf.tanh(p2)
  o1, o2 = tf.matmul(a2, w3), tf.matmul(tf.tanh(a1), w3)
  lc.register_fully_connected_multi(w3, [a2, tf.tanh(a1)], [o1, o2])
  logits = o1 + 0.5 * o2 + tf.pad(cpool, [[0, 0], [0, 1]])
  lc.register_softmax_cross_entropy_loss(logits, targets=labels)


MODELS = {"zoo": (_zoo_model, _zoo_inits, _zoo_data),
          "variants": (_variants_model, _variants_inits, _variants_data)}


# ------------------------------------------------------------------ worlds
class _World:
  """A model with estimator statistics, in TF2 (eager operator, estimator
  built in a tf.function) or in a TF1 graph run by a Session."""

  def __init__(self, kind, model="zoo", damping=DAMPING, mode="exact"):
    """`model`: a name in MODELS or a (model, inits, data) triple."""
    self.kind = kind
    self._model, inits, data = MODELS.get(model, model)
    self._data = data
    self._damping = damping
    self._mode = mode
    self.store = kfac.state.StateStore("curvature_test")
    if kind == "graph":
      self._graph = tf.Graph()
      self._ctx = self._graph.as_default()
      self._ctx.__enter__()
      self.vs = [tf.Variable(v) for v in inits()]
      self.estimator, (cov_op, inv_op) = self._build(data())
      self.sess = tf.compat.v1.Session(graph=self._graph)
      self.sess.run(tf.compat.v1.global_variables_initializer())
      # Two runs: in one, the inverses' reads of the statistics would not
      # be ordered after the statistics' update (a TF1 graph).
      self.sess.run(cov_op)
      self.sess.run(inv_op)
    else:
      self.vs = [tf.Variable(v) for v in inits()]
      self.update(data())

  def _build(self, data):
    lc = kfac.LayerCollection()
    self._model(self.vs, data, lc)
    est = kfac.estimator.FisherEstimator(
        variables=lc.registered_variables, cov_ema_decay=0.5,
        damping=self._damping, layer_collection=lc,
        estimation_mode=self._mode, state_store=self.store)
    ops = est.make_vars_and_create_ops()
    return est, (ops.cov_update_op, ops.inv_update_op)

  def update(self, data):
    """One more statistics update (eager world: in a tf.function)."""
    holder = {}

    @tf.function
    def step():
      holder["est"], ops = self._build(data)
      with tf.control_dependencies(ops):
        return tf.constant(0)
    step()
    self.estimator = holder["est"]

  def run(self, fetches):
    if self.kind == "graph":
      return self.sess.run(fetches)
    return tf.nest.map_structure(
        lambda t: None if t is None else np.asarray(t), fetches)

  def operator(self, **kwargs):
    op = CurvatureOperator.from_estimator(self.estimator, **kwargs)
    if self.kind == "graph":
      self.sess.run(tf.compat.v1.variables_initializer(op.state_variables))
      self.sess.run(op.refresh())
    return op

  def reference(self, damped=True, undamped_blocks=None):
    """Dense [n, n] reference from the blocks' products / full blocks."""
    blocks, dtype = [], tf.float64
    for params, block in self.estimator.layers.blocks_and_params():
      seq = list(params) if isinstance(params, (list, tuple)) else [params]
      shapes = [v.shape.as_list() for v in seq]
      size = sum(int(np.prod(s)) for s in shapes)
      if not damped:
        blocks.append(tf.convert_to_tensor(block.full_fisher_block()))
        continue

      def column(unit, params=params, shapes=shapes, block=block):
        parts, start = [], 0
        for s in shapes:
          k = int(np.prod(s))
          parts.append(tf.reshape(unit[start:start + k], s))
          start += k
        vec = tuple(parts) if isinstance(params, (list, tuple)) else parts[0]
        out = block.multiply(vec)
        out = out if isinstance(out, (list, tuple)) else [out]
        return tf.concat([tf.reshape(o, [-1]) for o in out], 0)
      # Column i is block.multiply(e_i) (vectorized over the unit vectors
      # in a graph, where building one product per column is slow).
      eye = tf.eye(size, dtype=dtype)
      if self.kind == "graph":
        blocks.append(tf.transpose(tf.vectorized_map(
            column, eye, fallback_to_while_loop=False)))
      else:
        blocks.append(tf.stack([column(eye[i]) for i in range(size)], 1))
    mats = self.run(blocks)
    n = sum(m.shape[0] for m in mats)
    dense, start = np.zeros([n, n]), 0
    for m in mats:
      dense[start:start + m.shape[0], start:start + m.shape[0]] = m
      start += m.shape[0]
    return dense

  def close(self):
    if self.kind == "graph":
      self.sess.close()
      self._ctx.__exit__(None, None, None)


@pytest.fixture
def world_factory():
  made = []

  def make(*args, **kwargs):
    made.append(_World(*args, **kwargs))
    return made[-1]
  yield make
  for w in reversed(made):
    w.close()


def _sym_power(mat, p):
  evals, evecs = np.linalg.eigh(0.5 * (mat + mat.T))
  return (evecs * evals**p) @ evecs.T


# ------------------------------------------------------------------ tests
@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("world", [  # eager: the same math, slow tier
    pytest.param("eager", marks=pytest.mark.slow), "graph"])
@pytest.mark.parametrize("model", ["zoo", "variants"])
def test_every_method_equals_the_dense_reference(world_factory, world, model):
  w = world_factory(world, model)
  op = w.operator()
  dense = w.reference()
  n = dense.shape[0]
  assert op.shape.as_list() == [n, n] and op.dtype == tf.float64
  assert op.is_self_adjoint and op.is_positive_definite
  rng = np.random.RandomState(5)
  v, m = rng.randn(n), rng.randn(n, 3)
  half = op.power(0.5)
  fetch = w.run(dict(
      dense=op.to_dense(), matvec=op.matvec(v), matmul=op.matmul(m),
      matmul_t=op.matmul(m.T, adjoint_arg=True), batch=op.matvec(m.T),
      solvevec=op.solvevec(v), solve=op.solve(m),
      inverse=op.inverse().to_dense(), half=half.to_dense(),
      half_sq=half.matmul(half.to_dense()), neg=op.power(-0.5).to_dense(),
      eig=op.eigvals(), eig2=op.eigenvalues(), trace=op.trace(),
      logdet=op.log_abs_determinant(), det=op.determinant(),
      fro=op.frobenius_norm(), diag=op.diag_part(), cond=op.cond(),
      shape=op.shape_tensor()))
  inv = np.linalg.inv(dense)
  evals = np.linalg.eigvalsh(dense)
  _close(fetch["dense"], dense, what="to_dense")
  _close(fetch["matvec"], dense @ v, what="matvec")
  _close(fetch["matmul"], dense @ m, what="matmul")
  _close(fetch["matmul_t"], dense @ m, what="matmul(adjoint_arg)")
  _close(fetch["batch"], (dense @ m).T, what="batched matvec")
  _close(fetch["solvevec"], np.linalg.solve(dense, v), what="solvevec")
  _close(fetch["solve"], np.linalg.solve(dense, m), what="solve")
  _close(fetch["inverse"], inv, what="inverse")
  _close(fetch["half"], _sym_power(dense, 0.5), what="power(0.5)")
  _close(fetch["half_sq"], dense, what="power(0.5)^2")
  _close(fetch["neg"], _sym_power(dense, -0.5), what="power(-0.5)")
  _close(fetch["eig"], evals, what="eigvals")
  _close(fetch["eig2"], evals, what="eigenvalues")
  _close(fetch["trace"], np.trace(dense), what="trace")
  assert abs(fetch["logdet"] - np.linalg.slogdet(dense)[1]) <= 1e-10
  _close(fetch["det"], np.linalg.det(dense), what="determinant")
  _close(fetch["fro"], np.linalg.norm(dense), what="frobenius_norm")
  _close(fetch["diag"], np.diag(dense), what="diag_part")
  _close(fetch["cond"], np.linalg.cond(dense), rtol=1e-8, what="cond")
  assert list(fetch["shape"]) == [n, n]


def test_kronecker_blocks_equal_the_pi_damped_formula(world_factory):
  # Independent of the blocks' products: c (A + pi r I) (x) (G + r / pi I)
  # with r = sqrt(damping / c), for the dense and conv blocks of the zoo.
  w = world_factory("eager")
  op = w.operator()
  dense = op.to_dense().numpy()
  for block, sl in op.block_slices():
    if type(block).__name__ not in ("FullyConnectedKFACBasicFB",
                                    "ConvKFCBasicFB"):
      continue
    # pylint: disable=protected-access
    a = block._input_factor.get_cov().numpy()
    g = block._output_factor.get_cov().numpy()
    c = float(block._renorm_coeff)
    expected = c * ref.pi_damped_kron(a, g, DAMPING / c)
    _close(dense[sl, sl], expected, what=block.name)


@pytest.mark.parametrize("world", ["eager", "graph"])
def test_undamped_operator_equals_the_full_fisher_blocks(world_factory, world):
  w = world_factory(world, "zoo")
  op = w.operator(damped=False)
  assert op.is_positive_definite is None
  dense = w.reference(damped=False)
  v = np.random.RandomState(0).randn(dense.shape[0])
  fetch = w.run(dict(dense=op.to_dense(), matvec=op.matvec(v),
                     eig=op.eigvals(), trace=op.trace(),
                     fro=op.frobenius_norm(), half=op.power(0.5).to_dense()))
  _close(fetch["dense"], dense, what="to_dense")
  _close(fetch["matvec"], dense @ v, what="matvec")
  _close(fetch["eig"], np.linalg.eigvalsh(dense), what="eigvals")
  _close(fetch["trace"], np.trace(dense), what="trace")
  _close(fetch["fro"], np.linalg.norm(dense), what="frobenius")
  _close(fetch["half"] @ fetch["half"], dense, what="power(0.5)^2")


@pytest.mark.parametrize("world", ["eager", "graph"])
def test_eigenvalue_damping_adds_to_every_block_exactly(world_factory, world):
  """EigenvalueDamping(d): the undamped blocks plus d * I (Kronecker blocks
  too, where the default damping splits d between the factors)."""
  w = world_factory(world, "zoo")
  op = w.operator(damping=kfac.linear_operator.EigenvalueDamping(0.3))
  pi_split = w.operator(damping=0.3)
  dense = w.reference(damped=False) + 0.3 * np.eye(op.shape[0])
  v = np.random.RandomState(1).randn(dense.shape[0])
  fetch = w.run(dict(dense=op.to_dense(), solve=op.solvevec(v),
                     logdet=op.log_abs_determinant(),
                     other=pi_split.to_dense()))
  _close(fetch["dense"], dense, what="to_dense")
  _close(fetch["solve"], np.linalg.solve(dense, v), what="solve")
  _close(fetch["logdet"], np.linalg.slogdet(dense)[1], what="logdet")
  # The pi split adds more than 0.3 * I to the Kronecker blocks.
  assert np.abs(fetch["other"] - dense).max() > 1e-3


def test_other_damping_equals_an_estimator_with_that_damping(world_factory):
  # (The TF1 checkpoint test uses another damping in a graph.)
  w = world_factory("eager", "zoo", damping=0.3)
  expected = w.reference()
  w2 = world_factory("eager", "zoo", damping=DAMPING)
  op = w2.operator(damping=0.3)
  _close(op.to_dense(), expected, what="damping=0.3")


def test_conjugate_gradient_converges_to_solve(world_factory):
  w = world_factory("eager")
  op = w.operator()
  rhs = tf.constant(np.random.RandomState(1).randn(2, op.shape[0]))
  cg = tf.linalg.experimental.conjugate_gradient
  # Eagerly (a few steps: a Python loop) and in a tf.function.
  eager = cg(op, rhs, tol=1e-13, max_iter=3)
  assert int(eager.i) == 3
  result = tf.function(lambda b: cg(op, b, tol=1e-13, max_iter=1000))(rhs)
  assert int(result.i) < 1000
  _close(result.x, op.solvevec(rhs), rtol=1e-8, what="CG")
  # Preconditioned by the inverse: one step.
  pre = tf.function(lambda b: cg(op, b, preconditioner=op.inverse(),
                                 tol=1e-13, max_iter=5))(rhs)
  assert int(pre.i) <= 2
  _close(pre.x, op.solvevec(rhs), rtol=1e-8, what="preconditioned CG")


def test_refresh_in_tf_function_and_checkpoint_round_trip(world_factory):
  w = world_factory("eager")
  op = w.operator()
  v = np.random.RandomState(2).randn(op.shape[0])
  before = op.matvec(v).numpy()
  before_solve = op.solvevec(v).numpy()
  path = tf.train.Checkpoint(op=op).save(
      os.path.join(tempfile.mkdtemp(), "op"))
  # New statistics: the snapshot changes only when refreshed.
  w.update(_zoo_data(seed=7))
  np.testing.assert_array_equal(op.matvec(v).numpy(), before)
  tf.function(op.refresh)()
  after = op.matvec(v).numpy()
  assert np.max(np.abs(after - before)) > 1e-3
  _close(after, w.reference() @ v, what="refreshed in tf.function")
  # A new operator on the same model, restored: identical products.
  other = w.operator()
  tf.train.Checkpoint(op=other).restore(path).assert_consumed()
  np.testing.assert_array_equal(other.matvec(v).numpy(), before)
  np.testing.assert_array_equal(other.solvevec(v).numpy(), before_solve)


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_refresh_from_the_estimator_of_a_later_trace(world_factory):
  w = world_factory("eager")
  op = w.operator()
  data = _zoo_data(seed=8)

  @tf.function
  def step():
    est, update = w._build(data)  # pylint: disable=protected-access
    with tf.control_dependencies([update]):
      op.refresh(est)  # reads the statistics after the update
    return tf.constant(0)
  step()
  v = np.random.RandomState(4).randn(op.shape[0])
  _close(op.matvec(v), w.reference() @ v, what="refresh(source)")
  other = _World("eager", "variants")
  with pytest.raises(ValueError, match="other variables"):
    op.refresh(other.estimator)


def test_tf1_refresh_op_and_checkpoint(world_factory):
  w = world_factory("graph")
  op = w.operator()
  assert op.refresh() is op.refresh()  # one op per graph
  v = np.random.RandomState(3).randn(op.shape[0])
  prod = op.matvec(v)
  before = w.sess.run(prod)
  prefix = os.path.join(tempfile.mkdtemp(), "op")
  with w.sess.as_default():
    path = tf.train.Checkpoint(op=op).save(prefix)
  other = CurvatureOperator.from_estimator(w.estimator, damping=1.0)
  w.sess.run(tf.compat.v1.variables_initializer(other.state_variables))
  w.sess.run(other.refresh())
  assert np.max(np.abs(w.sess.run(other.matvec(v)) - before)) > 1e-3
  tf.train.Checkpoint(op=other).restore(path).run_restore_ops(w.sess)
  np.testing.assert_array_equal(w.sess.run(other.matvec(v)), before)


def test_flatten_unflatten_and_variables(world_factory):
  w = world_factory("eager")
  op = w.operator()
  assert [id(v) for v in op.variables] == [
      id(v) for v in w.estimator.layers.registered_variables]
  parts = [tf.random.normal(v.shape, dtype=tf.float64) for v in op.variables]
  flat = op.flatten(parts)
  assert flat.shape == [op.shape[0]]
  for a, b in zip(op.unflatten(flat), parts):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  # matvec of the flattened vector equals the estimator's blockwise product.
  expected = w.estimator.multiply(list(zip(parts, op.variables)))
  _close(op.matvec(flat), op.flatten([p for p, _ in expected]),
         what="estimator.multiply")


def test_bad_inputs_are_named(world_factory):
  w = world_factory("eager")
  op = w.operator()
  n = op.shape[0]
  with pytest.raises(ValueError, match="vectors of %d entries" % n):
    op.matvec(np.zeros(n - 1))
  with pytest.raises(ValueError, match="vectors of %d entries" % n):
    op.solve(np.zeros([n + 1, 2]))
  with pytest.raises(TypeError, match="float64"):
    op.matvec(tf.zeros([n], tf.float32))
  with pytest.raises(ValueError, match="takes 9 tensors"):
    op.flatten([tf.zeros([3])])
  with pytest.raises(ValueError, match="has shape"):
    op.flatten([tf.zeros([1])] * 9)
  with pytest.raises(ValueError, match="vectors of %d entries" % n):
    op.unflatten(np.zeros(3))
  with pytest.raises(TypeError, match="Python number"):
    op.power(tf.constant(2.0))
  with pytest.raises(TypeError, match="closure"):
    tf.function(lambda o: o.trace())(op)
  lc = kfac.LayerCollection()
  with tf.Graph().as_default():
    vs = [tf.Variable(v) for v in _zoo_inits()]
    _zoo_model(vs, _zoo_data(), lc)
    with pytest.raises(ValueError, match="no statistics yet"):
      CurvatureOperator(lc)
  with pytest.raises(TypeError, match="FisherEstimator or LayerCollection"):
    CurvatureOperator.from_estimator(object())


def test_dense_fallback_for_inverse_only_series_blocks(world_factory):
  del world_factory
  rng = np.random.RandomState(4)
  with tf.Graph().as_default():
    w = tf.Variable(0.5 * rng.randn(3, 3))
    xs = [tf.constant(rng.randn(N, 3)) for _ in range(3)]
    lc = kfac.LayerCollection()
    outs, h = [], xs[0]
    for t in range(3):
      h = tf.tanh(tf.matmul(h + xs[t], w))
      outs.append(h)
    ins = [xs[0]] + [outs[t] + xs[t + 1] for t in range(2)]
    pres = [tf.matmul(i, w) for i in ins]
    lc.register_fully_connected_multi(w, ins, pres, approx="kron_series_2")
    lc.register_softmax_cross_entropy_loss(
        pres[-1], targets=tf.constant(rng.randint(0, 3, N)))
    est = kfac.estimator.FisherEstimator(
        variables=[w], cov_ema_decay=0.5, damping=DAMPING,
        layer_collection=lc, estimation_mode="exact")
    ops = est.make_vars_and_create_ops()
    op = CurvatureOperator.from_estimator(est)
    assert spectral.block_kind(est.blocks[0]) == "dense"
    eye = tf.eye(9, dtype=tf.float64)
    inv_cols = tf.stack([tf.reshape(est.blocks[0].multiply_inverse(
        tf.reshape(eye[i], [3, 3])), [-1]) for i in range(9)], axis=1)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      sess.run(ops.cov_update_op)
      sess.run(ops.inv_update_op)
      sess.run(op.refresh())
      got, inv = sess.run([op.inverse().to_dense(), inv_cols])
    _close(got, 0.5 * (inv + inv.T), what="series inverse")
    with pytest.raises(ValueError, match="not available"):
      CurvatureOperator.from_estimator(est, damped=False)
    with pytest.raises(ValueError, match="estimator's own damping"):
      CurvatureOperator.from_estimator(est, damping=0.1)


# ------------------------------------------------------------------ from_data
def _mlp_model_fn(vs):
  def model_fn(batch, lc):
    x, labels = batch
    record = []
    logits = ref.mlp_forward(vs, x, record=record)
    for params, inputs, outputs in record:
      lc.register_fully_connected(params, inputs, outputs)
    lc.register_softmax_cross_entropy_loss(logits, targets=labels)
    return logits
  return model_fn


def _mlp_setup(seed=0, n=10):
  rng = np.random.RandomState(seed)
  inits = ref.mlp_inits((3, 4, 3), seed=seed)
  x, labels = rng.randn(n, 3), rng.randint(0, 3, n)
  return inits, x, labels


def _one_batch_reference(inits, x, labels, damping):
  """The operator of one estimator update on the whole data."""
  w = _World("eager", (lambda vs, data, lc: _mlp_model_fn(vs)(data, lc),
                       lambda: inits,
                       lambda: (tf.constant(x), tf.constant(labels))),
             damping=damping)
  return w.vs, w.operator().to_dense().numpy()


def test_from_data_is_the_mean_over_the_dataset(capsys):
  inits, x, labels = _mlp_setup()
  vs, expected = _one_batch_reference(inits, x, labels, DAMPING)
  for v, init in zip(vs, inits):
    v.assign(init)
  ds = tf.data.Dataset.from_tensor_slices((x, labels)).batch(4)  # 4, 4, 2
  op = CurvatureOperator.from_data(_mlp_model_fn(vs), ds, DAMPING,
                                   estimation_mode="exact", log_every=2)
  _close(op.to_dense(), expected, what="from_data")
  out = capsys.readouterr().out
  assert "pass 1: 2 batches, 8 examples" in out
  assert "3 batches, 10 examples" in out and "(done)" in out
  quiet = CurvatureOperator.from_data(_mlp_model_fn(vs), ds, DAMPING,
                                      estimation_mode="exact", verbose=0,
                                      steps=2)
  assert capsys.readouterr().out == ""
  assert quiet.shape == op.shape


def test_from_data_in_a_tf1_session():
  inits, x, labels = _mlp_setup()
  _, expected = _one_batch_reference(inits, x, labels, DAMPING)
  with tf.Graph().as_default():
    vs = [tf.Variable(v) for v in inits]
    ds = tf.data.Dataset.from_tensor_slices((x, labels)).batch(4)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.variables_initializer(vs))
      op = CurvatureOperator.from_data(_mlp_model_fn(vs), ds, DAMPING,
                                       estimation_mode="exact", verbose=0,
                                       session=sess)
      got = sess.run(op.to_dense())
      with pytest.raises(ValueError, match="session="):
        CurvatureOperator.from_data(_mlp_model_fn(vs), ds, DAMPING)
  _close(got, expected, what="from_data (TF1)")


def test_from_data_errors():
  inits, x, labels = _mlp_setup()
  vs = [tf.Variable(v) for v in inits]
  ds = tf.data.Dataset.from_tensor_slices((x, labels)).batch(4).repeat()
  with pytest.raises(ValueError, match="steps="):
    CurvatureOperator.from_data(_mlp_model_fn(vs), ds, DAMPING)
  with pytest.raises(TypeError, match="model_fn"):
    CurvatureOperator.from_data(None, ds, DAMPING, steps=1)


def test_from_data_ekfac_makes_two_passes(capsys):
  # EKFAC: the basis from pass 1, the eigenvalue corrections from pass 2.
  inits, x, labels = _mlp_setup(seed=3)
  vs = [tf.Variable(v) for v in inits]

  def model_fn(batch, lc):
    xb, yb = batch
    record = []
    logits = ref.mlp_forward(vs, xb, record=record)
    for params, inputs, outputs in record:
      lc.register_fully_connected(params, inputs, outputs, approx="ekfac")
    lc.register_softmax_cross_entropy_loss(logits, targets=yb)

  ds = tf.data.Dataset.from_tensor_slices((x, labels)).batch(5)
  op = CurvatureOperator.from_data(model_fn, ds, DAMPING,
                                   estimation_mode="exact")
  out = capsys.readouterr().out
  assert "pass 2 (eigenvalue corrections): 2 batches, 10 examples" in out
  blocks = op.layer_collection.get_blocks()
  assert all(spectral.block_kind(b) == "custom" for b in blocks)
  # The operator is the blocks' own products, and the corrections are the
  # exact diagonal of the whole-data Fisher block in the pass-1 basis.
  dense = op.to_dense().numpy()
  jacs = ref.per_example_jacobians(ref.mlp_forward, inits, x)
  logits = ref.outputs(ref.mlp_forward, inits, x)
  fisher = ref.curvature(jacs, [ref.categorical_fisher(z) for z in logits])
  for block, sl in op.block_slices():
    size = sl.stop - sl.start
    cols = []
    for i in range(size):
      unit = np.eye(size)[i]
      parts = (tf.constant(unit[:-block.ekfac_shape()[1]].reshape(
          -1, block.ekfac_shape()[1])), tf.constant(
              unit[-block.ekfac_shape()[1]:]))
      cols.append(np.concatenate([np.ravel(p) for p in
                                  block.multiply(parts)]))
    _close(dense[sl, sl], np.stack(cols, 1), what="ekfac " + block.name)
    q_in, q_out, _ = [None if t is None else t.numpy()
                      for t in block.spectral_view(damped=False)]
    basis = np.kron(q_in, q_out)
    rotated = basis.T @ fisher[sl, sl] @ basis
    evals = np.linalg.eigvalsh(basis.T @ (dense[sl, sl] - DAMPING *
                                          np.eye(size)) @ basis)
    _close(np.sort(evals), np.sort(np.diag(rotated)), rtol=1e-9,
           what="ekfac scalings " + block.name)


def test_from_data_mixed_ekfac_and_kron_in_tf1_equals_eager():
  inits, x, labels = _mlp_setup(seed=4)

  def model_fn_for(vs):
    def model_fn(batch, lc):
      xb, yb = batch
      record = []
      logits = ref.mlp_forward(vs, xb, record=record)
      for (params, inputs, outputs), approx in zip(record, ("ekfac", "kron")):
        lc.register_fully_connected(params, inputs, outputs, approx=approx)
      lc.register_softmax_cross_entropy_loss(logits, targets=yb)
    return model_fn

  def dataset():
    return tf.data.Dataset.from_tensor_slices((x, labels)).batch(4)
  vs = [tf.Variable(v) for v in inits]
  eager = CurvatureOperator.from_data(model_fn_for(vs), dataset(), DAMPING,
                                      estimation_mode="exact", verbose=0)
  with tf.Graph().as_default():
    vs = [tf.Variable(v) for v in inits]
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.variables_initializer(vs))
      op = CurvatureOperator.from_data(model_fn_for(vs), dataset(), DAMPING,
                                       estimation_mode="exact", verbose=0,
                                       session=sess)
      graph = sess.run(op.to_dense())
  _close(graph, eager.to_dense(), what="TF1 two passes")


# ------------------------------------------------------------------ exact
def _exact_setup(n=5, seed=0):
  rng = np.random.RandomState(seed)
  inits = ref.mlp_inits((3, 4, 3), seed=seed)
  x, labels = rng.randn(n, 3), rng.randint(0, 3, n)
  jacs = ref.per_example_jacobians(ref.mlp_forward, inits, x)
  logits = ref.outputs(ref.mlp_forward, inits, x)
  ggn = ref.curvature(jacs, [ref.categorical_fisher(z) for z in logits])
  return inits, (tf.constant(x), tf.constant(labels)), ggn


def test_exact_ggn_equals_brute_force_jacobians():
  inits, batch, ggn = _exact_setup()
  vs = [tf.Variable(v) for v in inits]
  op = ExactCurvatureOperator(_mlp_model_fn(vs), batch, curvature="ggn",
                              damping=DAMPING)
  n = ggn.shape[0]
  dense = ggn + DAMPING * np.eye(n)
  assert op.shape.as_list() == [n, n] and op.is_positive_definite
  v = np.random.RandomState(1).randn(2, n)
  _close(op.to_dense(), dense, what="exact to_dense")
  _close(op.matvec(v), v @ dense, what="exact matvec")
  _close(op.matmul(v.T), dense @ v.T, what="exact matmul")
  _close(op.solvevec(v), np.linalg.solve(dense, v.T).T, rtol=1e-8,
         what="exact CG solve")
  _close(op.trace(), np.trace(dense), what="exact trace")
  assert abs(op.log_abs_determinant() - np.linalg.slogdet(dense)[1]) < 1e-9
  _close(op.eigenvalues(), np.linalg.eigvalsh(dense), what="exact eigvals")


def test_exact_fisher_in_a_tf_function():
  # The Fisher of the softmax cross-entropy equals its GGN.
  inits, batch, ggn = _exact_setup()
  vs = [tf.Variable(v) for v in inits]
  dense = ggn + DAMPING * np.eye(ggn.shape[0])
  v = np.random.RandomState(1).randn(2, ggn.shape[0])
  fisher = ExactCurvatureOperator(_mlp_model_fn(vs), batch,
                                  curvature="fisher", damping=DAMPING)
  got = tf.function(lambda u: (fisher.matvec(u), fisher.solvevec(u)))(v)
  _close(got[0], v @ dense, what="fisher matvec (tf.function)")
  _close(got[1], np.linalg.solve(dense, v.T).T, rtol=1e-8, what="CG")


def test_exact_operator_in_a_tf1_graph_with_kfac_preconditioner():
  inits, (x, labels), ggn = _exact_setup()
  with tf.Graph().as_default():
    vs = [tf.Variable(v) for v in inits]
    batch = (tf.constant(x.numpy()), tf.constant(labels.numpy()))
    exact = ExactCurvatureOperator(_mlp_model_fn(vs), batch, damping=DAMPING)
    lc = kfac.LayerCollection()
    _mlp_model_fn(vs)(batch, lc)
    est = kfac.estimator.FisherEstimator(
        variables=lc.registered_variables, cov_ema_decay=0.5,
        damping=DAMPING, layer_collection=lc, estimation_mode="exact")
    ops = est.make_vars_and_create_ops()
    approx = CurvatureOperator.from_estimator(est)
    rhs = tf.constant(np.random.RandomState(2).randn(ggn.shape[0]))
    plain = exact.conjugate_gradient(rhs)
    pre = exact.conjugate_gradient(rhs, preconditioner=approx.inverse())
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      sess.run(ops.cov_update_op)
      sess.run(approx.refresh())
      plain, pre, rhs = sess.run([plain, pre, rhs])
  dense = ggn + DAMPING * np.eye(ggn.shape[0])
  _close(plain.x, np.linalg.solve(dense, rhs), rtol=1e-8, what="CG")
  _close(pre.x, np.linalg.solve(dense, rhs), rtol=1e-8, what="PCG")


def test_exact_operator_errors():
  inits, batch, _ = _exact_setup()
  vs = [tf.Variable(v) for v in inits]
  hess = ExactCurvatureOperator(_mlp_model_fn(vs), batch, curvature="hessian",
                                max_dense_size=10)
  with pytest.raises(ValueError, match="max_dense_size=10"):
    hess.to_dense()
  with pytest.raises(ValueError, match="max_dense_size=10"):
    hess.log_abs_determinant()
  with pytest.raises(ValueError, match="positive definite"):
    hess.solvevec(np.zeros(hess.shape[0]))
  with pytest.raises(ValueError, match="vectors of 31 entries"):
    hess.matvec(np.zeros(30))
  with pytest.raises(ValueError, match="curvature must be one of"):
    ExactCurvatureOperator(_mlp_model_fn(vs), batch, curvature="gnn")


@pytest.mark.slow  # imports TensorFlow Probability
def test_tensorflow_probability_accepts_the_operator(world_factory):
  # The "tests" extra installs TensorFlow Probability: no skip.
  import tensorflow_probability as tfp  # pylint: disable=g-import-not-at-top
  w = world_factory("eager")
  op = w.operator()
  dist = tfp.distributions.MultivariateNormalLinearOperator(
      loc=tf.zeros([op.shape[0]], tf.float64), scale=op.power(-0.5))
  x = tf.constant(np.random.RandomState(0).randn(op.shape[0]))
  dense = op.to_dense().numpy()
  n = dense.shape[0]
  expected = -0.5 * (x.numpy() @ dense @ x.numpy() + n * np.log(2 * np.pi) -
                     np.linalg.slogdet(dense)[1])
  _close(dist.log_prob(x), expected, what="log_prob")
  bijector = tfp.bijectors.ScaleMatvecLinearOperator(op)
  _close(bijector.forward(x), dense @ x.numpy(), what="bijector")
  _close(bijector.forward_log_det_jacobian(x, event_ndims=1),
         np.linalg.slogdet(dense)[1], what="bijector log-det")
