"""Options of the curvature model that kfac 0.2.x kept in module globals.

kfac 0.2.x steered some of its math through `set_global_constants` of its
fisher_blocks and fisher_factors modules, read while the ops were built.
Here they are explicit configuration: a `CurvatureOptions` value held by each
`LayerCollection` (argument `curvature_options=`), which its blocks and
factors read. The old `set_global_constants` calls still work: they change
the defaults that a LayerCollection made afterwards picks up
(compat_utils/legacy_constants.py); a collection that exists keeps its
options.

Fields (defaults are kfac 0.2.x's):

* pi_type: "tracenorm" splits the damping of a Kronecker block A (x) G
  between its factors with the trace-norm rule, A + pi s I and G + s / pi I
  with s = sqrt(damping) and pi = sqrt((tr A / dim A) / (tr G / dim G));
  "off" uses pi = 1 (A + s I and G + s I).
* normalize_damping_power p: a Kronecker block whose weights are shared
  over c positions (conv locations, uses of a multi-use layer) is c A (x) G
  and splits damping / c^p (so the damped block is about
  c A (x) G + c^(1-p) damping); the exact diagonal of a conv layer gets
  c^(1-p) damping. p = 1 (the default) adds the damping itself.
* eigenvalue_clipping_threshold t: where a factor computes a power from
  the eigendecomposition of its statistic, eigenvalues below t are raised
  to t before the damping is added (0 clips rounding noise below zero).
  As in kfac 0.2.x, inverses use that eigendecomposition (and so the
  clipping) only when the factor also has other powers registered or at
  least `eigenvalue_decomposition_threshold` inverses (one per damping);
  otherwise they are computed by Cholesky, unclipped. Without clipping
  (t = 0) the two ways give the same matrix and inverses always use
  Cholesky.
* sub_sample_inputs: the default of register_conv2d / register_conv1d /
  register_convolution's `sub_sample_inputs` for "kron" layers (and of the
  multi-use conv blocks); True computes the input factor's statistic on
  ceil(inputs_to_extract_patches_factor * N) of the N examples, drawn
  uniformly without replacement at every statistics update.
* factor_block_size b (0: off): a Kronecker factor of a dense or
  convolution layer ("kron" blocks) with more than b rows is kept as its
  diagonal blocks of at most b rows (layers/base/block_diagonal.py): k =
  ceil(n / b) blocks of ceil(n / k) rows, their statistics, inverses and
  products batched. Its state, statistics, inverses and products then cost
  about n b instead of n^2 (n^3 / k^2 for the inverse): the factors of
  wide layers (a 3x3 convolution over 512 channels has n = 4609) become
  affordable, and the block approximates the factor by dropping the
  covariances between its blocks of inputs (Shampoo's blocking applied to
  K-FAC's factors). Not kfac 0.2.x's.
(kfac 0.2.x's sub_sample_patches, max_num_patches and
max_num_patches_per_dimension are not options here: sub-sampling of patch
rows is chosen per layer, register_conv2d(sub_sample_patches=...).)
"""

import dataclasses
import math
import numbers

import tensorflow as tf

PI_TRACENORM_NAME = "tracenorm"
PI_OFF_NAME = "off"
_PI_TYPES = (PI_TRACENORM_NAME, PI_OFF_NAME)


def _check_number(name, value, low, low_ok=True):
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError("CurvatureOptions: %s must be a number, got %r." %
                     (name, value))
  if not math.isfinite(value) or value < low or (value == low and
                                                 not low_ok):
    raise ValueError("CurvatureOptions: %s must be a finite number %s %s, "
                     "got %r." % (name, ">=" if low_ok else ">", low, value))


@dataclasses.dataclass(frozen=True)
class CurvatureOptions:
  """See the module docstring."""

  pi_type: str = PI_TRACENORM_NAME
  normalize_damping_power: float = 1.0
  eigenvalue_clipping_threshold: float = 0.0
  eigenvalue_decomposition_threshold: float = 4
  sub_sample_inputs: bool = False
  inputs_to_extract_patches_factor: float = 0.2
  factor_block_size: int = 0

  def __post_init__(self):
    if self.pi_type not in _PI_TYPES:
      raise ValueError("CurvatureOptions: pi_type must be one of %s, got %r."
                       % (", ".join(map(repr, _PI_TYPES)), self.pi_type))
    _check_number("normalize_damping_power", self.normalize_damping_power, 0)
    _check_number("eigenvalue_clipping_threshold",
                  self.eigenvalue_clipping_threshold, 0)
    _check_number("eigenvalue_decomposition_threshold",
                  self.eigenvalue_decomposition_threshold, 0, low_ok=False)
    _check_number("inputs_to_extract_patches_factor",
                  self.inputs_to_extract_patches_factor, 0, low_ok=False)
    if (isinstance(self.factor_block_size, bool) or
        not isinstance(self.factor_block_size, numbers.Integral) or
        self.factor_block_size < 0 or self.factor_block_size == 1):
      raise ValueError("CurvatureOptions: factor_block_size must be 0 (off) "
                       "or an integer >= 2, got %r." %
                       (self.factor_block_size,))
    if not isinstance(self.sub_sample_inputs, bool):
      raise ValueError("CurvatureOptions: sub_sample_inputs must be a bool, "
                       "got %r." % (self.sub_sample_inputs,))

  def damping_normalizer(self, num_positions):
    """c^p: what the damping of a block shared over c positions is divided
    by before the pi split (a Python number, or a float64 tensor when c
    is one)."""
    return _power(num_positions, self.normalize_damping_power)

  def diagonal_damping_scale(self, num_positions):
    """c^(1-p): the multiple of the damping added to an exact diagonal
    shared over c positions (kfac 0.2.x's ConvDiagonalFB)."""
    return _power(num_positions, 1.0 - self.normalize_damping_power)

  def num_sampled_inputs(self, batch_size):
    """ceil(inputs_to_extract_patches_factor * batch_size) for a Python
    int batch size (kfac 0.2.x's rule for sub_sample_inputs=True)."""
    return int(math.ceil(batch_size * self.inputs_to_extract_patches_factor))


def _power(count, exponent):
  if exponent == 0:
    return 1.0
  if isinstance(count, numbers.Real) and not isinstance(count, bool):
    return float(count) ** exponent
  return tf.pow(tf.cast(count, tf.float64), float(exponent))


def check(options):
  """`options`, or a TypeError naming what was passed instead."""
  if not isinstance(options, CurvatureOptions):
    raise TypeError("curvature_options must be a kfac CurvatureOptions "
                    "(kfac.python.ops.layers.base.curvature_options), got %r." %
                    (options,))
  return options
