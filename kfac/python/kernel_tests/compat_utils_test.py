"""Tests of the old library's helpers restored for old scripts: kfac.utils
(compat_utils/, numerics/linalg.py, layers/conv/patches.py), OpQueue, the old
set_global_constants functions, fisher_factors / fisher_blocks module
helpers, and the data readers fed per-step graph batch tensors.

Numerical helpers are checked against numpy float64 references; graph-only
helpers in a TF1 Graph + Session and in a tf.function.
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.ops.layers.base import curvature_options
from kfac.python.ops.data import data_reader
from kfac.python.ops import fisher_blocks
from kfac.python.ops import fisher_factors
from kfac.python.ops import optimizer as optimizer_lib
from kfac.python.ops import utils
from kfac.python.ops.compat_utils import legacy_constants

RNG = np.random.RandomState(0)


def tf1_run(build):
  """Builds `build()` in a fresh TF1 graph, initialises variables and
  returns (session, fetches)."""
  graph = tf.Graph()
  with graph.as_default():
    fetches = build()
    sess = tf.compat.v1.Session(graph=graph)
    sess.run(tf.compat.v1.global_variables_initializer())
  return sess, fetches


def psd(n, seed=0):
  x = np.random.RandomState(seed).randn(n, n)
  return x @ x.T


# ------------------------------------------------------------ containers
def test_sequence_dict():
  d = utils.SequenceDict({"a": 1})
  d[("b", "c")] = (2, 3)
  d["d"] = 4
  assert d["a"] == 1 and d[["b", "c", "d"]] == [2, 3, 4]
  assert sorted(d.items()) == [("a", 1), ("b", 2), ("c", 3), ("d", 4)]
  with pytest.raises(ValueError, match="2 keys but 1 values"):
    d[("x", "y")] = (1,)
  with pytest.raises(KeyError):
    d["zz"]  # pylint: disable=pointless-statement


def test_partitioned_tensor():
  a = tf.constant(np.arange(6.).reshape(3, 2))
  b = tf.constant(np.arange(6., 10.).reshape(2, 2))
  pt = utils.PartitionedTensor([a, b])
  assert pt.shape.as_list() == [5, 2] and pt.dtype == tf.float64
  np.testing.assert_array_equal(tf.convert_to_tensor(pt).numpy(),
                                np.arange(10.).reshape(5, 2))
  np.testing.assert_array_equal((tf.reduce_sum(pt)).numpy(), 45.)
  assert pt == utils.PartitionedTensor([a, b]) and pt != utils.PartitionedTensor(
      [b, a])
  assert hash(pt) == hash(utils.PartitionedTensor([a, b]))
  with pytest.raises(ValueError, match="1\\+ Tensors"):
    utils.PartitionedTensor([])
  with pytest.raises(ValueError, match="same dtype"):
    utils.PartitionedTensor([a, tf.cast(b, tf.float32)])
  with pytest.raises(ValueError, match="excluding batch"):
    utils.PartitionedTensor([a, tf.zeros([2, 3], tf.float64)])


# ------------------------------------------------------------- SubGraph
def test_subgraph_tf1():
  with tf.Graph().as_default():
    a = tf.constant([[1., 2.]])
    b = tf.constant([[3., 4.]])
    c = a + b
    d = a * b
    var = tf.compat.v1.get_variable("v", [2, 2], use_resource=True)
    va = tf.identity(var)
    z = tf.matmul(c, va) + tf.matmul(a, va) + tf.matmul(d, var)
    sub = utils.SubGraph((c,))
    assert sub.is_member(a) and sub.is_member(c) and not sub.is_member(d)
    assert sub.filter_list([b, d, c]) == [b, c]
    assert utils.SubGraph((z,)).variable_uses(var) == 3
    assert sub.variable_uses(var) == 0
    with pytest.raises(ValueError, match="variable"):
      sub.variable_uses(a)


def test_subgraph_tf_function():
  var = tf.Variable(tf.ones([2, 2]))
  found = []

  @tf.function
  def f(x):
    y = tf.matmul(x, var) + tf.matmul(tf.identity(x), var)
    found.append(utils.SubGraph((y,)).variable_uses(var))
    return y

  f(tf.ones([1, 2]))
  assert found == [2]
  with pytest.raises(ValueError, match="graph tensors"):
    utils.SubGraph((tf.constant(1.),))


# ------------------------------------------------------------ linear algebra
def test_kronecker_product():
  a, b = RNG.randn(2, 3), RNG.randn(4, 2)
  out = utils.kronecker_product(tf.constant(a), tf.constant(b))
  assert out.shape.as_list() == [8, 6]
  np.testing.assert_allclose(out.numpy(), np.kron(a, b), rtol=1e-14)
  fn = tf.function(utils.kronecker_product, input_signature=[
      tf.TensorSpec([None, None], tf.float64)] * 2)
  np.testing.assert_allclose(fn(a, b).numpy(), np.kron(a, b), rtol=1e-14)
  with pytest.raises(ValueError, match="two matrices"):
    utils.kronecker_product(tf.ones([2]), tf.ones([2, 2]))


@pytest.mark.parametrize("method", ["cholesky", "matrix_inverse", "eig"])
def test_posdef_inv(method):
  x, damp = psd(4), 0.3
  ref = np.linalg.inv(x + damp * np.eye(4))
  fn = utils.posdef_inv_functions[method]
  np.testing.assert_allclose(
      fn(tf.constant(x), tf.eye(4, dtype=tf.float64), damp).numpy(), ref,
      rtol=1e-10)
  np.testing.assert_allclose(
      utils.posdef_inv(tf.constant(x), damp, method=method).numpy(), ref,
      rtol=1e-10)
  with pytest.raises(ValueError, match="Unknown posdef_inv method"):
    utils.posdef_inv(tf.constant(x), damp, method="qr")


def test_posdef_eig_and_cholesky():
  x = psd(4, seed=1)
  for method in ("self_adjoint", "svd"):
    evals, evecs = utils.posdef_eig(tf.constant(x), method=method)
    np.testing.assert_allclose(
        (evecs.numpy() * evals.numpy()) @ evecs.numpy().T, x, atol=1e-10)
    np.testing.assert_allclose(np.sort(evals.numpy()),
                               np.linalg.eigvalsh(x), rtol=1e-10)
  np.testing.assert_allclose(
      utils.cholesky(tf.constant(x), 0.5).numpy(),
      np.linalg.cholesky(x + 0.5 * np.eye(4)), rtol=1e-10)


def test_layer_params_mat2d_round_trip():
  w, b = RNG.randn(2, 3, 4), RNG.randn(4)
  mat = utils.layer_params_to_mat2d((tf.constant(w), tf.constant(b)))
  np.testing.assert_array_equal(
      mat.numpy(), np.concatenate([w.reshape(6, 4), b[None]], 0))
  w2, b2 = utils.mat2d_to_layer_params((tf.constant(w), tf.constant(b)), mat)
  np.testing.assert_array_equal(w2.numpy(), w)
  np.testing.assert_array_equal(b2.numpy(), b)
  np.testing.assert_array_equal(
      utils.mat2d_to_layer_params(
          tf.constant(w), utils.layer_params_to_mat2d(tf.constant(w))).numpy(),
      w)
  sl = tf.IndexedSlices(tf.ones([1, 4]), tf.constant([1]))
  assert utils.layer_params_to_mat2d(sl) is sl
  with pytest.raises(TypeError, match="IndexedSlices"):
    utils.mat2d_to_layer_params(sl, tf.ones([2, 4]))


def test_sparse_matmuls():
  values, idx = RNG.randn(2, 3), np.array([4, 1])
  a = tf.IndexedSlices(tf.constant(values), tf.constant(idx),
                       tf.constant([6, 3], tf.int64))
  bmat = RNG.randn(3, 5)
  out = utils.matmul_sparse_dense(a, tf.constant(bmat))
  np.testing.assert_allclose(out.values.numpy(), values @ bmat, rtol=1e-14)
  assert list(out.dense_shape.numpy()) == [6, 5]
  diag = RNG.randn(6)
  out = utils.matmul_diag_sparse(tf.constant(diag), a)
  np.testing.assert_allclose(out.values.numpy(), diag[idx][:, None] * values,
                             rtol=1e-14)
  with pytest.raises(ValueError, match="rank-1"):
    utils.matmul_diag_sparse(tf.ones([2, 2], tf.float64), a)


def test_list_algebra():
  v1, v2 = tf.Variable(1.), tf.Variable(2.)
  p = [(tf.constant([1., 2.]), v1), (tf.constant(3.), v2)]
  q = [(tf.constant([4., 5.]), v1), (tf.constant(6.), v2)]
  assert utils.ip_p(p, q).numpy() == 1 * 4 + 2 * 5 + 3 * 6
  summed = utils.sum_p(p, q)
  np.testing.assert_array_equal(summed[0][0].numpy(), [5., 7.])
  assert summed[1][1] is v2
  assert [t.numpy() for t, _ in utils.sprod_p(2., p)][1] == 6.
  assert utils.ip(utils.sprod(2., [tf.constant(1.)]), [tf.constant(3.)]) == 6.
  with pytest.raises(ValueError, match="must match"):
    utils.sum_p(p, list(reversed(q)))
  with pytest.raises(ValueError, match="Mismatch on variable lists at "
                     "indices 0, 1"):
    utils.assert_variables_match_pairs_list(p, list(reversed(q)))


# ---------------------------------------------------------------- patches
def numpy_patches(x, k, stride, dilation, pad):
  """[N, out..., k..., C] patches of a channels-last x (explicit padding)."""
  d = x.ndim - 2
  xp = np.pad(x, [(0, 0)] + list(pad) + [(0, 0)])
  out = [(xp.shape[1 + i] - (k[i] - 1) * dilation[i] - 1) // stride[i] + 1
         for i in range(d)]
  res = np.zeros([x.shape[0]] + out + list(k) + [x.shape[-1]])
  for o in np.ndindex(*out):
    for t in np.ndindex(*k):
      pos = tuple(o[i] * stride[i] + t[i] * dilation[i] for i in range(d))
      res[(slice(None),) + o + t] = xp[(slice(None),) + pos]
  return res


@pytest.mark.parametrize("case", [
    # spatial, kernel, strides, dilations, padding, explicit padding
    ((7,), (3,), (2,), (1,), "VALID", [(0, 0)]),
    ((6, 5), (3, 2), (1, 2), (1, 1), "SAME", [(1, 1), (0, 1)]),
    ((5, 6), (2, 2), (1, 1), (2, 1), "VALID", [(0, 0), (0, 0)]),
    ((4, 5, 3), (2, 3, 1), (2, 1, 1), (1, 1, 1), "SAME",
     [(0, 1), (1, 1), (0, 0)]),
])
def test_extract_convolution_patches(case):
  spatial, k, s, dil, padding, pad = case
  x = RNG.randn(2, *spatial, 3)
  filter_shape = list(k) + [3, 4]
  got = utils.extract_convolution_patches(
      tf.constant(x), filter_shape, padding, strides=list(s),
      dilation_rate=list(dil))
  ref = numpy_patches(x, k, s, dil, pad)
  assert got.shape.as_list() == list(ref.shape)
  np.testing.assert_allclose(got.numpy(), ref, rtol=1e-14)
  # patches x reshaped filter == the convolution (float64)
  w = RNG.randn(*filter_shape)
  conv = tf.nn.convolution(tf.constant(x), tf.constant(w), padding=padding,
                           strides=list(s), dilations=list(dil))
  flat = ref.reshape(-1, np.prod(k) * 3) @ w.reshape(-1, 4)
  np.testing.assert_allclose(conv.numpy().reshape(-1, 4), flat, atol=1e-12)


def test_extract_convolution_patches_errors_and_graph():
  with pytest.raises(ValueError, match="Channel must be last"):
    utils.extract_convolution_patches(tf.ones([1, 4, 4, 3]), [2, 2, 3, 1],
                                      "VALID", data_format="NCHW")
  with pytest.raises(ValueError, match="in_channels"):
    utils.extract_convolution_patches(tf.ones([1, 4, 4, 3]), [2, 2, 2, 1],
                                      "VALID")
  x = RNG.randn(2, 5, 5, 2)
  sess, out = tf1_run(lambda: utils.extract_convolution_patches(
      tf.compat.v1.placeholder_with_default(x, [None, 5, 5, 2]),
      [3, 3, 2, 1], "SAME", strides=[1, 2, 2, 1]))
  np.testing.assert_allclose(sess.run(out),
                             numpy_patches(x, (3, 3), (2, 2), (1, 1),
                                           [(1, 1), (1, 1)]), rtol=1e-14)


def test_pointwise_patches_and_locations():
  x = RNG.randn(2, 3, 4, 5)
  p = utils.extract_pointwise_conv2d_patches(tf.constant(x), [1, 1, 5, 7])
  np.testing.assert_array_equal(p.numpy(), x.reshape(2, 3, 4, 1, 1, 5))
  with pytest.raises(ValueError, match="shape 1 along spatial"):
    utils.extract_pointwise_conv2d_patches(tf.constant(x), [2, 1, 5, 7])
  for padding in ("SAME", "VALID"):
    for shape, filt, strides in (([2, 9, 7, 3], [3, 2, 3, 4], [1, 2, 3, 1]),
                                 ([2, 10, 3], [4, 3, 2], [1, 3, 1])):
      conv = tf.nn.convolution(tf.ones(shape), tf.ones(filt), padding=padding,
                               strides=strides[1:-1])
      assert utils.num_conv_locations(shape, filt, strides, padding) == (
          np.prod(conv.shape[1:-1]))
  with pytest.raises(ValueError, match="length 4"):
    utils.num_conv_locations([1, 2], [1, 2], None, "SAME")


# --------------------------------------------------------- graph helpers
def test_fwd_gradients_tf1_and_function():
  a = RNG.randn(3, 2)
  v = RNG.randn(2)

  def build(x):
    y = tf.tanh(tf.linalg.matvec(tf.constant(a), x))
    return utils.fwd_gradients(y, x, grad_xs=tf.constant(v))[0]

  x0 = RNG.randn(2)
  ref = (1 - np.tanh(a @ x0) ** 2) * (a @ v)  # J v
  sess, out = tf1_run(lambda: build(tf.constant(x0)))
  np.testing.assert_allclose(sess.run(out), ref, rtol=1e-12)
  np.testing.assert_allclose(tf.function(build)(tf.constant(x0)).numpy(), ref,
                             rtol=1e-12)
  with pytest.raises(ValueError, match="ForwardAccumulator"):
    utils.fwd_gradients(tf.constant(1.), tf.constant(1.))


def test_batch_execute_round_robin():
  expected = [[1, 1, 0], [2, 1, 1], [2, 2, 2], [3, 3, 2], [4, 3, 3]]

  def build():
    step = tf.Variable(0)
    accs = [tf.Variable(0) for _ in range(3)]
    ops = utils.batch_execute(step, [lambda a=a: a.assign_add(1)
                                     for a in accs], 2)
    return step, accs, ops

  sess, (step, accs, ops) = tf1_run(build)
  assert len(ops) == 3
  with sess.graph.as_default():
    increment = step.assign_add(1)
  values = []
  for _ in range(5):
    sess.run(ops)
    sess.run(increment)
    values.append(sess.run(accs))
  assert values == expected

  step = tf.Variable(0)
  accs = [tf.Variable(0) for _ in range(3)]

  @tf.function
  def run_step():
    utils.batch_execute(step, [lambda a=a: a.assign_add(1) for a in accs], 2)
    step.assign_add(1)

  values = []
  for _ in range(5):
    run_step()
    values.append([int(a.numpy()) for a in accs])
  assert values == expected
  with pytest.raises(ValueError, match="positive int"):
    utils.batch_execute(step, [], 0)


def test_accumulator_variable_tf1_and_eager():
  def build():
    acc = utils.AccumulatorVariable("acc", [2], tf.float32)
    adds = [acc.accumulate(tf.constant([v, 2 * v])) for v in (1., 2., 6.)]
    return acc, adds

  sess, (acc, adds) = tf1_run(build)
  with sess.graph.as_default():
    value = acc.value
    read = acc.read_value_and_reset()
  sess.run(adds)
  np.testing.assert_allclose(sess.run(value), [3., 6.])
  np.testing.assert_allclose(sess.run(read), [3., 6.])
  sess.run(adds[0])
  np.testing.assert_allclose(sess.run(value), [1., 2.])

  acc = utils.AccumulatorVariable("acc", [], tf.float64)
  @tf.function
  def step(v):
    acc.accumulate(v)

  for v in (1., 2.):
    step(tf.constant(v, tf.float64))
  assert acc.value.numpy() == 1.5
  acc.reset()
  assert np.isnan(acc.value.numpy())


def test_moving_average_variable():
  avg = utils.MovingAverageVariable("avg", [2], tf.float64)
  raw = utils.MovingAverageVariable("raw", [2], tf.float64,
                                    normalize_value=False)
  num, total = np.zeros(2), 0.
  for value, decay in (([1., 2.], 0.5), ([3., -1.], 0.9), ([0., 4.], 0.7)):
    for m in (avg, raw):
      m.add_to_average(tf.constant(value, tf.float64), decay=decay,
                       weight=1 - decay)
    num = decay * num + (1 - decay) * np.array(value)
    total = decay * total + (1 - decay)
  np.testing.assert_allclose(avg.value.numpy(), num / total, rtol=1e-14)
  np.testing.assert_allclose(raw.value.numpy(), num, rtol=1e-14)


def test_replication_helpers_without_strategy():
  x = {"a": tf.constant(2.)}
  assert utils.all_sum(x) is x and utils.all_average(x) is x
  assert utils.get_num_replicas() == 1 and utils.get_replica_id() == 0
  assert not utils.is_replicated() and not utils.is_tpu_replicated()
  assert utils.get_tf_replicator() is None
  assert utils.map_gather([lambda: 1, lambda: 2]) == (1, 2)
  signs = utils.generate_random_signs([1000], tf.float64).numpy()
  assert set(np.unique(signs)) == {-1., 1.}
  v = tf.Variable(1.)
  utils.smart_assign(v, tf.constant(3, tf.int32), force_cast=True)
  assert v.numpy() == 3.
  assert utils.smart_cond(tf.constant(False), lambda: 1., lambda: 2.) == 2.


def test_smart_assign_in_mirrored_replica_context():
  strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
  with strategy.scope():
    v = tf.Variable(0.)

  @tf.function
  def step():
    def replica_fn():
      utils.smart_assign(v, tf.constant(5.))
      return utils.all_sum(tf.constant(1.))
    return strategy.run(replica_fn)

  assert float(step()) == 1.
  assert v.numpy() == 5.


# ------------------------------------------------------ fisher modules
def test_fisher_module_helpers():
  t = RNG.randn(5, 3)
  np.testing.assert_allclose(fisher_factors.compute_cov(tf.constant(t)).numpy(),
                             t.T @ t / 5, rtol=1e-14)
  r = RNG.randn(5, 2)
  np.testing.assert_allclose(
      fisher_factors.compute_cov(tf.constant(t), tf.constant(r), 2.).numpy(),
      t.T @ r / 2, rtol=1e-14)
  np.testing.assert_array_equal(
      fisher_factors.append_homog(tf.constant(t), 2.).numpy(),
      np.concatenate([t, 2 * np.ones([5, 1])], 1))
  assert fisher_factors.DenseSquareMatrixFactor is (
      fisher_factors.DenseSquareFactor)
  with tf.Graph().as_default():
    with fisher_factors.maybe_place_on_device("/cpu:0"):
      on_cpu = tf.constant(1.)
    with fisher_factors.maybe_place_on_device(""):
      anywhere = tf.constant(1.)
  assert "CPU:0" in on_cpu.device.upper() and anywhere.device == ""


def test_fisher_factors_scope_strings():
  with tf.Graph().as_default():
    w = tf.compat.v1.get_variable("layer/w", [2, 2])
    t = tf.constant(1., name="gradients/add_4_grad/Reshape")
    assert fisher_factors.scope_string_from_name(t) == (
        "gradients_add_4_grad_Reshape_0")
    assert fisher_factors.scope_string_from_name((w, t)) == (
        "layer_w_0__gradients_add_4_grad_Reshape_0")
    assert fisher_factors.scope_string_from_params(
        [w, None, (1, 2, 3), "SAME", 3, True]) == (
            "layer_w_0_None_1-2-3_SAME_3_True")
    assert fisher_factors.scalar_or_tensor_to_string(0.5) == "0.5"
    assert fisher_factors.scalar_or_tensor_to_string(np.int64(3)) == repr(
        np.int64(3))
    assert fisher_factors.list_to_string(["a", 2, t]) == (
        "a_2_gradients_add_4_grad_Reshape_0")
    with pytest.raises(ValueError, match="unsupported parameter.*dict"):
      fisher_factors.scope_string_from_params({"a": 1})


def test_optimizer_module_helpers():
  a = [tf.constant([1., 2.]), tf.constant(3.)]
  b = [tf.constant([4., 5.]), tf.constant(6.)]
  assert float(optimizer_lib.ip(a, b)) == 1 * 4 + 2 * 5 + 3 * 6
  pairs_a = list(zip(a, ["x", "y"]))
  pairs_b = list(zip(b, ["x", "y"]))
  assert float(optimizer_lib.ip_p(pairs_a, pairs_b)) == 32.
  assert [float(tf.reduce_sum(x)) for x in optimizer_lib.sprod(2., a)] == [
      6., 6.]
  assert [v for _, v in optimizer_lib.sprod_p(2., pairs_a)] == ["x", "y"]
  optimizer_lib.set_global_constants(include_damping_in_qmodel_change=False)
  optimizer_lib.set_global_constants()
  assert legacy_constants.optimizer_defaults() == {
      "include_damping_in_qmodel_change": False}
  with pytest.raises(TypeError, match="unexpected keyword"):
    optimizer_lib.set_global_constants(other=1)

  a, g = psd(3), psd(2, seed=3)
  pi_ref = np.sqrt((np.trace(a) / 3) / (np.trace(g) / 2))
  pi = fisher_blocks.compute_pi_tracenorm(
      tf.linalg.LinearOperatorFullMatrix(a), tf.constant(g))
  np.testing.assert_allclose(pi.numpy(), pi_ref, rtol=1e-12)
  assert fisher_blocks.compute_pi_tracenorm(
      tf.zeros([2, 2], tf.float64), tf.constant(g)).numpy() == 1.
  left, right = fisher_blocks.compute_pi_adjusted_damping(
      tf.constant(a), tf.constant(g), 0.1)
  np.testing.assert_allclose([left.numpy(), right.numpy()],
                             [0.1 * pi_ref, 0.1 / pi_ref], rtol=1e-12)
  assert fisher_blocks.normalize_damping(1.0, 4) == 0.25
  f = fisher_blocks.PackagedFunc(lambda: 3, ["x", lambda: 7])
  assert f() == 3 and f.func_id == ("x", 7)
  assert fisher_blocks.maybe_tuple([1, 2]) == (1, 2)


def test_depthwise_filter_conversion():
  filt = RNG.randn(2, 2, 3, 2)
  x = RNG.randn(1, 4, 4, 3)
  dense = fisher_blocks.depthwise_conv2d_filter_to_conv2d_filter(
      tf.constant(filt))
  assert dense.shape.as_list() == [2, 2, 3, 6]
  np.testing.assert_allclose(
      tf.nn.conv2d(x, dense, 1, "VALID").numpy(),
      tf.nn.depthwise_conv2d(x, filt, [1, 1, 1, 1], "VALID").numpy(),
      atol=1e-12)
  np.testing.assert_array_equal(
      fisher_blocks.conv2d_filter_to_depthwise_conv2d_filter(dense).numpy(),
      filt)
  with pytest.raises(ValueError, match="multiple of input channels"):
    fisher_blocks.conv2d_filter_to_depthwise_conv2d_filter(
        tf.ones([1, 1, 3, 4]))


def test_set_global_constants():
  try:
    _check_set_global_constants()
  finally:
    legacy_constants.restore_defaults()


def _check_set_global_constants():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    # The old defaults (our behaviour) and placement-only values: silent.
    fisher_factors.set_global_constants(
        zero_debias=True, eigenvalue_clipping_threshold=0.0,
        tower_strategy="concat", sub_sample_inputs=False)
    fisher_blocks.set_global_constants(normalize_damping_power=1,
                                       pi_type="tracenorm")
    utils.set_global_constants(posdef_inv_method="cholesky")
    assert legacy_constants.curvature_defaults() == (
        curvature_options.CurvatureOptions())
    # Settings of the curvature model: the defaults of new collections
    # (curvature_options_test.py checks their math).
    fisher_factors.set_global_constants(
        eigenvalue_clipping_threshold=0.1, sub_sample_inputs=True,
        inputs_to_extract_patches_factor=0.1,
        eigenvalue_decomposition_threshold=10000)
    fisher_blocks.set_global_constants(pi_type="off",
                                       normalize_damping_power=0.5)
    optimizer_lib.set_global_constants(include_damping_in_qmodel_change=True)
  assert kfac.LayerCollection().curvature_options == (
      curvature_options.CurvatureOptions(
          pi_type="off", normalize_damping_power=0.5,
          eigenvalue_clipping_threshold=0.1,
          eigenvalue_decomposition_threshold=10000, sub_sample_inputs=True,
          inputs_to_extract_patches_factor=0.1))
  assert legacy_constants.optimizer_defaults() == {
      "include_damping_in_qmodel_change": True}
  # The old module-level helpers read the settings when called (0.2.x).
  assert fisher_blocks.normalize_damping(1.0, 4) == 0.5  # 1 / 4**0.5
  assert fisher_blocks.compute_pi_adjusted_damping(
      tf.eye(2), 3.0 * tf.eye(2), 0.1) == (0.1, 0.1)
  legacy_constants.restore_defaults()
  assert kfac.LayerCollection().curvature_options == (
      curvature_options.CurvatureOptions())
  for call in (lambda: fisher_factors.set_global_constants(zero_debias=False),
               lambda: fisher_factors.set_global_constants(
                   sub_sample_patches=True),
               lambda: utils.set_global_constants(posdef_inv_method="eig")):
    with pytest.warns(legacy_constants.LegacyConstantWarning,
                      match="is ignored"):
      call()
  with pytest.raises(ValueError, match="assume_zero_mean_activations"):
    fisher_factors.set_global_constants(assume_zero_mean_activations=True)
  with pytest.raises(ValueError, match="TF-Replicator"):
    utils.set_global_constants(tf_replicator=object())
  with pytest.raises(ValueError, match="zero_debias must be a bool"):
    fisher_factors.set_global_constants(zero_debias=0)
  with pytest.raises(ValueError, match="tower_strategy must be one of"):
    fisher_factors.set_global_constants(tower_strategy="mirror")
  with pytest.raises(ValueError, match="pi_type must be one of"):
    fisher_blocks.set_global_constants(pi_type="trace")
  with pytest.raises(ValueError, match="include_damping_in_qmodel_change "
                     "must be a bool"):
    optimizer_lib.set_global_constants(include_damping_in_qmodel_change=1)
  with pytest.raises(TypeError):
    fisher_factors.set_global_constants(posdef_inv_method="cholesky")  # pylint: disable=unexpected-keyword-arg
  # Nothing steers the math while ops are built: the module constants keep
  # their values, and a rejected call changes no default.
  assert fisher_factors.ZERO_DEBIAS is True
  assert utils.POSDEF_INV_METHOD == "cholesky"
  assert legacy_constants.curvature_defaults() == (
      curvature_options.CurvatureOptions())


# ----------------------------------------------------------------- OpQueue
def test_op_queue():
  from kfac.python.ops import op_queue  # the old import path
  from kfac.python.ops.kfac_utils import op_queue as new_op_queue
  assert op_queue.OpQueue is new_op_queue.OpQueue
  with tf.Graph().as_default():
    ops = [tf.no_op(name="op%d" % i) for i in range(4)]
    queue = op_queue.OpQueue(ops, seed=3)
    with tf.compat.v1.Session() as sess:
      rounds = [[queue.next_op(sess) for _ in ops] for _ in range(3)]
    same = op_queue.OpQueue(list(reversed(ops)), seed=3)
    assert [same.next_op() for _ in range(12)] == sum(rounds, [])
  for r in rounds:
    assert sorted(op.name for op in r) == sorted(op.name for op in ops)
  assert len(set(tuple(op.name for op in r) for r in rounds)) > 1
  assert set(queue.ops) == set(ops)
  with pytest.raises(ValueError, match="at least one op"):
    op_queue.OpQueue([])


def test_old_import_paths():
  # pylint: disable=g-import-not-at-top
  from kfac.python.ops.data import data_reader_alt
  from kfac.python.ops.optimizers import kfac_optimizer
  from kfac.python.ops.kfac_utils import data_reader as old_reader
  from kfac.python.ops.kfac_utils import data_reader_alt as old_alt
  from kfac.python.ops.kfac_utils import periodic_inv_cov_update_kfac_opt
  assert old_reader.CachedDataReader is data_reader.CachedDataReader
  assert old_reader.VariableBatchReader is data_reader.VariableBatchReader
  assert old_alt.CachedDataReader is data_reader_alt.CachedDataReader
  assert (periodic_inv_cov_update_kfac_opt.PeriodicInvCovUpdateKfacOpt is
          kfac_optimizer.PeriodicInvCovUpdateKfacOpt)


# ------------------------------------------- readers of per-step batches
BATCH = 6  # rows per step of the pipeline; reader max_batch_size 4


def batches(num):
  """Step s of the pipeline yields rows [10 s, 10 s + BATCH)."""
  x = np.stack([10 * s + np.arange(BATCH) for s in range(num)]).astype(
      np.float32)[..., None] * np.ones([1, 1, 2], np.float32)
  return tf.data.Dataset.from_tensor_slices((x, x[..., 0].astype(np.int64)))


def expected_rows(step, size):
  return 10 * step + np.arange(size)


SIZES = [2, 4, 1, 3]


def test_cached_reader_graph_tensors_tf1():
  graph = tf.Graph()
  with graph.as_default():
    x, y = tf.compat.v1.data.make_one_shot_iterator(batches(4)).get_next()
    x = tf.compat.v1.placeholder_with_default(x, [None, 2])  # dynamic rows
    reader = data_reader.CachedDataReader((x, y), 4)
    size = tf.compat.v1.placeholder(tf.int32, [])
    before = reader.cached_batch  # read before the call: previous step
    bx, by = reader(size)
    sess = tf.compat.v1.Session(graph=graph)
    sess.run(tf.compat.v1.global_variables_initializer())
  prev = np.zeros([0])
  for step, n in enumerate(SIZES):
    (cx, cy), gx, gy = sess.run([before, bx, by], {size: n})
    np.testing.assert_array_equal(gy, expected_rows(step, n))
    np.testing.assert_array_equal(gx[:, 1], expected_rows(step, n))
    np.testing.assert_array_equal(cy, prev)
    assert cx.shape == (len(prev), 2)
    prev = gy
  # In a later run the cache holds the last batch (no feeds needed).
  with graph.as_default():
    later = reader.cached_batch
  np.testing.assert_array_equal(sess.run(later)[1], prev)


def test_reader_graph_tensors_in_tf_function_in_tf1_graph():
  graph = tf.Graph()
  with graph.as_default():
    x, y = tf.compat.v1.data.make_one_shot_iterator(batches(3)).get_next()
    reader = data_reader.CachedDataReader((x, y), 4)

    @tf.function
    def step(n):
      cached = reader.cached_batch
      return reader(n)[1], cached[1]

    size = tf.compat.v1.placeholder(tf.int32, [])
    out = step(size)
    sess = tf.compat.v1.Session(graph=graph)
    sess.run(tf.compat.v1.global_variables_initializer())
  prev = np.zeros([0])
  for s, n in enumerate([3, 4, 2]):
    got, cached = sess.run(out, {size: n})
    np.testing.assert_array_equal(got, expected_rows(s, n))
    np.testing.assert_array_equal(cached, prev)
    prev = got


def test_reader_graph_tensors_tf2_function_is_refused_clearly():
  """Per-step batch tensors are the TF1 contract; a TF2 tf.function that
  makes the reader in its first trace gets a clear error when tf.function
  retraces (it does after variables were created)."""
  iterator = iter(batches(4))
  holder = []

  @tf.function
  def step(n):
    x, y = next(iterator)
    if not holder:
      holder.append(data_reader.CachedDataReader((x, y), 4))
    return holder[0](n)[1]

  with pytest.raises(ValueError, match="belongs to that trace"):
    step(tf.constant(2))


def test_reader_graph_tensor_errors():
  with tf.Graph().as_default():
    x = tf.random.uniform([3, 2])
    with pytest.raises(ValueError, match="fewer than max_batch_size"):
      data_reader.VariableBatchReader((x,), 4)
    with pytest.raises(ValueError, match="mixes symbolic tensors"):
      data_reader.VariableBatchReader((x, np.zeros([3])), 2)
    with pytest.raises(ValueError, match="static non-batch"):
      data_reader.CachedDataReader(
          (tf.compat.v1.placeholder(tf.float32, [5, None]),), 2)
    reader = data_reader.VariableBatchReader(
        (tf.compat.v1.placeholder_with_default(
            tf.zeros([3, 2]), [None, 2]),), 4)
    rows = reader(tf.constant(4) + 0)[0]
    with tf.compat.v1.Session() as sess:
      with pytest.raises(tf.errors.InvalidArgumentError, match="fewer rows"):
        sess.run(rows)
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match="cannot see its dataset"):
      reader(2)


# ----------------------------------------------------------- loss functions
def test_distribution_negative_log_prob_loss():
  # pylint: disable=g-import-not-at-top
  from kfac.python.ops import losses as lf

  class UnitNormal(object):

    def __init__(self, mean):
      self.mean = mean

    def log_prob(self, x):
      return -0.5 * tf.square(x - self.mean) - 0.5 * np.log(2 * np.pi)

    def sample(self, seed=None):
      del seed
      return self.mean + 1.0

  class MyLoss(lf.DistributionNegativeLogProbLoss):

    def __init__(self, mean, targets):
      super().__init__()
      self._mean, self._targets = mean, targets

    @property
    def dist(self):
      return UnitNormal(self._mean)

    @property
    def inputs(self):
      return (self._mean,)

    @property
    def targets(self):
      return self._targets

    def _multiply_fisher(self, vector):
      return vector

    def _multiply_fisher_factor(self, vector):
      return vector

    def _multiply_fisher_factor_transpose(self, vector):
      return vector

    def _fisher_factor_one_hot(self, index):
      raise NotImplementedError

  mean, targets = np.array([1., 2.]), np.array([0., 0.5])
  loss = MyLoss(tf.constant(mean), tf.constant(targets))
  ref = np.sum(0.5 * (targets - mean) ** 2 + 0.5 * np.log(2 * np.pi))
  np.testing.assert_allclose(loss.evaluate().numpy(), ref, rtol=1e-14)
  np.testing.assert_array_equal(loss.sample().numpy(), mean + 1)
  assert isinstance(lf.CategoricalLogitsNegativeLogProbLoss(tf.zeros([1, 2])),
                    lf.DistributionNegativeLogProbLoss)
  with pytest.raises(TypeError, match="abstract"):
    lf.DistributionNegativeLogProbLoss()  # pylint: disable=abstract-class-instantiated


def test_alt_reader_graph_tensor_dataset_tf1_and_function():
  # pylint: disable=g-import-not-at-top
  from kfac.python.ops.data import data_reader_alt
  from kfac.python.ops.kfac_utils import data_reader_alt as old_alt
  assert old_alt.CachedDataReader is data_reader_alt.CachedDataReader
  n = 7
  x = np.arange(n, dtype=np.float64)[:, None] * np.array([[1., -1.]])
  graph = tf.Graph()
  with graph.as_default():
    # A graph tensor without a constant value, the same at every step.
    data = tf.compat.v1.placeholder_with_default(x, [n, 2])
    labels = tf.compat.v1.placeholder_with_default(np.arange(n), [n])
    reader = data_reader_alt.CachedDataReader((data, labels), n, seed=1)
    size = tf.compat.v1.placeholder(tf.int32, [])
    before = reader.cached_batch[1]
    bx, by = reader(size)

    @tf.function
    def in_function(k):
      return reader(k)[1]

    fn_out = in_function(size)
    sess = tf.compat.v1.Session(graph=graph)
    sess.run(tf.compat.v1.global_variables_initializer())
  drawn, prev = [], np.zeros([0])
  for k in (3, 4):  # exactly one epoch
    cached, gx, gy = sess.run([before, bx, by], {size: k})
    np.testing.assert_array_equal(gx, x[gy])
    np.testing.assert_array_equal(cached, prev)
    drawn += list(gy)
    prev = gy
  assert sorted(drawn) == list(range(n))
  drawn = list(sess.run(fn_out, {size: 4})) + list(sess.run(fn_out, {size: 3}))
  assert sorted(drawn) == list(range(n))
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match="cannot see its dataset"):
      reader(2)
    with pytest.raises(ValueError, match="static leading"):
      data_reader_alt.VariableBatchReader(
          (tf.compat.v1.placeholder(tf.float32, [None, 2]),), 3)


def test_old_argument_names():
  # pylint: disable=g-import-not-at-top
  from kfac.python.ops.data import data_reader_alt
  from kfac.python.ops import losses as lf
  x = np.arange(5.)[:, None]
  reader = data_reader_alt.CachedDataReader((x,), num_examples=5, seed=0)
  assert reader.max_batch_size == 5
  assert sorted(reader(5)[0].numpy()[:, 0]) == list(range(5))
  with pytest.raises(TypeError, match="once"):
    data_reader_alt.VariableBatchReader((x,), 5, num_examples=5)

  mean, var = np.array([[1., 2.]]), np.array([[0.5, 2.]])
  loss = lf.NormalMeanVarianceNegativeLogProbLoss(tf.constant(mean),
                                                  tf.constant(var))
  vecs = (tf.constant([[1., 1.]], tf.float64), tf.constant([[1., 1.]],
                                                            tf.float64))
  by_old_name = loss.multiply_fisher(vecs=vecs)
  # Fisher of N(mean, var) w.r.t. (mean, var): diag(1/var, 1/(2 var^2)).
  np.testing.assert_allclose(by_old_name[0].numpy(), 1 / var, rtol=1e-14)
  np.testing.assert_allclose(by_old_name[1].numpy(), 1 / (2 * var ** 2),
                             rtol=1e-14)
  np.testing.assert_allclose(loss.multiply_fisher(vector=vecs)[1].numpy(),
                             by_old_name[1].numpy())
  with pytest.raises(TypeError, match="once"):
    loss.multiply_fisher()

  class ValueOnly(lf.LossFunction):

    @property
    def inputs(self):
      return (tf.ones([2, 3]),)

    def evaluate(self):
      return tf.constant(0.)

  loss = ValueOnly()
  assert loss.ggn_factor_inner_static_shape.as_list() == [2, 3]
  with pytest.raises(NotImplementedError, match="ValueOnly does not "
                     "implement GGN"):
    loss.multiply_ggn(tf.ones([2, 3]))
