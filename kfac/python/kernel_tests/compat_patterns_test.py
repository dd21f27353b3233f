"""The usage patterns of the old library's examples, run against ours.

Each test is written the way a kfac 0.2.x script drives the library (TF1
graph, tf.compat.v1 only, the old names and return values), on tiny models
with fixed data, and checks a number: a manual schedule of the update thunks
equals PeriodicInvCovUpdateKfacOpt step for step (float64, rtol 1e-10); an
MLP classifier, a small convnet and an RNN over time steps with multi-use
registration train (loss falls by a stated factor, global_step counts the
steps); auto-registration by graph search gives the same steps as manual
registration.
"""

import numpy as np
import tensorflow as tf

import kfac

tf1 = tf.compat.v1
N = 32
TOL = dict(rtol=1e-10, atol=1e-12)


def _data(shape, classes=3, seed=0):
  rng = np.random.RandomState(seed)
  x = rng.randn(N, *shape)
  w = rng.randn(int(np.prod(shape)), classes)
  y = np.argmax(x.reshape(N, -1) @ w, axis=1)
  return x, y


def _dense(x, n_out, name, act=None):
  n_in = int(x.shape[-1])
  rng = np.random.RandomState(sum(map(ord, name)))
  w = tf1.get_variable(name + "/w", initializer=rng.randn(n_in, n_out) /
                       np.sqrt(n_in))
  b = tf1.get_variable(name + "/b", initializer=np.zeros(n_out))
  pre = tf.matmul(x, w) + b
  return (act(pre) if act else pre), (w, b), pre


def _mlp(x, lc):
  h, params, pre = _dense(x, 8, "fc1", tf.tanh)
  lc.register_fully_connected(params, x, pre)
  logits, params, _ = _dense(h, 3, "fc2")
  lc.register_fully_connected(params, h, logits)
  return logits


def _train(build, steps, feed_losses=True):
  """Runs `build()` -> (loss, train_op) in a fresh graph; returns the losses
  and the final values of the trainable variables (sorted by name)."""
  with tf.Graph().as_default():
    tf1.set_random_seed(0)
    loss, train_op, extra = build()
    variables = sorted(tf1.trainable_variables(), key=lambda v: v.name)
    losses = []
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      for step in range(steps):
        if extra is not None:
          extra(sess, step)
        losses.append(sess.run([loss, train_op])[0] if feed_losses else
                      sess.run(train_op))
      gs = sess.run(tf1.train.get_or_create_global_step())
      return np.array(losses), sess.run(variables), gs


def _classifier(x_np, y_np, opt_kwargs, manual=False, invert_every=1):
  def build():
    x = tf.constant(x_np)
    lc = kfac.LayerCollection()
    logits = _mlp(x, lc)
    lc.register_softmax_cross_entropy_loss(logits)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.constant(y_np), logits=logits))
    gs = tf1.train.get_or_create_global_step()
    if not manual:
      opt = kfac.PeriodicInvCovUpdateKfacOpt(
          invert_every=invert_every, cov_update_every=1, layer_collection=lc,
          **opt_kwargs)
      return loss, opt.minimize(loss, global_step=gs), None
    # The old convnet example's manual schedule: build the update ops from
    # the thunks, run the statistics and (every invert_every steps) the
    # inverses, then the step.
    opt = kfac.KfacOptimizer(layer_collection=lc, **opt_kwargs)
    cov_update_thunks, inv_update_thunks = opt.make_vars_and_create_op_thunks()
    cov_update_op = tf.group(*[thunk() for thunk in cov_update_thunks])
    inv_update_op = tf.group(*[thunk() for thunk in inv_update_thunks])
    train_op = opt.minimize(loss, global_step=gs)

    def updates(sess, step):
      sess.run(cov_update_op)
      if step % invert_every == 0:
        sess.run(inv_update_op)
    return loss, train_op, updates
  return build


OPT = dict(learning_rate=0.05, damping=0.01, momentum=0.9,
           estimation_mode="exact")


def test_manual_thunks_equal_periodic_optimizer():
  x, y = _data((5,))
  for invert_every in (1, 3):
    periodic = _train(_classifier(x, y, OPT, invert_every=invert_every), 7)
    manual = _train(_classifier(x, y, OPT, manual=True,
                                invert_every=invert_every), 7)
    np.testing.assert_allclose(manual[0], periodic[0], **TOL)
    for a, b in zip(manual[1], periodic[1]):
      np.testing.assert_allclose(a, b, **TOL)
    assert periodic[2] == manual[2] == 7


def test_mlp_classifier_trains_and_counts_steps():
  x, y = _data((5,))
  losses, _, gs = _train(_classifier(x, y, OPT, invert_every=5), 30)
  assert gs == 30
  assert np.all(np.isfinite(losses))
  assert losses[-1] < 0.3 * losses[0], losses


def _softmax_head_step(lc, h, y_np, classes, name, invert_every):
  """The old examples' head: a registered dense softmax layer, the mean
  cross-entropy and a PeriodicInvCovUpdateKfacOpt step with global_step."""
  logits, params, _ = _dense(h, classes, name)
  lc.register_fully_connected(params, h, logits)
  lc.register_softmax_cross_entropy_loss(logits)
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=tf.constant(y_np), logits=logits))
  opt = kfac.PeriodicInvCovUpdateKfacOpt(
      invert_every=invert_every, layer_collection=lc, learning_rate=0.05,
      damping=0.01, momentum=0.9)
  return loss, opt.minimize(
      loss, global_step=tf1.train.get_or_create_global_step()), None


def test_convnet_pattern_trains():
  x_np, y_np = _data((6, 6, 2))

  def build():
    x = tf.constant(x_np)
    lc = kfac.LayerCollection()
    rng = np.random.RandomState(1)
    k = tf1.get_variable("conv/w", initializer=rng.randn(3, 3, 2, 4) / 4.)
    kb = tf1.get_variable("conv/b", initializer=np.zeros(4))
    pre = tf.nn.bias_add(tf.nn.conv2d(x, k, [1, 1, 1, 1], "SAME"), kb)
    lc.register_conv2d((k, kb), (1, 1, 1, 1), "SAME", x, pre)
    h = tf.reshape(tf.nn.max_pool2d(tf.nn.relu(pre), 2, 2, "SAME"),
                   [N, 3 * 3 * 4])
    return _softmax_head_step(lc, h, y_np, 3, "fc", invert_every=2)

  losses, _, gs = _train(build, 30)
  assert gs == 30 and np.all(np.isfinite(losses))
  assert losses[-1] < 0.3 * losses[0], losses


def test_rnn_multi_use_pattern_trains():
  """The old RNN example's registration: one dense layer applied at every
  time step, registered once with lists of per-step inputs and outputs."""
  steps_t, d_in, d_h = 4, 3, 6
  rng = np.random.RandomState(2)
  x_np = rng.randn(N, steps_t, d_in)
  y_np = (x_np.sum(axis=(1, 2)) > 0).astype(np.int64)

  def build():
    lc = kfac.LayerCollection()
    x = tf.constant(x_np)
    w_in = tf1.get_variable("rnn/w_in", initializer=rng.randn(d_in + d_h, d_h)
                            / 3.)
    b_in = tf1.get_variable("rnn/b_in", initializer=np.zeros(d_h))
    h = tf.zeros([N, d_h], tf.float64)
    ins, outs = [], []
    for t in range(steps_t):
      z = tf.concat([x[:, t], h], axis=1)
      pre = tf.matmul(z, w_in) + b_in
      ins.append(z)
      outs.append(pre)
      h = tf.tanh(pre)
    lc.register_fully_connected_multi((w_in, b_in), ins, outs,
                                      approx="kron_indep")
    return _softmax_head_step(lc, h, y_np, 2, "out", invert_every=3)

  losses, _, gs = _train(build, 30)
  assert gs == 30 and np.all(np.isfinite(losses))
  assert losses[-1] < 0.5 * losses[0], losses


def test_auto_registration_pattern_equals_manual():
  """The old autoencoder example registers its layers by graph search
  (layer_collection.auto_register_layers()); the steps equal manual
  registration."""
  x_np, y_np = _data((5,))

  def build(auto):
    def inner():
      x = tf.constant(x_np)
      lc = kfac.LayerCollection()
      if auto:
        h, _, _ = _dense(x, 8, "fc1", tf.tanh)
        logits, _, _ = _dense(h, 3, "fc2")
      else:
        logits = _mlp(x, lc)
      lc.register_softmax_cross_entropy_loss(logits)
      if auto:
        lc.auto_register_layers()
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=tf.constant(y_np), logits=logits))
      opt = kfac.PeriodicInvCovUpdateKfacOpt(
          invert_every=2, layer_collection=lc, **OPT)
      return loss, opt.minimize(
          loss, global_step=tf1.train.get_or_create_global_step()), None
    return inner

  manual = _train(build(False), 6)
  auto = _train(build(True), 6)
  np.testing.assert_allclose(auto[0], manual[0], **TOL)
  for a, b in zip(auto[1], manual[1]):
    np.testing.assert_allclose(a, b, **TOL)


def _rnn_graph(register, steps=3):
  """A tanh RNN h_t = tanh(x_t W + h_{t-1} U) over `steps` steps in a TF1
  graph; register(lc, (w, u), xs, hs_in, pre_x, pre_h) registers it. The
  loss is the last state's squared error."""
  graph = tf.Graph()
  with graph.as_default():
    rng = np.random.RandomState(0)
    w = tf.compat.v1.get_variable("w", initializer=rng.randn(2, 3))
    u = tf.compat.v1.get_variable("u", initializer=rng.randn(3, 3) * 0.5)
    xs = [tf.constant(rng.randn(4, 2)) for _ in range(steps)]
    h = tf.zeros([4, 3], tf.float64)
    hs_in, pre_x, pre_h = [], [], []
    for x in xs:
      hs_in.append(h)
      pre_x.append(tf.matmul(x, w))
      pre_h.append(tf.matmul(h, u))
      h = tf.tanh(pre_x[-1] + pre_h[-1])
    lc = kfac.LayerCollection()
    register(lc, (w, u), xs, hs_in, pre_x, pre_h)
    lc.register_squared_error_loss(h)
    loss = tf.reduce_sum(tf.square(h))
  return graph, lc, (w, u), loss


def test_mis_registered_rnn_is_an_error_of_the_optimizer():
  """kfac 0.2.x's use count runs when the optimizer sets up (TF1 graphs):
  an RNN whose recurrent weight is registered at one step only is an error
  naming the weight and both counts."""
  import pytest  # pylint: disable=g-import-not-at-top

  def once(lc, params, xs, hs_in, pre_x, pre_h):
    w, u = params
    lc.register_fully_connected_multi(w, xs, pre_x)
    lc.register_fully_connected(u, hs_in[-1], pre_h[-1])  # 1 of 3 uses

  graph, lc, _, loss = _rnn_graph(once)
  with graph.as_default():
    opt = kfac.PeriodicInvCovUpdateKfacOpt(
        learning_rate=0.1, damping=0.1, layer_collection=lc)
    with pytest.raises(ValueError,
                       match=r"u is registered with 1 use\(s\) but the graph "
                       r"of the registered losses uses it 3 time"):
      opt.minimize(loss)
  graph, lc, params, _ = _rnn_graph(once)
  with graph.as_default():
    with pytest.raises(ValueError, match="u is registered with 1 use"):
      kfac.estimator.FisherEstimator(
          variables=list(params), cov_ema_decay=0.9, damping=0.1,
          layer_collection=lc).make_vars_and_create_op_thunks()


def test_legitimate_registrations_pass_the_use_count():
  """Every use registered (a list over uses, towers, a generic block), uses
  folded into one op and split after it, and one lookup whose rows feed
  several ops: the optimizer builds its step."""

  def per_use(lc, params, xs, hs_in, pre_x, pre_h):
    w, u = params
    lc.register_fully_connected_multi(w, xs, pre_x)
    lc.register_fully_connected_multi(u, hs_in, pre_h)

  def towers_and_generic(lc, params, xs, hs_in, pre_x, pre_h):
    w, u = params
    for t, (x, z) in enumerate(zip(xs, pre_x)):
      lc.register_fully_connected(w, x, z, reuse=t > 0)
    lc.register_generic(u, 4)

  for register in (per_use, towers_and_generic):
    graph, lc, _, loss = _rnn_graph(register)
    with graph.as_default():
      kfac.PeriodicInvCovUpdateKfacOpt(
          learning_rate=0.1, damping=0.1, layer_collection=lc).minimize(loss)

  with tf.Graph().as_default():
    rng = np.random.RandomState(1)
    w = tf.compat.v1.get_variable("w", initializer=rng.randn(2, 3))
    table = tf.compat.v1.get_variable("table", initializer=rng.randn(5, 3))
    words = tf.compat.v1.get_variable("words", initializer=rng.randn(5, 3))
    ids = tf.constant(rng.randint(0, 5, (4, 3)))
    xs = [tf.constant(rng.randn(4, 2)) for _ in range(3)]
    # One matmul on the stacked uses, split after it.
    outs = tf.split(tf.matmul(tf.concat(xs, 0), w), 3)
    # One lookup (one use), its rows read by three ops.
    emb = tf.gather(table, ids[:, 0])                 # [4, 3]
    centred = (emb - tf.reduce_mean(emb, 1, keepdims=True)) * tf.reduce_max(
        emb)
    # One lookup of three positions, split into the three uses.
    per_position = tf.unstack(tf.gather(words, ids), axis=1)
    lc = kfac.LayerCollection()
    lc.register_fully_connected_multi(w, xs, outs)
    lc.register_fully_connected(table, ids[:, 0], emb, dense_inputs=False)
    lc.register_fully_connected_multi(
        words, tf.unstack(ids, axis=1), per_position, dense_inputs=False)
    prediction = tf.add_n(outs + per_position) + centred
    lc.register_squared_error_loss(prediction)
    loss = tf.reduce_sum(tf.square(prediction))
    opt = kfac.PeriodicInvCovUpdateKfacOpt(
        learning_rate=0.1, damping=0.1, layer_collection=lc)
    train = opt.minimize(loss)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      before = sess.run([w, table, words])
      for _ in range(3):
        sess.run(train)
      assert sess.run(opt.counter) == 3
      for old, new in zip(before, sess.run([w, table, words])):
        assert np.all(np.isfinite(new)) and np.any(old != new)


def test_minimize_var_list_replaces_the_trainable_default():
  """In a TF1 graph the default var_list is the graph's trainable variables
  (kfac 0.2.x); minimize(var_list=...) before the first step replaces it,
  so a trainable damping variable need not be registered."""
  with tf.Graph().as_default():
    x_np, y_np = _data([3])
    x = tf.constant(x_np.astype(np.float32))
    w = tf.compat.v1.get_variable("w", [3, 3])
    logits = tf.matmul(x, w)
    lc = kfac.LayerCollection()
    lc.register_fully_connected(w, x, logits)
    lc.register_softmax_cross_entropy_loss(logits)
    damping = tf.Variable(0.1)  # trainable, not a parameter
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.constant(y_np), logits=logits))
    opt = kfac.PeriodicInvCovUpdateKfacOpt(
        learning_rate=0.1, damping=damping, layer_collection=lc)
    train = opt.minimize(loss, var_list=[w])
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      before = sess.run(loss)
      for _ in range(5):
        sess.run(train)
      assert sess.run(loss) < before
    # Without a var_list the default (w and the damping variable) stands.
    opt2 = kfac.PeriodicInvCovUpdateKfacOpt(
        learning_rate=0.1, damping=0.1, layer_collection=lc, name="other")
    import pytest  # pylint: disable=g-import-not-at-top
    with pytest.raises(ValueError, match="variables Variable"):
      opt2.minimize(loss)
