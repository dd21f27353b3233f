"""Registering what graph search found on the LayerCollection: each
group of records becomes one register_* call (multi-use and folded uses
included), and the variables left over become generic registrations."""

import logging
import warnings

import tensorflow as tf

from kfac.python.ops.tensormatch import match_records as _records
from kfac.python.ops.tensormatch import tensorflow_graph_util as graph_util
from kfac.python.ops.tensormatch.match_records import RecordType
from kfac.python.ops.tensormatch.match_records import ensure_sequence
from kfac.python.ops.tensormatch.record_filters import linked_groups
from kfac.python.ops.tensormatch.search_errors import AmbiguousRegistrationError
from kfac.python.ops.tensormatch.search_errors import GraphSearchWarning
from kfac.python.ops.tensors import utils

_log = logging.getLogger("kfac.graph_search")


def _names(variables):
  return ", ".join(utils.variable_name(v) for v in variables)


def _group_text(params):
  params = ensure_sequence(params)
  try:
    return str(frozenset(params))  # TF1 variables are hashable
  except TypeError:
    return "{%s}" % _names(params)


def register_generic_leftovers(layer_collection, leftover, reuse,
                                batch_size):
  groups = linked_groups(layer_collection)
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
      registered.update(_records.variable_refs(ensure_sequence(params)))
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
    linked = lc.linked_approximation(params)
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
  registered = _records.variable_refs(lc.registered_variables)
  return bool(_records.variable_refs(ensure_sequence(params)) & registered)
