"""Factors of layers used several times."""

__all__ = []
