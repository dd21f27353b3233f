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

import collections
import logging
import warnings

import tensorflow as tf

from kfac.python.ops.tensors import utils
from kfac.python.ops.compat_utils.subgraph import SubGraph
from kfac.python.ops.tensormatch import graph_matcher as gm
from kfac.python.ops.tensormatch import graph_patterns as gp
from kfac.python.ops.tensormatch import tensorflow_graph_util as graph_util
# The records are part of this module's public interface (kfac 0.2.x).
# pylint: disable=unused-import
from kfac.python.ops.tensormatch.match_records import (
    MatchRecord, ParamsDict, RecordType, TensorToVariable,
    UnsupportedLayerError, ensure_sequence,
    record_affine_from_bindings, record_batch_norm_from_bindings,
    record_scale_and_shift_from_bindings)
from kfac.python.ops.tensormatch import match_records as _records
# pylint: enable=unused-import

_log = logging.getLogger("kfac.graph_search")


class AmbiguousRegistrationError(ValueError):
  """Graph search cannot decide how to register some variables (they are
  matched in overlapping groups, or must be registered generically but no
  batch_size was given). A ValueError too."""


class GraphSearchWarning(UserWarning):
  """Warned when graph search registers variables generically."""


# (pattern, record builder, op types a match can end at). The op types let
# the search skip tensors that cannot be a pattern's output.
_SEARCHES = (
    (gp.Affine, _records.record_affine_from_bindings,
     ("MatMul", "BatchMatMulV2", "BatchMatMulV3", "Conv2D", "Conv3D",
      "DepthwiseConv2dNative", "Squeeze", "BatchToSpaceND", "Add", "AddV2",
      "BiasAdd")),
    (gp.ScaleAndShift, _records.record_scale_and_shift_from_bindings,
     ("Mul", "Add", "AddV2", "BiasAdd")),
    (gp.BatchNorm, _records.record_batch_norm_from_bindings,
     ("Add", "AddV2")),
    (gp.FusedBatchNormOutput, _records.record_batch_norm_from_bindings,
     ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")),
    (gp.Embed, _records.record_affine_from_bindings,
     ("Gather", "GatherV2", "ResourceGather")),
)
_COMPILED = []


def _searches():
  if not _COMPILED:
    _COMPILED.extend((gm.matcher_with_consumed(pattern), build,
                      frozenset(types)) for pattern, build, types in _SEARCHES)
  return _COMPILED


def _refs(variables):
  return frozenset(graph_util.node_key(v) for v in variables)


def _names(variables):
  return ", ".join(utils.variable_name(v) for v in variables)


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
  user_registered = _refs(layer_collection.registered_variables)
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


def _candidate_tensors(graph, subgraph):
  for op in graph.get_operations():
    if graph_util.is_identity(op):
      continue
    for t in op.outputs:
      if subgraph.is_member(t):
        yield t


def find_records(varlist, subgraph, graph, skip_variables=frozenset()):
  """A ParamsDict params -> [MatchRecord] of every layer pattern match in
  `subgraph` (of `graph`) whose variables are among `varlist`.

  Raises:
    UnsupportedLayerError: (a ValueError) for a match K-FAC cannot
      register (e.g. a matmul with transposed weights), unless it uses a
      variable of `skip_variables` (variables or refs; those the user
      registered).
  """
  skip = _refs(skip_variables)
  lookup = TensorToVariable(varlist, graph)
  found = ParamsDict()
  if not len(lookup):  # pylint: disable=g-explicit-length-test
    return found
  for tensor in _candidate_tensors(graph, subgraph):
    for match, build, op_types in _searches():
      if tensor.op.type not in op_types:
        continue
      result = match(tensor)
      if not result:
        continue
      bindings, consumed = result
      try:
        record = build(bindings, consumed, lookup)
      except _records.UnsupportedLayerError as e:
        if _refs(ensure_sequence(e.params)) & skip:
          continue  # the user registered this layer
        raise
      if record is None:
        continue
      if record.params not in found:
        found[record.params] = []
      found[record.params].append(record)
  return found


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
  user_refs = _refs(user_registered_variables)
  records = find_records(varlist, subgraph, graph, user_refs)
  records = filter_records(layer_collection, records, user_refs)
  registered = register_records(layer_collection, records, reuse=reuse,
                                batch_size=batch_size)
  done = user_refs | registered
  leftover = [v for v in varlist if graph_util.node_key(v) not in done]
  _register_generic_leftovers(layer_collection, leftover, reuse, batch_size)


def _linked_groups(layer_collection):
  """[(frozenset of variable refs, params)] of the linked groups."""
  out = []
  for key, value in layer_collection.linked_parameters.items():
    if isinstance(value, tuple) and len(value) == 2 and not isinstance(
        value[0], str):
      params = value[0]  # ours: {refs: (params, approximation)}
    else:
      params = tuple(key)
    out.append((_refs(ensure_sequence(params)), params))
  return out


def _group_text(params):
  params = ensure_sequence(params)
  try:
    return str(frozenset(params))  # TF1 variables are hashable
  except TypeError:
    return "{%s}" % _names(params)


def _register_generic_leftovers(layer_collection, leftover, reuse,
                                batch_size):
  groups = _linked_groups(layer_collection)
  seen = set()
  for var in leftover:
    key = graph_util.node_key(var)
    if key in seen:
      continue
    seen.add(key)
    for refs, params in groups:
      if key in refs and len(refs) > 1:
        raise ValueError(
            "Variable %s in linked group %s was not matched. Graph search "
            "found no layer using exactly these variables together; "
            "register the group yourself before auto registration." %
            (utils.variable_name(var), _group_text(params)))
    if batch_size is None:
      raise AmbiguousRegistrationError(
          "Tried to register %s as generic without knowledge of batch_size: "
          "graph search found no layer using it. Pass batch_size to "
          "register it generically, register its layer yourself, or leave "
          "it out of the variables to register. Note that a generic "
          "registration uses the crudest approximation and may be a sign "
          "that the search does not recognise your model." %
          utils.variable_name(var))
    warnings.warn(
        "K-FAC graph search: registering %s as generic, because no layer "
        "pattern matched it in the graph that computes the registered "
        "losses (it may not be used by them, or be used in a way the search "
        "does not recognise). Generic is the crudest approximation: "
        "register the layer yourself if it is a dense, convolution or "
        "embedding layer." % utils.variable_name(var),
        GraphSearchWarning, stacklevel=4)
    layer_collection.register_generic(var, batch_size, reuse=reuse)


def filter_user_registered_records(record_list_dict,
                                   user_registered_variables):
  """The records none of whose variables the user registered (a mapping
  of the same kind as `record_list_dict`)."""
  user_refs = _refs(user_registered_variables)
  out = _records.empty_like(record_list_dict)
  for params, record_list in record_list_dict.items():
    if not _refs(ensure_sequence(params)) & user_refs:
      out[params] = record_list
  return out


def filter_grouped_variable_records(layer_collection, record_list_dict):
  """The records whose params do not cut across a linked group (they are
  the whole group or share no variable with it)."""
  groups = [refs for refs, _ in _linked_groups(layer_collection)]
  out = _records.empty_like(record_list_dict)
  for params, record_list in record_list_dict.items():
    refs = _refs(ensure_sequence(params))
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
    for key in _refs(ensure_sequence(record.params)):
      by_variable[key].append(record)
  dropped = set()
  for record in flat:
    for key in _refs(ensure_sequence(record.params)):
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


def _sort_key(params):
  return (0 if isinstance(params, (tuple, list)) else 1,
          [utils.variable_name(v) for v in ensure_sequence(params)])


def register_records(layer_collection,
                     record_list_dict,
                     reuse=False,
                     batch_size=None):
  """Registers the records on `layer_collection`, in the order of their
  params' variable names.

  Args:
    layer_collection: the `LayerCollection`.
    record_list_dict: a mapping params -> list of MatchRecords (a dict in
      a TF1 graph, or a ParamsDict).
    reuse: True adds towers to existing blocks.
    batch_size: see register_layers.

  Returns:
    The frozenset of `.ref()`s of the variables registered.

  Raises:
    ValueError: if some params have records of different kinds, or are
      used several times by a layer kind without a multi-use
      registration.
    AmbiguousRegistrationError: for a batch norm layer without batch_size.
  """
  mixed = []
  registered = set()
  for params in sorted(record_list_dict.keys(), key=_sort_key):
    record_list = list(record_list_dict[params])
    kinds = set(r.record_type for r in record_list)
    if len(kinds) > 1:
      mixed.append("Detected variables %s with mixed record types: %s." %
                   (_records.describe(params), record_list))
      continue
    if _register_one(layer_collection, params, record_list, reuse,
                     batch_size):
      registered.update(_refs(ensure_sequence(params)))
  if mixed:
    raise ValueError("\n".join(mixed) + "\nA variable can belong to one kind "
                     "of layer only; register these yourself.")
  return frozenset(registered)


def _folded_uses(params, record, batch_size, max_rank):
  """num_uses if the record's inputs fold uses into the batch dimension
  ([num_uses * batch_size, ...]), else None."""
  inputs = record.data["inputs"]
  rank = inputs.shape.rank
  first = tf.compat.dimension_value(inputs.shape[0]) if rank else None
  if (batch_size is None or first is None or first == batch_size or
      rank is None or rank > max_rank):
    return None
  if first % batch_size:
    raise ValueError(
        "Passed batch_size did not divide first dimension of tensor with "
        "presumed folded batch and use/times dimension: layer %s has inputs "
        "%s (first dimension %d) but batch_size=%d. Pass the batch size per "
        "tower / replica, or register this layer yourself. Inputs and "
        "outputs: %s and %s." % (_records.describe(params), inputs.shape,
                                 first, batch_size, inputs,
                                 record.data["outputs"]))
  _log.warning(
      "Registering %s as a multi-use layer with %d uses folded into the "
      "batch dimension. The series (kron_series_*) approximations need "
      "the rows ordered [use, batch] (time-major) before folding.",
      _records.describe(params), first // batch_size)
  return first // batch_size


def _uses(record_list):
  return (tuple(r.data["inputs"] for r in record_list),
          tuple(r.data["outputs"] for r in record_list))


def _no_multi_use(params, record_list, kind):
  raise ValueError(
      "Multi-use registrations currently not supported for %s layers: %s is "
      "used %d times. Register it yourself (e.g. register_generic) before "
      "auto registration." % (kind, _records.describe(params),
                              len(record_list)))


def _register_one(lc, params, record_list, reuse, batch_size):
  """Registers one layer; True when it was registered."""
  kind = record_list[0].record_type
  first = record_list[0]
  data = first.data
  name = _records.describe(params)
  num_uses = None  # of a single record that folds its uses into the batch
  if len(record_list) == 1 and kind is RecordType.fully_connected:
    num_uses = _folded_uses(params, first, batch_size,
                            2 if data["dense_inputs"] else 1)
  elif len(record_list) == 1 and kind is RecordType.conv2d:
    num_uses = _folded_uses(params, first, batch_size, 4)
  try:
    if kind is RecordType.fully_connected:
      dense = data["dense_inputs"]
      if len(record_list) > 1:
        inputs, outputs = _uses(record_list)
        _log.info("Registering as multi-use fully-connected: %s", name)
        lc.register_fully_connected_multi(params, inputs, outputs,
                                          dense_inputs=dense, reuse=reuse)
        return True
      if num_uses is not None:
        lc.register_fully_connected_multi(
            params, data["inputs"], data["outputs"], num_uses=num_uses,
            dense_inputs=dense, reuse=reuse)
      else:
        _log.info("Registering as fully-connected: %s", name)
        lc.register_fully_connected(params, data["inputs"], data["outputs"],
                                    dense_inputs=dense, reuse=reuse)
      return True

    if kind is RecordType.conv2d:
      conv = dict(data_format=data["data_format"],
                  dilations=data["dilations"], reuse=reuse)
      if len(record_list) > 1:
        inputs, outputs = _uses(record_list)
        _log.info("Registering as multi-use conv2d: %s", name)
        lc.register_conv2d_multi(params, data["strides"], data["padding"],
                                 list(inputs), list(outputs), **conv)
        return True
      if num_uses is not None:
        lc.register_conv2d_multi(params, data["strides"], data["padding"],
                                 data["inputs"], data["outputs"],
                                 num_uses=num_uses, **conv)
      else:
        _log.info("Registering as conv2d: %s", name)
        lc.register_conv2d(params, data["strides"], data["padding"],
                           data["inputs"], data["outputs"], **conv)
      return True

    if kind is RecordType.conv1d:
      if len(record_list) > 1:
        _no_multi_use(params, record_list, "conv1d")
      lc.register_conv1d(params, data["strides"], data["padding"],
                         data["inputs"], data["outputs"],
                         dilations=data["dilations"],
                         data_format=data["data_format"], reuse=reuse)
      return True

    if kind is RecordType.convolution:
      if len(record_list) > 1:
        _no_multi_use(params, record_list, "convolution")
      lc.register_convolution(params, data["inputs"], data["outputs"],
                              data["padding"], strides=data["strides"],
                              dilation_rate=data["dilations"],
                              data_format=data["data_format"], reuse=reuse)
      return True

    if kind is RecordType.depthwise_conv2d:
      if len(record_list) > 1:
        _no_multi_use(params, record_list, "depthwise conv2d")
      lc.register_depthwise_conv2d(params, data["inputs"], data["outputs"],
                                   data["strides"], data["padding"],
                                   rate=data["dilations"],
                                   data_format=data["data_format"],
                                   reuse=reuse)
      return True

    if kind is RecordType.scale_and_shift:
      if len(record_list) > 1:
        _no_multi_use(params, record_list, "scale & shift")
      _log.info("Registering as scale (& shift): %s", name)
      lc.register_scale_and_shift(params, data["inputs"], data["outputs"],
                                  reuse=reuse)
      return True
  except ValueError as e:
    if _is_registered(lc, params):
      raise
    warnings.warn(
        "K-FAC graph search: %s looks like a %s layer but cannot be "
        "registered as one (%s); it is left to the generic fallback." %
        (name, kind.name, e), GraphSearchWarning, stacklevel=4)
    return False

  if kind is RecordType.batch_norm:
    # Registered generically: the fused op does not expose the normalized
    # inputs that a scale-and-shift registration needs.
    if batch_size is None:
      raise AmbiguousRegistrationError(
          "Tried to register the batch norm parameters %s (as generic) "
          "without knowledge of batch_size. Pass batch_size to fix this, "
          "or register them yourself before auto registration." % name)
    _log.info("Registering as generic (batch norm): %s", name)
    linked = lc._linked_approx(params)  # pylint: disable=protected-access
    diagonal = linked == "diagonal" or (
        linked is None and lc.default_generic_approximation == "diagonal")
    if diagonal:
      for var in ensure_sequence(params):
        lc.register_generic(var, batch_size, reuse=reuse)
    else:
      lc.register_generic(params, batch_size, reuse=reuse)
    return True
  raise ValueError("Invalid record type %s." % (kind,))


def _is_registered(lc, params):
  registered = _refs(lc.registered_variables)
  return bool(_refs(ensure_sequence(params)) & registered)


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
