"""The horizontal bar chart of ms/step that the step-time benchmarks write."""

import numpy as np


def write_step_time_plot(path, names, medians, spreads, title, colors,
                         label_format="%.1f", height=None):
  """Bars of `medians` with interquartile `spreads` ([low, high] offsets),
  one per configuration name, labelled with the median; saved as a PNG."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(7.0, height or 0.5 * len(names) + 1.6))
  y = np.arange(len(names))
  ax.barh(y, medians, xerr=spreads, capsize=3, color=colors)
  ax.set_yticks(y)
  ax.set_yticklabels(names)
  ax.invert_yaxis()
  ax.set_xlabel("ms per step (median; bars: interquartile range)")
  ax.set_title(title, fontsize=9)
  right = np.add(medians, spreads[1])
  for yi, m, r in zip(y, medians, right):
    ax.text(r, yi, "  " + label_format % m, va="center", fontsize=8)
  ax.set_xlim(0, 1.15 * max(right))
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
