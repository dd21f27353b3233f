"""Factors of convolution layers."""

__all__ = []
