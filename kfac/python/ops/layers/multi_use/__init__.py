"""Weights used several times per example (time steps, tied weights):
factors, blocks and registration."""
