"""`ExactCurvatureOperator`: the exact mini-batch curvature as a
LinearOperator, for comparisons with `CurvatureOperator`.

Products are `CurvatureMatrixVectorProductComputer`'s (Fisher, GGN or
Hessian of the registered losses) divided by the number of examples (the
curvature of the mean loss, which K-FAC's statistics approximate; pass
`mean=False` for the summed loss), plus damping * I. Vectors are flat, in
the order of `variables` (by default the layer collection's registration
order: the same flattening as `CurvatureOperator`).

The operator re-evaluates the model: it is built from `model_fn(batch,
layer_collection)` (the function `CurvatureOperator.from_data` takes), which
registers the losses (layers are not needed). In a graph the forward pass is
built once per graph; eagerly, products run in a tf.function. So it works
eagerly, in tf.function and in TF1 graphs, and inside the loop of
`tf.linalg.experimental.conjugate_gradient` (which `solve` uses), where a
product needs a forward pass of its own. Several vectors are multiplied at
once with `tf.vectorized_map`.

`to_dense()` takes one product per parameter; trace, log-determinant,
determinant, eigenvalues and the Frobenius norm are computed from it, so
they are limited to `max_dense_size` parameters.
"""

import weakref

import tensorflow as tf

from kfac.python.ops import curvature_matrix_vector_products as cmvp_lib
from kfac.python.ops.collection import layer_collection as lc_lib
from kfac.python.ops.tensors import utils
from kfac.python.ops.linear_operator import flat

__all__ = ["ExactCurvatureOperator"]

_METHODS = {"fisher": "multiply_fisher", "ggn": "multiply_ggn",
            "hessian": "multiply_hessian"}


@utils.exclude_from_autograph
class ExactCurvatureOperator(flat.FlatVectorOperator):
  """Exact Fisher / GGN / Hessian (+ damping * I) as a LinearOperator.

  Args:
    model_fn: `model_fn(batch, layer_collection)` runs the model on `batch`
      and registers its losses (with targets for "ggn" / "hessian").
    batch: the data `model_fn` gets (any nest of tensors / arrays).
    curvature: "ggn" (default), "fisher" or "hessian".
    damping: a number or scalar tensor added to the diagonal.
    variables: the variables (default: the registered layers' variables, in
      registration order).
    mean: divide the summed-loss curvature by the number of examples (the
      rows of the first registered loss, all its towers).
    tolerance, max_iter: of the conjugate gradient in `solve` (relative
      residual; default max_iter: 10 times the number of parameters, as
      rounding makes CG on ill-conditioned systems take more than n
      steps).
    max_dense_size: the most parameters `to_dense` (and what needs it)
      accepts.
    is_positive_definite: default True for "fisher" / "ggn" with a positive
      Python damping; `solve` (conjugate gradient) needs it.
    name: the operator's name.
  """

  def __init__(self, model_fn, batch, curvature="ggn", damping=0.0,
               variables=None, mean=True, tolerance=1e-10, max_iter=None,
               max_dense_size=2048, is_positive_definite=None,
               name="ExactCurvatureOperator", _layer_collection=None):
    if curvature not in _METHODS:
      raise ValueError("curvature must be one of %s, got %r." %
                       (sorted(_METHODS), curvature))
    if model_fn is not None and not callable(model_fn):
      raise TypeError("model_fn must be callable as model_fn(batch, "
                      "layer_collection), got %r." % (model_fn,))
    object.__setattr__(self, "_model_fn", model_fn)
    object.__setattr__(self, "_batch", batch)
    self._method = _METHODS[curvature]
    self._curvature = curvature
    object.__setattr__(self, "_damping", damping)
    self._mean = bool(mean)
    self._tolerance = tolerance
    self._max_dense_size = int(max_dense_size)
    # graph -> (layer collection, product computer)
    object.__setattr__(self, "_graphs", weakref.WeakKeyDictionary())
    if _layer_collection is not None:
      graph = tf.compat.v1.get_default_graph()
      self._graphs[graph] = (_layer_collection, None)
      registered = _layer_collection.registered_variables
    else:
      registered = self._discover_variables()
    variables = list(registered if variables is None else variables)
    if not variables:
      raise ValueError("No variables: register the layers in model_fn or "
                       "pass variables=[...].")
    for v in variables:
      if not v.shape.is_fully_defined():
        raise ValueError("Variable %s needs a static shape, got %s." %
                         (utils.variable_name(v), v.shape))
    object.__setattr__(self, "_variables", tuple(variables))
    self._sizes = [v.shape.num_elements() for v in variables]
    self._size = sum(self._sizes)
    self._max_iter = 10 * self._size if max_iter is None else int(max_iter)
    if is_positive_definite is None and curvature != "hessian" and (
        utils.is_python_number(damping) and damping > 0):
      is_positive_definite = True
    object.__setattr__(self, "_eager_products",
                       tf.function(self._graph_products,
                                   reduce_retracing=True))
    object.__setattr__(self, "_eager_cg", tf.function(
        self.conjugate_gradient, reduce_retracing=True))
    super().__init__(
        dtype=variables[0].dtype.base_dtype, is_self_adjoint=True,
        is_square=True, is_positive_definite=is_positive_definite,
        is_non_singular=True if is_positive_definite else None, name=name,
        parameters=dict(model_fn=model_fn, batch=batch, curvature=curvature,
                        damping=damping, variables=variables, mean=mean,
                        tolerance=tolerance, max_iter=max_iter,
                        max_dense_size=max_dense_size, name=name))

  @classmethod
  def from_layer_collection(cls, layer_collection, curvature="ggn",
                            damping=0.0, variables=None, mean=True, **kwargs):
    """Products on the forward pass a LayerCollection was registered on
    (its graph only: `solve` needs `model_fn`, since the conjugate
    gradient's loop needs a forward pass of its own)."""
    if tf.executing_eagerly():
      raise ValueError("from_layer_collection uses the registered graph: "
                       "call it inside a tf.function or a TF1 graph.")
    return cls(None, None, curvature=curvature, damping=damping,
               variables=variables, mean=mean,
               _layer_collection=layer_collection, **kwargs)

  def _build_model(self):
    lc = lc_lib.LayerCollection(name="ExactCurvatureOperator")
    self._model_fn(self._batch, lc)
    if not lc.losses:
      raise ValueError("model_fn registered no loss: register the model's "
                       "predictive distribution (e.g. "
                       "register_softmax_cross_entropy_loss(logits, "
                       "targets=labels)) in it.")
    return lc

  def _discover_variables(self):
    if self._model_fn is None:
      raise ValueError("ExactCurvatureOperator needs model_fn.")
    if not tf.executing_eagerly():
      lc = self._build_model()
      self._graphs[tf.compat.v1.get_default_graph()] = (lc, None)
      return lc.registered_variables
    found = []

    def trace():
      found.append(self._build_model().registered_variables)
    tf.function(trace).get_concrete_function()
    return found[0]

  # ------------------------------------------------------------ products
  @property
  def variables(self):
    """The variables the operator acts on, in the flattened order."""
    return self._variables

  @property
  def curvature(self):
    return self._curvature

  def _computer(self):
    """(layer collection, product computer) of the current graph."""
    graph = tf.compat.v1.get_default_graph()
    lc, computer = self._graphs.get(graph, (None, None))
    if lc is None:
      if self._model_fn is None:
        raise ValueError(
            "%s was made from a LayerCollection, whose forward pass exists "
            "only in its own graph; this product is built in another graph "
            "(e.g. the loop of solve's conjugate gradient). Make the "
            "operator from model_fn and batch instead." % self.name)
      lc = self._build_model()
    if computer is None:
      computer = cmvp_lib.CurvatureMatrixVectorProductComputer(
          lc, list(self._variables))
      self._graphs[graph] = (lc, computer)
    return lc, computer

  def _examples(self, lc):
    towers = lc.towers_by_loss[0]
    return tf.add_n([tf.shape(loss.inputs[0])[0] for loss in towers])

  def _graph_products(self, rows):
    """rows [m, n] -> [m, n] products (graph mode)."""
    lc, computer = self._computer()
    scale = None
    if self._mean:
      scale = 1.0 / tf.cast(self._examples(lc), self.dtype)
    damping = utils.cast(self._damping, self.dtype)

    def one(vec):
      parts, start = [], 0
      for v, size in zip(self._variables, self._sizes):
        parts.append(tf.reshape(vec[start:start + size], v.shape))
        start += size
      prod = getattr(computer, self._method)(parts)
      flat = tf.concat([tf.reshape(p, [-1]) for p in prod], axis=0)
      if scale is not None:
        flat = flat * scale
      return flat + damping * vec

    m = rows.shape[0]
    if m == 1:
      return one(rows[0])[tf.newaxis]
    try:
      return tf.vectorized_map(one, rows, fallback_to_while_loop=False)
    except Exception:  # pylint: disable=broad-except
      if m is None:
        raise
      return tf.stack([one(rows[i]) for i in range(m)])

  def _products(self, rows):
    if tf.executing_eagerly():
      return self._eager_products(rows)
    return self._graph_products(rows)

  def _apply_vectors(self, x, solve=False):
    x = tf.convert_to_tensor(x, self.dtype)
    rows = tf.reshape(x, [-1, self._size])
    out = self._solve_rows(rows) if solve else self._products(rows)
    return tf.reshape(out, tf.shape(x))

  def _matvec(self, x, adjoint=False):
    del adjoint
    return self._apply_vectors(x)

  def _matmul(self, x, adjoint=False, adjoint_arg=False):
    del adjoint
    x = tf.convert_to_tensor(x, self.dtype)
    xt = x if adjoint_arg else tf.linalg.matrix_transpose(x)
    return tf.linalg.matrix_transpose(self._apply_vectors(xt))

  # ------------------------------------------------------------ solves
  def conjugate_gradient(self, rhs, preconditioner=None):
    """The `tf.linalg.experimental.conjugate_gradient` state of solving
    this system for rhs [..., n] (x, residual r, iterations i, ...), with
    the operator's tolerance and max_iter; e.g. a `CurvatureOperator`'s
    inverse() as `preconditioner`."""
    self._check_solvable()
    rhs = tf.convert_to_tensor(rhs, self.dtype)
    self._check_dim(rhs, -1, "conjugate_gradient")

    def solve(rhs):
      return tf.linalg.experimental.conjugate_gradient(
          self, rhs, preconditioner=preconditioner, tol=self._tolerance,
          max_iter=self._max_iter)
    if tf.executing_eagerly():  # the loop as one graph
      if preconditioner is None:
        return self._eager_cg(rhs)
      return tf.function(solve)(rhs)
    return solve(rhs)

  def _check_solvable(self):
    if not self.is_positive_definite:
      raise ValueError(
          "%s.solve uses the conjugate gradient, which needs a positive "
          "definite operator: the %s with damping %r is not known to be one "
          "(pass is_positive_definite=True if it is)." %
          (self.name, self._curvature, self._damping))

  def _solve_rows(self, rows):
    return self.conjugate_gradient(rows).x

  def _solvevec(self, rhs, adjoint=False):
    del adjoint
    return self._apply_vectors(rhs, solve=True)

  def _solve(self, rhs, adjoint=False, adjoint_arg=False):
    del adjoint
    rhs = tf.convert_to_tensor(rhs, self.dtype)
    rt = rhs if adjoint_arg else tf.linalg.matrix_transpose(rhs)
    return tf.linalg.matrix_transpose(self._apply_vectors(rt, solve=True))

  # ------------------------------------------------------------ dense
  def _to_dense(self):
    if self._size > self._max_dense_size:
      raise ValueError(
          "%s needs its dense matrix here (to_dense, and the trace, "
          "log-determinant, determinant, eigenvalues and norms computed "
          "from it), which is limited to max_dense_size=%d parameters; this "
          "operator has %d. Pass a larger max_dense_size if you have the "
          "time (one product per parameter) and memory." %
          (self.name, self._max_dense_size, self._size))
    rows = self._products(tf.eye(self._size, dtype=self.dtype))
    return tf.linalg.matrix_transpose(rows)

  def frobenius_norm(self, name="frobenius_norm"):
    with self._name_scope(name):  # pylint: disable=not-callable
      return tf.norm(self.to_dense())

  def eigenvalues(self, name="eigenvalues"):
    with self._name_scope(name):  # pylint: disable=not-callable
      return self.eigvals()

  def _shape(self):
    return tf.TensorShape([self._size, self._size])

  def _shape_tensor(self):
    return tf.constant([self._size, self._size], dtype=tf.int32)
