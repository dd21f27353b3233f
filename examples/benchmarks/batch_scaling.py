"""The arithmetic of scaling the batch and the workers, without flags or
TensorFlow, so that tests import it alone (critical_batch.py and
large_batch_projection.py use it).

McCandlish et al. (2018), "An empirical model of large-batch training":
the steps to a target at batch B follow S(B) = S_min (1 + B_noise / B);
S_min is the fewest steps any batch needs and B_noise, the batch at which
twice that is needed, the critical batch size.
"""

import math

import val_workloads as vw


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


def fit_latency_bandwidth(points):
  """t = latency + bytes / bandwidth fitted to [(bytes, seconds)] by least
  squares; (latency s, bandwidth bytes/s), latency at least 0 and the
  bandwidth infinite when the times do not grow with the bytes."""
  n = float(len(points))
  if n < 2:
    raise ValueError("fit_latency_bandwidth needs 2 points or more, got %d"
                     % len(points))
  mean_b = sum(b for b, _ in points) / n
  mean_t = sum(t for _, t in points) / n
  var = sum((b - mean_b) ** 2 for b, _ in points)
  slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / var
  if slope <= 0:
    return max(0.0, mean_t), float("inf")
  return max(0.0, mean_t - slope * mean_b), 1.0 / slope


def ring_allreduce_s(nbytes, workers, latency_s, bytes_per_s):
  """Seconds to all-reduce `nbytes` on `workers` workers with the ring
  algorithm (Patarasuk & Yuan): 2 (W - 1) messages in sequence, each of
  nbytes / W, so 2 (W - 1) latencies and 2 (W - 1) / W * nbytes sent by
  each worker."""
  if workers <= 1:
    return 0.0
  return (2.0 * (workers - 1) * latency_s +
          2.0 * (workers - 1) / workers * nbytes / bytes_per_s)


def steps_to(run, workload, target):
  """The step of the run's first validation at least as good as the
  target, or None."""
  if "error" in run:
    return None
  for p in run["points"]:
    if math.isfinite(p["metric"]) and vw.better(workload, p["metric"],
                                                 target):
      return p["step"]
  return None


def best_runs(results, workload, target):
  """{(optimizer, batch): (steps to target or None, the run)}: per
  optimizer and batch the run of its grid that reached the target in the
  fewest steps (else the one with the best figure)."""
  out = {}
  pick = min if vw.is_loss_metric(workload) else max
  for r in results:
    if r["workload"] != workload:
      continue
    key = (r["optimizer"], r["batch"])
    s = steps_to(r, workload, target)
    have = out.get(key)
    if have is None:
      out[key] = (s, r)
    elif s is not None and (have[0] is None or s < have[0]):
      out[key] = (s, r)
    elif s is None and have[0] is None and "error" not in r and (
        "error" in have[1] or pick(r["best"], have[1]["best"]) == r["best"]):
      out[key] = (s, r)
  return out
