"""`CurvatureOperator`: K-FAC's curvature approximation as a LinearOperator.

The block-diagonal (damped) curvature approximation of a model registered in
a `LayerCollection` (statistics from a `FisherEstimator`), as a
`tf.linalg.LinearOperator` over the flattened parameters, usable wherever
TensorFlow (or TensorFlow Probability) takes a LinearOperator.

Flattened order (`operator.variables`): the layer collection's blocks in
registration order, within a block its parameters in registration order,
each flattened row-major. `operator.flatten(tensors)` / `unflatten(vector)`
convert between that vector and per-variable tensors.

Every method works block by block on a spectral snapshot of each block
(spectral.py: B = (L (x) R) diag(vec(E)) (L (x) R)^T in the block's matrix
view) kept in the operator's own variables. Products, solves, powers,
eigenvalues, trace, log-determinant and Frobenius norm never build the
dense matrix; `to_dense()` does (small models). The snapshot is taken when
the operator is made (eagerly; in a graph, by the op `refresh()` returns)
and again at each `refresh()`; `tf.train.Checkpoint(op=operator)` saves it.
"""

import weakref

import tensorflow as tf

from kfac.python.ops.tensors import utils
from kfac.python.ops.linear_operator import flat
from kfac.python.ops.linear_operator import from_data as from_data_lib
from kfac.python.ops.linear_operator import layout as layout_lib
from kfac.python.ops.linear_operator import spectral

__all__ = ["CurvatureOperator", "curvature_from_data"]

_ROLES = ("left", "right", "eigenvalues")


class _Shared:
  """What an operator and its powers share (not checkpointed)."""

  def __init__(self, layer_collection, layouts, damping, damped, dtype):
    self.layer_collection = layer_collection
    self.layouts = layouts
    self.damping = damping
    self.damped = damped
    self.dtype = dtype
    self.size = sum(l.size for l in layouts)
    self.variables = tuple(v for l in layouts for v in l.params)
    self.refresh_ops = weakref.WeakKeyDictionary()  # TF1 graph -> op


@utils.exclude_from_autograph
class CurvatureOperator(flat.FlatVectorOperator):
  """The damped block-diagonal curvature approximation as a LinearOperator.

  Args:
    layer_collection: a `LayerCollection` whose blocks have statistics (a
      `FisherEstimator` or optimizer was built on it); see also
      `from_estimator` and `from_data`.
    damping: None uses the estimator's damping (split between Kronecker
      factors by the pi rule, as the estimator's products do); a number,
      tensor or variable replaces it.
    damped: False gives the undamped approximation (then the operator may
      be singular).
    name: the operator's name.
  """

  def __init__(self, layer_collection, damping=None, damped=True,
               name="CurvatureOperator", _shared=None, _state=None,
               _exponent=1.0):
    parameters = dict(layer_collection=layer_collection, damping=damping,
                      damped=damped, name=name)
    fresh = _shared is None
    if fresh:
      layouts = layout_lib.make_layouts(layer_collection)
      views = self._views_of(layouts, damped, damping)
      dtype = self._common_dtype(layouts, views)
      _shared = _Shared(layer_collection, layouts, damping, damped, dtype)
    positive = bool(damped) and not (utils.is_python_number(damping) and
                                     damping <= 0)
    super().__init__(
        dtype=_shared.dtype, is_self_adjoint=True, is_square=True,
        is_non_singular=True if positive else None,
        is_positive_definite=True if positive else None, name=name,
        parameters=parameters)
    object.__setattr__(self, "_shared", _shared)
    self._exponent = float(_exponent)
    if fresh:
      self._state = self._make_state(views)
      self._assign_or_cache(views)
    else:
      self._state = _state

  # ------------------------------------------------------------ building
  @staticmethod
  def _views_of(layouts, damped, damping):
    views = []
    for lay in layouts:
      view = spectral.spectral_view(lay.block, damped=damped, damping=damping)
      evals = tf.convert_to_tensor(view.eigenvalues)
      if evals.shape.num_elements() != lay.size:
        raise ValueError(
            "The spectral view of block %s has %s eigenvalues (shape %s) for "
            "%d parameters." % (lay.name, evals.shape.num_elements(),
                                evals.shape, lay.size))
      views.append(spectral.SpectralView(view.left, view.right, evals))
    return views

  @staticmethod
  def _common_dtype(layouts, views):
    dtypes = {}
    for lay, view in zip(layouts, views):
      dtypes.setdefault(view.eigenvalues.dtype.base_dtype, lay.name)
    if len(dtypes) > 1:
      raise ValueError(
          "Blocks compute their curvature in different dtypes (%s); a "
          "CurvatureOperator needs one dtype." %
          ", ".join("%s: %s" % (d.name, n) for d, n in dtypes.items()))
    return next(iter(dtypes))

  def _make_state(self, views):
    state = {}
    with tf.init_scope():
      for i, view in enumerate(views):
        for role, value in zip(_ROLES, view):
          if value is None:
            continue
          shape = value.shape
          if not shape.is_fully_defined():
            raise ValueError("The %s of block %s has no static shape (%s)." %
                             (role, self._shared.layouts[i].name, shape))
          state["block%d_%s" % (i, role)] = tf.Variable(
              tf.zeros(shape, self.dtype), trainable=False,
              name="%s_block%d_%s" % (self.name, i, role))
    return state

  def _assign_ops(self, views):
    ops = []
    for i, view in enumerate(views):
      for role, value in zip(_ROLES, view):
        key = "block%d_%s" % (i, role)
        has_var = key in self._state
        if (value is None) == has_var:
          raise ValueError(
              "Block %s changed its spectral structure (%s is %s now)." %
              (self._shared.layouts[i].name, role,
               "missing" if value is None else "present"))
        if has_var:
          ops.append(self._state[key].assign(tf.cast(value, self.dtype)))
    return tf.group(*ops)

  def _assign_or_cache(self, views):
    op = self._assign_ops(views)
    if tf.executing_eagerly():
      return None
    graph = tf.compat.v1.get_default_graph()
    if getattr(graph, "building_function", False):
      return None  # tf.function runs the assignments in program order
    self._shared.refresh_ops[graph] = op
    return op

  def refresh(self, source=None):
    """Recomputes the snapshot from the current statistics (and damping).

    Eagerly and in a tf.function it assigns (at once, or in program
    order) and returns None; in a TF1 graph it returns the op that assigns
    (the same op on every call: run it after initializing the variables,
    and whenever the statistics changed). `source`: an estimator or
    LayerCollection registering the same layers, to read the statistics
    through (e.g. the one built in the current tf.function trace);
    default the one the operator was made from.
    """
    shared = self._shared
    if source is not None:
      lc = layout_lib.layer_collection_of(source)
      layouts = layout_lib.make_layouts(lc)
      old = [(utils.variable_name(v), v.shape.as_list())
             for v in shared.variables]
      new = [(utils.variable_name(v), v.shape.as_list())
             for l in layouts for v in l.params]
      if old != new:
        raise ValueError("refresh(source): the source registers other "
                         "variables (%s) than this operator (%s)." %
                         (new, old))
      shared.layouts = layouts
      shared.layer_collection = lc
      shared.refresh_ops = weakref.WeakKeyDictionary()
    elif not tf.executing_eagerly():
      graph = tf.compat.v1.get_default_graph()
      if graph in shared.refresh_ops:
        return shared.refresh_ops[graph]
    views = self._views_of(shared.layouts, shared.damped, shared.damping)
    return self._assign_or_cache(views)

  # ------------------------------------------------------------ constructors
  @classmethod
  def from_estimator(cls, estimator, damping=None, damped=True,
                     name="CurvatureOperator"):
    """The curvature of a `FisherEstimator` (or of the LayerCollection an
    estimator was built on), with its current statistics; damping None is
    the estimator's."""
    return cls(layout_lib.layer_collection_of(estimator), damping=damping,
               damped=damped, name=name)

  @classmethod
  def from_data(cls, model_fn, dataset, damping, **kwargs):
    """Registers the model with `model_fn(batch, layer_collection)` and
    averages the statistics over one pass of `dataset`; see
    `curvature_from_data` for the arguments."""
    return curvature_from_data(model_fn, dataset, damping,
                               operator_class=cls, **kwargs)

  # ------------------------------------------------------------ structure
  @property
  def variables(self):
    """The model variables the operator acts on, in the flattened order.
    (The operator's own snapshot variables are `state_variables`.)"""
    return self._shared.variables

  @property
  def state_variables(self):
    return [self._state[k] for k in sorted(self._state)]

  @property
  def layer_collection(self):
    return self._shared.layer_collection

  @property
  def damped(self):
    return self._shared.damped

  @property
  def exponent(self):
    """The power of the curvature this operator applies (1, or p for
    `power(p)`, -1 for `inverse()`)."""
    return self._exponent

  def block_slices(self):
    """[(block, slice into the flat vector)] in the flattened order."""
    return [(l.block, slice(l.offset, l.offset + l.size))
            for l in self._shared.layouts]

  def views(self):
    """The snapshot: one SpectralView (L, R, E) of tensors per block."""
    out = []
    for i in range(len(self._shared.layouts)):
      parts = [self._state.get("block%d_%s" % (i, role)) for role in _ROLES]
      out.append(spectral.SpectralView(
          *[None if p is None else tf.convert_to_tensor(p) for p in parts]))
    return out

  # ------------------------------------------------------------ products
  def _apply_rows(self, rows, exp):
    """rows [m, n] of flat vectors -> their products with C^exp."""
    outs = []
    for lay, view in zip(self._shared.layouts, self.views()):
      part = rows[:, lay.offset:lay.offset + lay.size]
      mats = spectral.apply_view(view.left, view.right, view.eigenvalues,
                        lay.to_views(part), exp)
      outs.append(lay.from_views(mats))
    return outs[0] if len(outs) == 1 else tf.concat(outs, axis=1)

  def _apply_vectors(self, x, exp):
    x = tf.convert_to_tensor(x, self.dtype)
    rows = tf.reshape(x, [-1, self._shared.size])
    return tf.reshape(self._apply_rows(rows, exp), tf.shape(x))

  def _apply_columns(self, x, exp, adjoint_arg):
    x = tf.convert_to_tensor(x, self.dtype)
    xt = x if adjoint_arg else tf.linalg.matrix_transpose(x)
    out = self._apply_vectors(xt, exp)
    return tf.linalg.matrix_transpose(out)

  def _matmul(self, x, adjoint=False, adjoint_arg=False):
    del adjoint  # self-adjoint (real)
    return self._apply_columns(x, self._exponent, adjoint_arg)

  def _matvec(self, x, adjoint=False):
    del adjoint
    return self._apply_vectors(x, self._exponent)

  def _solve(self, rhs, adjoint=False, adjoint_arg=False):
    del adjoint
    return self._apply_columns(rhs, -self._exponent, adjoint_arg)

  def _solvevec(self, rhs, adjoint=False):
    del adjoint
    return self._apply_vectors(rhs, -self._exponent)

  def power(self, exponent, name=None):
    """C^p as a CurvatureOperator sharing this operator's snapshot (so a
    refresh of either updates both). Fractional powers need a positive
    semidefinite curvature (not an indefinite GGN)."""
    if not utils.is_python_number(exponent):
      raise TypeError("power takes a Python number, got %r." % (exponent,))
    return type(self)(self._shared.layer_collection,
                      damping=self._shared.damping, damped=self._shared.damped,
                      name=name or "%s_pow" % self.name,
                      _shared=self._shared, _state=self._state,
                      _exponent=self._exponent * float(exponent))

  def _linop_inverse(self):
    return self.power(-1, name="%s_inverse" % self.name)

  # ------------------------------------------------------------ spectra
  def _eigen_parts(self, exp=None):
    exp = self._exponent if exp is None else exp
    return [tf.reshape(spectral.eigen_power(v.eigenvalues, exp), [-1])
            for v in self.views()]

  def _all_eigenvalues(self):
    parts = self._eigen_parts()
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)

  def _eigvals(self):
    return tf.sort(self._all_eigenvalues())

  def eigenvalues(self, name="eigenvalues"):
    """All eigenvalues, ascending (the same as `eigvals()`)."""
    with self._name_scope(name):  # pylint: disable=not-callable
      return self._eigvals()

  def _trace(self):
    return tf.reduce_sum(self._all_eigenvalues())

  def _log_abs_determinant(self):
    logs = [tf.reduce_sum(tf.math.log(tf.abs(v.eigenvalues)))
            for v in self.views()]
    return utils.cast(self._exponent, self.dtype) * tf.add_n(logs)

  def _determinant(self):
    sign = tf.reduce_prod(tf.sign(self._all_eigenvalues()))
    return sign * tf.exp(self._log_abs_determinant())

  def _cond(self):
    mags = tf.abs(self._all_eigenvalues())
    return tf.reduce_max(mags) / tf.reduce_min(mags)

  def frobenius_norm(self, name="frobenius_norm"):
    """||C^p||_F = sqrt(sum of squared eigenvalues), block by block."""
    with self._name_scope(name):  # pylint: disable=not-callable
      return tf.norm(self._all_eigenvalues())

  def _diag_part(self):
    # diag of L diag(E) L^T (x) ... in the view: (L o L) E (R o R)^T.
    outs = []
    for lay, view in zip(self._shared.layouts, self.views()):
      diag = spectral.eigen_power(view.eigenvalues, self._exponent)
      if view.left is not None:
        diag = tf.matmul(tf.square(view.left), diag)
      if view.right is not None:
        diag = tf.matmul(diag, tf.square(view.right), transpose_b=True)
      outs.append(lay.from_views(diag[tf.newaxis])[0])
    return tf.concat(outs, axis=0)

  # ------------------------------------------------------------ dense
  max_dense_size = 8192

  def _to_dense(self):
    n = self._shared.size
    if n > self.max_dense_size:
      raise ValueError(
          "%s.to_dense: %d parameters is above max_dense_size=%d (a dense "
          "[n, n] matrix); use the operator's structured methods, or raise "
          "max_dense_size on the operator if you have the memory." %
          (self.name, n, self.max_dense_size))
    return self._apply_rows(tf.eye(n, dtype=self.dtype), self._exponent)

  def _shape(self):
    n = self._shared.size
    return tf.TensorShape([n, n])

  def _shape_tensor(self):
    n = self._shared.size
    return tf.constant([n, n], dtype=tf.int32)


def curvature_from_data(model_fn, dataset, damping, damped=True,
                        estimation_mode="gradients", steps=None, verbose=1,
                        log_every=100, session=None, name="CurvatureOperator",
                        operator_class=None):
  """A CurvatureOperator of the statistics averaged over `dataset`.

  Args:
    model_fn: `model_fn(batch, layer_collection)`: runs the model on one
      element of `dataset` and registers its layers and losses (the loss
      with targets for the data-dependent modes). Called once per traced
      batch shape (and once more at the end), not once per batch.
    dataset: a `tf.data.Dataset` of batches (or, eagerly, any re-iterable
      collection of batches).
    damping: the damping of the operator (a number or variable), split
      between Kronecker factors as the estimator does.
    damped: False gives the undamped curvature.
    estimation_mode: the FisherEstimator mode ("gradients": one sampled
      target per example; "exact": the exact Fisher / GGN per example,
      one backward pass per output; "empirical", ...).
    steps: the number of batches of a pass (required for a dataset that
      repeats forever); default the whole dataset.
    verbose: 0 silent, 1 a line every `log_every` batches and at the end
      of each pass.
    log_every: batches between progress lines.
    session: the tf.compat.v1.Session to run the pass in when called in a
      TF1 graph (the model's variables must be initialized).
    name: the operator's name.
    operator_class: the class to make (default CurvatureOperator).

  Returns:
    The operator (its statistics live in `operator.statistics_store`).
  """
  if operator_class is None:
    operator_class = CurvatureOperator
  return from_data_lib.operator_from_data(
      operator_class, model_fn, dataset, damping, damped, estimation_mode,
      steps, verbose, log_every, session, name)
