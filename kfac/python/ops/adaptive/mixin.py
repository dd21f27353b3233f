"""kfac's old path of `IgnoredArgumentWarning` (adaptive K-FAC's parts are
elsewhere).

The momentum types "qmodel" / "qmodel_fixedmu" and the damping rule's
predicted change are the `QuadraticModel` part
(`adaptive/quadratic_model.py`, with the scalar math); the readable records
(learning rate, momentum, rho, qmodel_change, norms) are `Records`
(`optimizers/step.py`); the damping rule and its calibration are the
`DampingController` (`adaptive/quadratic_model.py`, with the math in
`adaptive/damping_rule.py`); the arguments are checked by
`optimizers/config.py`; the exact curvature products are in
`curvature_matrix_vector_products.py`.
"""

from kfac.python.ops.adaptive import damping_rule

# Defined with the damping rule's checks (kept here: kfac's old path).
IgnoredArgumentWarning = damping_rule.IgnoredArgumentWarning
