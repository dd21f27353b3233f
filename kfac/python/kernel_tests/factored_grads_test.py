"""Dense gradients preconditioned through the product that formed them
(factored_grads): which graphs match, which form is chosen, and that
training takes the same values as the plain product (float64, rtol 1e-12)
in a TF1 Session and in a tf.function, with fixed and with adaptive K-FAC,
static and run-time batch sizes on both sides of the cost limit (the static
batch sizes, a graph per size, in the slow tier). Where nothing else reads a
gradient, its product x^T d is computed only when the plain form is taken
(the guard checks x and d), and a non-finite d still skips the step."""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.ops.layers.dense import factored_grads
from kfac.python.ops.adaptive import recipe

SIZES = (20, 30, 12, 30, 20)
# Rows per step; the four layers' cost limits are 16, 10, 11 and 15 rows,
# so 3 and 8 take the factored form, 64 and 100 the plain one.
BATCHES = (8, 64, 3, 100, 8)


@pytest.fixture
def plain_only(monkeypatch):
  """Switches the factored form off (for the reference runs)."""
  def disable():
    monkeypatch.setattr(factored_grads, "gradient_factors",
                        lambda vector, has_bias: None)
  return disable


# ------------------------------------------------------------ matching
def _layer(bias):
  x = tf.compat.v1.placeholder(tf.float64, [None, 5])
  w = tf.Variable(np.ones([5, 3]))
  b = tf.Variable(np.zeros([3]))
  if bias == "add":
    pre = tf.matmul(x, w) + b
  elif bias == "bias_add":
    pre = tf.nn.bias_add(tf.matmul(x, w), b)
  else:
    pre = tf.matmul(x, w)
  return x, w, b, tf.reduce_sum(tf.tanh(pre))


@pytest.mark.parametrize("bias", ["add", "bias_add", "none"])
def test_matches_tf_gradients_and_compute_gradients(bias):
  with tf.Graph().as_default():
    x, w, b, loss = _layer(bias)
    params = [w, b] if bias != "none" else [w]
    gw = tf.gradients(loss, params)
    gated = tf.compat.v1.train.GradientDescentOptimizer(0.1).compute_gradients(
        loss, params)  # Identity ops with control dependencies
    for grads in (gw, [g for g, _ in gated]):
      vec = tuple(grads) if bias != "none" else grads[0]
      pair = factored_grads.gradient_factors(vec, bias != "none")
      assert pair is not None
      feed = np.random.RandomState(0).randn(4, 5)
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        left, right, want = sess.run([pair[0], pair[1], grads], {x: feed})
      got = left.T @ right
      want = np.concatenate([want[0], want[1][None]]) if len(want) == 2 \
          else want[0]
      np.testing.assert_allclose(got, want, rtol=1e-12)


def test_other_gradients_do_not_match():
  with tf.Graph().as_default():
    x, w, b, loss = _layer("add")
    gw, gb = tf.gradients(loss + tf.reduce_sum(w**2), [w, b])
    assert factored_grads.gradient_factors((gw, gb), True) is None  # l2 term
    gw, gb = tf.gradients(loss, [w, b])
    assert factored_grads.gradient_factors((gw, gb * 2.0), True) is None
    assert factored_grads.gradient_factors((gw, gb), False) is None
    assert factored_grads.gradient_factors(gw, True) is None
    assert factored_grads.gradient_factors(
        tf.IndexedSlices(gw, tf.range(5)), False) is None
    wt = tf.Variable(np.ones([3, 5]))
    gt = tf.gradients(tf.reduce_sum(tf.matmul(x, wt, transpose_b=True)), wt)
    # grad of a transposed use is MatMul(d, x, transpose_a=True): still
    # exactly L^T R, so it matches, with the roles swapped.
    assert factored_grads.gradient_factors(gt[0], False) is not None
  assert factored_grads.gradient_factors(tf.ones([5, 3]), False) is None


def test_matches_in_tf_function_and_keras():
  import keras  # pylint: disable=g-import-not-at-top
  layer = keras.layers.Dense(3)
  layer.build((None, 5))
  found = []

  @tf.function
  def step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.tanh(layer(x)))
    grads = tape.gradient(loss, [layer.kernel, layer.bias])
    found.append(factored_grads.gradient_factors(tuple(grads), True))
    return grads

  step.get_concrete_function(tf.TensorSpec([None, 5], tf.float32))
  assert found and found[0] is not None


def test_cost_choice():
  def run(rows, feed_rows=None):
    with tf.Graph().as_default():
      x = tf.compat.v1.placeholder(tf.float32, [rows, 100])
      d = tf.zeros([tf.shape(x)[0], 200])
      out = factored_grads.prefer_factored(
          x, d, lambda: tf.constant(1), lambda: tf.constant(2))
      with tf.compat.v1.Session() as sess:
        return sess.run(out, {x: np.zeros([feed_rows or rows, 100])})
  # limit = 100*200*300 // (100^2 + 200^2 + 100*200) = 85 rows
  assert run(84) == 1 and run(85) == 2
  assert run(None, 84) == 1 and run(None, 85) == 2


# ------------------------------------------------------------ training
def _model(x, variables, lc):
  h = x
  for i, (w, b) in enumerate(variables):
    pre = tf.matmul(h, w) + b
    if lc is not None:
      lc.register_fully_connected((w, b), h, pre)
    h = tf.tanh(pre) if i < len(variables) - 1 else pre
  return h


def _variables(rng):
  return [(tf.Variable(rng.randn(a, b) / np.sqrt(a)),
           tf.Variable(rng.randn(b) * 0.1))
          for a, b in zip(SIZES[:-1], SIZES[1:])]


def _loss(x, out):
  return 0.5 * tf.reduce_mean(tf.reduce_sum(tf.square(out - x), 1))


def _opt_kwargs(adaptive):
  if adaptive:
    # one burn-in step (they move no parameter), then four updates
    return recipe.adaptive_kwargs(invert_every=2, dtype="float64",
                                  num_burnin_steps=1)
  return dict(invert_every=2, cov_update_every=1, learning_rate=0.1,
              damping=0.1, momentum=0.9, momentum_type="regular",
              dtype="float64")


def _train_tf1(adaptive, static_batch):
  rng = np.random.RandomState(0)
  data = [rng.randn(n, SIZES[0]) for n in BATCHES]
  with tf.Graph().as_default():
    tf.compat.v1.set_random_seed(0)
    if static_batch:
      xs = [tf.compat.v1.placeholder(tf.float64, batch.shape)
            for batch in data]
    else:
      xs = [tf.compat.v1.placeholder(tf.float64, [None, SIZES[0]])]
    variables = _variables(rng)
    flat = [v for pair in variables for v in pair]
    train_ops = []
    opt = None
    for x in xs:
      lc = kfac.LayerCollection()
      out_t = _model(x, variables, lc)
      lc.register_normal_predictive_distribution(out_t, var=1.0)
      loss = _loss(x, out_t)
      kwargs = _opt_kwargs(adaptive)
      if adaptive:
        kwargs.update(loss_fn=lambda b: _loss(b, _model(b, variables, None)),
                      train_batch=x)
      opt = kfac.PeriodicInvCovUpdateKfacOpt(layer_collection=lc, **kwargs)
      train_ops.append(opt.minimize(loss, var_list=flat))
      if not static_batch:
        break
    init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session() as sess:
      sess.run(init)
      start = sess.run(flat)
      for i, batch in enumerate(data):
        j = i if static_batch else 0
        sess.run(train_ops[j], {xs[j]: batch})
      out = sess.run(flat)
  moved = max(np.abs(a - b).max() for a, b in zip(out, start))
  assert moved > 1e-3, moved  # the steps did change the parameters
  return out


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("adaptive", [False, True])
def test_tf1_training_equals_plain(adaptive, plain_only):
  got = _train_tf1(adaptive, static_batch=False)
  plain_only()
  want = _train_tf1(adaptive, static_batch=False)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)


@pytest.mark.slow  # a graph per batch size, twice
def test_tf1_training_with_static_batches_equals_plain(plain_only):
  got = _train_tf1(False, static_batch=True)
  plain_only()
  want = _train_tf1(False, static_batch=True)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)


def _train_tf2():
  rng = np.random.RandomState(0)
  data = [tf.constant(rng.randn(n, SIZES[0])) for n in BATCHES]
  variables = _variables(rng)
  flat = [v for pair in variables for v in pair]
  opt = kfac.PeriodicInvCovUpdateKfacOpt(**_opt_kwargs(False))

  @tf.function(input_signature=[tf.TensorSpec([None, SIZES[0]],
                                              tf.float64)])
  def step(x):
    lc = kfac.LayerCollection()
    out_t = _model(x, variables, lc)
    lc.register_normal_predictive_distribution(out_t, var=1.0)
    opt.minimize(_loss(x, out_t), var_list=flat, layer_collection=lc)

  for batch in data:
    step(batch)
  return [v.numpy() for v in flat]


def test_tf_function_training_equals_plain(plain_only):
  got = _train_tf2()
  plain_only()
  want = _train_tf2()
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)


def test_block_uses_the_factored_form(monkeypatch):
  """The dense block builds the factored product for a matching gradient
  (the equality tests above would also pass if it never did)."""
  calls = []
  real = factored_grads.prefer_factored

  def spy(x, d, factored, plain, plain_in_branch=None):
    calls.append((x, d))
    return real(x, d, factored, plain, plain_in_branch)

  monkeypatch.setattr(factored_grads, "prefer_factored", spy)
  _train_tf1(False, static_batch=False)
  assert len(calls) >= len(SIZES) - 1


# ------------------------------------------------------------ unread products
def test_rebuilt_only_inside_the_context_and_when_unread():
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 4])
    w = tf.Variable(np.ones([4, 3], np.float32))
    loss = tf.reduce_sum(tf.tanh(tf.matmul(x, w)))
    grad = tf.gradients(loss, [w])[0]
    assert factored_grads.rebuilt(grad, False) is grad  # no context
    with factored_grads.gradients_read_only_here():
      again = factored_grads.rebuilt(grad, False)
      assert again is not grad and again.op.type == "MatMul"
      assert factored_grads.product_operands(again) == (
          factored_grads.product_operands(grad))
      read = tf.identity(grad)  # now something reads the gradient
      assert factored_grads.rebuilt(grad, False) is grad
    fresh = tf.gradients(loss, [w])[0]
    with factored_grads.gradients_read_only_here(False):
      assert factored_grads.rebuilt(fresh, False) is fresh
    del read


def _matmul_count(meta):
  return sum(1 for dev in meta.step_stats.dev_stats
             for node in dev.node_stats
             if " = " in node.timeline_label and "MatMul" in
             node.timeline_label.split(" = ")[1].split("(")[0])


def _step_matmuls(read_once, batch, nan_layer=None):
  """MatMul ops run by the second training step (not an inverse or
  statistics step) of the SIZES model with a run-time batch, the
  parameters after it, and the guard's skipped_steps."""
  rng = np.random.RandomState(0)
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float64, [None, SIZES[0]])
    variables = _variables(rng)
    flat = [v for pair in variables for v in pair]
    lc = kfac.LayerCollection()
    h = x
    for i, (w, b) in enumerate(variables):
      pre = tf.matmul(h, w) + b
      lc.register_fully_connected((w, b), h, pre)
      if i == nan_layer:  # a finite value whose gradient is NaN
        pre = _nan_gradient(pre)
      h = tf.tanh(pre) if i < len(variables) - 1 else pre
    lc.register_normal_predictive_distribution(h, var=1.0)
    opt = kfac.PeriodicInvCovUpdateKfacOpt(
        layer_collection=lc, invert_every=10, cov_update_every=2,
        learning_rate=0.1, damping=0.1, momentum=0.9,
        momentum_type="regular", dtype="float64")
    if not read_once:
      opt._gradients_read_once = lambda: False  # pylint: disable=protected-access
    train = opt.minimize(_loss(x, h), var_list=flat)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      data = rng.randn(batch, SIZES[0])
      sess.run(train, {x: data})
      before = sess.run(flat)
      meta = tf.compat.v1.RunMetadata()
      sess.run(train, {x: data}, run_metadata=meta,
               options=tf.compat.v1.RunOptions(
                   trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
      return (_matmul_count(meta), before, sess.run(flat),
              (sess.run(opt.skipped_steps), variables[2][0].name.split(":")[0]))


@tf.custom_gradient
def _nan_gradient(t):
  return tf.identity(t), lambda dy: dy * np.nan


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("control_flow", ["v2", "v1"])
def test_factored_step_does_not_compute_the_products(control_flow):
  """At 3 rows every layer takes the factored form: the four weight
  gradients x^T d are not computed (the guard reads x and d), and the
  values are those of the step that computes them. With control flow v2
  and v1 (legacy graphs)."""
  with util.control_flow(control_flow):
    count, _, after, _ = _step_matmuls(True, 3)
    want_count, _, want, _ = _step_matmuls(False, 3)
  assert count == want_count - (len(SIZES) - 1), (count, want_count)
  for a, b in zip(after, want):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
  # At 100 rows (plain form) the products are computed once either way.
  with util.control_flow(control_flow):
    count, _, after, _ = _step_matmuls(True, 100)
    want_count, _, want, _ = _step_matmuls(False, 100)
  assert count == want_count, (count, want_count)
  for a, b in zip(after, want):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("batch", [3, 100])
def test_guard_skips_a_step_whose_d_is_not_finite(batch, capfd):
  """A NaN in a layer's output gradient d (the loss stays finite) makes
  its weight gradient non-finite: the step is skipped, and the warning
  names that gradient, whether the guard read the product (plain form)
  or its operands (factored form)."""
  _, before, after, (skipped, name) = _step_matmuls(True, batch, nan_layer=2)
  assert skipped == 2  # both steps
  for a, b in zip(after, before):
    np.testing.assert_array_equal(a, b)
  assert "gradient of %s," % name in capfd.readouterr().err
