"""The statistics' backward pass runs only on the steps that update them
(lazy.recompute_in_branch, FisherEstimator with cov_update_every > 1), and
the results equal those of the pass built outside the conditional. Also
with TF1's control flow v1 (the tf.cond of graphs built after
tf.compat.v1.disable_v2_behavior(); switched here with the process-wide
toggle, restored after each test)."""

import contextlib

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref
from kfac.python.ops import lazy

K = 3  # cov_update_every
STEPS = 7


def _executed_types(graph, meta):
  """The op types of the nodes a traced session.run executed (also those
  of function bodies, e.g. a cond's branch, which the graph does not
  list)."""
  del graph
  types = []
  for dev in meta.step_stats.dev_stats:
    for node in dev.node_stats:
      if " = " in node.timeline_label:
        types.append(node.timeline_label.split(" = ")[1].split("(")[0])
  return types


@pytest.fixture(params=["v2", "v1"])
def control_flow(request):
  """Runs a test with control flow v2 (the default) and v1."""
  with util.control_flow(request.param) as version:
    yield version


# ------------------------------------------------------- lazy.defer
def _counted(log, x):
  """A build() for lazy.defer that logs the graph it runs in."""
  def build():
    log.append(tf.compat.v1.get_default_graph())
    return [tf.tanh(x) * 3.0]
  return build


def test_defer_builds_at_the_first_read_once():
  log = []

  @tf.function
  def f(x):
    (s,), home = lazy.defer([x], _counted(log, x))
    assert home is tf.compat.v1.get_default_graph()
    assert not log and s.graph is not home and s.shape == x.shape
    return s + 1.0, s * 2.0

  a, b = f(tf.constant([0.5, -1.0]))
  expected = np.tanh([0.5, -1.0]).astype(np.float32) * 3.0
  np.testing.assert_allclose(a, expected + 1.0, rtol=1e-6)
  np.testing.assert_allclose(b, expected * 2.0, rtol=1e-6)
  assert len(log) == 1  # two reads, one build, in the function's graph
  assert isinstance(log[0], lazy.recompute.func_graph_class())


def _read_in_branch(hooked, outer, inner):
  """A tf.function whose only read of a deferred tensor is in a branch,
  under recompute_in_branch when `hooked`."""

  @tf.function
  def f(x, pred):
    (s,), home = lazy.defer([x], _counted(outer, x))

    def taken():
      if not hooked:
        return s + 1.0
      with lazy.recompute_in_branch([s], _counted(inner, x), home=home):
        return s + 1.0
    return tf.cond(pred, taken, lambda: tf.zeros_like(x))
  return f


@pytest.mark.parametrize("hooked", [True, False])
def test_defer_read_only_in_a_branch_builds_nothing_outside(hooked):
  """The trace's own graph gets no op of build(): the branch that reads
  the stand-in (under recompute_in_branch) builds its own copy; a branch
  without it reads the copy built in the trace's graph."""
  outer, inner = [], []
  f = _read_in_branch(hooked, outer, inner)
  x = tf.constant([0.5, -1.0])
  graph = f.get_concrete_function(x, tf.constant(True)).graph
  outer_tanh = [op for op in graph.get_operations() if op.type == "Tanh"]
  if hooked:
    assert not outer and len(inner) == 1 and not outer_tanh
  else:
    assert len(outer) == 1 and not inner and len(outer_tanh) == 1
  np.testing.assert_allclose(f(x, tf.constant(True)),
                             np.tanh([0.5, -1.0]) * 3.0 + 1.0, rtol=1e-6)
  np.testing.assert_allclose(f(x, tf.constant(False)), [0.0, 0.0])


def test_defer_in_a_tf1_graph_builds_now():
  log = []
  with tf.Graph().as_default():
    x = tf.constant([0.5])
    (s,), home = lazy.defer([x], _counted(log, x))
    assert home is None and len(log) == 1 and s.graph is x.graph
    with tf.compat.v1.Session() as sess:
      np.testing.assert_allclose(sess.run(s), np.tanh([0.5]) * 3.0,
                                 rtol=1e-6)


def test_defer_read_from_another_trace_fails():
  kept = []

  @tf.function
  def f(x):
    (s,), _ = lazy.defer([x], lambda: [tf.tanh(x)])
    kept.append(s)
    return s

  f(tf.constant([0.5]))

  @tf.function
  def g(x):
    return kept[0] + x

  with pytest.raises(TypeError, match="out of scope"):
    g(tf.constant([0.5]))


# ------------------------------------------------------------ the context
def test_recompute_in_branch_tf1_runs_only_when_taken(control_flow):
  with tf.Graph().as_default() as g:
    x = tf.compat.v1.placeholder(tf.float64, [None])
    pred = tf.compat.v1.placeholder(tf.bool, [])
    outer = tf.tanh(x) * 3.0
    built = []

    def branch():
      with lazy.recompute_in_branch([outer], lambda: built.append(1) or [
          tf.tanh(x) * 3.0]):
        return outer + 1.0

    out = tf.cond(pred, branch, lambda: tf.zeros_like(x))
    assert built == [1]  # built once, in the branch
    assert (out.op.type == "Merge") == (control_flow == "v1")
    xv = np.array([0.3, -1.2])
    with tf.compat.v1.Session() as sess:
      for taken in (True, False):
        meta = tf.compat.v1.RunMetadata()
        value = sess.run(out, {x: xv, pred: taken}, run_metadata=meta,
                         options=tf.compat.v1.RunOptions(
                             trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
        np.testing.assert_allclose(
            value, np.tanh(xv) * 3 + 1 if taken else 0, rtol=1e-15)
        assert _executed_types(g, meta).count("Tanh") == (1 if taken else 0)


def test_recompute_in_branch_function_and_no_op_outside_a_branch():
  x = tf.constant([0.3, -1.2], tf.float64)

  @tf.function
  def run(pred):
    outer = tf.tanh(x) * 3.0
    with lazy.recompute_in_branch([outer], lambda: [tf.tanh(x) * 3.0]):
      same_graph = outer * 2.0  # not in a branch: the outer tensor itself

    def branch():
      with lazy.recompute_in_branch([outer], lambda: [tf.tanh(x) * 3.0]):
        return outer + 1.0

    return tf.cond(pred, branch, lambda: tf.zeros_like(x)), same_graph

  taken, same = run(tf.constant(True))
  np.testing.assert_allclose(taken.numpy(), np.tanh(x.numpy()) * 3 + 1,
                             rtol=1e-15)
  np.testing.assert_allclose(same.numpy(), np.tanh(x.numpy()) * 6,
                             rtol=1e-15)
  np.testing.assert_array_equal(run(tf.constant(False))[0].numpy(), [0, 0])


def test_recompute_in_branch_first_read_in_a_nested_conditional(
    control_flow):
  """The first read comes through a conditional inside the branch: the
  values are right either way it is captured, and (v1) the outer tensor
  is not computed."""
  del control_flow
  with tf.Graph().as_default() as g:
    x = tf.compat.v1.placeholder(tf.float64, [None])
    pred = tf.compat.v1.placeholder(tf.bool, [])
    outer = tf.tanh(x) * 3.0

    def branch():
      with lazy.recompute_in_branch([outer], lambda: [tf.tanh(x) * 3.0]):
        inner = tf.cond(pred, lambda: outer + 1.0, lambda: outer * 0.0)
        return inner + outer

    out = tf.cond(pred, branch, lambda: tf.zeros_like(x))
    xv = np.array([0.3, -1.2])
    with tf.compat.v1.Session() as sess:
      for taken in (True, False):
        meta = tf.compat.v1.RunMetadata()
        value = sess.run(out, {x: xv, pred: taken}, run_metadata=meta,
                         options=tf.compat.v1.RunOptions(
                             trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
        np.testing.assert_allclose(value, np.tanh(xv) * 6 + 1 if taken else 0,
                                   rtol=1e-15)
        assert _executed_types(g, meta).count("Tanh") == (1 if taken else 0)


# ------------------------------------------------------------ K-FAC
def _loss(labels, logits):
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=tf.constant(labels), logits=logits))


@contextlib.contextmanager
def _eager_statistics(on):
  """With on=False, the estimator builds the statistics' backward pass
  outside the conditional (the behaviour before lazy/)."""
  if on:
    yield
    return
  saved = lazy.recompute_in_branch
  lazy.recompute_in_branch = (
      lambda tensors, build, home=None: contextlib.nullcontext())
  try:
    yield
  finally:
    lazy.recompute_in_branch = saved


def _optimizer(lc, mode):
  return kfac.PeriodicInvCovUpdateKfacOpt(
      learning_rate=0.1, damping=0.1, layer_collection=lc, momentum=0.9,
      cov_update_every=K, invert_every=2, estimation_mode=mode,
      cov_ema_decay=0.5)


def _tf1_run(mode, lazy_on, x, labels):
  with _eager_statistics(lazy_on), tf.Graph().as_default() as g:
    tf.compat.v1.set_random_seed(7)
    variables = [tf.Variable(p) for p in ref.mlp_inits(util.SIZES, seed=1)]
    lc = kfac.LayerCollection()
    logits = util.register_mlp(variables, tf.constant(x), lc)
    util.categorical_loss(lc, logits, labels)
    loss = _loss(labels, logits)
    opt = _optimizer(lc, mode)
    train = opt.minimize(loss, var_list=variables)
    covs = [f.get_cov() for f in opt.factors]
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      tanh_grads = []
      for _ in range(STEPS):
        meta = tf.compat.v1.RunMetadata()
        sess.run(train, run_metadata=meta, options=tf.compat.v1.RunOptions(
            trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
        tanh_grads.append(_executed_types(g, meta).count("TanhGrad"))
      return sess.run(variables), sess.run(covs), tanh_grads


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("mode", ["gradients", "empirical", "exact"])
def test_tf1_statistics_backward_only_on_update_steps(mode, control_flow):
  del control_flow
  x, labels = util.data(16)
  params, covs, counts = _tf1_run(mode, True, x, labels)
  ref_params, ref_covs, ref_counts = _tf1_run(mode, False, x, labels)
  for a, b in zip(params + covs, ref_params + ref_covs):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
  # The model's gradient has one TanhGrad; the statistics' pass one more
  # per source (exact: one per output class).
  extra = 3 if mode == "exact" else 1
  assert counts == [1 + (extra if step % K == 0 else 0)
                    for step in range(STEPS)], counts
  assert ref_counts == [1 + extra] * STEPS, ref_counts  # the guard can fail


def _function_run(lazy_on, x, labels):
  with _eager_statistics(lazy_on):
    variables = [tf.Variable(p) for p in ref.mlp_inits(util.SIZES, seed=1)]
    opt = kfac.PeriodicInvCovUpdateKfacOpt(
        learning_rate=0.1, damping=0.1, momentum=0.9, cov_update_every=K,
        invert_every=2, estimation_mode="empirical", cov_ema_decay=0.5)

    @tf.function
    def step():
      lc = kfac.LayerCollection()
      logits = util.register_mlp(variables, tf.constant(x), lc)
      util.categorical_loss(lc, logits, labels)
      opt.minimize(_loss(labels, logits), var_list=variables,
                   layer_collection=lc)

    for _ in range(STEPS):
      step()
    return [v.numpy() for v in variables]


def test_function_matches_the_eager_statistics():
  x, labels = util.data(16)
  for a, b in zip(_function_run(True, x, labels),
                  _function_run(False, x, labels)):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_function_step_builds_no_outer_statistics_backward():
  """In a tf.function step with cov_update_every > 1, the statistics'
  sampled backward pass exists only in the statistics' conditional: the
  step's own graph has the model's backward pass alone (before lazy.defer
  it also had the pass built at set-up, pruned unrun)."""
  x, labels = util.data(16)
  counts = {}
  for lazy_on in (True, False):
    with _eager_statistics(lazy_on):
      variables = [tf.Variable(p) for p in ref.mlp_inits(util.SIZES, seed=1)]
      opt = _optimizer(None, "empirical")

      @tf.function
      def step(variables=variables, opt=opt):
        lc = kfac.LayerCollection()
        logits = util.register_mlp(variables, tf.constant(x), lc)
        util.categorical_loss(lc, logits, labels)
        opt.minimize(_loss(labels, logits), var_list=variables,
                     layer_collection=lc)

      graph = step.get_concrete_function().graph
      counts[lazy_on] = sum(op.type == "TanhGrad"
                            for op in graph.get_operations())

  variables = [tf.Variable(p) for p in ref.mlp_inits(util.SIZES, seed=1)]

  @tf.function
  def model_backward():
    logits = util.register_mlp(variables, tf.constant(x),
                               kfac.LayerCollection())
    return tf.gradients(_loss(labels, logits), variables)

  alone = sum(op.type == "TanhGrad" for op in
              model_backward.get_concrete_function().graph.get_operations())
  assert alone >= 1
  assert counts[True] == alone, counts
  assert counts[False] > alone, counts
