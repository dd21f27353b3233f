"""Reliability of a K-FAC run: the non-finite guard (nonfinite.py). See
docs/reliability.md."""
