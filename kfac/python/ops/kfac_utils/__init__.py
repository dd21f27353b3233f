"""Optimizer variants kept at their old import path
(kfac.python.ops.kfac_utils.*): the asynchronous statistics/inverse
updater (async_inv_cov_update_kfac_opt.py)."""
