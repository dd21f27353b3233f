"""The K-FAC optimizers: KfacOptimizer (kfac_optimizer.py, with its parts in
this package: config, update_rule, update, sparse, commit,
guarded_step, replicated) and the periodic-update optimizer (periodic.py)."""
