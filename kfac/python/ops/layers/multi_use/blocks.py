"""Blocks of dense layers whose weights are shared.

* `FullyConnectedKFACReduceFB` ("kron_reduce"): KFAC-reduce for a layer
  applied at several positions in one call ([batch, P..., in] inputs;
  Eschenhagen et al. 2023, "Kronecker-Factored Approximate Curvature for
  Modern Neural Network Architectures").
* `FullyConnectedMultiIndepFB` ("kron_indep" and its diagonal variants) and
  `FullyConnectedSeriesFB` ("kron_series_1", "kron_series_2"): a layer used
  several times (time steps of an RNN, tied weights), registered with
  `register_fully_connected_multi` (Martens, Ba & Johnson 2018,
  "Kronecker-factored curvature approximations for recurrent neural
  networks").

Conventions (see docs/weight_sharing.md): the curvature is that of the
per-example loss averaged over the N examples (the leading dimension of the
registered inputs), F = (1/N) sum_n J_n^T Lambda_n J_n, where an example's
loss sums over its positions / uses.
"""

import tensorflow as tf

from kfac.python.ops.layers.multi_use import factors as multi_use_factors
from kfac.python.ops.tensors import utils
from kfac.python.ops.layers.base.blocks import KroneckerProductFB
from kfac.python.ops.layers.dense.blocks import _DenseLayerBlock

__all__ = ["FullyConnectedKFACReduceFB", "FullyConnectedMultiIndepFB",
           "FullyConnectedSeriesFB", "SeriesFBApproximation"]


class FullyConnectedKFACReduceFB(_DenseLayerBlock, KroneckerProductFB):
  """KFAC-reduce block of a dense layer shared over positions.

  For inputs a_np ([batch, P..., in]) and output gradients g_np:
  A = E_n[abar_n abar_n^T] with abar_n = mean_p a_np (a ones entry appended
  for the bias), G = E_n[gsum_n gsum_n^T] with gsum_n = sum_p g_np, and the
  block is A (x) G (coefficient 1, damping not normalised). It is exact (in
  the exact / exact_GGN modes, any batch) when the per-example gradient
  sum_p a_np g_np^T equals abar_n gsum_n^T, e.g. when the positions are
  averaged right after the layer in a network linear after it; KFAC-expand
  ("kron") is exact when each position has a loss term of its own. On
  [batch, in] inputs it equals "kron".
  """

  def __init__(self, layer_collection, has_bias=False, params=None):
    _DenseLayerBlock.__init__(self, layer_collection, has_bias, params)

  def instantiate_factors(self, grads_list, damping, weights=None):
    cls = multi_use_factors.FullyConnectedReduceKroneckerFactor
    self._input_factor = self._make_factor(
        cls, (tuple(self._inputs), "mean", self._has_bias), "A")
    weights = None if weights is None else tuple(weights)
    args = (tuple(tuple(g) for g in grads_list), "sum", False, weights)
    if self._output_axes != 1:
      args += (None, self._output_axes)
    self._output_factor = self._make_factor(cls, args, "G")
    self._setup_damping(damping)


class _MultiUseDenseBlock(_DenseLayerBlock):
  """Towers of a dense layer used `num_uses` times.

  A tower's inputs / outputs are a tuple of per-use [batch, n] tensors or one
  folded, time-major [num_uses * batch, n] tensor. Statistics use the folded
  form (lists are concatenated along the batch axis).
  """

  def __init__(self, layer_collection, has_bias=False, num_uses=None,
               params=None):
    if (not isinstance(num_uses, int) or isinstance(num_uses, bool) or
        num_uses < 1):
      raise ValueError("%s needs num_uses, a positive Python int; got %r." %
                       (type(self).__name__, num_uses))
    _DenseLayerBlock.__init__(self, layer_collection, has_bias, params)
    self._num_uses = num_uses

  @property
  def num_uses(self):
    return self._num_uses

  def register_additional_tower(self, inputs, outputs):
    if isinstance(inputs, list):
      inputs = tuple(inputs)
    if isinstance(outputs, list):
      outputs = tuple(outputs)
    super().register_additional_tower(inputs, outputs)

  def tensors_to_compute_grads(self):
    out = []
    for outputs in self._outputs:
      out.extend(utils.ensure_sequence(outputs))
    return tuple(out)

  @staticmethod
  def _fold(x):
    if isinstance(x, tuple):
      return x[0] if len(x) == 1 else tf.concat(list(x), axis=0)
    return x

  def _folded_inputs(self):
    return tuple(self._fold(x) for x in self._inputs)

  def _folded_grads(self, grads_list):
    """grads_list (sources of flat tuples matching tensors_to_compute_grads)
    -> tuple over sources of tuples over towers of folded gradients."""
    out = []
    for grads in grads_list:
      grads = tuple(grads)
      towers, start = [], 0
      for outputs in self._outputs:
        count = len(utils.ensure_sequence(outputs))
        towers.append(self._fold(grads[start:start + count]))
        start += count
      out.append(tuple(towers))
    return tuple(out)


class FullyConnectedMultiIndepFB(_MultiUseDenseBlock, KroneckerProductFB):
  """K-FAC for a layer used num_uses times, uses treated as independent.

  A = E[a a^T] and G = E[g g^T] are means over all uses and examples (with a
  ones entry for the bias); the block is num_uses * A (x) G, damping
  normalised to damping / num_uses before the pi split (so the damped block
  is num_uses * (A (x) G) + damping, approximately). It is exact when every
  use has loss terms of its own and the per-use gradients of an example are
  uncorrelated across uses (e.g. tied weights applied to separate inputs,
  each with its own output, in a network linear after the layer). The
  `diagonal_approx_for_input/output` flags give kron_indep_in_diag,
  kron_indep_out_diag and kron_indep_both_diag.
  """

  def __init__(self, layer_collection, has_bias=False, num_uses=None,
               diagonal_approx_for_input=False,
               diagonal_approx_for_output=False, params=None):
    _MultiUseDenseBlock.__init__(self, layer_collection, has_bias, num_uses,
                                 params)
    self._diag_in = diagonal_approx_for_input
    self._diag_out = diagonal_approx_for_output

  @property
  def approximation(self):
    suffix = {(False, False): "", (True, False): "_in_diag",
              (False, True): "_out_diag", (True, True): "_both_diag"}
    return "kron_indep" + suffix[(bool(self._diag_in), bool(self._diag_out))]

  @property
  def _renorm_coeff(self):
    return self._num_uses

  def instantiate_factors(self, grads_list, damping, weights=None):
    self._make_kronecker_factors(self._folded_inputs(),
                                 self._folded_grads(grads_list), weights)
    self._setup_damping(damping)


class SeriesFBApproximation:
  """The two closed forms of Martens, Ba & Johnson (2018), section 3.5."""
  option1 = 1
  option2 = 2


class FullyConnectedSeriesFB(_MultiUseDenseBlock, KroneckerProductFB):
  """The "temporal" K-FAC of Martens, Ba & Johnson (2018) for a layer used
  num_uses = T times in order.

  The per-use gradient contributions w_t = vec(a_t g_t^T) are modelled as a
  stationary AR(1) process with Kronecker-factored moments:
  V_0 = E[w_t w_t^T] ~ A_0 (x) G_0, E[w_t w_{t+1}^T] ~ A_1 (x) G_1, so
  w_{t+1} = Psi w_t + noise with Psi = Psi_A (x) Psi_G,
  Psi_A = A_1^T A_0^{-1}. The block approximates
  F = sum_{t,s} E[w_t w_s^T] = sum_{|d|<T} (T - |d|) C(d), C(d) = V_0 (Psi^T)^d.

  * option 1 ("kron_series_1"): A_1, G_1 symmetrised (a time-reversible
    process); F = V_0^{1/2} zeta_T(hatPsi) V_0^{1/2} with
    hatPsi = V_0^{-1/2} V_1 V_0^{-1/2} = hatPsi_A (x) hatPsi_G and
    zeta_T(x) = sum_{|d|<T} (T - |d|) x^|d|
              = (T (1 - x^2) - 2 x (1 - x^T)) / (1 - x)^2.
    With hatPsi_A = U_A diag(psi_A) U_A^T, L_A = A_0^{-1/2} U_A:
    F^{-1} Z = L_A [gamma o (L_A^T Z L_G)] L_G^T, gamma_ij = 1 / zeta_T(psi_A,i psi_G,j).
  * option 2 ("kron_series_2"): the T -> infinity limit, no symmetry:
    F ~ T (I - Psi)^{-1} Q (I - Psi^T)^{-1} with Q = V_0 - Psi V_0 Psi^T
    (T times the sum of all autocovariances), so
    F^{-1} = (1/T) (I - Psi^T) Q^{-1} (I - Psi) and
    Q^{-1} Z = K_A [(K_A^T Z K_G) / (1 - mu_A mu_G^T)] K_G^T with
    A_0^{-1/2} A_1^T A_0^{-1} A_1 A_0^{-1/2} = E_A diag(mu_A) E_A^T,
    K_A = A_0^{-1/2} E_A.

  Damping: A_0 and G_0 are damped as in kron_indep (factored Tikhonov,
  damping / T split with the pi rule), A_1 and G_1 are not; so with zero
  cross moments both options give exactly the kron_indep inverse.

  Estimated moments need not describe a stationary process (A_0 averages
  all T uses, A_1 the T - 1 pairs), so for safety: option 1 clips psi to
  [0, 1] (then zeta_T >= T: the inverse is never larger than kron_indep's;
  negative temporal correlations are ignored); option 2 clips the singular
  values of the whitened transition A_0^{-1/2} A_1^T A_0^{-1/2} to at most
  0.999 (`multi_use_factors.MAX_OPTION2_SINGULAR_VALUE`) and uses the
  clipped transition everywhere, which keeps Q positive definite.

  Only the inverse is defined: `multiply_inverse` / `multiply_matpower(v,
  -1)`. Other powers, `multiply`, Cholesky products and `full_fisher_block`
  raise NotImplementedError.
  """

  def __init__(self, layer_collection, has_bias=False, num_uses=None,
               option=SeriesFBApproximation.option2, params=None):
    _MultiUseDenseBlock.__init__(self, layer_collection, has_bias, num_uses,
                                 params)
    option = {"option1": 1, "option2": 2}.get(option, option)
    if option not in (1, 2):
      raise ValueError("FullyConnectedSeriesFB option must be 1 or 2 "
                       "(SeriesFBApproximation.option1/option2), got %r." %
                       (option,))
    self._option = option

  @property
  def option(self):
    return self._option

  @property
  def approximation(self):
    return "kron_series_%d" % self._option

  @property
  def _renorm_coeff(self):
    return self._num_uses

  def instantiate_factors(self, grads_list, damping, weights=None):
    cls = multi_use_factors.FullyConnectedMultiKF
    self._input_factor = self._make_factor(
        cls, (self._folded_inputs(), self._num_uses, self._has_bias), "A")
    weights = None if weights is None else tuple(weights)
    self._output_factor = self._make_factor(
        cls, (self._folded_grads(grads_list), self._num_uses, False, weights),
        "G")
    self._setup_damping(damping)

  def _inverse_only(self, what):
    return NotImplementedError(
        "%s of layer %s is not available: the %s approximation (%s) defines "
        "only the inverse (multiply_inverse, multiply_matpower with "
        "exponent -1)." % (what, self.name, self.approximation,
                           type(self).__name__))

  def register_matpower(self, exp):
    self._check_instantiated()
    if exp == 1:
      raise self._inverse_only("multiply")
    if exp != -1:
      raise self._inverse_only("Matrix power %s" % (exp,))
    register = ("register_option1quants" if self._option == 1 else
                "register_option2quants")
    getattr(self._input_factor, register)(self._in_damping)
    getattr(self._output_factor, register)(self._out_damping)

  def register_cholesky(self):
    raise self._inverse_only("A Cholesky factor")

  def register_cholesky_inverse(self):
    raise self._inverse_only("An inverse Cholesky factor")

  def multiply_matpower(self, vector, exp):
    if exp != -1:
      raise self._inverse_only("multiply" if exp == 1 else
                               "Matrix power %s" % (exp,))
    self._check_instantiated()
    mat = self._to_mat(vector)
    if self._option == 1:
      out = self._option1_inverse(mat)
    else:
      out = self._option2_inverse(mat)
    return self._from_mat(out, vector)

  def _multiply_cholesky(self, vector, transpose, inverse):
    raise self._inverse_only("A Cholesky product")

  def full_fisher_block(self):
    raise self._inverse_only("full_fisher_block")

  def _option1_inverse(self, mat):
    l_a, psi_a = self._input_factor.get_option1quants(self._in_damping)
    l_g, psi_g = self._output_factor.get_option1quants(self._out_damping)
    x = (tf.cast(psi_a, tf.float64)[:, tf.newaxis] *
         tf.cast(psi_g, tf.float64)[tf.newaxis, :])
    gamma = tf.cast(1.0 / zeta(x, self._num_uses), mat.dtype)
    inner = tf.matmul(tf.matmul(l_a, mat, transpose_a=True), l_g)
    return tf.matmul(tf.matmul(l_a, gamma * inner), l_g, transpose_b=True)

  def _option2_inverse(self, mat):
    p_a, k_a, mu_a = self._input_factor.get_option2quants(self._in_damping)
    p_g, k_g, mu_g = self._output_factor.get_option2quants(self._out_damping)
    # (I - Psi) Z = Z - Psi_A Z Psi_G^T
    y = mat - tf.matmul(tf.matmul(p_a, mat), p_g, transpose_b=True)
    # Q^{-1}
    y = tf.matmul(tf.matmul(k_a, y, transpose_a=True), k_g)
    y = y / (1.0 - mu_a[:, tf.newaxis] * mu_g[tf.newaxis, :])
    y = tf.matmul(tf.matmul(k_a, y), k_g, transpose_b=True)
    # (I - Psi^T) Y = Y - Psi_A^T Y Psi_G, and the 1/T
    y = y - tf.matmul(tf.matmul(p_a, y, transpose_a=True), p_g)
    return y / utils.cast(float(self._num_uses), y.dtype)


# zeta_T(x) is evaluated in closed form in float64 with x clipped to at most
# 1 - ZETA_EPS: the closed form cancels near x = 1, with a relative error of
# about 2 eps64 / (T (1 - x)), and zeta_T(1 - delta) = T^2 (1 - O(T delta)).
ZETA_EPS = 1e-7


def zeta(x, num_uses):
  """zeta_T(x) = sum_{|d|<T} (T - |d|) x^|d| for x in [0, 1] (float64)."""
  t = float(num_uses)
  x = tf.clip_by_value(tf.cast(x, tf.float64), 0.0, 1.0 - ZETA_EPS)
  one_minus = 1.0 - x
  return (t * (1.0 - x * x) - 2.0 * x * (1.0 - tf.pow(x, t))) / (
      one_minus * one_minus)
