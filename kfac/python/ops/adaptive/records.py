"""The values an optimizer keeps readable after each step (learning rate,
momentum, rho, qmodel_change, norms): `Records`, a part of the step
(optimizers/step.py), in the optimizer's StateStore under "records/"."""

import tensorflow as tf

from kfac.python.ops.numerics.inner_products import gram64
from kfac.python.ops.tensors import utils

# Values an optimizer keeps readable after each step, with their initial
# value (NaN: not computed yet).
RECORDS = {
    "learning_rate": 0.0,
    "momentum": 0.0,
    "qmodel_change": float("nan"),
    "rho": float("nan"),
    "grad_norm": float("nan"),
    "precon_grad_norm": float("nan"),
    "update_norm": float("nan"),
}
NORM_RECORDS = ("grad_norm", "precon_grad_norm", "update_norm")


class Records:
  """The records of a step, as float64 state variables."""

  def __init__(self, store, compute_norm_stats=False):
    """store: the optimizer's StateStore; compute_norm_stats: whether each
    step records its norms (grad_norm, precon_grad_norm, update_norm)."""
    self._store = store
    self._compute_norm_stats = compute_norm_stats

  def get(self, name):
    """The variable of the record `name` (one of RECORDS)."""
    return self._store.get_or_create("records/" + name, [], tf.float64,
                                     initial_value=RECORDS[name])

  def ops(self, update):
    """The assignments of the records of `update` (a step's Update)."""
    for name in RECORDS:  # all readable from the first step on
      self.get(name)
    if self._compute_norm_stats:
      deltas = [tf.convert_to_tensor(d) for d, _ in update.deltas]
      inner = gram64([update.grads, [p for p, _ in update.precon], deltas])
      for i, name in enumerate(("grad_norm", "precon_grad_norm",
                                "update_norm")):
        update.records[name] = tf.sqrt(inner[i][i])
    if update.model_change is not None:
      update.records["qmodel_change"] = update.model_change
    return [self.get(name).assign(utils.cast(value, tf.float64))
            for name, value in sorted(update.records.items())]

  def norm_stats(self):
    """{name: float64 tensor} of the norms."""
    return {name: tf.convert_to_tensor(self.get(name))
            for name in NORM_RECORDS}
