"""Optimizer update rules against hand-computed steps, and the two worlds.

The hand-computed problem: one parameter vector w in R^2, prediction
y = x . w for one example, squared error (t - y)^2 registered as a generic
"full" block in the empirical mode with cov_ema_decay = 0 and invert_every
= 1, so the preconditioner at each step is exactly (g g^T + lambda I)^-1
with g = -2 (t - y) x the gradient of the loss.
"""

import inspect

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref

WORLDS = ref.WORLDS
X = np.array([[1.5, -0.5]])
T = np.array([[0.7]])
W0 = np.array([[0.2], [-0.3]])


def train(world, inits, model_fn, opt_fn, steps, feed=None):
  """Runs `steps` training steps in a TF1 Session or a TF2 tf.function.

  model_fn(variables, lc, inputs) -> loss registers the model; opt_fn(lc)
  makes the optimizer (lc is None in TF2). Returns [(loss, [values])]: the
  loss before each step and the variables after it. `feed` optionally gives
  per-step inputs (numpy); otherwise inputs are None.
  """
  feed = feed or [None] * steps
  history = []
  if world == "graph":
    with tf.Graph().as_default():
      vs = [tf.Variable(v) for v in inits]
      inputs = None
      if feed[0] is not None:
        inputs = tf.compat.v1.placeholder(tf.as_dtype(feed[0].dtype),
                                          [None] + list(feed[0].shape[1:]))
      lc = kfac.LayerCollection()
      loss = model_fn(vs, lc, inputs)
      opt = opt_fn(lc)
      train_op = opt.minimize(loss, var_list=vs)
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for f in feed:
          fd = {inputs: f} if inputs is not None else None
          value, _ = sess.run([loss, train_op], fd)
          history.append((value, sess.run(vs)))
    return history
  vs = [tf.Variable(v) for v in inits]
  opt = opt_fn(None)

  @tf.function
  def step(inputs):
    lc = kfac.LayerCollection()
    loss = model_fn(vs, lc, inputs)
    opt.minimize(loss, var_list=vs, layer_collection=lc)
    return loss

  for f in feed:
    value = step(f)
    history.append((value.numpy(), [v.numpy() for v in vs]))
  return history


def two_param_model(vs, lc, inputs):
  del inputs
  (w,) = vs
  y = tf.matmul(tf.constant(X), w)
  lc.register_generic(w, 1, approx="full")
  lc.register_squared_error_loss(y, targets=tf.constant(T))
  return tf.reduce_sum(tf.square(tf.constant(T) - y))


def make_opt(**kwargs):
  base = dict(learning_rate=0.3, damping=0.05, momentum=0.5,
              cov_ema_decay=0.0, estimation_mode="empirical", invert_every=1)
  base.update(kwargs)
  return lambda lc: kfac.PeriodicInvCovUpdateKfacOpt(layer_collection=lc,
                                                     **base)


def hand_steps(momentum_type, steps, lr=0.3, damping=0.05, mu=0.5,
               norm_constraint=None, wd=None, l2_reg=0.0):
  w = W0[:, 0].copy()
  v = np.zeros(2)
  x = X[0]
  out = []
  for _ in range(steps):
    g = -2.0 * (T[0, 0] - x @ w) * x
    inv = np.linalg.inv(np.outer(g, g) + (damping + l2_reg) * np.eye(2))
    if momentum_type == "regular":
      p = inv @ g
      if norm_constraint is not None:
        p *= min(1.0, np.sqrt(norm_constraint / (lr**2 * g @ p)))
      v = mu * v + p
      step = v
    else:
      v = mu * v + g
      step = inv @ v
      if norm_constraint is not None:
        step *= min(1.0, np.sqrt(norm_constraint / (lr**2 * v @ step)))
    if wd is not None:
      step = step + wd * w
    w = w - lr * step
    out.append(w.copy())
  return out


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("momentum_type", ["regular", "adam"])
def test_momentum_types_reproduce_hand_computed_steps(world, momentum_type):
  hist = train(world, [W0], two_param_model,
               make_opt(momentum_type=momentum_type), 4)
  want = hand_steps(momentum_type, 4)
  for (_, (w,)), expected in zip(hist, want):
    np.testing.assert_allclose(w[:, 0], expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("momentum_type", ["regular", "adam"])
def test_norm_constraint_reproduces_hand_computed_steps(world, momentum_type):
  hist = train(world, [W0], two_param_model,
               make_opt(momentum_type=momentum_type, norm_constraint=1e-3),
               4)
  want = hand_steps(momentum_type, 4, norm_constraint=1e-3)
  unclipped = hand_steps(momentum_type, 4)
  assert np.abs(want[0] - unclipped[0]).max() > 1e-3  # the clip is active
  for (_, (w,)), expected in zip(hist, want):
    np.testing.assert_allclose(w[:, 0], expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("world", WORLDS)
def test_weight_decay_and_l2_reg_reproduce_hand_computed_steps(world):
  hist = train(world, [W0], two_param_model,
               make_opt(momentum_type="regular", use_weight_decay=True,
                        weight_decay_coeff=0.1, l2_reg=0.2), 3)
  want = hand_steps("regular", 3, wd=0.1, l2_reg=0.2)
  for (_, (w,)), expected in zip(hist, want):
    np.testing.assert_allclose(w[:, 0], expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("world", WORLDS)
def test_periodic_schedule_burnin_cov_and_inverse_steps(world):
  """invert_every=3, cov_update_every=2, num_burnin_steps=2, decay 0.5.

  kfac 0.2.x schedule: the explicit decay becomes 0.5**2 = 0.25; calls 0
  and 1 are burn-in (statistics into an arithmetic mean, each with weight
  1 - 0.25; counter stays 0, burnin_counter counts them); then at call t
  the counter c = t - 2: statistics when c is even, inverses when
  c % 3 == 0, parameters move on every call from t = 2.
  """
  steps = 9
  model = two_param_model

  def opt_fn(lc):
    return kfac.PeriodicInvCovUpdateKfacOpt(
        invert_every=3, cov_update_every=2, num_burnin_steps=2,
        learning_rate=0.1, damping=0.05, momentum=0.0, cov_ema_decay=0.5,
        estimation_mode="empirical", layer_collection=lc)

  if world == "graph":
    # Read state between steps through extra fetches.
    with tf.Graph().as_default():
      (w,) = vs = [tf.Variable(W0)]
      lc = kfac.LayerCollection()
      loss = model(vs, lc, None)
      opt = opt_fn(lc)
      train_op = opt.minimize(loss, var_list=vs)
      factor = opt.factors[0]
      inv = opt.get_inv_vars()[0][0]
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        states = []
        for _ in range(steps):
          sess.run(train_op)
          states.append(sess.run([opt.counter, factor._cov_weight, inv, w,
                                  opt.burnin_counter]))
  else:
    (w,) = vs = [tf.Variable(W0)]
    opt = opt_fn(None)

    @tf.function
    def step():
      lc = kfac.LayerCollection()
      opt.minimize(model(vs, lc, None), var_list=vs, layer_collection=lc)

    states = []
    for _ in range(steps):
      step()
      factor = opt.factors[0]
      states.append([opt.counter.numpy(), factor._cov_weight.numpy(),
                     opt.get_inv_vars()[0][0].numpy(), w.numpy(),
                     opt.burnin_counter.numpy()])

  decay = 0.5**2
  inv_steps = [t for t in range(steps) if t >= 2 and (t - 2) % 3 == 0]
  prev_inv, prev_w = np.zeros((2, 2)), W0
  want_weight = 0.0
  for t, (counter, weight, inv, w_val, burnin) in enumerate(states):
    assert counter == max(0, t - 1), t
    assert burnin == min(t + 1, 2), t
    if t < 2:
      want_weight += 1 - decay
    elif (t - 2) % 2 == 0:
      want_weight = decay * want_weight + (1 - decay)
    np.testing.assert_allclose(weight, want_weight, rtol=1e-12)
    assert (np.abs(inv - prev_inv).max() > 0) == (t in inv_steps), t
    assert (np.abs(w_val - prev_w).max() > 0) == (t >= 2), t
    prev_inv, prev_w = inv, w_val


def mlp_model(vs, lc, inputs):
  x, labels = inputs if inputs is not None else (None, None)
  logits = util.register_mlp(vs, tf.cast(x, vs[0].dtype), lc)
  lc.register_softmax_cross_entropy_loss(logits, targets=labels)
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))


# Each momentum type and each mode in the fast tier; the other two pairs in
# the slow tier.
@pytest.mark.parametrize("momentum_type, mode", [
    ("regular", "exact"), ("adam", "empirical"),
    pytest.param("regular", "empirical", marks=pytest.mark.slow),
    pytest.param("adam", "exact", marks=pytest.mark.slow)])
def test_tf1_session_and_tf2_function_train_identically(mode, momentum_type):
  inits = ref.mlp_inits((5, 8, 6, 3), seed=90, dtype=np.float32)
  rng = np.random.RandomState(91)
  batches = [(rng.randn(16, 5).astype(np.float32),
              rng.randint(0, 3, 16).astype(np.int32)) for _ in range(6)]

  def model(vs, lc, inputs):
    return mlp_model(vs, lc, inputs)

  opt_fn = lambda lc: kfac.PeriodicInvCovUpdateKfacOpt(
      invert_every=2, learning_rate=0.05, damping=0.01, momentum=0.9,
      momentum_type=momentum_type, estimation_mode=mode, cov_ema_decay=0.9,
      layer_collection=lc)

  graph_hist = _train_with_pairs("graph", inits, model, opt_fn, batches)
  fn_hist = _train_with_pairs("function", inits, model, opt_fn, batches)
  graph_losses = [h[0] for h in graph_hist]
  assert graph_losses[-1] < graph_losses[0]  # it trains
  np.testing.assert_allclose([h[0] for h in fn_hist], graph_losses,
                             rtol=2e-5, atol=1e-6)
  for (_, gv), (_, fv) in zip(graph_hist, fn_hist):
    for a, b in zip(gv, fv):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _train_with_pairs(world, inits, model, opt_fn, batches):
  """train() with (x, labels) batches fed through placeholders/arguments."""
  if world == "graph":
    hist = []
    with tf.Graph().as_default():
      vs = [tf.Variable(v) for v in inits]
      x = tf.compat.v1.placeholder(tf.float32, [None, batches[0][0].shape[1]])
      y = tf.compat.v1.placeholder(tf.int32, [None])
      lc = kfac.LayerCollection()
      loss = model(vs, lc, (x, y))
      opt = opt_fn(lc)
      train_op = opt.minimize(loss, var_list=vs)
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for bx, by in batches:
          value, _ = sess.run([loss, train_op], {x: bx, y: by})
          hist.append((value, sess.run(vs)))
    return hist
  vs = [tf.Variable(v) for v in inits]
  opt = opt_fn(None)

  @tf.function
  def step(bx, by):
    lc = kfac.LayerCollection()
    loss = model(vs, lc, (bx, by))
    opt.minimize(loss, var_list=vs, layer_collection=lc)
    return loss

  return [(step(bx, by).numpy(), [v.numpy() for v in vs])
          for bx, by in batches]


def test_retracing_finds_the_same_state():
  """New batch sizes retrace the step; no state is created twice and the
  counter and statistics carry on."""
  inits = ref.mlp_inits((5, 8, 3), seed=95, dtype=np.float32)
  vs = [tf.Variable(v) for v in inits]
  opt = kfac.PeriodicInvCovUpdateKfacOpt(
      invert_every=1, learning_rate=0.05, damping=0.01, momentum=0.9,
      estimation_mode="empirical")
  traces = []

  @tf.function
  def step(bx, by):
    traces.append(1)
    lc = kfac.LayerCollection()
    loss = mlp_model(vs, lc, (bx, by))
    opt.minimize(loss, var_list=vs, layer_collection=lc)
    return loss

  rng = np.random.RandomState(96)
  sizes = [8, 8, 5, 5, 8, 3]
  for n in sizes:
    step(rng.randn(n, 5).astype(np.float32),
         rng.randint(0, 3, n).astype(np.int32))
    if n == 8 and len(traces) <= 2:
      names = sorted(opt.state_store.variables_by_name)
  assert len(traces) >= 3  # really retraced
  assert sorted(opt.state_store.variables_by_name) == names
  assert opt.counter.numpy() == len(sizes)
  weight = opt.factors[0]._cov_weight.numpy()
  np.testing.assert_allclose(weight, 1 - 0.95**len(sizes), rtol=1e-6)


def test_manual_cov_and_inverse_ops_match_the_periodic_optimizer():
  """KfacOptimizer + the estimator's update ops (the old TF1 recipe) takes
  the same first step as PeriodicInvCovUpdateKfacOpt."""
  common = dict(learning_rate=0.3, damping=0.05, momentum=0.5,
                cov_ema_decay=0.0, estimation_mode="empirical",
                momentum_type="regular")
  with tf.Graph().as_default():
    (w,) = vs = [tf.Variable(W0)]
    lc = kfac.LayerCollection()
    loss = two_param_model(vs, lc, None)
    global_step = tf.compat.v1.train.get_or_create_global_step()
    opt = kfac.KfacOptimizer(layer_collection=lc, **common)
    (_, cov_op, _, inv_op, _, _) = opt.make_vars_and_create_ops()
    train_op = opt.minimize(loss, var_list=vs, global_step=global_step)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      for _ in range(2):
        sess.run(cov_op)
        sess.run(inv_op)
        sess.run(train_op)
      manual = sess.run(w)
      assert sess.run(global_step) == 2
      assert sess.run(opt.counter) == 2
  np.testing.assert_allclose(manual[:, 0], hand_steps("regular", 2)[-1],
                             rtol=1e-10)


_V1_SCRIPT = r"""
import numpy as np, sys
import tensorflow as tf
if sys.argv[1] == "v1":
  tf.compat.v1.disable_v2_behavior()
import kfac
rng = np.random.RandomState(0)
with tf.Graph().as_default():
  x = tf.constant(rng.randn(32, 6).astype(np.float32))
  y = tf.constant(rng.randint(0, 3, 32))
  w1 = tf.compat.v1.get_variable("w1", initializer=(0.3 * rng.randn(6, 8)).astype(np.float32))
  b1 = tf.compat.v1.get_variable("b1", initializer=np.zeros(8, np.float32))
  w2 = tf.compat.v1.get_variable("w2", initializer=(0.3 * rng.randn(8, 3)).astype(np.float32))
  lc = kfac.LayerCollection()
  pre = tf.matmul(x, w1) + b1
  lc.register_fully_connected((w1, b1), x, pre)
  h = tf.tanh(pre)
  logits = tf.matmul(h, w2)
  lc.register_fully_connected(w2, h, logits)
  lc.register_softmax_cross_entropy_loss(logits, targets=y)
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
  opt = kfac.PeriodicInvCovUpdateKfacOpt(invert_every=2, num_burnin_steps=1,
      learning_rate=0.1, damping=1e-2, momentum=0.9, layer_collection=lc,
      estimation_mode="exact")
  train = opt.minimize(loss, var_list=[w1, b1, w2],
                       global_step=tf.compat.v1.train.get_or_create_global_step())
  with tf.compat.v1.Session() as sess:
    sess.run(tf.compat.v1.global_variables_initializer())
    print(" ".join("%.7f" % sess.run([loss, train])[0] for _ in range(6)))
"""


@pytest.mark.slow  # subprocesses with v2 behaviour disabled
def test_scripts_with_v2_behavior_disabled_train_the_same():
  """Old scripts often call tf.compat.v1.disable_v2_behavior() (reference
  variables, v1 control flow); the core must work there too, identically.
  Run in subprocesses because that switch is process-wide."""
  import os
  import subprocess
  import sys
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  env["PYTHONPATH"] = os.pathsep.join(
      [str(__import__("pathlib").Path(kfac.__file__).parents[1])] +
      [p for p in [env.get("PYTHONPATH")] if p])
  losses = {}
  for mode in ("v1", "v2"):
    out = subprocess.run([sys.executable, "-c", _V1_SCRIPT, mode], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    losses[mode] = [float(v) for v in out.stdout.split()]
  assert len(losses["v1"]) == 6
  assert losses["v1"][-1] < losses["v1"][0]
  np.testing.assert_allclose(losses["v1"], losses["v2"], rtol=1e-5)


_V1_STEP_SCRIPT = r"""
import collections, numpy as np, sys
import tensorflow as tf
if sys.argv[1] == "v1":
  tf.compat.v1.disable_v2_behavior()
import kfac
rng = np.random.RandomState(0)
sizes = (20, 30, 12, 30, 20)
with tf.Graph().as_default():
  tf.compat.v1.set_random_seed(0)
  x = tf.compat.v1.placeholder(tf.float32, [None, sizes[0]])
  lc = kfac.LayerCollection()
  h = x
  for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
    w = tf.compat.v1.get_variable("w%d" % i, initializer=(
        rng.randn(a, b) / np.sqrt(a)).astype(np.float32))
    bias = tf.compat.v1.get_variable("b%d" % i, initializer=np.zeros(
        b, np.float32))
    pre = tf.matmul(h, w) + bias
    lc.register_fully_connected((w, bias), h, pre)
    h = tf.tanh(pre) if i < len(sizes) - 2 else pre
  lc.register_normal_predictive_distribution(h, var=1.0)
  loss = 0.5 * tf.reduce_mean(tf.reduce_sum(tf.square(h - x), 1))
  opt = kfac.PeriodicInvCovUpdateKfacOpt(
      layer_collection=lc, invert_every=3, cov_update_every=2,
      learning_rate=0.05, damping=0.1, momentum=0.9, momentum_type="regular")
  train = opt.minimize(loss, global_step=tf.compat.v1.train.get_or_create_global_step())
  data = rng.randn(4, sizes[0]).astype(np.float32)
  with tf.compat.v1.Session() as sess:
    sess.run(tf.compat.v1.global_variables_initializer())
    losses, products = [], []
    for step in range(6):
      meta = tf.compat.v1.RunMetadata()
      value = sess.run([train, loss], {x: data}, run_metadata=meta,
                       options=tf.compat.v1.RunOptions(
                           trace_level=tf.compat.v1.RunOptions.FULL_TRACE))[1]
      losses.append("%.7f" % value)
      products.append(str(sum(
          1 for d in meta.step_stats.dev_stats for n in d.node_stats
          if " = " in n.timeline_label and
          "MatMul" in n.timeline_label.split(" = ")[1].split("(")[0])))
    print(" ".join(losses))
    print(" ".join(products))
"""


@pytest.mark.slow  # subprocesses with v2 behaviour disabled
def test_v2_behavior_disabled_step_runs_the_same_products():
  """Under disable_v2_behavior() (control flow v1, reference variables, v1
  shapes) a step with a run-time batch computes what it computes with TF2
  behaviour: the same losses, and the same matrix products per step (the
  statistics' backward pass only on update steps, no weight-gradient
  product where the factored form runs)."""
  import os
  import subprocess
  import sys
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  env["PYTHONPATH"] = os.pathsep.join(
      [str(__import__("pathlib").Path(kfac.__file__).parents[1])] +
      [p for p in [env.get("PYTHONPATH")] if p])
  out = {}
  for mode in ("v1", "v2"):
    proc = subprocess.run([sys.executable, "-c", _V1_STEP_SCRIPT, mode],
                          env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()[-2:]
    out[mode] = ([float(v) for v in lines[0].split()],
                 [int(v) for v in lines[1].split()])
  (losses_v1, products_v1), (losses_v2, products_v2) = out["v1"], out["v2"]
  assert losses_v1[-1] < losses_v1[0]
  np.testing.assert_allclose(losses_v1, losses_v2, rtol=1e-5)
  assert products_v1 == products_v2, (products_v1, products_v2)
  # Steps 0, 2, 4 update the statistics (and 0, 3 the inverses); 1 and 5
  # run neither: forward 4, backward 3 + 0 weight products (factored), the
  # factored preconditioning 3 per layer.
  assert products_v1[1] == products_v1[5] == 4 + 3 + 3 * 4, products_v1


@pytest.mark.parametrize("cls", [kfac.LayerCollection, kfac.KfacOptimizer,
                                 kfac.PeriodicInvCovUpdateKfacOpt,
                                 kfac.estimator.FisherEstimator])
def test_public_methods_are_not_converted_by_autograph(cls):
  """tf.function's autograph would otherwise convert every kfac function a
  training step reaches (slow tracing); see utils.exclude_from_autograph."""
  names = [n for n in dir(cls) if not n.startswith("_") and
           inspect.isfunction(inspect.getattr_static(cls, n)) and
           getattr(getattr(cls, n), "__module__", "").startswith("kfac")]
  assert len(names) > 5
  unmarked = [n for n in names
              if not hasattr(getattr(cls, n), "autograph_info__")]
  assert not unmarked, unmarked


def test_kfac_02x_update_rule_helpers():
  """kfac 0.2.x's private helpers of the update rule, which its own tests
  and some users' subclasses call, keep their meaning: with g = the
  gradients and p = the preconditioned gradients, <g, p> = 174 here, so at
  learning rate 0.1 the update's squared Fisher norm is 1.74; the clip
  coefficient is 1 under a norm constraint of 10 and sqrt(0.5 / 1.74)
  under 0.5, and _clip_updates scales p by it."""
  g = [np.array([[1., 2.], [3., 4.]]), np.array([[2., 3.], [4., 5.]])]
  p = [np.array([[3., 4.], [5., 6.]]), np.array([[7., 8.], [9., 10.]])]
  with tf.Graph().as_default():
    gv = [(tf.constant(x, tf.float32), None) for x in g]
    pv = [(tf.constant(x, tf.float32), None) for x in p]
    values = {}
    for bound in (10.0, 0.5):
      opt = kfac.KfacOptimizer(0.1, 0.2, kfac.LayerCollection(),
                               norm_constraint=bound,
                               name="clip_%d" % int(bound * 10))
      values[bound] = (opt._squared_fisher_norm(gv, pv),  # pylint: disable=protected-access
                       opt._update_clip_coeff(gv, pv),  # pylint: disable=protected-access
                       [c for c, _ in opt._clip_updates(gv, pv)])  # pylint: disable=protected-access
    with tf.compat.v1.Session() as sess:
      got = sess.run(values)
  for bound, coeff in ((10.0, 1.0), (0.5, np.sqrt(0.5 / 1.74))):
    sq_norm, got_coeff, clipped = got[bound]
    assert sq_norm == pytest.approx(174.0, rel=1e-12)
    assert got_coeff == pytest.approx(coeff, rel=1e-6)
    for c, x in zip(clipped, p):
      np.testing.assert_allclose(c, coeff * x, rtol=1e-6)
