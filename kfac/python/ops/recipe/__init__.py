"""K-FAC's default recipe: what the optimizers do when the user sets only
what they must (see docs/recipe.md).

* `curvature_scale`: the mean eigenvalue of the K-FAC curvature, read from
  the factors' traces (no decomposition), used by the relative damping floor
  (`relative_min_damping`).
"""

from kfac.python.ops.recipe.scale import curvature_scale  # noqa: F401
