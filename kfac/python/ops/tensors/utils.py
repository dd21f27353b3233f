"""Tensor plumbing shared by every layer of the package (layer 1)."""

import inspect
import numbers
import weakref

import tensorflow as tf


def is_tensor_or_variable(x):
  return isinstance(x, (tf.Tensor, tf.Variable)) or tf.is_tensor(x)


def ensure_sequence(obj):
  """Wraps a single object into a tuple; lists and tuples pass through."""
  if isinstance(obj, (list, tuple)):
    return tuple(obj)
  return (obj,)


def hashable_key(obj):
  """A hashable stand-in for tensors/variables (which are unhashable in TF2).

  Tensors and variables map to `.ref()`; lists and tuples are mapped
  recursively; everything else must be hashable already.
  """
  if isinstance(obj, (list, tuple)):
    return tuple(hashable_key(o) for o in obj)
  if isinstance(obj, tf.Variable) or tf.is_tensor(obj):
    return obj.ref()
  return obj


def variable_name(var):
  """A readable name of a variable without the ':0' suffix."""
  name = getattr(var, "name", None) or "var"
  return name.split(":")[0]


def state_name(var):
  """The name K-FAC state of `var` is keyed by: the variable's name, unless
  an integration set a more stable one as `var._kfac_state_name` (the Keras
  optimizer names variables by their layer's position in the model, so that
  a rebuilt model with other automatic layer names finds its state)."""
  return getattr(var, "_kfac_state_name", None) or variable_name(var)


def append_homog(tensor):
  """Appends a column of ones to a [batch, n] tensor (bias input)."""
  ones = tf.ones_like(tensor[:, :1])
  return tf.concat([tensor, ones], axis=1)


def tensors_to_column(tensors):
  """Flattens a tensor or a sequence of tensors into one [n, 1] column."""
  if isinstance(tensors, (list, tuple)):
    return tf.concat([tf.reshape(t, [-1, 1]) for t in tensors], axis=0)
  return tf.reshape(tensors, [-1, 1])


def column_to_tensors(tensors_template, colvec):
  """Inverse of `tensors_to_column`, shaped like `tensors_template`."""
  if isinstance(tensors_template, (list, tuple)):
    offset = 0
    out = []
    for t in tensors_template:
      size = t.shape.num_elements()
      if size is None:
        raise ValueError("column_to_tensors needs static shapes; got %s "
                         "with shape %s." % (getattr(t, "name", t), t.shape))
      out.append(tf.reshape(colvec[offset:offset + size], tf.shape(t)))
      offset += size
    return tuple(out)
  return tf.reshape(colvec, tf.shape(tensors_template))


def mat_to_params(mat, params_template):
  """Splits a [in(+1), out] weight matrix back into (W, b) or W."""
  if isinstance(params_template, (list, tuple)):
    w, b = params_template
    return (tf.reshape(mat[:-1], tf.shape(w)), tf.reshape(mat[-1], tf.shape(b)))
  return tf.reshape(mat, tf.shape(params_template))


def params_to_mat(params):
  """Stacks (W [in,out], b [out]) into one [in+1, out] matrix; W alone as is."""
  if isinstance(params, (list, tuple)):
    w, b = params
    w = tf.reshape(w, [-1, tf.shape(w)[-1]])
    return tf.concat([w, tf.reshape(b, [1, -1])], axis=0)  # b: [out] or [1, out]
  return tf.reshape(params, [-1, tf.shape(params)[-1]])


def inner_product(list1, list2):
  """Sum over the list of elementwise products of matching tensors."""
  terms = [tf.reduce_sum(a * b) for a, b in zip(list1, list2)]
  return tf.add_n(terms) if terms else tf.constant(0.0)


def batch_size(tensor):
  """Dynamic first dimension of a tensor, as an int32 scalar."""
  return tf.shape(tensor)[0]


def is_python_number(x):
  return isinstance(x, numbers.Number) and not isinstance(x, bool)


def scalar_identity(value):
  """A stable identity of a damping-like value: numbers by value, tensors
  and variables by object identity (so two different tensors never share
  cached inverses)."""
  if is_python_number(value):
    return ("const", float(value))
  return ("obj", hashable_key(value))


def zeros_like_if_none(grads, like):
  return [tf.zeros_like(x) if g is None else g for g, x in zip(grads, like)]


# Per graph: {(value, dtype name): Const} for shared_constant.
_SHARED_CONSTANTS = weakref.WeakKeyDictionary()


def shared_constant(value, dtype):
  """tf.constant(value, dtype), made once per graph and reused by every
  caller in that graph (a new one in eager mode and inside TF1 control-flow
  contexts). For the scalars that per-factor ops take as inputs (diagonal
  offsets, reduction axes, dimensions): a model with hundreds of factors
  would otherwise build a Const node per op. Made without the control
  dependencies, device and colocation in scope, so that sharing it orders
  and places nothing."""
  dtype = tf.as_dtype(dtype)
  if tf.executing_eagerly():
    return tf.constant(value, dtype)
  graph = tf.compat.v1.get_default_graph()
  if graph._get_control_flow_context() is not None:  # pylint: disable=protected-access
    return tf.constant(value, dtype)
  cache = _SHARED_CONSTANTS.setdefault(graph, {})
  key = (repr(value), dtype.name)
  found = cache.get(key)
  if found is None:
    with tf.control_dependencies(None), graph.colocate_with(
        None, ignore_existing=True), graph.device(None), tf.name_scope(
            "shared_constants/"):
      found = tf.constant(value, dtype)
    cache[key] = found
  return found


def trace(mat):
  """The trace of a square matrix (or of each of a batch [..., n, n]), as
  tf.linalg.trace computes it, with shared constants (shared_constant)."""
  diag = tf.raw_ops.MatrixDiagPartV3(
      input=mat, k=shared_constant(0, tf.int32),
      padding_value=shared_constant(0, mat.dtype), align="RIGHT_LEFT")
  return tf.raw_ops.Sum(input=diag, axis=shared_constant(-1, tf.int32),
                        keep_dims=False)


def cast(value, dtype):
  """tf.cast that keeps full precision for Python numbers (tf.cast would
  round them through float32 first)."""
  dtype = tf.as_dtype(dtype)
  if (isinstance(value, (int, float)) and not isinstance(value, bool) and
      (dtype.is_floating or dtype.is_complex)):
    return tf.constant(value, dtype)
  return tf.cast(value, dtype)


def dims_product(tensor, start, stop):
  """Product of the dimensions tensor.shape[start:stop] (e.g. the positions
  a layer shares its weights over): a Python int when they are static, else
  a scalar int32 tensor."""
  dims = tensor.shape[start:stop]
  if dims.is_fully_defined():
    return int(dims.num_elements())
  return tf.reduce_prod(tf.shape(tensor)[start:stop])


def exclude_from_autograph(cls):
  """Class decorator: tf.function's autograph calls the public methods of
  `cls` (its own and inherited kfac ones) as plain Python.

  kfac builds graphs with ordinary Python control flow on static values; it
  has nothing for autograph to convert. Without this, a `tf.function` that
  registers layers and calls the optimizer would have autograph convert
  every kfac function it reaches (over a thousand), which made tracing a
  small model several times slower.
  """
  for name in dir(cls):
    if name.startswith("_"):
      continue
    attr = inspect.getattr_static(cls, name)
    if not inspect.isfunction(attr):
      continue  # properties, static/class methods, non-callables
    if not getattr(attr, "__module__", "").startswith("kfac"):
      continue
    setattr(cls, name, tf.autograph.experimental.do_not_convert(attr))
  return cls


def cond_op(pred, make_op):
  """An op that runs make_op() only when the scalar bool `pred` holds.

  The result obeys the surrounding `tf.control_dependencies`, also in a TF1
  graph: there `tf.cond` does not attach the context's control inputs to its
  `If` op (only a tf.function orders it by program order), so the predicate
  goes through an Identity created here, under that context."""
  pred = tf.identity(pred)

  def run():
    with tf.control_dependencies([make_op()]):
      return tf.constant(True)
  return tf.cond(pred, run, lambda: tf.constant(False))


def in_xla_context():
  """Whether ops built now are compiled by XLA (jit_compile=True), which
  cannot compile prints, assertions or summary writes."""
  try:
    from tensorflow.python.ops import control_flow_util  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  if tf.executing_eagerly():
    return False
  return control_flow_util.GraphOrParentsInXlaContext(
      tf.compat.v1.get_default_graph())
