"""Transposed convolutions (register_conv2d_transpose / conv1d_transpose /
conv_transpose; "kron": KFC with the patches on the output-gradient side,
an exact block for the bias; "diagonal": the exact diagonal; "ekfac":
EKFAC of the filter in the KFC eigenbasis; layers/conv/transpose.py,
ekfac/blocks.py) against float64 references.

References (never kfac code): output-gradient patches by numpy loops
(conv_factors_test.np_patches of the gradient w.r.t. the layer's outputs,
from a GradientTape), whose geometry is checked against per-example weight
gradients from tapes (reference.per_example_loss_grads); exact Fisher
blocks from per-example tape Jacobians (reference.py); damped products from
dense numpy matrices (blockdiag(L * pi_damped_kron(A, G, damping / L) in
the filter's (tap, o, c) order, F_b + damping I)). Tolerances as in
conv_blocks_test: 1e-9 relative / 1e-12 absolute for identities, 1e-8 /
1e-11 through matrix powers and Cholesky factors; the preconditioned
vector (damped inverse applied) to 1e-10 / 1e-12 against a dense solve.
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import conv_blocks_test as cbt
from kfac.python.kernel_tests import conv_factors_test as cft
from kfac.python.kernel_tests import ekfac_test as et
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref
from kfac.python.ops.ekfac import blocks as ekfac_blocks
from kfac.python.ops.layers.conv import transpose
from kfac.python.ops.linear_operator import CurvatureOperator

TOL = cbt.TOL
PTOL = cbt.PTOL
INV_TOL = dict(rtol=1e-10, atol=1e-12)
_FIRST = ("NCW", "NCHW", "NCDHW")


def _dilated(w, dilations):
  """The filter [k.., O, C] with d - 1 zeros between taps along each
  spatial axis of dilation d."""
  w = tf.identity(w)  # one read of the variable
  for axis, d in enumerate(dilations):
    if d == 1:
      continue
    taps = tf.split(w, int(w.shape[axis]), axis=axis)
    shape = w.shape.as_list()
    shape[axis] = d - 1
    zeros = tf.zeros(shape, w.dtype)
    parts = [taps[0]]
    for tap in taps[1:]:
      parts += [zeros, tap]
    w = tf.concat(parts, axis=axis)
  return w


class ConvT:
  """A transposed convolution x [N, spatial.., C] -> y [N, y_spatial.., O]
  (filter [k.., O, C], optional bias [O])."""

  def __init__(self, x_shape, kernel, out, strides, padding, y_spatial,
               dilations=None, bias=True, data_format=None, register="2d"):
    self.x_shape, self.kernel, self.out = x_shape, kernel, out
    self.strides, self.padding, self.y_spatial = strides, padding, y_spatial
    self.dilations = dilations or (1,) * len(kernel)
    self.bias, self.data_format, self.register = bias, data_format, register

  @property
  def first(self):
    return self.data_format in _FIRST

  def inits(self, seed):
    rng = np.random.RandomState(seed)
    w = 0.5 * rng.randn(*(self.kernel + (self.out, self.x_shape[-1])))
    return [w, 0.2 * rng.randn(self.out)] if self.bias else [w]

  def data(self, seed):
    x = np.random.RandomState(seed).randn(*self.x_shape)
    return np.moveaxis(x, -1, 1) if self.first else x

  def last(self, a):
    return np.moveaxis(a, 1, -1) if self.first else a

  def apply(self, vs, x):
    rank = len(self.x_shape)
    if self.first:
      x = tf.transpose(x, [0] + list(range(2, rank)) + [1])
    # TensorFlow's float64 CPU kernels have no dilated transposed
    # convolution: the same map with the dilated filter (zeros between the
    # taps).
    y = tf.nn.conv_transpose(
        x, _dilated(vs[0], self.dilations),
        tf.concat([tf.shape(x)[:1], list(self.y_spatial) + [self.out]],
                  axis=0), list(self.strides), self.padding)
    if self.bias:
      y = y + vs[1]
    if self.first:
      y = tf.transpose(y, [0, rank - 1] + list(range(1, rank - 1)))
    return y

  def params(self, vs):
    return (vs[0], vs[1]) if self.bias else vs[0]

  def register_layer(self, lc, vs, x, pre, approx=None):
    args = (self.params(vs), x, pre, list(self.strides), self.padding)
    kwargs = dict(data_format=self.data_format,
                  dilations=list(self.dilations), approx=approx)
    if self.register == "2d":
      return lc.register_conv2d_transpose(*args, **kwargs)
    if self.register == "1d":
      return lc.register_conv1d_transpose(*args, **kwargs)
    return lc.register_conv_transpose(*args, **kwargs)

  @property
  def num_locations(self):
    return int(np.prod(self.x_shape[1:-1]))

  def grad_patches(self, g):
    """[N, L, K*O] patches of the channels-last output gradients g."""
    return cft.np_patches(self.last(g), self.kernel, self.strides,
                          self.dilations, self.padding)

  def hand_factors(self, x, g):
    """(A, G, F_b) by numpy from inputs and output gradients."""
    xs = self.last(x).reshape(-1, self.x_shape[-1])
    q = self.grad_patches(g)
    sums = self.last(g).reshape(len(g), -1, self.out).sum(axis=1)
    return (cft.mean_outer(xs), cft.mean_outer(q.reshape(-1, q.shape[-1])),
            cft.mean_outer(sums))

  def filter_perm(self):
    """perm[i]: position of flat filter entry i ((tap, o, c)) in the
    (c, tap, o) order of kron(A, G)."""
    c, ko = self.x_shape[-1], int(np.prod(self.kernel)) * self.out
    return np.arange(c * ko).reshape(c, ko).T.reshape(-1)

  def dense(self, a, g, fb, damping=None):
    """The block (damping None) or the damped block, flat parameter
    order."""
    locs = self.num_locations
    if damping is None:
      filt = locs * np.kron(a, g)
    else:
      filt = locs * ref.pi_damped_kron(a, g, damping / locs)
    perm = self.filter_perm()
    filt = filt[np.ix_(perm, perm)]
    if not self.bias:
      return filt
    fb = fb if damping is None else fb + damping * np.eye(len(fb))
    n = len(filt) + len(fb)
    out = np.zeros((n, n))
    out[:len(filt), :len(filt)] = filt
    out[len(filt):, len(filt):] = fb
    return out


def _build(layer, x, labels, approx=None):
  def build_model(lc, vs):
    xt = tf.constant(x)
    pre = layer.apply(vs, xt)
    build_model.blocks.append(layer.register_layer(lc, vs, xt, pre, approx))
    lc.register_softmax_cross_entropy_loss(cbt.forward_from_pre(pre),
                                           targets=tf.constant(labels))
  build_model.blocks = []
  return build_model


def _output_grads(layer, inits, x, labels):
  """d (summed softmax cross-entropy) / d outputs, the layer's layout."""
  vs = [tf.constant(v) for v in inits]
  pre = layer.apply(vs, tf.constant(x))
  with tf.GradientTape() as tape:
    tape.watch(pre)
    loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.constant(labels), logits=cbt.forward_from_pre(pre)))
  return tape.gradient(loss, pre).numpy()


def _loss_fn(labels):
  def loss_fn(logits, n):
    return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.constant(labels[n:n + 1]), logits=logits))
  return loss_fn


CONFIGS = {
    # Keras Conv2DTranspose(3, 3, strides=2, padding="same"): 3x3 -> 6x6.
    "2d_stride2_same": ConvT((3, 3, 3, 2), (3, 3), 3, (2, 2), "SAME",
                             (6, 6)),
    # output_padding=1 with 'valid': (3 - 1) * 2 + 2 + 1 = 7.
    "2d_stride2_valid_output_padding": ConvT((2, 3, 3, 2), (2, 2), 2, (2, 2),
                                             "VALID", (7, 7)),
    "2d_dilation2_valid_nobias": ConvT((2, 3, 3, 2), (2, 2), 2, (1, 1),
                                       "VALID", (5, 5), dilations=(2, 2),
                                       bias=False),
    "2d_nchw_stride2_same": ConvT((2, 2, 3, 3), (2, 3), 2, (2, 1), "SAME",
                                  (4, 3), data_format="NCHW"),
    "1d_stride3_same": ConvT((3, 4, 2), (4,), 2, (3,), "SAME", (12,),
                             register="1d"),
    "3d_stride2_valid": ConvT((2, 2, 2, 1, 2), (2, 2, 1), 2, (2, 1, 1),
                              "VALID", (4, 3, 1), register="nd"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_reference_patches_give_the_per_example_weight_gradients(name):
  """The reference's geometry: per example, sum_p q_p x_p^T (numpy output
  gradient patches q) is the tape's weight gradient, and the sum of the
  output gradients over positions is the bias gradient."""
  layer = CONFIGS[name]
  inits, x = layer.inits(1), layer.data(2)
  labels = np.random.RandomState(3).randint(0, 3, len(x))
  forward = lambda vs, xs: cbt.forward_from_pre(layer.apply(vs, xs))
  grads = ref.per_example_loss_grads(forward, inits, x, _loss_fn(labels))
  g = _output_grads(layer, inits, x, labels)
  q = layer.grad_patches(g)
  xs = layer.last(x).reshape(len(x), -1, layer.x_shape[-1])
  for n in range(len(x)):
    dw = q[n].T @ xs[n]  # [K*O, C] = reshape(filter)
    want = [dw]
    if layer.bias:
      want.append(layer.last(g)[n].reshape(-1, layer.out).sum(axis=0))
    np.testing.assert_allclose(grads[n], ref.flat(want), **TOL)


@pytest.mark.parametrize("world,name", cbt.worlds_for(
    sorted(CONFIGS), both=("2d_stride2_same",)))
def test_kron_factors_block_and_products(world, name):
  """A, G and F_b equal the brute-force expectations over examples (and
  positions); the block is blockdiag(L (A (x) G), F_b); its damped powers
  and Cholesky factors equal the dense pi-damped matrix's."""
  layer = CONFIGS[name]
  inits, x = layer.inits(4), layer.data(5)
  labels = np.random.RandomState(6).randint(0, 3, len(x))
  damping, exps = 0.03, (-1, -0.5, 2)
  build_model = _build(layer, x, labels)
  out = cbt.run_estimator(
      world, inits, build_model, "empirical", damping=damping, exps=exps,
      extra=lambda est, vs: cbt._product_fetches(est, vs, exps, 7),
      compute_cholesky=True, compute_cholesky_inverse=True)
  want_cls = (transpose.ConvTransposeKFCBasicBiasFB if layer.bias else
              transpose.ConvTransposeKFCBasicFB)
  assert type(build_model.blocks[0]) is want_cls
  a, g, fb = layer.hand_factors(x, _output_grads(layer, inits, x, labels))
  factors = out["factors"][0]
  assert len(factors) == (3 if layer.bias else 2)
  np.testing.assert_allclose(factors[0], a, **TOL)
  np.testing.assert_allclose(factors[1], g, **TOL)
  if layer.bias:
    np.testing.assert_allclose(factors[2], fb, **TOL)
  np.testing.assert_allclose(out["blocks"][0], layer.dense(a, g, fb), **TOL)
  dense = layer.dense(a, g, fb, damping)
  ex = out["extra"]
  vec = ref.flat(ex["vecs"])
  for e in (1,) + exps:
    np.testing.assert_allclose(ref.flat(ex["pow%s" % e]),
                               ref.sym_matpower(dense, e) @ vec, **PTOL)
  # The preconditioned vector: the dense damped block's solve.
  np.testing.assert_allclose(ref.flat(ex["pow-1"]),
                             np.linalg.solve(dense, vec), **INV_TOL)
  cbt._check_cholesky_fetches(ex, dense)


@pytest.mark.parametrize("world", ref.WORLDS)
def test_block_is_exact_for_one_example_at_one_position(world):
  """One example with one input position, "exact" mode: the filter's block
  is the exact Fisher's filter block (KFC's only approximations are across
  positions and examples), the bias block the exact bias block; the
  filter-bias coupling is the one part dropped."""
  layer = ConvT((1, 1, 1, 3), (3, 2), 2, (2, 2), "VALID", (3, 2))
  inits, x = layer.inits(8), layer.data(9)
  forward = lambda vs, xs: (cbt.forward_from_pre(layer.apply(vs, xs)), None)
  out = cbt.run_estimator(world, inits, _build(layer, x, [1]), "exact")
  exact = cbt.exact_fisher(forward, inits, x)
  nw = inits[0].size
  want = exact.copy()
  want[:nw, nw:] = 0.0
  want[nw:, :nw] = 0.0
  np.testing.assert_allclose(out["blocks"][0], want, **TOL)
  assert np.abs(exact[:nw, nw:]).max() > 1e-3  # the coupling is not zero


def test_bias_block_is_the_exact_bias_fisher_and_filter_block_differs():
  """Many examples and positions, "exact" mode: the bias block still
  equals the exact Fisher's bias block; the filter block is KFC's
  L (A (x) G), which differs from the exact filter block (independence
  of inputs and output gradients across positions and examples assumed)
  -- here by more than 5% in Frobenius norm."""
  layer = CONFIGS["2d_stride2_same"]
  inits, x = layer.inits(10), layer.data(11)
  forward = lambda vs, xs: (cbt.forward_from_pre(layer.apply(vs, xs)), None)
  out = cbt.run_estimator("graph", inits, _build(layer, x, [0, 1, 2]),
                          "exact")
  exact = cbt.exact_fisher(forward, inits, x)
  nw = inits[0].size
  got = out["blocks"][0]
  np.testing.assert_allclose(got[nw:, nw:], exact[nw:, nw:], **TOL)
  rel = (np.linalg.norm(got[:nw, :nw] - exact[:nw, :nw]) /
         np.linalg.norm(exact[:nw, :nw]))
  assert rel > 0.05, rel


@pytest.mark.parametrize("world,name", cbt.worlds_for(
    ["2d_stride2_same", "2d_dilation2_valid_nobias", "2d_nchw_stride2_same",
     "1d_stride3_same"], both=("2d_stride2_same",)))
def test_diagonal_equals_exact_fisher_diagonal(world, name):
  """"diagonal", "exact" mode, several examples and positions: the block is
  the exact Fisher's diagonal (per-example tape Jacobians) and nothing
  else; its damped powers are elementwise."""
  layer = CONFIGS[name]
  inits, x = layer.inits(15), layer.data(16)
  forward = lambda vs, xs: (cbt.forward_from_pre(layer.apply(vs, xs)), None)
  damping, exps = 0.03, (-1, -0.5)
  build_model = _build(layer, x, [0] * len(x), approx="diagonal")
  out = cbt.run_estimator(
      world, inits, build_model, "exact", damping=damping, exps=exps,
      extra=lambda est, vs: cbt._product_fetches(est, vs, exps, 17))
  assert type(build_model.blocks[0]) is transpose.ConvTransposeDiagonalFB
  diag = np.diag(cbt.exact_fisher(forward, inits, x))
  got = out["blocks"][0]
  np.testing.assert_allclose(np.diag(got), diag, **TOL)
  assert np.count_nonzero(got - np.diag(np.diag(got))) == 0
  vec = ref.flat(out["extra"]["vecs"])
  for e in (1,) + exps:
    np.testing.assert_allclose(ref.flat(out["extra"]["pow%s" % e]),
                               (diag + damping)**e * vec, **PTOL)


# The tf.function run of this oracle (~10 s, traced twice) is in the slow
# tier, as ekfac_test's (reference.WORLDS_TF2_SLOW).
@pytest.mark.parametrize("world,name", [
    ("graph", "2d_stride2_same"),
    pytest.param("function", "2d_stride2_same", marks=pytest.mark.slow),
    ("graph", "2d_dilation2_valid_nobias"), ("graph", "1d_stride3_same")])
def test_ekfac_scalings_block_and_products(world, name):
  """"ekfac", "exact" mode: the filter's scalings are the diagonal of the
  brute-force Fisher filter block in the KFC eigenbasis (1e-9), the block
  is Q diag(S) Q^T there, closer to the Fisher than KFC's; the bias block
  is the exact bias block; damped products, powers and Cholesky factors
  equal dense algebra on blockdiag(Q (S + damping) Q^T, F_b + damping)."""
  layer = CONFIGS[name]
  inits, x = layer.inits(20), layer.data(21)
  labels = np.random.RandomState(22).randint(0, 3, len(x))
  forward = lambda vs, xs: cbt.forward_from_pre(layer.apply(vs, xs))
  blocks = []

  def forward_register(vs, xt, lc):
    pre = layer.apply(vs, xt)
    blocks.append(layer.register_layer(lc, vs, xt, pre, approx="ekfac"))
    return cbt.forward_from_pre(pre)

  (item,) = et._run(world, inits, forward_register, x, labels, "exact",
                    fetch_products=True)
  assert type(blocks[0]) is (ekfac_blocks.ConvTransposeEKFACBiasFB
                             if layer.bias else
                             ekfac_blocks.ConvTransposeEKFACFB)
  fisher = et._reference(forward, inits, x, labels, "exact")
  nw = inits[0].size
  perm = layer.filter_perm()  # flat filter entry -> view position
  inv = np.argsort(perm)
  view = lambda m: m[np.ix_(inv, inv)]
  item_view = dict(item, block=view(item["block"][:nw, :nw]))
  et._check_scalings(item_view, view(fisher[:nw, :nw]))
  ekfac_err, kfac_err = et._errors(item_view, view(fisher[:nw, :nw]))
  assert ekfac_err < kfac_err, (ekfac_err, kfac_err)
  q, d = et._dense_products(item)
  dense = np.zeros((len(item["v"]),) * 2)
  dense[:nw, :nw] = ((q * d) @ q.T)[np.ix_(perm, perm)]
  if layer.bias:
    np.testing.assert_allclose(item["block"][nw:, nw:], fisher[nw:, nw:],
                               **TOL)
    assert np.count_nonzero(item["block"][:nw, nw:]) == 0
    dense[nw:, nw:] = fisher[nw:, nw:] + et.DAMPING * np.eye(len(dense) - nw)
  np.testing.assert_allclose(dense, item["block"] + et.DAMPING * np.eye(
      len(dense)), **TOL)
  v = item["v"]
  np.testing.assert_allclose(item["mul"], dense @ v, **TOL)
  np.testing.assert_allclose(item["inv"], np.linalg.solve(dense, v), **TOL)
  np.testing.assert_allclose(item["sqrt"], ref.sym_matpower(dense, 0.5) @ v,
                             **TOL)
  # The filter's C (C C^T its damped block): Q diag(sqrt(S + damping)) on
  # the [C, K*O] views of vectors and of the eigen-coordinates.
  chol = (q * np.sqrt(d))[np.ix_(perm, perm)]
  for key, mat in (("chol", chol), ("cholT", chol.T),
                   ("cholinv", np.linalg.inv(chol)),
                   ("cholinvT", np.linalg.inv(chol.T))):
    np.testing.assert_allclose(item[key][:nw], mat @ v[:nw], **TOL)
  if layer.bias:  # ||C^T u||^2 = u^T (F_b + damping) u, and for C^-1
    u, damped_b = v[nw:], dense[nw:, nw:]
    np.testing.assert_allclose(np.sum(item["cholT"][nw:]**2),
                               u @ damped_b @ u, **TOL)
    np.testing.assert_allclose(np.sum(item["cholinv"][nw:]**2),
                               u @ np.linalg.solve(damped_b, u), **TOL)


def _var(shape, name):
  return tf.Variable(np.zeros(shape), name=name)


def test_registration_errors_name_the_filter():
  with tf.Graph().as_default():
    lc = kfac.LayerCollection()
    w = _var([3, 3, 4, 2], "convt_w")  # [kh, kw, out, in]
    b = _var([4], "convt_b")
    x = tf.zeros([2, 3, 3, 2], tf.float64)
    y = tf.zeros([2, 6, 6, 4], tf.float64)
    cases = [
        ((w, x, tf.zeros([2, 6, 6, 3], tf.float64), 2, "SAME"),
         {}, "needs outputs with 4 channels"),
        ((w, tf.zeros([2, 3, 3, 4], tf.float64), y, 2, "SAME"),
         {}, "needs inputs with 2 channels"),
        (((w, _var([2], "convt_b2")), x, y, 2, "SAME"), {},
         "must have shape [4]"),
        ((w, x, tf.zeros([2, 8, 8, 4], tf.float64), 2, "SAME"), {},
         "are not what inputs of spatial shape [3, 3] give"),
        ((w, x, y, 2, "CAUSAL"), {}, "CAUSAL padding"),
        ((w, x, y, 2, "SAME"), dict(approx="kron_reduce"),
         "Unknown approximation 'kron_reduce' for transposed convolution"),
        ((w, x, y, 2, "SAME"), dict(data_format="NCDHW"),
         "does not describe a 2-d convolution"),
        ((w, tf.zeros([2, 3, 2], tf.float64), y, 2, "SAME"), {},
         "needs inputs of rank 4"),
    ]
    for args, kwargs, message in cases:
      with pytest.raises(ValueError, match=r"convt_w|convt_b") as info:
        lc.register_conv2d_transpose(*args, **kwargs)
      assert message in str(info.value), (message, str(info.value))
    with pytest.raises(ValueError, match="convt_w.*rank 3"):
      lc.register_conv1d_transpose(w, x, y, 2, "SAME")
    block = lc.register_conv2d_transpose((w, b), x, y, 2, "SAME")
    assert isinstance(block, transpose.ConvTransposeKFCBasicBiasFB)
    with pytest.raises(ValueError, match="convt_w"):
      lc.register_conv2d_transpose((w, b), x, y, 2, "SAME", reuse=False)


@pytest.mark.parametrize("name,approx", [
    ("2d_stride2_same", "kron"), ("2d_dilation2_valid_nobias", "kron"),
    ("2d_stride2_same", "diagonal"), ("2d_stride2_same", "ekfac"),
    ("2d_dilation2_valid_nobias", "ekfac")])
def test_curvature_operator_is_the_damped_block(name, approx):
  """kfac.linear_operator.CurvatureOperator of the estimator (the filter-only
  block through its Kronecker eigenbasis, the block with bias through its
  dense products, the diagonal elementwise, EKFAC through its eigenbasis)
  is the dense damped block; its inverse the dense inverse."""
  layer = CONFIGS[name]
  inits, x = layer.inits(12), layer.data(13)
  labels = np.random.RandomState(14).randint(0, 3, len(x))
  damping = 0.03
  build_model = _build(layer, x, labels, approx=approx)
  store = util.new_store()

  def build(vs):
    lc = kfac.LayerCollection()
    build_model(lc, vs)
    est, ops = util.estimator_stages(store, lc, vs, "empirical",
                                         damping=damping)
    op = CurvatureOperator.from_estimator(est)
    # Stages run one after the other: the statistics, the inverses, the
    # operator's refresh, then its products.
    return ops + [op.refresh(),
                  {"dense": op.to_dense(), "inverse": op.inverse().to_dense(),
                   "factors": [tf.identity(f.get_cov())
                               for f in est.blocks[0].factors()],
                   "block": tf.identity(est.blocks[0].full_fisher_block())}]

  out = ref.run_stages("graph", inits, build)[-1]
  factors = out["factors"]
  if approx in ("diagonal", "ekfac"):  # the damping on the diagonal / S
    dense = out["block"] + damping * np.eye(len(out["block"]))
  else:
    dense = layer.dense(factors[0], factors[1],
                        factors[2] if layer.bias else None, damping)
  np.testing.assert_allclose(out["dense"], dense, **PTOL)
  np.testing.assert_allclose(out["inverse"], np.linalg.inv(dense), **PTOL)
