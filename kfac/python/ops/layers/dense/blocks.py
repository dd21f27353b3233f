"""Blocks of dense layers: K-FAC (with diagonal variants) and the exact
diagonal."""

import tensorflow as tf

from kfac.python.ops.layers.base import block_diagonal
from kfac.python.ops.layers.base import damping as damping_lib
from kfac.python.ops.layers.dense import factors as dense_factors
from kfac.python.ops.layers.dense import factored_grads
from kfac.python.ops.tensors import utils
from kfac.python.ops.layers.base.blocks import ElementwiseDiagonalFB
from kfac.python.ops.layers.base.blocks import LayerTowersFB
from kfac.python.ops.layers.base.blocks import KroneckerProductFB


class _DenseLayerBlock(LayerTowersFB):
  """Shared plumbing of blocks for dense layers: towers of (inputs, outputs)
  and the (W, b) <-> [in(+1), out] matrix view of vectors.

  `output_axes` (set by the registration, `set_output_axes`) is the number
  of trailing axes of the weight and of the outputs that are output axes
  (1 but for e.g. EinsumDense kernels [in, heads, head_dim]): the matrix
  view flattens them into `out`, and the factors flatten the output
  gradients the same way (the registered outputs keep their shape: they
  are the tensors the loss depends on)."""

  _output_axes = 1

  def __init__(self, layer_collection, has_bias=False, params=None):
    super().__init__(layer_collection, params)
    self._has_bias = has_bias
    self._init_towers()

  def set_output_axes(self, output_axes):
    """Sets the number of output axes (before the first tower; every tower
    of the block must agree)."""
    if self._inputs and output_axes != self._output_axes:
      raise ValueError(
          "Towers of layer %s must have the same number of output axes: the "
          "first has %d, this one %d." % (self.name, self._output_axes,
                                          output_axes))
    self._output_axes = output_axes

  def _grads_factor_args(self, grads, has_bias, weights):
    """Arguments of a dense factor of output gradients (output_axes is
    passed only when > 1, so the factors of ordinary layers keep their
    keys)."""
    if self._output_axes == 1:
      return (grads, has_bias, weights)
    return (grads, has_bias, weights, None, self._output_axes)

  def _to_mat(self, vector):
    if self._has_bias:
      if not isinstance(vector, (list, tuple)) or len(vector) != 2:
        raise ValueError("Block %s has a bias and takes (W, b) vectors." %
                         self.name)
    if self._output_axes != 1:
      w = vector[0] if self._has_bias else vector
      width = int(w.shape[-self._output_axes:].num_elements())
      w = tf.reshape(w, [-1, width])
      vector = (w, vector[1]) if self._has_bias else w
    return utils.params_to_mat(vector)

  def _from_mat(self, mat, template):
    return utils.mat_to_params(mat, template)

  def _make_kronecker_factors(self, inputs, grads, weights):
    """Sets `_input_factor` A from `inputs` (with the bias entry) and
    `_output_factor` G from the sources' output gradients `grads`, each
    replaced by its diagonal when `_diag_in` / `_diag_out` is set."""
    in_cls = (dense_factors.DiagonalKroneckerFactor if self._diag_in else
              dense_factors.FullyConnectedKroneckerFactor)
    out_cls = (dense_factors.DiagonalKroneckerFactor if self._diag_out else
               dense_factors.FullyConnectedKroneckerFactor)
    self._input_factor = self._kronecker_factor(
        in_cls, (inputs, self._has_bias), "A")
    weights = None if weights is None else tuple(weights)
    self._output_factor = self._kronecker_factor(
        out_cls, self._grads_factor_args(grads, False, weights), "G")

  def _kronecker_factor(self, cls, args, role):
    """A full factor `cls(*args)`, kept as its diagonal blocks when the
    CurvatureOptions' factor_block_size says so (block_diagonal.py)."""
    if cls is dense_factors.FullyConnectedKroneckerFactor:
      return block_diagonal.block_diagonal_factor(self, cls, args, role)
    return self._make_factor(cls, args, role)


class FullyConnectedKFACBasicFB(_DenseLayerBlock, KroneckerProductFB):
  """K-FAC block of a dense layer: F ~= A (x) G.

  A = E[a a^T] over the layer inputs (with a ones column for the bias) and
  G = E[g g^T] over the gradients of the loss w.r.t. the pre-activations.
  `diagonal_approx_for_input/output` replace A / G by their diagonals (the
  kron_in_diag, kron_out_diag and kron_both_diag approximations).

  Inputs of rank > 2 ([batch, positions..., in], a layer shared over
  positions) are treated as KFAC-expand: the factors average over batch and
  positions and the block is scaled by the number of positions (see
  `KroneckerProductFB`).
  """

  def __init__(self, layer_collection, has_bias=False,
               diagonal_approx_for_input=False,
               diagonal_approx_for_output=False, params=None):
    _DenseLayerBlock.__init__(self, layer_collection, has_bias, params)
    self._diag_in = diagonal_approx_for_input
    self._diag_out = diagonal_approx_for_output

  @property
  def approx_name(self):
    """The approximation's name (kron, kron_in_diag, kron_out_diag,
    kron_both_diag)."""
    return {(False, False): "kron", (True, False): "kron_in_diag",
            (False, True): "kron_out_diag", (True, True): "kron_both_diag"}[
                (bool(self._diag_in), bool(self._diag_out))]

  def cheaper_variant(self, level):
    """(a cheaper block of the same layer, not yet instantiated, and its
    approximation's name), or None: level 0 makes the larger factor
    diagonal, level 1 both (collection/memory_fallback.py)."""
    if type(self) is not FullyConnectedKFACBasicFB:  # pylint: disable=unidiomatic-typecheck
      return None  # (subclasses hold more than these options)
    diag_in, diag_out = self._diag_in, self._diag_out
    if diag_in and diag_out:
      return None
    if level == 0 and not (diag_in or diag_out):
      wide_input = (self._input_factor.cov_shape[0] >=
                    self._output_factor.cov_shape[0])
      diag_in, diag_out = wide_input, not wide_input
    else:
      diag_in = diag_out = True
    new = FullyConnectedKFACBasicFB(
        self._layer_collection, has_bias=self._has_bias,
        diagonal_approx_for_input=diag_in,
        diagonal_approx_for_output=diag_out, params=self.params)
    new.set_output_axes(self._output_axes)
    new.take_towers_of(self)
    return new, new.approx_name

  # kfac 0.2.x's names of the diagonal options.
  @property
  def _diagonal_approx_for_input(self):
    return self._diag_in

  @property
  def _diagonal_approx_for_output(self):
    return self._diag_out

  @property
  def _renorm_coeff(self):
    return num_shared_positions(self._inputs[0])

  def register_additional_tower(self, inputs, outputs):
    # The coefficient is taken from the first tower, so every tower must
    # share the weights over the same number of positions.
    if self._inputs:
      first = num_shared_positions(self._inputs[0])
      this = num_shared_positions(inputs)
      if (isinstance(first, int) and isinstance(this, int) and
          first != this):
        raise ValueError(
            "Towers of layer %s must share the weights over the same number "
            "of positions: the first tower has %d (inputs %s), this one %d "
            "(inputs %s)." % (self.name, first, self._inputs[0].shape, this,
                              inputs.shape))
    super().register_additional_tower(inputs, outputs)

  def multiply_matpower(self, vector, exp):
    # A gradient that the graph formed as X^T d is multiplied through its
    # two factors where that is cheaper (factored_grads/match.py).
    pair = None
    if not (self._diag_in or self._diag_out or self._output_axes != 1):
      pair = factored_grads.gradient_factors(vector, self._has_bias)
    if pair is None:
      return super().multiply_matpower(vector, exp)
    self._check_instantiated()
    x, d = pair

    def factored():
      left = self._input_factor.right_multiply_matpower(x, exp,
                                                        self._in_damping)
      right = self._output_factor.right_multiply_matpower(d, exp,
                                                          self._out_damping)
      return tf.matmul(left, right, transpose_a=True)

    def plain(vec=vector):
      mat = self._input_factor.left_multiply_matpower(
          self._to_mat(vec), exp, self._in_damping)
      return self._output_factor.right_multiply_matpower(mat, exp,
                                                         self._out_damping)

    def plain_in_branch():
      # x^T d again here where nothing else reads the gradient (match.py).
      return plain(factored_grads.rebuilt(vector, self._has_bias))

    mat = factored_grads.prefer_factored(x, d, factored, plain,
                                         plain_in_branch)
    return self._from_mat(self._scaled(mat, exp), vector)

  def gradient_operands(self, vector):
    """(x, d) of the product x^T d that formed the weight gradient in
    `vector` (W, or (W, b)), when multiply_matpower may precondition it
    through them without reading the product (a run-time choice or the
    factored form); else None (the product is read)."""
    if self._diag_in or self._diag_out or self._output_axes != 1:
      return None
    pair = factored_grads.gradient_factors(vector, self._has_bias)
    if pair is None or factored_grads.static_choice(*pair) == "plain":
      return None
    return factored_grads.product_operands(
        vector[0] if self._has_bias else vector)

  def instantiate_factors(self, grads_list, damping, weights=None):
    self._make_kronecker_factors(tuple(self._inputs),
                                 tuple(tuple(g) for g in grads_list), weights)
    self._setup_damping(damping)


def num_shared_positions(inputs):
  """Number of positions a dense layer on `inputs` [batch, ..., in] shares
  its weights over (the product of the middle dimensions; 1 for rank 2).
  A Python int when the shape is static, else a scalar tensor."""
  if inputs.shape.rank is None:
    raise ValueError("Dense layer inputs need a known rank, got %s." % inputs)
  return utils.dims_product(inputs, 1, -1)


class FullyConnectedDiagonalFB(ElementwiseDiagonalFB,
                               _DenseLayerBlock):
  """Exact diagonal of a dense layer's Fisher ("sum of squares" estimator:
  F_ii = E[v_i^2] with v = vec(a g^T) per example), plus damping."""

  def __init__(self, layer_collection, has_bias=False, params=None):
    _DenseLayerBlock.__init__(self, layer_collection, has_bias, params)
    self._factor = None

  def instantiate_factors(self, grads_list, damping, weights=None):
    weights = None if weights is None else tuple(weights)
    args = (tuple(self._inputs), tuple(tuple(g) for g in grads_list),
            self._has_bias, weights)
    if self._output_axes != 1:
      args += (None, self._output_axes)
    self._factor = self._make_factor(
        dense_factors.FullyConnectedDiagonalFactor, args, "diag")
    self._damping_func = damping_lib.as_damping_func(damping)

  def _to_view(self, vector):
    return self._to_mat(vector)

  def _from_view(self, view, template):
    return self._from_mat(view, template)
