"""The automatic recipe's switch (adaptive/recipe/switch.py): one traced
step that runs the exact recipe until the switch, then the minibatch
recipe.

Oracles (float64, a two-layer tanh network with a softmax loss on 16
examples; relative tolerance 1e-10, the two graphs differ in the order of
their sums only):
* unswitched, the step equals PeriodicInvCovUpdateKfacOpt with the exact
  recipe's arguments (recipe.adaptive_kwargs): weights, learning rate,
  momentum, damping after every step (burn-in, calibration, inverse
  periods and damping adaptations included);
* switched before the first step, it equals PeriodicInvCovUpdateKfacOpt
  with the minibatch recipe's arguments at the phase's periods (and the
  exact recipe's burn-in and calibration, which the switched step keeps);
* switched in the middle of a run, the next step is the minibatch rule
  computed here by hand (v <- momentum v + clip(F^-1 g), w <- w - lr v)
  from the inverses and velocities before it, the velocities taken as
  zero at the first switched step (the momentum restarts), and the step's
  periods are the phase's (no inverse update where the exact recipe's
  period had one).
Both worlds: a TF1 Session graph and a tf.function. The Keras recipe='auto'
(it sets the switch from the measured noise scale) is tested in
keras_adaptive_test.py.
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.ops.adaptive import recipe
from kfac.python.ops.adaptive.recipe import switch as switch_lib
from kfac.python.ops.tensors import utils as tensor_utils

RTOL = 1e-10
N, D_IN, D_HID, D_OUT = 16, 5, 4, 3
STEPS = 16
# Short periods, so that 16 steps cross several of each.
PHASE = switch_lib.MinibatchPhase(
    learning_rate=0.3, momentum=0.9, norm_constraint=1e-4,
    cov_update_every=3, invert_every=3, damping_adaptation_interval=4,
    damping_adaptation_decay=0.9, initial_damping=0.5)
WORLDS = ("graph", "function")


def _data():
  rng = np.random.RandomState(0)
  x = rng.randn(N, D_IN)
  y = rng.randint(0, D_OUT, N)
  inits = [rng.randn(D_IN, D_HID) * 0.5, np.zeros(D_HID),
           rng.randn(D_HID, D_OUT) * 0.5, np.zeros(D_OUT)]
  return x, y, inits


class _Model:
  """The network, its LayerCollection and its loss (in the current graph
  or trace)."""

  def __init__(self, variables, x, y):
    self.variables = variables
    self.x, self.y = x, y

  def forward(self):
    w1, b1, w2, b2 = self.variables
    hidden = tf.tanh(tf.matmul(self.x, w1) + b1)
    return hidden, tf.matmul(hidden, w2) + b2

  def loss(self, logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=self.y, logits=logits))

  def training(self):
    """(loss, LayerCollection) of the training forward pass."""
    w1, b1, w2, b2 = self.variables
    pre = tf.matmul(self.x, w1) + b1
    hidden = tf.tanh(pre)
    logits = tf.matmul(hidden, w2) + b2
    lc = kfac.LayerCollection()
    lc.register_fully_connected((w1, b1), self.x, pre)
    lc.register_fully_connected((w2, b2), hidden, logits)
    lc.register_softmax_cross_entropy_loss(logits)
    return self.loss(logits), lc

  def qmodel_collection(self):
    """A forward pass of its own with the loss registered on it."""
    lc = kfac.LayerCollection()
    lc.register_softmax_cross_entropy_loss(self.forward()[1])
    return lc

  def loss_fn(self, batch):
    del batch
    return self.loss(self.forward()[1])


def _kwargs(kind, model):
  common = dict(loss_fn=model.loss_fn, train_batch=(model.x,),
                use_passed_loss=False, dtype=tf.float64,
                var_list=model.variables)
  if kind == "exact":
    return recipe.adaptive_kwargs(invert_every=2, **common)
  if kind == "auto":
    return recipe.adaptive_kwargs(
        invert_every=2, minibatch_phase=PHASE,
        qmodel_layer_collection=model.qmodel_collection, **common)
  # The minibatch recipe at the phase's settings and initial damping, with
  # the exact recipe's burn-in (no calibration: the switched step has
  # none).
  return recipe.minibatch_kwargs(damping=PHASE.initial_damping,
      learning_rate=PHASE.learning_rate, momentum=PHASE.momentum,
      norm_constraint=PHASE.norm_constraint,
      cov_update_every=PHASE.cov_update_every,
      invert_every=PHASE.invert_every,
      damping_adaptation_interval=PHASE.damping_adaptation_interval,
      damping_adaptation_decay=PHASE.damping_adaptation_decay,
      num_burnin_steps=recipe.NUM_BURNIN_STEPS, **common)


def _readings(opt, variables):
  """The weights, learning rate, momentum and damping (read ops, ordered
  after the step in a TF1 graph when made under its control
  dependencies)."""
  values = list(variables) + [opt.learning_rate, opt.momentum, opt.damping]
  return [tf.identity(tf.cast(tf.convert_to_tensor(v), tf.float64))
          for v in values]


def _run(world, kind, switch_before=None, steps=STEPS):
  """[readings after each step]; `switch_before`: the step (0-based) before
  which the switch is activated (None: never)."""
  x_np, y_np, inits = _data()
  if world == "graph":
    graph = tf.Graph()
    with graph.as_default():
      variables = [tf.compat.v1.get_variable(
          "v%d" % i, initializer=tf.constant(v)) for i, v in
                   enumerate(inits)]
      model = _Model(variables, tf.constant(x_np), tf.constant(y_np))
      loss, lc = model.training()
      opt = kfac.PeriodicInvCovUpdateKfacOpt(
          layer_collection=lc, **_kwargs(kind, model))
      train = opt.minimize(loss, var_list=variables)
      with tf.control_dependencies([train]):
        read = _readings(opt, variables)
      activate = (opt.recipe_switch.activate() if kind == "auto" else None)
      out = []
      with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for i in range(steps):
          if i == switch_before:
            sess.run(activate)
          out.append(sess.run(read))
      return out
  variables = [tf.Variable(v) for v in inits]
  model = _Model(variables, tf.constant(x_np), tf.constant(y_np))
  opt = kfac.PeriodicInvCovUpdateKfacOpt(**_kwargs(kind, model))

  @tf.function
  def step():
    loss, lc = model.training()
    opt.minimize(loss, var_list=variables, layer_collection=lc)
    return loss

  out = []
  for i in range(steps):
    if i == switch_before:
      opt.recipe_switch.activate()
    step()
    out.append([r.numpy() for r in _readings(opt, variables)])
  return out


def _assert_runs_equal(got, want):
  for step, (g, w) in enumerate(zip(got, want)):
    for i, (a, b) in enumerate(zip(g, w)):
      np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-13,
                                 err_msg="step %d, reading %d" % (step, i))


@pytest.mark.parametrize("world", WORLDS)
def test_unswitched_step_is_the_exact_recipe(world):
  got = _run(world, "auto")
  want = _run(world, "exact")
  _assert_runs_equal(got, want)
  # The weights moved, and the quadratic model chose the rates.
  assert not np.allclose(got[-1][0], _data()[2][0])
  assert len({round(float(r[4]), 12) for r in got[6:]}) > 3


@pytest.mark.parametrize("world", WORLDS)
def test_switched_step_is_the_minibatch_recipe(world):
  got = _run(world, "auto", switch_before=0)
  want = _run(world, "minibatch")
  _assert_runs_equal(got, want)
  assert all(float(r[4]) == PHASE.learning_rate for r in got)
  dampings = {round(float(r[6]), 12) for r in got}
  assert len(dampings) > 1  # adapted by the rule


def _hand_step_graph(switch_at, switched=True, after_switch=0):
  """Runs the automatic recipe in a TF1 Session for `switch_at` calls,
  switches, and runs one more; returns (before, after): the weights,
  velocities, preconditioned gradient, a fixed probe preconditioned
  (F^-1 r: changes when the inverses do) and the counter before that
  call, and the weights, velocities and probe after it."""
  x_np, y_np, inits = _data()
  graph = tf.Graph()
  with graph.as_default():
    variables = [tf.compat.v1.get_variable(
        "v%d" % i, initializer=tf.constant(v)) for i, v in enumerate(inits)]
    model = _Model(variables, tf.constant(x_np), tf.constant(y_np))
    loss, lc = model.training()
    opt = kfac.PeriodicInvCovUpdateKfacOpt(layer_collection=lc,
                                           **_kwargs("auto", model))
    grads = tf.gradients(loss, variables)
    train = opt.apply_gradients(list(zip(grads, variables)))
    est = opt._require_estimator()  # pylint: disable=protected-access
    precon = [p for p, _ in est.multiply_inverse(list(zip(grads,
                                                          variables)))]
    fed = [tf.compat.v1.placeholder(tf.float64, v.shape) for v in variables]
    precon_fed = [p for p, _ in est.multiply_inverse(list(zip(fed,
                                                              variables)))]
    rng = np.random.RandomState(5)
    probe = [p for p, _ in est.multiply_inverse(
        [(tf.constant(rng.randn(*v.shape.as_list())), v)
         for v in variables])]
    velocities = [opt.state_store.get("velocity/" +
                                      tensor_utils.state_name(v))
                  for v in variables]
    with tf.compat.v1.Session(graph=graph) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      for _ in range(switch_at):
        sess.run(train)
      if switched:
        sess.run(opt.recipe_switch.activate())
      for _ in range(after_switch):
        sess.run(train)
      damping = tf.convert_to_tensor(opt.damping)
      before = sess.run([variables, velocities, precon, probe, opt.counter,
                         damping])
      sess.run(train)
      after = sess.run([variables, velocities, probe,
                        tf.convert_to_tensor(opt.damping)])
      # The step's gradient preconditioned with the inverses after it.
      after.append(sess.run(precon_fed, dict(zip(
          fed, _numpy_grads(before[0])))))
  return before, after


@pytest.mark.parametrize("calls, counter", [(11, 7), (12, 8)])
def test_switched_step_is_the_minibatch_rule_by_hand(calls, counter):
  # 5 burn-in calls, then the counter runs 0, 1, ...; the switch comes
  # after `calls`, and the second switched step is checked: counter 7 and 8
  # are multiples of none of the phase's periods (3, 3, 4); 8 is one of
  # the exact recipe's inverse period (2), which the switched step no
  # longer follows: its inverses stay.
  before, after = _hand_step_graph(switch_at=calls, after_switch=1)
  weights, velocities, precon, probe_before, got_counter = before[:5]
  assert got_counter == counter
  new_weights, new_velocities, probe_after = after[:3]
  for a, b in zip(probe_before, probe_after):
    np.testing.assert_array_equal(a, b)  # no inverse update
  assert max(np.abs(v).max() for v in velocities) > 0
  lr, mu, bound = (PHASE.learning_rate, PHASE.momentum,
                   PHASE.norm_constraint)
  # The norm constraint on p = F^-1 g: p * min(1, sqrt(C / (lr^2 <g, p>))).
  grads = _numpy_grads(weights)
  sq = sum(float(np.sum(g * p)) for g, p in zip(grads, precon))
  coeff = min(1.0, np.sqrt(bound / (lr * lr * sq)))
  assert coeff < 1.0  # the constraint is active here
  want_v = [mu * v + coeff * p for v, p in zip(velocities, precon)]
  for got, want in zip(new_velocities, want_v):
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-13)
  for got, w, v in zip(new_weights, weights, want_v):
    np.testing.assert_allclose(got, w - lr * v, rtol=RTOL, atol=1e-13)


def test_first_switched_step_restarts_damping_inverses_and_momentum():
  # The switch after 12 calls: the next step (counter 7, a multiple of no
  # period) sets the damping to the phase's initial damping, recomputes
  # the inverses with it (the probe changes) and takes the velocities as
  # zero: its velocity is the clipped F^-1 g of the new inverses alone.
  before, after = _hand_step_graph(switch_at=12, after_switch=0)
  weights, velocities, _, probe_before, counter, damping_before = before
  assert counter == 7
  new_weights, new_velocities, probe_after, damping_after, precon = after
  assert damping_before != PHASE.initial_damping
  assert damping_after == PHASE.initial_damping
  assert any(not np.allclose(a, b, rtol=1e-6)
             for a, b in zip(probe_before, probe_after))  # inverses redone
  assert max(np.abs(v).max() for v in velocities) > 0
  lr, bound = PHASE.learning_rate, PHASE.norm_constraint
  grads = _numpy_grads(weights)
  sq = sum(float(np.sum(g * p)) for g, p in zip(grads, precon))
  coeff = min(1.0, np.sqrt(bound / (lr * lr * sq)))
  for v, p, w0, w1 in zip(new_velocities, precon, weights, new_weights):
    np.testing.assert_allclose(v, coeff * p, rtol=RTOL, atol=1e-13)
    np.testing.assert_allclose(w1, w0 - lr * v, rtol=RTOL, atol=1e-13)


def test_unswitched_step_keeps_the_exact_periods():
  # The same call unswitched (counter 8, a multiple of the exact recipe's
  # inverse period 2) updates the inverses: the probe changes.
  before, after = _hand_step_graph(switch_at=13, switched=False)
  assert before[4] == 8
  assert any(not np.allclose(a, b, rtol=1e-6)
             for a, b in zip(before[3], after[2]))


def _numpy_grads(weights):
  """The gradient of the mean softmax loss of the network, in numpy."""
  x, y, _ = _data()
  w1, b1, w2, b2 = weights
  pre = x @ w1 + b1
  h = np.tanh(pre)
  logits = h @ w2 + b2
  p = np.exp(logits - logits.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  d_logits = p.copy()
  d_logits[np.arange(N), y] -= 1
  d_logits /= N
  g_w2 = h.T @ d_logits
  g_b2 = d_logits.sum(0)
  d_pre = (d_logits @ w2.T) * (1 - h * h)
  return [x.T @ d_pre, d_pre.sum(0), g_w2, g_b2]


def test_minibatch_phase_errors_name_the_culprit():
  x_np, y_np, inits = _data()
  variables = [tf.Variable(v) for v in inits]
  model = _Model(variables, tf.constant(x_np), tf.constant(y_np))
  kwargs = _kwargs("auto", model)
  for field, value, match in (
      ("learning_rate", 0.0, "minibatch_phase.learning_rate must be a "
       "number > 0"),
      ("momentum", 1.0, "minibatch_phase.momentum must be a number in "
       r"\[0, 1\)"),
      ("damping_adaptation_decay", 1.5, "damping_adaptation_decay must be"),
      ("norm_constraint", -1.0, "norm_constraint must be None or a number"),
      ("invert_every", 0, "minibatch_phase.invert_every must be an "
       "integer >= 1"),
      ("cov_update_every", 2.5, "cov_update_every must be an integer")):
    bad = dict(PHASE.__dict__, **{field: value})
    with pytest.raises(ValueError, match=match):
      kfac.PeriodicInvCovUpdateKfacOpt(**dict(
          kwargs, minibatch_phase=switch_lib.MinibatchPhase(**bad)))
  with pytest.raises(ValueError, match="must be a kfac recipe.MinibatchPhase"):
    kfac.PeriodicInvCovUpdateKfacOpt(**dict(kwargs, minibatch_phase={}))
  with pytest.raises(ValueError, match=r"minibatch_phase=\.\.\.\) switches "
                     "from the exact recipe.*momentum_type='regular'"):
    kfac.PeriodicInvCovUpdateKfacOpt(**recipe.minibatch_kwargs(
        learning_rate=0.1, minibatch_phase=PHASE, loss_fn=model.loss_fn,
        train_batch=(model.x,), use_passed_loss=False))
  # The quadratic model's forward pass must be built in its branch.
  opt = kfac.PeriodicInvCovUpdateKfacOpt(**dict(
      kwargs, qmodel_layer_collection=None))

  @tf.function
  def step():
    loss, lc = model.training()
    opt.minimize(loss, var_list=variables, layer_collection=lc)

  with pytest.raises(ValueError, match="qmodel_layer_collection=<a callable"):
    step()
