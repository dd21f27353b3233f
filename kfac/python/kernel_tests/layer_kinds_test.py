"""The tables of layer kinds (collection/layer_kinds.py, keras/layer_registration.py)
agree with the LayerCollection: one thin method per registration function
of a family, with the function's signature and docstring, and a settable
default for each settable kind."""

import inspect

import pytest

from kfac.python.keras import layer_registration as keras_layer_kinds
from kfac.python.ops.collection import layer_kinds
from kfac.python.ops.collection.layer_collection import LayerCollection


def _methods():
  return [(family, name) for family in layer_kinds.FAMILIES.values()
          for name in family.methods]


@pytest.mark.parametrize("family, name", _methods(),
                         ids=lambda x: getattr(x, "name", x))
def test_each_registration_function_is_a_method_with_its_signature(
    family, name):
  module, = [m for m in vars(layer_kinds).values()
             if inspect.ismodule(m) and getattr(m, "FAMILY", None) is family]
  function = getattr(module, name, None)
  assert function is not None, (family.name, name)
  method = getattr(LayerCollection, name)
  method_params = list(inspect.signature(method).parameters.values())[1:]
  function_params = list(inspect.signature(function).parameters.values())[1:]
  assert [(p.name, p.default) for p in method_params] == [
      (p.name, p.default) for p in function_params]
  assert method.__doc__ == function.__doc__


def test_settable_kinds_have_their_default_methods():
  lc = LayerCollection()
  for name, kind in layer_kinds.KINDS.items():
    if not kind.settable:
      continue
    assert getattr(lc, "default_%s_approximation" % name) == kind.default
    other = sorted(set(kind.blocks) - {kind.default})
    if other:
      getattr(lc, "set_default_%s_approximation" % name)(other[0])
      assert getattr(lc, "default_%s_approximation" % name) == other[0]
    with pytest.raises(ValueError, match="Unknown %s approximation" % name):
      getattr(lc, "set_default_%s_approximation" % name)("no such")


def test_keras_kinds_name_a_family():
  for kind in keras_layer_kinds.KINDS.values():
    assert kind.family in layer_kinds.FAMILIES, kind.name
