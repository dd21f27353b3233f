"""Choosing among the records graph search found: the matches of variables
the user registered, the matches cutting across a linked group and the
matches contained in larger ones are dropped; a variable left in two
groups is ambiguous."""

import collections

from kfac.python.ops.tensormatch import match_records as _records
from kfac.python.ops.tensormatch import tensorflow_graph_util as graph_util
from kfac.python.ops.tensormatch.match_records import ensure_sequence
from kfac.python.ops.tensormatch.search_errors import AmbiguousRegistrationError
from kfac.python.ops.tensors import utils


def linked_groups(layer_collection):
  """[(frozenset of variable refs, params)] of the linked groups."""
  out = []
  for key, value in layer_collection.linked_parameters.items():
    if isinstance(value, tuple) and len(value) == 2 and not isinstance(
        value[0], str):
      params = value[0]  # ours: {refs: (params, approximation)}
    else:
      params = tuple(key)
    out.append((_records.variable_refs(ensure_sequence(params)), params))
  return out



def filter_user_registered_records(record_list_dict,
                                   user_registered_variables):
  """The records none of whose variables the user registered (a mapping
  of the same kind as `record_list_dict`)."""
  user_refs = _records.variable_refs(user_registered_variables)
  out = _records.empty_like(record_list_dict)
  for params, record_list in record_list_dict.items():
    if not _records.variable_refs(ensure_sequence(params)) & user_refs:
      out[params] = record_list
  return out


def filter_grouped_variable_records(layer_collection, record_list_dict):
  """The records whose params do not cut across a linked group (they are
  the whole group or share no variable with it)."""
  groups = [refs for refs, _ in linked_groups(layer_collection)]
  out = _records.empty_like(record_list_dict)
  for params, record_list in record_list_dict.items():
    refs = _records.variable_refs(ensure_sequence(params))
    if any(refs & group and refs != group for group in groups):
      continue
    out[params] = record_list
  return out


def filter_subgraph_records(record_list_dict):
  """Drops every record that covers a strict subset of the nodes of
  another record sharing a variable with it."""
  flat = [r for record_list in record_list_dict.values() for r in record_list]
  by_variable = collections.defaultdict(list)
  for record in flat:
    for key in _records.variable_refs(ensure_sequence(record.params)):
      by_variable[key].append(record)
  dropped = set()
  for record in flat:
    for key in _records.variable_refs(ensure_sequence(record.params)):
      if any(record.tensor_set < other.tensor_set
             for other in by_variable[key]):
        dropped.add(id(record))
        break
  out = _records.empty_like(record_list_dict)
  for record in flat:
    if id(record) in dropped:
      continue
    if record.params not in out:
      out[record.params] = []
    out[record.params].append(record)
  return out


def filter_records(layer_collection, record_list_dict,
                   user_registered_variables):
  """Applies the three filters (user registered, linked groups, subgraphs)
  and checks that every variable is left in one group at most.

  Raises:
    AmbiguousRegistrationError: if a variable is left in several groups.
  """
  record_list_dict = filter_user_registered_records(
      record_list_dict, user_registered_variables)
  record_list_dict = filter_grouped_variable_records(layer_collection,
                                                     record_list_dict)
  record_list_dict = filter_subgraph_records(record_list_dict)
  owner = {}
  problems = []
  for params in record_list_dict:
    for var in ensure_sequence(params):
      key = graph_util.node_key(var)
      if key in owner:
        problems.append(
            "Variable %s was recorded in multiple groups: %s and %s." %
            (utils.variable_name(var), _records.describe(params),
             _records.describe(owner[key])))
      else:
        owner[key] = params
  if problems:
    raise AmbiguousRegistrationError(
        "\n".join(problems) + "\nDeclare the grouping you want with "
        "layer_collection.define_linked_parameters(...) (e.g. the shared "
        "weights alone), or register these layers yourself before "
        "auto registration.")
  return record_list_dict
