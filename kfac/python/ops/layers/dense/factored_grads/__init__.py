"""Dense-layer gradients preconditioned through the products that formed
them: see match.py."""

from kfac.python.ops.layers.dense.factored_grads.match import gradient_factors
from kfac.python.ops.layers.dense.factored_grads.match import gradients_read_only_here
from kfac.python.ops.layers.dense.factored_grads.match import prefer_factored
from kfac.python.ops.layers.dense.factored_grads.match import product_operands
from kfac.python.ops.layers.dense.factored_grads.match import rebuilt
from kfac.python.ops.layers.dense.factored_grads.match import static_choice

__all__ = ["gradient_factors", "gradients_read_only_here", "prefer_factored",
           "product_operands", "rebuilt", "static_choice"]
