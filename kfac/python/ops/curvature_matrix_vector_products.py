"""Exact mini-batch curvature-matrix-vector products.

`CurvatureMatrixVectorProductComputer(layer_collection, wrt_tensors)` forms
products of the exact curvature of the registered losses w.r.t. a list of
tensors or variables (`wrt_tensors`) with vectors aligned with that list.
Nothing is approximated and no statistics are kept: each call builds a few
gradient passes in the current graph.

Notation. The layer collection holds losses L_l (one entry per loss *tower*:
a loss registered twice under one name with reuse=True contributes both
towers), each with a coefficient c_l. z_l is the tuple of a loss's inputs
(`loss.inputs`: logits, or mean and variance, ...), J_l the Jacobian of z_l
w.r.t. the flattened wrt tensors, and for each loss

* F_l, its Fisher w.r.t. z_l (`loss.multiply_fisher`), with F_l = B_l B_l^T
  (`loss.multiply_fisher_factor`),
* H_l, the Hessian of L_l w.r.t. z_l at the data targets ("GGN" curvature,
  `loss.multiply_ggn`), with H_l = B_l S_l B_l^T where S_l is a constant
  diagonal of +-1 signs (`loss.ggn_factor_signs`; None means S_l = I).

Then

    Fisher    F = sum_l c_l J_l^T F_l J_l
    GGN       G = sum_l c_l J_l^T H_l J_l
    Hessian   H = d^2 (sum_l c_l L_l) / d w^2        (layer_collection.total_loss())

Losses are negative log-likelihoods SUMMED over the batch, so these are
sums over examples, without a 1/N: the curvature of the mean loss, which the
optimizer uses, is the product divided by the batch size.

Cost. `multiply_fisher` / `multiply_ggn` take one Jacobian-vector product
for all loss inputs at once (forward mode pushed op by op through the
existing graph, `kfac.python.ops.forward_mode`, since the forward pass
already exists and `tf.autodiff.ForwardAccumulator` cannot be used on it;
about the cost of two forward passes) and one vector-Jacobian product over
all loss inputs at once: about the cost of two backward passes in total. The
Hessian product is a double backward pass of the total loss.

Factor products. `multiply_fisher_factor_transpose(v)` returns, per loss
tower, u_l = sqrt(c_l) B_l^T J_l v in that loss's factor space (shape
`loss.fisher_factor_inner_shape`); `multiply_fisher_factor(us)` returns
sum_l sqrt(c_l) J_l^T B_l u_l. Hence multiply_fisher(v) ==
multiply_fisher_factor(multiply_fisher_factor_transpose(v)) and
v^T F v == sum_l ||u_l||^2. The GGN analogues use the GGN factors; when a
loss has signs (`ggn_factor_signs`: a list over loss towers of None or a
numpy +-1 vector over the last axis of the factor space) the GGN is
J^T B S B^T J, so v^T G v == sum_l sum(signs_l * u_l^2), and
multiply_ggn_factor(multiply_ggn_factor_transpose(v)) is J^T B B^T J v,
which is G v only for sign-free losses.

Gradients w.r.t. variables read through `tf.gather` (IndexedSlices) are
made dense; a wrt tensor no loss depends on gets zero products. Everything
must be built in graph mode: a TF1 `tf.Graph` run by a Session, or inside a
`tf.function`.
"""

import tensorflow as tf

from kfac.python.ops import forward_mode
from kfac.python.ops.tensors import utils

__all__ = ["CurvatureMatrixVectorProductComputer"]


def _dense(x):
  if isinstance(x, tf.IndexedSlices):
    return tf.convert_to_tensor(x)
  return x


def _as_tuple(x):
  return tuple(x) if isinstance(x, (list, tuple)) else (x,)


def _zeros_like(x):
  if x.shape.is_fully_defined():
    return tf.zeros(x.shape, x.dtype)
  return tf.zeros_like(x)


def _describe(x):
  return "%r" % utils.variable_name(x)


class CurvatureMatrixVectorProductComputer(object):
  """Exact products of the mini-batch Fisher / GGN / Hessian with vectors.

  Args:
    layer_collection: the `LayerCollection` whose registered losses define
      the curvature (every loss tower, with its coeff).
    wrt_tensors: list of tensors or variables the curvature is taken
      w.r.t. Vectors passed to and returned by the products are lists
      aligned with it (same shapes).
    colocate_gradients_with_ops: accepted for compatibility with the
      tf.contrib API and ignored (TF2's `tf.gradients` has no such option).

  See the module docstring for the exact definitions and conventions
  (products of the summed, not the mean, loss).
  """

  def __init__(self, layer_collection, wrt_tensors,
               colocate_gradients_with_ops=True):
    del colocate_gradients_with_ops  # No effect in TF2.
    self._layer_collection = layer_collection
    if isinstance(wrt_tensors, (list, tuple)):
      wrt_tensors = list(wrt_tensors)
    else:
      wrt_tensors = [wrt_tensors]
    if not wrt_tensors:
      raise ValueError("CurvatureMatrixVectorProductComputer needs at least "
                       "one wrt tensor.")
    for x in wrt_tensors:
      if not utils.is_tensor_or_variable(x):
        raise ValueError("wrt_tensors must be tensors or variables, got %r."
                         % (x,))
    self._wrt_tensors = wrt_tensors

  # ------------------------------------------------------------ properties
  @property
  def wrt_tensors(self):
    return self._wrt_tensors

  @property
  def layer_collection(self):
    return self._layer_collection

  @property
  def ggn_factor_signs(self):
    """List over loss towers (the order of `multiply_ggn_factor_transpose`)
    of None (GGN = B B^T) or a numpy +-1 vector over the last axis of that
    loss's GGN factor space (GGN = B diag(signs) B^T)."""
    return [loss.ggn_factor_signs for loss, _ in self._losses()]

  # ------------------------------------------------------------ products
  def multiply_fisher(self, vecs):
    """F v = sum_l c_l J_l^T F_l J_l v (summed over the batch)."""
    return self._multiply_curvature(vecs, "multiply_fisher")

  def multiply_ggn(self, vecs):
    """G v = sum_l c_l J_l^T H_l J_l v, H_l the loss Hessian w.r.t. its
    inputs at the data targets (summed over the batch)."""
    self._check_ggn_targets()
    return self._multiply_curvature(vecs, "multiply_ggn")

  def multiply_hessian(self, vecs):
    """H v, H the Hessian of layer_collection.total_loss() (coeffs
    included, summed over the batch) w.r.t. the wrt tensors. Every loss
    needs data targets."""
    self._check_graph_mode("multiply_hessian")
    vecs = self._check_vecs(vecs)
    losses = self._losses()
    missing = [label for (loss, _), label in zip(losses, self._labels())
               if loss.targets is None]
    if missing:
      raise ValueError(
          "multiply_hessian differentiates the total loss at the data "
          "targets, but loss %s has no targets: register it with "
          "targets=..." % ", ".join(missing))
    total = self._layer_collection.total_loss()
    grads = tf.gradients(total, self._wrt_tensors)
    idx = [i for i, g in enumerate(grads) if g is not None]
    out = [None] * len(self._wrt_tensors)
    if idx:
      second = tf.gradients([_dense(grads[i]) for i in idx],
                            self._wrt_tensors,
                            grad_ys=[vecs[i] for i in idx])
      out = list(second)
    return self._finish(out)

  def multiply_fisher_factor_transpose(self, vecs):
    """[sqrt(c_l) B_l^T J_l v for each loss tower], each of shape
    `loss.fisher_factor_inner_shape`."""
    return self._multiply_factor_transpose(vecs,
                                           "multiply_fisher_factor_transpose")

  def multiply_fisher_factor(self, loss_inner_vecs):
    """sum_l sqrt(c_l) J_l^T B_l u_l for `loss_inner_vecs` = [u_l per loss
    tower] (as returned by multiply_fisher_factor_transpose; shapes in
    `fisher_factor_inner_shapes`)."""
    return self._multiply_factor(loss_inner_vecs, "multiply_fisher_factor")

  def multiply_ggn_factor_transpose(self, vecs):
    """[sqrt(c_l) B_l^T J_l v for each loss tower] with the GGN factors
    (H_l = B_l S_l B_l^T, see `ggn_factor_signs`)."""
    self._check_ggn_targets()
    return self._multiply_factor_transpose(vecs,
                                           "multiply_ggn_factor_transpose")

  def multiply_ggn_factor(self, loss_inner_vecs):
    """sum_l sqrt(c_l) J_l^T B_l u_l with the GGN factors (shapes in
    `ggn_factor_inner_shapes`)."""
    self._check_ggn_targets()
    return self._multiply_factor(loss_inner_vecs, "multiply_ggn_factor")

  # Shapes of the vectors multiply_fisher_factor / multiply_ggn_factor take,
  # one per loss tower (dynamic: tensors; static: tf.TensorShape).
  @property
  def fisher_factor_inner_shapes(self):
    return tuple(loss.fisher_factor_inner_shape for loss, _ in self._losses())

  @property
  def fisher_factor_inner_static_shapes(self):
    return tuple(loss.fisher_factor_inner_static_shape
                 for loss, _ in self._losses())

  @property
  def ggn_factor_inner_shapes(self):
    return tuple(loss.ggn_factor_inner_shape for loss, _ in self._losses())

  @property
  def ggn_factor_inner_static_shapes(self):
    return tuple(loss.ggn_factor_inner_static_shape
                 for loss, _ in self._losses())

  # ------------------------------------------------------------ internals
  @staticmethod
  def _check_graph_mode(what):
    if tf.executing_eagerly():
      raise RuntimeError(
          "CurvatureMatrixVectorProductComputer.%s builds graph ops: call it "
          "inside a tf.function (TF2) or while building a tf.Graph for a "
          "Session (TF1)." % what)

  def _losses(self):
    losses = self._layer_collection.losses_with_coeffs()
    if not losses:
      raise ValueError(
          "No losses registered with the layer collection: register the "
          "model's predictive distribution (e.g. "
          "register_softmax_cross_entropy_loss(logits)) before asking for "
          "curvature products.")
    return losses

  def _labels(self):
    lc = self._layer_collection
    names = getattr(lc, "loss_names", None)
    if names is None:
      return ["#%d" % i for i in range(len(self._losses()))]
    labels = []
    for name, towers in zip(names, lc.towers_by_loss):
      for k in range(len(towers)):
        labels.append("%r (tower %d)" % (name, k) if len(towers) > 1
                      else "%r" % (name,))
    return labels

  def _check_ggn_targets(self):
    for (loss, _), label in zip(self._losses(), self._labels()):
      if getattr(loss, "ggn_requires_targets", False) and (
          loss.targets is None):
        raise ValueError(
            "The GGN of loss %s (%s) is its Hessian at the data targets: "
            "register it with targets=... to use GGN products." %
            (label, type(loss).__name__))

  def _check_vecs(self, vecs):
    if not isinstance(vecs, (list, tuple)):
      raise ValueError("vecs must be a list aligned with wrt_tensors, got "
                       "%r." % (vecs,))
    if len(vecs) != len(self._wrt_tensors):
      raise ValueError(
          "Got %d vectors for %d wrt tensors (%s); pass one vector per wrt "
          "tensor, in the same order." %
          (len(vecs), len(self._wrt_tensors),
           ", ".join(_describe(x) for x in self._wrt_tensors)))
    out = []
    for v, x in zip(vecs, self._wrt_tensors):
      if v is None:
        raise ValueError("The vector for %s is None." % _describe(x))
      v = tf.convert_to_tensor(_dense(v))
      if v.dtype.base_dtype != x.dtype.base_dtype:
        raise ValueError("The vector for %s has dtype %s, expected %s." %
                         (_describe(x), v.dtype.name,
                          x.dtype.base_dtype.name))
      if not v.shape.is_compatible_with(x.shape):
        raise ValueError("The vector for %s has shape %s, expected %s." %
                         (_describe(x), v.shape, x.shape))
      out.append(v)
    return out

  def _finish(self, grads):
    return [_zeros_like(x) if g is None else _dense(g)
            for g, x in zip(grads, self._wrt_tensors)]

  def _inputs(self, losses):
    """The flat list of all loss inputs and, per loss, its slice into it."""
    flat, slices = [], []
    for loss, _ in losses:
      inputs = tuple(loss.inputs)
      slices.append(slice(len(flat), len(flat) + len(inputs)))
      flat.extend(inputs)
    return flat, slices

  def _jacobian_vector(self, flat_inputs, vecs):
    """[J_i v for every loss input i] (forward mode, op by op; by one
    double backward where the path holds TF1 control flow)."""
    try:
      jvps = forward_mode.jvp(flat_inputs, self._wrt_tensors, vecs)
    except forward_mode.UnsupportedGraph:
      jvps = self._whole_graph_jacobian_vector(flat_inputs, vecs)
    return [_zeros_like(z) if j is None else _dense(j)
            for j, z in zip(jvps, flat_inputs)]

  def _whole_graph_jacobian_vector(self, flat_inputs, vecs):
    dummies = [tf.zeros_like(z) for z in flat_inputs]
    transposed = tf.gradients(flat_inputs, self._wrt_tensors,
                              grad_ys=dummies)
    idx = [i for i, g in enumerate(transposed) if g is not None]
    jvps = [None] * len(flat_inputs)
    if idx:
      jvps = tf.gradients([_dense(transposed[i]) for i in idx], dummies,
                          grad_ys=[vecs[i] for i in idx])
    return jvps

  def _vector_jacobian(self, flat_inputs, flat_vecs):
    """sum_i J_i^T u_i, aligned with the wrt tensors."""
    return self._finish(tf.gradients(flat_inputs, self._wrt_tensors,
                                     grad_ys=flat_vecs))

  @staticmethod
  def _coeff(coeff, dtype, sqrt=False):
    value = utils.cast(coeff, dtype)
    return tf.sqrt(value) if sqrt else value

  def _forward_products(self, vecs, method):
    """(losses, flat loss inputs, [(loss, coeff, J_l v as a tuple)])."""
    self._check_graph_mode(method)
    vecs = self._check_vecs(vecs)
    losses = self._losses()
    flat, slices = self._inputs(losses)
    jv = self._jacobian_vector(flat, vecs)
    return flat, [(loss, coeff, tuple(jv[sl]))
                  for (loss, coeff), sl in zip(losses, slices)]

  def _multiply_curvature(self, vecs, method):
    flat, per_loss = self._forward_products(vecs, method)
    out = []
    for loss, coeff, own in per_loss:
      arg = own[0] if len(own) == 1 else own
      prod = _as_tuple(getattr(loss, method)(arg))
      c = self._coeff(coeff, loss.dtype)
      out.extend(c * p for p in prod)
    return self._vector_jacobian(flat, out)

  def _multiply_factor_transpose(self, vecs, method):
    _, per_loss = self._forward_products(vecs, method)
    return [self._coeff(coeff, loss.dtype, sqrt=True) *
            getattr(loss, method)(own) for loss, coeff, own in per_loss]

  def _multiply_factor(self, loss_vecs, method):
    self._check_graph_mode(method)
    losses = self._losses()
    labels = self._labels()
    if not isinstance(loss_vecs, (list, tuple)) or (
        len(loss_vecs) != len(losses)):
      raise ValueError(
          "%s takes a list with one factor-space vector per loss tower "
          "(%d: %s), got %r." %
          (method, len(losses), ", ".join(labels), loss_vecs))
    flat, _ = self._inputs(losses)
    out = []
    for (loss, coeff), u, label in zip(losses, loss_vecs, labels):
      u = tf.convert_to_tensor(u)
      if u.dtype.base_dtype != loss.dtype.base_dtype:
        raise ValueError("The factor vector for loss %s has dtype %s, "
                         "expected %s." % (label, u.dtype.name,
                                           loss.dtype.name))
      static = (loss.fisher_factor_inner_static_shape
                if method == "multiply_fisher_factor"
                else loss.ggn_factor_inner_static_shape)
      if not u.shape.is_compatible_with(static):
        raise ValueError("The factor vector for loss %s has shape %s, "
                         "expected %s." % (label, u.shape, static))
      prod = _as_tuple(getattr(loss, method)(u))
      c = self._coeff(coeff, loss.dtype, sqrt=True)
      out.extend(c * p for p in prod)
    return self._vector_jacobian(flat, out)
