"""The quadratic model behind K-FAC's adaptive learning rate and momentum.

With g the gradient, p the preconditioned gradient (the new direction) and
d the previous update, K-FAC looks for the update x1 * p + x2 * d that
minimises the local quadratic model of the objective h,

    q(x) = 1/2 x^T M x + c^T x,        c = [g.p, g.d],
    M = [[p.C p, p.C d], [d.C p, d.C d]]

where C is the exact curvature of the mean loss plus (damping + l2_reg) I
when solving for x, and plus l2_reg I only when the model is used to
predict the change of the objective for the damping rule (Martens & Grosse
2015, sections 6.4, 6.5 and 7). Everything here is scalar float64
arithmetic on the five numbers M11, M12, M22, c1, c2, so it is cheap and
testable by hand.

Degenerate cases of the 2x2 solve, in order:
* M11 > 0, M22 > 0 and det(M) > DET_RTOL * M11 * M22: the exact minimiser
  x = -M^-1 c;
* otherwise, when M11 > 0: the best multiple of p alone, x = (-c1/M11, 0)
  (the first step, where d = 0, and p parallel to d land here);
* otherwise, when M22 > 0: the best multiple of d alone, (0, -c2/M22);
* otherwise (no curvature along either vector): x = (0, 0).

`QuadraticModel`, the part of the step that builds this model from a
step's gradient, preconditioned gradient and previous update (and the
damping rule's predicted change of a regular / adam update), is at the end
of the module:

Quadratic model. With g the gradient of the mean loss, p = F^-1 g the
K-FAC preconditioned gradient (F^-1 with the preconditioner damping
damping * precon_damping_mult + l2_reg) and d the previous update, the
update is delta = alpha p + mu d where (alpha, mu) minimise

    1/2 x^T V^T (C + (damping + l2_reg) I) V x + x^T V^T g,   V = [p, d]

and C is the exact mini-batch curvature of the mean loss: (1/N) times the
summed-loss curvature from `CurvatureMatrixVectorProductComputer`, the
Fisher for the Fisher / empirical-Fisher estimation modes and the GGN for
the *_GGN modes. N is `batch_size` when given, else the number of rows of
the first registered loss's inputs (summed over its towers): pass
batch_size when the loss you minimise is not the mean over those rows.
With a `qmodel_layer_collection` (its losses registered on the model's
outputs for part of the batch), C is the curvature over those rows alone,
with N scaled by their share of the batch: the two curvature products, the
largest extra cost of an adaptive step, are then paid on those rows only
(kfac.keras's qmodel_batch_fraction); g and p stay the whole batch's.
"qmodel_fixedmu" keeps mu = momentum and solves for alpha alone.
`qmodel_update_rescale` s multiplies both coefficients after the solve.
The recorded `learning_rate` is -alpha * s, `momentum` mu * s.

The predicted change used by the damping rule, `qmodel_change`, is the
model of the update actually applied, by default without the damping term
(`include_damping_in_qmodel_change=True`, kfac 0.2.x's
`optimizer.set_global_constants` option, adds it; its default, None, takes
the value set there, else False):

* qmodel / qmodel_fixedmu: with the exact curvature, C + l2_reg I (as in
  Martens & Grosse 2015, sec. 6.5, and kfac-jax's default); it comes with
  the solve at no extra cost. With the damping term: C + (damping +
  l2_reg) I, the matrix of the solve.
* regular / adam (with adapt_damping or calibrate_damping): with the K-FAC
  matrix B itself (the damped preconditioner, whose damping includes
  l2_reg): 1/2 delta^T B delta + g^T delta, whatever
  include_damping_in_qmodel_change says (B's factored damping cannot be
  taken out of it exactly; kfac 0.2.x's default subtracted
  (damping - l2_reg) |delta|^2 / 2, an approximation it called "not quite
  right"). It is computed only on the steps that use it.
  `always_use_exact_qmodel_for_damping_adjustment=True` uses the exact
  1/2 delta^T (C + l2_reg I) delta + g^T delta instead (C + (damping +
  l2_reg) I with the damping term); a gradient cannot be taken inside a
  tf.cond branch, so that costs one exact curvature product (about two
  backward passes) on every step.
"""

from typing import Any, NamedTuple

import tensorflow as tf

from kfac.python.ops.distribute import collective
from kfac.python.ops.numerics.inner_products import gram64, sum_inner64
from kfac.python.ops.tensors import utils

# Relative size below which det(M) counts as zero (p and d parallel).
DET_RTOL = 1e-12


def _f64(x):
  return utils.cast(x, tf.float64)


def solve_two_by_two(m11, m12, m22, c1, c2):
  """(x1, x2) minimising 1/2 x^T M x + c^T x; see the module docstring."""
  m11, m12, m22, c1, c2 = (_f64(v) for v in (m11, m12, m22, c1, c2))
  zero = tf.zeros_like(m11)
  one = tf.ones_like(m11)
  det = m11 * m22 - m12 * m12
  pos11 = m11 > 0
  pos22 = m22 > 0
  full = tf.logical_and(tf.logical_and(pos11, pos22),
                        det > DET_RTOL * m11 * m22)
  safe_det = tf.where(full, det, one)
  x1_full = -(m22 * c1 - m12 * c2) / safe_det
  x2_full = -(m11 * c2 - m12 * c1) / safe_det
  x1_p = -c1 / tf.where(pos11, m11, one)
  x2_d = -c2 / tf.where(pos22, m22, one)
  x1 = tf.where(full, x1_full, tf.where(pos11, x1_p, zero))
  x2 = tf.where(full, x2_full,
                tf.where(pos11, zero, tf.where(pos22, x2_d, zero)))
  return x1, x2


def solve_fixed_second(m11, m12, c1, x2):
  """x1 minimising q(x1, x2) for a fixed x2 (the fixed momentum):
  x1 = -(c1 + x2 M12) / M11, or 0 when M11 <= 0."""
  m11, m12, c1, x2 = (_f64(v) for v in (m11, m12, c1, x2))
  pos = m11 > 0
  return tf.where(pos, -(c1 + x2 * m12) / tf.where(pos, m11,
                                                   tf.ones_like(m11)),
                  tf.zeros_like(m11))


def model_value(x1, x2, m11, m12, m22, c1, c2):
  """q(x) = 1/2 x^T M x + c^T x (the predicted change of the objective)."""
  x1, x2, m11, m12, m22, c1, c2 = (
      _f64(v) for v in (x1, x2, m11, m12, m22, c1, c2))
  return (0.5 * (m11 * x1 * x1 + 2.0 * m12 * x1 * x2 + m22 * x2 * x2) +
          c1 * x1 + c2 * x2)


# ------------------------------------------------------------ the part
class CurvatureSource(NamedTuple):
  """What the exact curvature of a step is computed from (per trace)."""
  layers: Any
  """The training LayerCollection."""
  qmodel_layers: Any
  """The qmodel_layer_collection, whose losses define the curvature on
  part of the batch (None: the training collection's)."""
  estimator: Any
  """The FisherEstimator (its curvature type, K-FAC products)."""


class QuadraticModel:
  """The part of the step (optimizers/step.py) that solves the quadratic
  model for the learning rate and momentum ("qmodel", "qmodel_fixedmu";
  the module docstring) and predicts the change of the loss of
  a regular / adam update for the damping rule."""

  def __init__(self, config, velocities, momentum):
    """config: the optimizer's config.KfacConfig (its update rule, damping
    and curvature groups); velocities: the momentum state
    (optimizers/update_rule.Velocities); momentum: the fixed momentum of
    "qmodel_fixedmu" (a number, tensor, variable or callable)."""
    self._update = config.update
    self._damping = config.damping
    self._batch_size = config.curvature.batch_size
    self._velocities = velocities
    self._momentum = momentum

  @staticmethod
  def _rows(layer_collection, what):
    """The number of rows of the first registered loss's inputs, summed
    over its towers."""
    towers = layer_collection.towers_by_loss
    if not towers:
      raise ValueError("The quadratic model needs a loss registered on %s."
                       % what)
    return tf.cast(tf.add_n([tf.shape(loss.inputs[0])[0]
                             for loss in towers[0]]), tf.float64)

  def _batch_size_value(self, source):
    if self._batch_size is not None:
      return utils.cast(self._batch_size, tf.float64)
    return self._rows(source.layers, "the layer collection")

  def _curvature_source(self, source):
    """(layer collection, N): the losses of the quadratic model's
    curvature and the batch size its summed products are divided by. With
    a qmodel_layer_collection, N scales the training batch size by its
    share of the rows."""
    sub = source.qmodel_layers
    if sub is None:
      return source.layers, self._batch_size_value(source)
    share = (self._rows(sub, "qmodel_layer_collection") /
             self._rows(source.layers, "the layer collection"))
    return sub, self._batch_size_value(source) * share

  def curvature_gram(self, source, variables, vectors):
    """[[u^T C v for v in vectors] for u in vectors]: the exact curvature of
    the mean loss (C = summed-loss curvature / batch size) on each pair of
    vectors (each a list aligned with `variables`), in float64; on the
    qmodel_layer_collection's rows where one is set."""
    from kfac.python.ops import curvature_matrix_vector_products as cmvp  # pylint: disable=g-import-not-at-top
    layers, n = self._curvature_source(source)
    computer = cmvp.CurvatureMatrixVectorProductComputer(layers, variables)
    if source.estimator.mat_type == "GGN":
      factors = [computer.multiply_ggn_factor_transpose(v) for v in vectors]
      signs = computer.ggn_factor_signs
    else:
      factors = [computer.multiply_fisher_factor_transpose(v)
                 for v in vectors]
      signs = [None] * len(factors[0])
    gram = []
    for fu in factors:
      row = []
      for fv in factors:
        terms = []
        for a, b, s in zip(fu, fv, signs):
          prod = utils.cast(a, tf.float64) * utils.cast(b, tf.float64)
          if s is not None:
            prod = prod * tf.constant(s, tf.float64)
          terms.append(tf.reduce_sum(prod))
        row.append(tf.add_n(terms) / n)
      gram.append(row)
    if collective.is_distributed():
      # Each replica's entries are means over its batch: the global ones
      # are their average weighted by the batch sizes.
      size = len(gram)
      (flat,) = collective.all_reduce(
          [tf.stack([e for row in gram for e in row])], collective.MEAN,
          weight=n)
      gram = [[flat[i * size + j] for j in range(size)]
              for i in range(size)]
    return gram

  def compute(self, grads_and_vars, update, source, damping):
    """Fills `update` with the step alpha p + mu d of the quadratic model
    (the module docstring); `damping`: a callable returning the
    damping now."""
    est = source.estimator
    variables = [v for _, v in grads_and_vars]
    grads = [g for g, _ in grads_and_vars]
    precon = [tf.convert_to_tensor(p)
              for p, _ in est.multiply_inverse(grads_and_vars)]
    velocities = [self._velocities.get(v) for v in variables]
    prev = [tf.convert_to_tensor(v) for v in velocities]
    gram = self.curvature_gram(source, variables, [precon, prev])
    # Every inner product of p, d and g the model needs, in one Gram.
    inner = gram64([precon, prev, grads])
    dots = [inner[0][:2], inner[1][:2]]
    damping = utils.cast(damping(), tf.float64)
    l2_reg = tf.constant(float(self._damping.l2_reg), tf.float64)

    def model(extra):
      return [[gram[i][j] + extra * dots[i][j] for j in range(2)]
              for i in range(2)]

    solve_m = model(damping + l2_reg)
    c1, c2 = inner[2][0], inner[2][1]
    if self._update.momentum_type == "qmodel":
      alpha, mu = solve_two_by_two(
          solve_m[0][0], solve_m[0][1], solve_m[1][1], c1, c2)
    else:
      mu = utils.cast(_read(self._momentum), tf.float64)
      alpha = solve_fixed_second(solve_m[0][0], solve_m[0][1], c1, mu)
    if self._update.qmodel_update_rescale is not None:
      scale = utils.cast(_read(self._update.qmodel_update_rescale),
                         tf.float64)
      alpha, mu = alpha * scale, mu * scale
    # The predicted change: without the damping term unless asked for.
    model_m = (solve_m if self._update.include_damping_in_qmodel_change
               else model(l2_reg))
    update.model_change = model_value(
        alpha, mu, model_m[0][0], model_m[0][1], model_m[1][1], c1, c2)
    coefficients = {}  # dtype -> (alpha, mu): cast once per dtype
    for p, d, var, velocity in zip(precon, prev, variables, velocities):
      dtype = tf.as_dtype(var.dtype).base_dtype
      if dtype not in coefficients:
        coefficients[dtype] = (tf.cast(alpha, dtype), tf.cast(mu, dtype))
      a, m = coefficients[dtype]
      delta = a * p + m * d
      update.deltas.append((delta, var))
      update.velocity_assigns.append((velocity, delta))
    update.precon = list(zip(precon, variables))
    update.grads = grads
    update.records["learning_rate"] = -alpha
    update.records["momentum"] = mu
    return update

  def set_model_change(self, grads_and_vars, update, source, damping):
    """The predicted change of a regular / adam update (this module's
    docstring): exact now, or the K-FAC model built where it is used.
    `damping`: a callable returning the damping now."""
    if not self._damping.uses_model:
      return
    grads = [tf.convert_to_tensor(g) for g, _ in grads_and_vars]
    if self._damping.always_use_exact_qmodel_for_damping_adjustment:
      variables = [v for _, v in grads_and_vars]
      deltas = [tf.convert_to_tensor(d) for d, _ in update.deltas]
      curvature = self.curvature_gram(source, variables, [deltas])[0][0]
      inner = gram64([deltas, grads])
      sq = inner[0][0]
      diagonal = tf.constant(float(self._damping.l2_reg), tf.float64)
      if self._update.include_damping_in_qmodel_change:
        diagonal += utils.cast(damping(), tf.float64)
      update.model_change = (0.5 * (curvature + diagonal * sq) +
                             inner[1][0])
      return
    momentum_type = self._update.momentum_type

    def approximate():
      deltas = [(tf.convert_to_tensor(d), v) for d, v in update.deltas]
      try:
        products = source.estimator.multiply(deltas)
      except NotImplementedError as e:
        raise NotImplementedError(
            "%s\nThe damping rule of momentum_type=%r predicts the change of "
            "the loss with the K-FAC matrix (B delta); pass "
            "always_use_exact_qmodel_for_damping_adjustment=True to use the "
            "exact curvature instead." % (e, momentum_type)) from e
      values = [d for d, _ in deltas]
      return (0.5 * sum_inner64(values, [p for p, _ in products]) +
              sum_inner64(grads, values))

    update.model_change_fn = approximate


def _read(value):
  """A hyperparameter's value now: a callable (not a variable) is called."""
  return value() if callable(value) and not isinstance(
      value, tf.Variable) else value
