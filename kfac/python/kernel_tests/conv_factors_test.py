"""Convolution patches and factors against numpy loops (float64).

References: patches extracted by explicit Python loops over examples,
output positions and filter taps (`np_patches`), themselves checked against
`tf.nn.convolution` (patches @ reshape(W, [K*C, O]) == conv output);
statistics assembled from them with numpy. Tolerances: 1e-12 absolute /
1e-10 relative (float64 sums of a few hundred products); the Monte Carlo
unbiasedness check of sub-sampling uses 6 standard errors estimated from
the draws.
"""

import itertools

import numpy as np
import pytest
import tensorflow as tf

from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref
from kfac.python.ops.layers.conv import depthwise_factors
from kfac.python.ops.layers.conv import factors as conv_factors
from kfac.python.ops.layers.conv import sua_factor
from kfac.python.ops.layers.base import damping as damping_lib
from kfac.python.ops.layers.conv import patches as patches_lib

TOL = dict(rtol=1e-10, atol=1e-12)


# ------------------------------------------------------- numpy references
def same_pads(in_size, k, s, d):
  """TensorFlow's SAME padding of one dimension (written out here, not
  taken from kfac)."""
  out = -(-in_size // s)
  eff = (k - 1) * d + 1
  total = max((out - 1) * s + eff - in_size, 0)
  return (total // 2, total - total // 2)


def np_pads(x_spatial, kernel, strides, dilations, padding):
  if padding == "VALID":
    return [(0, 0)] * len(kernel)
  if padding == "SAME":
    return [same_pads(n, k, s, d) for n, k, s, d in
            zip(x_spatial, kernel, strides, dilations)]
  return [tuple(p) for p in padding]


def np_patches(x, kernel, strides, dilations, padding):
  """[N, L, K*C] patches of channels-last x by explicit loops."""
  n_ex, channels = x.shape[0], x.shape[-1]
  d = len(kernel)
  pads = np_pads(x.shape[1:-1], kernel, strides, dilations, padding)
  xp = np.pad(x, [(0, 0)] + pads + [(0, 0)])
  out_shape = [(xp.shape[1 + i] - ((kernel[i] - 1) * dilations[i] + 1)) //
               strides[i] + 1 for i in range(d)]
  rows = []
  for n in range(n_ex):
    for o in itertools.product(*[range(s) for s in out_shape]):
      patch = []
      for tap in itertools.product(*[range(k) for k in kernel]):
        idx = tuple(o[i] * strides[i] + tap[i] * dilations[i]
                    for i in range(d))
        patch.extend(xp[(n,) + idx])
      rows.append(patch)
  num_locs = int(np.prod(out_shape))
  return np.asarray(rows).reshape(n_ex, num_locs,
                                  int(np.prod(kernel)) * channels)


def mean_outer(rows):
  rows = np.asarray(rows)
  return rows.T @ rows / rows.shape[0]


def with_ones(rows):
  return np.concatenate([rows, np.ones(rows.shape[:-1] + (1,))], axis=-1)


def kfc_input_factor(x, kernel, strides, dilations, padding, bias):
  p = np_patches(x, kernel, strides, dilations, padding)
  p = p.reshape(-1, p.shape[-1])
  return mean_outer(with_ones(p) if bias else p)


def sua_input_factor(x, taps, bias):
  """I_K (x) Sigma + u u^T (with the bias row/column)."""
  a = x.reshape(-1, x.shape[-1])
  mu = a.mean(0)
  sigma = (a - mu).T @ (a - mu) / a.shape[0]
  main = np.kron(np.eye(taps), sigma)
  u = np.tile(mu, taps)
  if bias:
    main = np.pad(main, [(0, 1), (0, 1)])
    u = np.concatenate([u, [1.0]])
  return main + np.outer(u, u)


# Configurations: (x shape channels-last, kernel, strides, dilations, padding)
PATCH_CONFIGS = {
    "2d_same_stride2": ((2, 5, 6, 3), (3, 3), (2, 2), (1, 1), "SAME"),
    "2d_valid_dilation2": ((2, 6, 5, 2), (2, 3), (1, 1), (2, 2), "VALID"),
    "2d_same_dilation2": ((1, 5, 5, 2), (3, 2), (1, 1), (2, 2), "SAME"),
    "2d_explicit": ((2, 4, 5, 2), (3, 3), (2, 1), (1, 1),
                    ((1, 2), (0, 1))),
    "1d_same_stride2": ((3, 7, 2), (3,), (2,), (1,), "SAME"),
    "1d_valid_dilation3": ((2, 9, 3), (2,), (1,), (3,), "VALID"),
    # A tap that only ever sees padding (its location sum is zero).
    "1d_explicit_padding_only_tap": ((2, 1, 2), (2,), (1,), (3,), ((0, 3),)),
    "3d_same_stride": ((2, 4, 5, 3, 2), (2, 3, 2), (2, 1, 2), (1, 1, 1),
                       "SAME"),
    "3d_valid_dilation": ((1, 5, 4, 5, 2), (2, 2, 3), (1, 1, 1), (2, 1, 1),
                          "VALID"),
}


def tf_conv(x, w, strides, dilations, padding):
  """tf.nn.convolution (explicit pairs: np.pad, then VALID)."""
  if not isinstance(padding, str):
    x = np.pad(x, [(0, 0)] + [tuple(p) for p in padding] + [(0, 0)])
    padding = "VALID"
  return tf.nn.convolution(x, w, strides=list(strides),
                           dilations=list(dilations), padding=padding).numpy()


@pytest.mark.parametrize("name", sorted(PATCH_CONFIGS))
def test_patches_match_numpy_loops_and_tf_convolution(name):
  shape, kernel, strides, dilations, padding = PATCH_CONFIGS[name]
  rng = np.random.RandomState(0)
  x = rng.randn(*shape)
  want = np_patches(x, kernel, strides, dilations, padding)
  # The reference itself: patches @ W_mat is TensorFlow's convolution.
  w = rng.randn(*(kernel + (shape[-1], 4)))
  conv = tf_conv(x, w, strides, dilations, padding)
  np.testing.assert_allclose(
      want @ w.reshape(-1, 4), conv.reshape(shape[0], -1, 4), **TOL)

  spec = patches_lib.make_conv_spec(kernel, strides, dilations, padding)
  got = patches_lib.extract_patches(tf.constant(x), spec).numpy()
  np.testing.assert_allclose(got.reshape(want.shape), want, **TOL)
  assert got.shape[1:-1] == conv.shape[1:-1]
  # Sums over locations (KFAC-reduce) and gathered rows (sub-sampling).
  sums = patches_lib.patch_location_sums(tf.constant(x), spec).numpy()
  np.testing.assert_allclose(sums, want.sum(1), **TOL)
  flat = want.reshape(-1, want.shape[-1])
  rows = rng.permutation(len(flat))[:5]
  gathered = patches_lib.sample_patch_rows(tf.constant(x), spec,
                                           tf.constant(rows)).numpy()
  np.testing.assert_allclose(gathered, flat[rows], **TOL)


def test_channels_first_and_argument_forms():
  rng = np.random.RandomState(1)
  x = rng.randn(2, 5, 6, 3)
  want = np_patches(x, (3, 2), (2, 1), (1, 1), "SAME")
  spec = patches_lib.make_conv_spec((3, 2), [1, 1, 2, 1], [1, 1, 1, 1],
                                    "same", "NCHW")
  assert spec.strides == (2, 1) and spec.channels_first
  x_first = tf.constant(np.transpose(x, [0, 3, 1, 2]))
  got = patches_lib.extract_patches(
      patches_lib.to_channels_last(x_first, spec.channels_first), spec)
  np.testing.assert_allclose(got.numpy().reshape(want.shape), want, **TOL)
  assert patches_lib.make_conv_spec((3, 3), 2, None, "VALID").strides == (2, 2)
  assert patches_lib.make_conv_spec((3, 3), [1, 2, 3, 1]).strides == (2, 3)
  causal = patches_lib.make_conv_spec((3,), 1, 2, "causal")
  assert causal.padding == ((4, 0),)
  for bad in ([2, 2, 2, 2], [1, 2, 3], 0):
    with pytest.raises(ValueError, match="strides"):
      patches_lib.make_conv_spec((3, 3), bad)
  with pytest.raises(ValueError, match="padding"):
    patches_lib.make_conv_spec((3, 3), 1, 1, "FULL")
  with pytest.raises(ValueError, match="data_format"):
    patches_lib.make_conv_spec((3, 3), 1, 1, "SAME", "NWHC")


# ------------------------------------------------------- statistics
def _factor_value(factor):
  return tf.convert_to_tensor(factor._compute_new_cov()).numpy()  # pylint: disable=protected-access


@pytest.mark.parametrize("bias", [False, True])
def test_input_factor_masks_and_channels_first(bias):
  rng = np.random.RandomState(2)
  x = rng.randn(3, 5, 4, 2)
  mask = (rng.rand(3, 3, 2) > 0.4).astype(np.float64)
  factor = conv_factors.ConvInputKroneckerFactor(
      (tf.constant(np.transpose(x, [0, 3, 1, 2])),), (3, 3, 2, 4), "SAME",
      (1, 2), None, "NCHW", None, bias, None, None, tf.constant(mask))
  p = np_patches(x, (3, 3), (1, 2), (1, 1), "SAME").reshape(-1, 18)
  p = p * mask.reshape(-1)
  want = mean_outer(with_ones(p) if bias else p)
  np.testing.assert_allclose(_factor_value(factor), want, **TOL)


def test_output_factors_average_and_sum_over_locations():
  rng = np.random.RandomState(3)
  g1, g2 = rng.randn(3, 4, 5, 2), rng.randn(3, 4, 5, 2)
  sources = ((tf.constant(g1),), (tf.constant(g2),))
  kfc = conv_factors.ConvOutputKroneckerFactor(sources, None, (1.0, -1.0))
  want = mean_outer(g1.reshape(-1, 2)) - mean_outer(g2.reshape(-1, 2))
  np.testing.assert_allclose(_factor_value(kfc), want, **TOL)
  first = ((tf.constant(np.transpose(g1, [0, 3, 1, 2])),),)
  reduce = conv_factors.ConvOutputReduceKroneckerFactor(first, "NCHW")
  np.testing.assert_allclose(_factor_value(reduce),
                             mean_outer(g1.sum((1, 2))), **TOL)


def test_reduce_input_factor_is_second_moment_of_location_means():
  rng = np.random.RandomState(4)
  x = rng.randn(4, 5, 5, 2)
  factor = conv_factors.ConvInputReduceKroneckerFactor(
      (tf.constant(x),), (2, 3, 2, 3), "VALID", (2, 1), (1, 1), None, True)
  means = np_patches(x, (2, 3), (2, 1), (1, 1), "VALID").mean(1)
  np.testing.assert_allclose(_factor_value(factor),
                             mean_outer(with_ones(means)), **TOL)


def test_diagonal_factor_is_mean_square_of_per_example_gradients():
  rng = np.random.RandomState(5)
  x, g = rng.randn(3, 5, 5, 2), rng.randn(3, 3, 3, 4)
  factor = conv_factors.ConvDiagonalFactor(
      (tf.constant(x),), ((tf.constant(g),),), (3, 3, 2, 4), (2, 2), "SAME",
      None, None, True)
  p = with_ones(np_patches(x, (3, 3), (2, 2), (1, 1), "SAME"))
  per_example = np.einsum("nlk,nlo->nko", p, g.reshape(3, 9, 4))
  np.testing.assert_allclose(_factor_value(factor),
                             (per_example**2).mean(0), **TOL)


# ------------------------------------------------------- sub-sampling
def _subsampled(world, x, sub_inputs, sub_patches, bias=True):
  """(statistic, example indices, row indices) from one run."""

  def build(_):
    factor = conv_factors.ConvInputKroneckerFactor(
        (tf.constant(x),), (2, 2, 2, 3), "SAME", (1, 1), None, None, None,
        bias, sub_inputs, sub_patches)
    cov, ex, rows = factor.compute_sampled_statistic()
    ex = tf.constant(-1, tf.int64) if ex is None else ex
    rows = tf.constant(-1, tf.int64) if rows is None else rows
    return [[cov, ex, rows]]

  return ref.run_stages(world, [np.zeros(1)], build)[-1]


@pytest.mark.parametrize("world", ref.WORLDS)
def test_sub_sampled_statistic_equals_statistic_of_the_chosen_subset(world):
  rng = np.random.RandomState(6)
  x = rng.randn(5, 4, 3, 2)
  patches = np_patches(x, (2, 2), (1, 1), (1, 1), "SAME")  # [5, 12, 8]

  cov, ex, _ = _subsampled(world, x, 2, None)
  assert len(ex) == 2 and len(set(ex)) == 2
  np.testing.assert_allclose(
      cov, mean_outer(with_ones(patches[ex].reshape(-1, 8))), **TOL)

  cov, _, rows = _subsampled(world, x, None, 7)
  assert len(rows) == 7 and len(set(rows)) == 7
  np.testing.assert_allclose(
      cov, mean_outer(with_ones(patches.reshape(-1, 8)[rows])), **TOL)

  # True: kfac 0.2.x's rule, ceil(0.2 * 5) = 1 example.
  cov, ex, rows = _subsampled(world, x, True, 11)
  assert len(ex) == 1 and len(rows) == 11
  kept = patches[ex].reshape(-1, 8)
  np.testing.assert_allclose(cov, mean_outer(with_ones(kept[rows])), **TOL)

  # Budgets larger than the batch keep everything (a permutation).
  cov, ex, rows = _subsampled(world, x, 50, True)  # 8 * 9 = 72 >= 60 rows
  assert sorted(ex) == list(range(5)) and sorted(rows) == list(range(60))
  np.testing.assert_allclose(
      cov, mean_outer(with_ones(patches.reshape(-1, 8))), **TOL)


@pytest.mark.parametrize("world", ref.WORLDS)
def test_depthwise_sub_sampled_statistic_is_that_of_the_chosen_rows(world):
  """A depthwise conv's per-channel input statistic on sub-sampled patch
  rows: each channel's [K+1]^2 second moment of the same chosen rows
  (gathered from the input, strided and padded); a budget above the row
  count keeps them all (the full statistic)."""
  rng = np.random.RandomState(8)
  x = rng.randn(3, 5, 4, 2)
  kernel, strides = (3, 2), (2, 1)
  patches = np_patches(x, kernel, strides, (1, 1), "SAME")  # [3, 12, 12]
  patches = patches.reshape(-1, 6, 2)  # [rows, K, C]

  def run(budget):
    def build(_):
      factor = depthwise_factors.DepthwiseConvInputKroneckerFactor(
          (tf.constant(x),), kernel + (2, 1), (1,) + strides + (1,), "SAME",
          None, None, True, budget)
      cov, rows = factor.compute_sampled_statistic()
      return [[cov, tf.constant(-1, tf.int64) if rows is None else rows]]
    return ref.run_stages(world, [np.zeros(1)], build)[-1]

  for budget, count in ((10, 10), (True, 36), (None, 36), (1000, 36)):
    cov, rows = run(budget)
    if budget is None:
      rows = np.arange(36)
    assert len(rows) == count and len(set(rows)) == count, budget
    for c in range(2):
      np.testing.assert_allclose(
          cov[c], mean_outer(with_ones(patches[rows, :, c])), **TOL)
  cov, rows = run(10)
  assert not np.allclose(cov[0], mean_outer(with_ones(patches[:, :, 0])))
  for bad in (0, 2.5, "all"):
    with pytest.raises(ValueError, match="sub_sample_patches"):
      depthwise_factors.DepthwiseConvInputKroneckerFactor(
          (tf.constant(x),), (3, 2, 2, 1), sub_sample_patches=bad)


def test_sub_sampled_statistic_is_unbiased():
  rng = np.random.RandomState(7)
  x = rng.randn(4, 3, 3, 1)
  full = mean_outer(np_patches(x, (2, 2), (1, 1), (1, 1), "SAME")
                    .reshape(-1, 4))
  factor = conv_factors.ConvInputKroneckerFactor(
      (tf.constant(x),), (2, 2, 1, 1), "SAME", None, None, None, None, False,
      3, 5)
  draws = 300
  stats = np.stack([factor.compute_sampled_statistic()[0].numpy()
                    for _ in range(draws)])
  stderr = stats.std(0) / np.sqrt(draws)
  assert np.all(np.abs(stats.mean(0) - full) <= 6 * stderr + 1e-12)
  assert np.max(np.abs(stats[0] - full)) > 1e-3  # really sub-sampled


def test_sub_sample_arguments_are_validated():
  x = tf.zeros([2, 3, 3, 1], tf.float64)
  for bad in (0, -1, 1.5, "all"):
    with pytest.raises(ValueError, match="sub_sample_patches"):
      conv_factors.ConvInputKroneckerFactor(
          (x,), (2, 2, 1, 1), "SAME", sub_sample_patches=bad)
  with pytest.raises(ValueError, match="patch_mask"):
    conv_factors.ConvInputKroneckerFactor(
        (x,), (2, 2, 1, 1), "SAME",
        patch_mask=tf.ones([3], tf.float64))._compute_new_cov()  # pylint: disable=protected-access


# ------------------------------------------------------- SUA
def _sua_factor_run(world, x, bias, damping, exps, scale_fn=None):
  store = util.new_store()

  def build(_):
    factor = sua_factor.ConvInputSUAKroneckerFactor(
        (tf.constant(x),), (3, 2, x.shape[-1], 4), bias)
    factor.set_name("sua")
    factor.attach_state_store(store)
    dfunc = damping_lib.DampingFunc(lambda: damping, ("test", damping),
                                    scale_fn=scale_fn)
    for e in exps:
      factor.register_matpower(e, dfunc)
    cov_op = factor.make_covariance_update_op(0.0)
    inv_ops = tf.group(*factor.make_inverse_update_ops())
    n = 6 * x.shape[-1] + (1 if bias else 0)
    eye = tf.eye(n, dtype=tf.float64)
    fetch = {"cov": tf.identity(factor.get_cov()),
             "trace": factor.normalized_trace()}
    for e in (1,) + tuple(exps):
      fetch["left%s" % e] = factor.left_multiply_matpower(eye, e, dfunc)
      fetch["right%s" % e] = factor.right_multiply_matpower(eye, e, dfunc)
    return [cov_op, inv_ops, fetch]

  return ref.run_stages(world, [np.zeros(1)], build)[-1]


@pytest.mark.parametrize("world", ref.WORLDS)
@pytest.mark.parametrize("bias", [False, True])
def test_sua_factor_equals_hand_built_matrix_and_its_powers(world, bias):
  rng = np.random.RandomState(8)
  x = rng.randn(3, 4, 4, 2) + 0.7  # a non-zero channel mean
  damping, scale = 0.05, 1.7
  out = _sua_factor_run(world, x, bias, damping, (-1, -0.5, 2),
                        scale_fn=lambda: tf.constant(scale, tf.float64))
  want = sua_input_factor(x, 6, bias)
  np.testing.assert_allclose(out["cov"], want, **TOL)
  np.testing.assert_allclose(out["trace"], np.trace(want) / len(want), **TOL)
  damped = scale * want + damping * np.eye(len(want))
  for e in (1, -1, -0.5, 2):
    np.testing.assert_allclose(out["left%s" % e], ref.sym_matpower(damped, e),
                               rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(out["right%s" % e], ref.sym_matpower(damped, e),
                               rtol=1e-9, atol=1e-11)
