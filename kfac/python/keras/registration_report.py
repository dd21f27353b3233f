"""The Keras registration report: a row per layer (what it was registered
as, with which approximation, parameters and calls, the memory its K-FAC
state takes, or why it fell back), then the losses and the total memory.
`Kfac.registration_report` shows it."""

import collections

from kfac.python.ops.collection import memory as memory_lib

Row = collections.namedtuple(
    "Row", ["layer", "layer_class", "registration", "approx", "params",
            "calls", "note", "blocks"], defaults=((),))


def _compact(nbytes):
  return memory_lib.format_bytes(nbytes).replace(" ", "")


def memory_of(layer_collection, budget=None):
  """What the report shows about memory: {block name: bytes}, {block name:
  memory_fallback.Fallback}, the total, the budget and the estimated working
  memory of the largest inversion; None while the collection's factors do
  not exist yet (before the first step)."""
  try:
    rows, total = layer_collection.memory_usage()
  except ValueError:
    return None
  fallbacks = {f.name: f for f in
               getattr(layer_collection, "memory_fallbacks", ())}
  return ({r.name: r.nbytes for r in rows}, fallbacks, total, budget,
          memory_lib.working_bytes(rows))


def format_report(rows, losses=(), memory=None):
  """The registration report: one line per layer, then the losses; with
  `memory` (from memory_of), each layer's K-FAC state and the total."""
  header = ("layer", "class", "block", "approx", "calls", "parameters",
            "note")
  table = []
  for r in rows:
    cells = [r.layer, r.layer_class, r.registration, r.approx, str(r.calls),
             r.params, r.note]
    if memory is not None:
      by_block, fallbacks = memory[:2]
      names = [b.name for b in r.blocks]
      cells.insert(6, _compact(sum(by_block.get(n, 0) for n in names)))
      notes = ["memory fallback: %s -> %s (was %s)" %
               (f.old, f.new, _compact(f.old_bytes))
               for f in (fallbacks.get(n) for n in names) if f is not None]
      cells[-1] = "; ".join([c for c in [cells[-1]] + notes if c])
    table.append(tuple(cells))
  if memory is not None:
    header = header[:6] + ("memory",) + header[6:]
  table.insert(0, header)
  widths = [max(len(row[i]) for row in table) for i in range(len(header))]
  lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
           for row in table]
  lines.insert(1, "  ".join("-" * w for w in widths))
  for loss in losses:
    lines.append("loss: " + loss)
  if memory is not None:
    _, _, total, budget, work = memory
    lines.append("K-FAC state: %s in total (%d bytes)%s%s" % (
        memory_lib.format_bytes(total), total,
        "" if budget is None else "; memory budget %s" %
        memory_lib.format_bytes(budget),
        "" if not work else "; inverting the largest factor needs some %s "
        "more while it runs" % memory_lib.format_bytes(work)))
  return "\n".join(lines)
