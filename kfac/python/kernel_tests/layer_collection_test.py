"""LayerCollection registration rules, loss bookkeeping, and the argument
checks of FisherEstimator and KfacOptimizer (TF1 graphs unless stated).

Errors are checked by message: each must name the offending variable, loss
or value.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.ops import fisher_blocks as fb
from kfac.python.ops import fisher_factors as ff
from kfac.python.ops.collection import default as lc_default
from kfac.python.ops import losses as lf

N, D_IN, D_OUT = 4, 3, 2
TOL = dict(rtol=1e-10, atol=1e-12)
FC_APPROXES = ("diagonal", "kron", "kron_both_diag", "kron_in_diag",
               "kron_out_diag")


def _rand(seed, *shape):
  return np.random.RandomState(seed).randn(*shape)


def _var(name, *shape, seed=0):
  return tf.Variable(_rand(seed, *shape), name=name)


def _layer(prefix, bias=True, seed=0):
  """(params, inputs, outputs) of a dense layer with float64 variables."""
  w = _var(prefix + "_w", D_IN, D_OUT, seed=seed)
  x = tf.constant(_rand(seed + 100, N, D_IN))
  y = tf.matmul(x, w)
  if bias:
    b = _var(prefix + "_b", D_OUT, seed=seed + 1)
    return (w, b), x, y + b
  return w, x, y


def _m(name):
  return re.escape(name)


@pytest.fixture
def graph():
  with tf.Graph().as_default() as g:
    yield g


@pytest.fixture(autouse=True)
def _no_default_collection():
  lc_default.set_default_layer_collection(None)
  yield
  lc_default.set_default_layer_collection(None)


# ------------------------------------------------------- layer registration
def test_registering_twice_needs_reuse(graph):
  lc = kfac.LayerCollection()
  params, x, y = _layer("dup")
  block = lc.register_fully_connected(params, x, y)
  assert block.num_registered_towers == 1
  with pytest.raises(ValueError, match=r"FisherBlock for dup_w, dup_b is "
                     r"already in LayerCollection"):
    lc.register_fully_connected(params, x, y)
  with pytest.raises(ValueError, match=_m("dup_w")):
    lc.register_fully_connected(params, x, y, reuse=False)
  again = lc.register_fully_connected(params, x, y, reuse=True)
  assert again is block
  assert block.num_registered_towers == 2
  assert len(lc.get_blocks()) == 1
  assert lc.registered_variables == params


def test_reuse_follows_the_variable_scope(graph):
  lc = kfac.LayerCollection()
  w, x, y = _layer("scoped", bias=False)
  block = lc.register_fully_connected(w, x, y)
  with tf.compat.v1.variable_scope("tower1", reuse=True):
    assert lc.register_fully_connected(w, x, y) is block
  assert block.num_registered_towers == 2
  with tf.compat.v1.variable_scope("tower2", reuse=tf.compat.v1.AUTO_REUSE):
    lc.register_fully_connected(w, x, y)
  assert block.num_registered_towers == 3
  with tf.compat.v1.variable_scope("tower3"):
    with pytest.raises(ValueError, match=_m("scoped_w")):
      lc.register_fully_connected(w, x, y)
  # An explicit reuse=False wins over a reusing scope.
  with tf.compat.v1.variable_scope("tower4", reuse=True):
    with pytest.raises(ValueError, match=_m("scoped_w")):
      lc.register_fully_connected(w, x, y, reuse=False)
  assert block.num_registered_towers == 3


def test_reuse_with_another_approximation_is_an_error(graph):
  lc = kfac.LayerCollection()
  params, x, y = _layer("mixed")
  lc.register_fully_connected(params, x, y, approx="kron")
  with pytest.raises(ValueError,
                     match=r"mixed_w, mixed_b.*FullyConnectedKFACBasicFB.*"
                     r"FullyConnectedDiagonalFB"):
    lc.register_fully_connected(params, x, y, approx="diagonal", reuse=True)
  assert lc.get_blocks()[0].num_registered_towers == 1
  g, _, _ = _layer("gen", bias=False, seed=3)
  lc.register_generic(g, N, approx="full")
  with pytest.raises(ValueError, match=_m("gen_w")):
    lc.register_generic(g, N, approx="diagonal", reuse=True)


def test_overlapping_parameter_tuples_are_an_error(graph):
  lc = kfac.LayerCollection()
  (w, b), x, y = _layer("shared")
  c = _var("other_bias", D_OUT, seed=7)
  lc.register_fully_connected((w, b), x, y)
  with pytest.raises(ValueError,
                     match=r"Variable shared_w was already registered in the "
                     r"layer \(shared_w, shared_b\)"):
    lc.register_fully_connected((w, c), x, y + c)
  with pytest.raises(ValueError, match=_m("shared_w")):
    lc.register_fully_connected(w, x, tf.matmul(x, w))
  with pytest.raises(ValueError, match=_m("shared_b")):
    lc.register_generic(b, N)
  # Nothing was half-registered: c is still free.
  assert lc.registered_variables == (w, b)
  lc.register_generic(c, N)
  assert len(lc.get_blocks()) == 2


def test_wrong_shapes_name_the_variable(graph):
  lc = kfac.LayerCollection()
  x = tf.constant(_rand(1, N, D_IN))
  w1 = _var("rank_one", D_IN)
  with pytest.raises(ValueError, match=r"rank_one must have rank 2"):
    lc.register_fully_connected(w1, x, tf.constant(_rand(2, N, D_OUT)))
  w = _var("good_w", D_IN, D_OUT)
  y = tf.matmul(x, w)
  bad_b = _var("bad_bias", D_OUT + 1)
  with pytest.raises(ValueError, match=r"Bias bad_bias must have shape \[2\]"):
    lc.register_fully_connected((w, bad_b), x, y)
  x_bad = tf.constant(_rand(3, N, D_IN + 2))
  with pytest.raises(ValueError,
                     match=r"Inputs of the layer with weight good_w must have "
                     r"shape \[batch, 3\]"):
    lc.register_fully_connected(w, x_bad, y)
  with pytest.raises(ValueError,
                     match=r"Outputs of the layer with weight good_w must "
                     r"have shape \(%d, 2\)" % N):
    lc.register_fully_connected(w, x, tf.constant(_rand(4, N, D_OUT + 1)))
  with pytest.raises(ValueError, match=r"matching inputs"):
    lc.register_fully_connected(w, x, tf.constant(_rand(4, N + 1, D_OUT)))
  b3 = _var("b3", D_OUT)
  with pytest.raises(ValueError, match=r"W or \(W, b\), got 3 variables"):
    lc.register_fully_connected((w, b3, b3), x, y)
  assert not lc.get_blocks()


def test_unknown_approximation_lists_the_valid_ones(graph):
  lc = kfac.LayerCollection()
  params, x, y = _layer("approx")
  with pytest.raises(ValueError, match=r"'kronn'.*approx_w") as info:
    lc.register_fully_connected(params, x, y, approx="kronn")
  for name in FC_APPROXES:
    assert "'%s'" % name in str(info.value)
  with pytest.raises(ValueError, match=r"'kron'.*\['diagonal', 'full'\]"):
    lc.register_generic(params, N, approx="kron")
  assert not lc.get_blocks()


def test_params_must_be_variables_or_tensors(graph):
  lc = kfac.LayerCollection()
  x = tf.constant(_rand(1, N, D_IN))
  w = _rand(2, D_IN, D_OUT)  # a numpy array: neither
  with pytest.raises(TypeError, match="must be tf.Variables"):
    lc.register_generic(w, N)
  with pytest.raises(TypeError, match="must be tf.Variables"):
    lc.register_generic((_var("real", 2), w), N)
  assert not lc.get_blocks()
  # Tensors are parameters too (kfac 0.2.x): e.g. for FisherEstimator
  # products with respect to computed weights.
  w = tf.constant(w)
  block = lc.register_fully_connected(w, x, tf.matmul(x, w))
  assert lc.fisher_blocks[w] is block


# ------------------------------------------------------ check_registration
def test_check_registration(graph):
  lc = kfac.LayerCollection()
  (w, b), x, y = _layer("reg")
  lc.register_fully_connected((w, b), x, y)
  stray = _var("stray_var", 2)
  with pytest.raises(ValueError, match=r"not registered.*: stray_var \("):
    lc.check_registration([w, b, stray])
  with pytest.raises(ValueError,
                     match=r"registered but not in the list.*: reg_b\."):
    lc.check_registration([w])
  with pytest.raises(ValueError, match=r"stray_var.*; registered but not in "
                     r"the list of variables to optimize: reg_w"):
    lc.check_registration([b, stray])
  lc.check_registration([b, w])
  lc.check_registration((w, b))


# ------------------------------------------------------- loss registration
def test_loss_names_and_towers(graph):
  lc = kfac.LayerCollection()
  logits = tf.constant(_rand(1, N, 3))
  labels = tf.constant([0, 2, 1, 1])
  first = lc.register_softmax_cross_entropy_loss(logits, targets=labels,
                                                 name="xent")
  with pytest.raises(ValueError, match=r"'xent' is already registered"):
    lc.register_softmax_cross_entropy_loss(logits, targets=labels, name="xent")
  second = lc.register_softmax_cross_entropy_loss(logits, targets=labels,
                                                  name="xent", reuse=True)
  with tf.compat.v1.variable_scope("replica", reuse=True):
    third = lc.register_softmax_cross_entropy_loss(logits, targets=labels,
                                                   name="xent")
  assert lc.loss_names == ["xent"]
  assert lc.towers_by_loss == [(first, second, third)]
  assert len({id(first), id(second), id(third)}) == 3
  # Unnamed losses never collide.
  a = lc.register_squared_error_loss(tf.constant(_rand(2, N, 2)))
  b = lc.register_squared_error_loss(tf.constant(_rand(3, N, 2)))
  c = lc.register_sigmoid_cross_entropy_loss(tf.constant(_rand(4, N, 2)))
  names = lc.loss_names
  assert len(names) == 4 and len(set(names)) == 4
  assert lc.towers_by_loss[1:] == [(a,), (b,), (c,)]
  assert lc.losses == [first, second, third, a, b, c]


def test_negative_coeff_is_an_error(graph):
  lc = kfac.LayerCollection()
  logits = tf.constant(_rand(1, N, 3))
  with pytest.raises(ValueError, match=r"non-negative, got -0.5"):
    lc.register_softmax_cross_entropy_loss(logits, coeff=-0.5)
  with pytest.raises(ValueError, match=r"non-negative, got -1"):
    lc.register_squared_error_loss(logits, coeff=-1.0)
  with pytest.raises(ValueError, match=r"non-negative, got -2"):
    lc.register_multi_bernoulli_predictive_distribution(logits, coeff=-2.0)
  with pytest.raises(ValueError, match=r"var must be positive, got 0"):
    lc.register_normal_predictive_distribution(logits, var=0.0)
  assert not lc.losses


def test_categorical_loss_class_follows_the_targets(graph):
  lc = kfac.LayerCollection()
  logits = tf.constant(_rand(1, N, 3))
  labels = np.array([0, 2, 1, 1])
  onehot = lc.register_categorical_predictive_distribution(
      logits, targets=tf.constant(np.eye(3)[labels]))
  ints = lc.register_categorical_predictive_distribution(
      logits, targets=tf.constant(labels))
  none = lc.register_categorical_predictive_distribution(logits)
  assert type(onehot) is lf.OnehotCategoricalLogitsNegativeLogProbLoss
  assert type(ints) is lf.CategoricalLogitsNegativeLogProbLoss
  assert type(none) is lf.CategoricalLogitsNegativeLogProbLoss
  with pytest.raises(ValueError, match=r"Targets of shape \(4, 3, 1\)"):
    lc.register_categorical_predictive_distribution(
        logits, targets=tf.constant(np.zeros([N, 3, 1])))
  with pytest.raises(ValueError, match=r"Targets of shape \(4, 5\)"):
    lc.register_squared_error_loss(logits, targets=tf.constant(_rand(2, N, 5)))
  with tf.compat.v1.Session() as sess:
    got = sess.run([onehot.evaluate(), ints.evaluate()])
  z = _rand(1, N, 3)
  logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
  want = -logp[np.arange(N), labels].sum()
  np.testing.assert_allclose(got, [want, want], **TOL)


def test_onehot_targets_must_have_the_logits_width(graph):
  """One-hot rows of 5 classes for 3 logits are refused at registration
  (like register_squared_error_loss does for mismatched targets)."""
  lc = kfac.LayerCollection()
  logits = tf.constant(_rand(1, N, 3))
  with pytest.raises(ValueError, match=r"Targets of shape \(4, 5\)"):
    lc.register_categorical_predictive_distribution(
        logits, targets=tf.constant(np.eye(5)[[0, 1, 2, 3]]))
  assert not lc.losses


def test_integer_labels_must_have_the_logits_batch(graph):
  """6 labels for a batch of 4 logits are refused at registration."""
  lc = kfac.LayerCollection()
  logits = tf.constant(_rand(1, N, 3))
  with pytest.raises(ValueError, match=r"Targets of shape \(6,\)"):
    lc.register_categorical_predictive_distribution(
        logits, targets=tf.constant([0, 1, 2, 0, 1, 2]))
  assert not lc.losses


# ---------------------------------------------------------------- eval_losses
def _numpy_nlls(z_cat, labels, mean, t_norm, z_bern, t_bern):
  logp = z_cat - np.log(np.exp(z_cat).sum(axis=1, keepdims=True))
  cat = -logp[np.arange(len(labels)), labels].sum()
  var = 0.5
  norm = np.sum((t_norm - mean)**2 / (2 * var) + 0.5 * np.log(2 * np.pi * var))
  p = 1 / (1 + np.exp(-z_bern))
  bern = -np.sum(t_bern * np.log(p) + (1 - t_bern) * np.log(1 - p))
  return np.array([cat, norm, bern])


def test_eval_losses_and_total_loss(graph):
  z_cat, labels = _rand(1, N, 3), np.array([2, 0, 1, 2])
  mean, t_norm = _rand(2, N, 2), _rand(3, N, 2)
  z_bern = _rand(4, N, 2)
  t_bern = (_rand(5, N, 2) > 0).astype(np.float64)
  coeffs = np.array([2.0, 0.5, 3.0])
  lc = kfac.LayerCollection()
  lc.register_softmax_cross_entropy_loss(
      tf.constant(z_cat), targets=tf.constant(labels), coeff=2.0)
  lc.register_squared_error_loss(tf.constant(mean),
                                 targets=tf.constant(t_norm), coeff=0.5)
  lc.register_sigmoid_cross_entropy_loss(
      tf.constant(z_bern), targets=tf.constant(t_bern), coeff=3.0)
  fetch = {
      "regular": lc.eval_losses(),
      "data_regular": lc.eval_losses(target_mode="data", coeff_mode="regular"),
      "sqrt": lc.eval_losses(coeff_mode="sqrt"),
      "off": lc.eval_losses(coeff_mode="off"),
      "total": lc.total_loss(),
      "sample": lc.eval_losses(target_mode="sample"),
  }
  with pytest.raises(ValueError, match=r"'bogus_target'"):
    lc.eval_losses(target_mode="bogus_target")
  with pytest.raises(ValueError, match=r"'bogus_coeff'"):
    lc.eval_losses(coeff_mode="bogus_coeff")
  with tf.compat.v1.Session() as sess:
    out = sess.run(fetch)
  nll = _numpy_nlls(z_cat, labels, mean, t_norm, z_bern, t_bern)
  np.testing.assert_allclose(out["regular"], coeffs * nll, **TOL)
  np.testing.assert_allclose(out["data_regular"], coeffs * nll, **TOL)
  np.testing.assert_allclose(out["sqrt"], np.sqrt(coeffs) * nll, **TOL)
  np.testing.assert_allclose(out["off"], nll, **TOL)
  np.testing.assert_allclose(out["total"], np.sum(coeffs * nll), **TOL)
  # Sampled targets: one finite, coeff-scaled value per loss; a categorical
  # NLL is positive and the Gaussian one at least its normalising constant.
  sample = np.asarray(out["sample"])
  assert sample.shape == (3,) and np.all(np.isfinite(sample))
  assert sample[0] > 0
  assert sample[1] >= 0.5 * N * 2 * 0.5 * np.log(np.pi) - 1e-12


def test_eval_losses_without_targets_names_the_loss(graph):
  lc = kfac.LayerCollection()
  lc.register_softmax_cross_entropy_loss(tf.constant(_rand(1, N, 3)))
  with pytest.raises(ValueError,
                     match=r"CategoricalLogitsNegativeLogProbLoss has no "
                     r"targets"):
    lc.total_loss()


# --------------------------------------------------------------- defaults
def test_default_approximations(graph):
  lc = kfac.LayerCollection()
  assert lc.default_generic_approximation == "diagonal"
  assert lc.default_fully_connected_approximation == "kron"
  p1, x1, y1 = _layer("d1", seed=1)
  assert type(lc.register_fully_connected(p1, x1, y1)) is (
      fb.FullyConnectedKFACBasicFB)
  g1 = _var("g1", 3, seed=2)
  assert type(lc.register_generic(g1, N)) is fb.NaiveDiagonalFB

  lc.set_default_fully_connected_approximation("diagonal")
  lc.set_default_generic_approximation("full")
  assert lc.default_fully_connected_approximation == "diagonal"
  p2, x2, y2 = _layer("d2", seed=3)
  assert type(lc.register_fully_connected(p2, x2, y2)) is (
      fb.FullyConnectedDiagonalFB)
  g2 = _var("g2", 3, seed=4)
  assert type(lc.register_generic(g2, N)) is fb.NaiveFullFB
  # An explicit approx still wins.
  p3, x3, y3 = _layer("d3", seed=5)
  assert type(lc.register_fully_connected(p3, x3, y3, approx="kron")) is (
      fb.FullyConnectedKFACBasicFB)

  with pytest.raises(ValueError, match=r"'bogus'.*'kron'"):
    lc.set_default_fully_connected_approximation("bogus")
  with pytest.raises(ValueError, match=r"'kron'.*\['diagonal', 'full'\]"):
    lc.set_default_generic_approximation("kron")
  assert lc.default_fully_connected_approximation == "diagonal"
  assert lc.default_generic_approximation == "full"
  # Defaults belong to one collection.
  assert kfac.LayerCollection().default_fully_connected_approximation == "kron"


# ------------------------------------------------------- linked parameters
def test_linked_parameters(graph):
  lc = kfac.LayerCollection()
  (w, b), x, y = _layer("linked")
  lc.define_linked_parameters((w, b), approximation="diagonal")
  assert list(lc.linked_parameters.values()) == [((w, b), "diagonal")]
  with pytest.raises(ValueError,
                     match=r"\(linked_w\) overlap the linked parameter group "
                     r"\(linked_w, linked_b\)"):
    lc.register_fully_connected(w, x, tf.matmul(x, w))
  with pytest.raises(ValueError, match=_m("linked_w, linked_b")):
    lc.register_generic(b, N)
  assert not lc.get_blocks()
  block = lc.register_fully_connected((w, b), x, y)
  assert type(block) is fb.FullyConnectedDiagonalFB

  c = _var("third", D_OUT, seed=9)
  with pytest.raises(ValueError,
                     match=r"Linked group \(linked_b, third\) overlaps the "
                     r"group \(linked_w, linked_b\)"):
    lc.define_linked_parameters((b, c))
  # A group without an approximation falls back to the default.
  (w2, b2), x2, y2 = _layer("free", seed=11)
  lc.define_linked_parameters((w2, b2))
  assert type(lc.register_fully_connected((w2, b2), x2, y2)) is (
      fb.FullyConnectedKFACBasicFB)


# ------------------------------------------------------------ default stack
def test_default_layer_collection(graph):
  with pytest.raises(ValueError, match="No default LayerCollection"):
    lc_default.get_default_layer_collection()
  outer, inner = kfac.LayerCollection(name="outer"), kfac.LayerCollection()
  with outer.as_default() as got:
    assert got is outer
    assert lc_default.get_default_layer_collection() is outer
    with inner.as_default():
      assert lc_default.get_default_layer_collection() is inner
    assert lc_default.get_default_layer_collection() is outer
  with pytest.raises(ValueError, match="No default LayerCollection"):
    lc_default.get_default_layer_collection()
  lc_default.set_default_layer_collection(inner)
  assert lc_default.get_default_layer_collection() is inner
  # Setting another while one is set raises (kfac 0.2.x); None clears.
  with pytest.raises(ValueError, match="already set"):
    lc_default.set_default_layer_collection(outer)
  assert lc_default.get_default_layer_collection() is inner
  lc_default.set_default_layer_collection(None)
  lc_default.set_default_layer_collection(outer)
  assert lc_default.get_default_layer_collection() is outer
  lc_default.set_default_layer_collection(None)
  with pytest.raises(ValueError, match="No default LayerCollection"):
    lc_default.get_default_layer_collection()


# --------------------------------------------------------------- finalize
def test_finalize(graph):
  lc = kfac.LayerCollection(name="my_lc")
  params, x, y = _layer("fin")
  lc.register_fully_connected(params, x, y)
  with pytest.raises(ValueError, match=r"No losses registered with "
                     r"LayerCollection my_lc"):
    lc.finalize()
  assert not lc.is_finalized
  empty = kfac.LayerCollection(name="empty")
  empty.register_squared_error_loss(y)
  with pytest.raises(ValueError, match=r"No layers registered.*empty"):
    empty.finalize()

  lc.register_squared_error_loss(y)
  lc.finalize()
  assert lc.is_finalized
  other, x2, y2 = _layer("late", seed=5)
  with pytest.raises(ValueError, match=r"my_lc is finalized"):
    lc.register_fully_connected(other, x2, y2)
  with pytest.raises(ValueError, match=r"my_lc is finalized"):
    lc.register_generic(_var("late_g", 2), N)
  with pytest.raises(ValueError, match=r"my_lc is finalized"):
    lc.register_squared_error_loss(y2)
  with pytest.raises(ValueError, match=r"my_lc is finalized"):
    lc.define_linked_parameters(other)
  assert len(lc.get_blocks()) == 1 and len(lc.losses) == 1


# ---------------------------------------------------------------- factors
def test_make_or_get_factor(graph):
  lc = kfac.LayerCollection()
  x = tf.constant(_rand(1, N, D_IN))
  x_other = tf.constant(_rand(1, N, D_IN))
  cls = ff.FullyConnectedKroneckerFactor
  f1 = lc.make_or_get_factor(cls, ((x,), False))
  assert lc.make_or_get_factor(cls, ((x,), False)) is f1
  f2 = lc.make_or_get_factor(cls, ((x,), True))
  f3 = lc.make_or_get_factor(cls, ((x_other,), False))
  f4 = lc.make_or_get_factor(ff.DiagonalKroneckerFactor, ((x,), False))
  assert len({id(f) for f in (f1, f2, f3, f4)}) == 4
  assert lc.get_factors() == [f1, f2, f3, f4]
  names = [f.name for f in lc.get_factors()]
  assert len(set(names)) == 4
  assert names[:3] == ["FullyConnectedKroneckerFactor",
                       "FullyConnectedKroneckerFactor_1",
                       "FullyConnectedKroneckerFactor_2"]
  named = lc.make_or_get_factor(cls, ((x, x_other), False), name="A")
  named2 = lc.make_or_get_factor(cls, ((x_other, x), False), name="A")
  assert (named.name, named2.name) == ("A", "A_1")
  # The shared factor computes its own statistic (has_bias differs).
  assert f1.get_cov_var().shape == (D_IN, D_IN)
  assert f2.get_cov_var().shape == (D_IN + 1, D_IN + 1)


# ----------------------------------------------------- auto_register_layers
def test_auto_register_layers(graph):
  """auto_register_layers searches the graph (graph_search_test.py covers
  the patterns): the manually registered layer is left alone, variables no
  layer uses fall back to generic blocks with a warning (which needs
  batch_size), and var_list defaults to the graph's trainable variables."""
  lc = kfac.LayerCollection()
  params, x, y = _layer("manual")
  dense = lc.register_fully_connected(params, x, y)
  extra1, extra2 = _var("auto_one", 3), _var("auto_two", 2, 2)
  all_vars = list(params) + [extra1, extra2]
  with pytest.raises(ValueError, match="No registered losses"):
    lc.auto_register_layers(all_vars, batch_size=N)
  lc.register_squared_error_loss(y)
  with pytest.raises(ValueError,
                     match=r"register auto_one as generic without knowledge "
                     r"of batch_size"):
    lc.auto_register_layers(all_vars)
  with pytest.raises(ValueError, match="auto_one as generic"):
    lc.auto_register_layers()  # the graph's trainable variables
  assert len(lc.get_blocks()) == 1
  with pytest.warns(UserWarning, match="registering auto_one as generic"):
    lc.auto_register_layers(all_vars, batch_size=N)
  blocks = lc.get_blocks()
  assert blocks[0] is dense
  assert [type(b) for b in blocks[1:]] == [fb.NaiveDiagonalFB] * 2
  assert [b.params for b in blocks[1:]] == [extra1, extra2]
  assert [b.num_registered_towers for b in blocks] == [1, 1, 1]
  lc.check_registration(all_vars)
  # Everything is registered now: a second call needs no batch size.
  lc.auto_register_layers(all_vars)
  assert len(lc.get_blocks()) == 3


# ------------------------------------------------------- estimator errors
def _registered_model(prefix="model"):
  lc = kfac.LayerCollection()
  (w, b), x, y = _layer(prefix)
  lc.register_fully_connected((w, b), x, y)
  labels = tf.constant([0, 1, 1, 0])
  lc.register_softmax_cross_entropy_loss(y, targets=labels)
  loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=y))
  return lc, [w, b], loss


def test_fisher_estimator_argument_errors(graph):
  lc, variables, _ = _registered_model()
  kwargs = dict(variables=variables, cov_ema_decay=0.9, damping=0.1,
                layer_collection=lc)
  with pytest.raises(ValueError, match=r"'bogus_mode'") as info:
    kfac.estimator.FisherEstimator(estimation_mode="bogus_mode", **kwargs)
  for mode in ("gradients", "empirical", "curvature_prop",
               "curvature_prop_GGN", "exact", "exact_GGN"):
    assert mode in str(info.value)
  with pytest.raises(ValueError, match=r"[Bb]atch size.*compute_params_stats"):
    kfac.estimator.FisherEstimator(compute_params_stats=True, **kwargs)
  with pytest.raises(ValueError, match=r"placement_strategy 'bogus'"):
    kfac.estimator.make_fisher_estimator(placement_strategy="bogus", **kwargs)
  est = kfac.estimator.FisherEstimator(
      variables=variables[:1], cov_ema_decay=0.9, damping=0.1,
      layer_collection=lc)
  # Checked when the estimator is first used (kfac 0.2.x: lazily).
  with pytest.raises(ValueError, match=r"registered but not in the list.*"
                     r"model_b"):
    est.make_vars_and_create_op_thunks()
  # With valid arguments the estimator is built and exposes its mode.
  est = kfac.estimator.make_fisher_estimator(
      placement_strategy="round_robin", cov_devices=["/cpu:0"], **kwargs)
  assert est.mat_type == "Fisher"
  assert len(est.blocks) == 1


# ------------------------------------------------------- optimizer errors
def test_optimizer_constructor_errors():
  common = dict(damping=0.1)
  with pytest.raises(ValueError, match=r"Unknown momentum_type 'bogus'"):
    kfac.KfacOptimizer(learning_rate=0.1, momentum_type="bogus", **common)
  with pytest.raises(ValueError, match=r"'qmodel' chooses the learning_rate"):
    kfac.KfacOptimizer(learning_rate=0.1, momentum=None,
                       momentum_type="qmodel", **common)
  with pytest.raises(ValueError, match=r"adapt_damping=True needs loss_fn"):
    kfac.KfacOptimizer(learning_rate=0.1, adapt_damping=True, **common)
  with pytest.raises(ValueError, match=r"learning_rate is required"):
    kfac.KfacOptimizer(learning_rate=None, **common)
  with pytest.raises(ValueError, match=r"damping is required"):
    kfac.KfacOptimizer(learning_rate=0.1, damping=None)


def test_optimizer_minimize_eagerly_is_a_runtime_error():
  assert tf.executing_eagerly()
  v = tf.Variable(1.0)
  opt = kfac.KfacOptimizer(learning_rate=0.1, damping=0.1)
  with pytest.raises(RuntimeError, match=r"minimize|compute_gradients"):
    opt.minimize(lambda: v * v, var_list=[v])
  with pytest.raises(RuntimeError, match="tf.function"):
    opt.apply_gradients([(tf.constant(1.0), v)])
  assert v.numpy() == 1.0


def test_optimizer_var_list_errors(graph):
  lc, (w, b), loss = _registered_model("opt")
  opt = kfac.KfacOptimizer(learning_rate=0.1, damping=0.1,
                           layer_collection=lc, momentum=0.9)
  stray = _var("unregistered_var", 2, seed=4)
  with pytest.raises(ValueError,
                     match=r"not registered.*unregistered_var"):
    opt.minimize(loss + tf.reduce_sum(stray**2), var_list=[w, b, stray])
  with pytest.raises(ValueError, match=r"No gradient for variables opt_w"):
    opt.apply_gradients([(None, w), (tf.ones_like(b), b)])
  unused = _var("unused_var", 2, seed=5)
  with pytest.raises(ValueError, match=r"No gradient for variables unused_var"):
    opt.minimize(loss, var_list=[w, b, unused])
  # The valid call builds a training op.
  assert isinstance(opt.minimize(loss), tf.Operation)


def test_optimizer_without_layer_collection(graph):
  v = _var("lonely", 2)
  opt = kfac.KfacOptimizer(learning_rate=0.1, damping=0.1)
  with pytest.raises(ValueError, match=r"layer_collection"):
    opt.apply_gradients([(tf.ones_like(v), v)])
  with pytest.raises(ValueError, match=r"layer_collection"):
    opt.make_vars_and_create_op_thunks()
