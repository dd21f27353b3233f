"""The K-FAC optimizers: KfacOptimizer and PeriodicInvCovUpdateKfacOpt
(kfac_optimizer.py), facades over their typed configuration (config.py) and
the parts of their step, composed by step.build_step (step.py, with the
parts: the update and its rules, the non-finite guard, the commit, the
counters, the records); sparse gradients (sparse), AdamW's decay
(weight_decay), several replicas (replicated); adaptive/'s quadratic model
and damping controller."""
