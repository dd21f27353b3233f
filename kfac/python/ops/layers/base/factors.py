"""Fisher factors: one statistic each, its moving average and its inverses.

A factor is built from symbolic tensors (layer inputs, gradients w.r.t. layer
outputs, parameter gradients) and keeps an exponential moving average of its
statistic in a variable. The average is zero-initialised and zero-debiased:
with a weight w_t = decay * w_{t-1} + (1 - decay) (w_0 = 0) the stored value
is sum_s decay^(t-s) (1-decay) stat_s / w_t, so after the first update it
equals the first statistic exactly.

Statistics built from several *sources* (the gradient lists of an estimation
mode: one per sample, per one-hot output index, ...) add up with per-source
weights (+1, or -1 for the negative part of an indefinite GGN).

Variables live in a `StateStore` (see tensors/state.py) under `<factor name>/...`.
"""

import abc

import tensorflow as tf

from kfac.python.ops.layers.base import curvature_options as options_lib
from kfac.python.ops.numerics import batched_inverse
from kfac.python.ops.numerics import linalg
from kfac.python.ops.tensors import state
from kfac.python.ops.tensors import utils
from kfac.python.ops.reliability import nonfinite


def normalize_sources(tensors):
  """-> list over sources of tuples over towers."""
  if utils.is_tensor_or_variable(tensors):
    return [(tensors,)]
  tensors = list(tensors)
  if tensors and all(utils.is_tensor_or_variable(t) for t in tensors):
    return [tuple(tensors)]
  return [utils.ensure_sequence(t) for t in tensors]


def normalize_weights(weights, num_sources):
  if weights is None:
    return [1.0] * num_sources
  weights = [float(w) for w in weights]
  if len(weights) != num_sources:
    raise ValueError("Got %d source weights for %d sources." %
                     (len(weights), num_sources))
  return weights


def concat_towers(towers, has_bias=False):
  x = towers[0] if len(towers) == 1 else tf.concat(list(towers), axis=0)
  x = tf.reshape(x, [-1, x.shape[-1]])
  return utils.append_homog(x) if has_bias else x


def merge_trailing_axes(x, num_axes=1):
  """x [..., d_1, ..., d_k] -> [..., d_1 * ... * d_k] (k = num_axes, the
  trailing dims static): the output axes of a dense layer whose weight has
  several of them (register_fully_connected's output_axes), flattened in
  the weight's row-major order. x itself when k == 1."""
  if num_axes == 1:
    return x
  trailing = x.shape[-num_axes:]
  if x.shape.rank is None or not trailing.is_fully_defined():
    raise ValueError("Tensor %s needs %d static trailing (output) axes, got "
                     "shape %s." % (x.name if hasattr(x, "name") else x,
                                    num_axes, x.shape))
  width = int(trailing.num_elements())
  lead = x.shape[:-num_axes]
  if lead.is_fully_defined():
    return tf.reshape(x, lead.as_list() + [width])
  flat = tf.reshape(x, tf.concat([tf.shape(x)[:-num_axes], [width]], 0))
  flat.set_shape(lead.concatenate([width]))
  return flat


def weighted_sum(terms, weights):
  total = None
  for term, w in zip(terms, weights):
    term = term if w == 1.0 else term * utils.cast(w, term.dtype)
    total = term if total is None else total + term
  return total


class MovingAverageView:
  """kfac 0.2.x's MovingAverageVariable interface over a factor's two
  variables: the zero-debiased average (`_var`) and its total weight
  (`_total_weight`).

  0.2.x kept the weighted sum in `_var` and divided by the weight when
  read; here `_var` holds the average itself, so `value` reads it as it is.
  `add_to_average(value, decay, weight)` gives the average 0.2.x's would
  read after the same call: the old sum decays by `decay`, `value` joins
  with `weight`, and the weight becomes decay * weight + `weight`.
  """

  def __init__(self, var, total_weight):
    self._var = var
    self._total_weight = total_weight

  @property
  def dtype(self):
    return self._var.dtype.base_dtype

  @property
  def value(self):
    return tf.convert_to_tensor(self._var)

  def add_to_average(self, value, decay=1.0, weight=1.0):
    """Folds `value` (the statistic's shape and dtype) into the average;
    returns the op (in a graph) that assigns both variables."""
    value = tf.convert_to_tensor(value, dtype=self.dtype)
    if not value.shape.is_compatible_with(self._var.shape):
      raise ValueError(
          "add_to_average: value of shape %s for the statistic %s of shape "
          "%s" % (value.shape, utils.variable_name(self._var),
                  self._var.shape))
    decay = utils.cast(decay, self.dtype)
    weight = utils.cast(weight, self.dtype)
    carried = decay * tf.convert_to_tensor(self._total_weight)
    new_weight = carried + weight
    averaged = (carried * tf.convert_to_tensor(self._var) +
                weight * value) / new_weight
    return tf.group(self._var.assign(averaged),
                    self._total_weight.assign(new_weight))

  def reset(self):
    return tf.group(self._var.assign(tf.zeros_like(self._var)),
                    self._total_weight.assign(
                        tf.zeros_like(self._total_weight)))


class FisherFactor(abc.ABC):
  """Base class: a moving-averaged statistic kept in a variable."""

  # Set by the LayerCollection that makes the factor (layers/base/curvature_options.py).
  curvature_options = options_lib.CurvatureOptions()

  def __init__(self, name=None):
    self._name = name or type(self).__name__
    self._store = None
    self._cov_var = None
    self._cov_weight = None

  @property
  def name(self):
    return self._name

  def set_name(self, name):
    self._name = name

  def set_curvature_options(self, options):
    self.curvature_options = options_lib.check(options)

  def attach_state_store(self, store):
    """Uses `store` for this factor's variables (the optimizer's store, so
    they survive retracing)."""
    self._store = store

  @property
  def state_store(self):
    if self._store is None:
      self._store = state.StateStore("kfac_factors")
    return self._store

  @property
  @abc.abstractmethod
  def _cov_shape(self):
    """Static shape of the statistic (a list of ints)."""

  @property
  def cov_shape(self):
    """Static shape of the statistic (a list of ints)."""
    return self._cov_shape

  @property
  @abc.abstractmethod
  def _dtype(self):
    pass

  @abc.abstractmethod
  def _compute_new_cov(self):
    """The statistic of the current mini-batch."""

  @property
  def dtype(self):
    return self._dtype

  def instantiate_cov_variables(self):
    if self._cov_var is None:
      self._cov_var = self.state_store.get_or_create(
          self.name + "/cov", self._cov_shape, self._dtype)
      self._cov_weight = self.state_store.get_or_create(
          self.name + "/cov_weight", [], self._dtype)

  def instantiate_inv_variables(self):
    """Makes the variables holding inverses (none for diagonal factors)."""

  def get_cov_var(self):
    self.instantiate_cov_variables()
    return self._cov_var

  @property
  def _cov(self):
    """kfac 0.2.x's private moving-average object, for code written for it
    (its own tests read `_cov._var` and call `_cov.add_to_average`): a
    MovingAverageView of this factor's statistic and weight variables, or
    None before they are made."""
    if self._cov_var is None:
      return None
    return MovingAverageView(self._cov_var, self._cov_weight)

  def covariance_statistics(self):
    """The current mini-batch's statistics, in the factor's dtype, and
    whether each is a symmetric matrix (for cross-replica packing)."""
    return [(tf.cast(self._compute_new_cov(), self._dtype),
             self._symmetric_statistic)]

  @property
  def _symmetric_statistic(self):
    return False

  def make_covariance_assign_op(self, statistics, ema_decay, ema_weight=None):
    """Folds `statistics` (as from covariance_statistics, possibly reduced
    across replicas) into the zero-debiased moving average. The new
    statistic gets the weight `ema_weight` (default 1 - ema_decay); the old
    average's weight is multiplied by ema_decay (ema_decay=1 with the
    default weight of the run's decay adds the statistic to an arithmetic
    mean, kfac 0.2.x's should_decay=False)."""
    self.instantiate_cov_variables()
    (new_cov,) = statistics
    decay = utils.cast(ema_decay, self._dtype)
    weight = (1.0 - decay if ema_weight is None else
              utils.cast(ema_weight, self._dtype))
    old_cov = tf.convert_to_tensor(self._cov_var)
    old_weight = tf.convert_to_tensor(self._cov_weight)
    carried = decay * old_weight
    new_weight = carried + weight
    averaged = (carried * old_cov + weight * new_cov) / new_weight
    return tf.group(self._cov_var.assign(averaged),
                    self._cov_weight.assign(new_weight),
                    name=utils.variable_name(self._cov_var) + "_update")

  def make_covariance_update_op(self, ema_decay, ema_weight=None):
    """Folds the current statistic into the zero-debiased moving average
    (`ema_weight`: see make_covariance_assign_op)."""
    stats = [t for t, _ in self.covariance_statistics()]
    if ema_weight is None:
      return self.make_covariance_assign_op(stats, ema_decay)
    return self.make_covariance_assign_op(stats, ema_decay, ema_weight)

  def inverse_values(self):
    """[(variable, new value)] of the inverse update (computed from the
    moving average; nothing assigned yet). None for diagonal factors."""
    return []

  def deferred_inverse_values(self):
    """inverse_values, except that a damped inverse may be given as a
    batched_inverse.DeferredInverse(mat, damping) that the caller computes
    together with those of other factors (estimation/estimator.py)."""
    return self.inverse_values()

  def inverse_variables(self):
    """The variables the inverse update writes (none for diagonal
    factors)."""
    self.instantiate_inv_variables()
    return list(getattr(self, "_vars", {}).values())

  def make_inverse_update_ops(self):
    """Assigns the new inverses; one that is not finite (after the float64
    retry of linalg) is not assigned: the factor keeps its previous one."""
    return [nonfinite.assign_if_finite(var, value)
            for var, value in self.inverse_values()]

  @abc.abstractmethod
  def get_cov(self):
    """The statistic as a dense matrix."""

  @property
  def cov(self):
    """The statistic (kfac 0.2.x's name; the same as get_cov())."""
    return self.get_cov()

  @abc.abstractmethod
  def normalized_trace(self):
    """trace(cov) / dim, used by the pi-adjusted damping split."""


class MatrixFactor(FisherFactor):
  """A factor whose (damped) powers and Cholesky factors are matrices (or
  batches of matrices, acting on batches of matrices x) given by
  `get_matpower`, `get_cholesky` and `get_cholesky_inverse`: products are
  matmuls with them."""

  def left_multiply_matpower(self, x, exp, damping_func):
    return tf.matmul(self.get_matpower(exp, damping_func), x)

  def right_multiply_matpower(self, x, exp, damping_func):
    return tf.matmul(x, self.get_matpower(exp, damping_func))

  def left_multiply_cholesky(self, x, damping_func, transpose=False,
                             inverse=False):
    mat = (self.get_cholesky_inverse(damping_func) if inverse else
           self.get_cholesky(damping_func))
    return tf.matmul(mat, x, transpose_a=transpose)

  def right_multiply_cholesky(self, x, damping_func, transpose=False,
                              inverse=False):
    mat = (self.get_cholesky_inverse(damping_func) if inverse else
           self.get_cholesky(damping_func))
    return tf.matmul(x, mat, transpose_b=transpose)


class DenseSquareFactor(MatrixFactor):
  """A factor whose statistic is a full symmetric [n, n] matrix.

  Inverses and other matrix powers registered through `register_matpower`
  are kept in variables refreshed by `make_inverse_update_ops`: exponent -1
  by Cholesky, other exponents by one shared eigendecomposition. Factors with
  negative source weights may be indefinite and always use the
  eigendecomposition (without clipping eigenvalues for integer exponents).
  """

  def __init__(self, name=None, weights=None):
    """`weights`: the per-source weights; any negative one makes the factor
    possibly indefinite."""
    super().__init__(name)
    self._psd = all(w >= 0 for w in (weights or ()))
    self._matpowers = []       # list of (exp, damping_func)
    self._choleskys = []       # list of damping_func
    self._cholesky_invs = []   # list of damping_func
    self._eigenbasis = False   # keep eigh(statistic) (EKFAC's basis)
    self._vars = {}            # (kind, exp, damping key) -> variable

  @property
  def _cov_shape(self):
    return [self._n, self._n]

  @property
  def _matpower_by_exp_and_damping(self):
    """kfac 0.2.x's private map (exponent, damping key) -> the variable
    holding that damped power, read by code written for it (its own
    tests); the variables are made by instantiate_inv_variables."""
    return {(exp, key): var for (kind, exp, key), var in self._vars.items()
            if kind == "matpow"}

  @property
  def _symmetric_statistic(self):
    return True

  def get_cov(self):
    return self.get_cov_var()

  def normalized_trace(self):
    cov = tf.convert_to_tensor(self.get_cov_var())
    return tf.math.truediv(
        utils.trace(cov), utils.shared_constant(self._cov_shape[0],
                                                cov.dtype))

  @staticmethod
  def _find(registry, key_fn, key):
    return any(key_fn(item) == key for item in registry)

  def register_matpower(self, exp, damping_func):
    if exp == 1:
      return  # computed directly from the statistic
    if not self._psd and exp != int(exp):
      raise ValueError("Factor %s may be indefinite (negative-weight GGN "
                       "sources); only integer powers are defined, got %s." %
                       (self.name, exp))
    key = (exp, damping_func.key)
    if not self._find(self._matpowers, lambda i: (i[0], i[1].key), key):
      self._matpowers.append((exp, damping_func))

  def register_cholesky(self, damping_func):
    self._check_psd("Cholesky factor")
    if not self._find(self._choleskys, lambda d: d.key, damping_func.key):
      self._choleskys.append(damping_func)

  def register_cholesky_inverse(self, damping_func):
    self._check_psd("inverse Cholesky factor")
    if not self._find(self._cholesky_invs, lambda d: d.key, damping_func.key):
      self._cholesky_invs.append(damping_func)

  def register_eigenbasis(self):
    """Keeps the eigendecomposition of the undamped statistic in variables
    refreshed with the inverses (the basis of EKFAC blocks)."""
    self._eigenbasis = True

  def get_eigenbasis(self):
    """(eigenvectors [n, n] as columns, eigenvalues [n]) of the statistic
    at the last inverse update (zeros before the first)."""
    self._check_eigenbasis()
    return (self._vars[("eigh", "vectors", None)],
            self._vars[("eigh", "values", None)])

  def eigenbasis_ready(self):
    """A boolean tensor: whether the eigenbasis was computed at least once."""
    self._check_eigenbasis()
    return self._vars[("eigh", "count", None)] > 0

  def _check_eigenbasis(self):
    if not self._eigenbasis:
      raise ValueError("Factor %s keeps no eigenbasis: call "
                       "register_eigenbasis() first." % self.name)
    self.instantiate_inv_variables()

  def _check_psd(self, what):
    if not self._psd:
      raise ValueError("A %s of factor %s is not defined: the factor may be "
                       "indefinite (negative-weight GGN sources)." %
                       (what, self.name))

  def _registrations(self):
    for i, (exp, dfunc) in enumerate(self._matpowers):
      yield ("matpow", exp, dfunc, "matpow%d" % i)
    for i, dfunc in enumerate(self._choleskys):
      yield ("chol", None, dfunc, "chol%d" % i)
    for i, dfunc in enumerate(self._cholesky_invs):
      yield ("cholinv", None, dfunc, "cholinv%d" % i)

  def instantiate_inv_variables(self):
    for kind, exp, dfunc, suffix in self._registrations():
      key = (kind, exp, dfunc.key)
      if key not in self._vars:
        self._vars[key] = self.state_store.get_or_create(
            self.name + "/" + suffix, self._cov_shape, self._dtype)
    if self._eigenbasis and ("eigh", "count", None) not in self._vars:
      for part, shape in (("vectors", self._cov_shape),
                          ("values", self._cov_shape[:1]), ("count", [])):
        self._vars[("eigh", part, None)] = self.state_store.get_or_create(
            self.name + "/eig" + part, shape, self._dtype)

  def _get_var(self, kind, exp, damping_func):
    key = (kind, exp, damping_func.key)
    if key not in self._vars:
      self.instantiate_inv_variables()
    if key not in self._vars:
      raise ValueError(
          "No %s with exponent %s and damping %r was registered on factor "
          "%s; register it first (FisherEstimator(exps=...), "
          "compute_cholesky=..., compute_cholesky_inverse=...)." %
          (kind, exp, damping_func.key, self.name))
    return self._vars[key]

  def _inverses_use_eigh(self):
    """kfac 0.2.x's rule, in force with eigenvalue clipping: inverses come
    from the eigendecomposition (and are clipped) when the factor also has
    other powers or at least eigenvalue_decomposition_threshold inverses.
    Without clipping both ways give the same matrix: Cholesky then."""
    options = self.curvature_options
    if not (self._psd and options.eigenvalue_clipping_threshold > 0):
      return False
    inverses = sum(1 for exp, _ in self._matpowers if exp == -1)
    return (inverses < len(self._matpowers) or
            inverses >= options.eigenvalue_decomposition_threshold)

  def _clipped(self, evals):
    """Eigenvalues of a psd factor raised to the clipping threshold
    (layers/base/curvature_options.py); the matrix powers also clip them at 0."""
    threshold = self.curvature_options.eigenvalue_clipping_threshold
    if not (self._psd and threshold > 0):
      return evals
    return tf.maximum(evals, utils.cast(threshold, evals.dtype))

  def inverse_values(self):
    return self._inverse_values(linalg.damped_inverse)

  def deferred_inverse_values(self):
    return self._inverse_values(batched_inverse.DeferredInverse)

  def _inverse_values(self, damped_inverse):
    """inverse_values, with the Cholesky inverses (mat, damping) given by
    `damped_inverse`."""
    self.instantiate_inv_variables()
    raw_cov = tf.convert_to_tensor(self.get_cov_var())
    ops = []
    eig = None
    eigh_inverses = self._inverses_use_eigh()
    for kind, exp, dfunc, _ in self._registrations():
      var = self._vars[(kind, exp, dfunc.key)]
      damping = utils.cast(dfunc(), self._dtype)
      cov = dfunc.scale(raw_cov)
      if kind == "matpow":
        if exp == -1 and self._psd and not eigh_inverses:
          value = damped_inverse(cov, damping)
        else:
          if eig is None:
            eig = linalg.eigh(raw_cov)
          scale = dfunc.scale(tf.ones([], self._dtype))
          value = linalg.matpower_from_eigh(
              self._clipped(eig[0]) * scale, eig[1], exp, damping,
              clip_negative=self._psd)
      elif kind == "chol":
        value = linalg.damped_cholesky(cov, damping)
      else:
        value = linalg.damped_cholesky_inverse(cov, damping)
      if not isinstance(value, batched_inverse.DeferredInverse):
        value = utils.cast(value, self._dtype)
      ops.append((var, value))
    if self._eigenbasis:
      if eig is None:
        eig = linalg.eigh(raw_cov)
      count = self._vars[("eigh", "count", None)]
      ops.extend([(self._vars[("eigh", "vectors", None)], eig[1]),
                  (self._vars[("eigh", "values", None)], eig[0]),
                  (count, tf.convert_to_tensor(count) + 1)])
    return ops

  def get_matpower(self, exp, damping_func):
    if exp == 1:
      cov = damping_func.scale(tf.convert_to_tensor(self.get_cov_var()))
      return linalg.add_to_diagonal(cov, damping_func())
    return self._get_var("matpow", exp, damping_func)

  def get_cholesky(self, damping_func):
    return self._get_var("chol", None, damping_func)

  def get_cholesky_inverse(self, damping_func):
    return self._get_var("cholinv", None, damping_func)

  def get_inverse(self, damping_func):
    return self.get_matpower(-1, damping_func)


class SymmetricSqrtFactor(FisherFactor):
  """A factor whose "Cholesky" factor is the symmetric square root (power
  1/2, inverse power -1/2), so that transposes are no-ops; products with
  powers come from `left_multiply_matpower` / `right_multiply_matpower`."""

  def left_multiply_cholesky(self, x, damping_func, transpose=False,
                             inverse=False):
    del transpose  # the symmetric square root is its own transpose
    return self.left_multiply_matpower(x, -0.5 if inverse else 0.5,
                                       damping_func)

  def right_multiply_cholesky(self, x, damping_func, transpose=False,
                              inverse=False):
    del transpose
    return self.right_multiply_matpower(x, -0.5 if inverse else 0.5,
                                        damping_func)


class DiagonalFactor(SymmetricSqrtFactor):
  """A factor whose statistic is a diagonal, stored as its entries.

  Powers, Cholesky factors and their inverses are elementwise and computed on
  the fly, so nothing needs registering and no inverse variables exist.
  """

  def get_cov(self):
    return tf.linalg.diag(tf.reshape(self.get_cov_var(), [-1]))

  def normalized_trace(self):
    cov = self.get_cov_var()
    return tf.reduce_mean(cov)

  def register_matpower(self, exp, damping_func):
    del exp, damping_func

  def register_cholesky(self, damping_func):
    del damping_func

  def register_cholesky_inverse(self, damping_func):
    del damping_func

  def register_eigenbasis(self):
    """A diagonal's eigenbasis is the identity: nothing to keep."""

  def get_eigenbasis(self):
    """(None for the identity basis, the diagonal's entries)."""
    return None, self.get_cov_var()

  def eigenbasis_ready(self):
    return None  # always

  def get_matpower(self, exp, damping_func):
    """Entries of (diag + damping)^exp, shaped like the statistic."""
    cov = damping_func.scale(tf.convert_to_tensor(self.get_cov_var()))
    return linalg.diagonal_matpower(cov, exp, damping_func())

  def gathered_matpower(self, indices, exp, damping_func):
    """(diag + damping)^exp at the rows `indices` of the statistic (the same
    numbers `get_matpower` has there, without computing the other rows: the
    rows an IndexedSlices vector touches)."""
    cov = tf.gather(tf.convert_to_tensor(self.get_cov_var()), indices)
    return linalg.diagonal_matpower(damping_func.scale(cov), exp,
                                    damping_func())

  def get_cholesky(self, damping_func):
    return self.get_matpower(0.5, damping_func)

  def get_cholesky_inverse(self, damping_func):
    return self.get_matpower(-0.5, damping_func)

  def left_multiply_matpower(self, x, exp, damping_func):
    """(diag + d)^exp applied to the rows of x ([n, m]) or elementwise."""
    power = self.get_matpower(exp, damping_func)
    return x * (power[:, tf.newaxis] if power.shape.rank == 1 else power)

  def right_multiply_matpower(self, x, exp, damping_func):
    power = self.get_matpower(exp, damping_func)
    return x * (power[tf.newaxis, :] if power.shape.rank == 1 else power)


class InputsGradsDiagonalFactor(DiagonalFactor):
  """Base of the exact-diagonal factors of a layer: statistics of the layer
  inputs (a tuple over towers) and of the output-gradient sources (with
  per-source weights). The statistic has the static shape `shape` and the
  inputs' dtype."""

  def __init__(self, inputs, outputs_grads, weights, shape, name=None):
    super().__init__(name=name)
    self._inputs = utils.ensure_sequence(inputs)
    self._grads = normalize_sources(outputs_grads)
    self._weights = normalize_weights(weights, len(self._grads))
    self._shape = list(shape)

  @property
  def _cov_shape(self):
    return self._shape

  @property
  def _dtype(self):
    return self._inputs[0].dtype
