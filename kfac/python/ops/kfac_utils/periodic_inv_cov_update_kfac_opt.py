"""Old import path kfac.python.ops.kfac_utils.periodic_inv_cov_update_kfac_opt:
see kfac/python/ops/periodic_inv_cov_update_kfac_opt.py."""

from kfac.python.ops.periodic_inv_cov_update_kfac_opt import PeriodicInvCovUpdateKfacOpt  # pylint: disable=unused-import,line-too-long
