"""Fully connected layers: Kronecker factors, blocks, and the factored
preconditioning of gradients formed by a product (factored_grads)."""
