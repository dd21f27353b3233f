"""Grouped convolutions (register_grouped_convolution, "kron": KFC
block-diagonal over groups) and separable convolutions
(register_separable_conv2d: depthwise block + pointwise KFC block) against
float64 references.

References (never kfac code): patches by numpy loops
(conv_factors_test.np_patches) of each group's input channels, output
gradients from a GradientTape, exact Fisher blocks from per-example tape
Jacobians (reference.py), damped products from dense numpy matrices
(per group: L * pi_damped_kron(A_j, G_j, damping / L)). The grouped
convolution is computed as G convolutions of channel slices, concatenated
(TensorFlow's CPU kernels have no grouped convolution). Tolerances as in
conv_blocks_test: 1e-9 relative / 1e-12 absolute for identities, 1e-8 /
1e-11 through inverses and matrix powers.
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import conv_blocks_test as cbt
from kfac.python.kernel_tests import conv_factors_test as cft
from kfac.python.kernel_tests import reference as ref
from kfac.python.ops.layers.conv import blocks as conv_blocks
from kfac.python.ops.layers.conv import grouped

TOL = cbt.TOL
PTOL = cbt.PTOL


class Grouped:
  """A grouped conv [k.., C/G, O] + bias [O], NHWC, stride 1."""

  def __init__(self, x_shape, kernel, out, groups, padding, dilations=(1, 1)):
    self.x_shape, self.kernel, self.out = x_shape, kernel, out
    self.groups, self.padding, self.dilations = groups, padding, dilations
    self.cg = x_shape[-1] // groups
    self.og = out // groups

  def inits(self, seed):
    rng = np.random.RandomState(seed)
    return [0.5 * rng.randn(*(self.kernel + (self.cg, self.out))),
            0.2 * rng.randn(self.out)]

  def apply(self, vs, x):
    # One split of the filter (the registration check counts the ops
    # reading a variable).
    ys = [tf.nn.convolution(xj, wj, padding=self.padding,
                            dilations=list(self.dilations))
          for xj, wj in zip(tf.split(x, self.groups, axis=-1),
                            tf.split(vs[0], self.groups, axis=-1))]
    return tf.concat(ys, axis=-1) + vs[1]

  def register_layer(self, lc, vs, x, pre, approx=None):
    return lc.register_grouped_convolution(
        (vs[0], vs[1]), x, pre, self.padding, self.groups, strides=1,
        dilation_rate=list(self.dilations), approx=approx)

  def param_positions(self, j):
    """Flat (filter, bias) indices of group j, in the (row, output) order
    of its Kronecker block (bias row last)."""
    rows = int(np.prod(self.kernel)) * self.cg
    cols = [j * self.og + m for m in range(self.og)]
    filt = [r * self.out + o for r in range(rows) for o in cols]
    return filt + [rows * self.out + o for o in cols]

  def group_patches(self, x, j):
    p = cft.np_patches(x[..., j * self.cg:(j + 1) * self.cg], self.kernel,
                       (1, 1), self.dilations, self.padding)
    return p.reshape(-1, p.shape[-1])


def _build(layer, x, labels, approx=None, register=None):
  def build_model(lc, vs):
    xt = tf.constant(x)
    pre = layer.apply(vs, xt)
    block = (register or layer.register_layer)(lc, vs, xt, pre, approx)
    build_model.blocks.append(block)
    lc.register_softmax_cross_entropy_loss(cbt.forward_from_pre(pre),
                                           targets=tf.constant(labels))
  build_model.blocks = []
  return build_model


def _output_grads(layer, inits, x, labels):
  vs = [tf.constant(v) for v in inits]
  pre = layer.apply(vs, tf.constant(x))
  with tf.GradientTape() as tape:
    tape.watch(pre)
    loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.constant(labels), logits=cbt.forward_from_pre(pre)))
  g = tape.gradient(loss, pre).numpy()
  return g.reshape(-1, g.shape[-1])


@pytest.mark.parametrize("world,groups", [("graph", 1), ("graph", 2),
                                          ("function", 2)])
def test_grouped_kron_factors_and_products(world, groups):
  """A_j, G_j equal the brute-force per-group expectations over examples
  and locations; the block is blockdiag_j L (A_j (x) G_j); its damped
  powers and Cholesky factors equal the dense per-group pi-damped
  Kronecker matrix's."""
  layer = Grouped((3, 4, 4, 4), (2, 1), 4, groups, "SAME")
  inits, x = layer.inits(40), np.random.RandomState(41).randn(*layer.x_shape)
  labels = np.random.RandomState(42).randint(0, 3, len(x))
  damping, exps = 0.05, (-1, -0.5, 2)
  build_model = _build(layer, x, labels)
  out = cbt.run_estimator(
      world, inits, build_model, "empirical", damping=damping, exps=exps,
      extra=lambda est, vs: cbt._product_fetches(est, vs, exps, 43),
      compute_cholesky=True, compute_cholesky_inverse=True)
  assert isinstance(build_model.blocks[0], grouped.GroupedConvKFCBasicFB)
  g = _output_grads(layer, inits, x, labels)
  a, gg = out["factors"][0]
  assert a.shape == (groups, 2 * layer.cg + 1, 2 * layer.cg + 1)
  assert gg.shape == (groups, layer.og, layer.og)
  num_locs = 16
  n = sum(int(np.prod(v.shape)) for v in inits)
  dense, block = np.zeros((n, n)), np.zeros((n, n))
  for j in range(groups):
    a_j = cft.mean_outer(cft.with_ones(layer.group_patches(x, j)))
    g_j = cft.mean_outer(g[:, j * layer.og:(j + 1) * layer.og])
    np.testing.assert_allclose(a[j], a_j, **TOL)
    np.testing.assert_allclose(gg[j], g_j, **TOL)
    idx = np.array(layer.param_positions(j))
    block[np.ix_(idx, idx)] = num_locs * np.kron(a_j, g_j)
    dense[np.ix_(idx, idx)] = num_locs * ref.pi_damped_kron(
        a_j, g_j, damping / num_locs)
  np.testing.assert_allclose(out["blocks"][0], block, **TOL)
  ex = out["extra"]
  vec = ref.flat(ex["vecs"])
  for e in (1,) + exps:
    np.testing.assert_allclose(ref.flat(ex["pow%s" % e]),
                               ref.sym_matpower(dense, e) @ vec, **PTOL)
  cbt._check_cholesky_fetches(ex, dense)


def test_grouped_with_one_group_equals_the_kfc_block():
  """groups=1: the same factors, block and products as register_conv2d's
  ConvKFCBasicFB on the same layer."""
  layer = Grouped((3, 4, 4, 2), (2, 2), 3, 1, "VALID")
  inits, x = layer.inits(44), np.random.RandomState(45).randn(*layer.x_shape)
  labels = np.random.RandomState(46).randint(0, 3, len(x))
  exps = (-1, -0.5)

  def plain(lc, vs, xt, pre, approx):
    return lc.register_conv2d((vs[0], vs[1]), 1, "VALID", xt, pre)

  outs = []
  for register in (None, plain):
    build_model = _build(layer, x, labels, register=register)
    outs.append(cbt.run_estimator(
        "graph", inits, build_model, "empirical", damping=0.03, exps=exps,
        extra=lambda est, vs: cbt._product_fetches(est, vs, exps, 47),
        compute_cholesky=True, compute_cholesky_inverse=True))
    outs[-1]["type"] = type(build_model.blocks[0])
  assert outs[0]["type"] is grouped.GroupedConvKFCBasicFB
  assert outs[1]["type"] is conv_blocks.ConvKFCBasicFB
  np.testing.assert_allclose(outs[0]["factors"][0][0][0],
                             outs[1]["factors"][0][0], **TOL)
  np.testing.assert_allclose(outs[0]["factors"][0][1][0],
                             outs[1]["factors"][0][1], **TOL)
  np.testing.assert_allclose(outs[0]["blocks"][0], outs[1]["blocks"][0],
                             **TOL)
  for key in ["pow1"] + ["pow%s" % e for e in exps] + ["c_v", "cinv_c_v"]:
    np.testing.assert_allclose(ref.flat(outs[0]["extra"][key]),
                               ref.flat(outs[1]["extra"][key]), **PTOL)


def test_grouped_blocks_are_exact_for_one_location():
  """One example, one output location, "exact" mode: each group's block is
  exactly the exact Fisher's block of that group's parameters (from
  per-example Jacobians); cross-group blocks are zero."""
  layer = Grouped((1, 2, 2, 4), (2, 2), 4, 2, "VALID")
  inits, x = layer.inits(48), np.random.RandomState(49).randn(*layer.x_shape)
  forward = lambda vs, xs: (cbt.forward_from_pre(layer.apply(vs, xs)), None)
  out = cbt.run_estimator("graph", inits, _build(layer, x, [1]), "exact")
  exact = cbt.exact_fisher(forward, inits, x)
  want = np.zeros_like(exact)
  for j in range(layer.groups):
    idx = np.array(layer.param_positions(j))
    want[np.ix_(idx, idx)] = exact[np.ix_(idx, idx)]
  np.testing.assert_allclose(out["blocks"][0], want, **TOL)


def _var(shape, name):
  return tf.Variable(np.zeros(shape), name=name)


def test_grouped_registration_errors_name_the_filter():
  with tf.Graph().as_default():
    lc = kfac.LayerCollection()
    w = _var([2, 2, 2, 4], "gconv_w")
    x = tf.zeros([3, 4, 4, 4], tf.float64)
    y = tf.zeros([3, 3, 3, 4], tf.float64)
    cases = [
        (dict(groups=3), "not divisible by groups=3"),
        (dict(groups=0), "groups must be a positive int"),
        (dict(groups=2.5), "groups must be a positive int"),
        (dict(groups=4), "expects 8 input channels"),
        (dict(groups=2, approx="diagonal"), "Unknown approximation"),
    ]
    for kwargs, message in cases:
      with pytest.raises(ValueError, match=message) as info:
        lc.register_grouped_convolution(w, x, y, "VALID", **kwargs)
      assert "gconv_w" in str(info.value) or "approximation" in message
    with pytest.raises(ValueError, match="gconv_w.*spatial shape"):
      lc.register_grouped_convolution(w, x, tf.zeros([3, 4, 4, 4],
                                                     tf.float64), "VALID", 2)


# ------------------------------------------------- separable conv
class Separable:
  """Depthwise [k, k, C, M] then a 1x1 pointwise conv [1, 1, C*M, O] +
  bias [O], NHWC: tf.nn.separable_conv2d's two convolutions."""

  def __init__(self, x_shape, kernel, mult, out, padding, rate=(1, 1)):
    self.x_shape, self.kernel, self.mult, self.out = x_shape, kernel, mult, out
    self.padding, self.rate = padding, rate
    self.mid = x_shape[-1] * mult

  def inits(self, seed):
    rng = np.random.RandomState(seed)
    return [0.5 * rng.randn(*(self.kernel + (self.x_shape[-1], self.mult))),
            0.5 * rng.randn(1, 1, self.mid, self.out),
            0.2 * rng.randn(self.out)]

  def both(self, vs, x):
    mid = cbt.depthwise_apply(x, vs[0], None, (1, 1), self.rate,
                              self.padding)
    return mid, tf.nn.conv2d(mid, vs[1], 1, "VALID") + vs[2]


@pytest.mark.parametrize("world", ref.WORLDS)
def test_separable_pair_of_blocks(world):
  """Default approximations, "empirical" mode: the depthwise block is the
  exact diagonal of the empirical Fisher of the depthwise filter (brute
  force: mean over examples of the squared per-example loss gradients) and
  the pointwise block is KFC on the depthwise outputs: A = mean p p^T of the
  1x1 patches (the depthwise outputs) with the bias entry, G = mean g g^T
  of the gradients of the pointwise outputs (tape), block 16 A (x) G; the
  inverse of the pair is the diagonal inverse and the pi-damped Kronecker
  inverse."""
  sep = Separable((3, 4, 4, 2), (2, 2), 2, 3, "SAME")
  inits = sep.inits(50)
  rng = np.random.RandomState(51)
  x = rng.randn(*sep.x_shape)
  labels = rng.randint(0, 3, len(x))
  damping = 0.05
  blocks = []

  def build_model(lc, vs):
    xt = tf.constant(x)
    mid, pre = sep.both(vs, xt)
    blocks.extend(lc.register_separable_conv2d(
        vs[0], (vs[1], vs[2]), xt, mid, pre, 1, "SAME"))
    lc.register_softmax_cross_entropy_loss(cbt.forward_from_pre(pre),
                                           targets=tf.constant(labels))

  def extra(est, vs):
    v = cbt._random_vectors(vs, 52)
    return {"vecs": v,
            "inv": [r for r, _ in est.multiply_inverse(list(zip(v, vs)))]}

  out = cbt.run_estimator(world, inits, build_model, "empirical",
                          damping=damping, extra=extra)
  # (a tf.function traces the build twice: the last registration)
  assert [type(b).__name__ for b in blocks[-2:]] == ["DepthwiseConvDiagonalFB",
                                                     "ConvKFCBasicFB"]
  # Depthwise: the empirical Fisher's diagonal.
  def loss_fn(logits, n):
    return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.constant(labels[n:n + 1]), logits=logits))
  grads = ref.per_example_loss_grads(
      lambda vs, xs: cbt.forward_from_pre(sep.both(vs, xs)[1]), inits, x,
      loss_fn)
  n_dw = inits[0].size
  np.testing.assert_allclose(np.diag(out["blocks"][0]),
                             np.mean(grads[:, :n_dw]**2, axis=0), **TOL)
  # Pointwise KFC factors against brute force.
  vs = [tf.constant(v) for v in inits]
  mid, pre = sep.both(vs, tf.constant(x))
  a_want = cft.mean_outer(cft.with_ones(mid.numpy().reshape(-1, sep.mid)))
  with tf.GradientTape() as tape:
    tape.watch(pre)
    loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.constant(labels), logits=cbt.forward_from_pre(pre)))
  g_want = cft.mean_outer(tape.gradient(loss, pre).numpy().reshape(
      -1, sep.out))
  a, g = out["factors"][1]
  np.testing.assert_allclose(a, a_want, **TOL)
  np.testing.assert_allclose(g, g_want, **TOL)
  num_locs = 16
  np.testing.assert_allclose(out["blocks"][1],
                             num_locs * np.kron(a_want, g_want), **TOL)
  dense_pw = num_locs * ref.pi_damped_kron(a_want, g_want,
                                           damping / num_locs)
  dw_diag = np.diag(out["blocks"][0]) + damping
  ex = out["extra"]
  v = ref.flat(ex["vecs"])
  want = np.concatenate([v[:n_dw] / dw_diag,
                         np.linalg.solve(dense_pw, v[n_dw:])])
  np.testing.assert_allclose(ref.flat(ex["inv"]), want, **PTOL)
