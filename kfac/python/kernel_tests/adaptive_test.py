"""Adaptive K-FAC: quadratic model, Levenberg-Marquardt damping, schedules.

References are float64 and independent of kfac's code: the 2x2 solves and
the damping rule are checked against numbers worked out by hand; the
optimizer's steps against numpy, where the exact curvature C of the mean
loss comes from per-example tape Jacobians, (1/N) sum_n J_n^T F_n J_n, and
the gradient and losses from tapes. The K-FAC preconditioner itself is not
what is tested here: blocks are generic "full" blocks, whose damped matrix
is exactly cov + damping I, and the reference reads their statistic from
the optimizer's state. Tolerance: relative 1e-9 (float64).

Both worlds: every optimizer check runs in a TF1 Session graph and in a
tf.function (the tf.function runs of the heaviest and of the repeated ones
in the slow tier: reference.WORLDS_TF2_SLOW).
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.ops.adaptive import mixin as adaptive
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref
from kfac.python.ops.adaptive import damping_rule as lm
from kfac.python.ops.adaptive import quadratic_model as qm

RTOL = 1e-9
WORLDS = ("graph", "function")
N = 5
SIZES = (3, 4, 3)


def _np(*values):
  return [float(tf.convert_to_tensor(v).numpy()) for v in values]


# ------------------------------------------------------------- 2x2 solves
def test_two_by_two_solve_matches_hand_computed_optimum():
  # M = [[2, 1], [1, 3]], c = [1, -2]: M^-1 c = [1, -1], so x = [-1, 1] and
  # q(x) = -1/2 c^T M^-1 c = -1.5.
  x1, x2 = _np(*qm.solve_two_by_two(2.0, 1.0, 3.0, 1.0, -2.0))
  assert (x1, x2) == pytest.approx((-1.0, 1.0), rel=1e-14)
  value, = _np(qm.model_value(x1, x2, 2.0, 1.0, 3.0, 1.0, -2.0))
  assert value == pytest.approx(-1.5, rel=1e-14)


@pytest.mark.parametrize("m, c, expected", [
    # first step: no previous update (M22 = 0): best multiple of p
    ((4.0, 0.0, 0.0), (2.0, 0.0), (-0.5, 0.0)),
    # p parallel to d (det M = 0): best multiple of p alone
    ((1.0, 2.0, 4.0), (3.0, 6.0), (-3.0, 0.0)),
    # zero gradient direction (M11 = 0): best multiple of d alone
    ((0.0, 0.0, 2.0), (0.0, 1.0), (0.0, -0.5)),
    # no curvature anywhere: no step
    ((0.0, 0.0, 0.0), (1.0, 1.0), (0.0, 0.0)),
])
def test_two_by_two_solve_degenerate_cases(m, c, expected):
  got = _np(*qm.solve_two_by_two(m[0], m[1], m[2], c[0], c[1]))
  assert got == pytest.approx(expected, rel=1e-14, abs=1e-300)


def test_fixed_momentum_solve():
  # minimise q(x1, 0.5) with M = [[2, 1], [1, 3]], c = [1, -2]:
  # dq/dx1 = 2 x1 + 0.5 + 1 = 0 -> x1 = -0.75.
  x1, = _np(qm.solve_fixed_second(2.0, 1.0, 1.0, 0.5))
  assert x1 == pytest.approx(-0.75, rel=1e-14)
  assert _np(qm.solve_fixed_second(0.0, 1.0, 1.0, 0.5)) == [0.0]


def _kkt_check(x, m, c, bound):
  """Asserts that x minimises q(x) = 1/2 x^T M x + c^T x (M positive
  definite) over |x2| <= bound, by the Karush-Kuhn-Tucker conditions
  (sufficient for a convex q) and against 20000 random feasible points;
  independent of the closed form under test."""
  m = np.array([[m[0], m[1]], [m[1], m[2]]])
  c = np.array(c)
  x = np.array(x)
  grad = m @ x + c
  scale = np.abs(m).max() * max(1.0, np.abs(x).max()) + np.abs(c).max()
  assert abs(x[1]) <= bound * (1 + 1e-15)
  assert abs(grad[0]) <= 1e-12 * scale  # free in x1
  if abs(x[1]) < bound:
    assert abs(grad[1]) <= 1e-12 * scale  # interior in x2
  else:  # at an end: moving inside does not lower q
    assert grad[1] * np.sign(x[1]) <= 1e-12 * scale
  def q(v):
    return 0.5 * np.einsum("ni,ij,nj->n", v, m, v) + v @ c
  rng = np.random.RandomState(0)
  spread = 10 * (np.abs(x).max() + 1)
  points = np.stack([x[0] + spread * rng.uniform(-1, 1, 20000),
                     rng.uniform(-bound, bound, 20000)], 1)
  assert q(points).min() >= q(x[None])[0] - 1e-12 * abs(q(x[None])[0])


@pytest.mark.parametrize("bound", [0.5, 1.0, 2.0])
def test_bounded_momentum_solve_is_the_constrained_minimiser(bound):
  """solve_bounded_second on random positive definite models, some whose
  unconstrained momentum lies outside the bound and some inside, and on a
  nearly collinear p and d at a tiny damping (the GRU's case, docs/recipe.md:
  the unconstrained x2 there is about -80)."""
  rng = np.random.RandomState(int(bound * 10))
  cases = []
  for _ in range(40):
    a = rng.randn(2, 2)
    m = a @ a.T + 1e-3 * np.eye(2)
    cases.append(((m[0, 0], m[0, 1], m[1, 1]), tuple(rng.randn(2) * 3)))
  cases.append(((1.0, 0.999, 0.998 + 1e-4), (0.5, 0.6)))
  outside = 0
  for m, c in cases:
    free = _np(*qm.solve_two_by_two(*m, *c))
    x = _np(*qm.solve_bounded_second(*m, *c, bound))
    _kkt_check(x, m, c, bound)
    if abs(free[1]) <= bound:
      assert x == pytest.approx(free, rel=1e-14)  # the bound is inactive
    else:
      outside += 1
      assert abs(x[1]) == bound
  assert outside >= 5  # the bound was active in several cases
  assert abs(_np(*qm.solve_two_by_two(*cases[-1][0], *cases[-1][1]))[1]) > 50


def test_bounded_momentum_solve_degenerate_cases():
  # No curvature along p (M11 = 0): the best multiple of d alone, -5, is
  # bounded to -1 and p keeps the coefficient 0.
  assert _np(*qm.solve_bounded_second(0.0, 0.0, 2.0, 0.0, 10.0, 1.0)) == [
      0.0, -1.0]
  # First step (d = 0): nothing to bound.
  assert _np(*qm.solve_bounded_second(4.0, 0.0, 0.0, 2.0, 0.0, 1.0)) == [
      -0.5, 0.0]
  # None: kfac 0.2.x's unbounded solve.
  assert _np(*qm.solve_bounded_second(1.0, 0.5, 1.0, 0.0, 4.0, None)) == (
      pytest.approx(_np(*qm.solve_two_by_two(1.0, 0.5, 1.0, 0.0, 4.0)),
                    rel=1e-15))


# ------------------------------------------------------------- LM rule
@pytest.mark.parametrize("rho, factor", [
    (0.1, 1 / 0.9**2),   # below the increase threshold: damping / omega
    (0.5, 1.0),          # between the thresholds: unchanged
    (0.9, 0.9**2),       # above the decrease threshold: damping * omega
    (float("nan"), 1 / 0.9**2),  # meaningless ratio counts as poor
    (-3.0, 1 / 0.9**2),  # the loss went up
])
def test_lm_rule_moves_damping_the_right_way(rho, factor):
  new, = _np(lm.adapted_damping(0.1, rho, decay=0.9, interval=2, lower=0.25,
                                upper=0.75, min_damping=1e-8))
  assert new == pytest.approx(0.1 * factor, rel=1e-14)


def test_lm_rule_respects_the_floor():
  new, = _np(lm.adapted_damping(1e-3, 0.99, decay=0.5, interval=1,
                                lower=0.25, upper=0.75, min_damping=8e-4))
  assert new == 8e-4
  new, = _np(lm.adapted_damping(1e-3, 0.99, decay=0.5, interval=1,
                                lower=0.25, upper=0.75, min_damping=1e-4))
  assert new == pytest.approx(5e-4, rel=1e-14)


def test_reduction_ratio():
  assert _np(lm.reduction_ratio(2.0, 1.5, -1.0)) == [0.5]
  # a model that predicts no decrease gives NaN (never a division by 0)
  assert np.isnan(_np(lm.reduction_ratio(2.0, 1.5, 0.0))[0])
  assert np.isnan(_np(lm.reduction_ratio(2.0, 1.5, 0.3))[0])


@pytest.mark.parametrize("kwargs, match", [
    (dict(damping_adaptation_decay=1.5), "damping_adaptation_decay"),
    (dict(damping_adaptation_interval=0), "damping_adaptation_interval"),
    (dict(damping_increase_rho_threshold=0.8), "must be below"),
    (dict(min_damping=-1.0), "min_damping"),
])
def test_lm_rule_argument_errors(kwargs, match):
  args = dict(damping_adaptation_decay=0.95, damping_adaptation_interval=5,
              damping_increase_rho_threshold=0.25,
              damping_decrease_rho_threshold=0.75, min_damping=1e-8)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    kfac.KfacOptimizer(learning_rate=0.1, damping=0.1, adapt_damping=True,
                       loss_fn=lambda b: 0.0, **args)


# ------------------------------------------------------------- references
def _loss(params, x, labels):
  logits = ref.mlp_forward(params, x)
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))


class Reference:
  """Float64 numpy/tape quantities of the tiny MLP at given parameters."""

  def __init__(self, params, x, labels):
    self.params = [np.asarray(p, np.float64) for p in params]
    self.x, self.labels = x, labels

  def loss(self):
    return float(_loss([tf.constant(p) for p in self.params],
                       tf.constant(self.x), tf.constant(self.labels)))

  def grad(self):
    variables = [tf.Variable(p) for p in self.params]
    with tf.GradientTape() as tape:
      value = _loss(variables, tf.constant(self.x), tf.constant(self.labels))
    return ref.flat([g.numpy() for g in tape.gradient(value, variables)])

  def curvature(self):
    jacs = ref.per_example_jacobians(ref.mlp_forward, self.params, self.x)
    logits = ref.outputs(ref.mlp_forward, self.params, self.x)
    return ref.curvature(jacs, [ref.categorical_fisher(z) for z in logits])


def _block_diag(mats):
  size = sum(m.shape[0] for m in mats)
  out = np.zeros([size, size])
  i = 0
  for m in mats:
    out[i:i + m.shape[0], i:i + m.shape[0]] = m
    i += m.shape[0]
  return out


class Trainer:
  """One K-FAC training step per call, in a TF1 Session or a tf.function.

  The MLP's layers are generic "full" blocks (damped matrix cov + lambda I),
  the loss is the mean softmax cross-entropy; `step(batch, prev_batch)`
  runs the optimizer's training op on batch = (x, labels).
  """

  def __init__(self, world, inits, opt_kwargs, set_batches=True):
    self.world = world
    opt_kwargs = dict(opt_kwargs)
    # qmodel_rows=M: the quadratic model's curvature on the batch's first M
    # rows (a qmodel_layer_collection set on every trace).
    self.qmodel_rows = opt_kwargs.pop("qmodel_rows", None)
    self.set_batches = set_batches and (opt_kwargs.get("adapt_damping") or
                                        opt_kwargs.get("calibrate_damping"))
    self.opt_kwargs = dict(opt_kwargs)
    if world == "graph":
      self.graph = tf.Graph()
      with self.graph.as_default():
        self._build_graph(inits)
    else:
      self._build_function(inits)

  def _make_opt(self):
    kwargs = dict(invert_every=1, cov_ema_decay=0.5, estimation_mode="exact",
                  batch_size=N, dtype="float64")
    kwargs.update(self.opt_kwargs)
    if kwargs.get("adapt_damping") or kwargs.get("calibrate_damping"):
      kwargs.setdefault("loss_fn", lambda b: _loss(self.variables, *b))
    return kfac.PeriodicInvCovUpdateKfacOpt(**kwargs)

  def _train_op(self, x, labels, prev):
    lc = kfac.LayerCollection()
    logits = util.register_mlp(self.variables, x, lc, generic="full",
                               batch_size=N)
    lc.register_softmax_cross_entropy_loss(logits, targets=labels)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits))
    if self.qmodel_rows is not None:
      rows = self.qmodel_rows
      sub = kfac.LayerCollection()
      sub.register_softmax_cross_entropy_loss(
          ref.mlp_forward(self.variables, x[:rows]), targets=labels[:rows])
      self.opt.set_qmodel_layer_collection(sub)
    if self.set_batches:
      self.opt.set_train_batch((x, labels))
      self.opt.set_prev_train_batch(prev)
    return self.opt.minimize(loss, var_list=self.variables,
                             layer_collection=lc)

  def _build_graph(self, inits):
    self.variables = [tf.Variable(v) for v in inits]
    self.opt = self._make_opt()
    self.x = tf.compat.v1.placeholder(tf.float64, [N, SIZES[0]])
    self.y = tf.compat.v1.placeholder(tf.int32, [N])
    self.px = tf.compat.v1.placeholder(tf.float64, [N, SIZES[0]])
    self.py = tf.compat.v1.placeholder(tf.int32, [N])
    self.op = self._train_op(self.x, self.y, (self.px, self.py))
    self.sess = tf.compat.v1.Session(graph=self.graph)
    self.sess.run(tf.compat.v1.global_variables_initializer())

  def _build_function(self, inits):
    self.variables = [tf.Variable(v) for v in inits]
    self.opt = self._make_opt()

    @tf.function
    def step(x, y, px, py):
      self._train_op(x, y, (px, py))
    self._step = step

  def step(self, batch, prev=None):
    prev = batch if prev is None else prev
    if self.world == "graph":
      self.sess.run(self.op, {self.x: batch[0], self.y: batch[1],
                              self.px: prev[0], self.py: prev[1]})
    else:
      self._step(*(tf.constant(v) for v in batch + prev))

  def read(self, tensors):
    """numpy values of a structure of tensors built by `tensors()`."""
    if self.world == "graph":
      with self.graph.as_default():
        return self.sess.run(tensors())
    return tf.nest.map_structure(lambda t: t.numpy(), tensors())

  def params(self):
    return self.read(lambda: [tf.convert_to_tensor(v)
                              for v in self.variables])

  def records(self):
    return self.read(lambda: dict(
        learning_rate=self.opt.learning_rate, momentum=self.opt.momentum,
        qmodel_change=self.opt.qmodel_change, rho=self.opt.rho,
        damping=self.opt.damping))

  def inverses(self):
    """{name: value} of the factors' inverse variables."""
    return self.read(lambda: {
        k: tf.convert_to_tensor(v) for k, v in
        self.opt.state_store.variables_by_name.items()
        if "/matpow" in k or "/chol" in k})

  def precon_matrix(self, damping):
    """Dense damped K-FAC matrix: the generic blocks' statistics + damping."""
    state = self.read(lambda: {k: tf.convert_to_tensor(v) for k, v in
                               self.opt.state_store.variables_by_name.items()
                               if k.endswith("/cov")})
    sizes = [SIZES[i] * SIZES[i + 1] + SIZES[i + 1]
             for i in range(len(SIZES) - 1)]
    covs = sorted(state.values(), key=lambda m: -m.shape[0])
    assert [c.shape[0] for c in covs] == sorted(sizes, reverse=True)
    covs = {c.shape[0]: c for c in covs}
    mat = _block_diag([covs[s] for s in sizes])
    return mat + damping * np.eye(mat.shape[0])


def _batches(num, seed=0):
  return [util.data(N, seed=seed + i, sizes=SIZES) for i in range(num)]


def _inits(seed=0):
  return ref.mlp_inits(SIZES, seed=seed)


def _qmodel_reference(reference, precon_mat, prev_delta, damping, l2_reg,
                      fixed_mu=None, rescale=1.0, curvature=None,
                      bound=None):
  """(delta, -alpha, mu, model change) of one quadratic-model step
  (`curvature`: C of the model if not the batch's, `reference`'s; `bound`:
  the momentum's bound, the learning rate then the model's best for the
  bounded momentum)."""
  g = reference.grad()
  c_mat = reference.curvature() if curvature is None else curvature
  p = np.linalg.solve(precon_mat, g)
  d = prev_delta
  vecs = np.stack([p, d], 1)
  gram = vecs.T @ c_mat @ vecs
  dots = vecs.T @ vecs
  m_solve = gram + (damping + l2_reg) * dots
  c = vecs.T @ g
  if fixed_mu is not None:
    alpha = -(c[0] + fixed_mu * m_solve[0, 1]) / m_solve[0, 0]
    x = np.array([alpha, fixed_mu])
  elif not np.any(d):
    x = np.array([-c[0] / m_solve[0, 0], 0.0])
  else:
    x = -np.linalg.solve(m_solve, c)
    if bound is not None and abs(x[1]) > bound:
      mu = np.sign(x[1]) * bound
      x = np.array([-(c[0] + mu * m_solve[0, 1]) / m_solve[0, 0], mu])
  x = x * rescale
  m_model = gram + l2_reg * dots
  change = 0.5 * x @ m_model @ x + x @ c
  return vecs @ x, -x[0], x[1], change


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
@pytest.mark.parametrize("variant", ["qmodel", "fixedmu", "rescale_l2",
                                     "sub_batch"])
def test_qmodel_steps_match_the_exact_quadratic_model(world, variant):
  """sub_batch: the model's curvature C is that of the mean loss over the
  batch's first 3 of 5 rows (qmodel_layer_collection), the gradient and
  the preconditioner the whole batch's."""
  damping, l2_reg, fixed_mu, rescale = 0.05, 0.0, None, 1.0
  rows = None
  kwargs = dict(learning_rate=None, momentum=None, momentum_type="qmodel",
                damping=damping)
  if variant == "fixedmu":
    fixed_mu = 0.7
    kwargs.update(momentum_type="qmodel_fixedmu", momentum=fixed_mu)
  elif variant == "rescale_l2":
    l2_reg, rescale = 0.01, 0.8
    kwargs.update(l2_reg=l2_reg, qmodel_update_rescale=rescale)
  elif variant == "sub_batch":
    rows = 3
    kwargs.update(qmodel_rows=rows)
  trainer = Trainer(world, _inits(), kwargs)
  prev_delta = np.zeros(sum(p.size for p in _inits()))
  for t, batch in enumerate(_batches(3)):
    before = trainer.params()
    trainer.step(batch)
    after = trainer.params()
    delta = ref.flat(after) - ref.flat(before)
    precon = trainer.precon_matrix(damping + l2_reg)
    curvature = None if rows is None else Reference(
        before, batch[0][:rows], batch[1][:rows]).curvature()
    want, lr, mu, change = _qmodel_reference(
        Reference(before, *batch), precon, prev_delta, damping, l2_reg,
        fixed_mu=fixed_mu, rescale=rescale, curvature=curvature)
    if rows is not None and t == 0:  # the rows' C is not the batch's
      assert not np.allclose(curvature, Reference(before, *batch).curvature(),
                             rtol=0.05)
    np.testing.assert_allclose(delta, want, rtol=RTOL, atol=1e-14,
                               err_msg="step %d" % t)
    rec = trainer.records()
    assert rec["learning_rate"] == pytest.approx(lr, rel=RTOL)
    assert rec["momentum"] == pytest.approx(mu, rel=RTOL, abs=1e-15)
    assert rec["qmodel_change"] == pytest.approx(change, rel=RTOL)
    assert change < 0  # the model predicts a decrease
    if t > 0 and variant != "fixedmu":
      assert mu != 0  # the momentum direction was used
    prev_delta = delta


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
def test_qmodel_steps_with_a_momentum_bound(world):
  """qmodel_momentum_bound: each step's update is alpha p + mu d with mu
  the unconstrained model's momentum clipped to the bound and alpha the
  model's best for it; the bound binds on some of the steps."""
  damping, bound = 0.05, 0.02
  trainer = Trainer(world, _inits(), dict(
      learning_rate=None, momentum=None, momentum_type="qmodel",
      damping=damping, qmodel_momentum_bound=bound))
  prev_delta = np.zeros(sum(p.size for p in _inits()))
  bound_steps = 0
  for t, batch in enumerate(_batches(4)):
    before = trainer.params()
    trainer.step(batch)
    delta = ref.flat(trainer.params()) - ref.flat(before)
    reference = Reference(before, *batch)
    precon = trainer.precon_matrix(damping)
    want, lr, mu, change = _qmodel_reference(
        reference, precon, prev_delta, damping, 0.0, bound=bound)
    _, _, free_mu, _ = _qmodel_reference(reference, precon, prev_delta,
                                         damping, 0.0)
    bound_steps += abs(free_mu) > bound
    np.testing.assert_allclose(delta, want, rtol=RTOL, atol=1e-14,
                               err_msg="step %d" % t)
    rec = trainer.records()
    assert rec["learning_rate"] == pytest.approx(lr, rel=RTOL)
    assert rec["momentum"] == pytest.approx(mu, rel=RTOL, abs=1e-15)
    assert abs(rec["momentum"]) <= bound * (1 + 1e-12)
    assert rec["qmodel_change"] == pytest.approx(change, rel=RTOL)
    prev_delta = delta
  assert bound_steps >= 1, "the bound never bound: choose a smaller one"


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
@pytest.mark.parametrize("thresholds, direction", [
    ((-10.0, -5.0), "down"),    # rho above the decrease threshold
    ((-10.0, 10.0), "same"),    # rho between the thresholds
    ((5.0, 10.0), "up"),        # rho below the increase threshold
])
def test_immediate_damping_rule_on_the_same_batch(world, thresholds,
                                                  direction):
  """rho = (loss after - loss before) / qmodel_change of the same update on
  the same batch; the damping moves as the rule says."""
  damping = 0.05
  trainer = Trainer(world, _inits(), dict(
      learning_rate=None, momentum=None, momentum_type="qmodel",
      damping=damping, adapt_damping=True, damping_adaptation_interval=1,
      damping_adaptation_decay=0.9, damping_increase_rho_threshold=
      thresholds[0], damping_decrease_rho_threshold=thresholds[1]))
  for batch in _batches(2):
    before = trainer.params()
    rec_before = trainer.records()
    trainer.step(batch)
    rec = trainer.records()
    loss_before = Reference(before, *batch).loss()
    loss_after = Reference(trainer.params(), *batch).loss()
    rho = (loss_after - loss_before) / rec["qmodel_change"]
    assert rec["rho"] == pytest.approx(rho, rel=1e-7)
    factor = {"down": 0.9, "same": 1.0, "up": 1 / 0.9}[direction]
    assert rec["damping"] == pytest.approx(rec_before["damping"] * factor,
                                           rel=1e-7)


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
@pytest.mark.parametrize("momentum_type", ["regular", "adam"])
@pytest.mark.parametrize("exact", [False, True])
def test_model_change_of_a_fixed_learning_rate_update(world, momentum_type,
                                                      exact):
  """With adapt_damping, regular / adam updates get the model change
  1/2 delta^T B delta + g^T delta with B the damped K-FAC matrix (default),
  or the exact 1/2 delta^T (C + l2 I) delta + g^T delta."""
  l2_reg, damping = 0.02, 0.1
  trainer = Trainer(world, _inits(), dict(
      learning_rate=0.3, momentum=0.5, momentum_type=momentum_type,
      damping=damping, l2_reg=l2_reg, adapt_damping=True,
      damping_adaptation_interval=1,
      always_use_exact_qmodel_for_damping_adjustment=exact))
  for batch in _batches(2):
    before = trainer.params()
    damping = trainer.records()["damping"]
    trainer.step(batch)
    delta = ref.flat(trainer.params()) - ref.flat(before)
    reference = Reference(before, *batch)
    if exact:
      curvature = reference.curvature() + l2_reg * np.eye(delta.size)
    else:
      curvature = trainer.precon_matrix(damping + l2_reg)
    want = 0.5 * delta @ curvature @ delta + reference.grad() @ delta
    assert trainer.records()["qmodel_change"] == pytest.approx(want,
                                                               rel=RTOL)


def test_kfac_model_change_needs_a_block_with_multiply():
  """kron_series blocks define only their inverse: the default (K-FAC
  matrix) model change says how to get the exact one instead."""
  with tf.Graph().as_default():
    w = tf.Variable(np.eye(3) * 0.5)
    xs = [tf.constant(np.random.RandomState(i).randn(4, 3)) for i in range(2)]
    outs = [tf.matmul(x, w) for x in xs]
    lc = kfac.LayerCollection()
    lc.register_fully_connected_multi(w, xs, outs, approx="kron_series_2")
    for i, o in enumerate(outs):
      lc.register_squared_error_loss(o, name="l", reuse=i > 0)
    loss = tf.add_n([tf.reduce_sum(tf.square(o)) for o in outs])
    opt = kfac.PeriodicInvCovUpdateKfacOpt(
        learning_rate=0.1, damping=0.1, layer_collection=lc,
        adapt_damping=True, loss_fn=lambda b: loss, train_batch=(),
        damping_adaptation_interval=1, dtype="float64")
    with pytest.raises(NotImplementedError,
                       match="always_use_exact_qmodel_for_damping"):
      opt.minimize(loss, var_list=[w])


@pytest.mark.parametrize("world", WORLDS)
def test_delayed_damping_rule_uses_the_previous_batch(world):
  """update_damping_immediately=False: the step after an adaptation step
  evaluates the previous batch at the new parameters; rho compares it with
  the loss of that batch before the update."""
  trainer = Trainer(world, _inits(), dict(
      learning_rate=None, momentum=None, momentum_type="qmodel",
      damping=0.05, adapt_damping=True, damping_adaptation_interval=2,
      update_damping_immediately=False, damping_adaptation_decay=0.9))
  batches = _batches(4)
  history = []
  for t, batch in enumerate(batches):
    history.append((trainer.params(), trainer.records()))
    trainer.step(batch, prev=batches[t - 1] if t else batch)
  history.append((trainer.params(), trainer.records()))
  # step 0 adapts: kept; step 1 evaluates batch 0 at the parameters after
  # step 0.
  p0, _ = history[0]
  p1, rec1 = history[1]
  _, rec2 = history[2]
  rho = ((Reference(p1, *batches[0]).loss() - Reference(p0, *batches[0])
          .loss()) / rec1["qmodel_change"])
  assert rec2["rho"] == pytest.approx(rho, rel=1e-7)
  new = float(lm.adapted_damping(rec1["damping"], rho, 0.9, 2, 0.25, 0.75,
                                 1e-8))
  assert rec2["damping"] == pytest.approx(new, rel=1e-7)
  assert np.isnan(rec1["rho"])  # nothing evaluated during step 0
  # step 2 adapts again (kept), step 3 evaluates batch 2.
  p2, _ = history[2]
  p3, rec3 = history[3]
  _, rec4 = history[4]
  rho = ((Reference(p3, *batches[2]).loss() - Reference(p2, *batches[2])
          .loss()) / rec3["qmodel_change"])
  assert rec4["rho"] == pytest.approx(rho, rel=1e-7)
  assert rec3["rho"] == rec2["rho"]


@pytest.mark.parametrize("world", WORLDS)
def test_use_passed_loss_false_and_non_chief(world):
  batch = _batches(1)[0]
  trainer = Trainer(world, _inits(), dict(
      learning_rate=None, momentum=None, momentum_type="qmodel",
      damping=0.05, adapt_damping=True, damping_adaptation_interval=1,
      use_passed_loss=False))
  before = trainer.params()
  trainer.step(batch)
  rec = trainer.records()
  rho = ((Reference(trainer.params(), *batch).loss() -
          Reference(before, *batch).loss()) / rec["qmodel_change"])
  assert rec["rho"] == pytest.approx(rho, rel=1e-7)
  # Not the chief: the damping stays.
  trainer = Trainer(world, _inits(), dict(
      learning_rate=None, momentum=None, momentum_type="qmodel",
      damping=0.05, adapt_damping=True, damping_adaptation_interval=1,
      is_chief=False))
  trainer.step(batch)
  rec = trainer.records()
  assert rec["damping"] == pytest.approx(0.05, rel=1e-12)
  assert np.isnan(rec["rho"])


# ------------------------------------------------------------- calibration
def test_calibration_rule_bisects_in_log_space():
  """Hand-computed moves: x10 while rho is poor, then the step halves
  (factor sqrt(10)) when the direction reverses; a rho between the
  thresholds keeps the damping; the floor holds."""
  ln10 = np.log(10.0)

  def move(damping, rho, step, last, floor=1e-8):
    return _np(*lm.calibrated_damping(damping, rho, step, last, 0.25, 0.75,
                                      floor))

  assert move(1.0, 0.1, ln10, 0.0) == pytest.approx([10.0, ln10, 1.0])
  assert move(10.0, float("nan"), ln10, 1.0) == pytest.approx(
      [100.0, ln10, 1.0])
  assert move(100.0, 0.9, ln10, 1.0) == pytest.approx(
      [100.0 / np.sqrt(10.0), ln10 / 2, -1.0])
  assert move(31.6, 0.5, ln10 / 2, -1.0) == pytest.approx(
      [31.6, ln10 / 2, -1.0])
  assert move(31.6, 0.1, ln10 / 2, -1.0) == pytest.approx(
      [31.6 * 10**0.25, ln10 / 4, 1.0])
  assert move(1e-7, 0.9, ln10, -1.0, floor=1e-7) == pytest.approx(
      [1e-7, ln10, -1.0])


@pytest.mark.parametrize("rule", ["calibrated", "adapted"])
def test_rules_read_each_variable_once(rule):
  """The rules' inputs may be the state variables they then assign: each is
  read once, so that in a TF1 graph (no automatic control dependencies)
  every use sees the value from before the assignments. tf.cast of a
  float64 variable returns the variable and every use read it again: the
  calibration's direction * last then ran after `last` was assigned in
  about one TF1 run in six."""
  with tf.Graph().as_default() as g:
    state = [tf.Variable(v, dtype=tf.float64) for v in (1e-2, 2.3, 1.0)]
    rho = tf.constant(2.0, tf.float64)
    before = len([op for op in g.get_operations()
                  if op.type == "ReadVariableOp"])
    if rule == "calibrated":
      lm.calibrated_damping(state[0], rho, state[1], state[2], 0.25, 0.75,
                            1e-8)
      expected = 3
    else:
      lm.adapted_damping(state[0], rho, 0.95, 5, 0.25, 0.75, 1e-8)
      expected = 1
    reads = len([op for op in g.get_operations()
                 if op.type == "ReadVariableOp"]) - before
  assert reads == expected


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
@pytest.mark.parametrize("momentum_type, initial, calibration_steps", [
    ("qmodel", 1e3, None), ("regular", 1e-4, None), ("qmodel", 1e3, 3)])
def test_damping_calibration_during_burn_in(world, momentum_type, initial,
                                            calibration_steps):
  """Each burn-in step tries the step's update on its batch and puts the
  parameters back bit for bit; rho of the trial equals the reference and
  the damping moves as calibrated_damping says (replayed here on the
  reference rho); the first real step uses the calibrated damping. With
  num_calibration_steps=k only the last k burn-in steps do so: the ones
  before gather statistics and compute no inverse."""
  burnin = 4
  kwargs = dict(damping=initial, num_burnin_steps=burnin,
                calibrate_damping=True,
                num_calibration_steps=calibration_steps)
  skipped = 0 if calibration_steps is None else burnin - calibration_steps
  if momentum_type == "qmodel":
    kwargs.update(learning_rate=None, momentum=None, momentum_type="qmodel")
  else:
    kwargs.update(learning_rate=0.5, momentum=0.9, momentum_type="regular")
  trainer = Trainer(world, _inits(), kwargs)
  batches = _batches(burnin + 1)
  log_step, direction = np.log(10.0), 0.0
  start = trainer.params()
  for i, batch in enumerate(batches[:burnin]):
    damping = trainer.records()["damping"]
    trainer.step(batch)
    for a, b in zip(trainer.params(), start):
      np.testing.assert_array_equal(a, b)  # restored exactly
    inverses = trainer.inverses()
    assert inverses and (i < skipped) == all(
        not np.any(v) for v in inverses.values()), (i, skipped)
    if i < skipped:  # statistics only
      assert trainer.records()["damping"] == damping
      assert trainer.read(lambda: trainer.opt.burnin_counter) == i + 1
      continue
    reference = Reference(start, *batch)
    precon = trainer.precon_matrix(damping)
    if momentum_type == "qmodel":
      delta, _, _, change = _qmodel_reference(
          reference, precon, np.zeros(precon.shape[0]), damping, 0.0)
    else:
      delta = -0.5 * np.linalg.solve(precon, reference.grad())
      change = 0.5 * delta @ precon @ delta + reference.grad() @ delta
    params = np.split(ref.flat(start) + delta,
                      np.cumsum([p.size for p in start])[:-1])
    trial = Reference([p.reshape(q.shape) for p, q in zip(params, start)],
                      *batch)
    rho = (trial.loss() - reference.loss()) / change
    rec = trainer.records()
    assert rec["rho"] == pytest.approx(rho, rel=1e-7)
    assert rec["qmodel_change"] == pytest.approx(change, rel=1e-7)
    want, log_step, direction = _np(*lm.calibrated_damping(
        damping, rho, log_step, direction, 0.25, 0.75, 1e-8))
    assert rec["damping"] == pytest.approx(want, rel=1e-7)
  calibrated = trainer.records()["damping"]
  # The far-off initial damping (too large for qmodel, whose trials then
  # have rho ~ 1; too small for lr 0.5, rho < 0) moved by >= 100x.
  assert abs(np.log10(calibrated / initial)) >= 2.0
  assert (calibrated < initial) == (momentum_type == "qmodel")
  trainer.step(batches[burnin])  # a real step with the calibrated damping
  moved = ref.flat(trainer.params()) - ref.flat(start)
  assert np.linalg.norm(moved) > 0
  assert trainer.records()["damping"] == calibrated


# ------------------------------------------------------------- arguments
@pytest.mark.parametrize("kwargs, match", [
    (dict(learning_rate=0.1, momentum=None, momentum_type="qmodel"),
     "pass learning_rate=None"),
    (dict(learning_rate=None, momentum=0.5, momentum_type="qmodel"),
     "pass momentum=None"),
    (dict(learning_rate=0.1, momentum=0.5, momentum_type="qmodel_fixedmu"),
     "pass learning_rate=None"),
    (dict(learning_rate=None, momentum=None,
          momentum_type="qmodel_fixedmu"), "momentum is required"),
    (dict(learning_rate=None, momentum=None, momentum_type="qmodel",
          use_weight_decay=True), "use_weight_decay"),
    (dict(learning_rate=None, momentum=None, momentum_type="qmodel",
          norm_constraint=1.0), "norm_constraint"),
    (dict(learning_rate=0.1, qmodel_update_rescale=0.5),
     "qmodel_update_rescale"),
    (dict(learning_rate=0.1, qmodel_layer_collection=kfac.LayerCollection()),
     "qmodel_layer_collection is used by the quadratic model only"),
    (dict(learning_rate=None, momentum=None, momentum_type="qmodel",
          qmodel_layer_collection=[]), "must be a LayerCollection"),
    (dict(learning_rate=0.1, adapt_damping=True), "needs loss_fn"),
    (dict(learning_rate=0.1, adapt_damping=True, loss_fn=lambda b: 0.0,
          damping=tf.constant(0.1)), "initial damping"),
    (dict(learning_rate=0.1, adapt_damping=True, loss_fn=lambda b: 0.0,
          damping_schedule=lambda s: 0.1, damping=None), "choose one"),
    (dict(learning_rate=0.1, learning_rate_schedule=lambda s: 0.1),
     "not both"),
    (dict(learning_rate=0.1, qmodel_momentum_bound=1.0),
     r"qmodel_momentum_bound .* momentum_type='qmodel' only "
     r"\(momentum_type='adam'\)"),
    (dict(learning_rate=None, momentum=0.5, momentum_type="qmodel_fixedmu",
          qmodel_momentum_bound=1.0), "qmodel_momentum_bound"),
    (dict(learning_rate=None, momentum=None, momentum_type="qmodel",
          qmodel_momentum_bound=0.0), "qmodel_momentum_bound"),
    (dict(learning_rate=None, momentum=None, momentum_type="qmodel",
          qmodel_momentum_bound="1"), "qmodel_momentum_bound must be a "
     "number"),
    (dict(learning_rate=0.1, calibrate_damping=True, num_burnin_steps=0),
     "num_burnin_steps > 0"),
    (dict(learning_rate=0.1, calibrate_damping=True, num_burnin_steps=3),
     "calibrate_damping=True needs loss_fn"),
    (dict(learning_rate=0.1, calibrate_damping=True, num_burnin_steps=3,
          num_calibration_steps=4),
     r"num_calibration_steps must be an integer from 1 to num_burnin_steps "
     r"\(3\), got 4"),
    (dict(learning_rate=0.1, calibrate_damping=True, num_burnin_steps=3,
          num_calibration_steps=0), "num_calibration_steps must be"),
    (dict(learning_rate=0.1, calibrate_damping=True, num_burnin_steps=3,
          num_calibration_steps=1.5), "num_calibration_steps must be"),
    (dict(learning_rate=0.1, calibrate_damping=False, num_burnin_steps=3,
          num_calibration_steps=2),
     "num_calibration_steps=2 is for calibrate_damping=True"),
])
def test_argument_errors(kwargs, match):
  args = dict(damping=0.1)
  args.update(kwargs)
  cls = (kfac.PeriodicInvCovUpdateKfacOpt if "calibrate_damping" in args
         else kfac.KfacOptimizer)
  with pytest.raises(ValueError, match=match):
    cls(**args)


@pytest.mark.parametrize("kwargs", [
    dict(damping_adaptation_interval=10),
    dict(damping_adaptation_decay=0.9, min_damping=1e-4),
    dict(always_use_exact_qmodel_for_damping_adjustment=True),
    dict(loss_fn=lambda b: 0.0, loss=tf.constant(1.0)),
    dict(calibrate_damping=True, num_burnin_steps=3,
         loss_fn=lambda b: 0.0, damping_adaptation_interval=2),
])
def test_arguments_of_the_damping_rule_without_it_warn(kwargs):
  """kfac 0.2.x accepted them silently (its classifier example passes them
  whatever adapt_damping is): a warning naming each, the optimizer works."""
  args = dict(damping=0.1, learning_rate=0.1)
  args.update(kwargs)
  cls = (kfac.PeriodicInvCovUpdateKfacOpt if "calibrate_damping" in args
         else kfac.KfacOptimizer)
  with pytest.warns(adaptive.IgnoredArgumentWarning) as caught:
    cls(**args)
  named = " ".join(str(w.message) for w in caught)
  for arg in kwargs:
    if "calibrate_damping" in kwargs and arg in (
        "calibrate_damping", "num_burnin_steps", "loss_fn"):
      continue  # the calibration uses them
    if arg in ("loss", "loss_fn"):
      assert arg + "=... is used by the damping adaptation only" in named
    else:
      assert arg + "=" in named and "only matters with adapt_damping" in named


@pytest.mark.parametrize("world", WORLDS)
def test_missing_batch_is_an_error(world):
  with pytest.raises(ValueError, match="train_batch is not set"):
    Trainer(world, _inits(), dict(
        learning_rate=0.1, momentum=0.0, damping=0.1, adapt_damping=True,
        damping_adaptation_interval=1), set_batches=False).step(
            _batches(1)[0])


# ------------------------------------------------------------- schedules
@pytest.mark.parametrize("world", WORLDS)
def test_schedules_and_norm_stats(world):
  """learning_rate_schedule / momentum_schedule are functions of the step
  counter; norm_stats are the Euclidean norms of the step's vectors."""
  trainer = Trainer(world, _inits(), dict(
      learning_rate=None, learning_rate_schedule=lambda s: 0.2 / tf.cast(
          s + 1, tf.float64), momentum=None, momentum_type="regular",
      momentum_schedule=lambda s: tf.cast(s, tf.float64) * 0.1,
      damping=0.1, compute_norm_stats=True))
  prev_velocity = None
  for t, batch in enumerate(_batches(2)):
    before = trainer.params()
    trainer.step(batch)
    delta = ref.flat(trainer.params()) - ref.flat(before)
    reference = Reference(before, *batch)
    p = np.linalg.solve(trainer.precon_matrix(0.1), reference.grad())
    velocity = p if prev_velocity is None else 0.1 * t * prev_velocity + p
    np.testing.assert_allclose(delta, -0.2 / (t + 1) * velocity, rtol=RTOL)
    stats = trainer.read(lambda: trainer.opt.norm_stats)
    assert stats["grad_norm"] == pytest.approx(
        np.linalg.norm(reference.grad()), rel=RTOL)
    assert stats["precon_grad_norm"] == pytest.approx(np.linalg.norm(p),
                                                      rel=RTOL)
    assert stats["update_norm"] == pytest.approx(np.linalg.norm(delta),
                                                 rel=RTOL)
    prev_velocity = velocity


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
@pytest.mark.parametrize("relative", [1e3, 1e-9])
def test_relative_damping_floor(world, relative):
  """relative_min_damping r: the rule's new damping is
  max(decreased damping, r * trace(B) / dim(B)) with B the undamped
  block-diagonal K-FAC matrix (here the generic blocks' covariances, read
  from the state after the step); r = 1e3 makes the floor bind, 1e-9 not."""
  damping = 0.05
  trainer = Trainer(world, _inits(), dict(
      learning_rate=None, momentum=None, momentum_type="qmodel",
      damping=damping, adapt_damping=True, damping_adaptation_interval=1,
      damping_adaptation_decay=0.9, damping_increase_rho_threshold=-10.0,
      damping_decrease_rho_threshold=-5.0, relative_min_damping=relative))
  for batch in _batches(2):
    rec_before = trainer.records()
    trainer.step(batch)
    covs = trainer.precon_matrix(0.0)
    scale = np.trace(covs) / covs.shape[0]
    expected = max(rec_before["damping"] * 0.9, relative * scale)
    assert trainer.records()["damping"] == pytest.approx(expected, rel=1e-9)
  if relative > 1:
    assert trainer.records()["damping"] > damping  # the floor lifted it
