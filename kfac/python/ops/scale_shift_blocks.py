"""Blocks of scale-and-shift parameters."""

__all__ = []
