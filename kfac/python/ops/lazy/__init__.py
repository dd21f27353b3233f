"""Work paid for only where it is used: see recompute.py and deferred.py."""

from kfac.python.ops.lazy.deferred import defer
from kfac.python.ops.lazy.recompute import recompute_in_branch

__all__ = ["defer", "recompute_in_branch"]
