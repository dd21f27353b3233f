"""forward_mode.jvp (op-by-op Jacobian-vector products on a built graph)
against TensorFlow's eager forward mode (tf.autodiff.ForwardAccumulator) in
float64, in a TF1 graph and in a tf.function, and what it runs."""

import numpy as np
import pytest
import tensorflow as tf

from kfac.python.ops import forward_mode
from kfac.python.ops import utils
from kfac.python.ops.compat_utils import forward_gradients

RNG = np.random.RandomState(3)
TOL = dict(rtol=1e-10, atol=1e-12)


def _params():
  shapes = dict(w1=(3, 3, 3, 4), b1=(4,), dw=(2, 2, 4, 1), db=(4,),
                w2=(36, 5), b2=(5,), emb=(7, 5), m=(5, 5))
  return {k: 0.5 * RNG.randn(*s) for k, s in sorted(shapes.items())}


def _model(x, ids, p):
  """Every op with a direct rule and several without (MaxPool, ConcatV2,
  Sin, Square, Pack, Exp), a broadcasting add, an op fed twice by one
  tensor and one fed by two paths from one tensor, and batch
  normalization's ops (StopGradient, a broadcasting SquaredDifference,
  Rsqrt)."""
  h = tf.nn.conv2d(x, p["w1"], 1, "SAME") + p["b1"]          # AddV2 bcast
  h = tf.nn.max_pool2d(tf.nn.relu(h), 2, 2, "SAME")           # 8x8 -> 4x4
  h = tf.nn.depthwise_conv2d(h, p["dw"], [1, 1, 1, 1], "VALID")
  h = tf.nn.bias_add(h, p["db"])                              # 3x3x4
  h = tf.reshape(h, [-1, 36])
  z = tf.matmul(h, p["w2"]) - tf.nn.embedding_lookup(p["emb"], ids)
  z = tf.tanh(z) * tf.sigmoid(z)                              # Mul
  z = tf.math.squared_difference(z, tf.sin(z))                # two paths
  mean = tf.reduce_mean(z, axis=0, keepdims=True)             # batch norm
  var = tf.reduce_mean(tf.math.squared_difference(
      z, tf.stop_gradient(mean)), axis=0, keepdims=True)      # broadcast
  z = (z - mean) * tf.math.rsqrt(var + 0.5)
  z = z + tf.math.squared_difference(tf.constant(0.3, z.dtype), z)  # dy only
  z3 = tf.expand_dims(z, 1)
  z3 = tf.matmul(z3, tf.transpose(tf.stack([p["m"]] * 1), [0, 2, 1]))
  z = tf.squeeze(tf.matmul(tf.tile(z3, [1, 1, 1]), p["m"][None]), 1)
  z = tf.add_n([z, -z * z, tf.identity(z)])
  s = tf.nn.softmax(tf.concat([z, tf.square(z)], axis=1))
  s = s + 0.1 * tf.exp(-s)
  return [s, tf.reduce_mean(s * s, axis=0, keepdims=True), tf.reduce_sum(z)]


def _inputs(n=4):
  return RNG.randn(n, 8, 8, 3), RNG.randint(0, 7, size=n)


def _reference(p, tangents, x, ids):
  """Eager forward mode (TensorFlow's own per-op JVPs)."""
  variables = {k: tf.Variable(v) for k, v in p.items()}
  with tf.autodiff.ForwardAccumulator(
      [variables[k] for k in sorted(p)],
      [tf.constant(tangents[k]) for k in sorted(p)]) as acc:
    ys = _model(tf.constant(x), tf.constant(ids), variables)
  return [acc.jvp(y).numpy() for y in ys]


def _build(x, ids, p, tangents):
  variables = {k: tf.Variable(v) for k, v in p.items()}
  ys = _model(x, ids, variables)
  keys = sorted(p)
  return forward_mode.jvp(ys, [variables[k] for k in keys],
                          [tf.constant(tangents[k]) for k in keys])


def test_tf1_graph_matches_eager_forward_mode():
  p = _params()
  tangents = {k: RNG.randn(*v.shape) for k, v in p.items()}
  x, ids = _inputs()
  ref = _reference(p, tangents, x, ids)
  with tf.Graph().as_default():
    xp = tf.compat.v1.placeholder(tf.float64, (None, 8, 8, 3))  # batch unknown
    ip = tf.compat.v1.placeholder(tf.int32, (None,))
    out = _build(xp, ip, p, tangents)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      got = sess.run(out, {xp: x, ip: ids})
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, **TOL)
  assert max(np.abs(r).max() for r in ref) > 1e-2  # not trivially zero


def test_function_matches_eager_forward_mode():
  p = _params()
  tangents = {k: RNG.randn(*v.shape) for k, v in p.items()}
  x, ids = _inputs(5)
  ref = _reference(p, tangents, x, ids)
  variables = {k: tf.Variable(v) for k, v in p.items()}
  keys = sorted(p)

  @tf.function
  def run(x, ids):  # variables captured from outside the function
    return forward_mode.jvp(_model(x, ids, variables),
                            [variables[k] for k in keys],
                            [tf.constant(tangents[k]) for k in keys])

  got = run(tf.constant(x), tf.constant(ids))
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g.numpy(), r, **TOL)


def test_subsets_of_variables_and_tensors():
  """Tangents on some variables only (the others held fixed), on a
  tensor, None where y does not depend on xs, the tangent where y is x."""
  p = _params()
  tangents = {k: (RNG.randn(*v.shape) if k in ("b1", "emb") else
                  np.zeros(v.shape)) for k, v in p.items()}
  x, ids = _inputs()
  ref = _reference(p, tangents, x, ids)
  tx = RNG.randn(*x.shape)
  with tf.Graph().as_default():
    variables = {k: tf.Variable(v) for k, v in p.items()}
    xt = tf.constant(x)
    ys = _model(xt, tf.constant(ids), variables)
    only = forward_mode.jvp(ys, [variables["b1"], variables["emb"]],
                            [tf.constant(tangents["b1"]),
                             tf.constant(tangents["emb"])])
    wrt_x = forward_mode.jvp(ys[0], xt, tf.constant(tx))
    other = tf.constant(2.0, tf.float64)
    none, same = forward_mode.jvp([other, xt], xt, tf.constant(tx))
    assert none is None
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      got, got_x, got_same = sess.run([only, wrt_x, same])
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, **TOL)
  np.testing.assert_array_equal(got_same, tx)
  # d s / d x . tx against central differences of the model in x.
  eps = 1e-6
  plus, minus = (_model(tf.constant(x + s * eps * tx), tf.constant(ids),
                        {k: tf.constant(v) for k, v in p.items()})[0]
                 for s in (1, -1))
  np.testing.assert_allclose(got_x[0], (plus - minus).numpy() / (2 * eps),
                             rtol=1e-6, atol=1e-9)


def test_stop_gradients():
  with tf.Graph().as_default():
    x = tf.constant(RNG.randn(3))
    h = tf.sin(x)
    y = h * x
    (got,) = forward_mode.jvp(y, x, tf.ones(3, tf.float64),
                              stop_gradients=[h])
    (full,) = forward_mode.jvp(y, x, tf.ones(3, tf.float64))
    with tf.compat.v1.Session() as sess:
      g, f, xv = sess.run([got, full, x])
  np.testing.assert_allclose(g, np.sin(xv), rtol=1e-14)
  np.testing.assert_allclose(f, np.sin(xv) + xv * np.cos(xv), rtol=1e-14)


def test_no_dummy_backward_pass_runs():
  """With the batch size unknown until run time, the whole-graph double
  backward runs the dummy reverse pass (its Shape ops need it); op by op,
  no convolution or pooling gradient runs at all."""
  p = _params()
  tangents = {k: RNG.randn(*v.shape) for k, v in p.items()}
  x, ids = _inputs()
  backward_types = {"Conv2DBackpropInput", "Conv2DBackpropFilter",
                    "DepthwiseConv2dNativeBackpropInput",
                    "DepthwiseConv2dNativeBackpropFilter", "MaxPoolGrad"}
  executed = {}
  for name, method in (("op_by_op", forward_mode.jvp),
                       ("whole_graph", forward_gradients.whole_graph_jvp)):
    with tf.Graph().as_default():
      xp = tf.compat.v1.placeholder(tf.float64, (None, 8, 8, 3))
      ip = tf.compat.v1.placeholder(tf.int32, (None,))
      variables = {k: tf.Variable(v) for k, v in p.items()}
      ys = _model(xp, ip, variables)
      out = method(ys, [variables[k] for k in sorted(p)],
                   [tf.constant(tangents[k]) for k in sorted(p)])
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        meta = tf.compat.v1.RunMetadata()
        sess.run(out, {xp: x, ip: ids}, run_metadata=meta,
                 options=tf.compat.v1.RunOptions(
                     trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
      types = set()
      for dev in meta.step_stats.dev_stats:
        for node in dev.node_stats:
          if " = " in node.timeline_label:  # "name = Type(inputs)"
            types.add(node.timeline_label.split(" = ")[1].split("(")[0])
      assert "Conv2D" in types  # the trace lists op types
      executed[name] = types & backward_types
  assert not executed["op_by_op"], executed
  assert executed["whole_graph"], executed  # what the test guards against


def test_tf1_control_flow_falls_back_to_the_whole_graph():
  with tf.Graph().as_default():
    x = tf.constant(RNG.randn(3))
    pred = tf.constant(True)
    false_out, true_out = tf.raw_ops.Switch(data=tf.sin(x), pred=pred)
    y = tf.raw_ops.Merge(inputs=[false_out * 2.0, true_out * 3.0])[0]
    with pytest.raises(forward_mode.UnsupportedGraph, match="Switch"):
      forward_mode.jvp(y, x, tf.ones(3, tf.float64))
    (got,) = utils.fwd_gradients(y, x, grad_xs=tf.ones(3, tf.float64))
    with tf.compat.v1.Session() as sess:
      g, xv = sess.run([got, x])
  np.testing.assert_allclose(g, 3 * np.cos(xv), rtol=1e-14)


def test_reference_variables():
  """TF1 reference variables (use_resource=False) are graph tensors."""
  a = RNG.randn(4, 3)
  t = RNG.randn(4, 3)
  with tf.Graph().as_default():
    w = tf.compat.v1.Variable(a, use_resource=False)
    y = tf.reduce_sum(tf.tanh(w) * 2.0, axis=0)
    (got,) = forward_mode.jvp(y, w, tf.constant(t))
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      g = sess.run(got)
  np.testing.assert_allclose(g, (2 * (1 - np.tanh(a) ** 2) * t).sum(0),
                             rtol=1e-13)


def test_bad_arguments():
  with tf.Graph().as_default():
    x = tf.constant(1.0)
    with pytest.raises(ValueError, match="one tangent per x"):
      forward_mode.jvp(x * 2, [x, x], [tf.constant(1.0)])


def test_ops_without_a_rule_take_their_gradient_locally(monkeypatch):
  """The generic path calls an op's registered gradient function itself:
  tf.gradients from the op's inputs would first mark every op downstream of
  them (the rest of the network), so building the products op by op grew
  with the square of the depth. The only tf.gradients calls left
  differentiate the local gradient with respect to the dummy cotangents."""
  from kfac.python.ops.forward_mode import walk  # pylint: disable=g-import-not-at-top
  p = _params()
  tangents = {k: RNG.randn(*v.shape) for k, v in p.items()}
  x, ids = _inputs()
  xs_of_calls = []
  real = tf.gradients

  def spy(ys, xs, **kwargs):
    xs_of_calls.append(list(xs))
    return real(ys, xs, **kwargs)

  monkeypatch.setattr(walk.tf, "gradients", spy)
  with tf.Graph().as_default():
    variables = {k: tf.Variable(v) for k, v in p.items()}
    ys = _model(tf.constant(x), tf.constant(ids), variables)
    model_ops = set(tf.compat.v1.get_default_graph().get_operations())
    got = forward_mode.jvp(ys, [variables[k] for k in sorted(p)],
                           [tf.constant(tangents[k]) for k in sorted(p)])
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      got = sess.run(got)
  # MaxPool, ConcatV2, Sin, Square, Pack, Exp took the generic path; none
  # differentiated from a tensor of the model.
  assert len(xs_of_calls) >= 6, xs_of_calls
  for xs in xs_of_calls:
    assert not any(t.op in model_ops for t in xs), [t.name for t in xs]
  want = _reference(p, tangents, x, ids)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, **TOL)


def _record_generic_ops(monkeypatch):
  """The list the types of the ops that take forward mode's generic path
  are appended to from now on (walk._generic spied on)."""
  from kfac.python.ops.forward_mode import walk  # pylint: disable=g-import-not-at-top
  generic = []
  real = walk._generic  # pylint: disable=protected-access

  def spy(op, tangents):
    generic.append(op.type)
    return real(op, tangents)
  monkeypatch.setattr(walk, "_generic", spy)
  return generic


def test_batch_norm_takes_no_generic_path(monkeypatch):
  """Batch normalization as Keras 3 builds it (tf.nn.moments: StopGradient,
  SquaredDifference; Rsqrt) is walked by direct rules: no op of it builds
  the generic path's dummy, gradient and second derivative (on ResNet50
  318 of the 322 generic ops of the quadratic model's two products were
  these). Values against eager forward mode, float64."""
  generic = _record_generic_ops(monkeypatch)
  x = RNG.randn(6, 3, 3, 4)
  w0, g0 = RNG.randn(3, 3, 4, 4), 1.0 + 0.1 * RNG.randn(4)
  tw, tg = RNG.randn(*w0.shape), RNG.randn(*g0.shape)

  def bn(w, gamma):
    h = tf.nn.conv2d(tf.constant(x), w, 1, "SAME")
    mean, var = tf.nn.moments(h, axes=[0, 1, 2], keepdims=True)
    return tf.nn.relu((h - mean) * tf.math.rsqrt(var + 1e-3) * gamma)

  with tf.Graph().as_default():
    w, gamma = tf.Variable(w0), tf.Variable(g0)
    y = bn(w, gamma)
    ops = {op.type for op in tf.compat.v1.get_default_graph().get_operations()}
    assert {"StopGradient", "SquaredDifference", "Rsqrt"} <= ops, ops
    got = forward_mode.jvp(y, [w, gamma], [tf.constant(tw), tf.constant(tg)])
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      got = sess.run(got[0])
  assert generic == [], generic
  wv, gv = tf.Variable(w0), tf.Variable(g0)
  with tf.autodiff.ForwardAccumulator([wv, gv], [tf.constant(tw),
                                                 tf.constant(tg)]) as acc:
    want = acc.jvp(bn(wv, gv)).numpy()
  np.testing.assert_allclose(got, want, **TOL)


def _attention(x, p):
  """Keras-style attention: EinsumDense projections ("abc,cde->abde"),
  the score and context einsums of MultiHeadAttention, a softmax, the
  exact GELU (Erfc), an output projection ("abcd,cde->abe") and a
  one-input einsum."""
  q = tf.einsum("abc,cde->abde", x, p["wq"])
  k = tf.einsum("abc,cde->abde", x, p["wk"])
  v = tf.einsum("abc,cde->abde", x, p["wv"])
  scores = tf.nn.softmax(tf.einsum("aecd,abcd->acbe", k, q) * 0.5)
  ctx = tf.einsum("acbe,aecd->abcd", scores, v)
  out = tf.einsum("abcd,cde->abe", ctx, p["wo"])
  out = 0.5 * out * tf.math.erfc(-out / np.sqrt(2.0))
  return [out, tf.einsum("abc->acb", out), scores]


@pytest.mark.parametrize("world", ["graph", "function"])
def test_attention_ops_take_direct_rules(world, monkeypatch):
  """Einsum (one and two inputs), Softmax and Erfc have direct rules: no
  generic path runs for them, and the products equal TensorFlow's eager
  forward mode in float64."""
  generic = _record_generic_ops(monkeypatch)
  rng = np.random.RandomState(11)
  shapes = dict(wq=(6, 2, 3), wk=(6, 2, 3), wv=(6, 2, 3), wo=(2, 3, 6))
  p = {k: 0.5 * rng.randn(*s) for k, s in sorted(shapes.items())}
  tangents = {k: rng.randn(*v.shape) for k, v in p.items()}
  x = rng.randn(3, 5, 6)
  keys = sorted(p)
  variables = {k: tf.Variable(v) for k, v in p.items()}
  with tf.autodiff.ForwardAccumulator(
      [variables[k] for k in keys],
      [tf.constant(tangents[k]) for k in keys]) as acc:
    ys = _attention(tf.constant(x), variables)
  want = [acc.jvp(y).numpy() for y in ys]
  if world == "graph":
    with tf.Graph().as_default():
      gvars = {k: tf.Variable(v) for k, v in p.items()}
      out = forward_mode.jvp(_attention(tf.constant(x), gvars),
                             [gvars[k] for k in keys],
                             [tf.constant(tangents[k]) for k in keys])
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        got = sess.run(out)
  else:
    @tf.function
    def run():
      return forward_mode.jvp(_attention(tf.constant(x), variables),
                              [variables[k] for k in keys],
                              [tf.constant(tangents[k]) for k in keys])
    got = [g.numpy() for g in run()]
  assert not {"Einsum", "Softmax", "Erfc"} & set(generic), generic
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, **TOL)
  assert min(np.abs(w).max() for w in want) > 1e-2


def _convnet_ops(x, p):
  """The ops keras.applications convnets put on the products' path:
  zero, constant and mirror padding, ReLU6, LeakyReLU, ELU, tf.nn.silu
  (an IdentityN with a custom gradient), Keras 3's dropout (SelectV2 with
  a broadcast zero), a v1 Select and a plain IdentityN."""
  h = tf.pad(x, [[0, 0], [1, 1], [1, 1], [0, 0]])
  h = tf.nn.conv2d(h, p["w1"], 1, "VALID")
  h = tf.nn.relu6(3.0 * h)
  h = tf.pad(h, [[0, 0], [1, 0], [0, 1], [0, 0]], constant_values=0.25)
  h = tf.pad(h, [[0, 0], [1, 1], [1, 1], [0, 0]], mode="REFLECT")
  h = tf.nn.depthwise_conv2d(h, p["dw"], [1, 1, 1, 1], "VALID")
  h = tf.nn.silu(h) + tf.nn.leaky_relu(h, alpha=0.3)
  h = tf.nn.elu(h)
  masks = np.random.RandomState(0)  # the same masks on every call
  keep = tf.constant(masks.rand(*h.shape.as_list()) > 0.3)
  h = tf.where(keep, h / 0.7, tf.zeros([], h.dtype))           # SelectV2
  h = tf.reshape(h, [h.shape[0], -1])
  z = tf.matmul(h, p["w2"])
  rows = tf.constant(masks.rand(z.shape[0]) > 0.5)
  z = tf.compat.v1.where(rows, z, tf.sin(z))                   # Select
  z = tf.identity_n([z, 2.0 * z])[0]
  return [z, h]


@pytest.mark.parametrize("world", ["graph", "function"])
def test_convnet_ops_take_direct_rules(world, monkeypatch):
  """Pad, PadV2, MirrorPad, Relu6, LeakyRelu, Elu, Select, SelectV2 and
  IdentityN (plain, and tf.nn.silu's custom-gradient one) have direct
  rules: no generic path runs for them, and the products equal
  TensorFlow's eager forward mode in float64."""
  generic = _record_generic_ops(monkeypatch)
  rng = np.random.RandomState(5)
  shapes = dict(w1=(3, 3, 2, 3), dw=(2, 2, 3, 1), w2=(3 * 8 * 8, 4))
  p = {k: 0.5 * rng.randn(*s) for k, s in sorted(shapes.items())}
  tangents = {k: rng.randn(*v.shape) for k, v in p.items()}
  x = rng.randn(3, 6, 6, 2)
  keys = sorted(p)
  variables = {k: tf.Variable(v) for k, v in p.items()}
  with tf.autodiff.ForwardAccumulator(
      [variables[k] for k in keys],
      [tf.constant(tangents[k]) for k in keys]) as acc:
    ys = _convnet_ops(tf.constant(x), variables)
  want = [acc.jvp(y).numpy() for y in ys]
  if world == "graph":
    with tf.Graph().as_default():
      gvars = {k: tf.Variable(v) for k, v in p.items()}
      ys = _convnet_ops(tf.constant(x), gvars)
      types = {op.type for op in
               tf.compat.v1.get_default_graph().get_operations()}
      out = forward_mode.jvp(ys, [gvars[k] for k in keys],
                             [tf.constant(tangents[k]) for k in keys])
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        got = sess.run(out)
    assert {"Pad", "PadV2", "MirrorPad", "Relu6", "LeakyRelu", "Elu",
            "Select", "SelectV2", "IdentityN"} <= types, types
  else:
    @tf.function
    def run():
      return forward_mode.jvp(_convnet_ops(tf.constant(x), variables),
                              [variables[k] for k in keys],
                              [tf.constant(tangents[k]) for k in keys])
    got = [g.numpy() for g in run()]
  # (The RealDiv and Sin have no direct rule.)
  direct = {"Pad", "PadV2", "MirrorPad", "Relu6", "LeakyRelu", "Elu",
            "Select", "SelectV2", "IdentityN"}
  assert not direct & set(generic), generic
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, **TOL)
  assert min(np.abs(w).max() for w in want) > 1e-2


def test_custom_gradient_identity_n_follows_its_gradient(monkeypatch):
  """A custom-gradient IdentityN that is not silu's keeps the generic
  path, which pushes the tangent through the custom gradient, what
  backpropagation (and so the gradient K-FAC preconditions) uses: here
  twice the derivative of the forward ops. (TensorFlow's eager forward
  mode follows the forward ops instead.) A check that the silu rule's
  condition is not too wide."""
  @tf.custom_gradient
  def doubled_grad(h):
    return tf.sin(h), lambda dy: 2.0 * tf.cos(h) * dy

  generic = _record_generic_ops(monkeypatch)
  with tf.Graph().as_default():
    w = tf.Variable(np.array([0.3, -1.2]))
    out = forward_mode.jvp([doubled_grad(w * 1.5)], [w],
                           [tf.constant([1.0, 2.0], tf.float64)])
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      got = sess.run(out[0])
  want = 2.0 * np.cos(1.5 * np.array([0.3, -1.2])) * 1.5 * np.array([1, 2])
  np.testing.assert_allclose(got, want, **TOL)
  assert generic.count("IdentityN") == 1, generic


@pytest.mark.parametrize("world", ["graph", "function"])
def test_silu_rule_with_a_beta_tangent(world, monkeypatch):
  """tf.nn.silu(h, beta) with a trainable beta: the rule's dbeta term
  (x^2 s (1 - s)) and dx term, against eager forward mode in float64, no
  generic path."""
  generic = _record_generic_ops(monkeypatch)
  rng = np.random.RandomState(2)
  x = rng.randn(5, 3)
  w0, b0 = rng.randn(3, 3), np.array(1.7)
  tw, tb = tf.constant(rng.randn(3, 3)), tf.constant(-0.8, tf.float64)

  def f(w, b):
    return tf.nn.silu(tf.matmul(tf.constant(x), w), beta=b)

  wv, bv = tf.Variable(w0), tf.Variable(b0)
  with tf.autodiff.ForwardAccumulator([wv, bv], [tw, tb]) as acc:
    want = acc.jvp(f(wv, bv)).numpy()
  if world == "graph":
    with tf.Graph().as_default():
      gw, gb = tf.Variable(w0), tf.Variable(b0)
      out = forward_mode.jvp([f(gw, gb)], [gw, gb],
                             [tf.constant(tw.numpy()),
                              tf.constant(tb.numpy())])
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        got = sess.run(out[0])
  else:
    got = tf.function(lambda: forward_mode.jvp([f(wv, bv)], [wv, bv],
                                               [tw, tb])[0])().numpy()
  assert "IdentityN" not in generic, generic
  np.testing.assert_allclose(got, want, **TOL)
