"""Convolution blocks and their registration against float64 references.

References (never kfac code): exact Fisher / GGN blocks from per-example
tape Jacobians (reference.py); KFC factors from patches extracted by numpy
loops (conv_factors_test.np_patches) and output gradients from a
GradientTape; damped products from dense numpy matrices
(L * pi_damped_kron(A, G, damping / L)). Tolerances: 1e-9 relative /
1e-12 absolute for exact identities, 1e-8 / 1e-11 for products through
inverses and matrix powers.
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import conv_factors_test as cft
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref
from kfac.python.ops.layers.conv import blocks as conv_blocks

WORLDS = ref.WORLDS


def worlds_for(names, both):
  """(world, name) pairs: both worlds for the names in `both`, the graph
  world for the others. Tracing a tf.function (twice: it creates state
  variables) costs ~10x a TF1 graph here, so the function world covers one
  case of each identity that has code of its own: kron (NCHW), diagonal,
  SUA products, reduce/expand exactness, depthwise kron, multi-use."""
  return [(w, n) for n in names for w in (WORLDS if n in both else
                                          ("graph",))]
TOL = dict(rtol=1e-9, atol=1e-12)
PTOL = dict(rtol=1e-8, atol=1e-11)

_FIRST = ("NCW", "NCHW", "NCDHW")


# ------------------------------------------------------------ models
def conv_apply(x, w, b, strides, dilations, padding, data_format=None):
  """tf.nn.convolution (+ bias) in channels-last; channels-first tensors
  are transposed around it (CPU kernels are NHWC only)."""
  rank = len(x.shape)
  first = data_format in _FIRST
  if first:
    x = tf.transpose(x, [0] + list(range(2, rank)) + [1])
  y = tf.nn.convolution(x, w, strides=list(strides), padding=padding,
                        dilations=list(dilations))
  if b is not None:
    y = y + b
  if first:
    y = tf.transpose(y, [0, rank - 1] + list(range(1, rank - 1)))
  return y


class Conv:
  """A conv layer configuration for the tests."""

  def __init__(self, x_shape, kernel, out, strides, dilations, padding,
               bias=True, data_format=None, register="conv2d"):
    self.x_shape = x_shape  # channels-last
    self.kernel, self.out = kernel, out
    self.strides, self.dilations, self.padding = strides, dilations, padding
    self.bias, self.data_format, self.register = bias, data_format, register

  @property
  def first(self):
    return self.data_format in _FIRST

  def inits(self, seed):
    rng = np.random.RandomState(seed)
    w = 0.5 * rng.randn(*(self.kernel + (self.x_shape[-1], self.out)))
    return [w, 0.2 * rng.randn(self.out)] if self.bias else [w]

  def data(self, seed):
    x = np.random.RandomState(seed).randn(*self.x_shape)
    return np.moveaxis(x, -1, 1) if self.first else x

  def channels_last(self, x):
    return np.moveaxis(x, 1, -1) if self.first else x

  def apply(self, vs, x):
    b = vs[1] if self.bias else None
    return conv_apply(x, vs[0], b, self.strides, self.dilations,
                      self.padding, self.data_format)

  def params(self, vs):
    return (vs[0], vs[1]) if self.bias else vs[0]

  def register_layer(self, lc, vs, x, pre, approx=None, **kwargs):
    params = self.params(vs)
    if self.register == "conv2d":
      return lc.register_conv2d(params, self.strides, self.padding, x, pre,
                                data_format=self.data_format,
                                dilations=self.dilations, approx=approx,
                                **kwargs)
    if self.register == "conv1d":
      return lc.register_conv1d(params, self.strides, self.padding, x, pre,
                                dilations=self.dilations, approx=approx,
                                data_format=self.data_format, **kwargs)
    return lc.register_convolution(params, x, pre, self.padding,
                                   strides=self.strides,
                                   dilation_rate=self.dilations,
                                   data_format=self.data_format,
                                   approx=approx, **kwargs)

  def hand_a(self, x, mask=None):
    p = cft.np_patches(self.channels_last(x), self.kernel, self.strides,
                       self.dilations, self.padding)
    p = p.reshape(-1, p.shape[-1])
    if mask is not None:
      p = p * mask.reshape(-1)
    return cft.mean_outer(cft.with_ones(p) if self.bias else p)


def head(num_in, classes=3, seed=99):
  return tf.constant(0.3 * np.random.RandomState(seed).randn(num_in, classes))


def forward_from_pre(pre):
  """tanh, flatten, a fixed dense layer to 3 logits."""
  flat = tf.reshape(tf.tanh(pre), [tf.shape(pre)[0], -1])
  return tf.matmul(flat, head(int(np.prod(pre.shape[1:]))))


def categorical_model(conv):
  """forward(vs, x) -> (logits, pre)."""

  def forward(vs, x):
    pre = conv.apply(vs, x)
    return forward_from_pre(pre), pre

  return forward


def exact_fisher(forward, inits, x):
  logits_fn = lambda vs, xs: forward(vs, xs)[0]
  jacs = ref.per_example_jacobians(logits_fn, inits, x)
  logits = ref.outputs(logits_fn, inits, x)
  return ref.curvature(jacs, [ref.categorical_fisher(z) for z in logits])


def exact_ggn_squared_error(forward, inits, x):
  jacs = ref.per_example_jacobians(forward, inits, x)
  return ref.curvature(jacs, [2.0 * np.eye(j.shape[0]) for j in jacs])


def tape_output_grads(forward, inits, x, labels):
  """d (summed softmax cross-entropy) / d pre, channels-last [N*L, O]."""
  vs = [tf.constant(v) for v in inits]
  _, pre = forward(vs, tf.constant(x))
  with tf.GradientTape() as tape:
    tape.watch(pre)
    loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.constant(labels), logits=forward_from_pre(pre)))
  return tape.gradient(loss, pre).numpy()


def run_estimator(world, inits, build_model, mode, damping=1e-2, exps=(-1,),
                  extra=None, **est_kwargs):
  """Registers via build_model(lc, vs) and fetches the blocks' factors and
  full blocks (+ extra(est, vs) if given)."""
  store = util.new_store()

  def build(vs):
    lc = kfac.LayerCollection()
    build_model(lc, vs)
    est, ops = util.estimator_stages(store, lc, vs, mode, damping=damping,
                                     exps=exps, **est_kwargs)
    fetch = {
        "blocks": [tf.identity(b.full_fisher_block()) for b in est.blocks],
        "factors": [[tf.identity(f.get_cov()) for f in b.factors()]
                    for b in est.blocks],
    }
    if extra is not None:
      fetch["extra"] = extra(est, vs)
    return ops + [fetch]

  return ref.run_stages(world, inits, build)[-1]


def layer_block(conv, fisher):
  n = sum(int(np.prod(s)) for s in
          [conv.kernel + (conv.x_shape[-1], conv.out)] +
          ([(conv.out,)] if conv.bias else []))
  return fisher[:n, :n]


# ------------------------------------------------- exact diagonal
DIAG_CONFIGS = {
    "2d_stride2_same": Conv((4, 5, 5, 2), (3, 3), 3, (2, 2), (1, 1), "SAME"),
    "2d_nchw_dilation2": Conv((3, 5, 6, 2), (2, 2), 2, (1, 1), (2, 2),
                              "VALID", data_format="NCHW"),
}


@pytest.mark.parametrize("world,name", worlds_for(
    sorted(DIAG_CONFIGS), both=("2d_stride2_same",)))
def test_diagonal_equals_exact_fisher_diagonal(world, name):
  conv = DIAG_CONFIGS[name]
  inits, x = conv.inits(1), conv.data(2)
  labels = np.random.RandomState(3).randint(0, 3, len(x))
  forward = categorical_model(conv)

  def build_model(lc, vs):
    xt = tf.constant(x)
    logits, pre = forward(vs, xt)
    block = conv.register_layer(lc, vs, xt, pre, approx="diagonal")
    assert isinstance(block, kfac.fisher_blocks.ConvDiagonalFB)
    lc.register_softmax_cross_entropy_loss(logits,
                                           targets=tf.constant(labels))

  out = run_estimator(world, inits, build_model, "exact")
  want = np.diag(exact_fisher(forward, inits, x))
  got = out["blocks"][0]
  np.testing.assert_allclose(np.diag(got), want, **TOL)
  assert np.count_nonzero(got - np.diag(np.diag(got))) == 0


# ------------------------------------------------- KFC by hand
KRON_CONFIGS = {
    "2d_stride2_same_bias": Conv((3, 5, 6, 2), (3, 3), 3, (2, 2), (1, 1),
                                 "SAME"),
    "2d_dilation2_valid_nobias": Conv((2, 6, 6, 2), (2, 3), 2, (1, 1),
                                      (2, 2), "VALID", bias=False),
    "2d_nchw_stride2_valid": Conv((2, 5, 5, 2), (2, 2), 3, (2, 2), (1, 1),
                                  "VALID", data_format="NCHW"),
    "1d_stride2_same": Conv((3, 7, 2), (3,), 2, (2,), (1,), "SAME",
                            register="conv1d"),
    "3d_dilation2_valid": Conv((2, 5, 4, 4, 2), (2, 2, 2), 2, (1, 1, 1),
                               (2, 1, 1), "VALID", register="convolution"),
}


@pytest.mark.parametrize("world,name", worlds_for(
    sorted(KRON_CONFIGS), both=("2d_nchw_stride2_valid",)))
def test_kron_equals_hand_kfc_formula(world, name):
  conv = KRON_CONFIGS[name]
  inits, x = conv.inits(4), conv.data(5)
  labels = np.random.RandomState(6).randint(0, 3, len(x))
  forward = categorical_model(conv)

  def build_model(lc, vs):
    xt = tf.constant(x)
    logits, pre = forward(vs, xt)
    block = conv.register_layer(lc, vs, xt, pre)
    assert type(block) is kfac.fisher_blocks.ConvKFCBasicFB  # pylint: disable=unidiomatic-typecheck
    lc.register_softmax_cross_entropy_loss(logits,
                                           targets=tf.constant(labels))

  out = run_estimator(world, inits, build_model, "empirical")
  a_want = conv.hand_a(x)
  g = tape_output_grads(forward, inits, x, labels)
  g = conv.channels_last(g)
  num_locs = int(np.prod(g.shape[1:-1]))
  g_want = cft.mean_outer(g.reshape(-1, conv.out))
  a, gg = out["factors"][0]
  np.testing.assert_allclose(a, a_want, **TOL)
  np.testing.assert_allclose(gg, g_want, **TOL)
  np.testing.assert_allclose(out["blocks"][0],
                             num_locs * np.kron(a_want, g_want), **TOL)


# ------------------------------------------------- products
def _random_vectors(vs, seed):
  rng = np.random.RandomState(seed)
  return [tf.constant(rng.randn(*v.shape)) for v in vs]


def _product_fetches(est, vs, exps, seed):
  """Products of random vectors with the damped block, its powers and its
  Cholesky factors (C, C^T, C^-1)."""
  vecs = _random_vectors(vs, seed)
  pairs = list(zip(vecs, vs))
  other = _random_vectors(vs, seed + 1)
  fetch = {"vecs": vecs, "other": other,
           "pow1": [r for r, _ in est.multiply(pairs)]}
  for e in exps:
    fetch["pow%s" % e] = [r for r, _ in est.multiply_matpower(e, pairs)]
  chol_t = est.multiply_cholesky(pairs, transpose=True)
  fetch["c_ct_v"] = [r for r, _ in est.multiply_cholesky(chol_t)]
  fetch["c_v"] = [r for r, _ in est.multiply_cholesky(pairs)]
  fetch["ct_u"] = [r for r, _ in est.multiply_cholesky(
      list(zip(other, vs)), transpose=True)]
  fetch["cinv_c_v"] = [r for r, _ in est.multiply_cholesky_inverse(
      est.multiply_cholesky(pairs))]
  return fetch


def _check_cholesky_fetches(out, dense):
  v, u = ref.flat(out["vecs"]), ref.flat(out["other"])
  np.testing.assert_allclose(ref.flat(out["c_ct_v"]), dense @ v, **PTOL)
  np.testing.assert_allclose(u @ ref.flat(out["c_v"]),
                             ref.flat(out["ct_u"]) @ v, **PTOL)
  np.testing.assert_allclose(ref.flat(out["cinv_c_v"]), v, **PTOL)


@pytest.mark.parametrize("world,approx", worlds_for(
    ["kron", "kron_sua", "kron_reduce"], both=("kron_sua",)))
def test_products_equal_dense_pi_damped_block(world, approx):
  conv = Conv((3, 4, 4, 2), (2, 1), 2, (1, 1), (1, 1), "SAME")
  inits, x = conv.inits(7), conv.data(8)
  labels = np.random.RandomState(9).randint(0, 3, len(x))
  forward = categorical_model(conv)
  damping, exps = 0.03, (-1, -0.5, 2)

  def build_model(lc, vs):
    xt = tf.constant(x)
    logits, pre = forward(vs, xt)
    conv.register_layer(lc, vs, xt, pre, approx=approx)
    lc.register_softmax_cross_entropy_loss(logits,
                                           targets=tf.constant(labels))

  def extra(est, vs):
    inv_vars = [v for vs in est.get_inv_vars() for v in vs]
    assert inv_vars and all(isinstance(v, tf.Variable) for v in inv_vars)
    return _product_fetches(est, vs, exps, 10)

  out = run_estimator(world, inits, build_model, "exact", damping=damping,
                      exps=exps, extra=extra, compute_cholesky=True,
                      compute_cholesky_inverse=True)
  a, g = out["factors"][0]
  if approx == "kron_sua":
    np.testing.assert_allclose(a, cft.sua_input_factor(x, 2, True), **TOL)
  coeff = 1 if approx == "kron_reduce" else 16  # L = 4 x 4 (SAME, stride 1)
  np.testing.assert_allclose(out["blocks"][0], coeff * np.kron(a, g), **TOL)
  dense = coeff * ref.pi_damped_kron(a, g, damping / coeff)
  extra_out = out["extra"]
  vec = ref.flat(extra_out["vecs"])
  for e in (1,) + exps:
    got = ref.flat(extra_out["pow%s" % e])
    np.testing.assert_allclose(got, ref.sym_matpower(dense, e) @ vec, **PTOL)
  _check_cholesky_fetches(extra_out, dense)


# ------------------------------------------------- 1x1 output == dense
@pytest.mark.parametrize("world", ["graph"])
def test_conv_with_one_output_location_equals_dense_block(world):
  conv = Conv((4, 3, 3, 2), (3, 3), 4, (1, 1), (1, 1), "VALID")
  inits, x = conv.inits(11), conv.data(12)
  labels = np.random.RandomState(13).randint(0, 3, len(x))
  forward = categorical_model(conv)
  damping = 0.02

  def extra(est, vs):
    vecs = _random_vectors(vs, 14)
    return {"vecs": vecs, "inv": [r for r, _ in est.multiply_inverse(
        list(zip(vecs, vs)))]}

  def conv_model(lc, vs):
    xt = tf.constant(x)
    logits, pre = forward(vs, xt)
    conv.register_layer(lc, vs, xt, pre)
    lc.register_softmax_cross_entropy_loss(logits,
                                           targets=tf.constant(labels))

  def dense_model(lc, vs):
    xt = tf.reshape(tf.constant(x), [len(x), -1])
    pre = tf.matmul(xt, vs[0]) + vs[1]
    logits = forward_from_pre(tf.reshape(pre, [-1, 1, 1, 4]))
    lc.register_fully_connected((vs[0], vs[1]), xt, pre)
    lc.register_softmax_cross_entropy_loss(logits,
                                           targets=tf.constant(labels))

  got = run_estimator(world, inits, conv_model, "exact", damping, extra=extra)
  dense_inits = [inits[0].reshape(-1, conv.out), inits[1]]
  want = run_estimator(world, dense_inits, dense_model, "exact", damping,
                       extra=extra)
  np.testing.assert_allclose(got["blocks"][0], want["blocks"][0], **TOL)
  np.testing.assert_allclose(ref.flat(got["extra"]["inv"]),
                             ref.flat(want["extra"]["inv"]), **PTOL)
  assert got["blocks"][0].shape == (conv.out * 19, conv.out * 19)


# ------------------------------------------------- exactness: expand/reduce
@pytest.mark.parametrize("world", WORLDS)
def test_kron_reduce_is_exact_for_linear_conv_with_global_pooling(world):
  conv = Conv((4, 4, 5, 2), (2, 3), 3, (1, 2), (1, 1), "SAME")
  inits, x = conv.inits(15), conv.data(16)
  head_np = np.random.RandomState(17).randn(3, 2)
  targets = np.random.RandomState(18).randn(4, 2)

  def forward(vs, xs):
    pooled = tf.reduce_mean(conv.apply(vs, xs), axis=[1, 2])
    return tf.matmul(pooled, tf.constant(head_np))

  def build_model(lc, vs):
    xt = tf.constant(x)
    pre = conv.apply(vs, xt)
    pred = tf.matmul(tf.reduce_mean(pre, axis=[1, 2]), tf.constant(head_np))
    conv.register_layer(lc, vs, xt, pre, approx="kron_reduce")
    lc.register_squared_error_loss(pred, targets=tf.constant(targets))

  out = run_estimator(world, inits, build_model, "exact_GGN")
  want = exact_ggn_squared_error(forward, inits, x)
  np.testing.assert_allclose(out["blocks"][0], want, **TOL)


@pytest.mark.parametrize("world", WORLDS)
def test_kron_expand_is_exact_for_linear_conv_with_per_location_loss(world):
  conv = Conv((3, 4, 4, 2), (3, 3), 3, (1, 1), (1, 1), "SAME")
  inits, x = conv.inits(19), conv.data(20)
  pointwise = np.random.RandomState(21).randn(1, 1, 3, 2)
  targets = np.random.RandomState(22).randn(3, 32)

  def forward(vs, xs):
    y = tf.nn.conv2d(conv.apply(vs, xs), pointwise, 1, "VALID")
    return tf.reshape(y, [tf.shape(xs)[0], -1])

  def build_model(lc, vs):
    xt = tf.constant(x)
    pre = conv.apply(vs, xt)
    y = tf.nn.conv2d(pre, pointwise, 1, "VALID")
    conv.register_layer(lc, vs, xt, pre, approx="kron")
    lc.register_squared_error_loss(tf.reshape(y, [3, -1]),
                                   targets=tf.constant(targets))

  out = run_estimator(world, inits, build_model, "exact_GGN")
  want = exact_ggn_squared_error(forward, inits, x)
  np.testing.assert_allclose(out["blocks"][0], want, **TOL)


# ------------------------------------------------- depthwise / separable
def depthwise_apply(x, w, b, strides, rate, padding):
  y = tf.nn.depthwise_conv2d(x, w, [1] + list(strides) + [1], padding,
                             dilations=list(rate))
  return y if b is None else y + b


class Depthwise:
  """Depthwise conv [k, k, C, M] + bias [C*M], NHWC."""

  def __init__(self, x_shape, kernel, mult, strides, rate, padding):
    self.x_shape, self.kernel, self.mult = x_shape, kernel, mult
    self.strides, self.rate, self.padding = strides, rate, padding
    self.channels = x_shape[-1]

  def inits(self, seed):
    rng = np.random.RandomState(seed)
    return [0.5 * rng.randn(*(self.kernel + (self.channels, self.mult))),
            0.2 * rng.randn(self.channels * self.mult)]

  def apply(self, vs, x):
    return depthwise_apply(x, vs[0], vs[1], self.strides, self.rate,
                           self.padding)

  def register_layer(self, lc, vs, x, pre, approx=None, **options):
    return lc.register_depthwise_conv2d((vs[0], vs[1]), x, pre,
                                        [1] + list(self.strides) + [1],
                                        self.padding, rate=self.rate,
                                        approx=approx, **options)

  def param_positions(self, channel):
    """Flat (filter, bias) indices of one input channel's parameters, in
    the (k, m) order of its Kronecker block (bias row last)."""
    taps = int(np.prod(self.kernel))
    c, m = self.channels, self.mult
    filt = [(k * c + channel) * m + j for k in range(taps) for j in range(m)]
    bias = [taps * c * m + channel * m + j for j in range(m)]
    return filt + bias


@pytest.mark.parametrize("world", ["graph"])
def test_depthwise_diagonal_equals_exact_fisher_diagonal(world):
  dw = Depthwise((3, 5, 5, 2), (3, 3), 2, (2, 2), (1, 1), "SAME")
  inits, x = dw.inits(23), np.random.RandomState(24).randn(*dw.x_shape)
  labels = np.random.RandomState(25).randint(0, 3, len(x))
  forward = lambda vs, xs: (forward_from_pre(dw.apply(vs, xs)), None)

  def build_model(lc, vs):
    xt = tf.constant(x)
    pre = dw.apply(vs, xt)
    block = dw.register_layer(lc, vs, xt, pre)  # default: diagonal
    assert isinstance(block, kfac.fisher_blocks.DepthwiseConvDiagonalFB)
    lc.register_softmax_cross_entropy_loss(forward_from_pre(pre),
                                           targets=tf.constant(labels))

  out = run_estimator(world, inits, build_model, "exact")
  want = np.diag(exact_fisher(forward, inits, x))
  np.testing.assert_allclose(np.diag(out["blocks"][0]), want, **TOL)


@pytest.mark.parametrize("world", ["graph"])
def test_depthwise_kron_channel_blocks_are_exact_for_one_location(world):
  """One example, one output location: each channel's block is exactly
  the exact Fisher's block of that channel's parameters; cross-channel
  blocks are dropped."""
  dw = Depthwise((1, 3, 3, 2), (3, 3), 2, (1, 1), (1, 1), "VALID")
  inits, x = dw.inits(26), np.random.RandomState(27).randn(*dw.x_shape)
  forward = lambda vs, xs: (forward_from_pre(dw.apply(vs, xs)), None)

  def build_model(lc, vs):
    xt = tf.constant(x)
    pre = dw.apply(vs, xt)
    dw.register_layer(lc, vs, xt, pre, approx="kron")
    lc.register_softmax_cross_entropy_loss(forward_from_pre(pre),
                                           targets=tf.constant([1]))

  out = run_estimator(world, inits, build_model, "exact")
  exact = exact_fisher(forward, inits, x)
  block = out["blocks"][0]
  want = np.zeros_like(exact)
  for c in range(dw.channels):
    idx = np.array(dw.param_positions(c))
    want[np.ix_(idx, idx)] = exact[np.ix_(idx, idx)]
  np.testing.assert_allclose(block, want, **TOL)


def _depthwise_output_grads(dw, inits, x, labels):
  """[rows, C, M] gradients of the summed loss with respect to the
  depthwise layer's pre-activations."""
  vs = [tf.constant(v) for v in inits]
  pre = dw.apply(vs, tf.constant(x))
  with tf.GradientTape() as tape:
    tape.watch(pre)
    loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.constant(labels), logits=forward_from_pre(pre)))
  return tape.gradient(loss, pre).numpy().reshape(-1, dw.channels, dw.mult)


@pytest.mark.parametrize("world", WORLDS)
def test_depthwise_kron_factors_and_products(world):
  dw = Depthwise((3, 4, 4, 2), (2, 1), 2, (1, 1), (1, 1), "SAME")
  inits, x = dw.inits(28), np.random.RandomState(29).randn(*dw.x_shape)
  labels = np.random.RandomState(30).randint(0, 3, len(x))
  damping, exps = 0.05, (-1, -0.5, 2)

  def build_model(lc, vs):
    xt = tf.constant(x)
    pre = dw.apply(vs, xt)
    block = dw.register_layer(lc, vs, xt, pre, approx="kron")
    assert isinstance(block, conv_blocks.DepthwiseConvKFCBasicFB)
    lc.register_softmax_cross_entropy_loss(forward_from_pre(pre),
                                           targets=tf.constant(labels))

  def extra(est, vs):
    return _product_fetches(est, vs, exps, 31)

  out = run_estimator(world, inits, build_model, "empirical",
                      damping=damping, exps=exps, extra=extra,
                      compute_cholesky=True, compute_cholesky_inverse=True)
  # Hand factors: per-channel patches and output gradients.
  p = cft.np_patches(x, dw.kernel, dw.strides, dw.rate, dw.padding)
  p = p.reshape(-1, 2, dw.channels)  # [rows, K, C]
  g = _depthwise_output_grads(dw, inits, x, labels)
  a, gg = out["factors"][0]
  num_locs = 16
  n = sum(int(np.prod(v.shape)) for v in inits)
  dense = np.zeros((n, n))
  for c in range(dw.channels):
    a_c = cft.mean_outer(cft.with_ones(p[:, :, c]))
    g_c = cft.mean_outer(g[:, c, :])
    np.testing.assert_allclose(a[c], a_c, **TOL)
    np.testing.assert_allclose(gg[c], g_c, **TOL)
    idx = np.array(dw.param_positions(c))
    dense[np.ix_(idx, idx)] = num_locs * ref.pi_damped_kron(
        a_c, g_c, damping / num_locs)
    np.testing.assert_allclose(out["blocks"][0][np.ix_(idx, idx)],
                               num_locs * np.kron(a_c, g_c), **TOL)
  ex = out["extra"]
  vec = ref.flat(ex["vecs"])
  for e in (1,) + exps:
    np.testing.assert_allclose(ref.flat(ex["pow%s" % e]),
                               ref.sym_matpower(dense, e) @ vec, **PTOL)
  _check_cholesky_fetches(ex, dense)


@pytest.mark.parametrize("world", ["graph"])
def test_separable_conv_diagonals_equal_exact_fisher(world):
  dw = Depthwise((3, 4, 4, 2), (2, 2), 2, (1, 1), (1, 1), "SAME")
  rng = np.random.RandomState(32)
  inits = dw.inits(33) [:1] + [0.5 * rng.randn(1, 1, 4, 3),
                               0.1 * rng.randn(3)]
  x = rng.randn(*dw.x_shape)
  labels = rng.randint(0, 3, len(x))

  def pointwise(vs, xs):
    dw_out = depthwise_apply(xs, vs[0], None, (1, 1), (1, 1), "SAME")
    return dw_out, tf.nn.conv2d(dw_out, vs[1], 1, "VALID") + vs[2]

  forward = lambda vs, xs: (forward_from_pre(pointwise(vs, xs)[1]), None)

  def build_model(lc, vs):
    xt = tf.constant(x)
    dw_out, pw_out = pointwise(vs, xt)
    blocks = lc.register_separable_conv2d(
        vs[0], (vs[1], vs[2]), xt, dw_out, pw_out, [1, 1, 1, 1], "SAME",
        approx=("diagonal", "diagonal"))
    assert [type(b).__name__ for b in blocks] == ["DepthwiseConvDiagonalFB",
                                                  "ConvDiagonalFB"]
    lc.register_softmax_cross_entropy_loss(forward_from_pre(pw_out),
                                           targets=tf.constant(labels))

  out = run_estimator(world, inits, build_model, "exact")
  want = np.diag(exact_fisher(forward, inits, x))
  got = np.concatenate([np.diag(b) for b in out["blocks"]])
  np.testing.assert_allclose(got, want, **TOL)


# ------------------------------------------------- multi-use (kron_indep)
def _two_use_model(conv, x1, x2):
  def logits_of(pre1, pre2):
    other = tf.matmul(tf.reshape(tf.tanh(pre2), [tf.shape(pre2)[0], -1]),
                      head(int(np.prod(pre2.shape[1:])), seed=98))
    return forward_from_pre(pre1) + other
  return logits_of


@pytest.mark.parametrize("world", WORLDS)
def test_conv2d_multi_kron_indep_averages_over_uses(world):
  conv = Conv((2, 4, 4, 2), (2, 2), 2, (1, 1), (1, 1), "SAME")
  inits = conv.inits(34)
  rng = np.random.RandomState(35)
  x1, x2 = rng.randn(*conv.x_shape), rng.randn(*conv.x_shape)
  labels = rng.randint(0, 3, 2)
  logits_of = _two_use_model(conv, x1, x2)

  def listed(lc, vs):
    pre1 = conv.apply(vs, tf.constant(x1))
    pre2 = conv.apply(vs, tf.constant(x2))
    block = lc.register_conv2d_multi((vs[0], vs[1]), 1, "SAME",
                                     [tf.constant(x1), tf.constant(x2)],
                                     [pre1, pre2])
    assert isinstance(block, kfac.fisher_blocks.ConvKFCBasicMultiIndepFB)
    lc.register_softmax_cross_entropy_loss(logits_of(pre1, pre2),
                                           targets=tf.constant(labels))

  def folded(lc, vs):
    x_all = tf.constant(np.concatenate([x1, x2]))
    pre_all = conv.apply(vs, x_all)
    lc.register_conv2d_multi((vs[0], vs[1]), [1, 1, 1, 1], "SAME", x_all,
                             pre_all, num_uses=2)
    pre1, pre2 = tf.split(pre_all, 2)
    lc.register_softmax_cross_entropy_loss(logits_of(pre1, pre2),
                                           targets=tf.constant(labels))

  out = run_estimator(world, inits, listed, "empirical")
  vs = [tf.constant(v) for v in inits]
  pre1, pre2 = conv.apply(vs, tf.constant(x1)), conv.apply(vs, tf.constant(x2))
  with tf.GradientTape() as tape:
    tape.watch([pre1, pre2])
    loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.constant(labels), logits=logits_of(pre1, pre2)))
  g1, g2 = [g.numpy().reshape(-1, 2) for g in tape.gradient(loss,
                                                           [pre1, pre2])]
  a_want = 0.5 * (conv.hand_a(x1) + conv.hand_a(x2))
  g_want = 0.5 * (cft.mean_outer(g1) + cft.mean_outer(g2))
  a, g = out["factors"][0]
  np.testing.assert_allclose(a, a_want, **TOL)
  np.testing.assert_allclose(g, g_want, **TOL)
  np.testing.assert_allclose(out["blocks"][0],
                             16 * 2 * np.kron(a_want, g_want), **TOL)
  if world == "graph":
    out_folded = run_estimator(world, inits, folded, "empirical")
    np.testing.assert_allclose(out_folded["blocks"][0], out["blocks"][0],
                               **TOL)


# ------------------------------------------------- masks, sub-sampling
@pytest.mark.parametrize("world,approx", worlds_for(
    ["kron", "diagonal"], both=()))
def test_patch_mask_of_a_masked_conv(world, approx):
  conv = Conv((3, 4, 4, 2), (3, 3), 2, (1, 1), (1, 1), "SAME")
  inits, x = conv.inits(36), conv.data(37)
  mask = (np.random.RandomState(38).rand(3, 3, 2) > 0.3).astype(np.float64)
  labels = np.random.RandomState(39).randint(0, 3, len(x))

  def masked_pre(vs, xs):
    w = vs[0] * tf.constant(mask[..., np.newaxis])
    return conv_apply(xs, w, vs[1], (1, 1), (1, 1), "SAME")

  forward = lambda vs, xs: (forward_from_pre(masked_pre(vs, xs)), None)

  def build_model(lc, vs):
    xt = tf.constant(x)
    pre = masked_pre(vs, xt)
    conv.register_layer(lc, vs, xt, pre, approx=approx, patch_mask=mask)
    lc.register_softmax_cross_entropy_loss(forward_from_pre(pre),
                                           targets=tf.constant(labels))

  out = run_estimator(world, inits, build_model, "exact")
  if approx == "kron":
    np.testing.assert_allclose(out["factors"][0][0], conv.hand_a(x, mask),
                               **TOL)
  else:
    want = np.diag(exact_fisher(forward, inits, x))
    np.testing.assert_allclose(np.diag(out["blocks"][0]), want, **TOL)


@pytest.mark.parametrize("world", WORLDS)
def test_registered_depthwise_sub_sampling(world):
  """register_depthwise_conv2d(approx="kron", sub_sample_patches=R): the
  input factor is a per-channel statistic of R of the 48 patch rows (not
  the full one), the output factor stays the full batch's."""
  dw = Depthwise((3, 4, 4, 2), (2, 2), 2, (1, 1), (1, 1), "SAME")
  inits, x = dw.inits(43), np.random.RandomState(44).randn(*dw.x_shape)
  labels = np.random.RandomState(45).randint(0, 3, len(x))

  def build_model(lc, vs):
    xt = tf.constant(x)
    pre = dw.apply(vs, xt)
    block = dw.register_layer(lc, vs, xt, pre, approx="kron",
                              sub_sample_patches=12)
    assert block._sub_sample_patches == 12  # pylint: disable=protected-access
    lc.register_softmax_cross_entropy_loss(forward_from_pre(pre),
                                           targets=tf.constant(labels))

  a, g = run_estimator(world, inits, build_model, "empirical")["factors"][0]
  p = cft.np_patches(x, dw.kernel, dw.strides, dw.rate, dw.padding)
  p = p.reshape(-1, 4, dw.channels)  # [48 rows, K, C]
  for c in range(dw.channels):
    full = cft.mean_outer(cft.with_ones(p[:, :, c]))
    assert a[c].shape == full.shape
    assert not np.allclose(a[c], full, rtol=1e-3)
    # A mean of 12 rows' outer products: its ones entry is exactly 1 and
    # each tap's mean is one of the patch values' 12-row means.
    np.testing.assert_allclose(a[c][-1, -1], 1.0, rtol=1e-14)
  grads = _depthwise_output_grads(dw, inits, x, labels)
  for c in range(dw.channels):
    np.testing.assert_allclose(g[c], cft.mean_outer(grads[:, c, :]), **TOL)


@pytest.mark.parametrize("world", ["graph"])
def test_registered_sub_sampling_updates_a_sub_sampled_statistic(world):
  conv = Conv((6, 4, 4, 2), (2, 2), 2, (1, 1), (1, 1), "SAME")
  inits, x = conv.inits(40), conv.data(41)
  labels = np.random.RandomState(42).randint(0, 3, len(x))

  def build_model(lc, vs):
    xt = tf.constant(x)
    pre = conv.apply(vs, xt)
    block = conv.register_layer(lc, vs, xt, pre, sub_sample_inputs=2,
                                sub_sample_patches=10)
    assert block._sub_sample_patches == 10  # pylint: disable=protected-access
    lc.register_softmax_cross_entropy_loss(forward_from_pre(pre),
                                           targets=tf.constant(labels))

  a = run_estimator(world, inits, build_model, "empirical")["factors"][0][0]
  full = conv.hand_a(x)
  assert a[-1, -1] == 1.0
  assert np.linalg.matrix_rank(a[:-1, :-1]) <= 9  # 10 rows (one a ones row)
  assert np.max(np.abs(a - full)) > 1e-3
  # Every kept row is a patch of the batch: A's bias column is a mean of
  # 10 patches, so it lies in the convex hull of all patches' entries.
  p = cft.np_patches(x, (2, 2), (1, 1), (1, 1), "SAME").reshape(-1, 8)
  assert np.all(a[:-1, -1] <= p.max(0) + 1e-12)
  assert np.all(a[:-1, -1] >= p.min(0) - 1e-12)


def test_towers_concatenate_like_one_big_batch():
  conv = Conv((4, 4, 4, 2), (2, 2), 2, (2, 2), (1, 1), "SAME")
  inits, x = conv.inits(43), conv.data(44)
  labels = np.random.RandomState(45).randint(0, 3, len(x))

  def towers(lc, vs):
    for half, reuse in ((slice(0, 2), False), (slice(2, 4), True)):
      xt = tf.constant(x[half])
      pre = conv.apply(vs, xt)
      block = conv.register_layer(lc, vs, xt, pre, reuse=reuse)
      lc.register_softmax_cross_entropy_loss(
          forward_from_pre(pre), targets=tf.constant(labels[half]),
          name="xent", reuse=reuse)
    assert block.num_registered_towers == 2

  def single(lc, vs):
    xt = tf.constant(x)
    pre = conv.apply(vs, xt)
    conv.register_layer(lc, vs, xt, pre)
    lc.register_softmax_cross_entropy_loss(forward_from_pre(pre),
                                           targets=tf.constant(labels))

  got = run_estimator("graph", inits, towers, "empirical")["blocks"][0]
  want = run_estimator("graph", inits, single, "empirical")["blocks"][0]
  np.testing.assert_allclose(got, want, **TOL)


# ------------------------------------------------- registration errors
def _variable(shape, name):
  return tf.Variable(np.zeros(shape), name=name)


def test_registration_errors_name_the_variable():
  with tf.Graph().as_default():
    lc = kfac.LayerCollection()
    w = _variable([3, 3, 2, 4], "w_conv")
    b = _variable([4], "b_conv")
    x = tf.zeros([2, 5, 5, 2], tf.float64)
    y = tf.zeros([2, 5, 5, 4], tf.float64)
    cases = [
        (lambda: lc.register_conv2d(_variable([3, 3, 2], "w_rank"), 1,
                                    "SAME", x, y), "w_rank.*rank 4"),
        (lambda: lc.register_conv2d(w, 1, "SAME",
                                    tf.zeros([2, 5, 5, 3], tf.float64), y),
         "w_conv.*input channels"),
        (lambda: lc.register_conv2d(w, 1, "SAME", x,
                                    tf.zeros([2, 5, 5, 5], tf.float64)),
         "w_conv.*output channels"),
        (lambda: lc.register_conv2d((w, _variable([5], "b_bad")), 1, "SAME",
                                    x, y), "b_bad"),
        (lambda: lc.register_conv2d(w, 2, "SAME", x, y),
         "w_conv.*spatial shape \\[3, 3\\].*\\[5, 5\\]"),
        (lambda: lc.register_conv2d(w, [2, 2, 2, 2], "SAME", x, y),
         "w_conv.*strides"),
        (lambda: lc.register_conv2d(w, 1, "SAME", x, y, approx="kron_foo"),
         "kron_foo.*w_conv"),
        (lambda: lc.register_conv2d(w, 1, "SAME", x, y, approx="diagonal",
                                    sub_sample_patches=4),
         "sub_sample_patches.*w_conv"),
        (lambda: lc.register_conv2d(w, 1, "SAME", x, y,
                                    patch_mask=np.ones([3, 3])),
         "patch_mask.*w_conv"),
        (lambda: lc.register_conv2d(w, 1, "SAME", x, y, sub_sample_inputs=0),
         "sub_sample_inputs.*w_conv"),
        (lambda: lc.register_conv1d(_variable([3, 2, 4], "w_1d"), 1, "SAME",
                                    x, y), "w_1d.*rank 3"),
        (lambda: lc.register_depthwise_conv2d(
            _variable([3, 3, 2, 2], "w_dw"), x,
            tf.zeros([2, 5, 5, 3], tf.float64), 1, "SAME"),
         "w_dw.*output channels"),
        (lambda: lc.register_depthwise_conv2d(
            _variable([3, 3, 2, 2], "w_dw2"), x, y, 1, "SAME",
            approx="kron_sua"), "kron_sua.*w_dw2"),
        (lambda: lc.register_depthwise_conv2d(
            _variable([3, 3, 2, 2], "w_dw3"), x,
            tf.zeros([2, 5, 5, 4], tf.float64), 1, "SAME",
            approx="diagonal", sub_sample_patches=8),
         "sub_sample_patches is not supported by approximation 'diagonal'.*"
         "w_dw3"),
        (lambda: lc.register_depthwise_conv2d(
            _variable([3, 3, 2, 2], "w_dw4"), x,
            tf.zeros([2, 5, 5, 4], tf.float64), 1, "SAME",
            approx="kron", sub_sample_patches=-3),
         "sub_sample_patches.*w_dw4"),
    ]
    for fn, pattern in cases:
      with pytest.raises(ValueError, match=pattern):
        fn()

    lc.register_conv2d((w, b), 1, "SAME", x, y)
    with pytest.raises(ValueError, match="already in LayerCollection"):
      lc.register_conv2d((w, b), 1, "SAME", x, y)
    with pytest.raises(ValueError, match="w_conv.*reused"):
      lc.register_conv2d((w, b), 2, "SAME", x,
                         tf.zeros([2, 3, 3, 4], tf.float64), reuse=True)
    with pytest.raises(ValueError, match="w_conv.*reused"):
      lc.register_conv2d((w, b), 1, "SAME", x, y, approx="kron_sua",
                         reuse=True)


def test_conv2d_multi_use_count_errors():
  with tf.Graph().as_default():
    lc = kfac.LayerCollection()
    w = _variable([2, 2, 2, 3], "w_multi")
    x = tf.zeros([2, 4, 4, 2], tf.float64)
    y = tf.zeros([2, 4, 4, 3], tf.float64)
    cases = [
        (lambda: lc.register_conv2d_multi(w, 1, "SAME", [x, x], [y]),
         "w_multi.*2 inputs and 1 outputs"),
        (lambda: lc.register_conv2d_multi(w, 1, "SAME", [x, x], [y, y],
                                          num_uses=3), "w_multi.*num_uses=3"),
        (lambda: lc.register_conv2d_multi(w, 1, "SAME", x, y),
         "w_multi.*need num_uses"),
        (lambda: lc.register_conv2d_multi(w, 1, "SAME", x, y, num_uses=3),
         "w_multi.*not divisible"),
        (lambda: lc.register_conv2d_multi(w, 1, "SAME", [x], y),
         "w_multi.*both"),
        (lambda: lc.register_conv2d_multi(w, 1, "SAME", [x], [y],
                                          approx="kron"), "kron.*w_multi"),
    ]
    for fn, pattern in cases:
      with pytest.raises(ValueError, match=pattern):
        fn()
    lc.register_conv2d_multi(w, 1, "SAME", [x, x], [y, y])
    with pytest.raises(ValueError, match="w_multi.*2 uses.*3 uses"):
      lc.register_conv2d_multi(w, 1, "SAME", [x, x, x], [y, y, y],
                               reuse=True)
    block = lc.register_conv2d_multi(w, 1, "SAME", [x, x], [y, y],
                                     reuse=True)
    assert block.num_registered_towers == 2 and block.num_uses == 2


def test_default_approximations_and_setters():
  with tf.Graph().as_default():
    lc = kfac.LayerCollection()
    assert lc.default_conv2d_approximation == "kron"
    assert lc.default_conv2d_multi_approximation == "kron_indep"
    with pytest.raises(ValueError, match="kron_bad"):
      lc.set_default_conv2d_approximation("kron_bad")
    with pytest.raises(ValueError, match="diagonal"):
      lc.set_default_conv2d_multi_approximation("diagonal")
    lc.set_default_conv2d_approximation("kron_reduce")
    assert lc.default_conv2d_approximation == "kron_reduce"
    x = tf.zeros([2, 5, 5, 2], tf.float64)
    block = lc.register_conv2d(_variable([3, 3, 2, 4], "w1"), [1, 1, 1, 1],
                               "VALID", x, tf.zeros([2, 3, 3, 4], tf.float64))
    assert isinstance(block, conv_blocks.ConvKFCReduceFB)
    lc.define_linked_parameters(_variable([3, 3, 2, 4], "w2"), "diagonal")
    block = lc.register_conv2d(lc.linked_parameters and
                               list(lc.linked_parameters.values())[0][0], 1,
                               "VALID", x, tf.zeros([2, 3, 3, 4], tf.float64))
    assert isinstance(block, conv_blocks.ConvDiagonalFB)
    dw, pw = lc.register_separable_conv2d(
        _variable([3, 3, 2, 2], "dw"), _variable([1, 1, 4, 3], "pw"), x,
        tf.zeros([2, 5, 5, 4], tf.float64), tf.zeros([2, 5, 5, 3], tf.float64),
        [1, 1, 1, 1], "SAME")
    assert isinstance(dw, conv_blocks.DepthwiseConvDiagonalFB)
    assert isinstance(pw, conv_blocks.ConvKFCReduceFB)  # the conv2d default
