"""The errors and warnings of graph search (tensormatch/graph_search.py)."""


class AmbiguousRegistrationError(ValueError):
  """Graph search cannot decide how to register some variables (they are
  matched in overlapping groups, or must be registered generically but no
  batch_size was given). A ValueError too."""


class GraphSearchWarning(UserWarning):
  """Warned when graph search registers variables generically."""
