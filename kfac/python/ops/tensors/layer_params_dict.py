"""`LayerParametersDict`: a mapping keyed by layer parameters.

A key is a variable (or tensor), or a tuple / list of them (lists are
stored as tuples). No variable may belong to two keys: inserting a key that
shares a variable with an existing key raises ValueError, so each variable
has at most one layer. This is the type of `LayerCollection.fisher_blocks`
(kfac 0.2.x's contract).

Variables and tensors are unhashable in TF2 programs, so entries are kept by
`.ref()`; the keys handed back are the parameters as given. A single
variable can also be looked up as a 1-tuple, and a 1-tuple key as the
variable.
"""

import collections
import collections.abc

from kfac.python.ops.tensors import utils


def _canonical(key):
  return tuple(key) if isinstance(key, (list, tuple)) else key


def _members(key):
  return key if isinstance(key, tuple) else (key,)


def _ref(obj):
  return utils.hashable_key(obj)


class LayerParametersDict(collections.abc.MutableMapping):
  """An ordered mapping from layer parameters (a variable / tensor, or a
  tuple of them) to values, in which no variable belongs to two keys."""

  def __init__(self, *args, **kwargs):
    self._entries = collections.OrderedDict()  # ref key -> (key, value)
    self._owner = {}  # member ref -> ref key
    self.update(*args, **kwargs)

  @classmethod
  def unchecked(cls, items):
    """A LayerParametersDict holding `items` ((key, value) pairs) as given,
    even if keys share variables (a variable then belongs to its first
    key); later insertions are checked against all of them."""
    out = cls()
    for key, value in items:
      key = _canonical(key)
      ref_key = _ref(key)
      out._entries[ref_key] = (key, value)  # pylint: disable=protected-access
      for m in _members(key):
        out._owner.setdefault(_ref(m), ref_key)  # pylint: disable=protected-access
    return out

  def _find(self, key):
    """The ref key under which `key` is stored, or None."""
    key = _canonical(key)
    try:
      ref = _ref(key)
      if ref in self._entries:
        return ref
      # A variable found as a 1-tuple key, and a 1-tuple as the variable.
      if isinstance(key, tuple) and len(key) == 1:
        alt = _ref(key[0])
      elif not isinstance(key, tuple):
        alt = (ref,)
      else:
        return None
      return alt if alt in self._entries else None
    except TypeError:  # an unhashable key that is no tensor
      return None

  def __setitem__(self, key, value):
    key = _canonical(key)
    refs = [_ref(m) for m in _members(key)]
    taken = [m for m, r in zip(_members(key), refs) if r in self._owner]
    if taken:
      raise ValueError(
          "Key(s) already present: %s already belong(s) to another key of "
          "this LayerParametersDict (a variable can belong to one layer "
          "only)." % ", ".join(_name(m) for m in taken))
    ref_key = _ref(key)
    self._entries[ref_key] = (key, value)
    for r in refs:
      self._owner[r] = ref_key

  def replace_value(self, key, value):
    """Sets the value of the existing `key`, keeping its place."""
    ref_key = self._find(key)
    if ref_key is None:
      raise KeyError(key)
    stored, _ = self._entries[ref_key]
    self._entries[ref_key] = (stored, value)

  def __getitem__(self, key):
    ref_key = self._find(key)
    if ref_key is None:
      raise KeyError(key)
    return self._entries[ref_key][1]

  def __delitem__(self, key):
    ref_key = self._find(key)
    if ref_key is None:
      raise KeyError(key)
    stored, _ = self._entries.pop(ref_key)
    for m in _members(stored):
      self._owner.pop(_ref(m), None)

  def __contains__(self, key):
    return self._find(key) is not None

  def __iter__(self):
    return iter([key for key, _ in self._entries.values()])

  def __len__(self):
    return len(self._entries)

  def __repr__(self):
    return "LayerParametersDict(%s)" % ", ".join(
        "%s: %r" % (_describe_key(k), v) for k, v in self._entries.values())

  def owner_of(self, member):
    """The key containing `member` (a variable or tensor), or None."""
    ref_key = self._owner.get(_ref(member))
    return None if ref_key is None else self._entries[ref_key][0]

  def refs(self, key):
    """The hashable form of a key (as stored)."""
    return _ref(_canonical(key))


def _name(obj):
  return utils.variable_name(obj) if hasattr(obj, "name") else repr(obj)


def _describe_key(key):
  if isinstance(key, tuple):
    return "(%s)" % ", ".join(_name(m) for m in key)
  return _name(key)
