"""The Keras registration report: a row per layer (what it was registered
as, with which approximation, parameters and calls, or why it fell back),
then the losses. `Kfac.registration_report` shows it."""

import collections

Row = collections.namedtuple(
    "Row", ["layer", "layer_class", "registration", "approx", "params",
            "calls", "note"])


def format_report(rows, losses=()):
  """The registration report: one line per layer, then the losses."""
  header = ("layer", "class", "block", "approx", "calls", "parameters",
            "note")
  table = [header] + [(r.layer, r.layer_class, r.registration, r.approx,
                       str(r.calls), r.params, r.note) for r in rows]
  widths = [max(len(row[i]) for row in table) for i in range(len(header))]
  lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
           for row in table]
  lines.insert(1, "  ".join("-" * w for w in widths))
  for loss in losses:
    lines.append("loss: " + loss)
  return "\n".join(lines)
