"""Registration of arbitrary parameters (generic layers) on a
LayerCollection: a full or diagonal block of the Fisher of their flattened
gradient. The family's declaration (`FAMILY`) and its registration
function, which LayerCollection.register_generic calls with the collection
`lc` first (its registry interface: `lc.resolve_approximation`,
`lc.register_block`, `lc.record_uses`).
"""

from kfac.python.ops.layers.base import registration as registration_base
from kfac.python.ops.layers.base.approximations import APPROX_DIAGONAL_NAME
from kfac.python.ops.layers.base.approximations import APPROX_FULL_NAME
from kfac.python.ops.layers.base.registration import VARIABLE_SCOPE
from kfac.python.ops.layers.generic import blocks as generic_blocks

_GENERIC_APPROX_TO_BLOCK = {
    APPROX_FULL_NAME: generic_blocks.NaiveFullFB,
    APPROX_DIAGONAL_NAME: generic_blocks.NaiveDiagonalFB,
}

GENERIC = registration_base.LayerKind(
    name="generic", label="generic", default=APPROX_DIAGONAL_NAME,
    blocks=_GENERIC_APPROX_TO_BLOCK, settable=True)

FAMILY = registration_base.LayerFamily(
    name="generic", kinds=(GENERIC,),
    params="any variable, or a tuple / list of variables",
    methods=("register_generic",))


def register_generic(lc, params, batch_size, approx=None,
                     reuse=VARIABLE_SCOPE):
  """Registers arbitrary parameters with a full or diagonal block of the
  Fisher of their flattened gradient (batch_size: examples per tower)."""
  approx = lc.resolve_approximation(params, approx, GENERIC)
  block = GENERIC.blocks[approx](lc, params)
  block = lc.register_block(params, block, reuse=reuse)
  block.register_additional_tower(batch_size)
  lc.record_uses(params, float("inf"))  # any number of uses
  return block
