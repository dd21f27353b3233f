"""Registration of arbitrary parameters (generic layers) on the
LayerCollection: a full or diagonal block of the Fisher of their flattened
gradient.

The mixin's methods run on a `LayerCollection` and use its core helpers:
`self._resolve_approx(params, approx, kind, table)`,
`self.register_block(params, block, reuse)`, `self._set_default(kind, value,
table)`, `self._add_uses(params, n)`.
"""

from kfac.python.ops.layers.base.approximations import APPROX_DIAGONAL_NAME
from kfac.python.ops.layers.base.approximations import APPROX_FULL_NAME
from kfac.python.ops.layers.base.registration import VARIABLE_SCOPE
from kfac.python.ops.layers.generic import blocks as generic_blocks

_GENERIC_APPROX_TO_BLOCK = {
    APPROX_FULL_NAME: generic_blocks.NaiveFullFB,
    APPROX_DIAGONAL_NAME: generic_blocks.NaiveDiagonalFB,
}


class GenericRegistrationMixin:
  """LayerCollection methods; see the module docstring."""

  def set_default_generic_approximation(self, value):
    self._set_default("generic", value, _GENERIC_APPROX_TO_BLOCK)

  @property
  def default_generic_approximation(self):
    return self._defaults["generic"]

  def register_generic(self, params, batch_size, approx=None,
                       reuse=VARIABLE_SCOPE):
    """Registers arbitrary parameters with a full or diagonal block of the
    Fisher of their flattened gradient (batch_size: examples per tower)."""
    approx = self._resolve_approx(params, approx, "generic",
                                  _GENERIC_APPROX_TO_BLOCK)
    block = _GENERIC_APPROX_TO_BLOCK[approx](self, params)
    block = self.register_block(params, block, reuse=reuse)
    block.register_additional_tower(batch_size)
    self._add_uses(params, float("inf"))  # any number of uses
    return block
