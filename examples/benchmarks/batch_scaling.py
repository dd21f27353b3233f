"""The arithmetic of scaling the batch and the workers, without flags or
TensorFlow, so that tests import it alone (critical_batch.py and the
projection of docs/large_batch.md use it).

McCandlish et al. (2018), "An empirical model of large-batch training":
the steps to a target at batch B follow S(B) = S_min (1 + B_noise / B);
S_min is the fewest steps any batch needs and B_noise, the batch at which
twice that is needed, the critical batch size.
"""

import math


def fit_critical_batch(points):
  """McCandlish et al.'s S(B) = S_min (1 + B_noise / B) fitted to
  [(B, S)] by least squares on log S (a grid over B_noise, S_min in
  closed form for each); (S_min, B_noise), or None with fewer than 3
  points."""
  points = [(float(b), float(s)) for b, s in points if s]
  if len(points) < 3:
    return None
  log_s = [math.log(s) for _, s in points]
  lo, hi = min(b for b, _ in points), max(b for b, _ in points)
  best = None
  # B_noise from 1/100 of the smallest batch to 100x the largest, on a
  # log grid fine enough for 0.1 % (then the closed-form S_min).
  n = 4000
  for k in range(n + 1):
    b_noise = lo / 100.0 * (100.0 * hi / (lo / 100.0)) ** (k / n)
    shape = [math.log(1.0 + b_noise / b) for b, _ in points]
    log_s_min = sum(ls - sh for ls, sh in zip(log_s, shape)) / len(points)
    err = sum((ls - log_s_min - sh) ** 2 for ls, sh in zip(log_s, shape))
    if best is None or err < best[0]:
      best = (err, math.exp(log_s_min), b_noise)
  return best[1], best[2]
