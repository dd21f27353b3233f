"""Pieces shared by the LayerCollection and its registration mixins."""

import tensorflow as tf

from kfac.python.ops import utils


class _VariableScopeSentinel:

  def __repr__(self):
    return "VARIABLE_SCOPE"


# Default of every `reuse` argument: take the reuse flag of the current
# tf.compat.v1 variable scope (False outside any reusing scope).
VARIABLE_SCOPE = _VariableScopeSentinel()


def resolve_reuse(reuse):
  if reuse is VARIABLE_SCOPE:
    scope_reuse = tf.compat.v1.get_variable_scope().reuse
    return bool(scope_reuse)  # AUTO_REUSE counts as reuse
  return bool(reuse)


def describe(params):
  """The names of `params` (a variable or a sequence), for error messages."""
  return ", ".join(utils.variable_name(v) for v in utils.ensure_sequence(params))
