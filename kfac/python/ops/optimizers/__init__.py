"""Optimizers over KfacOptimizer: the periodic-update optimizer."""
