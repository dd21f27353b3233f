"""Cheaper approximations for the layers that would not fit a memory budget.

With `over_budget="fallback"` (FisherEstimator, KfacOptimizer, Kfac), when
the predicted state (collection/memory.py) exceeds the budget, the largest
layers that have a cheaper approximation are re-registered with it, largest
first, until the total fits:
- a Kronecker dense layer (kron) first gets its larger factor replaced by
  its diagonal (kron_in_diag for a wide input, kron_out_diag for a wide
  output), then, if still needed, both factors (kron_both_diag);
- a Kronecker convolution (kron) gets the exact diagonal (diagonal).
Each replacement is listed in `LayerCollection.memory_fallbacks` (shown in
the Keras registration report) and announced by a warning. Other layers keep
their block; if the total still does not fit, the budget error is raised.
The decision is made from static shapes when the estimator makes its
factors, before any state is allocated, and is the same on every trace.
"""

import collections
import warnings

from kfac.python.ops.collection import memory as memory_lib

OVER_BUDGET_CHOICES = ("raise", "fallback")

Fallback = collections.namedtuple(
    "Fallback", ["name", "params", "old", "new", "old_bytes", "new_bytes"])


def check_over_budget(owner, value):
  if value not in OVER_BUDGET_CHOICES:
    raise ValueError("%s: over_budget must be one of %s, got %r." %
                     (owner, ", ".join(repr(c) for c in OVER_BUDGET_CHOICES),
                      value))
  return value


def cheaper_variant(block, level):
  """(a new, not yet instantiated block for the same layer, its approx
  name), or None where the block has no cheaper approximation here (the
  block kinds that have one say so: `cheaper_variant(level)`)."""
  make = getattr(block, "cheaper_variant", None)
  return None if make is None else make(level)


def _approx_label(block):
  return getattr(block, "approx_name", type(block).__name__)


def apply(layer_collection, rows, budget, adopt, rebuild):
  """Replaces blocks (largest first) by cheaper ones until the total of
  `rows` (memory.memory_table of the collection's blocks) fits `budget`.
  `adopt(new_block, old_block)`: the new block will take the old one's
  gradients; `rebuild()` makes the factors of every block again from
  scratch (after each replacement, so that the replaced block's factors,
  and the powers it registered on factors it shared, get no state and
  count for nothing). Returns the new rows; records the replacements in
  `layer_collection.memory_fallbacks` and warns about them."""
  rows = list(rows)
  changed = {}  # row index -> [old approx, old bytes, new approx]
  order = sorted(range(len(rows)), key=lambda i: -rows[i].nbytes)
  for level in (0, 1):
    for i in order:
      if memory_lib.needed_bytes(rows) <= budget:
        break
      variant = cheaper_variant(rows[i].block, level)
      if variant is None:
        continue
      new, label = variant
      old = rows[i].block
      changed.setdefault(i, [_approx_label(old), rows[i].nbytes, None])[2] = (
          label)
      adopt(new, old)
      _replace_block(layer_collection, old, new)
      rebuild()
      rows = memory_lib.memory_table(layer_collection.get_blocks())
  if not changed:
    return rows
  fallbacks = []
  for i in sorted(changed):
    old_label, old_bytes, new_label = changed[i]
    fallbacks.append(Fallback(rows[i].name, rows[i].params, old_label,
                              new_label, old_bytes, rows[i].nbytes))
  layer_collection.memory_fallbacks = fallbacks
  warnings.warn(
      "K-FAC's state would exceed the memory budget of %s: %s. "
      "(over_budget='fallback'; see docs/reliability.md, Memory.)" %
      (memory_lib.format_bytes(budget), "; ".join(
          "layer %s registered with %s instead of %s (%s instead of %s)"
          % (f.name, f.new, f.old, memory_lib.format_bytes(f.new_bytes),
             memory_lib.format_bytes(f.old_bytes)) for f in fallbacks)))
  return rows


def _replace_block(layer_collection, old, new):
  blocks = layer_collection.fisher_blocks
  for key, block in list(blocks.items()):
    if block is old:
      blocks.replace_value(key, new)
      return
  raise ValueError("Block %s is not registered." % old.name)
