"""Old import path kfac.python.ops.kfac_utils.periodic_inv_cov_update_kfac_opt:
see kfac/python/ops/optimizers/kfac_optimizer.py."""

from kfac.python.ops.optimizers.kfac_optimizer import PeriodicInvCovUpdateKfacOpt  # pylint: disable=unused-import,line-too-long
