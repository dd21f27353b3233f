"""Fetching the loss with the training op, as every training loop does
(session.run([train_op, loss])), runs the same computation as running the
training op alone: the same matrix products on a statistics-update step
and on a step without one (no second forward pass, no statistics
recomputed), with TF2 behaviour's control flow and with control flow v1
(graphs built after tf.compat.v1.disable_v2_behavior()).

A Session prepares every new set of fetches once (pruning, grappler, an
executor), so the first run of [train_op, loss] costs more than a step;
examples/benchmarks/autoencoder_step_time.py reports it apart. Here each
fetch set runs once untraced before it is compared.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import kfac_test_util as util

SIZES = (20, 30, 12, 30, 20)


def _executed(meta):
  """Op type -> how many nodes of that type the traced run executed."""
  counts = collections.Counter()
  for dev in meta.step_stats.dev_stats:
    for node in dev.node_stats:
      if " = " in node.timeline_label:
        counts[node.timeline_label.split(" = ")[1].split("(")[0]] += 1
  return counts


def _step_counts(fetch_loss, batch):
  """Executed op counts of steps 2 (statistics update) and 3 (none) of a
  tanh autoencoder trained by PeriodicInvCovUpdateKfacOpt
  (cov_update_every=2), and its loss after them."""
  rng = np.random.RandomState(0)
  with tf.Graph().as_default():
    tf.compat.v1.set_random_seed(0)
    x = tf.compat.v1.placeholder(tf.float32, [None, SIZES[0]])
    lc = kfac.LayerCollection()
    h = x
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
      w = tf.Variable((rng.randn(a, b) / np.sqrt(a)).astype(np.float32))
      bias = tf.Variable(np.zeros(b, np.float32))
      pre = tf.matmul(h, w) + bias
      lc.register_fully_connected((w, bias), h, pre)
      h = tf.tanh(pre) if i < len(SIZES) - 2 else pre
    lc.register_normal_predictive_distribution(h, var=1.0)
    loss = 0.5 * tf.reduce_mean(tf.reduce_sum(tf.square(h - x), 1))
    opt = kfac.PeriodicInvCovUpdateKfacOpt(
        layer_collection=lc, invert_every=4, cov_update_every=2,
        learning_rate=0.01, damping=0.1, momentum=0.9,
        momentum_type="regular")
    train = opt.minimize(
        loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    fetch = [train, loss] if fetch_loss else train
    data = rng.randn(batch, SIZES[0]).astype(np.float32)
    counts = []
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      for step in range(4):
        meta = tf.compat.v1.RunMetadata()
        options = (tf.compat.v1.RunOptions(
            trace_level=tf.compat.v1.RunOptions.FULL_TRACE) if step >= 2
                   else None)
        sess.run(fetch, {x: data}, options=options, run_metadata=meta)
        if step >= 2:
          counts.append(_executed(meta))
      return counts, sess.run(loss, {x: data})


@pytest.mark.parametrize("control_flow", ["v2", "v1"])
def test_fetching_the_loss_runs_the_same_products(control_flow):
  with util.control_flow(control_flow):
    alone, loss_alone = _step_counts(False, 4)
    fetched, loss_fetched = _step_counts(True, 4)
  for a, f in zip(alone, fetched):
    products = {k: v for k, v in a.items() if "MatMul" in k}
    assert products and products == {
        k: v for k, v in f.items() if "MatMul" in k}, (a, f)
    # The fetch itself, and grappler's constant folding may differ by a
    # node or two with the fetches.
    assert abs(sum(a.values()) - sum(f.values())) <= 4, (a, f)
  # The update step runs the statistics' products and backward pass.
  assert sum(v for k, v in alone[0].items() if "MatMul" in k) > sum(
      v for k, v in alone[1].items() if "MatMul" in k)
  np.testing.assert_allclose(loss_fetched, loss_alone, rtol=1e-6)
