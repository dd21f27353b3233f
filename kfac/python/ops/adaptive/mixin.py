"""Adaptive K-FAC: quadratic-model learning rate and momentum.

`AdaptiveMixin` is the part of `KfacOptimizer` that validates the adaptive
arguments, keeps the readable records (learning rate, momentum, rho,
qmodel_change, norms) and implements the momentum types "qmodel" /
"qmodel_fixedmu". The damping rule and its calibration are in
`adaptive/damping_mixin.py`, the scalar math in `adaptive/quadratic_model.py` and
`adaptive/damping_rule.py`, the exact curvature products in
`curvature_matrix_vector_products.py`.

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

import warnings

import tensorflow as tf

from kfac.python.ops.adaptive import damping_mixin as adaptive_damping
from kfac.python.ops.adaptive import damping_rule as damping_adaptation
from kfac.python.ops.adaptive import quadratic_model
from kfac.python.ops.adaptive import shared_evaluation
from kfac.python.ops.tensors import utils
from kfac.python.ops.compat_utils import legacy_constants
from kfac.python.ops.distribute import collective
from kfac.python.ops.numerics.inner_products import gram64, sum_inner64

# Values an optimizer keeps readable after each step, with their initial
# value (NaN: not computed yet).
_RECORDS = {
    "learning_rate": 0.0,
    "momentum": 0.0,
    "qmodel_change": float("nan"),
    "rho": float("nan"),
    "grad_norm": float("nan"),
    "precon_grad_norm": float("nan"),
    "update_norm": float("nan"),
}
_NORM_RECORDS = ("grad_norm", "precon_grad_norm", "update_norm")


class IgnoredArgumentWarning(UserWarning):
  """An optimizer argument that has no effect with the other arguments
  given (e.g. damping_adaptation_interval without adapt_damping)."""

# Arguments that only matter with adapt_damping (or calibrate_damping) and
# their defaults.
_DAMPING_RULE_DEFAULTS = (
    ("damping_adaptation_decay", 0.95),
    ("damping_adaptation_interval", 5),
    ("update_damping_immediately", True),
)
_DAMPING_TARGET_DEFAULTS = (
    ("damping_decrease_rho_threshold", 0.75),
    ("damping_increase_rho_threshold", 0.25),
    ("min_damping", 1e-8),
    ("relative_min_damping", None),
    ("use_passed_loss", True),
    ("always_use_exact_qmodel_for_damping_adjustment", False),
)


# The constructor arguments of KfacOptimizer that _init_adaptive reads.
ARGUMENTS = (
    "momentum_type", "qmodel_update_rescale", "adapt_damping",
    "update_damping_immediately", "is_chief", "prev_train_batch", "loss",
    "loss_fn", "min_damping", "l2_reg", "damping_adaptation_decay",
    "damping_adaptation_interval", "damping_decrease_rho_threshold",
    "damping_increase_rho_threshold", "precon_damping_mult",
    "use_passed_loss", "train_batch", "print_logs", "use_weight_decay",
    "norm_constraint", "damping_schedule",
    "always_use_exact_qmodel_for_damping_adjustment", "relative_min_damping",
    "include_damping_in_qmodel_change")


class _StoredDamping:
  """The initial value of a damping kept in the StateStore."""

  def __init__(self, initial):
    self.initial = initial


class AdaptiveMixin(adaptive_damping.AdaptiveDampingMixin,
                    shared_evaluation.SharedEvaluationMixin):
  """Quadratic model and damping adaptation for KfacOptimizer."""

  # ------------------------------------------------------------ set-up
  def _from_schedule(self, name, value, schedule):
    """`value`, or a function of the step counter when `schedule` is a
    callable step -> value (kfac-jax style schedules)."""
    if schedule is None:
      return value
    if not callable(schedule):
      raise ValueError("%s_schedule must be a callable of the step, got %r."
                       % (name, schedule))
    if value is not None:
      raise ValueError("Pass either %s or %s_schedule, not both (got %s=%r)."
                       % (name, name, name, value))
    return lambda: schedule(tf.convert_to_tensor(self.counter))

  def _init_adaptive(self, args):
    """Checks and keeps the adaptive arguments (a dict of ARGUMENTS)."""
    momentum_type = args["momentum_type"]
    qmodel_update_rescale = args["qmodel_update_rescale"]
    adapt_damping = args["adapt_damping"]
    l2_reg = args["l2_reg"]
    precon_damping_mult = args["precon_damping_mult"]
    loss_fn = args["loss_fn"]
    qmodel = momentum_type.startswith("qmodel")
    # Set by PeriodicInvCovUpdateKfacOpt before it calls this constructor.
    calibrate = getattr(self, "_calibrate_damping", False)
    if qmodel_update_rescale is not None and not qmodel:
      raise ValueError("qmodel_update_rescale applies to the momentum types "
                       "'qmodel' / 'qmodel_fixedmu' only (momentum_type=%r)."
                       % momentum_type)
    if qmodel and args["use_weight_decay"]:
      raise ValueError(
          "use_weight_decay cannot be combined with momentum_type=%r: the "
          "quadratic model has no learning rate for the decay term. Add the "
          "l2 term to the loss and pass l2_reg instead." % momentum_type)
    if qmodel and args["norm_constraint"] is not None:
      raise ValueError(
          "norm_constraint cannot be combined with momentum_type=%r: the "
          "quadratic model already chooses the size of the update."
          % momentum_type)
    if l2_reg < 0 or precon_damping_mult <= 0:
      raise ValueError("l2_reg must be >= 0 and precon_damping_mult > 0, got "
                       "%r and %r." % (l2_reg, precon_damping_mult))
    unused = (() if adapt_damping else _DAMPING_RULE_DEFAULTS) + (
        () if adapt_damping or calibrate else _DAMPING_TARGET_DEFAULTS)
    for arg, default in unused:
      if args[arg] != default:
        # kfac 0.2.x accepted these silently (its examples pass them
        # whatever adapt_damping is): a warning, not an error.
        warnings.warn("%s=%r only matters with adapt_damping=True%s; it is "
                      "ignored (pass that too, or leave %s at %r)." %
                      (arg, args[arg], "" if arg in dict(
                          _DAMPING_RULE_DEFAULTS) else
                       " or calibrate_damping=True", arg, default),
                      IgnoredArgumentWarning, stacklevel=4)
    if adapt_damping or calibrate:
      what = "adapt_damping=True" if adapt_damping else (
          "calibrate_damping=True")
      damping_adaptation.check_arguments(
          args["damping_adaptation_decay"],
          args["damping_adaptation_interval"],
          args["damping_increase_rho_threshold"],
          args["damping_decrease_rho_threshold"], args["min_damping"])
      if args["damping_schedule"] is not None:
        raise ValueError("damping_schedule and %s both set the damping: "
                         "choose one." % what)
      if loss_fn is None:
        raise ValueError(
            "%s needs loss_fn=..., a function of a batch that returns the "
            "loss, to evaluate the loss after the update." % what)
      self._damping = self._make_damping_variable(
          self._damping, what, args["min_damping"])
    else:
      for arg in ("loss", "loss_fn", "train_batch", "prev_train_batch"):
        if args[arg] is not None:  # kfac 0.2.x accepted them silently
          warnings.warn(
              "%s=... is used by the damping adaptation only and is ignored "
              "here: pass adapt_damping=True (or calibrate_damping=True to "
              "PeriodicInvCovUpdateKfacOpt), or drop it." % arg,
              IgnoredArgumentWarning, stacklevel=4)
    include = args["include_damping_in_qmodel_change"]
    if include is None:
      include = legacy_constants.optimizer_defaults()[
          "include_damping_in_qmodel_change"]
    if not isinstance(include, bool):
      raise ValueError("include_damping_in_qmodel_change must be a bool or "
                       "None, got %r." % (include,))
    self._include_damping_in_qmodel_change = include
    self._qmodel_update_rescale = qmodel_update_rescale
    self._adapt_damping = bool(adapt_damping)
    self._exact_damping_model = bool(
        args["always_use_exact_qmodel_for_damping_adjustment"])
    self._update_damping_immediately = args["update_damping_immediately"]
    self._is_chief = args["is_chief"]
    self._prev_train_batch = args["prev_train_batch"]
    self._loss = args["loss"]
    self._loss_fn = loss_fn
    self._min_damping = args["min_damping"]
    self._relative_min_damping = args["relative_min_damping"]
    self._l2_reg = l2_reg
    self._adaptation_decay = args["damping_adaptation_decay"]
    self._adaptation_interval = int(args["damping_adaptation_interval"])
    self._rho_upper = args["damping_decrease_rho_threshold"]
    self._rho_lower = args["damping_increase_rho_threshold"]
    self._precon_damping_mult = precon_damping_mult
    self._use_passed_loss = args["use_passed_loss"]
    self._train_batch = args["train_batch"]
    self._print_logs = args["print_logs"]
    self._passed_loss = None

  def _make_damping_variable(self, damping, what, floor=0.0):
    if isinstance(damping, tf.Variable):
      if not damping.dtype.is_floating or damping.shape.rank != 0:
        raise ValueError("%s with a damping variable needs a floating-point "
                         "scalar, got %s %s." %
                         (what, damping.dtype.name, damping.shape))
      return damping
    if utils.is_python_number(damping) and damping == 0 and floor > 0:
      damping = floor  # the rule keeps the damping >= min_damping
    if not utils.is_python_number(damping) or damping <= 0:
      raise ValueError(
          "%s needs the initial damping as a positive Python number (or a "
          "scalar tf.Variable to adapt in place), got %r." % (what, damping))
    return _StoredDamping(float(damping))

  # The adapted damping lives in the StateStore, created when first used
  # (in the step: under a strategy, as a replica-local variable).
  @property
  def _damping(self):
    value = self.__dict__.get("_damping_value")
    if isinstance(value, _StoredDamping):
      return self._store.get_or_create("adaptive/damping", [], tf.float64,
                                       initial_value=value.initial)
    return value

  @_damping.setter
  def _damping(self, value):
    self.__dict__["_damping_value"] = value

  @property
  def _damping_is_stored(self):
    """Whether the adapted damping is K-FAC's (not the user's variable)."""
    return isinstance(self.__dict__.get("_damping_value"), _StoredDamping)

  @property
  def _uses_damping_model(self):
    """Whether the steps need the predicted change of the loss."""
    return self._adapt_damping or getattr(self, "_calibrate_damping", False)

  # ------------------------------------------------------------ records
  def _record(self, name):
    return self._store.get_or_create("records/" + name, [], tf.float64,
                                     initial_value=_RECORDS[name])

  @property
  def _loss_tensor(self):
    """The `loss` given to the constructor (kfac 0.2.x's private name, read
    by code written for it)."""
    return self._loss

  @property
  def _damping_adaptation_interval(self):
    return self._adaptation_interval

  @property
  def damping_adaptation_interval(self):
    """How many steps apart the damping rule runs (an int)."""
    return self._adaptation_interval

  @property
  def rho(self):
    """The last reduction ratio of the damping rule (NaN before the first)."""
    return utils.cast(self._record("rho"), self._dtype)

  @property
  def qmodel_change(self):
    """The change of the loss the quadratic model predicted for the last
    update (qmodel*: every step; regular / adam: the last step the damping
    rule used it; NaN before)."""
    return utils.cast(self._record("qmodel_change"), self._dtype)

  @property
  def norm_stats(self):
    """{"grad_norm", "precon_grad_norm", "update_norm"}: Euclidean norms of
    the last step's gradient, preconditioned vector and update (float64);
    needs compute_norm_stats=True."""
    if not self._compute_norm_stats:
      raise ValueError("norm_stats needs KfacOptimizer(..., "
                       "compute_norm_stats=True).")
    return {name: tf.convert_to_tensor(self._record(name))
            for name in _NORM_RECORDS}

  def _record_ops(self, update):
    for name in _RECORDS:  # all readable from the first step on
      self._record(name)
    if self._compute_norm_stats:
      deltas = [tf.convert_to_tensor(d) for d, _ in update.deltas]
      inner = gram64([update.grads, [p for p, _ in update.precon], deltas])
      for i, name in enumerate(("grad_norm", "precon_grad_norm",
                                "update_norm")):
        update.records[name] = tf.sqrt(inner[i][i])
    if update.model_change is not None:
      update.records["qmodel_change"] = update.model_change
    return [self._record(name).assign(utils.cast(value, tf.float64))
            for name, value in sorted(update.records.items())]

  # ------------------------------------------------------------ curvature
  def set_qmodel_layer_collection(self, layer_collection):
    """The LayerCollection whose losses define the quadratic model's
    exact curvature (the constructor's qmodel_layer_collection; None: the
    training collection's); in a tf.function set it on every trace."""
    if layer_collection is not None:
      if not (self._momentum_type.startswith("qmodel") or
              self._exact_damping_model):
        raise ValueError(
            "qmodel_layer_collection is used by the quadratic model only "
            "(momentum_type 'qmodel' / 'qmodel_fixedmu', or "
            "always_use_exact_qmodel_for_damping_adjustment=True); got "
            "momentum_type=%r." % self._momentum_type)
      if not hasattr(layer_collection, "losses_with_coeffs"):
        raise ValueError("qmodel_layer_collection must be a LayerCollection "
                         "with the loss registered on it, got %r."
                         % (layer_collection,))
    self._qmodel_layers = layer_collection

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

  def _batch_size_value(self):
    if self._batch_size is not None:
      return utils.cast(self._batch_size, tf.float64)
    return self._rows(self._layers, "the layer collection")

  def _qmodel_curvature_source(self):
    """(layer collection, N): the losses of the quadratic model's
    curvature and the batch size its summed products are divided by. With
    a qmodel_layer_collection, N scales the training batch size by its
    share of the rows."""
    sub = self._qmodel_layers
    if sub is None:
      return self._layers, self._batch_size_value()
    share = (self._rows(sub, "qmodel_layer_collection") /
             self._rows(self._layers, "the layer collection"))
    return sub, self._batch_size_value() * share

  def _curvature_gram(self, variables, vectors):
    """[[u^T C v for v in vectors] for u in vectors]: the exact curvature of
    the mean loss (C = summed-loss curvature / batch size) on each pair of
    vectors (each a list aligned with `variables`), in float64; on the
    qmodel_layer_collection's rows where one is set."""
    from kfac.python.ops import curvature_matrix_vector_products as cmvp  # pylint: disable=g-import-not-at-top
    layers, n = self._qmodel_curvature_source()
    computer = cmvp.CurvatureMatrixVectorProductComputer(layers, variables)
    if self._require_estimator().mat_type == "GGN":
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

  def _qmodel_update(self, grads_and_vars, update):
    """Fills `update` with the step alpha p + mu d of the quadratic model
    (module docstring)."""
    est = self._require_estimator()
    variables = [v for _, v in grads_and_vars]
    grads = [g for g, _ in grads_and_vars]
    precon = [tf.convert_to_tensor(p)
              for p, _ in est.multiply_inverse(grads_and_vars)]
    velocities = [self._velocity(v) for v in variables]
    prev = [tf.convert_to_tensor(v) for v in velocities]
    gram = self._curvature_gram(variables, [precon, prev])
    # Every inner product of p, d and g the model needs, in one Gram.
    inner = gram64([precon, prev, grads])
    dots = [inner[0][:2], inner[1][:2]]
    damping = utils.cast(self._read(self._damping), tf.float64)
    l2_reg = tf.constant(float(self._l2_reg), tf.float64)

    def model(extra):
      return [[gram[i][j] + extra * dots[i][j] for j in range(2)]
              for i in range(2)]

    solve_m = model(damping + l2_reg)
    c1, c2 = inner[2][0], inner[2][1]
    if self._momentum_type == "qmodel":
      alpha, mu = quadratic_model.solve_two_by_two(
          solve_m[0][0], solve_m[0][1], solve_m[1][1], c1, c2)
    else:
      mu = utils.cast(self._read(self._momentum), tf.float64)
      alpha = quadratic_model.solve_fixed_second(solve_m[0][0], solve_m[0][1],
                                                 c1, mu)
    if self._qmodel_update_rescale is not None:
      scale = utils.cast(self._read(self._qmodel_update_rescale), tf.float64)
      alpha, mu = alpha * scale, mu * scale
    # The predicted change: without the damping term unless asked for.
    model_m = (solve_m if self._include_damping_in_qmodel_change else
               model(l2_reg))
    update.model_change = quadratic_model.model_value(
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

  def _set_model_change(self, grads_and_vars, update):
    """The predicted change of a regular / adam update (module docstring):
    exact now, or the K-FAC model built where it is used."""
    if not self._uses_damping_model:
      return
    grads = [tf.convert_to_tensor(g) for g, _ in grads_and_vars]
    if self._exact_damping_model:
      variables = [v for _, v in grads_and_vars]
      deltas = [tf.convert_to_tensor(d) for d, _ in update.deltas]
      curvature = self._curvature_gram(variables, [deltas])[0][0]
      inner = gram64([deltas, grads])
      sq = inner[0][0]
      diagonal = tf.constant(float(self._l2_reg), tf.float64)
      if self._include_damping_in_qmodel_change:
        diagonal += utils.cast(self._read(self._damping), tf.float64)
      update.model_change = (0.5 * (curvature + diagonal * sq) +
                             inner[1][0])
      return

    def approximate():
      deltas = [(tf.convert_to_tensor(d), v) for d, v in update.deltas]
      try:
        products = self._require_estimator().multiply(deltas)
      except NotImplementedError as e:
        raise NotImplementedError(
            "%s\nThe damping rule of momentum_type=%r predicts the change of "
            "the loss with the K-FAC matrix (B delta); pass "
            "always_use_exact_qmodel_for_damping_adjustment=True to use the "
            "exact curvature instead." % (e, self._momentum_type)) from e
      values = [d for d, _ in deltas]
      return (0.5 * sum_inner64(values, [p for p, _ in products]) +
              sum_inner64(grads, values))

    update.model_change_fn = approximate
