"""Tensor plumbing shared by the whole package: helpers, counter-based random
numbers, the layer-parameters dict and the state store."""
