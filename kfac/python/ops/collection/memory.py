"""How much memory K-FAC's state takes, known before anything is allocated.

Every factor keeps its state in variables it asks its `StateStore` for
(`get_or_create(key, shape, dtype)`) in `instantiate_cov_variables` (the
moving average of its statistic and the average's weight, plus any extra
statistic) and `instantiate_inv_variables` (the inverses, damped inverses,
Cholesky factors, matrix powers and eigendecompositions that its registered
exponents and the inverse method keep). Those requests depend only on static
shapes and the options. `factor_parts` replays them against a store that
records instead of allocating (and puts the factor back as it was), so the
prediction is exact for every block family and follows any new one without
a per-family formula.

`memory_table(blocks)` gives one `BlockMemory` per block (a factor shared
by several blocks is counted once, with the first); `check_budget` raises,
before any state exists, when the total and the estimated working memory
of the largest inversion (`working_bytes`) exceed the budget. The budget
defaults to DEFAULT_BUDGET_FRACTION of the machine's physical memory
(`default_budget`). All of this is build-time Python over static shapes:
nothing runs per step.

Not counted: the optimizer's velocities (one per parameter, as any momentum
optimizer keeps), scalar counters, and with `lazy_statistics_sync` under
several replicas the per-replica copies of the statistics
(distribute/lazy_sync.py).
"""

import collections
import os
import re

import tensorflow as tf

# The default budget: this fraction of the machine's physical memory.
DEFAULT_BUDGET_FRACTION = 0.5
# Inverting (or decomposing) an n x n factor needs working memory besides
# the state: measured (a TF1 Session, float32, invert_every=1, one Dense
# layer of d inputs) as peak RSS minus the process's baseline and the
# predicted state, 11.4x the factor's float32 bytes at d = 4000 (730 MiB)
# and 14.3x at d = 10000 (5.6 GiB) - some seven float64 copies. The budget
# check counts this many bytes per entry of the largest square state part.
WORKING_BYTES_PER_ENTRY = 14 * 4

Part = collections.namedtuple("Part", ["factor", "key", "shape", "dtype",
                                       "nbytes"])


class BlockMemory(collections.namedtuple("BlockMemory",
                                         ["block", "name", "params",
                                          "parts"])):
  """One block's state: `parts` (a list of Part) and their total `nbytes`."""

  @property
  def nbytes(self):
    return sum(p.nbytes for p in self.parts)

  def by_kind(self):
    """{kind: bytes}, kind being the part's name without its factor and
    index (cov, cov_weight, matpow, chol, cholinv, eigvectors, ...)."""
    out = collections.OrderedDict()
    for p in self.parts:
      out[part_kind(p.key)] = out.get(part_kind(p.key), 0) + p.nbytes
    return out


def part_kind(key):
  return re.sub(r"\d+$", "", key.rsplit("/", 1)[-1])


class _RecordingStore:
  """Answers get_or_create with a stand-in and records the request."""

  def __init__(self):
    self.requests = collections.OrderedDict()

  def get_or_create(self, key, shape, dtype, initial_value=0.0):
    del initial_value
    shape = tf.TensorShape(shape)
    if not shape.is_fully_defined():
      raise ValueError("K-FAC state %r needs a fully defined shape, got %s."
                       % (key, shape))
    self.requests.setdefault(key, (tuple(shape.as_list()), tf.as_dtype(dtype)))
    return _StandIn(key)


class _StandIn:
  """What the recording store hands out instead of a variable."""

  def __init__(self, key):
    self.key = key


def factor_parts(factor):
  """[Part] for every variable `factor` will create (cov and inverses),
  computed without creating any. The factor is left as it was."""
  saved = dict(factor.__dict__)
  try:
    # The factor caches its variables in attributes and dicts: give it
    # copies without them, so that it asks the store for each again.
    for name, value in saved.items():
      if _is_state(value):
        factor.__dict__[name] = None
      elif isinstance(value, dict):
        factor.__dict__[name] = type(value)(
            (k, v) for k, v in value.items() if not _is_state(v))
      elif isinstance(value, list):
        factor.__dict__[name] = list(value)
    store = _RecordingStore()
    factor.__dict__["_store"] = store
    factor.instantiate_cov_variables()
    factor.instantiate_inv_variables()
  finally:
    factor.__dict__.clear()
    factor.__dict__.update(saved)
  parts = []
  for key, (shape, dtype) in store.requests.items():
    count = 1
    for d in shape:
      count *= int(d)
    parts.append(Part(factor.name, key, shape, dtype, count * dtype.size))
  return parts


def _is_state(value):
  """A variable (or a tuple of them) that a factor got from its store."""
  if isinstance(value, tuple):
    return bool(value) and all(_is_state(v) for v in value)
  return isinstance(value, (tf.Variable, tf.distribute.DistributedValues,
                            _StandIn))


def memory_table(blocks):
  """[BlockMemory], one per block in order (blocks' factors must exist:
  the estimator makes them). A factor shared by blocks counts once."""
  seen = set()
  rows = []
  for block in blocks:
    parts = []
    for factor in block_factors(block):
      if id(factor) in seen:
        continue
      seen.add(id(factor))
      parts.extend(factor_parts(factor))
    rows.append(BlockMemory(block, block.name, _params_name(block.params),
                            parts))
  return rows


def block_factors(block):
  try:
    factors = block.factors
    factors = factors() if callable(factors) else factors
  except ValueError as e:
    raise ValueError(
        "The memory of block %s is known once its factors exist (the "
        "estimator or optimizer makes them when first used): %s" %
        (block.name, e))
  out = []
  if not factors or all(f is None for f in factors):
    raise ValueError(
        "The memory of block %s is known once its factors exist: the "
        "estimator (or optimizer) makes them when first used." % block.name)
  for f in factors:
    if f is None:
      continue
    out.extend(f if isinstance(f, (list, tuple)) else [f])
  return out


def _params_name(params):
  names = []
  stack = [params]
  while stack:
    p = stack.pop(0)
    if isinstance(p, (list, tuple)):
      stack[:0] = list(p)
    elif p is not None:
      names.append(getattr(p, "name", str(p)))
  return ", ".join(names)


def total_bytes(rows):
  return sum(r.nbytes for r in rows)


def working_bytes(rows):
  """The estimated transient memory of inverting the largest square
  factor (WORKING_BYTES_PER_ENTRY per entry; 0 without square parts)."""
  largest = 0
  for r in rows:
    for p in r.parts:
      shape = [int(d) for d in p.shape]
      if len(shape) >= 2 and shape[-1] == shape[-2]:
        largest = max(largest, shape[-1] * shape[-1])
  return largest * WORKING_BYTES_PER_ENTRY


def needed_bytes(rows):
  """What the budget is checked against: the state and the working memory
  of the largest inversion."""
  return total_bytes(rows) + working_bytes(rows)


def format_bytes(n):
  for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if n >= size:
      return "%.1f %s" % (n / size, unit)
  return "%d B" % n


def format_table(rows):
  """A text table: one line per block (its parts by kind), then the total."""
  lines = []
  for r in rows:
    kinds = ", ".join("%s %s" % (k, format_bytes(v))
                      for k, v in r.by_kind().items())
    lines.append("%s (%s): %s [%s]" % (r.name, r.params,
                                       format_bytes(r.nbytes), kinds))
  lines.append("total: %s" % format_bytes(total_bytes(rows)))
  if working_bytes(rows):
    lines.append("working memory of the largest inversion (estimated, while "
                 "it runs): %s" % format_bytes(working_bytes(rows)))
  return "\n".join(lines)


def physical_memory():
  """The machine's physical memory in bytes, or None where unknown."""
  try:
    pages = os.sysconf("SC_PHYS_PAGES")
    page = os.sysconf("SC_PAGE_SIZE")
    if pages > 0 and page > 0:
      return int(pages) * int(page)
  except (AttributeError, ValueError, OSError):
    pass
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemTotal:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return None


def default_budget():
  """DEFAULT_BUDGET_FRACTION of the physical memory (None where unknown:
  then no budget is enforced)."""
  total = physical_memory()
  return None if total is None else int(total * DEFAULT_BUDGET_FRACTION)


def resolve_budget(owner, budget):
  """The budget in bytes: "auto" -> default_budget(); None -> None (no
  check); else a positive number."""
  if isinstance(budget, str):
    if budget == "auto":
      return default_budget()
    raise ValueError("%s: memory_budget must be a number of bytes, 'auto' "
                     "or None, got %r." % (owner, budget))
  if budget is None:
    return None
  if isinstance(budget, bool) or not isinstance(budget, (int, float)) or (
      budget <= 0):
    raise ValueError("%s: memory_budget must be a positive number of bytes, "
                     "'auto' or None, got %r." % (owner, budget))
  return budget


def check_budget(rows, budget):
  """Raises ValueError naming the largest blocks when the total exceeds
  `budget` bytes (None: no check)."""
  if budget is None:
    return
  total = total_bytes(rows)
  work = working_bytes(rows)
  if total + work <= budget:
    return
  largest = sorted(rows, key=lambda r: -r.nbytes)
  listed = "; ".join("%s (%s): %s" % (r.name, r.params, format_bytes(r.nbytes))
                     for r in largest[:5] if r.nbytes)
  raise ValueError(
      "K-FAC's state would take %s (%d bytes)%s, over the memory budget of %s "
      "(%d bytes). Largest layers: %s. Register those layers with a cheaper "
      "approximation (approx='kron_in_diag' or 'diagonal', see "
      "docs/approximations.md) or let K-FAC do it (over_budget='fallback'), "
      "exclude them from K-FAC, or raise the budget (memory_budget=<bytes>, "
      "or None for no check; docs/reliability.md, Memory)." % (
          format_bytes(total), total,
          " and inverting its largest factor some %s more" %
          format_bytes(work) if work else "",
          format_bytes(budget), int(budget), listed))
