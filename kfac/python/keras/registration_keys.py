"""Which layers a Keras optimizer's `fisher_approx` / `registration_options`
mapping means, and the checks of those mappings (names, classes, options).

Keys are layer names, layer classes, or "__class__:Name" strings (how a
class key is stored in a config; kfac 0.2.x's "kfac_class_Name" is read
too). `registration_options` values are dicts of a convolution's
statistics options (CONV_OPTIONS; a DepthwiseConv2D takes
DEPTHWISE_OPTIONS).
"""

from kfac.python.keras import keras_flavor

CLASS_KEY_PREFIX = "__class__:"
# How kfac 0.2.x stored a layer-class key (kfac.keras.utils
# serialize_fisher_approx); read as well as CLASS_KEY_PREFIX.
OLD_CLASS_KEY_PREFIX = "kfac_class_"
_CLASS_PREFIXES = (CLASS_KEY_PREFIX, OLD_CLASS_KEY_PREFIX)


def class_key_name(key):
  """The class name a "__class__:Name" / "kfac_class_Name" key stands for,
  or None for a layer-name key."""
  for prefix in _CLASS_PREFIXES:
    if isinstance(key, str) and key.startswith(prefix):
      return key[len(prefix):]
  return None


class RegistrationError(ValueError):
  """A layer or loss that kfac.keras cannot register."""


# ---------------------------------------------------------------- fisher_approx
def resolve_fisher_approx(fisher_approx, layer):
  """The approximation `fisher_approx` asks for `layer` (None: default).

  Keys are layer names, layer classes, or "__class__:Name" strings (how a
  class key is stored in a config); a name wins over a class, and a more
  derived class over its bases."""
  if not fisher_approx:
    return None
  if layer.name in fisher_approx:
    return fisher_approx[layer.name]
  for cls in type(layer).__mro__:
    if cls in fisher_approx:
      return fisher_approx[cls]
    for prefix in _CLASS_PREFIXES:
      key = prefix + cls.__name__
      if key in fisher_approx:
        return fisher_approx[key]
  return None


def _check_layer_keys(mapping, model, what, check_value, class_keys=True):
  """Raises unless every key of `mapping` names some layer of `model` and
  every value passes check_value(key, value). With class_keys=False a
  layer-class key need not match a layer (only name keys must)."""
  if not mapping:
    return
  layers = keras_flavor.leaf_layers(model)
  names = {layer.name for layer in layers}
  class_names = set()
  for layer in layers:
    class_names.update(keras_flavor.class_names(layer))
  for key, value in mapping.items():
    check_value(key, value)
    if isinstance(key, type):
      found = key.__name__ in class_names
    elif class_key_name(key) is not None:
      found = class_key_name(key) in class_names
    elif isinstance(key, str):
      found = key in names
    else:
      raise RegistrationError("%s keys must be layer names or layer "
                              "classes, got %r." % (what, key))
    if not found and (class_keys or isinstance(key, str) and
                      class_key_name(key) is None):
      raise RegistrationError(
          "%s key %r matches no layer of model %r (layers: %s)." %
          (what, key, model.name, ", ".join(sorted(names))))


def check_fisher_approx(fisher_approx, model):
  """Raises unless every layer-name key of fisher_approx names some layer of
  model and every value is an approximation name or None. Layer-class keys
  need not match a layer (kfac 0.2.x: one fisher_approx may serve several
  models)."""
  def check(key, value):
    if value is not None and not isinstance(value, str):
      raise RegistrationError("fisher_approx[%r] must be an approximation "
                              "name (a string) or None (the default), got "
                              "%r." % (key, value))
  _check_layer_keys(fisher_approx, model, "fisher_approx", check,
                    class_keys=False)


# Options a convolution registration takes (see conv_registration).
CONV_OPTIONS = ("sub_sample_inputs", "sub_sample_patches", "patch_mask")
# Those a depthwise convolution's (kron) registration takes.
DEPTHWISE_OPTIONS = ("sub_sample_patches",)


def check_registration_options(options, model):
  """Raises unless options maps layers to dicts of CONV_OPTIONS."""
  def check(key, value):
    if not isinstance(value, dict) or any(k not in CONV_OPTIONS
                                          for k in value):
      raise RegistrationError(
          "registration_options[%r] must be a dict with keys among %s, got "
          "%r." % (key, ", ".join(CONV_OPTIONS), value))
  _check_layer_keys(options, model, "registration_options", check)
  if options:
    for layer in keras_flavor.leaf_layers(model):
      check_depthwise_options(
          layer, resolve_fisher_approx(options, layer) or {},
          "DepthwiseConv2D" in keras_flavor.class_names(layer))


def check_depthwise_options(layer, options, is_depthwise):
  """Raises unless a depthwise convolution's options are among
  DEPTHWISE_OPTIONS."""
  if is_depthwise and set(options) - set(DEPTHWISE_OPTIONS):
    raise RegistrationError(
        "registration_options %s for layer %s (%s): a depthwise "
        "convolution takes only %s." %
        (options, keras_flavor.layer_path(layer), type(layer).__name__,
         ", ".join(DEPTHWISE_OPTIONS)))
