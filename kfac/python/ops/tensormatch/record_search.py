"""Finding the layers in the graph: every place a layer pattern
(graph_patterns.py) matches, as `MatchRecord`s grouped by their variables.
"""

from kfac.python.ops.tensormatch import graph_matcher as gm
from kfac.python.ops.tensormatch import graph_patterns as gp
from kfac.python.ops.tensormatch import match_records as _records
from kfac.python.ops.tensormatch import tensorflow_graph_util as graph_util
from kfac.python.ops.tensormatch.match_records import ParamsDict
from kfac.python.ops.tensormatch.match_records import TensorToVariable
from kfac.python.ops.tensormatch.match_records import ensure_sequence

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
  skip = _records.variable_refs(skip_variables)
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
        if _records.variable_refs(ensure_sequence(e.params)) & skip:
          continue  # the user registered this layer
        raise
      if record is None:
        continue
      if record.params not in found:
        found[record.params] = []
      found[record.params].append(record)
  return found
