"""kfac 0.2.x's damping hooks: maybe_pre_update_adapt_damping and
include_damping_in_qmodel_change, in a TF1 Session graph and a tf.function.

The model, data and float64 references are adaptive_test.py's (the tiny MLP
with generic "full" blocks, exact curvature from per-example Jacobians).
maybe_pre_update_adapt_damping: running it as kfac 0.2.x told (before the
step, in its own session.run or in the step's) gives bit for bit the
trajectory of a run that never calls it, and the damping moves once per
adaptation: with rho always below the increase threshold, after k
evaluations it is damping0 / omega^k (omega = decay^interval).
include_damping_in_qmodel_change: the recorded qmodel_change equals the
quadratic model with the damping term, written out with numpy (relative
1e-9).
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import adaptive_test as base
from kfac.python.kernel_tests import reference as ref
from kfac.python.ops.compat_utils import legacy_constants

DAMPING, DECAY, INTERVAL = 0.05, 0.9, 2
# rho (about 1 on these steps) is always below the increase threshold.
DELAYED = dict(learning_rate=None, momentum=None, momentum_type="qmodel",
               damping=DAMPING, adapt_damping=True,
               damping_adaptation_interval=INTERVAL,
               damping_adaptation_decay=DECAY, update_damping_immediately=False,
               damping_increase_rho_threshold=5.0,
               damping_decrease_rho_threshold=10.0)


class PreUpdateTrainer(base.Trainer):
  """adaptive_test.Trainer whose script also builds
  maybe_pre_update_adapt_damping() before minimize and runs it: "separate"
  (its own session.run first), "together" (fetched with the training op,
  no control dependency) or "step" (never run: the step runs it)."""

  def __init__(self, world, inits, opt_kwargs, mode):
    self.mode = mode
    super().__init__(world, inits, opt_kwargs)

  def _train_op(self, x, labels, prev):
    self.opt.set_train_batch((x, labels))
    self.opt.set_prev_train_batch(prev)
    self.pre = None
    if self.mode != "step":
      self.pre = self.opt.maybe_pre_update_adapt_damping()
    train = super()._train_op(x, labels, prev)
    if self.pre is not None:  # the step depends on that same op
      assert self.opt.maybe_pre_update_adapt_damping() is self.pre
    return train

  def step(self, batch, prev=None):
    if self.world != "graph" or self.mode == "step":
      return super().step(batch, prev)
    feed = {self.x: batch[0], self.y: batch[1], self.px: prev[0],
            self.py: prev[1]}
    if self.mode == "separate":
      self.sess.run(self.pre, feed)
      self.sess.run(self.op, feed)
    else:
      self.sess.run([self.pre, self.op], feed)


def _trajectory(trainer, batches):
  out = []
  for t, batch in enumerate(batches):
    trainer.step(batch, prev=batches[t - 1] if t else batch)
    rec = trainer.records()
    out.append((ref.flat(trainer.params()), rec["damping"], rec["rho"]))
  return out


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("world", ref.WORLDS)
def test_running_maybe_pre_update_adapt_damping_adapts_once(world):
  batches = base._batches(5)  # pylint: disable=protected-access
  modes = ("step", "separate", "together") if world == "graph" else (
      "step", "called")
  runs = {mode: _trajectory(PreUpdateTrainer(world, base._inits(), DELAYED,  # pylint: disable=protected-access
                                             mode), batches)
          for mode in modes}
  omega = DECAY**INTERVAL
  # Adaptation steps 0, 2, 4 keep the loss; steps 1 and 3 evaluate it.
  want = [DAMPING, DAMPING / omega, DAMPING / omega, DAMPING / omega**2,
          DAMPING / omega**2]
  for mode, trajectory in runs.items():
    np.testing.assert_allclose([d for _, d, _ in trajectory], want,
                               rtol=1e-12, err_msg=mode)
    for (p, d, rho), (p0, d0, rho0) in zip(trajectory, runs["step"]):
      np.testing.assert_array_equal(p, p0, err_msg=mode)
      assert d == d0 and (rho == rho0 or np.isnan(rho) and np.isnan(rho0))


def test_old_manual_update_ops_pattern_adapts_once():
  """kfac 0.2.x's KfacOptimizer script: the statistics and inverse ops run
  by hand, the inverses after maybe_pre_update_adapt_damping() (control
  dependency), then the training step: the damping moves once per
  adaptation, as in the script without the call. (The steps themselves
  differ: with the call the inverses of an evaluation step use the new
  damping; without it they are not ordered after the step's own
  evaluation.)"""
  batches = base._batches(5)  # pylint: disable=protected-access

  def run(call):
    with tf.Graph().as_default():
      variables = [tf.Variable(v) for v in base._inits()]  # pylint: disable=protected-access
      x = tf.compat.v1.placeholder(tf.float64, [base.N, base.SIZES[0]])
      y = tf.compat.v1.placeholder(tf.int32, [base.N])
      px = tf.compat.v1.placeholder(tf.float64, [base.N, base.SIZES[0]])
      py = tf.compat.v1.placeholder(tf.int32, [base.N])
      lc = kfac.LayerCollection()
      logits = base.util.register_mlp(variables, x, lc, generic="full",
                                      batch_size=base.N)
      lc.register_softmax_cross_entropy_loss(logits, targets=y)
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=y, logits=logits))
      opt = kfac.KfacOptimizer(
          learning_rate=0.1, momentum=0.5, damping=DAMPING,
          layer_collection=lc, adapt_damping=True,
          damping_adaptation_interval=INTERVAL,
          damping_adaptation_decay=DECAY, update_damping_immediately=False,
          damping_increase_rho_threshold=5.0,
          damping_decrease_rho_threshold=10.0, estimation_mode="exact",
          loss_fn=lambda b: base._loss(variables, *b),  # pylint: disable=protected-access
          train_batch=(x, y), prev_train_batch=(px, py), dtype="float64")
      cov_thunks, inv_thunks = opt.make_vars_and_create_op_thunks()
      cov_op = tf.group(*[t() for t in cov_thunks])
      deps = [opt.maybe_pre_update_adapt_damping()] if call else []
      # The inverses read the statistics after their update (the old
      # library's scripts ordered them so; unordered, a TF1 run may read
      # either value).
      with tf.control_dependencies(deps + [cov_op]):
        inv_op = tf.group(*[t() for t in inv_thunks])
      with tf.control_dependencies([cov_op, inv_op]):
        train = opt.minimize(loss, var_list=variables)
      out = []
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for t, batch in enumerate(batches):
          prev = batches[t - 1] if t else batch
          sess.run(train, {x: batch[0], y: batch[1], px: prev[0],
                           py: prev[1]})
          out.append(sess.run([opt.damping, opt.rho]))
      return np.array(out)

  with_call, without = run(True), run(False)
  np.testing.assert_array_equal(with_call[:, 0], without[:, 0])
  omega = DECAY**INTERVAL
  np.testing.assert_allclose(with_call[:, 0], [
      DAMPING, DAMPING / omega, DAMPING / omega, DAMPING / omega**2,
      DAMPING / omega**2], rtol=1e-12)


@pytest.mark.parametrize("kwargs", [
    dict(),                                          # no damping rule
    dict(adapt_damping=True),                        # immediate rule
    dict(adapt_damping=True, update_damping_immediately=False,
         is_chief=False),                            # not the chief
])
def test_maybe_pre_update_adapt_damping_is_a_no_op_otherwise(kwargs):
  with tf.Graph().as_default():
    if kwargs.get("adapt_damping"):
      kwargs = dict(kwargs, loss_fn=lambda b: 0.0)
    opt = kfac.KfacOptimizer(learning_rate=0.1, damping=0.1, **kwargs)
    op = opt.maybe_pre_update_adapt_damping()
    assert isinstance(op, tf.Operation) and op.type == "NoOp"
    assert not op.control_inputs


def test_maybe_pre_update_adapt_damping_needs_a_graph():
  opt = kfac.KfacOptimizer(learning_rate=0.1, damping=0.1, adapt_damping=True,
                           update_damping_immediately=False,
                           loss_fn=lambda b: 0.0)
  with pytest.raises(RuntimeError, match="maybe_pre_update_adapt_damping.*"
                     "tf.function"):
    opt.maybe_pre_update_adapt_damping()


# --------------------------------------- include_damping_in_qmodel_change
@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("world", ref.WORLDS)
def test_qmodel_change_with_the_damping_term(world):
  damping, l2_reg = 0.05, 0.01
  trainer = base.Trainer(world, base._inits(), dict(  # pylint: disable=protected-access
      learning_rate=None, momentum=None, momentum_type="qmodel",
      damping=damping, l2_reg=l2_reg, include_damping_in_qmodel_change=True))
  prev_delta = np.zeros(sum(p.size for p in base._inits()))  # pylint: disable=protected-access
  for batch in base._batches(2):  # pylint: disable=protected-access
    before = trainer.params()
    trainer.step(batch)
    reference = base.Reference(before, *batch)
    g = reference.grad()
    precon = trainer.precon_matrix(damping + l2_reg)
    vecs = np.stack([np.linalg.solve(precon, g), prev_delta], 1)
    x = np.array([-trainer.records()["learning_rate"],
                  trainer.records()["momentum"]])
    m = (vecs.T @ reference.curvature() @ vecs +
         (damping + l2_reg) * vecs.T @ vecs)
    want = 0.5 * x @ m @ x + x @ (vecs.T @ g)
    assert trainer.records()["qmodel_change"] == pytest.approx(want,
                                                               rel=1e-9)
    # Without the damping term it would be smaller in magnitude.
    without = want - 0.5 * damping * x @ (vecs.T @ vecs) @ x
    assert abs(without - want) > 1e-6 * abs(want)
    prev_delta = ref.flat(trainer.params()) - ref.flat(before)


@pytest.mark.parametrize("world", ref.WORLDS)
def test_exact_model_change_of_a_fixed_step_with_the_damping_term(world):
  damping, l2_reg = 0.1, 0.02
  trainer = base.Trainer(world, base._inits(), dict(  # pylint: disable=protected-access
      learning_rate=0.3, momentum=0.5, momentum_type="adam", damping=damping,
      l2_reg=l2_reg, adapt_damping=True, damping_adaptation_interval=1,
      always_use_exact_qmodel_for_damping_adjustment=True,
      include_damping_in_qmodel_change=True))
  batch = base._batches(1)[0]  # pylint: disable=protected-access
  before = trainer.params()
  trainer.step(batch)
  delta = ref.flat(trainer.params()) - ref.flat(before)
  reference = base.Reference(before, *batch)
  curvature = reference.curvature() + (l2_reg + damping) * np.eye(delta.size)
  want = 0.5 * delta @ curvature @ delta + reference.grad() @ delta
  assert trainer.records()["qmodel_change"] == pytest.approx(want, rel=1e-9)


def test_include_damping_default_comes_from_set_global_constants():
  try:
    kfac.optimizer.set_global_constants(include_damping_in_qmodel_change=True)
    made_after = kfac.KfacOptimizer(learning_rate=0.1, damping=0.1)
    explicit = kfac.KfacOptimizer(learning_rate=0.1, damping=0.1,
                                  include_damping_in_qmodel_change=False)
  finally:
    legacy_constants.restore_defaults()
  assert made_after._include_damping_in_qmodel_change is True  # pylint: disable=protected-access
  assert explicit._include_damping_in_qmodel_change is False  # pylint: disable=protected-access
  assert kfac.KfacOptimizer(
      learning_rate=0.1,
      damping=0.1)._include_damping_in_qmodel_change is False  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="include_damping_in_qmodel_change"):
    kfac.KfacOptimizer(learning_rate=0.1, damping=0.1,
                       include_damping_in_qmodel_change="yes")
