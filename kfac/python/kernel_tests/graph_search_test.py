"""Graph search (`LayerCollection.auto_register_layers`,
kfac.python.ops.tensormatch): automatic registration equals registering by
hand, in a TF1 graph and inside a tf.function.

The reference for every model is the same model registered by hand with
the documented `register_*` calls. "Equal" means: the same block types
for the same parameters, the same Fisher blocks (`full_fisher_block()`,
i.e. the same factor statistics) and the same losses and parameters over
5 K-FAC steps, to float64 rounding (rtol 1e-9). The K-FAC steps use
estimation_mode="exact" so that no random sampling depends on the order in
which ops were created. The tf.function runs of the convolution, RNN,
shared-weight, embedding and partly hand-registered models are in the slow
tier (their TF1 runs, and both runs of the dense model and of the error
and fallback tests, are fast).
"""

import re
import warnings

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import reference as ref
from kfac.python.ops import fisher_blocks as fb
from kfac.python.ops.tensormatch import graph_matcher as gm
from kfac.python.ops.tensormatch import graph_patterns as gp
from kfac.python.ops.tensormatch import graph_search as gs
from kfac.python.ops.tensormatch import match_records
from kfac.python.ops.tensormatch import record_filters
from kfac.python.ops.tensormatch import record_registration
from kfac.python.ops.tensormatch import record_search
from kfac.python.ops.tensormatch import search_errors

WORLDS = ref.WORLDS
TOL = dict(rtol=1e-9, atol=1e-12)
N = 6  # batch size
STEPS = 5



def test_graph_search_module_keeps_its_names():
  """tensormatch.graph_search (kfac 0.2.4's path) still offers the names
  now defined in the modules it was split into, as the same objects."""
  moved = {
      search_errors: ("AmbiguousRegistrationError", "GraphSearchWarning"),
      record_search: ("find_records",),
      record_filters: ("filter_records", "filter_user_registered_records",
                       "filter_grouped_variable_records",
                       "filter_subgraph_records"),
      record_registration: ("register_records",),
      match_records: ("MatchRecord", "ParamsDict", "RecordType",
                      "TensorToVariable", "UnsupportedLayerError",
                      "ensure_sequence", "record_affine_from_bindings",
                      "record_batch_norm_from_bindings",
                      "record_scale_and_shift_from_bindings"),
  }
  for module, names in moved.items():
    for name in names:
      assert getattr(gs, name) is getattr(module, name), name
  for name in ("register_layers", "register_subgraph_layers",
               "default_variables"):
    assert callable(getattr(gs, name)), name
  assert issubclass(gs.AmbiguousRegistrationError, ValueError)

def _rand(seed, *shape, scale=0.5):
  return scale * np.random.RandomState(seed).randn(*shape)


def _labels(seed, n, classes):
  return np.random.RandomState(seed).randint(0, classes, n)


def _ce(lc, logits, labels, name=None):
  labels = tf.constant(labels)
  lc.register_softmax_cross_entropy_loss(logits, name=name)
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))


def _summary(lc):
  """[(block class, variable names)] of a collection, sorted."""
  return sorted((type(b).__name__,
                 tuple(v.name.split(":")[0]
                       for v in match_records.ensure_sequence(p)))
                for p, b in lc.blocks_and_params())


def _fisher_blocks(lc):
  """The full Fisher blocks, in the order of _summary."""
  pairs = sorted(lc.blocks_and_params(),
                 key=lambda pb: tuple(v.name for v in match_records.ensure_sequence(
                     pb[0])))
  return [b.full_fisher_block() for _, b in pairs]


def _variables(inits):
  return [tf.Variable(v, name="v%d" % i) for i, v in enumerate(inits)]


def _train(world, inits, model, auto, batch_size=None, steps=STEPS,
           auto_kwargs=None):
  """Trains model(vs, lc, auto) -> loss for `steps` K-FAC steps.

  With `auto`, the model registers its losses only (and whatever it
  registers by hand when auto is a set of layers to keep) and
  auto_register_layers runs after it. Returns (block summary, losses,
  final variables, Fisher blocks after the last step)."""
  seen = {}

  def build(vs, lc):
    loss = model(vs, lc, auto)
    if auto:
      lc.auto_register_layers(vs, batch_size=batch_size, **(auto_kwargs or {}))
    seen["summary"] = _summary(lc)
    return loss

  def make_opt(lc):
    return kfac.PeriodicInvCovUpdateKfacOpt(
        invert_every=1, learning_rate=0.1, damping=0.05, momentum=0.5,
        cov_ema_decay=0.8, estimation_mode="exact", layer_collection=lc)

  if world == "graph":
    with tf.Graph().as_default():
      vs = _variables(inits)
      lc = kfac.LayerCollection()
      loss = build(vs, lc)
      train_op = make_opt(lc).minimize(loss, var_list=vs)
      blocks = _fisher_blocks(lc)
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        losses = [sess.run([loss, train_op])[0] for _ in range(steps)]
        return (seen["summary"], losses, sess.run(vs), sess.run(blocks))
  vs = _variables(inits)
  opt = make_opt(None)

  @tf.function
  def step():
    lc = kfac.LayerCollection()
    loss = build(vs, lc)
    op = opt.minimize(loss, var_list=vs, layer_collection=lc)
    with tf.control_dependencies([op]):
      blocks = [tf.identity(b) for b in _fisher_blocks(lc)]
    return loss, blocks

  losses = []
  for _ in range(steps):
    loss, blocks = step()
    losses.append(loss.numpy())
  return (seen["summary"], losses, [v.numpy() for v in vs],
          [b.numpy() for b in blocks])


def _assert_same_training(world, inits, model, batch_size=None,
                          expected=None, **kwargs):
  manual = _train(world, inits, model, False)
  auto = _train(world, inits, model, True, batch_size=batch_size, **kwargs)
  assert auto[0] == manual[0]
  if expected is not None:
    assert manual[0] == sorted(expected)
  assert manual[1][-1] < manual[1][0]  # it trains
  np.testing.assert_allclose(auto[1], manual[1], **TOL)
  for a, m in zip(auto[2] + auto[3], manual[2] + manual[3]):
    np.testing.assert_allclose(a, m, **TOL)
  return auto


# ------------------------------------------------------------------ models
def _mlp(vs, lc, auto):
  w1, b1, w2, b2 = vs
  x = tf.constant(_rand(1, N, 4, scale=1.0))
  pre1 = tf.matmul(x, w1) + b1
  h = tf.tanh(pre1)
  logits = tf.nn.bias_add(tf.matmul(h, w2), b2)
  if not auto:
    lc.register_fully_connected((w1, b1), x, pre1)
    lc.register_fully_connected((w2, b2), h, logits)
  return _ce(lc, logits, _labels(2, N, 3))


MLP_INITS = [_rand(3, 4, 5), _rand(4, 5), _rand(5, 5, 3), _rand(6, 3)]


@pytest.mark.parametrize("world", WORLDS)
def test_dense_layers_equal_manual_registration(world):
  _assert_same_training(world, MLP_INITS, _mlp, expected=[
      ("FullyConnectedKFACBasicFB", ("v0", "v1")),
      ("FullyConnectedKFACBasicFB", ("v2", "v3"))])


def _convnet(vs, lc, auto):
  """depthwise conv2d -> conv2d (+bias) -> conv1d (+bias) -> dense."""
  dw, f2, b2, f1, b1, w = vs
  x = tf.constant(_rand(7, N, 5, 5, 2, scale=1.0))
  d = tf.nn.depthwise_conv2d(x, dw, [1, 1, 1, 1], "SAME")
  a = tf.tanh(d)
  c = tf.nn.bias_add(tf.nn.conv2d(a, f2, 2, "VALID"), b2)
  h = tf.reshape(tf.tanh(c), [N, 4, 3])
  c1 = tf.nn.conv1d(h, f1, 1, "SAME") + b1
  flat = tf.reshape(tf.tanh(c1), [N, 8])
  logits = tf.matmul(flat, w)
  if not auto:
    lc.register_depthwise_conv2d(dw, x, d, [1, 1, 1, 1], "SAME")
    lc.register_conv2d((f2, b2), [1, 2, 2, 1], "VALID", a, c)
    lc.register_conv1d((f1, b1), 1, "SAME", h, c1)
    lc.register_fully_connected(w, flat, logits)
  return _ce(lc, logits, _labels(8, N, 3))


CONV_INITS = [_rand(9, 2, 2, 2, 1), _rand(10, 2, 2, 2, 3), _rand(11, 3),
              _rand(12, 2, 3, 2), _rand(13, 2), _rand(14, 8, 3)]


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
def test_convolutions_equal_manual_registration(world):
  _assert_same_training(world, CONV_INITS, _convnet, expected=[
      ("DepthwiseConvDiagonalFB", ("v0",)),
      ("ConvKFCBasicFB", ("v1", "v2")),
      ("ConvKFCBasicFB", ("v3", "v4")),
      ("FullyConnectedKFACBasicFB", ("v5",))])


def _dilated(vs, lc, auto):
  """Dilated convolutions, which TensorFlow computes through
  SpaceToBatchND / BatchToSpaceND, with a reshaped bias (as Keras 3
  adds it)."""
  f2, b2, f1 = vs
  x = tf.constant(_rand(15, N, 7, 7, 2, scale=1.0))
  c = tf.nn.convolution(x, f2, padding="SAME", dilations=2) + tf.reshape(
      b2, [1, 1, 1, 3])
  h = tf.reshape(tf.tanh(c), [N, 49, 3])
  c1 = tf.nn.convolution(h, f1, padding="VALID", dilations=3)
  logits = tf.reduce_mean(c1, axis=1)
  if not auto:
    lc.register_conv2d((f2, b2), 1, "SAME", x, c, dilations=2)
    lc.register_conv1d(f1, 1, "VALID", h, c1, dilations=3)
  return _ce(lc, logits, _labels(16, N, 2))


DILATED_INITS = [_rand(17, 3, 3, 2, 3), _rand(18, 3), _rand(19, 3, 3, 2)]


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
def test_dilated_convolutions_equal_manual_registration(world):
  _assert_same_training(world, DILATED_INITS, _dilated, expected=[
      ("ConvKFCBasicFB", ("v0", "v1")), ("ConvKFCBasicFB", ("v2",))])


T = 3  # RNN steps


def _rnn(vs, lc, auto):
  """An unrolled RNN: the same three layers at every step, a loss per
  step (the weights are shared over time: multi-use layers)."""
  w_in, b_in, w_rec, w_out, b_out = vs
  xs = [tf.constant(_rand(20 + t, N, 2, scale=1.0)) for t in range(T)]
  h = tf.zeros([N, 4], tf.float64)
  uses = {"in": ([], []), "rec": ([], []), "out": ([], [])}
  loss = 0.0
  for t in range(T):
    s_in = tf.matmul(xs[t], w_in) + b_in
    s_rec = tf.matmul(h, w_rec)
    uses["in"][0].append(xs[t])
    uses["in"][1].append(s_in)
    uses["rec"][0].append(h)
    uses["rec"][1].append(s_rec)
    h = tf.tanh(s_in + s_rec)
    logits = tf.matmul(h, w_out) + b_out
    uses["out"][0].append(h)
    uses["out"][1].append(logits)
    loss += _ce(lc, logits, _labels(30 + t, N, 3))
  if not auto:
    lc.register_fully_connected_multi((w_in, b_in), *uses["in"])
    lc.register_fully_connected_multi(w_rec, *uses["rec"])
    lc.register_fully_connected_multi((w_out, b_out), *uses["out"])
  return loss


RNN_INITS = [_rand(40, 2, 4), _rand(41, 4), _rand(42, 4, 4), _rand(43, 4, 3),
             _rand(44, 3)]


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
def test_rnn_multi_use_equals_manual_registration(world):
  _assert_same_training(world, RNN_INITS, _rnn, expected=[
      ("FullyConnectedMultiIndepFB", ("v0", "v1")),
      ("FullyConnectedMultiIndepFB", ("v2",)),
      ("FullyConnectedMultiIndepFB", ("v3", "v4"))])


def _tied(vs, lc, auto):
  """One weight matrix applied to two inputs, with a bias each: ambiguous
  unless the weights are declared a group of their own; then the weights
  are one layer used twice and the biases are generic."""
  w, b0, b1, v = vs
  x = tf.constant(_rand(50, N, 3, scale=1.0))
  y = tf.constant(_rand(51, N, 3, scale=1.0))
  p0, p1 = tf.matmul(x, w), tf.matmul(y, w)
  h = tf.tanh(p0 + b0) * tf.tanh(p1 + b1)
  logits = tf.matmul(h, v)
  if auto:
    lc.define_linked_parameters(w)
  else:
    lc.register_fully_connected_multi(w, (x, y), (p0, p1))
    lc.register_generic(b0, N)
    lc.register_generic(b1, N)
    lc.register_fully_connected(v, h, logits)
  return _ce(lc, logits, _labels(52, N, 2))


TIED_INITS = [_rand(53, 3, 4), _rand(54, 4), _rand(55, 4), _rand(56, 4, 2)]


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
def test_shared_weights_equal_manual_registration(world):
  with pytest.warns(search_errors.GraphSearchWarning) as caught:
    _assert_same_training(world, TIED_INITS, _tied, batch_size=N, expected=[
        ("FullyConnectedMultiIndepFB", ("v0",)),
        ("NaiveDiagonalFB", ("v1",)),
        ("NaiveDiagonalFB", ("v2",)),
        ("FullyConnectedKFACBasicFB", ("v3",))])
  names = set(re.findall(r"registering (\S+) as generic",
                         " ".join(str(w.message) for w in caught)))
  assert names == {"v1", "v2"}


def _embed_norm(vs, lc, auto):
  """Embedding lookup -> normalisation -> scale and shift -> dense."""
  table, gamma, beta, w = vs
  ids = tf.constant(_labels(60, N, 7))
  e = tf.gather(table, ids)
  mean, var = tf.nn.moments(e, [1], keepdims=True)
  normed = (e - mean) * tf.math.rsqrt(var + 1e-3)
  out = normed * gamma + beta
  act = tf.tanh(out)
  logits = tf.matmul(act, w)
  if not auto:
    lc.register_fully_connected(table, ids, e, dense_inputs=False)
    lc.register_scale_and_shift((gamma, beta), normed, out)
    lc.register_fully_connected(w, act, logits)
  return _ce(lc, logits, _labels(61, N, 3))


EMBED_INITS = [_rand(62, 7, 4), 1.0 + _rand(63, 4), _rand(64, 4),
               _rand(65, 4, 3)]


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
def test_embedding_and_scale_shift_equal_manual_registration(world):
  _assert_same_training(world, EMBED_INITS, _embed_norm, expected=[
      ("EmbeddingKFACFB", ("v0",)),
      ("ScaleAndShiftFullFB", ("v1", "v2")),
      ("FullyConnectedKFACBasicFB", ("v3",))])


def _partly_manual(vs, lc, auto):
  """The first layer is always registered by hand, with a non-default
  approximation; graph search must leave it alone."""
  w1, b1, w2, b2 = vs
  x = tf.constant(_rand(1, N, 4, scale=1.0))
  pre1 = tf.matmul(x, w1) + b1
  h = tf.tanh(pre1)
  logits = tf.matmul(h, w2) + b2
  lc.register_fully_connected((w1, b1), x, pre1, approx="diagonal")
  if not auto:
    lc.register_fully_connected((w2, b2), h, logits)
  return _ce(lc, logits, _labels(2, N, 3))


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
def test_user_registered_subset_is_left_alone(world):
  _assert_same_training(world, MLP_INITS, _partly_manual, expected=[
      ("FullyConnectedDiagonalFB", ("v0", "v1")),
      ("FullyConnectedKFACBasicFB", ("v2", "v3"))])


# ---------------------------------------------- registrations, both worlds
def _in_world(world, inits, fn):
  """Runs fn(variables) (which builds graph ops) in a TF1 graph or in a
  tf.function trace; `inits` maps variable names to (initial value,
  trainable)."""
  def make():
    return {name: tf.Variable(value, name=name, trainable=trainable)
            for name, (value, trainable) in inits.items()}

  if world == "graph":
    with tf.Graph().as_default():
      return fn(make())
  variables = make()
  out = []

  @tf.function
  def traced():
    out.append(fn(variables))
    return tf.constant(0)

  traced()
  return out[0]


@pytest.mark.parametrize("world", WORLDS)
def test_generic_fallback_warns_with_the_variable_names(world):
  def build(vs):
    w, c = vs["weights"], vs["odd_one"]
    x = tf.constant(_rand(72, N, 3))
    logits = tf.matmul(x, w) + tf.square(c)  # not a bias add of c
    lc = kfac.LayerCollection()
    lc.register_squared_error_loss(logits)
    with pytest.raises(search_errors.AmbiguousRegistrationError,
                       match="register odd_one as generic without knowledge "
                       "of batch_size"):
      lc.auto_register_layers([w, c])
    lc = kfac.LayerCollection()
    lc.register_squared_error_loss(logits)
    with pytest.warns(search_errors.GraphSearchWarning,
                      match="registering odd_one as generic") as caught:
      new = lc.auto_register_layers([w, c], batch_size=N)
    assert len(caught) == 1
    return _summary(lc), len(new)

  summary, num_new = _in_world(
      world, {"weights": (_rand(70, 3, 2), True),
              "odd_one": (_rand(71, 2), True)}, build)
  assert summary == [("FullyConnectedKFACBasicFB", ("weights",)),
                     ("NaiveDiagonalFB", ("odd_one",))]
  assert num_new == 2


@pytest.mark.parametrize("world", WORLDS)
def test_default_var_list_and_towers(world):
  """var_list defaults to the trainable variables (TF1) / those the trace
  read (TF2); losses registered again under the same name are towers."""
  def build(vs):
    w, b, frozen = vs["w"], vs["b"], vs["frozen"]
    lc = kfac.LayerCollection()
    inputs = []
    for tower in range(2):
      x = tf.constant(_rand(83 + tower, N, 3))
      logits = tf.matmul(x, w) + b + tf.matmul(x, frozen)
      inputs.append(x)
      lc.register_squared_error_loss(logits, name="out",
                                     reuse=tower > 0)
    new = lc.auto_register_layers()
    block = lc.fisher_blocks[(w, b)]
    (params,) = list(new)
    return (_summary(lc), params[0] is w and params[1] is b,
            block.num_registered_towers,
            [t is x for t, x in zip(block._inputs, inputs)])  # pylint: disable=protected-access

  summary, new_ok, towers, same_inputs = _in_world(
      world, {"w": (_rand(80, 3, 2), True), "b": (_rand(81, 2), True),
              "frozen": (_rand(82, 3, 2), False)}, build)
  assert summary == [("FullyConnectedKFACBasicFB", ("w", "b"))]
  assert new_ok is True
  assert towers == 2 and same_inputs == [True, True]


@pytest.mark.parametrize("world", WORLDS)
def test_folded_uses_need_the_batch_size(world):
  def build(vs):
    w = vs["w"]
    x = tf.constant(_rand(91, T * N, 3))  # [T * N, in], uses folded
    out = tf.matmul(x, w)
    lc = kfac.LayerCollection()
    lc.register_squared_error_loss(out)
    lc.auto_register_layers([w], batch_size=N)
    folded = lc.fisher_blocks[w]
    lc2 = kfac.LayerCollection()
    lc2.register_squared_error_loss(out)
    lc2.auto_register_layers([w])  # no batch size: an ordinary layer
    with pytest.raises(ValueError, match="did not divide first dimension"):
      lc3 = kfac.LayerCollection()
      lc3.register_squared_error_loss(out)
      lc3.auto_register_layers([w], batch_size=4)
    return type(folded), folded.num_uses, type(lc2.fisher_blocks[w])

  kind, uses, plain = _in_world(world, {"w": (_rand(90, 3, 2), True)},
                                build)
  assert kind is fb.FullyConnectedMultiIndepFB and uses == T
  assert plain is fb.FullyConnectedKFACBasicFB


@pytest.mark.parametrize("world", WORLDS)
def test_ambiguity_and_linked_group_errors(world):
  def build(vs):
    w, b0, b1 = vs["shared_w"], vs["b0"], vs["b1"]
    x = tf.constant(_rand(103, N, 3))
    out0, out1 = tf.matmul(x, w) + b0, tf.matmul(x * 2.0, w) + b1
    lc = kfac.LayerCollection()
    lc.register_squared_error_loss(out0)
    lc.register_squared_error_loss(out1)
    with pytest.raises(search_errors.AmbiguousRegistrationError,
                       match="shared_w was recorded in multiple groups"):
      lc.auto_register_layers([w, b0, b1], batch_size=N)
    lc.define_linked_parameters((b0, b1))
    with pytest.raises(ValueError,
                       match="in linked group .* was not matched"):
      lc.auto_register_layers([w, b0, b1], batch_size=N)
    lc = kfac.LayerCollection()
    lc.register_squared_error_loss(out0)
    lc.register_squared_error_loss(out1)
    lc.define_linked_parameters((w, b1), approximation="diagonal")
    with pytest.warns(search_errors.GraphSearchWarning, match="b0 as generic"):
      lc.auto_register_layers([w, b0, b1], batch_size=N)
    return _summary(lc)

  assert _in_world(world, {"shared_w": (_rand(100, 3, 3), True),
                           "b0": (_rand(101, 3), True),
                           "b1": (_rand(102, 3), True)}, build) == [
      ("FullyConnectedDiagonalFB", ("shared_w", "b1")),
      ("NaiveDiagonalFB", ("b0",))]


@pytest.mark.parametrize("world", WORLDS)
def test_transposed_weights_raise_unless_registered_by_hand(world):
  """A tied decoder x @ W^T: a clear error naming W, unless the user
  registered W first."""
  def build(vs):
    w, b = vs["tied"], vs["dec_b"]
    x = tf.constant(_rand(130, N, 3))
    code = tf.matmul(x, w)
    recon = tf.matmul(tf.tanh(code), w, transpose_b=True) + b
    lc = kfac.LayerCollection()
    lc.register_squared_error_loss(recon)
    with pytest.raises(ValueError, match="transposed .* weights tied"):
      lc.auto_register_layers([w, b], batch_size=N)
    lc = kfac.LayerCollection()
    lc.register_squared_error_loss(recon)
    lc.register_fully_connected_multi(w, [x], [code])  # the user's choice
    with pytest.warns(search_errors.GraphSearchWarning, match="dec_b as generic"):
      lc.auto_register_layers([w, b], batch_size=N)
    return _summary(lc)

  assert _in_world(world, {"tied": (_rand(131, 3, 4), True),
                           "dec_b": (_rand(132, 3), True)}, build) == [
                               ("FullyConnectedMultiIndepFB", ("tied",)),
                               ("NaiveDiagonalFB", ("dec_b",))]


def test_errors_outside_a_graph_and_without_losses():
  w = tf.Variable(_rand(110, 3, 2))
  lc = kfac.LayerCollection()
  with pytest.raises(ValueError, match="No registered losses"):
    lc.auto_register_layers([w])
  lc.register_squared_error_loss(tf.matmul(tf.ones([2, 3], tf.float64), w))
  with pytest.raises(ValueError, match="graph tensors"):
    lc.auto_register_layers([w])
  with tf.Graph().as_default():
    lc = kfac.LayerCollection()
    lc.register_squared_error_loss(tf.ones([2, 2]))
    with pytest.raises(TypeError, match="must hold tf.Variables"):
      gs.register_layers(lc, [tf.ones([2])])


def test_reference_variables_in_a_tf1_graph():
  """TF1 reference variables (VariableV2 ops) are found like resource
  variables."""
  with tf.Graph().as_default():
    w = tf.compat.v1.Variable(_rand(120, 3, 2), use_resource=False, name="w")
    b = tf.compat.v1.Variable(_rand(121, 2), use_resource=False, name="b")
    assert w.op.type == "VariableV2"
    x = tf.constant(_rand(122, N, 3))
    out = tf.matmul(x, w) + b
    lc = kfac.LayerCollection()
    lc.register_squared_error_loss(out)
    lc.auto_register_layers([w, b])
    assert _summary(lc) == [("FullyConnectedKFACBasicFB", ("w", "b"))]


# ------------------------------------------------------- pattern matcher
def test_pattern_matcher_bindings_choice_and_consumed():
  with tf.Graph().as_default():
    w = tf.Variable(tf.ones([3, 2]), name="w")
    b = tf.Variable(tf.ones([2]), name="b")
    x = tf.ones([4, 3], name="x")
    mm = tf.matmul(x, w)
    out = tf.nn.relu(mm + b)
    bindings = gm.matcher(gp.Layer())(out)
    assert bindings["activations"] is out
    assert bindings["in"] is x
    assert bindings["linear_op"] is mm.op
    assert bindings["weights"] is w.handle and bindings["biases"] is b.handle
    # Affine matches both at the MatMul (linear only) and at the add.
    linear, consumed_linear = gm.matcher_with_consumed(gp.Affine())(mm)
    assert "biases" not in linear
    affine, consumed_affine = gm.matcher_with_consumed(gp.Affine())(
        bindings["pre_activations"])
    assert consumed_linear < consumed_affine
    assert gm.matcher(gp.Affine())(x) is False  # a leaf has no inputs
    # '?:not', '?:any', thunks and all_matcher.
    pattern = (gp.Tensor("t"), ("In", (gp.MatMul, ("In", ("?:any",),
                                                   ("?:not", gp.Const)))))
    assert gm.matcher(pattern)(mm)["t"] is mm
    assert gm.matcher((gp.Tensor, ("In", (gp.MatMul, ("In", gp.Const,
                                                      gp.Const)))))(mm) is \
        False
    both = gm.all_matcher(("?:choice", gp.Tensor("a"), gp.Tensor("b")))(x)
    assert [list(m) for m in both] == [["a"], ["b"]]
    assert gm.matcher(gp.Tensor())(x) is True  # matches, binds nothing
    # A name bound twice must be the same node.
    same = (gp.Tensor(), ("In", (gp.Mul, ("In", gp.Tensor("v"),
                                          gp.Tensor("v")))))
    assert gm.matcher(same)(x * x)
    assert not gm.matcher(same)(x * (x + 1.0))
    # Continuation-passing use of a compiled pattern (kfac 0.2.x style).
    compiled = gm.make_combinators(gm.expand_thunks(gp.Tensor("t")))
    assert compiled(x, {}, set(), lambda bind, _: bind["t"] is x)


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_pattern_matcher_works_on_func_graphs():
  w = tf.Variable(tf.ones([3, 2]))
  found = {}

  @tf.function
  def f(x):
    out = tf.matmul(x, w)
    found.update(gm.matcher(gp.Affine())(out))
    return out

  f(tf.ones([4, 3]))
  weights = found["weights"]
  assert weights.dtype == tf.resource and weights.op.type == "Placeholder"
  assert found["linear_op"].type == "MatMul"


def test_row_bias_is_part_of_the_dense_layer():
  """A [1, out] bias (accepted by register_fully_connected, as in kfac
  0.2.x) is found with its weights."""
  with tf.Graph().as_default():
    x = tf.constant(np.ones([4, 3], np.float32))
    w = tf.compat.v1.get_variable("w", [3, 2])
    b = tf.compat.v1.get_variable("b", [1, 2])
    logits = tf.matmul(x, w) + b
    lc = kfac.LayerCollection()
    lc.register_categorical_predictive_distribution(logits)
    lc.auto_register_layers(var_list=[w, b])
    assert [tuple(v.name for v in kfac.utils.ensure_sequence(p))
            for p in lc.fisher_blocks] == [("w:0", "b:0")]
    block = lc.fisher_blocks[(w, b)]
    assert type(block).__name__ == "FullyConnectedKFACBasicFB"
