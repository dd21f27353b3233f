"""The per-layer / per-output arguments of kfac.keras.utils.get_layer_collection.

`fisher_approx` and `loss_weights` may be given as a dict (keyed by layer /
output name; fisher_approx also by layer class) or as a list (in the order
of the model's layers with trainable weights / of its outputs), and `loss`
as one loss, a list or a dict keyed by output name, as in kfac 0.2.x. These
helpers check them against the model and turn them into dicts, with errors
that name the argument.
"""

from kfac.python.keras import keras_flavor
from kfac.python.keras import registration_keys
from kfac.python.keras.registration_keys import RegistrationError


def layers_depth_first(model):
  """The model's layers, nested models expanded in place (left-to-right,
  depth first): the order a list-form fisher_approx follows."""
  out, stack = [], list(model.layers)[::-1]
  while stack:
    layer = stack.pop()
    if hasattr(layer, "layers") and keras_flavor.is_instance_by_name(
        layer, "Model"):
      stack.extend(list(layer.layers)[::-1])
    else:
      out.append(layer)
  return out


def trainable_layer_names(model):
  """Names of the layers a list-form fisher_approx is matched with: those
  with trainable weights of their own, in depth-first order."""
  return [layer.name for layer in layers_depth_first(model)
          if getattr(layer, "trainable", True) and
          keras_flavor.own_trainable_variables(layer)]


def verified_dict(container, what, names):
  """A {name: value} dict from a dict or a list matched with `names`.

  A dict's string keys must be among `names` (keys naming a layer class,
  "kfac_class_Name" / "__class__:Name", are checked elsewhere); a list
  must have one entry per name. None and {} give {}."""
  if container is None or (isinstance(container, dict) and not container):
    return {}
  if isinstance(container, dict):
    unknown = [k for k in container if isinstance(k, str) and
               registration_keys.class_key_name(k) is None and
               k not in names]
    if unknown:
      raise RegistrationError(
          "There is a %s without a matching layer: %s (the layers are %s)."
          % (what, ", ".join(repr(k) for k in unknown), list(names)))
    return dict(container)
  if isinstance(container, (list, tuple)):
    if len(container) != len(names):
      raise RegistrationError(
          "Number of %s and layers don't match: %d given for %d layers %s." %
          (what, len(container), len(names), list(names)))
    return dict(zip(names, container))
  raise RegistrationError("%s must be a list or dict, got %r." %
                          (what, container))


def fisher_approx_dict(fisher_approx, model):
  """fisher_approx as a dict keyed by layer name / class (None if empty)."""
  if isinstance(fisher_approx, (list, tuple)):
    return verified_dict(fisher_approx, "fisher_approx",
                         trainable_layer_names(model)) or None
  if fisher_approx is not None and not isinstance(fisher_approx, dict):
    raise RegistrationError("fisher_approx must be a list or dict, got %r."
                            % (fisher_approx,))
  return fisher_approx or None


def output_names(model):
  return list(getattr(model, "output_names", None) or [])


def losses_by_output(loss, model):
  """{output layer name: loss} for the model (see module doc); a single
  loss of a single-output model goes to its last layer."""
  names = output_names(model)
  if not loss:
    return {}
  if isinstance(loss, dict) and not ("class_name" in loss and
                                     "config" in loss):
    if set(names) != set(loss):
      raise RegistrationError(
          "Output layer names and loss dict keys don't match: "
          "model.output_names %s, loss dict keys %s." %
          (names, sorted(loss)))
    return dict(loss)
  if isinstance(loss, (list, tuple)):
    if len(names) != len(loss):
      raise RegistrationError(
          "Number of loss dict items doesn't match number of output layers: "
          "model.output_names %s, loss list %s." % (names, list(loss)))
    return dict(zip(names, loss))
  if len(names) > 1:
    raise RegistrationError(
        "More output layers than losses: model.output_names %s, loss %r. "
        "Pass one loss per output (a list or a dict)." % (names, loss))
  # The output's name may not be the last layer's when the model was used
  # as a callable; its single output is the last layer's.
  return {model.layers[-1].name: loss}


def loss_weights_by_output(loss_weights, model):
  return verified_dict(loss_weights, "loss_weights", output_names(model))
