"""The automatic recipe: the exact recipe until the step is switched, then
the minibatch recipe, inside one traced step (docs/recipe.md, "The
automatic recipe").

`PeriodicInvCovUpdateKfacOpt(momentum_type="qmodel", adapt_damping=True,
minibatch_phase=MinibatchPhase(...))` builds both update rules into its
step and takes one of them per step with a conditional on a K-FAC state
flag (`RecipeSwitch`; saved with the optimizer's other state, so a resumed
run keeps the recipe it had switched to). Until the flag is set the step is
the exact recipe's (the quadratic model chooses the learning rate and
momentum; statistics, inverses and the damping rule at the optimizer's own
periods); once it is set, the minibatch recipe's: momentum "regular" at the
phase's learning rate and momentum with its norm constraint, statistics
every `cov_update_every` steps, inverses every `invert_every`, the damping
rule every `damping_adaptation_interval` steps with its decay. The switch
is one way: nothing in the step clears the flag.

What sets the flag is the caller's: `kfac.keras.optimizers.Kfac(
recipe="auto")` sets it when the gradient noise scale it measures
(adaptive/noise_scale.py) passes the batch size; a custom loop can run
`optimizer.recipe_switch.activate()` when it likes.

The quadratic model's curvature products are gradients of the model's
outputs; a conditional branch cannot take gradients of tensors built
outside it, so in this recipe the exact branch takes them on a forward pass
of its own: `qmodel_layer_collection` must then be a callable that builds
the model's forward pass on the batch (or part of it) and returns a
LayerCollection with the loss registered on its outputs, and the step calls
it inside the branch. The minibatch steps build no forward pass of it.

The first switched step restarts the minibatch recipe: the damping is set
to the phase's initial damping (and the inverses recomputed with it), the
velocities are taken as zero, and no burn-in step calibrates the damping
after the switch (the minibatch recipe calibrates nothing). The exact
recipe's damping suits its quadratic model's steps, not a fixed rate:
carried over, the GRU's and the autoencoder's runs diverged after the
switch (measured in docs/recipe.md). The velocity variables are shared, but
the momentum restarts. The exact recipe's
velocity is its last update (the change of the parameters, in the step's
direction), the minibatch recipe's the momentum's sum of preconditioned
gradients (the step is -learning_rate times it): carried over, the exact
update's sign turned the minibatch momentum against the gradient
(measured in docs/recipe.md: the GRU's validation accuracy fell from 0.84
to 0.11 at the switch). The flag is 1 from `activate` to the first
switched step's commit, then 2.
"""

import dataclasses
from typing import Optional

import tensorflow as tf

from kfac.python.ops.tensors import utils


@dataclasses.dataclass(frozen=True)
class MinibatchPhase:
  """The minibatch recipe's settings after the switch
  (recipe.minibatch_kwargs names the same values)."""

  learning_rate: float
  """The learning rate of the "regular" momentum (a number > 0)."""
  momentum: float
  """The fixed momentum (a number in [0, 1))."""
  norm_constraint: Optional[float]
  """The bound C of lr^2 <v, F^-1 v> (None: none)."""
  cov_update_every: int
  """Statistics when counter % cov_update_every == 0."""
  invert_every: int
  """Inverses when counter % invert_every == 0."""
  damping_adaptation_interval: int
  """The damping rule when counter % interval == 0."""
  damping_adaptation_decay: float
  """The damping rule's factor per step (raised to the interval)."""
  initial_damping: float
  """The damping the first switched step restarts from (its inverses are
  recomputed with it)."""

  def check(self, owner):
    """Raises a ValueError naming the first bad setting."""
    def number(value):
      return isinstance(value, (int, float)) and not isinstance(value, bool)
    rules = (("learning_rate", self.learning_rate, lambda v: v > 0, "> 0"),
             ("initial_damping", self.initial_damping, lambda v: v > 0,
              "> 0"),
             ("momentum", self.momentum, lambda v: 0 <= v < 1, "in [0, 1)"),
             ("damping_adaptation_decay", self.damping_adaptation_decay,
              lambda v: 0 < v <= 1, "in (0, 1]"))
    for name, value, ok, what in rules:
      if not (number(value) and ok(value)):
        raise ValueError("%s: minibatch_phase.%s must be a number %s, got "
                         "%r." % (owner, name, what, value))
    if self.norm_constraint is not None and not (
        number(self.norm_constraint) and self.norm_constraint > 0):
      raise ValueError("%s: minibatch_phase.norm_constraint must be None or "
                       "a number > 0, got %r." % (owner,
                                                  self.norm_constraint))
    for name in ("cov_update_every", "invert_every",
                 "damping_adaptation_interval"):
      value = getattr(self, name)
      if not (isinstance(value, int) and not isinstance(value, bool) and
              value >= 1):
        raise ValueError("%s: minibatch_phase.%s must be an integer >= 1, "
                         "got %r." % (owner, name, value))


class RecipeSwitch:
  """The flag that takes the step from the exact recipe to the minibatch
  recipe (module docstring), and the values that follow it."""

  KEY = "recipe/minibatch"

  def __init__(self, phase, store):
    """phase: a MinibatchPhase; store: the optimizer's StateStore."""
    self.phase = phase
    self._store = store

  def flag(self):
    """The int64 state variable: 1 once switched."""
    self.switched_at()  # (made with the flag, before any conditional)
    return self._store.get_or_create(self.KEY, [], tf.int64)

  def first_step(self):
    """A boolean tensor: whether no switched step has been committed yet
    (the flag is 1 from `activate` to the first switched step's commit,
    then 2)."""
    return tf.equal(tf.convert_to_tensor(self.flag()),
                    tf.constant(1, tf.int64))

  def committed(self):
    """(flag, its value after a committed step): the assignment that marks
    the first switched step done, made with the step's velocities."""
    flag = self.flag()
    value = tf.convert_to_tensor(flag)
    return flag, tf.where(tf.equal(value, 1), tf.constant(2, tf.int64),
                          value)

  def restart_damping(self, damping):
    """The op that sets `damping` (the adapted damping's variable) to the
    phase's initial damping while no switched step is committed."""
    return utils.cond_op(self.first_step(), lambda: damping.assign(
        tf.cast(self.phase.initial_damping, damping.dtype)))

  def active(self):
    """A boolean tensor: whether the step runs the minibatch recipe."""
    return tf.greater(tf.convert_to_tensor(self.flag()),
                      tf.constant(0, tf.int64))

  def switched_at(self):
    """The int64 state variable: the step (the caller's count) given to
    `activate`, -1 before it."""
    return self._store.get_or_create("recipe/switched_at", [], tf.int64,
                                     initial_value=-1)

  def activate(self, step=None):
    """The op that switches to the minibatch recipe (for good); `step`
    (an integer tensor, optional) is kept in `switched_at`."""
    ops = [self.flag().assign(tf.constant(1, tf.int64), read_value=False)]
    if step is not None:
      ops.append(self.switched_at().assign(tf.cast(step, tf.int64),
                                           read_value=False))
    return tf.group(*ops)

  def pick(self, exact, minibatch, dtype):
    """`exact` before the switch, `minibatch` after it (a `dtype` tensor)."""
    def as_dtype(value):  # (a Python number straight to `dtype`)
      if isinstance(value, (int, float)):
        return tf.constant(value, dtype)
      return tf.cast(value, dtype)
    return tf.where(self.active(), as_dtype(minibatch), as_dtype(exact))
