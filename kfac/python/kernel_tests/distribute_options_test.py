"""The distribution options at one replica: placement_strategy=
"replica_round_robin" (the greedy owner assignment) and
lazy_statistics_sync take the same steps as the defaults. Their
several-replica equivalences (bit-identical to replicated inverses; equal
to the eager sync) are in distribute_test.py."""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref
from kfac.python.ops.distribute import inverse_placement
from kfac.python.ops.distribute import lazy_sync

SIZES = (5, 8, 3)


def test_greedy_owners_balance_the_cost():
  # Largest first, each to the least loaded replica (ties: lower id).
  assert inverse_placement.assign_owners([8, 1, 1, 1, 27], 2) == [
      1, 1, 1, 1, 0]
  assert inverse_placement.assign_owners([5, 5, 5, 5], 2) == [0, 1, 0, 1]
  assert inverse_placement.assign_owners([3, 2, 1], 4) == [0, 1, 2]
  assert inverse_placement.assign_owners([], 3) == []
  # n^3 per square matrix (batched: times the batch), else the size.
  assert inverse_placement._cost([4, 4]) == 64
  assert inverse_placement._cost([3, 2, 2]) == 24
  assert inverse_placement._cost([7]) == 7


def _run(world, placement, **extra):
  inits = ref.mlp_inits(SIZES, seed=4, dtype=np.float32)
  x, labels = util.data(16, seed=5, sizes=SIZES)
  args = dict(invert_every=2, learning_rate=0.1, damping=0.05, momentum=0.5,
              estimation_mode="exact", placement_strategy=placement,
              **extra)

  def build(vs, lc):
    logits = util.register_mlp(vs, tf.constant(x, tf.float32), lc)
    util.categorical_loss(lc, logits, labels)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.constant(labels), logits=logits))

  if world == "tf1":
    with tf.Graph().as_default():
      vs = [tf.Variable(v) for v in inits]
      lc = kfac.LayerCollection()
      loss = build(vs, lc)
      opt = kfac.PeriodicInvCovUpdateKfacOpt(layer_collection=lc, **args)
      train = opt.minimize(loss, var_list=vs)
      owners = opt.estimator.inverse_owners(2) if placement else None
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for _ in range(4):
          sess.run(train)
        return sess.run(vs), owners
  vs = [tf.Variable(v) for v in inits]
  opt = kfac.PeriodicInvCovUpdateKfacOpt(**args)

  @tf.function
  def step():
    lc = kfac.LayerCollection()
    opt.minimize(build(vs, lc), var_list=vs, layer_collection=lc)

  for _ in range(4):
    step()
  return [v.numpy() for v in vs], None


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("world", ["tf1", "tf2"])
def test_one_replica_trains_as_the_default_placement(world):
  default, _ = _run(world, None)
  placed, owners = _run(world, "replica_round_robin")
  assert max(np.abs(a - i).max() for a, i in zip(
      default, ref.mlp_inits(SIZES, seed=4, dtype=np.float32))) > 1e-3
  for a, b in zip(default, placed):
    np.testing.assert_array_equal(a, b)
  if world == "tf1":
    # Factors: layer 0's A (6x6: 5 inputs and the bias) and G (8x8), layer
    # 1's A (9x9) and G (3x3); costs 216, 512, 729, 27. Greedy over 2
    # replicas: 729 -> 0; 512 -> 1; 216 -> 1 (load 512 < 729); 27 -> 1
    # (728 < 729).
    assert owners == {"Variable/A": 1, "Variable/G": 1, "Variable_2/A": 0,
                      "Variable_2/G": 1}


@pytest.mark.parametrize("world", ["tf1", "tf2"])
def test_lazy_sync_with_one_replica_is_the_eager_sync(world):
  eager, _ = _run(world, None)
  lazy, _ = _run(world, None, lazy_statistics_sync=True)
  for a, b in zip(eager, lazy):
    np.testing.assert_array_equal(a, b)


def test_lazy_sync_needs_the_statistics_ops_first():
  with tf.Graph().as_default():
    vs = [tf.Variable(v) for v in ref.mlp_inits(SIZES, seed=4,
                                                 dtype=np.float32)]
    x, labels = util.data(4, sizes=SIZES)
    lc = kfac.LayerCollection()
    util.categorical_loss(lc, util.register_mlp(
        vs, tf.constant(x, tf.float32), lc), labels)
    est = kfac.estimator.FisherEstimator(
        variables=vs, cov_ema_decay=0.9, damping=0.1, layer_collection=lc,
        estimation_mode="exact", lazy_statistics_sync=True)
    with pytest.raises(ValueError, match="statistics .cov. update ops first"):
      lazy_sync.sync_op(est.factors)


def test_unknown_placement_is_refused():
  with pytest.raises(ValueError, match="placement_strategy"):
    kfac.PeriodicInvCovUpdateKfacOpt(learning_rate=0.1, damping=0.1,
                                     placement_strategy="by_magic")


def _xla_run(jit, approx_conv):
  """4 TF2 steps of a conv + dense model; jit: the step XLA-compiled."""
  rng = np.random.RandomState(7)
  img = tf.constant(rng.randn(8, 5, 5, 2).astype(np.float32))
  y = tf.constant(rng.randint(0, 3, 8).astype(np.int32))
  k = tf.Variable(rng.randn(3, 3, 2, 3).astype(np.float32) * 0.3)
  w = tf.Variable(rng.randn(27, 3).astype(np.float32) * 0.3)
  opt = kfac.PeriodicInvCovUpdateKfacOpt(
      invert_every=2, num_burnin_steps=1, learning_rate=0.1, damping=0.05,
      momentum=0.9, estimation_mode="exact")

  @tf.function(jit_compile=jit)
  def step():
    lc = kfac.LayerCollection()
    c = tf.nn.conv2d(img, k, [1, 1, 1, 1], "VALID")
    lc.register_conv2d(k, [1, 1, 1, 1], "VALID", img, c, approx=approx_conv)
    a = tf.reshape(tf.tanh(c), [-1, 27])
    logits = tf.matmul(a, w)
    lc.register_fully_connected(w, a, logits)
    lc.register_softmax_cross_entropy_loss(logits, targets=y)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=logits))
    opt.minimize(loss, var_list=[k, w], layer_collection=lc)
    return loss

  losses = [float(step()) for _ in range(4)]
  return losses, [k.numpy(), w.numpy()]


@pytest.mark.slow  # XLA compiles the step (xla_linalg_test: its routines)
@pytest.mark.parametrize("approx_conv", ["kron", "diagonal"])
def test_step_compiles_with_xla(approx_conv):
  """The TF2 step (statistics, Cholesky-based damped inverses in their
  conditional, the update) compiles with jit_compile=True, as a TPU step
  must, and takes the same steps as without XLA (1e-5 relative)."""
  plain_losses, plain = _xla_run(False, approx_conv)
  xla_losses, xla = _xla_run(True, approx_conv)
  np.testing.assert_allclose(xla_losses, plain_losses, rtol=1e-5)
  assert plain_losses[-1] < plain_losses[0]
  for a, b in zip(plain, xla):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
