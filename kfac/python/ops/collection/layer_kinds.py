"""The layer families a LayerCollection registers, as one table.

Each family declares itself once in layers/<family>/registration.py (a
`LayerFamily`: its kinds, each kind's block constructor per approximation
and default approximation, and the names of the LayerCollection methods
that register it). This module lists them; LayerCollection reads the
kinds for its default approximations (the kinds marked `settable` have
set_default_<kind>_approximation) and for the approximations each kind
accepts, and the Keras registration (kfac/python/keras/layer_registration.py)
names the family of each Keras layer kind from it. A new family is one
entry here (and its registration methods on LayerCollection).
"""

from kfac.python.ops.layers.conv import registration as conv_registration
from kfac.python.ops.layers.conv import transpose_registration
from kfac.python.ops.layers.dense import registration as dense_registration
from kfac.python.ops.layers.embedding import registration as embedding_registration
from kfac.python.ops.layers.generic import registration as generic_registration
from kfac.python.ops.layers.multi_use import registration as multi_use_registration
from kfac.python.ops.layers.scale_shift import registration as scale_shift_registration

FAMILIES = {
    family.name: family for family in (
        generic_registration.FAMILY,
        dense_registration.FAMILY,
        conv_registration.FAMILY,
        transpose_registration.FAMILY,
        embedding_registration.FAMILY,
        multi_use_registration.FAMILY,
        scale_shift_registration.FAMILY,
    )
}

# kind name -> LayerKind, over every family.
KINDS = {kind.name: kind for family in FAMILIES.values()
         for kind in family.kinds}

# The collection's default approximation per kind whose default can be
# changed (kfac 0.2.x's documented defaults).
DEFAULT_APPROXIMATIONS = {name: kind.default for name, kind in KINDS.items()
                          if kind.settable}
