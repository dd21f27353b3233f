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
from kfac.python.ops.layers.conv import blocks as conv_blocks
from kfac.python.ops.layers.dense import blocks as dense_blocks

OVER_BUDGET_CHOICES = ("raise", "fallback")

Fallback = collections.namedtuple(
    "Fallback", ["name", "params", "old", "new", "old_bytes", "new_bytes"])


def check_over_budget(owner, value):
  if value not in OVER_BUDGET_CHOICES:
    raise ValueError("%s: over_budget must be one of %s, got %r." %
                     (owner, ", ".join(repr(c) for c in OVER_BUDGET_CHOICES),
                      value))
  return value


def _copy_towers(old, new):
  new._inputs = list(old._inputs)  # pylint: disable=protected-access
  new._outputs = list(old._outputs)  # pylint: disable=protected-access
  new._row_checks = list(old.row_checks)  # pylint: disable=protected-access
  new.set_name(old.name)
  return new


def _dense_variant(block, level):
  """kron -> one side diagonal (the larger side) -> both diagonal."""
  diag_in, diag_out = block._diag_in, block._diag_out  # pylint: disable=protected-access
  if diag_in and diag_out:
    return None
  if level == 0 and not (diag_in or diag_out):
    n_in = block._input_factor._cov_shape[0]  # pylint: disable=protected-access
    n_out = block._output_factor._cov_shape[0]  # pylint: disable=protected-access
    diag_in, diag_out = n_in >= n_out, n_in < n_out
    label = "kron_in_diag" if diag_in else "kron_out_diag"
  else:
    diag_in = diag_out = True
    label = "kron_both_diag"
  new = dense_blocks.FullyConnectedKFACBasicFB(
      block._layer_collection, has_bias=block._has_bias,  # pylint: disable=protected-access
      diagonal_approx_for_input=diag_in,
      diagonal_approx_for_output=diag_out, params=block.params)
  new.set_output_axes(block._output_axes)  # pylint: disable=protected-access
  return _copy_towers(block, new), label


def _conv_variant(block, level):
  del level
  spec = block._spec  # pylint: disable=protected-access
  new = conv_blocks.ConvDiagonalFB(
      block._layer_collection, block.params, strides=spec.strides,  # pylint: disable=protected-access
      padding=spec.padding, dilations=spec.dilations,
      data_format=block._data_format,  # pylint: disable=protected-access
      patch_mask=getattr(block, "_patch_mask", None))
  return _copy_towers(block, new), "diagonal"


def cheaper_variant(block, level):
  """(a new, not yet instantiated block for the same layer, its approx
  name), or None where the block has no cheaper approximation here."""
  if type(block) is dense_blocks.FullyConnectedKFACBasicFB:  # pylint: disable=unidiomatic-typecheck
    return _dense_variant(block, level)
  if type(block) is conv_blocks.ConvKFCBasicFB and level == 0:  # pylint: disable=unidiomatic-typecheck
    return _conv_variant(block, level)
  return None


def _approx_label(block):
  if isinstance(block, dense_blocks.FullyConnectedKFACBasicFB):
    return {(False, False): "kron", (True, False): "kron_in_diag",
            (False, True): "kron_out_diag", (True, True): "kron_both_diag"}[
                (block._diag_in, block._diag_out)]  # pylint: disable=protected-access
  if isinstance(block, conv_blocks.ConvKFCBasicFB):
    return "kron"
  return type(block).__name__


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
