"""Dense-layer gradients preconditioned through the products that formed
them: see match.py."""

from kfac.python.ops.factored_grads.match import gradient_factors
from kfac.python.ops.factored_grads.match import prefer_factored

__all__ = ["gradient_factors", "prefer_factored"]
