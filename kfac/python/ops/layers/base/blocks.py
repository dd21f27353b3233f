"""Fisher blocks: one layer's curvature approximation, built from factors.

A block owns the registered parameters of one layer, the tensors it needs
gradients for, and the factors that approximate its block of the Fisher (or
GGN). Vectors are shaped like the parameters: a Tensor for a single
variable, a tuple (W, b) for a layer with bias. Flattened, a dense layer's
parameters are ordered concat(W.flatten(), b.flatten()) (row-major), which
is how `full_fisher_block()` lays out its matrix.

All products are with the *damped* block; Kronecker blocks use factored
Tikhonov damping with the pi adjustment (see layers/base/damping.py), diagonal and full
blocks add the damping to the diagonal.
"""

import abc

import tensorflow as tf

from kfac.python.ops.layers.base import curvature_options as options_lib
from kfac.python.ops.layers.base import damping as damping_lib
from kfac.python.ops.numerics import linalg
from kfac.python.ops.tensors import utils
from kfac.python.ops.reliability import shapes


class FisherBlock(abc.ABC):
  """Base class of all blocks."""

  def __init__(self, layer_collection, params=None):
    self._layer_collection = layer_collection
    self._params = params
    self._damping_func = None
    self._name = None
    self._row_checks = []  # run-time checks of the towers' row counts

  @property
  def params(self):
    return self._params

  @property
  def row_checks(self):
    """Assertions that each tower's inputs and outputs have the same number
    of rows (reliability/shapes.py); the statistics are computed after
    them."""
    return list(self._row_checks)

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

  @property
  def curvature_options(self):
    """The CurvatureOptions of the block's LayerCollection."""
    return getattr(self._layer_collection, "curvature_options",
                   None) or _DEFAULT_OPTIONS

  def _make_factor(self, cls, args, role):
    name = "%s/%s" % (self.name, role)
    return self._layer_collection.make_or_get_factor(cls, args, name=name)

  def _check_instantiated(self):
    if self._damping_func is None:
      raise ValueError("Block %s has no factors yet: it is instantiated by a "
                       "FisherEstimator (or KfacOptimizer) built on its "
                       "LayerCollection." % self.name)


_DEFAULT_OPTIONS = options_lib.CurvatureOptions()


def normalized_damping_func(damping_func, coeff, options):
  """damping / coeff^p (p: options.normalize_damping_power), the damping a
  block shared over `coeff` positions splits between its factors;
  `damping_func` itself when that is 1."""
  power = options.normalize_damping_power
  if power == 0 or (utils.is_python_number(coeff) and coeff == 1):
    return damping_func
  if power == 1:
    normalizer = coeff
  else:
    normalizer = options.damping_normalizer(coeff)
  if utils.is_python_number(normalizer):
    inv = 1.0 / float(normalizer)
  else:
    inv = 1.0 / tf.cast(normalizer, tf.float64)
  return damping_lib.scaled_damping_func(damping_func, inv)


def kronecker_damping_funcs(options, input_factor, output_factor,
                            damping_func, coeff, per_channel_split=None):
  """The (input, output) DampingFuncs of a Kronecker block c * (A (x) G):
  damping / c^p split with the pi rule of `options` (per_channel_split:
  layers/conv/depthwise_factors.per_channel_pi_damping_funcs for batched
  factors)."""
  normalized = normalized_damping_func(damping_func, coeff, options)
  split = per_channel_split or damping_lib.pi_adjusted_damping_funcs
  return split(input_factor, output_factor, normalized, options.pi_type)


class LayerTowersFB(FisherBlock):
  """A block of a layer registered as towers of (inputs, outputs) pairs,
  kept in the lists `_inputs` / `_outputs` (set up by `_init_towers()`);
  the statistics need the loss gradients w.r.t. every tower's outputs."""

  def _init_towers(self):
    self._inputs = []
    self._outputs = []

  def register_additional_tower(self, inputs, outputs):
    # Inputs and outputs must be the same examples (checked when the
    # statistics are computed, when a batch size is unknown).
    self._row_checks.extend(shapes.layer_row_checks(inputs, outputs,
                                                    self.name))
    self._inputs.append(inputs)
    self._outputs.append(outputs)

  @property
  def num_registered_towers(self):
    return len(self._inputs)

  def tensors_to_compute_grads(self):
    return tuple(self._outputs)

  def take_towers_of(self, other):
    """Takes the towers, row checks and name of `other`, a block of the
    same layer (a replacement of it that is not yet instantiated);
    returns self."""
    self._inputs = list(other._inputs)  # pylint: disable=protected-access
    self._outputs = list(other._outputs)  # pylint: disable=protected-access
    self._row_checks = list(other.row_checks)
    self.set_name(other.name)
    return self


class KroneckerProductFB(FisherBlock):
  """A block c * (A (x) G) acting on [rows, cols] matrix views of vectors.

  A (the input factor `_input_factor`, damped by `_in_damping`) acts on the
  rows, G (the output factor `_output_factor`, damped by `_out_damping`) on
  the columns; the factors may be batched over a leading axis (per-channel
  blocks). The coefficient c (`_renorm_coeff`) is the number of positions a
  weight is shared over (conv locations, uses of a layer, sequence steps):
  both factors are averages over all positions, so c restores the sum over
  positions of the per-example Fisher (KFAC-expand). Damping is factored
  with the pi rule on the normalised value damping / c, so that the damped
  block is c * (A (x) G + damping / c) = c A (x) G + damping (with the
  collection's CurvatureOptions: damping / c^p split by the pi rule or
  with pi = 1, see layers/base/curvature_options.py).

  Subclasses set `_input_factor`, `_output_factor` and call
  `_setup_damping(damping)` (or set the two dampings themselves) in
  `instantiate_factors`, and provide `_to_mat(vector)` /
  `_from_mat(mat, template)`.
  """

  _input_factor = None
  _output_factor = None
  _renorm_coeff = 1.0

  def _setup_damping(self, damping):
    self._damping_func = damping_lib.as_damping_func(damping)
    self._in_damping, self._out_damping = kronecker_damping_funcs(
        self.curvature_options, self._input_factor, self._output_factor,
        self._damping_func, self._renorm_coeff)

  def _coeff_power(self, exp, dtype):
    coeff = self._renorm_coeff
    if utils.is_python_number(coeff):
      return None if coeff == 1 else utils.cast(float(coeff)**exp, dtype)
    return tf.cast(coeff, dtype)**utils.cast(exp, dtype)

  def _scaled(self, mat, exp):
    scale = self._coeff_power(exp, mat.dtype)
    return mat if scale is None else mat * scale

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
    return self._from_mat(self._scaled(mat, exp), vector)

  def _multiply_cholesky(self, vector, transpose, inverse):
    # C = sqrt(c) L_A (x) L_G acts on the matrix view V as
    # sqrt(c) L_A V L_G^T, so C C^T reproduces c A V G; C^T acts as
    # sqrt(c) L_A^T V L_G.
    self._check_instantiated()
    mat = self._to_mat(vector)
    mat = self._input_factor.left_multiply_cholesky(
        mat, self._in_damping, transpose=transpose, inverse=inverse)
    mat = self._output_factor.right_multiply_cholesky(
        mat, self._out_damping, transpose=not transpose, inverse=inverse)
    return self._from_mat(self._scaled(mat, -0.5 if inverse else 0.5),
                          vector)

  def full_fisher_block(self):
    self._check_instantiated()
    block = linalg.kronecker_product(self._input_factor.get_cov(),
                                     self._output_factor.get_cov())
    return self._scaled(block, 1)


class SingleFactorFB(FisherBlock):
  """A block that is one dense square factor `_factor` acting on a column
  view of the block's vectors (`_to_view` / `_from_view`), damped by
  `_damping_func` added to its diagonal."""

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


class ElementwiseDiagonalFB(FisherBlock):
  """A block that is one elementwise diagonal factor `_factor` shaped like
  the block's vector view (`_to_view` / `_from_view`), damped by
  `_damping_func`."""

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
