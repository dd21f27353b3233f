"""Adaptive K-FAC: the quadratic model behind the learning rate and
momentum, and the damping that checks it (`QuadraticModel`,
`DampingController`; the Levenberg-Marquardt rule's math: damping_rule.py).

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

With a momentum bound B (`qmodel_momentum_bound`, not in kfac 0.2.x) the
model is minimised over |x2| <= B instead (`solve_bounded_second`): where
the solution above has |x2| > B, x2 = sign(x2) B and x1 is the best for it,
x1 = -(c1 + x2 M12) / M11 (0 when M11 <= 0). For a positive definite M
this is the exact constrained minimiser: min over x1 of q is a convex
quadratic in x2 whose minimum is the unconstrained x2, so over the
interval it is least at the end nearest to it. Why: x2 multiplies the
previous update d, itself x2' of the one before, so |x2| > 1 on several
steps makes the update grow geometrically; at a damping the rule has
lowered by orders of magnitude the model's minimiser can ask for that
(docs/recipe.md, "The momentum bound").

`QuadraticModel`, the part of the step that builds this model from a
step's gradient, preconditioned gradient and previous update (and the
damping rule's predicted change of a regular / adam update), follows the
model's math; `DampingController`, which uses its predicted change, closes
the module:

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
"qmodel_fixedmu" keeps mu = momentum and solves for alpha alone;
`qmodel_momentum_bound` B keeps |mu| <= B ("qmodel").
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

from kfac.python.ops.adaptive import damping_rule as damping_adaptation
from kfac.python.ops.adaptive.recipe import scale
from kfac.python.ops.compat_utils import introspection
from kfac.python.ops.distribute import collective
from kfac.python.ops.distribute import replicas
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


def solve_bounded_second(m11, m12, m22, c1, c2, bound):
  """(x1, x2) minimising 1/2 x^T M x + c^T x over |x2| <= bound (the
  module docstring); bound None: solve_two_by_two."""
  x1, x2 = solve_two_by_two(m11, m12, m22, c1, c2)
  if bound is None:
    return x1, x2
  bound = tf.constant(float(bound), tf.float64)
  outside = tf.abs(x2) > bound
  x2_bound = tf.clip_by_value(x2, -bound, bound)
  x1_bound = solve_fixed_second(m11, m12, c1, x2_bound)
  return (tf.where(outside, x1_bound, x1), tf.where(outside, x2_bound, x2))


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
    (optimizers/step.Velocities); momentum: the fixed momentum of
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
      alpha, mu = solve_bounded_second(
          solve_m[0][0], solve_m[0][1], solve_m[1][1], c1, c2,
          self._update.qmodel_momentum_bound)
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


# --------------------------------------------------------------------------
# The damping controller: K-FAC's damping, its rule and its calibration.
#
# `DampingController` is the part of a K-FAC step (optimizers/step.py) that
# holds the damping (a float64 state variable, or the user's scalar
# variable, or the damping given), builds the Levenberg-Marquardt damping
# rule (`adaptive/damping_rule.py` has its math) into a training step, and
# the calibration of the initial damping that `PeriodicInvCovUpdateKfacOpt`
# runs during its burn-in steps with `calibrate_damping=True`. It also keeps
# what the rule evaluates in a step (the loss, the batches: the optimizer's
# `set_*` methods set them per trace).
#
# Damping rule: rho = (loss after - loss before) / qmodel_change on the same
# mini-batch, every damping_adaptation_interval steps (the steps where the
# counter is a multiple of it).
#
# * update_damping_immediately=True: on such a step the loss before is the
#   passed loss (`minimize`'s loss or `set_loss`; with use_passed_loss=False,
#   loss_fn(train_batch) evaluated before the update, or the value of it
#   given by `set_train_batch_loss`, e.g. the Keras optimizer's training
#   loss), and the loss after is
#   loss_fn(train_batch) evaluated after the update, in the same step: one
#   extra forward pass on adaptation steps only.
# * update_damping_immediately=False: on such a step the loss before and the
#   predicted change are kept; at the start of the next step
#   loss_fn(prev_train_batch) (the previous step's batch, e.g.
#   `CachedDataReader.cached_batch`) is evaluated at the current parameters
#   and the damping adapted, before anything of that step reads the damping
#   (PeriodicInvCovUpdateKfacOpt: before its inverse updates, so they use the
#   new damping, as in kfac 0.2.x). That op is kfac 0.2.x's
#   `maybe_pre_update_adapt_damping()`: a script that runs it before the
#   step as 0.2.x told (in the same session.run with a control dependency,
#   or a session.run of its own) gets the same op the step depends on, and
#   it adapts the damping once per adaptation (it runs only while an
#   evaluation is pending, and clears it).
#
# Calibration, on each burn-in step (the parameters do not move then): the
# step's update delta is tried on the step's batch (the variables are set to
# w + delta, loss_fn(train_batch) is evaluated, and the variables get back
# their exact previous values), rho of that trial is computed as above, and
# `damping_adaptation.calibrated_damping` moves the damping (bisection in log
# space towards rho between the thresholds). The inverses are recomputed on
# every burn-in step, with the damping of that step.
#
# Under several replicas (tf.distribute) the losses are reduced across the
# replicas (the passed loss summed, following the gradients' convention;
# loss_fn's value averaged with the replicas' batch sizes as weights). A
# reduction cannot run inside a plain conditional there, so the rule's
# conditionals that evaluate loss_fn are taken for all replicas at once
# (collective.cross_replica_cond), and loss_fn still runs on adaptation steps
# only. The damping calibration moves the (mirrored) model variables inside a
# conditional and is not supported with several replicas.
#
# Only the chief (is_chief=True) adapts or calibrates the damping. The
# damping lives in a float64 state variable (`adaptive/damping`), or in the
# scalar variable passed as `damping`, floored at min_damping; the
# preconditioner adds l2_reg to it, so the effective damping never falls
# below l2_reg + min_damping * precon_damping_mult. With relative_min_damping
# r the floor is max(min_damping, r * curvature scale), the scale being the
# mean eigenvalue of the K-FAC curvature read from the factors' traces
# (recipe/scale.py), evaluated when the rule runs.


class DampingController:
  """The damping, the damping rule and the damping calibration (module
  docstring)."""

  # Set per trace; under MirroredStrategy each replica thread builds its
  # own step (see distribute/replicas.py).
  loss = replicas.PerReplicaAttribute()
  passed_loss = replicas.PerReplicaAttribute()
  train_batch = replicas.PerReplicaAttribute()
  prev_train_batch = replicas.PerReplicaAttribute()
  commit_active = replicas.PerReplicaAttribute()
  _pre_update_op = replicas.PerReplicaAttribute()

  def __init__(self, config, store, records, estimator, counter, name,
               check_graph_mode, loss_fn=None, loss=None, train_batch=None,
               prev_train_batch=None):
    """config: the optimizer's config.KfacConfig (its damping group, and
    is_chief); store: its StateStore; records: its optimizers/step.Records;
    estimator: a callable returning the estimator of this trace; counter:
    a callable returning the step counter variable; name: the optimizer's
    name; check_graph_mode: a callable (what) that raises outside a graph;
    loss_fn, loss, train_batch, prev_train_batch: what the rule evaluates
    (module docstring)."""
    self._settings = config.damping
    self._is_chief = config.placement.is_chief
    self._store = store
    self._records = records
    self._estimator = estimator
    self._counter = counter
    self._name = name
    self._check_graph_mode = check_graph_mode
    self._loss_fn = loss_fn
    self.loss = loss
    self.passed_loss = None
    self.train_batch = train_batch
    self.prev_train_batch = prev_train_batch
    self.commit_active = None
    self._pre_update_op = None
    self.train_batch_loss = None
    # The switch to the minibatch recipe (adaptive/recipe/switch.py), whose
    # rule interval and decay apply once it is active; None: none.
    self.switch = None

  def _rule_setting(self, name, dtype):
    """The damping rule's `name` (interval or decay) of this step."""
    mine = getattr(self._settings, name)
    if self.switch is None:
      return mine
    return self.switch.pick(mine, getattr(self.switch.phase, name), dtype)

  # ------------------------------------------------------------ the damping
  @property
  def damping(self):
    """The damping now: K-FAC's adapted one (created in the StateStore
    when first used: in the step, under a strategy, a replica-local
    variable), or the value given (a schedule's reader: a callable)."""
    settings = self._settings
    if settings.kfac_owns_damping:
      return self._store.get_or_create("adaptive/damping", [], tf.float64,
                                       initial_value=settings.damping)
    if settings.damping_schedule is None:
      return settings.damping
    schedule = settings.damping_schedule
    return lambda: schedule(tf.convert_to_tensor(self._counter()))

  def counter(self):
    """The step counter variable."""
    return self._counter()

  @property
  def owns_damping(self):
    """Whether the adapted damping is K-FAC's (not the user's variable)."""
    return self._settings.kfac_owns_damping

  @property
  def adapts(self):
    """Whether this worker runs the damping rule."""
    return self._settings.adapt_damping and self._is_chief

  def shares_evaluation(self, trial):
    """Whether a step with the calibration condition `trial` (None: no
    calibration) evaluates the loss once for the calibration and the rule
    (optimizers/step.py)."""
    return (trial is not None and self._settings.adapt_damping and
            self._is_chief and self._settings.update_damping_immediately and
            not collective.is_distributed())

  def set_train_batch_loss(self, loss):
    """loss_fn(train_batch) at the current parameters, already computed in
    this trace (e.g. the training forward pass's own loss, when loss_fn
    replays that pass), or None.

    With use_passed_loss=False the rule and the calibration then take it as
    the loss before the update instead of evaluating loss_fn(train_batch)
    once more: the same value, without another forward pass of the model
    in the graph and at run time. It must be exactly that value (same
    batch, same parameters, same random draws). One replica only; in a
    tf.function call it on every trace (a tensor of another graph is not
    used)."""
    if loss is not None and collective.is_distributed():
      raise ValueError(
          "set_train_batch_loss is for one replica: under several replicas "
          "loss_fn(train_batch) is evaluated and averaged across them.")
    self.train_batch_loss = (
        None if loss is None else
        (tf.compat.v1.get_default_graph(), loss))

  # ------------------------------------------------------------ losses
  def adaptation_step(self):
    counter = tf.convert_to_tensor(self._counter())
    now = tf.equal(counter % self._rule_setting(
        "damping_adaptation_interval", counter.dtype), 0)
    # Under several replicas a step's commit is built unconditionally and
    # says whether it applies (not during burn-in): see
    # optimizers/replicated.py.
    active = self.commit_active
    return now if active is None else tf.logical_and(now, active)

  @staticmethod
  def _batch(batch):
    return batch() if callable(batch) else batch

  def checked_batch(self, batch, what):
    batch = self._batch(batch)
    if batch is None:
      raise ValueError(
          "The damping rule evaluates loss_fn(%s), but %s is not set: pass "
          "it to the constructor or call set_%s(...) (in a tf.function, on "
          "every trace)." % (what, what, what))
    return batch

  def loss_value(self, batch, examples=None):
    """loss_fn(batch) in float64; under several replicas averaged across
    them with the replicas' batch sizes `examples` as weights."""
    value = tf.cast(self._loss_fn(batch), tf.float64)
    if collective.is_distributed():
      (value,) = collective.all_reduce([value], collective.MEAN,
                                       weight=examples)
    return value

  def _evaluate_loss_fn(self, batch, what):
    """loss_fn(batch) now (one replica: the calibration)."""
    return self.loss_value(self.checked_batch(batch, what))

  def _given_train_batch_loss(self):
    """The float64 loss set by set_train_batch_loss in this trace (in the
    current graph or one enclosing it), or None."""
    given = self.train_batch_loss
    if given is None:
      return None
    graph, loss = given
    current = tf.compat.v1.get_default_graph()
    while current is not None and current is not graph:
      current = getattr(current, "outer_graph", None)
    if current is None:
      return None  # set in another trace
    return tf.cast(loss, tf.float64)

  def _loss_before_update(self):
    """loss_fn(train_batch) before the update: the loss set by
    set_train_batch_loss, else evaluated now."""
    given = self._given_train_batch_loss()
    if given is not None:
      return given
    return self._evaluate_loss_fn(self.train_batch, "train_batch")

  def _cond_with_loss(self, pred, batch, what, make_op, args=()):
    """An op that, when `pred` holds, evaluates loss_fn(batch) and runs
    make_op(loss, *args). Under several replicas the reduction of the loss
    needs the conditional taken for all replicas at once
    (collective.cross_replica_cond), so everything per-replica that
    make_op uses comes in `args`."""
    batch = self.checked_batch(batch, what)
    if not collective.is_distributed():
      return utils.cond_op(
          pred, lambda: make_op(self.loss_value(batch), *args))
    examples = self._estimator().replica_examples()

    def branch(batch, examples, *args):
      return make_op(self.loss_value(batch, examples), *args)
    return collective.cross_replica_cond(pred, branch,
                                         (batch, examples) + tuple(args))

  def _passed_loss_value(self):
    loss = self.loss if self.loss is not None else self.passed_loss
    if loss is None:
      raise ValueError(
          "The damping rule needs the loss before the update: use "
          "minimize(loss), pass loss=... / call set_loss(loss), or pass "
          "use_passed_loss=False to evaluate loss_fn(train_batch).")
    loss = utils.cast(loss, tf.float64)
    if collective.is_distributed():
      loss = collective.all_reduce_one(loss, collective.SUM)
    return loss

  def loss_before(self):
    if self._settings.use_passed_loss:
      return self._passed_loss_value()
    return tf.convert_to_tensor(self._store.get_or_create(
        "adaptive/loss_before", [], tf.float64))

  def _model_change_op(self, update):
    """(predicted change, ops recording it) for use inside a branch."""
    change = update.predicted_change()
    if update.model_change is not None:  # recorded with the step
      return change, []
    return change, [self._records.get("qmodel_change").assign(change)]

  # ------------------------------------------------------------ the rule
  def _damping_floor(self):
    """The damping's floor (float64): min_damping, or with
    relative_min_damping r the larger of it and r * the curvature scale
    (the mean eigenvalue of the K-FAC curvature, recipe/scale.py)."""
    floor = tf.constant(float(self._settings.min_damping), tf.float64)
    if self._settings.relative_min_damping is None:
      return floor
    curvature = scale.curvature_scale(self._estimator().blocks)
    return tf.maximum(
        floor, float(self._settings.relative_min_damping) * curvature)

  def _apply_rule(self, loss_before, loss_after, model_change, counter,
                  extra_ops=()):
    """Ops that set rho and the new damping."""
    rho = damping_adaptation.reduction_ratio(loss_before, loss_after,
                                             model_change)
    new = damping_adaptation.adapted_damping(
        self.damping, rho,
        self._rule_setting("damping_adaptation_decay", tf.float64),
        self._rule_setting("damping_adaptation_interval", tf.float64),
        self._settings.damping_increase_rho_threshold,
        self._settings.damping_decrease_rho_threshold,
        self._damping_floor())
    ops = [self._records.get("rho").assign(rho),
           self.damping.assign(tf.cast(new, self.damping.dtype))]
    ops.extend(extra_ops)
    if self._settings.print_logs:
      ops.append(tf.print("kfac step", counter, "rho", rho, "damping", new,
                          "qmodel_change", model_change, "loss before",
                          loss_before, "after", loss_after))
    return tf.group(*ops)

  def before_update(self, update):
    """Ops to run before the variables change (see the module docstring)."""
    del update  # the ops only need to run before the variables change
    if not (self._settings.adapt_damping and self._is_chief):
      return []
    ops = []
    adapt_now = self.adaptation_step()
    if not self._settings.use_passed_loss:
      keep = self._store.get_or_create("adaptive/loss_before", [], tf.float64)
      given = self._given_train_batch_loss()
      if given is not None:  # no evaluation needed
        ops.append(utils.cond_op(adapt_now, lambda: keep.assign(given)))
      else:
        ops.append(self._cond_with_loss(adapt_now, self.train_batch,
                                        "train_batch", keep.assign))
    return ops

  # ------------------------------------------------------ delayed rule
  def maybe_pre_update_adapt_damping(self):
    """kfac 0.2.x's op that adapts the damping at the start of a step.

    With adapt_damping=True and update_damping_immediately=False (on the
    chief), on the step after a damping adaptation step it evaluates
    loss_fn(prev_train_batch) at the current parameters and moves the
    damping (module docstring). The training step built by minimize /
    apply_gradients runs this same op first, so a script need not run it;
    one that does, as kfac 0.2.x told (every session.run, before the
    inverse updates), adapts the damping once, not twice. Otherwise (and
    on workers that are not the chief) it returns tf.no_op(), as kfac
    0.2.x did. In a TF1 graph or inside a tf.function (one op per graph).
    """
    ops = self.pre_update_ops()
    return ops[0] if ops else tf.no_op()

  def pre_update_ops(self):
    """[the delayed rule's op of the current graph] (made once per graph
    and replica), or [] when there is no delayed rule."""
    if not (self._settings.adapt_damping and self._is_chief and
            not self._settings.update_damping_immediately):
      return []
    self._check_graph_mode("maybe_pre_update_adapt_damping")
    if (collective.is_distributed() and
        tf.distribute.in_cross_replica_context()):
      raise ValueError(
          "maybe_pre_update_adapt_damping() under a tf.distribute strategy "
          "must be called inside the replica function (strategy.run), like "
          "minimize; the training step runs it anyway.")
    graph = tf.compat.v1.get_default_graph()
    cached = self._pre_update_op
    if cached is not None and cached.graph is graph:
      return [cached]
    with tf.name_scope(self._name + "_pre_update_adapt_damping"):
      op = tf.group(self._delayed_rule_op())
    self._pre_update_op = op
    return [op]

  def _delayed_rule_op(self):
    """When an evaluation is pending: loss_fn(prev_train_batch) now, the
    rule against the kept loss and predicted change, pending cleared."""
    pending = self._store.get_or_create("adaptive/pending", [], tf.int64)
    prev_loss = self._store.get_or_create("adaptive/prev_loss", [],
                                          tf.float64)
    prev_change = self._store.get_or_create("adaptive/prev_change", [],
                                            tf.float64)
    counter = tf.convert_to_tensor(self._counter())

    def evaluate_previous(after, counter):
      with tf.control_dependencies([self._apply_rule(
          tf.convert_to_tensor(prev_loss), after,
          tf.convert_to_tensor(prev_change), counter)]):
        return pending.assign(0)

    return self._cond_with_loss(
        tf.greater(tf.convert_to_tensor(pending), 0),
        self.prev_train_batch, "prev_train_batch", evaluate_previous,
        (counter,))

  def after_update(self, update, step_op):
    """Runs after `step_op` (the variables have changed)."""
    if not (self._settings.adapt_damping and self._is_chief):
      return step_op
    adapt_now = self.adaptation_step()
    counter = tf.convert_to_tensor(self._counter())
    with tf.control_dependencies([step_op]):
      # Read after step_op, which waits for the ops that store the loss
      # before the update (use_passed_loss=False).
      before = self.loss_before()
      if self._settings.update_damping_immediately:
        return self._cond_with_loss(
            adapt_now, self.train_batch, "train_batch",
            lambda after, before, change, counter: self.immediate_rule(
                update, after, before, change, counter),
            (before, update.predicted_change(), counter))

      def keep():
        change, records = self._model_change_op(update)
        store = self._store
        return tf.group(
            store.get("adaptive/prev_loss").assign(before),
            store.get("adaptive/prev_change").assign(change),
            store.get("adaptive/pending").assign(1), *records)
      return utils.cond_op(adapt_now, keep)

  def immediate_rule(self, update, after, before, change, counter):
    """The rule's ops of an adaptation step (update_damping_immediately),
    given the loss after the update; `change` is update.predicted_change()
    (passed in: under several replicas it comes into the branch as an
    argument)."""
    records = ([self._records.get("qmodel_change").assign(change)]
               if update.model_change is None else [])  # else recorded
    return self._apply_rule(before, after, change, counter, records)

  # ------------------------------------------------------------ calibration
  def calibration_op(self, update):
    """One calibration step (module docstring): an op that tries `update`,
    restores the variables and moves the damping."""
    if not self._is_chief:
      return tf.no_op()
    before, saved, trial = self.calibration_trial(update)
    with tf.control_dependencies([trial]):
      after = self._evaluate_loss_fn(self.train_batch, "train_batch")
    return self.calibration_finish(update, before, after, saved)

  def calibration_trial(self, update):
    """(loss before, the variables' values before, the op that sets the
    variables to w + delta after reading both)."""
    variables = [v for _, v in update.deltas]
    deltas = [tf.convert_to_tensor(d) for d, _ in update.deltas]
    if self._settings.use_passed_loss:
      before = self._passed_loss_value()
    else:
      before = self._loss_before_update()
    # Copies: a TF1 reference variable's read would show the trial's values
    # after the trial's assign_add (introspection.value_copy).
    saved = [introspection.value_copy(v) for v in variables]
    with tf.control_dependencies(saved + [before]):
      trial = tf.group(*[v.assign_add(d) for d, v in zip(deltas, variables)])
    return before, saved, trial

  def calibration_finish(self, update, before, after, saved):
    """After the trial's loss `after`: the variables restored to `saved`
    and the damping moved (an op)."""
    counter = tf.convert_to_tensor(self._counter())
    variables = [v for _, v in update.deltas]
    with tf.control_dependencies([after]):
      restored = tf.group(*[v.assign(s) for v, s in zip(variables, saved)])
    change = update.predicted_change()  # no commit records it now
    records = [self._records.get("qmodel_change").assign(change)]
    rho = damping_adaptation.reduction_ratio(before, after, change)
    log_step = self._store.get_or_create(
        "calibration/log_step", [], tf.float64,
        initial_value=damping_adaptation.CALIBRATION_INITIAL_LOG_STEP)
    direction = self._store.get_or_create("calibration/direction", [],
                                          tf.float64)
    new, new_step, new_direction = damping_adaptation.calibrated_damping(
        self.damping, rho, log_step, direction,
        self._settings.damping_increase_rho_threshold,
        self._settings.damping_decrease_rho_threshold, self._damping_floor())
    with tf.control_dependencies([restored]):
      ops = [self.damping.assign(tf.cast(new, self.damping.dtype)),
             log_step.assign(new_step), direction.assign(new_direction),
             self._records.get("rho").assign(rho)] + records
      if self._settings.print_logs:
        ops.append(tf.print("kfac burn-in step", counter, "rho", rho,
                            "damping", new, "qmodel_change", change,
                            "loss before", before, "after", after))
      return tf.group(*ops)
