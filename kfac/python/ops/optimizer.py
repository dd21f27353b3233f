"""kfac 0.2.4's `kfac.optimizer` module path (kept for users' imports).

The optimizer lives in the `optimizers/` concept package
(optimizers/kfac_optimizer.py); this module only re-exports kfac 0.2.x's
names: `KfacOptimizer`, the list algebra helpers `ip`, `ip_p`, `sprod`,
`sprod_p` and `set_global_constants`.
"""

from kfac.python.ops.compat_utils import legacy_constants
from kfac.python.ops.compat_utils import list_algebra
from kfac.python.ops.optimizers.kfac_optimizer import KfacOptimizer  # pylint: disable=unused-import

ip = list_algebra.ip
ip_p = list_algebra.ip_p
sprod = list_algebra.sprod
sprod_p = list_algebra.sprod_p
# include_damping_in_qmodel_change: the default of the constructor's
# argument of that name for optimizers made afterwards.
set_global_constants = legacy_constants.set_optimizer_constants
