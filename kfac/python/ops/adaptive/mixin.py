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

import tensorflow as tf

from kfac.python.ops.adaptive import damping_mixin as adaptive_damping
from kfac.python.ops.adaptive import damping_rule as damping_adaptation
from kfac.python.ops.adaptive import shared_evaluation
from kfac.python.ops.tensors import utils
from kfac.python.ops.numerics.inner_products import gram64

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


# Defined with the damping rule's checks (kept here: kfac's old path).
IgnoredArgumentWarning = damping_adaptation.IgnoredArgumentWarning


class AdaptiveMixin(adaptive_damping.AdaptiveDampingMixin,
                    shared_evaluation.SharedEvaluationMixin):
  """Quadratic model and damping adaptation for KfacOptimizer."""

  # ------------------------------------------------------------ set-up
  def _scheduled(self, value, schedule):
    """`value`, or a function of the step counter when `schedule` (a
    callable step -> value, kfac-jax style; checked by config.build) is
    given."""
    if schedule is None:
      return value
    return lambda: schedule(tf.convert_to_tensor(self.counter))

  # The adapted damping lives in the StateStore, created when first used
  # (in the step: under a strategy, as a replica-local variable).
  @property
  def _damping(self):
    settings = self.config.damping
    if settings.kfac_owns_damping:
      return self._store.get_or_create("adaptive/damping", [], tf.float64,
                                       initial_value=settings.damping)
    return self._scheduled(settings.damping, settings.damping_schedule)

  @property
  def _damping_is_stored(self):
    """Whether the adapted damping is K-FAC's (not the user's variable)."""
    return self.config.damping.kfac_owns_damping

  # Settings read by code outside the optimizer (kfac/python/keras, tests,
  # kfac 0.2.x programs): read-only views of `config`.
  @property
  def _momentum_type(self):
    return self.config.update.momentum_type

  @property
  def _adapt_damping(self):
    return self.config.damping.adapt_damping

  @property
  def _calibrate_damping(self):
    return self.config.damping.calibrate_damping

  @property
  def _l2_reg(self):
    return self.config.damping.l2_reg

  @property
  def _include_damping_in_qmodel_change(self):
    return self.config.update.include_damping_in_qmodel_change

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
    return self.config.damping.damping_adaptation_interval

  @property
  def damping_adaptation_interval(self):
    """How many steps apart the damping rule runs (an int)."""
    return self.config.damping.damping_adaptation_interval

  @property
  def rho(self):
    """The last reduction ratio of the damping rule (NaN before the first)."""
    return utils.cast(self._record("rho"), self.config.dtype)

  @property
  def qmodel_change(self):
    """The change of the loss the quadratic model predicted for the last
    update (qmodel*: every step; regular / adam: the last step the damping
    rule used it; NaN before)."""
    return utils.cast(self._record("qmodel_change"), self.config.dtype)

  @property
  def norm_stats(self):
    """{"grad_norm", "precon_grad_norm", "update_norm"}: Euclidean norms of
    the last step's gradient, preconditioned vector and update (float64);
    needs compute_norm_stats=True."""
    if not self.config.update.compute_norm_stats:
      raise ValueError("norm_stats needs KfacOptimizer(..., "
                       "compute_norm_stats=True).")
    return {name: tf.convert_to_tensor(self._record(name))
            for name in _NORM_RECORDS}

  def _record_ops(self, update):
    for name in _RECORDS:  # all readable from the first step on
      self._record(name)
    if self.config.update.compute_norm_stats:
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
      if not (self.config.update.momentum_type.startswith("qmodel") or
              self.config.damping.always_use_exact_qmodel_for_damping_adjustment):
        raise ValueError(
            "qmodel_layer_collection is used by the quadratic model only "
            "(momentum_type 'qmodel' / 'qmodel_fixedmu', or "
            "always_use_exact_qmodel_for_damping_adjustment=True); got "
            "momentum_type=%r." % self.config.update.momentum_type)
      if not hasattr(layer_collection, "losses_with_coeffs"):
        raise ValueError("qmodel_layer_collection must be a LayerCollection "
                         "with the loss registered on it, got %r."
                         % (layer_collection,))
    self._qmodel_layers = layer_collection
