"""Factors of embedding lookups."""

__all__ = []
