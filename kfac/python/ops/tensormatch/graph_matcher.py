"""A small pattern language for TensorFlow graphs, and its matcher.

Patterns are nested Python tuples (kfac 0.2.x's syntax):

  ('?', name, pred, ...)        an element: any node for which every
                                predicate holds; bound to `name` unless
                                name is None (a name bound twice must be
                                the same node both times)
  ('?:choice', p1, p2, ...)     the first alternative that matches (later
                                ones are tried when a later part fails)
  ('List', p1, p2, ...)         a sequence of exactly these elements
  (p, ('In', p1, ...))          an internal node: p matches the node, the
  (p, ('Out', p1, ...))         'In' patterns its inputs (all of them, in
  (p, ('In', ...), ('Out', ...))  order), the 'Out' patterns its outputs
  ('?:not', p)                  succeeds (binding nothing) when p fails
  ('?:any',)                    anything
  any other value               that value itself (compared with ==)

Inputs and outputs follow tensorflow_graph_util: a tensor's input is its
producing op, an op's inputs are its input tensors (identity ops looked
through). A zero-argument callable inside a pattern stands for its result
(so `MatMul` means `MatMul()`, `Tensor` means `Tensor()`).

Matching is a backtracking search written with Python generators: each
compiled pattern yields every (bindings, consumed) pair under which it
matches a node, lazily. `consumed` collects the nodes a match covered (by
`tensorflow_graph_util.node_key`, so it also works with TF2 tensors,
which are unhashable); graph search compares these sets to prefer the
largest of overlapping matches.

For compatibility with kfac 0.2.x the compiled matchers can also be called
in continuation-passing style, `matcher(data, bindings, consumed, succeed)`:
that returns the first truthy value of `succeed(bindings, consumed)` over
the solutions, or False.
"""

import inspect

from kfac.python.ops.tensormatch import tensorflow_graph_util as util


# ------------------------------------------------------------------ syntax
def is_seq(obj):
  return isinstance(obj, (tuple, list))


def is_nonempty_seq(obj):
  return is_seq(obj) and len(obj) > 0


def is_empty_seq(obj):
  return is_seq(obj) and len(obj) == 0


is_pattern = is_nonempty_seq


def _tagged(pat, tag):
  return is_pattern(pat) and isinstance(pat[0], str) and pat[0] == tag


def is_element_pattern(pat):
  return _tagged(pat, "?")


def element_name(pat):
  return pat[1] if len(pat) > 1 else None


def element_restrictions(pat):
  return tuple(pat[2:])


def is_choice_pattern(pat):
  return _tagged(pat, "?:choice")


def choice_patterns(pat):
  return tuple(pat[1:])


def is_list_pattern(pat):
  return _tagged(pat, "List")


def list_patterns(pat):
  return tuple(pat[1:])


def is_not_pattern(pat):
  return _tagged(pat, "?:not")


def negated_pattern(pat):
  return pat[1]


def is_any_pattern(pat):
  return _tagged(pat, "?:any")


def is_any_noconsume_pattern(pat):
  return _tagged(pat, "?:any_noconsume")


_NEIGHBOR_TAG_ORDERS = (("In",), ("Out",), ("In", "Out"))


def is_internal_node_pattern(pat):
  """(node_pattern, ('In', ...)[, ('Out', ...)]) or (node_pattern,
  ('Out', ...))."""
  if not is_pattern(pat) or len(pat) < 2:
    return False
  if not all(is_pattern(item) for item in pat):
    return False
  tags = []
  for item in pat[1:]:
    if not isinstance(item[0], str):
      return False
    tags.append(item[0])
  return tuple(tags) in _NEIGHBOR_TAG_ORDERS


def internal_node_pattern(pat):
  return pat[0]


def _neighbors(pat, tag):
  for item in pat[1:]:
    if item[0] == tag:
      return ("List",) + tuple(item[1:])
  return ("?:any_noconsume",)


def internal_node_input_pattern(pat):
  return _neighbors(pat, "In")


def internal_node_output_pattern(pat):
  return _neighbors(pat, "Out")


def internal_patterns(pat):
  return [internal_node_pattern(pat), internal_node_input_pattern(pat),
          internal_node_output_pattern(pat)]


# ------------------------------------------------------------ matchers
def _same(a, b):
  """Node identity (== on TF2 tensors is elementwise, so not used)."""
  if a is b:
    return True
  if util.is_tensor(a) or util.is_tensor(b) or util.is_op(a) or util.is_op(b):
    return False
  try:
    return bool(a == b)
  except Exception:  # pylint: disable=broad-except
    return False


def _with(consumed, node):
  try:
    return consumed | {util.node_key(node)}
  except TypeError:  # an unhashable non-node value (e.g. a list)
    return consumed | frozenset(util.node_key(n) for n in node)


class _Matcher(object):
  """A compiled pattern: `solutions(data, bindings, consumed)` yields each
  (bindings, consumed) under which the pattern matches `data`."""

  def __init__(self, solutions, description):
    self.solutions = solutions
    self._description = description

  def __call__(self, data, bindings, consumed, succeed):
    for new_bindings, new_consumed in self.solutions(
        data, bindings, frozenset(consumed)):
      result = succeed(new_bindings, new_consumed)
      if result:
        return result
    return False

  def __repr__(self):
    return "<matcher %s>" % self._description


def match_eqv(pattern):
  """Matches the value `pattern` itself."""

  def solutions(data, bindings, consumed):
    if _same(data, pattern):
      yield bindings, _with(consumed, data)

  return _Matcher(solutions, "eqv(%r)" % (pattern,))


def _any_solutions(data, bindings, consumed):
  yield bindings, _with(consumed, data)


def _any_noconsume_solutions(data, bindings, consumed):  # pylint: disable=unused-argument
  yield bindings, consumed


_ANY = _Matcher(_any_solutions, "any")
_ANY_NOCONSUME = _Matcher(_any_noconsume_solutions, "any_noconsume")


def match_any(data, bindings, consumed, succeed):
  """Matches anything, consuming it."""
  return _ANY(data, bindings, consumed, succeed)


def match_any_noconsume(data, bindings, consumed, succeed):
  """Matches anything without adding it to the consumed nodes."""
  return _ANY_NOCONSUME(data, bindings, consumed, succeed)


def match_element(variable_name, restrictions):
  """Matches a node that satisfies every predicate of `restrictions`,
  binding it to `variable_name` (unless that is None)."""
  restrictions = tuple(restrictions)

  def solutions(data, bindings, consumed):
    for predicate in restrictions:
      if not predicate(data):
        return
    if variable_name:
      if variable_name in bindings:
        if not _same(bindings[variable_name], data):
          return
      else:
        bindings = dict(bindings)
        bindings[variable_name] = data
    yield bindings, _with(consumed, data)

  return _Matcher(solutions, "element(%s)" % (variable_name,))


def match_choice(*match_combinators):
  """Matches what any of the alternatives matches, in order."""

  def solutions(data, bindings, consumed):
    for m in match_combinators:
      for solution in _solutions_of(m, data, bindings, consumed):
        yield solution

  return _Matcher(solutions, "choice/%d" % len(match_combinators))


def match_list(*match_combinators):
  """Matches a sequence element by element (same length)."""

  def from_index(data, i, bindings, consumed):
    if i == len(match_combinators):
      yield bindings, consumed
      return
    for b, c in _solutions_of(match_combinators[i], data[i], bindings,
                              consumed):
      for solution in from_index(data, i + 1, b, c):
        yield solution

  def solutions(data, bindings, consumed):
    if not is_seq(data) or len(data) != len(match_combinators):
      return
    for solution in from_index(data, 0, bindings, consumed):
      yield solution

  return _Matcher(solutions, "list/%d" % len(match_combinators))


def match_not(match_combinator):
  """Succeeds (consuming and binding nothing) when the pattern fails."""

  def solutions(data, bindings, consumed):
    for _ in _solutions_of(match_combinator, data, bindings, frozenset()):
      return
    yield bindings, consumed

  return _Matcher(solutions, "not")


def match_internal(*match_combinators):
  """Matches a graph node and its neighbours: the combinators are for the
  node, the list of its inputs and the list of its outputs."""
  node_m, inputs_m, outputs_m = match_combinators

  def solutions(data, bindings, consumed):
    try:
      inputs = util.expand_inputs(data)
    except ValueError:
      return
    outputs = []  # computed once, when an 'Out' pattern needs them

    def outputs_of_data():
      if outputs_m is _ANY_NOCONSUME:
        return None
      if not outputs:
        outputs.append(util.expand_outputs(data))
      return outputs[0]

    for b1, c1 in _solutions_of(node_m, data, bindings, consumed):
      for b2, c2 in _solutions_of(inputs_m, inputs, b1, c1):
        for solution in _solutions_of(outputs_m, outputs_of_data(), b2, c2):
          yield solution

  return _Matcher(solutions, "internal")


def _solutions_of(combinator, data, bindings, consumed):
  """Solutions of one of our matchers, or of a user's continuation-passing
  combinator (collected by a continuation that never stops it)."""
  if isinstance(combinator, _Matcher):
    return combinator.solutions(data, bindings, consumed)
  found = []

  def collect(b, c):
    found.append((b, frozenset(c)))
    return False

  combinator(data, bindings, consumed, collect)
  return iter(found)


# ------------------------------------------------------------- compiler
class PatternEvaluator(object):
  """Compiles patterns into matchers by the first handler whose predicate
  accepts the pattern (`defhandler(predicate, handler)` adds one); patterns
  no handler accepts go to `default_operation`."""

  def __init__(self, default_operation=None):
    self.default_operation = default_operation
    self.handlers = []

  def defhandler(self, predicate, handler):
    self.handlers.append((predicate, handler))

  def __call__(self, pat):
    for predicate, handler in self.handlers:
      if predicate(pat):
        return handler(pat)
    if self.default_operation is not None:
      return self.default_operation(pat)
    raise ValueError("No handler for pattern %r." % (pat,))


make_combinators = PatternEvaluator(match_eqv)
make_combinators.defhandler(
    is_element_pattern,
    lambda pat: match_element(element_name(pat), element_restrictions(pat)))
make_combinators.defhandler(
    is_list_pattern,
    lambda pat: match_list(*[make_combinators(p) for p in list_patterns(pat)]))
make_combinators.defhandler(
    is_choice_pattern,
    lambda pat: match_choice(
        *[make_combinators(p) for p in choice_patterns(pat)]))
make_combinators.defhandler(
    is_not_pattern,
    lambda pat: match_not(make_combinators(negated_pattern(pat))))
make_combinators.defhandler(is_any_pattern, lambda pat: _ANY)
make_combinators.defhandler(is_any_noconsume_pattern,
                            lambda pat: _ANY_NOCONSUME)
make_combinators.defhandler(
    is_internal_node_pattern,
    lambda pat: match_internal(
        *[make_combinators(p) for p in internal_patterns(pat)]))


def _is_thunk(x):
  if not callable(x) or isinstance(x, (type, _Matcher)):
    return False
  try:
    params = inspect.signature(x).parameters.values()
  except (TypeError, ValueError):
    return False
  return all(p.default is not p.empty or
             p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def expand_thunks(pat):
  """`pat` with every zero-argument callable replaced by its result
  (recursively, inside tuples and lists)."""
  while _is_thunk(pat):
    pat = pat()
  if isinstance(pat, (tuple, list)):
    return type(pat)(expand_thunks(p) for p in pat)
  return pat


# ------------------------------------------------------------ interface
def _compile(pattern):
  return make_combinators(expand_thunks(pattern))


def matcher(pattern):
  """node -> the bindings of the first match (True if it binds nothing),
  or False."""
  compiled = _compile(pattern)

  def match(node):
    for bindings, _ in _solutions_of(compiled, node, {}, frozenset()):
      return bindings or True
    return False

  return match


def all_matcher(pattern):
  """node -> a list of the bindings of every match (True for a match that
  binds nothing); empty if there is none."""
  compiled = _compile(pattern)

  def all_matches(node):
    return [bindings or True
            for bindings, _ in _solutions_of(compiled, node, {}, frozenset())]

  return all_matches


def matcher_with_consumed(pattern):
  """node -> (bindings, consumed) of the first match, or False. `consumed`
  is a frozenset of the matched nodes' keys (`tensorflow_graph_util.
  node_key`: tensors by `.ref()`, ops as they are)."""
  compiled = _compile(pattern)

  def match(node):
    for bindings, consumed in _solutions_of(compiled, node, {}, frozenset()):
      return bindings, consumed
    return False

  return match
