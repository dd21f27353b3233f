"""Loss functions against float64 closed forms and tape Hessians."""

import numpy as np
import pytest
import tensorflow as tf

from kfac.python.kernel_tests import reference as ref
from kfac.python.ops import losses as lf

N, D = 4, 3
RNG = np.random.RandomState(3)
LOGITS = RNG.randn(N, D)
MEAN = RNG.randn(N, D)
VAR = np.exp(RNG.randn(N, D) * 0.5)
TARGET_REAL = RNG.randn(N, D)
TARGET_INT = RNG.randint(0, D, N)
TARGET_BIN = (RNG.rand(N, D) > 0.5).astype(np.float64)
TOL = dict(rtol=1e-10, atol=1e-12)


def _nll_normal(z, t, var):
  return 0.5 * tf.reduce_sum((t - z)**2 / var + np.log(2 * np.pi * var))


# name -> (make loss, per-example Fisher(n), per-example NLL of (input row, n))
CASES = {
    "categorical": (
        lambda: lf.CategoricalLogitsNegativeLogProbLoss(
            tf.constant(LOGITS), tf.constant(TARGET_INT)),
        lambda n: ref.categorical_fisher(LOGITS[n]),
        lambda z, n: -tf.nn.log_softmax(z)[TARGET_INT[n]]),
    "onehot_categorical": (
        lambda: lf.OnehotCategoricalLogitsNegativeLogProbLoss(
            tf.constant(LOGITS), tf.constant(np.eye(D)[TARGET_INT])),
        lambda n: ref.categorical_fisher(LOGITS[n]),
        lambda z, n: -tf.nn.log_softmax(z)[TARGET_INT[n]]),
    "bernoulli": (
        lambda: lf.MultiBernoulliNegativeLogProbLoss(
            tf.constant(LOGITS), tf.constant(TARGET_BIN)),
        lambda n: ref.bernoulli_fisher(LOGITS[n]),
        lambda z, n: tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(
            labels=TARGET_BIN[n], logits=z))),
    "normal_mean": (
        lambda: lf.NormalMeanNegativeLogProbLoss(
            tf.constant(MEAN), 0.7, tf.constant(TARGET_REAL)),
        lambda n: np.eye(D) / 0.7,
        lambda z, n: _nll_normal(z, TARGET_REAL[n], 0.7)),
}


def _columns(fn, dim):
  """Stacks fn(e_k) for the basis vectors e_k of the per-example factor
  space into per-example matrices [N, out, dim]."""
  cols = []
  for k in range(dim):
    e = np.zeros([N, dim])
    e[:, k] = 1.0
    cols.append(_flat_inputs(fn(tf.constant(e))))
  return np.stack(cols, axis=-1)


def _flat_inputs(v):
  if isinstance(v, (list, tuple)):
    return np.concatenate([np.asarray(x) for x in v], axis=-1)
  return np.asarray(v)


@pytest.mark.parametrize("name", sorted(CASES))
def test_fisher_factor_reproduces_fisher(name):
  make, fisher, _ = CASES[name]
  loss = make()
  b = _columns(loss.multiply_fisher_factor, D)
  for n in range(N):
    np.testing.assert_allclose(b[n] @ b[n].T, fisher(n), **TOL)
  v = RNG.randn(N, D)
  fv = loss.multiply_fisher(tf.constant(v)).numpy()
  for n in range(N):
    np.testing.assert_allclose(fv[n], fisher(n) @ v[n], **TOL)
  # transpose and replicated one-hot agree with the same B
  bt = _columns(lambda u: loss.multiply_fisher_factor_transpose(u), D)
  for n in range(N):
    np.testing.assert_allclose(bt[n], b[n].T, **TOL)
  for k in range(D):
    col = loss.multiply_fisher_factor_replicated_one_hot([k]).numpy()
    np.testing.assert_allclose(col, b[:, :, k], **TOL)


@pytest.mark.parametrize("name", sorted(CASES))
def test_natural_param_ggn_is_hessian_and_fisher(name):
  make, fisher, nll = CASES[name]
  loss = make()
  assert loss.ggn_factor_signs is None
  inputs = LOGITS if name != "normal_mean" else MEAN
  v = RNG.randn(N, D)
  hv = loss.multiply_ggn(tf.constant(v)).numpy()
  for n in range(N):
    hess = ref.tape_hessian(lambda z, n=n: nll(z, n), inputs[n])
    np.testing.assert_allclose(hess, fisher(n), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(hv[n], hess @ v[n], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", sorted(CASES))
def test_evaluate_is_summed_nll(name):
  make, _, nll = CASES[name]
  loss = make()
  inputs = LOGITS if name != "normal_mean" else MEAN
  expected = sum(float(nll(tf.constant(inputs[n]), n)) for n in range(N))
  np.testing.assert_allclose(loss.evaluate().numpy(), expected, rtol=1e-12)
  sample = loss.sample(seed=1)
  assert sample.shape[0] == N
  assert np.isfinite(loss.evaluate_on_sample(seed=1).numpy())


def _mean_var_loss(targets=True):
  return lf.NormalMeanVarianceNegativeLogProbLoss(
      tf.constant(MEAN), tf.constant(VAR),
      tf.constant(TARGET_REAL) if targets else None)


def _mean_var_nll(n):
  def nll(z):
    mu, var = z[:D], z[D:]
    return 0.5 * tf.reduce_sum((TARGET_REAL[n] - mu)**2 / var +
                               tf.math.log(2 * np.pi * var))
  return nll


def test_mean_variance_fisher():
  loss = _mean_var_loss()
  b = _columns(loss.multiply_fisher_factor, 2 * D)
  for n in range(N):
    expected = np.diag(np.concatenate([1 / VAR[n], 0.5 / VAR[n]**2]))
    np.testing.assert_allclose(b[n] @ b[n].T, expected, **TOL)
  for k in range(2 * D):
    col = _flat_inputs(loss.multiply_fisher_factor_replicated_one_hot([k]))
    np.testing.assert_allclose(col, b[:, :, k], **TOL)


def test_mean_variance_ggn_is_indefinite_hessian_with_signed_factor():
  loss = _mean_var_loss()
  signs = loss.ggn_factor_signs
  np.testing.assert_array_equal(signs, [1] * D + [-1] * D)
  b = _columns(loss.multiply_ggn_factor, 2 * D)
  vm, vv = RNG.randn(N, D), RNG.randn(N, D)
  hv = _flat_inputs(loss.multiply_ggn((tf.constant(vm), tf.constant(vv))))
  for n in range(N):
    row = np.concatenate([MEAN[n], VAR[n]])
    hess = ref.tape_hessian(_mean_var_nll(n), row)
    np.testing.assert_allclose(b[n] @ np.diag(signs) @ b[n].T, hess,
                               rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(hv[n], hess @ np.concatenate([vm[n], vv[n]]),
                               rtol=1e-9, atol=1e-10)
    fisher = np.diag(np.concatenate([1 / VAR[n], 0.5 / VAR[n]**2]))
    assert np.abs(hess - fisher).max() > 1e-3  # the GGN is not the Fisher
    assert np.linalg.eigvalsh(hess).min() < 0  # and it is indefinite
  bt = _columns(lambda u: loss.multiply_ggn_factor_transpose(
      tuple(tf.split(u, 2, axis=-1))), 2 * D)
  for n in range(N):
    np.testing.assert_allclose(bt[n], b[n].T, rtol=1e-9, atol=1e-12)
  for k in range(2 * D):
    col = _flat_inputs(loss.multiply_ggn_factor_replicated_one_hot([k]))
    np.testing.assert_allclose(col, b[:, :, k], rtol=1e-9, atol=1e-12)


def test_mean_variance_ggn_needs_targets():
  loss = _mean_var_loss(targets=False)
  with pytest.raises(ValueError, match="targets"):
    loss.multiply_ggn((tf.constant(MEAN), tf.constant(VAR)))


def test_evaluate_without_targets_names_the_loss():
  loss = lf.CategoricalLogitsNegativeLogProbLoss(tf.constant(LOGITS))
  with pytest.raises(ValueError, match="CategoricalLogitsNegativeLogProbLoss"):
    loss.evaluate()


def test_categorical_sampling_follows_probabilities():
  logits = tf.constant([[2.0, 0.0, -1.0]] * 20000)
  loss = lf.CategoricalLogitsNegativeLogProbLoss(logits)
  freq = np.bincount(loss.sample(seed=7).numpy(), minlength=3) / 20000.0
  # 3 binomial standard deviations at n=20000 are below 0.011
  np.testing.assert_allclose(freq, ref.softmax(np.array([2.0, 0.0, -1.0])),
                             atol=0.011)


def test_bernoulli_normal_and_onehot_sampling_follow_their_distributions():
  n = 40000
  # Bernoulli: per-column frequency within 4.5 standard deviations.
  logits = tf.constant(np.tile([[1.5, -0.5, 0.0]], [n, 1]))
  sample = lf.MultiBernoulliNegativeLogProbLoss(logits).sample(seed=3).numpy()
  p = ref.sigmoid(np.array([1.5, -0.5, 0.0]))
  assert set(np.unique(sample)) <= {0.0, 1.0}
  np.testing.assert_array_less(np.abs(sample.mean(0) - p),
                               4.5 * np.sqrt(p * (1 - p) / n))
  # Normal with fixed variance and with learned variance: mean and variance.
  mean = tf.constant(np.tile([[1.0, -2.0]], [n, 1]))
  for loss, var in (
      (lf.NormalMeanNegativeLogProbLoss(mean, 0.7), np.array([0.7, 0.7])),
      (lf.NormalMeanVarianceNegativeLogProbLoss(
          mean, tf.constant(np.tile([[0.3, 2.0]], [n, 1]))),
       np.array([0.3, 2.0]))):
    draws = loss.sample(seed=4).numpy()
    np.testing.assert_array_less(np.abs(draws.mean(0) - [1.0, -2.0]),
                                 4.5 * np.sqrt(var / n))
    # sample variance: standard error sqrt(2/n) var
    np.testing.assert_array_less(np.abs(draws.var(0) - var),
                                 4.5 * np.sqrt(2.0 / n) * var)
  # One-hot categorical: rows are one-hot.
  onehot = lf.OnehotCategoricalLogitsNegativeLogProbLoss(
      tf.constant(LOGITS)).sample(seed=5).numpy()
  np.testing.assert_array_equal(onehot.sum(-1), np.ones(N))
  assert set(np.unique(onehot)) <= {0.0, 1.0}


@pytest.mark.slow  # subprocess without tfp
def test_kfac_works_without_tensorflow_probability():
  """tfp >= 0.24 cannot import its distributions without tf_keras (which
  drags in the full tensorflow wheel); the core must not need it."""
  import os
  import subprocess
  import sys
  import kfac
  script = (
      "import sys\n"
      "sys.modules['tensorflow_probability'] = None\n"
      "sys.modules['tf_keras'] = None\n"
      "import tensorflow as tf, kfac\n"
      "loss = kfac.loss_functions.CategoricalLogitsNegativeLogProbLoss(\n"
      "    tf.zeros([4, 3]))\n"
      "print(int(tf.size(loss.sample(seed=1))))\n"
      "try:\n"
      "  loss.dist\n"
      "except ImportError as e:\n"
      "  print('dist:', 'tensorflow-probability' in str(e))\n")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  env["PYTHONPATH"] = os.pathsep.join(
      [os.path.dirname(os.path.dirname(kfac.__file__))] +
      [p for p in [env.get("PYTHONPATH")] if p])
  out = subprocess.run([sys.executable, "-c", script], env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split("\n")[:2] == ["4", "dist: True"], out.stdout
