"""Pieces shared by the LayerCollection and the registration of every layer
family: the `reuse` argument, parameter checks, and the declaration of a
family (`LayerFamily`, its `LayerKind`s: approximation -> block constructor).
"""

import dataclasses
import typing

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


def unique_name(base, used):
  """`base`, or `base_<i>` for the first i > 0 not in `used`; adds the name
  to `used`."""
  name, i = base, 1
  while name in used:
    name = "%s_%d" % (base, i)
    i += 1
  used.add(name)
  return name


def check_params(params):
  """TypeError unless every entry of `params` is a tf.Variable or a tensor."""
  for p in utils.ensure_sequence(params):
    if not (isinstance(p, tf.Variable) or tf.is_tensor(p)):
      raise TypeError("Registered parameters must be tf.Variables (or "
                      "tensors), got %r." % (p,))


def set_block_params(block, params):
  """Gives `block` its parameters where its constructor did not."""
  if block.params is None:
    block._params = params  # pylint: disable=protected-access


@dataclasses.dataclass(frozen=True, eq=False)
class LayerKind:
  """One kind of layer a family registers, declared once.

  name: the kind's key; for a kind whose default the collection can change
    (`settable`) also the `<name>` of LayerCollection's
    set_default_<name>_approximation / default_<name>_approximation.
  label: how error messages name a layer of the kind ("fully connected").
  default: the default approximation (None: another kind's, see the
    family's registration function).
  blocks: approximation name (layers/base/approximations.py) -> the block
    constructor. Its arguments are the family's (the collection first).
  settable: whether the collection's default of this kind can be changed.
  """
  name: str
  label: str
  default: typing.Optional[str]
  blocks: typing.Mapping[str, typing.Callable]
  settable: bool = False

  @property
  def approximations(self):
    return tuple(self.blocks)


@dataclasses.dataclass(frozen=True, eq=False)
class LayerFamily:
  """A layer family's declaration (layers/<family>/registration.py):

  name: the family's package name ("dense", "conv", ...).
  kinds: its LayerKinds.
  params: what a registration takes as `params` (for readers and reports).
  methods: the LayerCollection methods that register it, each a function
    of the family's module taking the collection first (LayerCollection
    defines one thin method per name).
  """
  name: str
  kinds: typing.Tuple[LayerKind, ...]
  params: str
  methods: typing.Tuple[str, ...]
