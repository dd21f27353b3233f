"""Adaptive K-FAC: quadratic-model learning rate and momentum (kfac's old
path of `IgnoredArgumentWarning`; the parts are elsewhere).

The momentum types "qmodel" / "qmodel_fixedmu" and the damping rule's
predicted change are the `QuadraticModel` part
(`adaptive/quadratic_model.py`, with the scalar math); the readable records
(learning rate, momentum, rho, qmodel_change, norms) are `Records`
(`adaptive/records.py`); the damping rule and its calibration are the
`DampingController` (`adaptive/damping_controller.py`, with the math in
`adaptive/damping_rule.py`); the arguments are checked by
`optimizers/config.py`; the exact curvature products are in
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

from kfac.python.ops.adaptive import damping_rule

# Defined with the damping rule's checks (kept here: kfac's old path).
IgnoredArgumentWarning = damping_rule.IgnoredArgumentWarning
