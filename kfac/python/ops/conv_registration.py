"""Registration of convolution layers (conv1d/2d/N-d, depthwise, separable,
conv2d multi-use) on the LayerCollection.

The mixin's methods run on a `LayerCollection` and use its core helpers:
`self._resolve_approx(params, approx, kind, table)`,
`self.register_block(params, block, reuse)`, `self._set_default(kind, value,
table)`.
"""

from kfac.python.ops import registration_base  # pylint: disable=unused-import


class ConvRegistrationMixin:
  """LayerCollection methods; see the module docstring."""
