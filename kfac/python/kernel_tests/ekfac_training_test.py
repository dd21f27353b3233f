"""EKFAC in the optimizers: TF1 Session and tf.function take the same
steps, the periodic optimizer refreshes the scalings every
cov_update_every and the basis every invert_every step, Keras `Kfac` with
fisher_approx="ekfac" takes the TF1 graph's steps, and EKFAC trains in the
sampled mode."""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import keras_optimizer_test as keras_case
from kfac.python.kernel_tests import optimizer_test as opt_case
from kfac.python.kernel_tests import reference as ref


def _ekfac_mlp(vs, lc, inputs):
  x, labels = inputs
  record = []
  logits = ref.mlp_forward(vs, tf.cast(x, vs[0].dtype), record=record)
  for params, layer_in, layer_out in record:
    lc.register_fully_connected(params, layer_in, layer_out, approx="ekfac")
  lc.register_softmax_cross_entropy_loss(logits, targets=labels)
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))


def _batches(count, seed=91, n=16):
  rng = np.random.RandomState(seed)
  return [(rng.randn(n, 5).astype(np.float32),
           rng.randint(0, 3, n).astype(np.int32)) for _ in range(count)]


def _periodic(mode, **kwargs):
  options = dict(invert_every=2, learning_rate=0.05, damping=0.01,
                 momentum=0.9, estimation_mode=mode, cov_ema_decay=0.9)
  options.update(kwargs)
  return lambda lc: kfac.PeriodicInvCovUpdateKfacOpt(layer_collection=lc,
                                                     **options)


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("mode", ["exact", "empirical"])
def test_tf1_session_and_tf2_function_train_identically(mode):
  inits = ref.mlp_inits((5, 8, 6, 3), seed=90, dtype=np.float32)
  batches = _batches(6)
  graph = opt_case._train_with_pairs("graph", inits, _ekfac_mlp,  # pylint: disable=protected-access
                                     _periodic(mode), batches)
  fn = opt_case._train_with_pairs("function", inits, _ekfac_mlp,  # pylint: disable=protected-access
                                  _periodic(mode), batches)
  losses = [h[0] for h in graph]
  assert losses[-1] < losses[0]
  np.testing.assert_allclose([h[0] for h in fn], losses, rtol=2e-5,
                             atol=1e-6)
  for (_, gv), (_, fv) in zip(graph, fn):
    for a, b in zip(gv, fv):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_periodic_optimizer_refreshes_scalings_and_basis_on_schedule():
  """cov_update_every=2, invert_every=4: the scalings' weight grows on
  steps 0, 2, 4 .. (from the first step after a basis exists) and the
  basis count on steps 0, 4, 8."""
  inits = ref.mlp_inits((5, 8, 6, 3), seed=92, dtype=np.float32)
  batches = _batches(9, seed=93)
  with tf.Graph().as_default():
    vs = [tf.Variable(v) for v in inits]
    x = tf.compat.v1.placeholder(tf.float32, [None, 5])
    y = tf.compat.v1.placeholder(tf.int32, [None])
    lc = kfac.LayerCollection()
    loss = _ekfac_mlp(vs, lc, (x, y))
    opt = _periodic("empirical", cov_update_every=2, invert_every=4)(lc)
    train = opt.minimize(loss, var_list=vs)
    block = opt.estimator.blocks[0]
    corr = block.correction_factor
    weight = corr._cov_weight  # pylint: disable=protected-access
    count = block._input_factor._vars[("eigh", "count", None)]  # pylint: disable=protected-access
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      seen = []
      for bx, by in batches:
        sess.run(train, {x: bx, y: by})
        seen.append(tuple(sess.run([weight, count])))
  weights, counts = zip(*seen)
  assert counts == (1, 1, 1, 1, 2, 2, 2, 2, 3)
  # Step 0: no basis before its statistics update, so no scalings; steps
  # 2, 4, 6, 8 fold in scalings (weight 0.1, then 0.9 w + 0.1).
  changed = [i for i in range(1, 9) if weights[i] != weights[i - 1]]
  assert weights[0] == 0 and weights[1] == 0
  assert changed == [2, 4, 6, 8], weights


@pytest.mark.slow  # end to end: 12 sampled-mode steps train
def test_sampled_mode_trains_in_tf_function():
  inits = ref.mlp_inits((5, 8, 6, 3), seed=94, dtype=np.float32)
  batches = _batches(1, seed=95, n=64) * 12
  hist = opt_case._train_with_pairs("function", inits, _ekfac_mlp,  # pylint: disable=protected-access
                                    _periodic("gradients", invert_every=3),
                                    batches)
  losses = [h[0] for h in hist]
  assert np.all(np.isfinite(losses))
  assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("mode", ["exact", "gradients"])
def test_keras_fit_equals_tf1_graph_steps(mode):
  model, _ = keras_case._compile(  # pylint: disable=protected-access
      keras_case.sequential_model(), estimation_mode=mode,
      fisher_approx={keras_case.keras.layers.Dense: "ekfac"})
  keras_case._fit(model, 0, 3)  # pylint: disable=protected-access
  expected = keras_case._tf1_reference(3, mode, approx="ekfac")  # pylint: disable=protected-access
  # float32 eigendecompositions: Keras and the TF1 graph agree to about
  # 1.4e-6 absolute after three steps (measured on an AVX2 machine; the
  # default atol 1e-6 held on others).
  keras_case._assert_weights(model.get_weights(), expected, atol=3e-6)  # pylint: disable=protected-access
  kron = keras_case._tf1_reference(3, mode)  # pylint: disable=protected-access
  # EKFAC's steps differ from K-FAC's by more than the tolerance.
  assert max(np.max(np.abs(a - b)) for a, b in zip(expected, kron)) > 1e-3


def test_lazy_statistics_sync_refuses_ekfac_blocks_by_name():
  inits = ref.mlp_inits((5, 8, 6, 3), seed=96, dtype=np.float32)
  with tf.Graph().as_default():
    vs = [tf.Variable(v) for v in inits]
    x, y = _batches(1)[0]
    lc = kfac.LayerCollection()
    _ekfac_mlp(vs, lc, (tf.constant(x), tf.constant(y)))
    est = kfac.estimator.FisherEstimator(
        variables=vs, cov_ema_decay=0.9, damping=0.01, layer_collection=lc,
        lazy_statistics_sync=True)
    est._lazy = lambda: True  # what several replicas would make it  # pylint: disable=protected-access
    with pytest.raises(ValueError, match=r"lazy_statistics_sync=True does "
                       r"not support EKFAC blocks .*S"):
      est.make_vars_and_create_op_thunks()
