"""Modules kept at their old import path (kfac.python.ops.kfac_utils.*):
the asynchronous statistics/inverse updater (async_inv_cov_update_kfac_opt),
and re-exports of the data readers (data_reader, data_reader_alt), the
periodic-update optimizer (periodic_inv_cov_update_kfac_opt) and OpQueue
(op_queue, also at kfac.python.ops.op_queue)."""
