"""Saving the Keras Kfac optimizer: its config (get_config / from_config,
JSON-able) and its variables in `.keras` files (save_own_variables /
load_own_variables: the Keras variables and every K-FAC state variable),
read from the engine (engine.KfacEngine)."""

import numpy as np

from kfac.python.keras import keras_flavor
from kfac.python.keras import layer_registration

STATE_PREFIX = "kfac_state:"


def get_config(engine, name, learning_rate):
  """The Keras Kfac optimizer's config (JSON-able; the arguments that
  rebuild it, with the hyperparameters' current values)."""
  config = {
      "learning_rate": (None if engine.adaptive and not engine.fixed_rate
                        else learning_rate),
      "damping": float(engine.hyper["damping"].numpy()),
      "adaptive": engine.adaptive,
      "loss": serialize_loss(engine.loss),
      "loss_weights": engine.loss_weights,
      "fisher_approx": encode_layer_keys(engine.fisher_approx),
      "seed": engine.seed,
      "name": name,
  }
  kwargs = dict(engine.kwargs)
  for hp, var in engine.hyper.items():
    if hp != "damping":
      kwargs[hp] = float(var.numpy())
  if engine.options:
    kwargs["registration_options"] = encode_layer_keys(engine.options)
  config.update(kwargs)
  return config


def arguments_from_config(config):
  """Kfac's keyword arguments from a config of get_config."""
  config = dict(config)
  config["loss"] = deserialize_loss(config.get("loss"))
  return config


def save_variables(variables, state, store):
  """The Keras variables by index (as Keras does), and every K-FAC state
  variable under "kfac_state:<its key>"."""
  for i, variable in enumerate(variables):
    store[str(i)] = variable.numpy()
  for key, value in state.numpy_state().items():
    store[STATE_PREFIX + encode(key)] = value


def load_variables(variables, state, store, name):
  """Sets what save_variables stored (`name`: the optimizer's, for the
  error)."""
  values, rest = {}, []
  for key in store.keys():
    if key.startswith(STATE_PREFIX):
      values[decode(key[len(STATE_PREFIX):])] = np.asarray(store[key])
    else:
      rest.append(key)
  if len(rest) != len(variables):
    raise ValueError(
        "The saved optimizer has %d Keras variables but Kfac %r has %d: "
        "was it saved with different Kfac arguments?" %
        (len(rest), name, len(variables)))
  for i, variable in enumerate(variables):
    variable.assign(store[str(i)])
  state.restore(values)


def encode_layer_keys(mapping):
  """Layer-class keys as "__class__:Name" strings (JSON-able configs)."""
  return {(layer_registration.CLASS_KEY_PREFIX + k.__name__
           if isinstance(k, type) else k): v for k, v in mapping.items()}


def encode(key):
  return key.replace("|", "||").replace("/", "|")


def decode(key):
  out, i = [], 0
  while i < len(key):
    if key.startswith("||", i):
      out.append("|")
      i += 2
    elif key[i] == "|":
      out.append("/")
      i += 1
    else:
      out.append(key[i])
      i += 1
  return "".join(out)


def serialize_loss(loss):
  if loss is None or isinstance(loss, str):
    return loss
  if isinstance(loss, (list, tuple)):
    return [serialize_loss(l) for l in loss]
  if isinstance(loss, dict):
    return {k: serialize_loss(v) for k, v in loss.items()}
  return keras_flavor.keras_module().losses.serialize(loss)


def deserialize_loss(loss):
  if loss is None or isinstance(loss, str):
    return loss
  if isinstance(loss, list):
    return [deserialize_loss(l) for l in loss]
  if isinstance(loss, dict) and "class_name" not in loss:
    return {k: deserialize_loss(v) for k, v in loss.items()}
  return keras_flavor.keras_module().losses.deserialize(loss)
