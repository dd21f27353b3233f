"""Position embeddings (ids without a batch axis) against brute force.

Model (float64): tokens [N, T] -> token table -> [N, T, D]; positions
tf.range(T) -> position table P [T + 1, D] (one row never looked up) ->
[T, D], added to the tokens (broadcast over the batch) -> tanh -> flatten
-> dense -> softmax. The position table is registered as kfac.keras does
(position_embedding: ids tiled to [N, T], the [N, T, D] sum as outputs),
in the "exact" mode, in a TF1 Session graph and in a tf.function. The
brute-force Fisher F of P, (1/N) sum_n J_n^T F_n J_n from per-example tape
Jacobians (reference.py), gives:
* the "diagonal" block equals diag(F) (1e-9);
* the "kron" block equals KFAC-expand over the T positions: for a looked-up
  row t, (1/T) sum_s F_ss (F_ss: the D x D diagonal block of row s), zero
  for the unused row (1e-9);
while the lookup registered as an embedding of its own ([T] ids, [T, D]
outputs, the gradient summed over the batch) misses diag(F) by far (> 10%).
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.keras import position_embedding
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref

TOL = dict(rtol=1e-9, atol=1e-12)
N, T, VOCAB, D, CLASSES = 4, 3, 5, 2, 3


def _inits(seed=0):
  rng = np.random.RandomState(seed)
  return [rng.randn(T + 1, D), rng.randn(VOCAB, D),
          0.8 * rng.randn(T * D, CLASSES)]


def _data(seed=1):
  rng = np.random.RandomState(seed)
  return (rng.randint(0, VOCAB, (N, T)).astype(np.int32),
          rng.randint(0, CLASSES, N))


def _forward(vs, tokens, record=None):
  pos_table, tok_table, head = vs
  ids = tf.range(tf.shape(tokens)[1])
  pos = tf.gather(pos_table, ids)
  total = tf.gather(tok_table, tokens) + pos
  logits = tf.matmul(tf.reshape(tf.tanh(total), [-1, T * D]), head)
  if record is not None:
    record.update(ids=ids, pos=pos)
  return logits


def _exact_fisher(inits, tokens):
  def forward(vs, x):
    return _forward(vs, tf.cast(x, tf.int32))
  jacs = ref.per_example_jacobians(forward, inits, tokens)
  logits = ref.outputs(forward, inits, tokens)
  size = inits[0].size
  return ref.curvature(jacs, [ref.categorical_fisher(z)
                              for z in logits])[:size, :size]


def _run(world, approx, as_keras_does=True):
  inits = _inits()
  tokens, labels = _data()
  store = util.new_store()

  def build(vs):
    lc = kfac.LayerCollection()
    rec = {}
    logits = _forward(vs, tf.constant(tokens), rec)
    if as_keras_does:
      assert position_embedding.example_independent(rec["ids"])
      total, reason = position_embedding.broadcast_sum(rec["pos"])
      assert reason is None, reason
      lc.register_embedding(vs[0], position_embedding.tiled_ids(
          rec["ids"], total), total, approx=approx)
    else:
      lc.register_embedding(vs[0], rec["ids"], rec["pos"], approx=approx)
    lc.register_softmax_cross_entropy_loss(logits,
                                           targets=tf.constant(labels))
    est, ops = util.estimator_stages(store, lc, [vs[0]], "exact")
    return ops + [est.blocks[0].full_fisher_block()]

  return ref.run_stages(world, inits, build)[-1], _exact_fisher(inits, tokens)


@pytest.mark.parametrize("world", ref.WORLDS)
def test_diagonal_block_is_the_exact_fisher_diagonal(world):
  block, exact = _run(world, "diagonal")
  np.testing.assert_allclose(np.diag(block), np.diag(exact), **TOL)
  assert np.count_nonzero(block - np.diag(np.diag(block))) == 0
  assert np.abs(np.diag(exact)[:T * D]).min() > 1e-5   # every used row


@pytest.mark.parametrize("world", ref.WORLDS)
def test_kron_block_is_kfac_expand_over_positions(world):
  block, exact = _run(world, "kron")
  rows = [exact[s * D:(s + 1) * D, s * D:(s + 1) * D] for s in range(T)]
  used = np.diag([1.0] * T + [0.0])
  np.testing.assert_allclose(block, np.kron(used, sum(rows) / T), **TOL)


def test_lookup_registered_alone_mixes_the_examples():
  block, exact = _run("graph", "diagonal", as_keras_does=False)
  err = np.abs(np.diag(block) - np.diag(exact)).max()
  assert err > 0.1 * np.abs(np.diag(exact)).max(), err


def test_which_ids_have_no_batch_axis_and_which_sums_broadcast():
  with tf.Graph().as_default():
    tokens = tf.compat.v1.placeholder(tf.int32, [None, T])
    table = tf.Variable(np.ones((T, D)))
    ids = tf.range(tf.shape(tokens)[1])
    assert position_embedding.example_independent(ids)
    assert position_embedding.example_independent(tf.constant([0, 1, 2]))
    assert not position_embedding.example_independent(tokens)
    assert not position_embedding.example_independent(tokens[0])
    lookup = tf.gather(table, ids)
    total = tf.ones([4, T, D], tf.float64) + lookup
    assert position_embedding.broadcast_sum(lookup) == (total, None)
    # The backward pass of the sum (a dynamic batch) and ops that read only
    # the lookup's shape do not count.
    dynamic = tf.gather(table, ids)
    summed = tf.gather(table, tokens) + dynamic
    tf.gradients(summed, [table])
    tf.shape(dynamic)
    assert position_embedding.broadcast_sum(dynamic) == (summed, None)
    # Used twice, or not broadcast over a batch axis: no per-example
    # gradients.
    twice = tf.gather(table, ids)
    _ = twice + 1.0, twice * 2.0
    found, reason = position_embedding.broadcast_sum(twice)
    assert found is None and "used by AddV2, Mul, not" in reason, reason
    same = tf.gather(table, ids)
    _ = same + tf.ones([T, D], tf.float64)
    found, reason = position_embedding.broadcast_sum(same)
    assert found is None and "not broadcast over a batch axis" in reason
