"""EKFAC's eigenvalue-correction factors (the scalings).

`EigenCorrectionFactor` keeps, as a zero-debiased moving average like every
factor, S = sum_s w_s mean_n (Q_A^T V_ns Q_G)^2 ([rows, cols]): the second
moments of the per-example gradients V_ns (source s) of a layer rotated
into the eigenbasis Q_A (x) Q_G of its two Kronecker factors, which keep
that basis in variables refreshed with the inverses (see
`DenseSquareFactor.register_eigenbasis`; a diagonal factor's basis is the
identity).

The scalings are computed in the basis of the last refresh and carried
across refreshes, like the factors' own averages carry across steps (the
basis moves slowly). Before the first refresh there is no basis: updates
are skipped, and `effective_scalings()` falls back to K-FAC's eigenvalues in
the basis until the first scalings arrive, so a step right after the first
refresh is a K-FAC step in the same basis.
"""

import tensorflow as tf

from kfac.python.ops.tensors import utils
from kfac.python.ops.ekfac import scalings
from kfac.python.ops.layers.embedding.factors import EmbeddingDiagonalFactor
from kfac.python.ops.layers.base.factors import FisherFactor
from kfac.python.ops.layers.base.factors import normalize_sources
from kfac.python.ops.layers.base.factors import normalize_weights
from kfac.python.ops.layers.base.factors import weighted_sum

_HALF = (tf.float16, tf.bfloat16)


def _full_precision(dtype):
  return tf.float32 if dtype in _HALF else dtype


class EigenCorrection(FisherFactor):
  """A factor of scalings in the eigenbasis of two Kronecker factors (set
  by `_init_basis`): the basis, the update gated on its first refresh and
  the K-FAC fallback. The statistic is the subclass's (or that of the
  factor class after this one in the bases)."""

  is_eigen_correction = True

  def _init_basis(self, input_factor, output_factor, kfac_coeff):
    self._input_factor = input_factor
    self._output_factor = output_factor
    self._kfac_coeff = kfac_coeff
    input_factor.register_eigenbasis()
    output_factor.register_eigenbasis()

  @property
  def basis_factors(self):
    return self._input_factor, self._output_factor

  def bases(self):
    """(Q_A or None for the identity, Q_G or None) of the last refresh."""
    return (self._input_factor.get_eigenbasis()[0],
            self._output_factor.get_eigenbasis()[0])

  def basis_ready(self):
    """A boolean tensor (or None: always ready)."""
    flags = [f.eigenbasis_ready() for f in self.basis_factors]
    flags = [f for f in flags if f is not None]
    if not flags:
      return None
    return flags[0] if len(flags) == 1 else tf.logical_and(*flags)

  def make_covariance_assign_op(self, statistics, ema_decay, ema_weight=None):
    ready = self.basis_ready()
    parent = super().make_covariance_assign_op
    if ready is None:
      return parent(statistics, ema_decay, ema_weight)
    return tf.cond(ready,
                   lambda: tf.group(parent(statistics, ema_decay, ema_weight)),
                   tf.no_op)

  def kfac_eigenvalues(self):
    """K-FAC's eigenvalues in the basis, c * lambda_A lambda_G^T
    ([rows, cols]; undamped)."""
    lam_a = tf.convert_to_tensor(self._input_factor.get_eigenbasis()[1])
    lam_g = tf.convert_to_tensor(self._output_factor.get_eigenbasis()[1])
    outer = (tf.reshape(tf.cast(lam_a, self._dtype), [-1, 1]) *
             tf.reshape(tf.cast(lam_g, self._dtype), [1, -1]))
    coeff = self._kfac_coeff
    if utils.is_python_number(coeff) and coeff == 1:
      return outer
    return outer * tf.cast(coeff, self._dtype)

  def effective_scalings(self):
    """The scalings, or K-FAC's eigenvalues while no scalings have been
    computed in a basis yet (weight 0)."""
    self.instantiate_cov_variables()
    cov = tf.convert_to_tensor(self._cov_var)
    return tf.where(tf.convert_to_tensor(self._cov_weight) > 0, cov,
                    self.kfac_eigenvalues())

  def get_cov(self):
    return tf.linalg.diag(tf.reshape(self.get_cov_var(), [-1]))

  def normalized_trace(self):
    return tf.reduce_mean(self.get_cov_var())


class EigenCorrectionFactor(EigenCorrection):
  """The scalings of a layer whose per-example gradient is
  sum_p x_np g_np^T in its [rows, cols] view.

  The `block` gives the views: `block.ekfac_inputs()` -> [N, P, rows] (all
  towers; with the bias' ones and any mask) and
  `block.ekfac_grads(towers)` -> [N, P, cols] for one source's gradients.
  """

  def __init__(self, block, grads_list, input_factor, output_factor,
               weights=None, strategy="auto", kfac_coeff=1, name=None):
    FisherFactor.__init__(self, name=name)
    self._block = block
    self._grads = normalize_sources(grads_list)
    self._weights = normalize_weights(weights, len(self._grads))
    self._strategy = scalings.check_strategy(strategy)
    self._shape = list(block.ekfac_shape())
    self._tensor_dtype = _full_precision(self._grads[0][0].dtype)
    self._init_basis(input_factor, output_factor, kfac_coeff)

  @property
  def _cov_shape(self):
    return self._shape

  @property
  def _dtype(self):
    return self._tensor_dtype

  def chosen_strategy(self, x=None):
    """The strategy used for this layer (see scalings.choose_strategy)."""
    if x is None:
      x = self._block.ekfac_inputs()
    positions = x.shape[1]
    return scalings.choose_strategy(
        None if positions is None else int(positions), self._shape[0],
        self._shape[1], self._strategy)

  def _compute_new_cov(self):
    q_in, q_out = self.bases()
    x = tf.cast(self._block.ekfac_inputs(), self._dtype)
    strategy = self.chosen_strategy(x)
    x = scalings.rotate(x, q_in)
    n = tf.cast(tf.shape(x)[0], self._dtype)
    terms = []
    for towers in self._grads:
      g = tf.cast(self._block.ekfac_grads(towers), self._dtype)
      g = scalings.rotate(g, q_out)
      terms.append(scalings.sum_of_squares(x, g, strategy) / n)
    return weighted_sum(terms, self._weights)


class EmbeddingEigenCorrectionFactor(EigenCorrection,
                                     EmbeddingDiagonalFactor):
  """The scalings of an embedding table: the input factor is diagonal (its
  basis is the identity), so they are the exact diagonal of the table's
  Fisher (`EmbeddingDiagonalFactor`) of the output gradients rotated by
  Q_G."""

  def __init__(self, input_ids, outputs_grads, vocab_size, input_factor,
               output_factor, weights=None, kfac_coeff=1, name=None):
    EmbeddingDiagonalFactor.__init__(self, input_ids, outputs_grads,
                                     vocab_size, weights, name=name)
    self._init_basis(input_factor, output_factor, kfac_coeff)

  def _statistic_grads(self):
    q_out = self.bases()[1]
    return [tuple(scalings.rotate(g, q_out) for g in towers)
            for towers in self._grads]
