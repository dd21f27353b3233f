"""Blocks of convolution layers."""

__all__ = []
