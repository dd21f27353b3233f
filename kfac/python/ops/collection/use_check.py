"""The registration check of the LayerCollection: the registered variables
are the ones to optimize, and (kfac 0.2.x's use count) each is registered
as many times as the graph of the registered losses uses it.

`UseCount` is the part of a LayerCollection that counts the registered uses
of each variable; `use_problems` and `check_registration` take the counts,
the registered blocks and losses explicitly.
"""

import collections
import math

import tensorflow as tf

from kfac.python.ops.compat_utils.subgraph import SubGraph
from kfac.python.ops.tensors import utils


class UseCount:
  """The registered uses of each variable: `counts` maps var.ref() to a
  number (float("inf") for registrations that cover any number of uses)."""

  def __init__(self):
    self.counts = {}

  def add(self, params, uses):
    """Records `uses` more uses of each variable of `params`."""
    for var in utils.ensure_sequence(params):
      self.counts[utils.hashable_key(var)] = (
          self.counts.get(utils.hashable_key(var), 0) + uses)

  def get(self, var):
    return self.counts.get(utils.hashable_key(var), 0)


def losses_subgraph(losses):
  """The `SubGraph` (kfac.utils.SubGraph) of `losses`' inputs (the ops the
  losses depend on); None without a loss or outside a graph."""
  inputs = []
  for loss in losses:
    inputs.extend(utils.ensure_sequence(loss.inputs))
  if not inputs or not all(hasattr(t, "op") for t in inputs):
    return None
  return SubGraph(inputs)


def use_problems(uses, fisher_blocks, losses, variables):
  """kfac 0.2.x's check that each variable is registered as many times as
  the losses' graph uses it (an RNN cell used at 3 time steps needs 3
  uses: register_fully_connected_multi, or 3 towers); generic
  registrations cover any number. A use is an op of the losses' graph
  that reads the variable (a gather counts as one use however many ops
  consume the rows it gathered). More registered uses than ops are fine
  when every registered output leads to the losses: the uses were folded
  into one op and split after it. Uses in the two branches of one
  conditional count as the larger branch's, since one branch runs (with
  control flow v1, e.g. under disable_v2_behavior, a fused
  BatchNormalization whose learning phase is not set reads its scale in
  both; kfac 0.2.x added a use for that case). Only in TF1 graphs: in a
  tf.function trace (and under several replicas) variables are read
  differently, and graph search registers the uses it finds.

  Args:
    uses: the collection's UseCount.
    fisher_blocks: its blocks by parameters (a LayerParametersDict).
    losses: its registered losses.
    variables: the variables to check.

  Returns:
    A list of problems (strings), empty when the registration fits.
  """
  if not _in_tf1_graph() or tf.distribute.has_strategy():
    return []
  candidates = [v for v in variables if isinstance(v, tf.Variable) and
                not math.isinf(uses.get(v))]
  if not candidates:
    return []
  subgraph = losses_subgraph(losses)
  if subgraph is None:
    return []
  problems = []
  for var in candidates:
    registered = uses.get(var)
    if not registered:
      continue  # reported as not registered
    found = exclusive_uses(subgraph.variable_consumers(var))
    if registered == found:
      continue
    stray = outputs_off_the_losses(fisher_blocks, var, subgraph)
    if registered > found and found and not stray:
      continue  # uses folded into fewer ops, outputs split after them
    problem = ("%s is registered with %d use(s) but the graph of the "
               "registered losses uses it %d time(s)" %
               (utils.variable_name(var), registered, found))
    if stray:
      problem += (", and its registered output(s) %s do not lead to the "
                  "losses" % ", ".join(stray))
    problems.append(
        problem + " (register every use: towers with reuse=True, or "
        "register_*_multi for a layer used several times; or register it "
        "with register_generic)")
  return problems


def outputs_off_the_losses(fisher_blocks, var, subgraph):
  """Names of the registered outputs of var's layer that the registered
  losses do not depend on."""
  key = fisher_blocks.owner_of(var)
  block = None if key is None else fisher_blocks.get(key)
  if block is None or not hasattr(block, "tensors_to_compute_grads"):
    return []
  stray = []
  for tensor in tf.nest.flatten(block.tensors_to_compute_grads()):
    if hasattr(tensor, "op") and not subgraph.is_member(tensor):
      stray.append(tensor.name)
  return stray


def check_registration(uses, fisher_blocks, losses, registered_variables,
                       variables, check_uses=True):
  """LayerCollection.check_registration: raises ValueError unless
  `variables` and `registered_variables` are the same set, naming the ones
  that differ; with check_uses, also unless each variable is registered as
  many times as the losses' graph uses it (use_problems)."""
  wanted = collections.OrderedDict(
      (v.ref(), v) for v in utils.ensure_sequence(variables))
  registered = collections.OrderedDict(
      (v.ref(), v) for v in registered_variables)
  missing = [v for r, v in wanted.items() if r not in registered]
  extra = [v for r, v in registered.items() if r not in wanted]
  problems = []
  if missing:
    problems.append(
        "not registered with the LayerCollection: %s (register their layers, "
        "e.g. register_fully_connected or register_generic)" %
        ", ".join(utils.variable_name(v) for v in missing))
  if extra:
    problems.append(
        "registered but not in the list of variables to optimize: %s" %
        ", ".join(utils.variable_name(v) for v in extra))
  if problems:
    raise ValueError("Variables " + "; ".join(problems) + ".")
  if check_uses:
    problems = use_problems(uses, fisher_blocks, losses,
                            list(wanted.values()))
    if problems:
      raise ValueError("Variable registration does not match the graph: " +
                       "; ".join(problems) + ".")


def _cond_path(op):
  """[(predicate name, branch)] of the control flow v1 conditionals that
  hold `op`, outermost first."""
  path = []
  ctx = op._control_flow_context  # pylint: disable=protected-access
  while ctx is not None:
    pred, branch = getattr(ctx, "pred", None), getattr(ctx, "branch", None)
    if pred is not None and branch is not None:
      path.append((pred.name, branch))
    ctx = ctx.outer_context
  return path[::-1]


def exclusive_uses(ops):
  """How many of `ops` can run in one execution: ops outside
  conditionals count one each; for each conditional, the branch with the
  most uses (recursively for nested ones)."""
  def count(paths):
    total = sum(1 for p in paths if not p)
    by_cond = collections.defaultdict(lambda: collections.defaultdict(list))
    for p in paths:
      if p:
        by_cond[p[0][0]][p[0][1]].append(p[1:])
    for branches in by_cond.values():
      total += max(count(rest) for rest in branches.values())
    return total
  return count([_cond_path(op) for op in ops])


def _in_tf1_graph():
  if tf.executing_eagerly():
    return False
  return not getattr(tf.compat.v1.get_default_graph(), "building_function",
                     False)
