"""The K-FAC optimizers: KfacOptimizer (kfac_optimizer.py), a facade over its
typed configuration (config.py) and the parts of its step, composed by
step.build_step (step.py): guarded_step, update_rule, update, sparse,
weight_decay, commit, replicated (and adaptive/'s quadratic model, damping
controller and records); the periodic-update optimizer (periodic.py), a
facade whose configuration has periods."""
