"""Unordered variable accesses in a TF1 graph.

A TF1 graph has no automatic control dependencies: two ops run in the
order their data and control edges impose, and in any order where none
does. A read of a variable that neither feeds an assignment of that
variable nor waits for it may see the value from before or after the
assignment, from run to run (the damping calibration's race, fixed in
adaptive/damping_rule.py, was one). `races(fetches)` lists every such pair
among the ops that fetching `fetches` runs:

* an access is a `ReadVariableOp` (read), any other op taking the
  variable's resource handle (an assignment, an `Apply*` op: write), or,
  for reference variables, an op taking the variable's ref tensor;
* ops of the two branches of one control flow v1 conditional never both
  run, and are not compared;
* control flow v2 (`If`, `While`, function calls) is looked into: the
  accesses of a body are compared among themselves (no automatic control
  dependencies there either in a TF1 graph), and the calling op counts as
  a read or a write of each variable its body reads or writes.

A pair is reported once per variable, access op names and kinds, so that a
test can print what to order.
"""

import collections

import tensorflow as tf

# Ops that forward a resource handle or a ref tensor without accessing it.
_FORWARD = ("Identity", "RefIdentity", "Enter", "RefEnter", "Switch",
            "RefSwitch", "Merge", "RefMerge", "Exit", "RefExit",
            "NextIteration", "RefNextIteration", "IdentityN")
_HANDLE_SOURCES = ("VarHandleOp", "VariableV2", "Variable",
                   "_VarHandlesOp")
_READS = ("ReadVariableOp", "VariableShape", "VarIsInitializedOp",
          "ResourceGather", "ResourceGatherNd", "IsVariableInitialized")
_CALLS = ("If", "StatelessIf", "While", "StatelessWhile", "PartitionedCall",
          "StatefulPartitionedCall", "Case", "StatelessCase")

# Ops that may forward their input's buffer rather than copy it: a read of
# a reference variable through them sees the variable's value when their
# consumers run (a TF1 gotcha: tf.identity(ref_variable) taken before an
# in-place assignment shows the assigned value afterwards).
_ALIASING = ("Identity", "IdentityN", "RefIdentity", "Reshape", "ExpandDims",
             "Squeeze", "Switch", "RefSwitch", "Merge", "RefMerge", "Enter",
             "RefEnter", "Exit", "RefExit", "NextIteration", "Bitcast",
             "StridedSlice", "Slice", "Split", "SplitV", "Transpose")
# Resource additions: two of them in either order give the same sum.
_ADDS = ("AssignAddVariableOp", "AssignSubVariableOp")

Race = collections.namedtuple("Race", "variable first first_kind second "
                              "second_kind")


def _is_handle(tensor):
  dtype = tensor.dtype
  return dtype == tf.resource or dtype._is_ref_dtype  # pylint: disable=protected-access


def _ancestors(ops):
  """{op: int bitset of the ops (by position in `ops`) it waits for}; the
  back edges of v1 while loops (NextIteration into Merge) are left out."""
  index = {op: i for i, op in enumerate(ops)}
  preds = {}
  for op in ops:
    ins = [t.op for t in op.inputs] + list(op.control_inputs)
    if op.type in ("Merge", "RefMerge"):
      ins = [p for p in ins if p.type not in ("NextIteration",
                                              "RefNextIteration")]
    preds[op] = [p for p in ins if p in index]
  order, state = [], {}
  for root in ops:
    if root in state:
      continue
    stack = [(root, iter(preds[root]))]
    state[root] = 1
    while stack:
      op, it = stack[-1]
      nxt = next(it, None)
      if nxt is None:
        stack.pop()
        order.append(op)
        continue
      if nxt not in state:
        state[nxt] = 1
        stack.append((nxt, iter(preds[nxt])))
  anc = {}
  for op in order:
    bits = 0
    for p in preds[op]:
      bits |= anc[p] | (1 << index[p])
    anc[op] = bits
  return anc, index


def _closure(fetch_ops):
  seen, stack = set(), list(fetch_ops)
  while stack:
    op = stack.pop()
    if op in seen:
      continue
    seen.add(op)
    stack.extend(t.op for t in op.inputs)
    stack.extend(op.control_inputs)
  return seen


def _exclusive(a, b):
  """True when a and b sit in different branches of one v1 conditional."""
  branches = {}
  ctx = a._get_control_flow_context()  # pylint: disable=protected-access
  while ctx is not None:
    if hasattr(ctx, "pred") and hasattr(ctx, "branch"):
      branches[ctx.pred.name] = ctx.branch
    ctx = ctx.outer_context
  ctx = b._get_control_flow_context()  # pylint: disable=protected-access
  while ctx is not None:
    if hasattr(ctx, "pred") and hasattr(ctx, "branch"):
      if branches.get(ctx.pred.name, ctx.branch) != ctx.branch:
        return True
    ctx = ctx.outer_context
  return False


def _source(tensor, inputs_map):
  """The variable behind a handle or ref tensor: its source op's name, or
  (for a function body's placeholder) what `inputs_map` maps it to."""
  seen = set()
  while True:
    if tensor.ref() in inputs_map:
      return inputs_map[tensor.ref()]
    op = tensor.op
    if op.type in _HANDLE_SOURCES or op in seen:
      return op.name
    seen.add(op)
    if op.type in _FORWARD and op.inputs and _is_handle(tensor):
      idx = tensor.value_index if op.type == "IdentityN" else 0
      tensor = op.inputs[min(idx, len(op.inputs) - 1)]
      continue
    return op.name


def _function_graphs(op):
  """The FuncGraphs an op calls (v2 conditionals, loops, calls)."""
  graphs = []
  for attr in ("then_branch", "else_branch", "body", "cond", "f"):
    try:
      fn = op.get_attr(attr)
    except ValueError:
      continue
    graphs.append(fn.name)
  try:
    for fn in op.get_attr("branches"):
      graphs.append(fn.name)
  except ValueError:
    pass
  out = []
  for name in graphs:
    graph = op.graph
    found = None
    while graph is not None and found is None:
      found = graph._get_function(name)  # pylint: disable=protected-access
      graph = getattr(graph, "outer_graph", None)
    if found is not None and getattr(found, "graph", None) is not None:
      out.append(found.graph)
  return out


def _accesses(ops, inputs_map, races_out):
  """[(op, variable, "read" | "write" | "add", users)] of `ops` (users:
  for a read of a reference variable by an op that forwards its buffer,
  the ops that read that buffer, else None); function bodies are analysed
  on the way (their races appended to races_out)."""
  out = []
  in_set = set(ops)
  for op in ops:
    handles = [(i, t) for i, t in enumerate(op.inputs) if _is_handle(t)]
    if not handles:
      continue
    if op.type in _FORWARD and all(_is_handle(t) for t in op.outputs):
      continue
    if op.type in _CALLS:
      offset = 1 if op.type in ("If", "StatelessIf", "Case",
                                "StatelessCase") else 0
      kinds = {}
      for body in _function_graphs(op):
        body_map = {}
        for i, t in handles:
          if 0 <= i - offset < len(body.inputs):
            body_map[body.inputs[i - offset].ref()] = _source(t, inputs_map)
        for _, var, kind, _ in _body_accesses(body, body_map, races_out):
          if kind != "read":
            kind = "write"
          if kinds.get(var) != "write":
            kinds[var] = kind
      for var, kind in kinds.items():
        out.append((op, var, kind, None))
      continue
    for i, t in handles:
      var = _source(t, inputs_map)
      users = None
      if t.dtype._is_ref_dtype:  # pylint: disable=protected-access
        kind = "write" if _mutates_ref(op, i) else "read"
        if kind == "read" and op.type in _ALIASING:
          users = _users(op, in_set)
          if op.name == var + "/read":
            # The variable's own snapshot (RefVariable.value()): TF1's live
            # read, each of its users reads the variable when it runs.
            out.extend((u, var, "read", None) for u in users)
            continue
        elif kind == "write" and op.type in ("AssignAdd", "AssignSub"):
          kind = "add"
      else:
        kind = "read" if op.type in _READS else "write"
        if op.type in _ADDS:
          kind = "add"
      out.append((op, var, kind, users))
  return out


def _users(op, in_set):
  """The ops that read the buffer an aliasing op forwards: its consumers
  in `in_set`, through further aliasing ops."""
  users, stack, seen = [], [op], set()
  while stack:
    cur = stack.pop()
    for t in cur.outputs:
      for c in t.consumers():
        if c in seen or c not in in_set:
          continue
        seen.add(c)
        if c.type in _ALIASING:
          stack.append(c)
        else:
          users.append(c)
  return users


def _mutates_ref(op, index):
  """Whether op's input `index` is a ref the op writes (Assign*, Apply*,
  Scatter*): its input arg is declared is_ref."""
  pos = 0
  for arg in op.op_def.input_arg:
    n = 1
    if arg.number_attr:
      n = op.get_attr(arg.number_attr)
    elif arg.type_list_attr:
      n = len(op.get_attr(arg.type_list_attr))
    if pos <= index < pos + n:
      return arg.is_ref
    pos += n
  return False


def _body_accesses(graph, inputs_map, races_out):
  ops = graph.get_operations()
  accesses = _accesses(ops, inputs_map, races_out)
  races_out.extend(_pairs(ops, accesses))
  return accesses


def _ordered(anc, index, a, b):
  """a runs before b in every run (b waits for a)."""
  return bool((anc[b] >> index[a]) & 1)


def _pairs(ops, accesses):
  anc, index = _ancestors(list(ops))
  by_var = collections.defaultdict(list)
  for op, var, kind, users in accesses:
    by_var[var].append((op, kind, users))
  found = []
  for var, acc in sorted(by_var.items()):
    writes = [i for i, (_, k, _) in enumerate(acc) if k != "read"]
    for wi in writes:
      w, wkind, _ = acc[wi]
      for xi, (x, kind, users) in enumerate(acc):
        if xi == wi or (kind != "read" and xi < wi):
          continue
        if wkind == "add" and kind == "add":
          continue  # additions commute
        if _exclusive(w, x):
          continue
        if _ordered(anc, index, w, x):
          continue  # x (and whatever reads its buffer) after the write
        if users is not None:
          # The buffer is read when its users run: each must run before
          # the write, or it sees the written value.
          late = [u for u in users if u is not w and
                  not _ordered(anc, index, u, w) and not _exclusive(w, u)]
          if late:
            found.append(Race(var, w.name, wkind, "%s (its buffer read by "
                              "%s)" % (x.name, late[0].name), "aliased read"))
          continue
        if _ordered(anc, index, x, w):
          continue
        found.append(Race(var, w.name, wkind, x.name, kind))
  return found


def races(fetches, graph=None):
  """Unordered (write, read-or-write) pairs of accesses to one variable
  among the ops that running `fetches` in a TF1 Session runs."""
  fetch_ops = []
  for f in tf.nest.flatten(fetches):
    fetch_ops.append(f if isinstance(f, tf.Operation) else f.op)
  graph = graph or fetch_ops[0].graph
  closure = _closure(fetch_ops)
  ops = [op for op in graph.get_operations() if op in closure]
  out = []
  accesses = _accesses(ops, {}, out)
  out.extend(_pairs(ops, accesses))
  return out
