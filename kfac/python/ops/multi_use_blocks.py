"""Blocks of layers used several times (and KFAC-reduce)."""

__all__ = []
