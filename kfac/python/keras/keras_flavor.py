"""Which Keras is in use, and the few places where the two flavours differ.

TensorFlow 2.21 ships Keras 3 (`import keras`) as `tf.keras`; with the
environment variable TF_USE_LEGACY_KERAS=1, `tf.keras` is `tf_keras`
(Keras 2). kfac.keras follows the same switch. Layers are recognised by the
names of the classes in their MRO (so a subclass of Dense is a Dense), which
works for both flavours without importing the other one.
"""

import importlib
import os

import tensorflow as tf


def legacy_keras_active():
  """True when TF_USE_LEGACY_KERAS selects tf_keras, as tf.keras does."""
  return os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true")


def v1_graph_mode():
  """True where tf_keras builds models with its v1 (TF1 graph) engine:
  v2 behaviour disabled, or inside a tf.compat.v1.Graph."""
  return not (tf.executing_eagerly() or
              tf.compat.v1.executing_eagerly_outside_functions())


def keras_module():
  """The `keras` package of the active flavour (`keras` or `tf_keras`)."""
  if legacy_keras_active():
    try:
      return importlib.import_module("tf_keras")
    except ImportError as e:
      raise ImportError(
          "TF_USE_LEGACY_KERAS=1 but tf_keras is not installed: "
          "pip install --no-deps tf-keras==<your TensorFlow version>") from e
  return importlib.import_module("keras")


def class_names(obj):
  """Names of the classes `obj` is an instance of (most derived first)."""
  return [cls.__name__ for cls in type(obj).__mro__]


def is_instance_by_name(obj, name):
  return name in class_names(obj)


def unwrap_variable(var):
  """The tf.Variable behind a Keras 3 variable (tf_keras uses tf.Variables)."""
  if isinstance(var, tf.Variable):
    return var
  value = getattr(var, "value", None)
  if isinstance(value, tf.Variable):
    return value
  # In a Keras 3 autocast scope (mixed precision, inside a layer's call)
  # `value` is the cast tensor; the variable is kept in `_value`.
  value = getattr(var, "_value", None)
  if isinstance(value, tf.Variable):
    return value
  raise TypeError("Expected a tf.Variable or a Keras variable, got %r." %
                  (var,))


def own_trainable_variables(layer):
  """The trainable variables created by `layer` itself (not sublayers)."""
  own = getattr(layer, "_trainable_variables", None)  # Keras 3
  if own is None:
    own = getattr(layer, "_trainable_weights", [])  # tf_keras
  return [v for v in own if getattr(v, "trainable", True)]


def leaf_layers(model):
  """Every layer inside `model`, nested models included, model excluded."""
  return list(model._flatten_layers(include_self=False, recursive=True))  # pylint: disable=protected-access


def layer_path(layer):
  """A readable name of the layer for reports and errors."""
  return getattr(layer, "path", None) or layer.name


def random_state_variables(model):
  """The random states of the random layers inside `model`, as tf.Variables
  without duplicates: a training forward pass draws its dropout masks from
  these states (and advances them), so setting them back replays its
  masks. Keras 3: the seed states of the layers holding a
  `keras.random.SeedGenerator` (Dropout, SpatialDropout, GaussianNoise,
  the dropout of MultiHeadAttention, random augmentations, ...); random
  ops called with seed=None draw from the global seed generator, which is
  not returned. tf_keras: the states of the `tf.random.Generator`s of its
  random layers where they use one (rng_type "stateful", e.g. after
  `tf.keras.backend.experimental.enable_tf_random_generator()`); its
  default dropout uses stateful random ops, which keep no state here."""
  out, seen = [], set()

  def add(var):
    var = unwrap_variable(var)
    if var.ref() not in seen:
      seen.add(var.ref())
      out.append(var)
  for layer in [model] + leaf_layers(model):
    for generator in getattr(layer, "_seed_generators", None) or []:
      add(generator.state)  # Keras 3
    generator = getattr(getattr(layer, "_random_generator", None),
                        "_generator", None)
    if isinstance(generator, tf.random.Generator):  # tf_keras
      add(generator.state)
  return out


def call_context_training():
  """Keras 3: the training mode of the layer call in progress (what a
  model's __call__ resolved from its argument or an enclosing call, also
  for a `call` that has no `training` argument); None elsewhere."""
  if legacy_keras_active():
    return None
  try:
    from keras.src.backend.common import global_state  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  context = global_state.get_global_attribute("current_call_ctx")
  return getattr(context, "training", None)


def state_variables(model):
  """The model's non-trainable variables (BatchNorm moving statistics, the
  seed states of Keras 3 random layers) and its metrics' variables, as
  tf.Variables without duplicates: what a forward pass and a loss
  evaluation may change besides the trainable weights."""
  found = list(model.non_trainable_variables)
  for metric in getattr(model, "metrics", []):
    found.extend(metric.variables)
  out, seen = [], set()
  for var in found:
    var = unwrap_variable(var)
    if var.ref() not in seen:
      seen.add(var.ref())
      out.append(var)
  return out

