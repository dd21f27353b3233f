"""OpQueue: an endless, shuffled round of ops (e.g. inverse updates spread
over workers or steps)."""

import numpy as np


class OpQueue(object):
  """Chooses which op to run next: every op once per round, in a new random
  order each round.

  Args:
    ops: non-empty list of ops (or tensors, or any objects) to choose from.
      Workers that pass the same ops in the same order and the same seed
      get the same sequence.
    seed: int or None (None: a different sequence every time).

  The order is drawn in Python (numpy), so `next_op` costs no session run;
  it works in a TF1 Session program and eagerly alike.
  """

  def __init__(self, ops, seed=None):
    ops = list(ops)
    if not ops:
      raise ValueError("OpQueue needs at least one op.")
    if seed is not None and (isinstance(seed, bool) or
                             not isinstance(seed, (int, np.integer))):
      raise ValueError("OpQueue: seed must be an int or None, got %r." %
                       (seed,))
    # Sorted by name where ops have names, so that workers building their
    # ops in different orders still agree.
    names = [getattr(op, "name", None) for op in ops]
    if all(isinstance(n, str) for n in names) and len(set(names)) == len(ops):
      ops = [op for _, op in sorted(zip(names, ops), key=lambda p: p[0])]
    self._ops = ops
    self._rng = np.random.RandomState(seed)
    self._round = []

  @property
  def ops(self):
    """The ops this queue returns from `next_op`."""
    return list(self._ops)

  def next_op(self, sess=None):
    """The next op of the current round (a new shuffled round starts when
    one is used up).

    Args:
      sess: accepted for compatibility with the old signature (the old
        queue drew the order with a session run); unused.
    """
    del sess
    if not self._round:
      self._round = list(self._rng.permutation(len(self._ops)))[::-1]
    return self._ops[self._round.pop()]
