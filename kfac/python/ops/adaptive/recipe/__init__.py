"""K-FAC's default recipe: what the optimizers do when the user sets only
what they must (docs/recipe.md has the measurements behind each value).

`kfac.keras.optimizers.Kfac(adaptive=True)` applies it: learning rate and
momentum from the exact quadratic model, Levenberg-Marquardt damping
calibrated during NUM_BURNIN_STEPS burn-in steps from INITIAL_DAMPING, and
a damping floor of RELATIVE_MIN_DAMPING times the curvature scale.
`recipe.adaptive_kwargs()` gives the same arguments for
`kfac.PeriodicInvCovUpdateKfacOpt` (whose own defaults stay kfac 0.2.x's).

* `curvature_scale`: the mean eigenvalue of the K-FAC curvature, read from
  the factors' traces (no decomposition), used by the relative damping floor
  (`relative_min_damping`).
"""

from kfac.python.ops.adaptive.recipe.scale import curvature_scale  # noqa: F401

# The damping never falls below this times the curvature scale. Measured
# (docs/recipe.md): without it adaptive K-FAC collapses on the benchmark
# convnet; 0.1 reached every target in the fewest steps of {0.1, 0.3, 1}.
RELATIVE_MIN_DAMPING = 0.1
# The initial damping, which the burn-in calibration then moves (by factors
# of 10, then bisecting in log space): the same on every workload.
INITIAL_DAMPING = 1.0
NUM_BURNIN_STEPS = 5
# Statistics (their sampled backward pass and factor products) every this
# many steps; measured by time to target in docs/recipe.md.
COV_UPDATE_EVERY = 2


def adaptive_kwargs(**overrides):
  """Arguments of kfac.PeriodicInvCovUpdateKfacOpt for the default recipe
  (pass loss_fn=... and, in a TF1 graph, train_batch=... too; overrides
  replace any of these)."""
  kwargs = dict(learning_rate=None, momentum=None, momentum_type="qmodel",
                damping=INITIAL_DAMPING, adapt_damping=True,
                calibrate_damping=True, num_burnin_steps=NUM_BURNIN_STEPS,
                relative_min_damping=RELATIVE_MIN_DAMPING,
                cov_update_every=COV_UPDATE_EVERY)
  kwargs.update(overrides)
  return kwargs
