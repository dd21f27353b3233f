"""Pieces shared by the LayerCollection and its registration mixins."""

import tensorflow as tf

from kfac.python.ops.tensors import utils


class _VariableScopeSentinel:

  def __repr__(self):
    return "VARIABLE_SCOPE"


# Default of every `reuse` argument: take the reuse flag of the current
# tf.compat.v1 variable scope (False outside any reusing scope).
VARIABLE_SCOPE = _VariableScopeSentinel()

# kfac 0.2.x's VARIABLE_SCOPE was this string; passing it means the same.
_OLD_VARIABLE_SCOPE = "VARIABLE_SCOPE"

AUTO = "auto"


class RegistrationKeyError(KeyError, ValueError):
  """A registration that conflicts with an existing one (a loss name
  registered again without reuse, or reuse of a name never registered).
  kfac 0.2.x raised KeyError here and this version raised ValueError; this
  error is both, so either `except` clause catches it."""

  def __str__(self):  # KeyError would print the message's repr
    return str(self.args[0]) if self.args else ""


def reuse_mode(reuse):
  """True, False or AUTO ("reuse if registered, else register") for a
  `reuse` argument: True / False, VARIABLE_SCOPE (the current variable
  scope's reuse flag, where tf.compat.v1.AUTO_REUSE means AUTO) or
  tf.compat.v1.AUTO_REUSE."""
  if reuse is VARIABLE_SCOPE or (isinstance(reuse, str) and
                                 reuse == _OLD_VARIABLE_SCOPE):
    reuse = tf.compat.v1.get_variable_scope().reuse
    if reuse is True and tf.distribute.has_strategy():
      # A tf.distribute replica thread after the first runs with a reusing
      # variable scope; its registrations are that replica's own.
      reuse = tf.compat.v1.AUTO_REUSE
  if reuse is tf.compat.v1.AUTO_REUSE:
    return AUTO
  if isinstance(reuse, str):
    raise ValueError("reuse must be True, False, tf.compat.v1.AUTO_REUSE or "
                     "layer_collection.VARIABLE_SCOPE, got %r." % (reuse,))
  return bool(reuse)


def resolve_reuse(reuse):
  """Whether `reuse` asks to reuse (AUTO counts as reuse)."""
  return bool(reuse_mode(reuse))


def describe(params):
  """The names of `params` (a variable or a sequence), for error messages."""
  return ", ".join(utils.variable_name(v) for v in utils.ensure_sequence(params))
