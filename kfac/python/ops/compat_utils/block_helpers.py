"""Module-level helpers of the old fisher_blocks module: the trace-norm pi
of a pair of Kronecker factors, damping normalisation, stable-id thunks and
depthwise <-> dense conv2d filter conversion."""

import tensorflow as tf

from kfac.python.ops.layers.base import damping as damping_lib
from kfac.python.ops.tensors import utils
from kfac.python.ops.compat_utils import legacy_constants

PI_OFF_NAME = "off"
PI_TRACENORM_NAME = "tracenorm"


def _trace_and_dim(cov):
  """(trace, dimension) of a LinearOperator or a dense square matrix."""
  if isinstance(cov, tf.linalg.LinearOperator):
    dim = cov.domain_dimension
    dim = int(dim) if dim is not None else cov.domain_dimension_tensor()
    return cov.trace(), dim
  cov = tf.convert_to_tensor(cov)
  if cov.shape.rank != 2:
    raise ValueError("Expected a square matrix or a LinearOperator, got "
                     "shape %s." % cov.shape)
  dim = tf.compat.dimension_value(cov.shape[-1])
  if dim is None:
    dim = tf.shape(cov)[-1]
  return tf.linalg.trace(cov), dim


def compute_pi_tracenorm(left_cov, right_cov):
  """pi = sqrt((trace(A) / dim(A)) / (trace(B) / dim(B))) for Kronecker
  factors A = left_cov, B = right_cov (LinearOperators or matrices); 1 when
  either normalised trace is not positive (Martens & Grosse 2015, 6.3)."""
  left_trace, left_dim = _trace_and_dim(left_cov)
  right_trace, right_dim = _trace_and_dim(right_cov)
  dtype = left_trace.dtype
  left = left_trace / tf.cast(left_dim, dtype)
  right = tf.cast(right_trace, dtype) / tf.cast(right_dim, dtype)
  return tf.cast(damping_lib.compute_pi(left, right), dtype)


def compute_pi_adjusted_damping(left_cov, right_cov, damping):
  """(damping * pi, damping / pi) with pi = compute_pi_tracenorm: the
  per-factor dampings whose Kronecker product has the given `damping`
  squared (pass the square root of the block's damping, as the old
  library's blocks did). (damping, damping) when the default pi_type is
  "off" (set_global_constants, read when called, as kfac 0.2.x did)."""
  if legacy_constants.curvature_defaults().pi_type == PI_OFF_NAME:
    return damping, damping
  pi = compute_pi_tracenorm(left_cov, right_cov)
  damping = utils.cast(damping, pi.dtype)
  return damping * pi, damping / pi


def normalize_damping(damping, num_replications):
  """damping / num_replications^p: the damping per use of a layer used
  num_replications times, p the default normalize_damping_power (1 unless
  set_global_constants changed it; read when called, as kfac 0.2.x did)."""
  power = legacy_constants.curvature_defaults().normalize_damping_power
  if not power:
    return damping
  return damping / (num_replications ** power)


class PackagedFunc(object):
  """A zero-argument function with a stable, hashable `func_id`.

  Args:
    func: zero-argument callable.
    func_id: hashable, or a callable returning one, or a list/tuple of
      those; `func_id` evaluates the callables each time it is read.
  """

  def __init__(self, func, func_id):
    if not callable(func):
      raise ValueError("PackagedFunc needs a callable, got %r." % (func,))
    self._func = func
    self._func_id = (tuple(func_id) if isinstance(func_id, (tuple, list))
                     else (func_id,))

  def __call__(self):
    return self._func()

  @property
  def func_id(self):
    return tuple(part() if callable(part) else part
                 for part in self._func_id)


def maybe_tuple(obj):
  """obj as a tuple if it is a list, else obj."""
  return tuple(obj) if isinstance(obj, list) else obj


def depthwise_conv2d_filter_to_conv2d_filter(filter, name=None):  # pylint: disable=redefined-builtin
  """A depthwise filter [kh, kw, in, m] as the equivalent dense conv2d
  filter [kh, kw, in, in * m] (zero outside each channel's m outputs;
  output channel c * m + j is channel c's j-th depthwise output)."""
  with tf.name_scope(name or "depthwise_conv2d_filter_to_conv2d_filter"):
    filter = tf.convert_to_tensor(filter)
    if filter.shape.rank != 4 or not filter.shape.is_fully_defined():
      raise ValueError("filter must be a 4-d tensor of static shape, got %s."
                       % filter.shape)
    kh, kw, cin, m = filter.shape.as_list()
    eye = tf.eye(cin, dtype=filter.dtype)
    dense = tf.einsum("hwcj,cd->hwcdj", filter, eye)
    return tf.reshape(dense, [kh, kw, cin, cin * m])


def conv2d_filter_to_depthwise_conv2d_filter(filter, name=None):  # pylint: disable=redefined-builtin
  """The inverse of `depthwise_conv2d_filter_to_conv2d_filter`: keeps each
  input channel's own block of m output channels of a [kh, kw, in, in * m]
  filter (entries outside those blocks are dropped)."""
  with tf.name_scope(name or "conv2d_filter_to_depthwise_conv2d_filter"):
    filter = tf.convert_to_tensor(filter)
    if filter.shape.rank != 4 or not filter.shape.is_fully_defined():
      raise ValueError("filter must be a 4-d tensor of static shape, got %s."
                       % filter.shape)
    kh, kw, cin, out = filter.shape.as_list()
    if out % cin:
      raise ValueError("A dense filter of shape %s does not come from a "
                       "depthwise one: output channels %d are not a "
                       "multiple of input channels %d." %
                       (filter.shape, out, cin))
    m = out // cin
    blocks = tf.reshape(filter, [kh, kw, cin, cin, m])
    eye = tf.eye(cin, dtype=filter.dtype)
    return tf.einsum("hwcdj,cd->hwcj", blocks, eye)
