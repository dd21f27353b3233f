"""Helpers of the old `kfac.utils` module that the rest of the package does
not need, one concept per module; `kfac.python.ops.utils` re-exports them
under their old names."""
