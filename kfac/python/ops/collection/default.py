"""The default LayerCollection (kfac 0.2.x's get_default_layer_collection /
set_default_layer_collection, and LayerCollection.as_default): a stack per
thread."""

import threading


_default_collections = threading.local()


def current_stack():
  if not hasattr(_default_collections, "stack"):
    _default_collections.stack = []
  return _default_collections.stack


def get_default_layer_collection():
  """The innermost LayerCollection made default by `as_default()`."""
  stack = current_stack()
  if not stack:
    raise ValueError("No default LayerCollection: use `with "
                     "layer_collection.as_default():` or "
                     "set_default_layer_collection(...).")
  return stack[-1]


def set_default_layer_collection(layer_collection):
  """Makes `layer_collection` the default; None clears the default.

  Raises:
    ValueError: if a default is already set (clear it with None first), as
      in kfac 0.2.x.
  """
  stack = current_stack()
  if layer_collection is not None and stack:
    raise ValueError("Default LayerCollection is already set (%s); call "
                     "set_default_layer_collection(None) first." %
                     stack[-1].name)
  del stack[:]
  if layer_collection is not None:
    stack.append(layer_collection)
