"""`Update`: what one K-FAC step does, built before any state changes.

`KfacOptimizer._compute_update` (optimizers/update_rule.py, or the
quadratic model in adaptive/quadratic_model.py) fills one in without
touching any state; `commit.Commit` (optimizers/commit.py) then carries it out.
"""

import tensorflow as tf

from kfac.python.ops.optimizers import sparse


def read(value):
  """A hyperparameter's value now: a callable (not a variable) is called
  (a schedule, or a function the user gave)."""
  return value() if callable(value) and not isinstance(
      value, tf.Variable) else value


class Update:
  """The changes of one step (see the module docstring)."""

  def __init__(self):
    self.deltas = []            # (change, variable): variable += change
    # (change, variable) of the decoupled weight decay (weight_decay.py),
    # applied after the damping rule's evaluation; not part of the step
    # the quadratic model and the damping rule see.
    self.decay_deltas = []
    self.velocity_assigns = []  # (velocity variable, new value)
    self.grads = []             # the gradients (dense)
    self.precon = None          # (preconditioned vector, variable)
    self.records = {}           # name -> float64 value to keep readable
    self.model_change = None    # q(delta) for the damping rule, or
    self.model_change_fn = None  # a function building it where it is used
    self.checks = []            # assertions of tensor hyperparameters

  def predicted_change(self):
    """q(delta): the tensor computed with the update, or built now (inside
    the branch of a step that uses it)."""
    if self.model_change is not None:
      return self.model_change
    if self.model_change_fn is None:
      raise ValueError("This update has no predicted change.")
    return self.model_change_fn()

  def decay_inputs(self):
    """The decay's changes, computed from the variables before the step:
    the step's assignments must wait for them."""
    return [d for d, _ in self.decay_deltas]

  def dependencies(self):
    """The tensors of the update (to order state changes after them)."""
    out = [d.values if sparse.is_slices(d) else d for d, _ in self.deltas]
    out.extend(d for d, _ in self.decay_deltas)
    out.extend(self.checks)
    if self.model_change is not None:
      out.append(self.model_change)
    return out
