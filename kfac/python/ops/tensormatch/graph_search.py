"""Automatic layer registration by searching the graph (graph search).

`register_layers(layer_collection, varlist, batch_size=None)` looks at the
graph that computes the registered losses, finds the layers that use the
variables of `varlist` (dense layers, convolutions, embedding lookups,
scale-and-shift and batch-norm parameters; see graph_patterns.py) and
registers them on `layer_collection` as if the user had called the
matching `register_*` method. `LayerCollection.auto_register_layers`
calls it.

It works wherever the model's tensors are graph tensors: a TF1
`tf.Graph` (reference or resource variables) and the FuncGraph of a
`tf.function` being traced (variables captured from outside, read through
ReadVariableOp). In a TF2 program run it inside the traced step, after
the forward pass and the loss registrations, on the LayerCollection built
in that trace.

How matches become registrations:
1. Every losses tower (losses registered again under the same name with
   reuse add towers) is searched separately, in the part of the graph its
   loss inputs depend on; towers after the first are registered with
   reuse=True (they add a tower to the first one's blocks).
2. Matches are dropped if they contain a variable the user registered
   before the search, if they cut across a group declared with
   `define_linked_parameters`, or if the nodes they cover are a strict
   subset of another match sharing a variable (so W is dropped in favour
   of (W, b)). A variable still left in two different groups (e.g. tied
   weights with different biases) is ambiguous: AmbiguousRegistrationError
   (declare the grouping you want with define_linked_parameters).
3. Params matched several times are one layer used several times
   (register_fully_connected_multi / register_conv2d_multi, uses in graph
   order). A single dense or conv2d match whose first dimension is a
   multiple of `batch_size` is a layer with its uses folded into the batch
   (num_uses = rows / batch_size).
4. Variables of `varlist` that no match registers fall back to
   `register_generic(var, batch_size)` with a warning naming them (that
   needs batch_size). A variable of a linked group with several members
   cannot be generic: ValueError.
Layers are registered in a deterministic order (by variable names), so
that K-FAC's state is found again on every retrace.
"""

import tensorflow as tf

from kfac.python.ops.tensors import utils
from kfac.python.ops.compat_utils.subgraph import SubGraph
from kfac.python.ops.tensormatch import tensorflow_graph_util as graph_util
from kfac.python.ops.tensormatch import match_records as _records
from kfac.python.ops.tensormatch.record_filters import filter_records
from kfac.python.ops.tensormatch.record_registration import register_generic_leftovers
from kfac.python.ops.tensormatch.record_registration import register_records
from kfac.python.ops.tensormatch.record_search import find_records
# This module's public interface (kfac 0.2.x), defined in the modules that
# find the layers (record_search), choose among the matches
# (record_filters) and register them (record_registration).
# pylint: disable=unused-import,g-bad-import-order
from kfac.python.ops.tensormatch import graph_matcher as gm
from kfac.python.ops.tensormatch import graph_patterns as gp
from kfac.python.ops.tensormatch.match_records import (
    MatchRecord, ParamsDict, RecordType, TensorToVariable,
    UnsupportedLayerError, ensure_sequence,
    record_affine_from_bindings, record_batch_norm_from_bindings,
    record_scale_and_shift_from_bindings)
from kfac.python.ops.tensormatch.record_filters import (
    filter_grouped_variable_records, filter_subgraph_records,
    filter_user_registered_records)
from kfac.python.ops.tensormatch.search_errors import (
    AmbiguousRegistrationError, GraphSearchWarning)
# pylint: enable=unused-import,g-bad-import-order


def _check_varlist(varlist):
  if varlist is None:
    raise ValueError("register_layers needs the list of variables to "
                     "register (varlist).")
  varlist = list(varlist)
  for v in varlist:
    if not isinstance(v, tf.Variable):
      raise TypeError("register_layers: varlist must hold tf.Variables, got "
                      "%r." % (v,))
  return varlist


def _losses_graph(layer_collection):
  for loss in layer_collection.losses:
    for t in loss.inputs:
      if graph_util.is_tensor(t):
        return t.graph
  raise ValueError(
      "Graph search needs the registered losses' inputs as graph tensors "
      "(eager tensors have no graph). Build the model and call "
      "auto_register_layers inside a TF1 graph or inside the tf.function "
      "(training step) that computes the loss.")


def register_layers(layer_collection, varlist, batch_size=None):
  """Finds the layers of `varlist` in the graph and registers them.

  Call it after registering the losses (all towers) and any layers you
  want registered your own way.

  Args:
    layer_collection: the `LayerCollection` to register on.
    varlist: the variables to register (tf.Variables).
    batch_size: the batch size per tower (per replica): needed when
      variables fall back to generic registrations, and used to detect
      layers whose uses (time steps) are folded into the batch dimension.

  Returns:
    A mapping (keyed by params: a variable or a tuple of variables) of the
    blocks this call registered.

  Raises:
    ValueError: if no losses are registered, losses were registered a
      different number of times (towers), a variable of a linked group was
      not matched with its group, variables are used by layers of
      different kinds, or a layer kind is used several times where K-FAC
      has no multi-use registration for it.
    AmbiguousRegistrationError: variables matched in overlapping groups, or
      a generic registration without batch_size.
  """
  varlist = _check_varlist(varlist)
  before = set(id(b) for b in layer_collection.get_blocks())
  user_registered = _records.variable_refs(layer_collection.registered_variables)
  if not layer_collection.losses:
    raise ValueError(
        "No registered losses found. Automatic registration requires all "
        "losses in the graph to be registered (e.g. "
        "register_softmax_cross_entropy_loss(logits)) before it can begin.")
  towers_by_loss = layer_collection.towers_by_loss
  num_towers = len(towers_by_loss[0])
  if any(len(towers) != num_towers for towers in towers_by_loss):
    raise ValueError(
        "If losses are registered with reuse=True, each name must be "
        "registered the same number of times; got %s towers for the losses "
        "%s." % ([len(t) for t in towers_by_loss],
                 list(getattr(layer_collection, "loss_names", []))))
  graph = _losses_graph(layer_collection)
  for tower in range(num_towers):
    outputs = [t for towers in towers_by_loss
               for t in towers[tower].inputs if graph_util.is_tensor(t)]
    register_subgraph_layers(
        layer_collection, varlist, SubGraph(outputs),
        user_registered_variables=user_registered, reuse=tower > 0,
        batch_size=batch_size, graph=graph)
  return ParamsDict((params, block)
                    for params, block in layer_collection.blocks_and_params()
                    if id(block) not in before)


def register_subgraph_layers(layer_collection,
                             varlist,
                             subgraph,
                             user_registered_variables=frozenset(),
                             reuse=False,
                             batch_size=None,
                             graph=None):
  """Registers the layers of `varlist` found in `subgraph` (one tower).

  Args:
    layer_collection: the `LayerCollection` to register on.
    varlist: the variables to register.
    subgraph: a `SubGraph` (kfac.utils.SubGraph) of the tower's loss
      inputs; only matches inside it count.
    user_registered_variables: variables registered before the search
      (variables or their `.ref()`s); matches using them are dropped and
      they are not registered again.
    reuse: True adds towers to the blocks of an earlier tower.
    batch_size: see register_layers.
    graph: the graph of the subgraph (default: the losses' graph).

  Raises:
    See register_layers.
  """
  varlist = _check_varlist(varlist)
  if graph is None:
    graph = _losses_graph(layer_collection)
  user_refs = _records.variable_refs(user_registered_variables)
  records = find_records(varlist, subgraph, graph, user_refs)
  records = filter_records(layer_collection, records, user_refs)
  registered = register_records(layer_collection, records, reuse=reuse,
                                batch_size=batch_size)
  done = user_refs | registered
  leftover = [v for v in varlist if graph_util.node_key(v) not in done]
  register_generic_leftovers(layer_collection, leftover, reuse, batch_size)


def default_variables(layer_collection):
  """The variables auto registration considers by default: in a TF1 graph
  the graph's trainable variables; inside a tf.function the trainable
  variables the trace has read so far (in the order it captured them)."""
  graph = _losses_graph(layer_collection)
  watched = getattr(graph, "_watched_variables", None)
  if watched is None:  # a TF1 graph
    return list(graph.get_collection(
        tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES))
  order = {}
  for i, (external, _) in enumerate(graph_util._captures(graph)):  # pylint: disable=protected-access
    order.setdefault(id(external), i)
  variables = [v for v in watched if getattr(v, "trainable", False)]

  def position(v):
    handle = getattr(v, "handle", None)
    return (order.get(id(handle), len(order)), utils.variable_name(v))

  return sorted(variables, key=position)
