"""SequenceDict: a dict read and written with single keys or sequences."""


class SequenceDict(object):
  """A dict whose items can be got and set with a key or a list/tuple of
  keys (then a list of values is returned / a sequence of values is
  stored, pairwise)."""

  def __init__(self, iterable=None):
    self._dict = dict(iterable or [])

  def __getitem__(self, key_or_keys):
    if isinstance(key_or_keys, (tuple, list)):
      return [self._dict[key] for key in key_or_keys]
    return self._dict[key_or_keys]

  def __setitem__(self, key_or_keys, val_or_vals):
    if not isinstance(key_or_keys, (tuple, list)):
      self._dict[key_or_keys] = val_or_vals
      return
    values = list(val_or_vals)
    if len(values) != len(key_or_keys):
      raise ValueError("SequenceDict: %d keys but %d values." %
                       (len(key_or_keys), len(values)))
    for key, value in zip(key_or_keys, values):
      self._dict[key] = value

  def __contains__(self, key):
    return key in self._dict

  def __len__(self):
    return len(self._dict)

  def items(self):
    return list(self._dict.items())
