"""Work paid for only where it is used: see recompute.py."""

from kfac.python.ops.lazy.recompute import recompute_in_branch

__all__ = ["recompute_in_branch"]
