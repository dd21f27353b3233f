"""The default recipe's pieces: the curvature scale (recipe/scale.py).

The curvature scale must equal trace(B) / dim(B) of the undamped
block-diagonal K-FAC matrix B, built here with numpy (np.kron of the
factors' covariances for Kronecker blocks, the covariance itself for full
blocks, its entries for diagonal blocks). The factors get random SPD
covariances (float64) so that nothing depends on the statistics' code.
Tolerance: relative 1e-12. Both worlds: a TF1 Session graph and a
tf.function trace.
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref
from kfac.python.ops.adaptive.recipe import scale

SIZES = (3, 4, 2)
N = 6
WORLDS = ("graph", "function")


def _conv_forward(x, kernel, bias):
  return tf.nn.conv2d(x, kernel, [1, 1, 1, 1], "VALID") + bias


def _build(lc, variables, x, images, approx):
  logits = util.register_mlp(variables[:4], x, lc, approx=approx[0],
                             generic=approx[1], batch_size=N)
  kernel, bias = variables[4:]
  out = _conv_forward(images, kernel, bias)
  lc.register_conv2d((kernel, bias), [1, 1, 1, 1], "VALID", images, out)
  lc.register_softmax_cross_entropy_loss(logits)
  lc.register_normal_predictive_distribution(
      tf.reshape(out, [N, -1]), var=1.0)
  return tf.reduce_mean(logits ** 2) + tf.reduce_mean(out ** 2)


def _variables():
  mlp = [tf.Variable(v) for v in ref.mlp_inits(SIZES, seed=1)]
  rng = np.random.RandomState(2)
  conv = [tf.Variable(rng.randn(2, 2, 2, 3)), tf.Variable(rng.randn(3))]
  return mlp + conv


def _inputs():
  x, _ = util.data(N, seed=3, sizes=SIZES)
  images = np.random.RandomState(4).randn(N, 4, 4, 2)
  return tf.constant(x), tf.constant(images)


def _spd(dim, rng):
  a = rng.randn(dim, dim)
  return a @ a.T / dim + 0.1 * np.eye(dim)


def _randomize_covs(blocks, rng, assign):
  """Gives every factor of `blocks` a random SPD (square) or positive
  (other shapes) statistic with assign(variable, value); returns the
  factors."""
  factors = list({f for b in blocks for f in b.factors() if f is not None})
  for f in factors:
    var = f.get_cov_var()
    shape = var.shape.as_list()
    assign(var, _spd(shape[0], rng) if len(shape) == 2 and
           shape[0] == shape[1] else rng.rand(*shape) + 0.1)
  return factors


def _block_matrix(block, covs):
  # pylint: disable=protected-access
  left = getattr(block, "_input_factor", None)
  if left is not None:
    return np.kron(covs[left], covs[block._output_factor])
  factor = block._factor
  cov = covs[factor]
  return np.diag(cov.ravel()) if cov.ndim == 1 or cov.shape[1] == 1 and (
      cov.shape[0] > 1) else cov


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("approx", [("kron", None), (None, "full"),
                                    (None, "diagonal")])
def test_curvature_scale_is_trace_over_dim(world, approx):
  variables = _variables()
  x, images = _inputs()
  holder = {}

  def step():
    lc = kfac.LayerCollection()
    loss = _build(lc, variables, x, images, approx)
    opt = holder.get("opt") or kfac.PeriodicInvCovUpdateKfacOpt(
        learning_rate=0.1, damping=0.1, dtype="float64", batch_size=N)
    holder["opt"] = opt
    op = opt.minimize(loss, var_list=variables, layer_collection=lc)
    holder["blocks"] = opt._require_estimator().blocks  # pylint: disable=protected-access
    return op

  rng = np.random.RandomState(5)
  if world == "graph":
    graph = tf.Graph()
    with graph.as_default():
      variables = _variables()
      x, images = _inputs()
      step()
      blocks = holder["blocks"]
      value = scale.curvature_scale(blocks)
      sess = tf.compat.v1.Session(graph=graph)
      sess.run(tf.compat.v1.global_variables_initializer())
      factors = _randomize_covs(blocks, rng,
                                lambda var, value: var.load(value, sess))
      got = sess.run(value)
      covs = dict(zip(factors, sess.run([f.get_cov() for f in factors])))
  else:
    tf.function(lambda: [step()][:0]).get_concrete_function()
    blocks = holder["blocks"]
    factors = _randomize_covs(blocks, rng,
                              lambda var, value: var.assign(value))
    got = float(scale.curvature_scale(blocks))
    covs = {f: f.get_cov().numpy() for f in factors}
  # get_cov(): the dense factor (a convolution's input factor keeps
  # moments in its variable).
  mats = [_block_matrix(b, covs) * float(getattr(b, "_renorm_coeff", 1.0))
          for b in blocks]
  dims = [sum(int(np.prod(p.shape.as_list()))
              for p in (b.params if isinstance(b.params, (list, tuple))
                        else [b.params])) for b in blocks]
  assert [m.shape[0] for m in mats] == dims  # one eigenvalue per parameter
  expected = sum(np.trace(m) for m in mats) / sum(dims)
  assert got == pytest.approx(expected, rel=1e-12)


def test_curvature_scale_of_unknown_blocks_is_zero():
  class Unknown:
    params = (tf.zeros([2]),)
  assert float(scale.curvature_scale([Unknown()])) == 0.0
  assert float(scale.curvature_scale([])) == 0.0


def test_curvature_scale_matches_the_per_block_sum():
  """The vectorized curvature_scale (one trace per distinct factor, gathered
  per block) against the per-block means of block_mean_eigenvalue, float64:
  Kronecker and one-factor blocks, a factor shared by two blocks, float32
  and float64 traces, a per-channel (vector) trace, a tensor coefficient."""

  class Factor:
    def __init__(self, trace, dtype):
      self.trace = tf.constant(trace, dtype)

    def normalized_trace(self):
      return self.trace

  class Block:
    def __init__(self, shape, **factors):
      self.params = (tf.zeros(shape),)
      for name, factor in factors.items():
        setattr(self, "_" + name, factor)

  shared = Factor(0.7, tf.float32)
  blocks = [
      Block([3, 4], input_factor=shared,
            output_factor=Factor(2.5, tf.float64), renorm_coeff=2.0),
      Block([5], factor=Factor([1.0, 3.0, 8.0], tf.float64)),
      Block([2, 2], input_factor=Factor(0.3, tf.float64),
            output_factor=shared,
            renorm_coeff=tf.constant(0.5, tf.float32)),
      Block([6], factor=Factor(4.0, tf.float32)),
  ]
  sizes = [12, 5, 4, 6]
  want = sum(float(scale.block_mean_eigenvalue(b)) * n
             for b, n in zip(blocks, sizes)) / sum(sizes)
  by_hand = (0.7 * 2.5 * 2.0 * 12 + 4.0 * 5 + 0.3 * 0.7 * 0.5 * 4 +
             4.0 * 6) / 27
  assert want == pytest.approx(by_hand, rel=1e-7)  # float32 0.7
  assert float(scale.curvature_scale(blocks)) == pytest.approx(want,
                                                                rel=1e-14)
  # Its graph does not grow with the number of blocks (beyond the factors'
  # own traces): 60 Kronecker blocks take as many ops as 2.
  def ops_for(n):
    with tf.Graph().as_default() as graph:
      many = [Block([2, 2], input_factor=Factor(1.0, tf.float32),
                    output_factor=Factor(2.0, tf.float32), renorm_coeff=1.0)
              for _ in range(n)]
      before = len(graph.get_operations())
      scale.curvature_scale(many)
      return len(graph.get_operations()) - before
  assert ops_for(60) == ops_for(2) <= 20, (ops_for(2), ops_for(60))
