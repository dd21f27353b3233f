"""Fisher blocks: one layer's curvature approximation, built from factors.

A block owns the registered parameters of one layer, the tensors it needs
gradients for, and the factors that approximate its block of the Fisher (or
GGN). Vectors are shaped like the parameters: a Tensor for a single
variable, a tuple (W, b) for a layer with bias. Flattened, a dense layer's
parameters are ordered concat(W.flatten(), b.flatten()) (row-major), which
is how `full_fisher_block()` lays out its matrix.

All products are with the *damped* block; Kronecker blocks use factored
Tikhonov damping with the pi adjustment (see damping.py), diagonal and full
blocks add the damping to the diagonal.
"""

import abc

import tensorflow as tf

from kfac.python.ops import damping as damping_lib
from kfac.python.ops import fisher_factors
from kfac.python.ops import linalg
from kfac.python.ops import utils


class FisherBlock(abc.ABC):
  """Base class of all blocks."""

  def __init__(self, layer_collection, params=None):
    self._layer_collection = layer_collection
    self._params = params
    self._damping_func = None
    self._name = None

  @property
  def params(self):
    return self._params

  def set_name(self, name):
    self._name = name

  @property
  def name(self):
    return self._name or type(self).__name__

  @abc.abstractmethod
  def tensors_to_compute_grads(self):
    """The tensors whose loss gradients the block's statistics need."""

  @property
  @abc.abstractmethod
  def num_registered_towers(self):
    pass

  @abc.abstractmethod
  def instantiate_factors(self, grads_list, damping, weights=None):
    """Creates the factors from the estimator's gradient lists.

    Args:
      grads_list: list over sources of tuples of gradients, matching
        `tensors_to_compute_grads()`.
      damping: a number, tensor, variable or `DampingFunc`.
      weights: optional list of per-source weights (default all 1).
    """

  @abc.abstractmethod
  def factors(self):
    """The block's factors, in a fixed order."""

  def register_inverse(self):
    self.register_matpower(-1)

  @abc.abstractmethod
  def register_matpower(self, exp):
    pass

  @abc.abstractmethod
  def register_cholesky(self):
    pass

  @abc.abstractmethod
  def register_cholesky_inverse(self):
    pass

  def multiply(self, vector):
    return self.multiply_matpower(vector, 1)

  def multiply_inverse(self, vector):
    return self.multiply_matpower(vector, -1)

  @abc.abstractmethod
  def multiply_matpower(self, vector, exp):
    pass

  def multiply_cholesky(self, vector, transpose=False):
    """C v (or C^T v) for the Cholesky factor C C^T of the damped block."""
    return self._multiply_cholesky(vector, transpose, inverse=False)

  def multiply_cholesky_inverse(self, vector, transpose=False):
    """C^-1 v (or C^-T v)."""
    return self._multiply_cholesky(vector, transpose, inverse=True)

  @abc.abstractmethod
  def _multiply_cholesky(self, vector, transpose, inverse):
    pass

  @abc.abstractmethod
  def full_fisher_block(self):
    """The undamped block as a dense matrix over the flattened parameters."""

  def _make_factor(self, cls, args, role):
    name = "%s/%s" % (self.name, role)
    return self._layer_collection.make_or_get_factor(cls, args, name=name)

  def _check_instantiated(self):
    if self._damping_func is None:
      raise ValueError("Block %s has no factors yet: it is instantiated by a "
                       "FisherEstimator (or KfacOptimizer) built on its "
                       "LayerCollection." % self.name)


class _DenseLayerBlock(FisherBlock):
  """Shared plumbing of blocks for dense layers: towers of (inputs, outputs)
  and the (W, b) <-> [in(+1), out] matrix view of vectors."""

  def __init__(self, layer_collection, has_bias=False, params=None):
    super().__init__(layer_collection, params)
    self._has_bias = has_bias
    self._inputs = []
    self._outputs = []

  def register_additional_tower(self, inputs, outputs):
    self._inputs.append(inputs)
    self._outputs.append(outputs)

  @property
  def num_registered_towers(self):
    return len(self._inputs)

  def tensors_to_compute_grads(self):
    return tuple(self._outputs)

  def _to_mat(self, vector):
    if self._has_bias:
      if not isinstance(vector, (list, tuple)) or len(vector) != 2:
        raise ValueError("Block %s has a bias and takes (W, b) vectors." %
                         self.name)
    return utils.params_to_mat(vector)

  def _from_mat(self, mat, template):
    return utils.mat_to_params(mat, template)


class FullyConnectedKFACBasicFB(_DenseLayerBlock):
  """K-FAC block of a dense layer: F ~= A (x) G.

  A = E[a a^T] over the layer inputs (with a ones column for the bias) and
  G = E[g g^T] over the gradients of the loss w.r.t. the pre-activations.
  `diagonal_approx_for_input/output` replace A / G by their diagonals (the
  kron_in_diag, kron_out_diag and kron_both_diag approximations).
  """

  def __init__(self, layer_collection, has_bias=False,
               diagonal_approx_for_input=False,
               diagonal_approx_for_output=False, params=None):
    super().__init__(layer_collection, has_bias, params)
    self._diag_in = diagonal_approx_for_input
    self._diag_out = diagonal_approx_for_output
    self._input_factor = None
    self._output_factor = None

  def instantiate_factors(self, grads_list, damping, weights=None):
    in_cls = (fisher_factors.DiagonalKroneckerFactor if self._diag_in else
              fisher_factors.FullyConnectedKroneckerFactor)
    out_cls = (fisher_factors.DiagonalKroneckerFactor if self._diag_out else
               fisher_factors.FullyConnectedKroneckerFactor)
    self._input_factor = self._make_factor(
        in_cls, (tuple(self._inputs), self._has_bias), "A")
    weights = None if weights is None else tuple(weights)
    self._output_factor = self._make_factor(
        out_cls, (tuple(tuple(g) for g in grads_list), False, weights), "G")
    self._damping_func = damping_lib.as_damping_func(damping)
    self._in_damping, self._out_damping = (
        damping_lib.pi_adjusted_damping_funcs(
            self._input_factor, self._output_factor, self._damping_func))

  def factors(self):
    return [self._input_factor, self._output_factor]

  def register_matpower(self, exp):
    self._check_instantiated()
    self._input_factor.register_matpower(exp, self._in_damping)
    self._output_factor.register_matpower(exp, self._out_damping)

  def register_cholesky(self):
    self._check_instantiated()
    self._input_factor.register_cholesky(self._in_damping)
    self._output_factor.register_cholesky(self._out_damping)

  def register_cholesky_inverse(self):
    self._check_instantiated()
    self._input_factor.register_cholesky_inverse(self._in_damping)
    self._output_factor.register_cholesky_inverse(self._out_damping)

  def multiply_matpower(self, vector, exp):
    self._check_instantiated()
    mat = self._to_mat(vector)
    mat = self._input_factor.left_multiply_matpower(mat, exp, self._in_damping)
    mat = self._output_factor.right_multiply_matpower(mat, exp,
                                                      self._out_damping)
    return self._from_mat(mat, vector)

  def _multiply_cholesky(self, vector, transpose, inverse):
    # C = L_A (x) L_G acts on the matrix view V as L_A V L_G^T, so C C^T
    # reproduces A V G; C^T acts as L_A^T V L_G.
    self._check_instantiated()
    mat = self._to_mat(vector)
    mat = self._input_factor.left_multiply_cholesky(
        mat, self._in_damping, transpose=transpose, inverse=inverse)
    mat = self._output_factor.right_multiply_cholesky(
        mat, self._out_damping, transpose=not transpose, inverse=inverse)
    return self._from_mat(mat, vector)

  def full_fisher_block(self):
    self._check_instantiated()
    return linalg.kronecker_product(self._input_factor.get_cov(),
                                    self._output_factor.get_cov())


class _ElementwiseDiagonalBlockMixin:
  """Products for blocks whose single factor is an elementwise diagonal
  shaped like the block's vector view."""

  def register_matpower(self, exp):
    self._check_instantiated()

  def register_cholesky(self):
    self._check_instantiated()

  def register_cholesky_inverse(self):
    self._check_instantiated()

  def _apply_power(self, vector, exp):
    self._check_instantiated()
    view = self._to_view(vector)
    view = self._factor.left_multiply_matpower(view, exp, self._damping_func)
    return self._from_view(view, vector)

  def multiply_matpower(self, vector, exp):
    return self._apply_power(vector, exp)

  def _multiply_cholesky(self, vector, transpose, inverse):
    del transpose  # a diagonal is its own transpose
    return self._apply_power(vector, -0.5 if inverse else 0.5)

  def factors(self):
    return [self._factor]

  def full_fisher_block(self):
    self._check_instantiated()
    return tf.linalg.diag(tf.reshape(self._factor.get_cov_var(), [-1]))


class FullyConnectedDiagonalFB(_ElementwiseDiagonalBlockMixin,
                               _DenseLayerBlock):
  """Exact diagonal of a dense layer's Fisher ("sum of squares" estimator:
  F_ii = E[v_i^2] with v = vec(a g^T) per example), plus damping."""

  def __init__(self, layer_collection, has_bias=False, params=None):
    _DenseLayerBlock.__init__(self, layer_collection, has_bias, params)
    self._factor = None

  def instantiate_factors(self, grads_list, damping, weights=None):
    weights = None if weights is None else tuple(weights)
    self._factor = self._make_factor(
        fisher_factors.FullyConnectedDiagonalFactor,
        (tuple(self._inputs), tuple(tuple(g) for g in grads_list),
         self._has_bias, weights), "diag")
    self._damping_func = damping_lib.as_damping_func(damping)

  def _to_view(self, vector):
    return self._to_mat(vector)

  def _from_view(self, view, template):
    return self._from_mat(view, template)


class _GenericBlock(FisherBlock):
  """Shared plumbing of blocks for arbitrary parameters: gradients are taken
  w.r.t. the parameters themselves, vectors are flattened into a column."""

  def __init__(self, layer_collection, params):
    super().__init__(layer_collection, params)
    self._batch_sizes = []

  def register_additional_tower(self, batch_size):
    self._batch_sizes.append(batch_size)

  @property
  def num_registered_towers(self):
    return len(self._batch_sizes)

  @property
  def _params_tuple(self):
    return utils.ensure_sequence(self._params)

  def tensors_to_compute_grads(self):
    return self._params_tuple

  def _total_batch_size(self):
    sizes = [tf.cast(b, tf.float64) if utils.is_tensor_or_variable(b) else
             float(b) for b in self._batch_sizes]
    total = sizes[0]
    for b in sizes[1:]:
      total = total + b
    return total

  def _to_view(self, vector):
    vector = utils.ensure_sequence(vector)
    if len(vector) != len(self._params_tuple):
      raise ValueError("Block %s takes %d vector parts, got %d." %
                       (self.name, len(self._params_tuple), len(vector)))
    return utils.tensors_to_column(vector)

  def _from_view(self, view, template):
    out = utils.column_to_tensors(utils.ensure_sequence(template), view)
    return out if isinstance(template, (list, tuple)) else out[0]

  def _make_generic_factor(self, cls, grads_list, weights, role):
    weights = None if weights is None else tuple(weights)
    return self._make_factor(
        cls, (tuple(tuple(g) for g in grads_list), self._total_batch_size(),
              weights), role)


class NaiveFullFB(_GenericBlock):
  """Full Fisher block of arbitrary parameters: E[g g^T] of the flattened
  loss gradient (exact for one example in the 'exact' mode)."""

  def __init__(self, layer_collection, params):
    super().__init__(layer_collection, params)
    self._factor = None

  def instantiate_factors(self, grads_list, damping, weights=None):
    self._factor = self._make_generic_factor(
        fisher_factors.NaiveFullFactor, grads_list, weights, "full")
    self._damping_func = damping_lib.as_damping_func(damping)

  def factors(self):
    return [self._factor]

  def register_matpower(self, exp):
    self._check_instantiated()
    self._factor.register_matpower(exp, self._damping_func)

  def register_cholesky(self):
    self._check_instantiated()
    self._factor.register_cholesky(self._damping_func)

  def register_cholesky_inverse(self):
    self._check_instantiated()
    self._factor.register_cholesky_inverse(self._damping_func)

  def multiply_matpower(self, vector, exp):
    self._check_instantiated()
    col = self._factor.left_multiply_matpower(self._to_view(vector), exp,
                                              self._damping_func)
    return self._from_view(col, vector)

  def _multiply_cholesky(self, vector, transpose, inverse):
    self._check_instantiated()
    col = self._factor.left_multiply_cholesky(
        self._to_view(vector), self._damping_func, transpose=transpose,
        inverse=inverse)
    return self._from_view(col, vector)

  def full_fisher_block(self):
    self._check_instantiated()
    return self._factor.get_cov()


class NaiveDiagonalFB(_ElementwiseDiagonalBlockMixin, _GenericBlock):
  """Diagonal Fisher of arbitrary parameters: E[g^2] per entry."""

  def __init__(self, layer_collection, params):
    _GenericBlock.__init__(self, layer_collection, params)
    self._factor = None

  def instantiate_factors(self, grads_list, damping, weights=None):
    self._factor = self._make_generic_factor(
        fisher_factors.NaiveDiagonalFactor, grads_list, weights, "diag")
    self._damping_func = damping_lib.as_damping_func(damping)
