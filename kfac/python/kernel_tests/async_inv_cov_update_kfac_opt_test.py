"""AsyncInvCovUpdateKfacOpt: statistic and inverse updates in Session
threads (kfac.python.ops.kfac_utils.async_inv_cov_update_kfac_opt)."""

import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref
from kfac.python.ops.kfac_utils import async_inv_cov_update_kfac_opt as mod

SIZES = (5, 8, 3)
COMMON = dict(learning_rate=0.1, damping=0.05, momentum=0.5,
              cov_ema_decay=0.0, estimation_mode="empirical",
              momentum_type="regular")


def _model(batch, lc, n=32, seed=3):
  """Tanh MLP on a fixed batch (constants: no placeholder)."""
  x, labels = util.data(n, seed=seed, sizes=SIZES)
  inits = ref.mlp_inits(SIZES, seed=11, dtype=np.float32)
  vs = [tf.Variable(v) for v in inits]
  x = batch if batch is not None else tf.constant(x, tf.float32)
  logits = util.register_mlp(vs, x, lc)
  util.categorical_loss(lc, logits, labels)
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=tf.constant(labels), logits=logits))
  return vs, loss


def test_public_names_and_old_import_path():
  assert kfac.AsyncInvCovUpdateKfacOpt is mod.AsyncInvCovUpdateKfacOpt
  assert issubclass(kfac.AsyncInvCovUpdateKfacOpt, kfac.KfacOptimizer)


def test_cov_then_inverse_ops_then_step_equal_the_periodic_first_step():
  """The thread's work, run by hand in its order (statistics, inverses),
  then the training op: the periodic optimizer's first step (invert_every
  1), bit for bit."""
  results = []
  for kind in ("async", "periodic"):
    with tf.Graph().as_default():
      lc = kfac.LayerCollection()
      vs, loss = _model(None, lc)
      if kind == "async":
        opt = kfac.AsyncInvCovUpdateKfacOpt(
            cov_devices=["/cpu:0"], inv_devices=["/cpu:0"],
            layer_collection=lc, **COMMON)
      else:
        opt = kfac.PeriodicInvCovUpdateKfacOpt(
            invert_every=1, layer_collection=lc, **COMMON)
      train_op = opt.minimize(loss, var_list=vs)
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        if kind == "async":
          ops = opt.cov_inv_ops
          # Two dense layers: 2 x 2 Kronecker factors, statistics first.
          assert len(ops) == 8
          assert opt.num_cov_inv_update_threads == 4
          for op in ops:
            sess.run(op)
        sess.run(train_op)
        results.append(sess.run(vs))
  moved = max(np.abs(a).max() for a in results[0])
  assert moved > 0
  for a, b in zip(*results):
    np.testing.assert_array_equal(a, b)


def test_threads_update_the_inverses_while_training():
  """Training with the threads running: the inverses get computed in the
  background and the loss falls; stop joins the threads."""
  with tf.Graph().as_default():
    lc = kfac.LayerCollection()
    vs, loss = _model(None, lc, n=64)
    opt = kfac.AsyncInvCovUpdateKfacOpt(
        cov_devices=None, inv_devices=None, num_cov_inv_update_threads=2,
        layer_collection=lc, **dict(COMMON, cov_ema_decay=0.9))
    global_step = tf.compat.v1.train.get_or_create_global_step()
    train_op = opt.minimize(loss, var_list=vs, global_step=global_step)
    inv_vars = opt.get_inv_vars()
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      first = sess.run(loss)
      opt.run_cov_inv_ops(sess)
      threads = list(opt._threads)
      assert len(threads) == 2 and all(t.is_alive() for t in threads)
      # Wait (a failure guard only) until every inverse has been computed.
      deadline = time.time() + 120
      while not all(np.abs(v).max() > 0 for v in sess.run(inv_vars)):
        assert time.time() < deadline, "inverses never updated"
        time.sleep(0.01)
      for _ in range(30):
        sess.run(train_op)
      opt.stop_cov_inv_ops(sess)
      # stop joined the threads: none of them can run an update any more.
      assert opt._threads is None
      assert not any(t.is_alive() for t in threads), threads
      assert not [t for t in threading.enumerate()
                  if t.name.startswith("kfac_cov_inv_")]
      last = sess.run(loss)
      assert sess.run(global_step) == 30
  assert last < 0.75 * first, (first, last)


def test_error_in_a_thread_is_raised_by_stop():
  """An op failing in a thread (a statistic of a NaN input, caught by
  check_numerics) stops the threads; stop_cov_inv_ops raises its error."""
  with tf.Graph().as_default():
    bad = tf.Variable(np.zeros((32, SIZES[0]), np.float32), trainable=False)
    x = tf.debugging.check_numerics(bad / bad, "input is NaN")
    lc = kfac.LayerCollection()
    vs, loss = _model(x, lc)
    opt = kfac.AsyncInvCovUpdateKfacOpt(
        cov_devices=None, inv_devices=None, layer_collection=lc, **COMMON)
    opt.minimize(loss, var_list=vs)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      opt.run_cov_inv_ops(sess)
      threads = list(opt._threads)
      # The coordinator's stop event, set by the failing thread (the
      # timeout is a failure guard only).
      assert opt._coord.wait_for_stop(120), "the failing op never stopped them"
      with pytest.raises(tf.errors.InvalidArgumentError, match="input is NaN"):
        opt.stop_cov_inv_ops(sess)
      assert not any(t.is_alive() for t in threads), threads


def test_placeholder_inputs_are_refused_with_a_clear_error():
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, SIZES[0]], name="images")
    lc = kfac.LayerCollection()
    vs, loss = _model(x, lc)
    opt = kfac.AsyncInvCovUpdateKfacOpt(
        cov_devices=None, inv_devices=None, layer_collection=lc, **COMMON)
    opt.minimize(loss, var_list=vs)
    with tf.compat.v1.Session() as sess:
      with pytest.raises(ValueError, match="placeholder.*images"):
        opt.run_cov_inv_ops(sess)


def test_usage_errors():
  with pytest.raises(TypeError, match="placement_strategy"):
    kfac.AsyncInvCovUpdateKfacOpt(None, None, placement_strategy=None,
                                  **COMMON)
  for bad in (0, 1.5, True):
    with pytest.raises(ValueError, match="num_cov_inv_update_threads"):
      kfac.AsyncInvCovUpdateKfacOpt(None, None,
                                    num_cov_inv_update_threads=bad, **COMMON)
  with tf.Graph().as_default():
    lc = kfac.LayerCollection()
    vs, loss = _model(None, lc)
    opt = kfac.AsyncInvCovUpdateKfacOpt(None, None, layer_collection=lc,
                                        **COMMON)
    with tf.compat.v1.Session() as sess:
      with pytest.raises(ValueError, match="minimize"):
        opt.run_cov_inv_ops(sess)
    opt.minimize(loss, var_list=vs)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      opt.run_cov_inv_ops(sess)
      with pytest.raises(RuntimeError, match="twice"):
        opt.run_cov_inv_ops(sess)
      opt.stop_cov_inv_ops(sess)
      opt.stop_cov_inv_ops(sess)  # a second stop does nothing
  with tf.Graph().as_default(), tf.compat.v1.Session() as other:
    with pytest.raises(ValueError, match="another graph"):
      opt.run_cov_inv_ops(other)


def test_tf_function_is_refused():
  inits = ref.mlp_inits(SIZES, seed=11, dtype=np.float32)
  vs = [tf.Variable(v) for v in inits]
  opt = kfac.AsyncInvCovUpdateKfacOpt(None, None, **COMMON)
  x, labels = util.data(8, sizes=SIZES)

  @tf.function
  def step():
    lc = kfac.LayerCollection()
    logits = util.register_mlp(vs, tf.constant(x, tf.float32), lc)
    util.categorical_loss(lc, logits, labels)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.constant(labels), logits=logits))
    return opt.minimize(loss, var_list=vs, layer_collection=lc)

  with pytest.raises(RuntimeError, match="tf.function.*PeriodicInvCov"):
    step()
