"""Saving the Keras Kfac optimizer: its config (get_config / from_config,
JSON-able) and its variables in `.keras` files (save_own_variables /
load_own_variables: the Keras variables and every K-FAC state variable)."""

import numpy as np

from kfac.python.keras import keras_flavor
from kfac.python.keras import layer_registration

STATE_PREFIX = "kfac_state:"


class KfacConfigMixin:
  """Config and saved variables of the Keras Kfac optimizer (a part of
  KfacKerasMixin)."""

  def _kfac_config(self, learning_rate):
    config = {
        "learning_rate": (None if self._kfac_adaptive and
                          not self._kfac_fixed_rate else learning_rate),
        "damping": float(self._kfac_hyper["damping"].numpy()),
        "adaptive": self._kfac_adaptive,
        "loss": serialize_loss(self._kfac_loss),
        "loss_weights": self._kfac_loss_weights,
        "fisher_approx": encode_layer_keys(self._kfac_fisher_approx),
        "seed": self._kfac_seed,
        "name": self.name,
    }
    kwargs = dict(self._kfac_kwargs)
    for name, var in self._kfac_hyper.items():
      if name != "damping":
        kwargs[name] = float(var.numpy())
    if self._kfac_options:
      kwargs["registration_options"] = encode_layer_keys(self._kfac_options)
    config.update(kwargs)
    return config

  # ------------------------------------------------ Keras's saving API
  def get_config(self):
    return self._kfac_config(float(self._kfac_lr_tensor().numpy()))

  @classmethod
  def from_config(cls, config, custom_objects=None):
    del custom_objects
    config = dict(config)
    config["loss"] = deserialize_loss(config.get("loss"))
    return cls(**config)

  def save_own_variables(self, store):
    """The Keras variables by index (as Keras does), and every K-FAC state
    variable under "kfac_state:<its key>"."""
    for i, variable in enumerate(self.variables):
      store[str(i)] = variable.numpy()
    for key, value in self._kfac_state.numpy_state().items():
      store[STATE_PREFIX + encode(key)] = value

  def load_own_variables(self, store):
    values, rest = {}, []
    for key in store.keys():
      if key.startswith(STATE_PREFIX):
        values[decode(key[len(STATE_PREFIX):])] = np.asarray(store[key])
      else:
        rest.append(key)
    if len(rest) != len(self.variables):
      raise ValueError(
          "The saved optimizer has %d Keras variables but Kfac %r has %d: "
          "was it saved with different Kfac arguments?" %
          (len(rest), self.name, len(self.variables)))
    for i, variable in enumerate(self.variables):
      variable.assign(store[str(i)])
    self._kfac_state.restore(values)


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
