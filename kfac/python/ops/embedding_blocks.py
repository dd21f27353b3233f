"""Blocks of embedding lookups."""

__all__ = []
