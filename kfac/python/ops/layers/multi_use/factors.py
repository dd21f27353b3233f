"""Factors of dense layers whose weights are shared.

* `FullyConnectedReduceKroneckerFactor`: the KFAC-reduce statistics
  (Eschenhagen et al. 2023): the second moment over examples of the layer
  inputs averaged (or output gradients summed) over the shared positions.
* `FullyConnectedMultiKF`: the statistics of a layer used several times in
  order (time steps): A_0 = E[x_t x_t^T] over uses and examples, and the
  lag-one cross moment A_1 = E[x_t x_{t+1}^T] (Martens, Ba & Johnson 2018),
  with the quantities the closed-form inverses of `kron_series_1` /
  `kron_series_2` need.

Multi-use tensors are *folded*, time-major: rows [t * batch, (t+1) * batch)
of a [num_uses * batch, n] tensor are use t (the concatenation of a list of
per-use [batch, n] tensors along axis 0).
"""

import tensorflow as tf

from kfac.python.ops.numerics import linalg
from kfac.python.ops.tensors import utils
from kfac.python.ops.layers.dense.factors import FullyConnectedKroneckerFactor
from kfac.python.ops.layers.base.factors import weighted_sum

__all__ = ["FullyConnectedReduceKroneckerFactor", "FullyConnectedMultiKF"]

# Upper clip of the singular values of the option-2 whitened transition (see
# FullyConnectedMultiKF): keeps the modelled AR(1) process stationary, so
# that its noise covariance Q stays positive definite.
MAX_OPTION2_SINGULAR_VALUE = 0.999


class FullyConnectedReduceKroneckerFactor(FullyConnectedKroneckerFactor):
  """Second moment over examples of tensors reduced over shared positions.

  Each [batch, P..., n] tower is reduced over its middle axes (`reduction`
  "mean" for layer inputs, "sum" for output gradients) to [batch, n]; a
  ones column is appended after the reduction when `has_bias` (the mean of
  [a, 1] is [mean a, 1]). Rank-2 tensors are used as they are, so on
  [batch, n] tensors this is `FullyConnectedKroneckerFactor`.
  """

  def __init__(self, tensors, reduction="mean", has_bias=False, weights=None,
               name=None, output_axes=1):
    if reduction not in ("mean", "sum"):
      raise ValueError("reduction must be 'mean' or 'sum', got %r." %
                       (reduction,))
    self._reduction = reduction
    super().__init__(tensors, has_bias, weights, name, output_axes)

  def _reduce(self, x):
    rank = x.shape.rank
    if rank is None:
      raise ValueError("KFAC-reduce needs tensors of known rank, got %s." % x)
    if rank == 2:
      return x
    axes = list(range(1, rank - 1))
    if self._reduction == "mean":
      return tf.reduce_mean(x, axis=axes)
    return tf.reduce_sum(x, axis=axes)

  def _source_matrices(self):
    out = []
    for towers in self._moments.sources:
      parts = [self._reduce(self._moments.flat(t)) for t in towers]
      x = parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)
      out.append(utils.append_homog(x) if self._moments.has_bias else x)
    return out


class FullyConnectedMultiKF(FullyConnectedKroneckerFactor):
  """Statistics of a layer used `num_uses` times in order.

  `tensors` are folded, time-major [num_uses * batch, n] tensors (one per
  tower, or per source and tower for output gradients). The statistic
  (`get_cov`) is A_0 = E[x_t x_t^T], the mean over all uses and examples,
  as for `FullyConnectedKroneckerFactor`; `get_cov_dt1` is the lag-one
  cross moment A_1 = E[x_t x_{t+1}^T], the mean over examples and the
  num_uses - 1 consecutive pairs of uses (zero for one use). Both are
  moving-averaged with the same zero-debiased weights.

  The series blocks register the quantities of their closed-form inverses
  per damping function (`register_option1quants` / `register_option2quants`);
  they are refreshed by `make_inverse_update_ops`. With a damping function
  of value d and scale s (see layers/base/damping.py), C_0 = s A_0 + d I and
  C_1 = s A_1 are used:

  * option 1: C_0^{-1/2} sym(C_1) C_0^{-1/2} = U diag(psi) U^T, kept as
    L = C_0^{-1/2} U and psi clipped to [0, 1];
  * option 2: the whitened transition C_0^{-1/2} C_1^T C_0^{-1/2} =
    E diag(sigma) V^T (an SVD), sigma clipped to at most
    MAX_OPTION2_SINGULAR_VALUE; kept are the transition
    P = C_0^{1/2} E diag(sigma) V^T C_0^{-1/2} (= C_1^T C_0^{-1} unclipped),
    K = C_0^{-1/2} E and mu = sigma^2 (the eigenvalues of
    C_0^{-1/2} P C_0 P^T C_0^{-1/2}).
  """

  def __init__(self, tensors, num_uses, has_bias=False, weights=None,
               name=None):
    if (not isinstance(num_uses, int) or isinstance(num_uses, bool) or
        num_uses < 1):
      raise ValueError("num_uses must be a positive Python int, got %r." %
                       (num_uses,))
    super().__init__(tensors, has_bias, weights, name)
    self._num_uses = num_uses
    self._cov_dt1 = None
    self._option1 = []  # damping funcs
    self._option2 = []
    self._series_vars = {}  # (option, damping key) -> tuple of variables

  @property
  def num_uses(self):
    return self._num_uses

  # ------------------------------------------------------------ statistics
  def instantiate_cov_variables(self):
    super().instantiate_cov_variables()
    if self._cov_dt1 is None:
      self._cov_dt1 = self.state_store.get_or_create(
          self.name + "/cov_dt1", self._cov_shape, self._dtype)

  def get_cov_dt1(self):
    self.instantiate_cov_variables()
    return self._cov_dt1

  def _compute_new_cov_dt1(self):
    uses = self._num_uses
    if uses == 1:
      return tf.zeros(self._cov_shape, self._dtype)
    terms = []
    for towers in self._moments.sources:
      total, count = None, None
      for x in towers:
        x = tf.reshape(x, [-1, x.shape[-1]])
        if self._moments.has_bias:
          x = utils.append_homog(x)
        rows = tf.shape(x)[0]
        batch = rows // uses
        part = tf.matmul(x[:rows - batch], x[batch:], transpose_a=True)
        pairs = tf.cast(rows - batch, x.dtype)
        total = part if total is None else total + part
        count = pairs if count is None else count + pairs
      terms.append(total / count)
    return weighted_sum(terms, self._weights)

  def covariance_statistics(self):
    """A_0 (symmetric) and the lag-one A_1 (not symmetric)."""
    return [(tf.cast(self._compute_new_cov(), self._dtype), True),
            (tf.cast(self._compute_new_cov_dt1(), self._dtype), False)]

  def make_covariance_assign_op(self, statistics, ema_decay, ema_weight=None):
    """Folds A_0 and A_1 into their zero-debiased averages (`ema_weight`:
    see FisherFactor.make_covariance_assign_op)."""
    self.instantiate_cov_variables()
    new_cov, new_cov_dt1 = statistics
    decay = utils.cast(ema_decay, self._dtype)
    weight = (1.0 - decay if ema_weight is None else
              utils.cast(ema_weight, self._dtype))
    old_weight = tf.convert_to_tensor(self._cov_weight)
    carried = decay * old_weight
    new_weight = carried + weight

    def averaged(var, new):
      return (carried * tf.convert_to_tensor(var) +
              weight * new) / new_weight

    cov = averaged(self._cov_var, new_cov)
    cov_dt1 = averaged(self._cov_dt1, new_cov_dt1)
    return tf.group(self._cov_var.assign(cov), self._cov_dt1.assign(cov_dt1),
                    self._cov_weight.assign(new_weight),
                    name=utils.variable_name(self._cov_var) + "_update")

  # ------------------------------------------------- series inverse parts
  def _check_series_psd(self):
    if not self._psd:
      raise ValueError(
          "Factor %s may be indefinite (negative-weight GGN sources); the "
          "kron_series approximations need a PSD factor. Use kron_indep or "
          "another estimation mode." % self.name)

  def register_option1quants(self, damping_func):
    self._check_series_psd()
    if not any(d.key == damping_func.key for d in self._option1):
      self._option1.append(damping_func)

  def register_option2quants(self, damping_func):
    self._check_series_psd()
    if not any(d.key == damping_func.key for d in self._option2):
      self._option2.append(damping_func)

  def _series_registrations(self):
    n = self._n
    for i, dfunc in enumerate(self._option1):
      yield (1, dfunc, (("opt1_L%d" % i, [n, n]), ("opt1_psi%d" % i, [n])))
    for i, dfunc in enumerate(self._option2):
      yield (2, dfunc, (("opt2_P%d" % i, [n, n]), ("opt2_K%d" % i, [n, n]),
                        ("opt2_mu%d" % i, [n])))

  def instantiate_inv_variables(self):
    super().instantiate_inv_variables()
    for option, dfunc, parts in self._series_registrations():
      key = (option, dfunc.key)
      if key not in self._series_vars:
        self._series_vars[key] = tuple(
            self.state_store.get_or_create(self.name + "/" + suffix, shape,
                                           self._dtype)
            for suffix, shape in parts)
        # Listed with the other inverse variables (FisherEstimator's
        # get_inv_vars reads `_vars`; the update ops do not).
        for j, var in enumerate(self._series_vars[key]):
          self._vars[("series%d" % option, j, dfunc.key)] = var

  def _damped_parts(self, dfunc):
    """(C_1, C_0^{1/2}, C_0^{-1/2}) of the class docstring."""
    cov = tf.convert_to_tensor(self.get_cov_var())
    cov_dt1 = tf.convert_to_tensor(self.get_cov_dt1())
    c0 = linalg.add_to_diagonal(linalg.symmetrize(dfunc.scale(cov)),
                                utils.cast(dfunc(), self._dtype))
    c1 = dfunc.scale(cov_dt1)
    evals, evecs = linalg.eigh(c0)

    def power(exp):
      return linalg.symmetrize(tf.matmul(
          evecs * tf.pow(evals, utils.cast(exp, evals.dtype))[tf.newaxis, :],
          evecs, transpose_b=True))

    return c1, power(0.5), power(-0.5)

  def _option1_quants(self, dfunc):
    c1, _, inv_sqrt = self._damped_parts(dfunc)
    hat_psi = tf.matmul(tf.matmul(inv_sqrt, linalg.symmetrize(c1)), inv_sqrt)
    psi, u = linalg.eigh(hat_psi)
    return (tf.matmul(inv_sqrt, u), tf.clip_by_value(psi, 0.0, 1.0))

  def _option2_quants(self, dfunc):
    c1, sqrt, inv_sqrt = self._damped_parts(dfunc)
    # The whitened transition C_0^{-1/2} C_1^T C_0^{-1/2} = U diag(s) V^T,
    # with its singular values clipped to MAX_OPTION2_SINGULAR_VALUE.
    whitened = tf.matmul(tf.matmul(inv_sqrt, c1, transpose_b=True), inv_sqrt)
    s, u, v = tf.linalg.svd(whitened)
    s = tf.minimum(s, utils.cast(MAX_OPTION2_SINGULAR_VALUE, s.dtype))
    clipped = tf.matmul(u * s[tf.newaxis, :], v, transpose_b=True)
    transition = tf.matmul(tf.matmul(sqrt, clipped), inv_sqrt)
    return transition, tf.matmul(inv_sqrt, u), tf.square(s)

  def inverse_values(self):
    ops = list(super().inverse_values())
    self.instantiate_inv_variables()
    for option, dfunc, _ in self._series_registrations():
      variables = self._series_vars[(option, dfunc.key)]
      values = (self._option1_quants(dfunc) if option == 1 else
                self._option2_quants(dfunc))
      ops.extend((v, tf.cast(x, self._dtype))
                 for v, x in zip(variables, values))
    return ops

  def _get_series(self, option, damping_func):
    key = (option, damping_func.key)
    if key not in self._series_vars:
      self.instantiate_inv_variables()
    if key not in self._series_vars:
      raise ValueError(
          "No option-%d series quantities with damping %r were registered on "
          "factor %s; register the block's inverse first." %
          (option, damping_func.key, self.name))
    return self._series_vars[key]

  def get_option1quants(self, damping_func):
    """(L, psi) of the module docstring for `damping_func`."""
    return self._get_series(1, damping_func)

  def get_option2quants(self, damping_func):
    """(P, K, mu) of the module docstring for `damping_func`."""
    return self._get_series(2, damping_func)
