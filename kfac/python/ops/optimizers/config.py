"""The optimizer's typed configuration: `KfacConfig`, frozen dataclasses
grouped by concern, and `build`, the one place where the constructors'
arguments are checked.

`KfacOptimizer`, `PeriodicInvCovUpdateKfacOpt` and
`AsyncInvCovUpdateKfacOpt` keep their kfac 0.2.x signatures; each turns its
arguments into a `KfacConfig` (`build`, with the same errors, in the same
order, and the same `IgnoredArgumentWarning`s as before) and keeps it as
`optimizer.config`. Everything the step does is read from it.

What is configuration and what is not. A setting is a value that says how
the optimizer works: the groups below. The objects a program hands the
optimizer are not settings and stay arguments of the constructor, kept by
the optimizer (and replaceable per trace through its `set_*` methods):
`layer_collection`, `var_list`, `loss`, `loss_fn`, `train_batch`,
`prev_train_batch`, `qmodel_layer_collection`. A hyperparameter given as a
tensor, a variable or a callable (learning_rate, momentum, damping,
norm_constraint, the weight decays, batch_size) is a setting whose value is
read at every step: its field is typed `Any` and holds that object.

Checks, in the order the constructors run them (so the same bad input gets
the same error):
1. `PeriodicInvCovUpdateKfacOpt`: its periods and the calibration
   (`periods`), and cov_ema_decay's range before it is raised to the power
   cov_update_every;
2. `KfacOptimizer`: tf_replicator (`reject_tf_replicator`); then `build`:
   the momentum type, the schedules and the values the momentum type
   requires or forbids; every number's range (reliability/arguments.py;
   tensors, variables and callables are checked with every step:
   `KfacConfig.step_hyperparameters`); the placement strategy and its keyword
   arguments; the decoupled weight decay; the memory budget; the quadratic
   model's and the damping rule's arguments (with warnings for the ones
   that have no effect).
"""

import dataclasses
import inspect
import types
import typing
from typing import Any, Callable, Mapping, Optional
import warnings

import tensorflow as tf

from kfac.python.ops.adaptive import damping_rule
from kfac.python.ops.adaptive.recipe import switch as switch_lib
from kfac.python.ops.collection import memory as memory_lib
from kfac.python.ops.collection import memory_fallback
from kfac.python.ops.compat_utils import legacy_constants
from kfac.python.ops.estimation import modes as estimation_modes
from kfac.python.ops.estimation import strategies as est_lib
from kfac.python.ops.reliability import arguments
from kfac.python.ops.tensors import utils

MOMENTUM_TYPES = ("regular", "adam", "qmodel", "qmodel_fixedmu")


# The warning of an argument that has no effect (kept at its old path,
# kfac.python.ops.adaptive.mixin, too).
IgnoredArgumentWarning = damping_rule.IgnoredArgumentWarning


# ------------------------------------------------------------------ groups
@dataclasses.dataclass(frozen=True)
class UpdateRuleConfig:
  """How a step turns the preconditioned gradient into a change of the
  variables (optimizers/step.py, adaptive/quadratic_model.py)."""

  momentum_type: str = "adam"
  """"regular", "adam", "qmodel" or "qmodel_fixedmu"."""
  learning_rate: Any = None
  """A number, tensor, variable or callable; None with "qmodel*"."""
  learning_rate_schedule: Optional[Callable[[Any], Any]] = None
  """A callable step counter -> learning rate, in place of learning_rate."""
  momentum: Any = 0.9
  """A number, tensor, variable or callable; None with "qmodel"."""
  momentum_schedule: Optional[Callable[[Any], Any]] = None
  """A callable step counter -> momentum, in place of momentum."""
  norm_constraint: Any = None
  """The bound C of lr^2 <v, F^-1 v> (None: none; not with "qmodel*")."""
  use_weight_decay: bool = False
  """kfac 0.2.x's weight decay: weight_decay_coeff * w added to the step."""
  weight_decay_coeff: Any = 0.1
  """The coefficient of use_weight_decay."""
  decoupled_weight_decay: Any = None
  """AdamW's weight decay, w -= lr * wd * w apart from the step (None: none)."""
  decoupled_weight_decay_mask: Optional[Callable[[Any], bool]] = None
  """A callable variable -> bool choosing the decayed variables (None: all)."""
  qmodel_update_rescale: Optional[float] = None
  """A factor of both coefficients the quadratic model chose (None: 1)."""
  qmodel_momentum_bound: Optional[float] = None
  """With "qmodel": the chosen momentum lies in [-bound, bound], the
  learning rate then the model's best for it (None: unbounded, kfac
  0.2.x's solve)."""
  include_damping_in_qmodel_change: bool = False
  """Whether the predicted change includes the damping term (resolved)."""
  compute_norm_stats: bool = False
  """Whether each step records the norms of its gradient, preconditioned
  vector and update (optimizer.norm_stats)."""

  @property
  def qmodel(self):
    """Whether the quadratic model chooses the learning rate."""
    return self.momentum_type.startswith("qmodel")


@dataclasses.dataclass(frozen=True)
class DampingConfig:
  """The damping, its Levenberg-Marquardt rule and its calibration
  (adaptive/quadratic_model.py, adaptive/damping_rule.py)."""

  damping: Any = None
  """The damping: a number, tensor, variable or callable; with the rule or
  the calibration, the initial value (a float kept by K-FAC) or the user's
  scalar variable adapted in place."""
  damping_schedule: Optional[Callable[[Any], Any]] = None
  """A callable step counter -> damping, in place of damping."""
  kfac_owns_damping: bool = False
  """Whether the adapted damping is K-FAC's state (damping is its initial
  value), not the user's variable."""
  adapt_damping: bool = False
  """Whether the Levenberg-Marquardt rule adapts the damping."""
  calibrate_damping: bool = False
  """Whether burn-in steps calibrate the damping (periodic optimizer)."""
  num_calibration_steps: int = 0
  """The burn-in steps (the last ones) that calibrate the damping."""
  update_damping_immediately: bool = True
  """Whether the rule evaluates the loss after the update in the same step
  (else at the start of the next one, on prev_train_batch)."""
  damping_adaptation_decay: float = 0.95
  """The rule's factor of the damping per adaptation interval."""
  damping_adaptation_interval: int = 5
  """How many steps apart the rule runs."""
  damping_decrease_rho_threshold: float = 0.75
  """Above this reduction ratio the damping decreases."""
  damping_increase_rho_threshold: float = 0.25
  """Below this reduction ratio the damping increases."""
  min_damping: float = 1e-8
  """The adapted damping's floor."""
  relative_min_damping: Optional[float] = None
  """A floor relative to the curvature's scale (None: none)."""
  l2_reg: float = 0.0
  """Added to the preconditioner's damping and to the quadratic model."""
  precon_damping_mult: float = 1.0
  """The preconditioner's damping is damping * this (+ l2_reg)."""
  use_passed_loss: bool = True
  """Whether the loss before the update is the passed loss (else
  loss_fn(train_batch))."""
  always_use_exact_qmodel_for_damping_adjustment: bool = False
  """Whether the rule's predicted change uses the exact curvature."""
  print_logs: bool = False
  """Whether the rule prints rho and the damping when it runs."""

  @property
  def uses_model(self):
    """Whether the steps need the predicted change of the loss."""
    return self.adapt_damping or self.calibrate_damping


@dataclasses.dataclass(frozen=True)
class Periods:
  """When the step itself updates the statistics and the inverses
  (optimizers/kfac_optimizer.py's optimizer)."""

  invert_every: int = 10
  """The inverses are recomputed when counter % invert_every == 0."""
  cov_update_every: int = 1
  """The statistics' moving averages are updated when counter %
  cov_update_every == 0."""
  num_burnin_steps: int = 0
  """The first calls only gather statistics (an arithmetic mean)."""


@dataclasses.dataclass(frozen=True)
class CurvatureConfig:
  """The curvature's estimation (estimation/) and when the step updates it."""

  cov_ema_decay: float = 0.95
  """The statistics' moving average decay."""
  estimation_mode: str = "gradients"
  """How registered losses become gradient sources (estimation/modes.py)."""
  colocate_gradients_with_ops: bool = True
  """kfac 0.2.x's option of the statistics' gradients."""
  batch_size: Any = None
  """The batch size (None: the first loss's rows); a number or tensor."""
  compute_params_stats: bool = False
  """Whether the estimator keeps statistics of the parameters."""
  periods: Optional[Periods] = None
  """None: the step updates neither statistics nor inverses (KfacOptimizer:
  the program runs the estimator's ops); else when it does."""


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
  """Where the work runs: devices, replicas, memory."""

  placement_strategy: Optional[str] = None
  """The estimator's placement strategy (estimation/strategies.py)."""
  placement_kwargs: Mapping[str, Any] = dataclasses.field(
      default_factory=lambda: types.MappingProxyType({}))
  """The strategy's keyword arguments (cov_devices, ...)."""
  lazy_statistics_sync: bool = False
  """Under several replicas, reduce the statistics at inversion steps only."""
  memory_budget: Optional[float] = None
  """The most bytes K-FAC's state may take (None: no check; resolved)."""
  over_budget: str = "raise"
  """"raise" or "fallback" (collection/memory_fallback.py)."""
  is_chief: bool = True
  """Whether this worker adapts or calibrates the damping."""


@dataclasses.dataclass(frozen=True)
class GuardConfig:
  """The non-finite guard (reliability/nonfinite.py)."""

  skip_non_finite_steps: bool = True
  """Whether a step with a non-finite loss, gradient or update is skipped."""
  max_consecutive_skipped_steps: int = 10
  """Skipped steps in a row that raise an error."""


@dataclasses.dataclass(frozen=True)
class KfacConfig:
  """Every setting of a K-FAC optimizer (module docstring)."""

  name: str = "KFAC"
  """The optimizer's name (its variables' scope)."""
  dtype: tf.DType = tf.float32
  """The dtype of the values the optimizer reports."""
  update: UpdateRuleConfig = UpdateRuleConfig()
  """The update rule."""
  damping: DampingConfig = DampingConfig()
  """The damping and its rule."""
  curvature: CurvatureConfig = CurvatureConfig()
  """The curvature's estimation and its periods."""
  placement: PlacementConfig = PlacementConfig()
  """Devices, replicas and memory."""
  guard: GuardConfig = GuardConfig()
  """The non-finite guard."""
  minibatch_phase: Any = None
  """The minibatch recipe the step switches to at run time (an
  adaptive/recipe/switch.MinibatchPhase; None: no switch)."""

  def step_hyperparameters(self, learning_rate, damping, momentum):
    """[(name, value, rule)] of the hyperparameters checked with every step
    when they are tensors, variables or callables (numbers are checked by
    `build`), given the values that stand for learning_rate, damping and
    momentum (their schedules' readers where given). The damping rule keeps
    the damping >= min_damping: with a positive floor the damping may start
    at 0."""
    floor = self.damping.min_damping
    adaptive_floor = (self.damping.adapt_damping and
                      arguments.is_number(floor) and floor > 0)
    return [
        ("learning_rate", learning_rate, arguments.NON_NEGATIVE),
        ("damping", damping,
         arguments.NON_NEGATIVE if adaptive_floor else arguments.POSITIVE),
        ("momentum", momentum, arguments.MOMENTUM),
        ("weight_decay_coeff", self.update.weight_decay_coeff,
         arguments.NON_NEGATIVE),
        ("norm_constraint", self.update.norm_constraint, arguments.POSITIVE),
        ("decoupled_weight_decay", self.update.decoupled_weight_decay,
         arguments.NON_NEGATIVE),
    ]


# ------------------------------------------------------------------ checks
def reject_tf_replicator(tf_replicator):
  """Raises ValueError unless `tf_replicator` is None."""
  if tf_replicator is not None:
    raise ValueError(
        "tf_replicator=%r: TF-Replicator is not supported by this version "
        "of kfac (it no longer exists). Run the step under a "
        "tf.distribute strategy instead (e.g. MirroredStrategy or "
        "TPUStrategy, see docs/distributed.md); K-FAC then reduces its "
        "statistics across replicas itself." % (tf_replicator,))


class PeriodicArguments(typing.NamedTuple):
  """What `periods` returns: the periods and the calibration's steps."""
  periods: Periods
  calibrate_damping: bool
  num_calibration_steps: int
  minibatch_phase: Any = None


def periods(invert_every, cov_update_every, num_burnin_steps,
            calibrate_damping, num_calibration_steps, minibatch_phase=None):
  """PeriodicInvCovUpdateKfacOpt's own arguments, checked."""
  if minibatch_phase is not None:
    if not isinstance(minibatch_phase, switch_lib.MinibatchPhase):
      raise ValueError(
          "minibatch_phase must be a kfac recipe.MinibatchPhase (or None), "
          "got %r." % (minibatch_phase,))
    minibatch_phase.check("PeriodicInvCovUpdateKfacOpt")
  for arg, value, low in (("invert_every", invert_every, 1),
                          ("cov_update_every", cov_update_every, 1),
                          ("num_burnin_steps", num_burnin_steps, 0)):
    if int(value) != value or value < low:
      raise ValueError("%s must be an integer >= %d, got %r." %
                       (arg, low, value))
  burnin = int(num_burnin_steps)
  if calibrate_damping and not burnin:
    raise ValueError(
        "calibrate_damping=True calibrates the damping during the burn-in "
        "steps: pass num_burnin_steps > 0 (e.g. 10).")
  if not calibrate_damping:
    if num_calibration_steps is not None:
      raise ValueError("num_calibration_steps=%r is for calibrate_damping="
                       "True." % (num_calibration_steps,))
    num_calibration_steps = 0
  elif num_calibration_steps is None:
    num_calibration_steps = burnin
  elif (int(num_calibration_steps) != num_calibration_steps or
        not 1 <= num_calibration_steps <= burnin):
    raise ValueError(
        "num_calibration_steps must be an integer from 1 to "
        "num_burnin_steps (%d), got %r." % (burnin, num_calibration_steps))
  return PeriodicArguments(
      Periods(int(invert_every), int(cov_update_every), burnin),
      bool(calibrate_damping), int(num_calibration_steps), minibatch_phase)


def periodic_cov_ema_decay(owner, cov_ema_decay, cov_update_every):
  """kfac 0.2.x raised a cov_ema_decay passed explicitly to the power
  cov_update_every (None stays None: the default is used as it is)."""
  if cov_ema_decay is None:
    return None
  decay = arguments.check(owner, "cov_ema_decay", cov_ema_decay,
                          arguments.UNIT_INTERVAL)
  return decay**cov_update_every


def _schedule(name, value, schedule):
  """Checks a (value, schedule) pair; returns what stands for the value in
  the checks that follow (the schedule when given)."""
  if schedule is None:
    return value
  if not callable(schedule):
    raise ValueError("%s_schedule must be a callable of the step, got %r."
                     % (name, schedule))
  if value is not None:
    raise ValueError("Pass either %s or %s_schedule, not both (got %s=%r)."
                     % (name, name, name, value))
  return schedule


def _check_required(momentum_type, learning_rate, momentum, damping):
  """The quadratic model chooses the learning rate ('qmodel',
  'qmodel_fixedmu') and the momentum ('qmodel'); the other values are
  required."""
  if momentum_type == "qmodel":
    for arg, value in (("learning_rate", learning_rate),
                       ("momentum", momentum)):
      if value is not None:
        raise ValueError(
            "momentum_type='qmodel' chooses the %s from the quadratic model "
            "at every step: pass %s=None (got %r)." % (arg, arg, value))
  elif momentum_type == "qmodel_fixedmu":
    if learning_rate is not None:
      raise ValueError(
          "momentum_type='qmodel_fixedmu' chooses the learning rate from the "
          "quadratic model (the momentum is fixed): pass learning_rate=None "
          "(got %r)." % (learning_rate,))
  elif learning_rate is None:
    raise ValueError("learning_rate is required with momentum_type=%r." %
                     momentum_type)
  if momentum is None and momentum_type != "qmodel":
    raise ValueError("momentum is required with momentum_type=%r." %
                     momentum_type)
  if damping is None:
    raise ValueError("damping is required.")


def _check_dtype(owner, dtype):
  try:
    tf.as_dtype(dtype)
  except TypeError:
    raise ValueError("%s: dtype must be a floating-point dtype, got %r." %
                     (owner, dtype)) from None
  if not tf.as_dtype(dtype).is_floating:
    raise ValueError("%s: dtype must be a floating-point dtype, got %r." %
                     (owner, dtype))


def check_placement(placement_strategy, placement_kwargs):
  """Unknown strategies fail here, not at the first step; so do keyword
  arguments the strategy's estimator does not take (TypeError)."""
  est_class = est_lib.estimator_class(placement_strategy)
  if not placement_kwargs:
    return
  accepted = set()
  for cls in est_class.__mro__:
    init = cls.__dict__.get("__init__")
    if init is not None:
      accepted.update(inspect.signature(init).parameters)
  unknown = sorted(set(placement_kwargs) - accepted)
  if unknown:
    raise TypeError("KfacOptimizer got unexpected keyword arguments %s ("
                    "placement "
                    "arguments: cov_devices, inv_devices, trans_devices for "
                    "the round-robin placement, distribute_transformations "
                    "for replica_round_robin)." % ", ".join(unknown))


def _check_decoupled_weight_decay(owner, decoupled_weight_decay, mask,
                                  use_weight_decay):
  """Raises ValueError for a combination that cannot work (the value's
  range is checked with the other hyperparameters)."""
  if decoupled_weight_decay is None:
    if mask is not None:
      raise ValueError("%s: decoupled_weight_decay_mask needs "
                       "decoupled_weight_decay." % owner)
    return
  if use_weight_decay:
    raise ValueError(
        "%s: decoupled_weight_decay (AdamW's weight decay) and "
        "use_weight_decay=True (kfac 0.2.x's, weight_decay_coeff) both decay "
        "the weights: choose one." % owner)
  if mask is not None and not callable(mask):
    raise ValueError("%s: decoupled_weight_decay_mask must be a callable "
                     "variable -> bool, got %r." % (owner, mask))


# The hyperparameters that must be Python numbers (or None).
_NUMBERS = (
    ("cov_ema_decay", arguments.UNIT_INTERVAL),
    ("l2_reg", arguments.NON_NEGATIVE),
    ("min_damping", arguments.NON_NEGATIVE),
    ("relative_min_damping", arguments.NON_NEGATIVE),
    ("precon_damping_mult", arguments.POSITIVE),
    ("qmodel_update_rescale", arguments.POSITIVE),
    ("qmodel_momentum_bound", arguments.POSITIVE),
)

# Arguments that only matter with adapt_damping (or calibrate_damping) and
# their defaults.
_DAMPING_RULE_DEFAULTS = (
    ("damping_adaptation_decay", 0.95),
    ("damping_adaptation_interval", 5),
    ("update_damping_immediately", True),
)
_DAMPING_TARGET_DEFAULTS = (
    ("damping_decrease_rho_threshold", 0.75),
    ("damping_increase_rho_threshold", 0.25),
    ("min_damping", 1e-8),
    ("relative_min_damping", None),
    ("use_passed_loss", True),
    ("always_use_exact_qmodel_for_damping_adjustment", False),
)


def _initial_damping(damping, what, floor=0.0):
  """The damping the rule starts from: the user's scalar variable, or a
  positive float K-FAC keeps (0 becomes the floor); (value, owned)."""
  if isinstance(damping, tf.Variable):
    if not damping.dtype.is_floating or damping.shape.rank != 0:
      raise ValueError("%s with a damping variable needs a floating-point "
                       "scalar, got %s %s." %
                       (what, damping.dtype.name, damping.shape))
    return damping, False
  if utils.is_python_number(damping) and damping == 0 and floor > 0:
    damping = floor  # the rule keeps the damping >= min_damping
  if not utils.is_python_number(damping) or damping <= 0:
    raise ValueError(
        "%s needs the initial damping as a positive Python number (or a "
        "scalar tf.Variable to adapt in place), got %r." % (what, damping))
  return float(damping), True


def build(owner, *, learning_rate, damping, cov_ema_decay, momentum,
          momentum_type, use_weight_decay, weight_decay_coeff,
          qmodel_update_rescale, norm_constraint, name, estimation_mode,
          colocate_gradients_with_ops, batch_size, placement_strategy,
          compute_params_stats, adapt_damping, update_damping_immediately,
          is_chief, min_damping, l2_reg, damping_adaptation_decay,
          damping_adaptation_interval, damping_decrease_rho_threshold,
          damping_increase_rho_threshold, precon_damping_mult,
          use_passed_loss, print_logs, dtype, learning_rate_schedule,
          momentum_schedule, damping_schedule, compute_norm_stats,
          always_use_exact_qmodel_for_damping_adjustment,
          lazy_statistics_sync, skip_non_finite_steps,
          max_consecutive_skipped_steps, relative_min_damping,
          include_damping_in_qmodel_change, decoupled_weight_decay,
          decoupled_weight_decay_mask, memory_budget, over_budget,
          placement_kwargs, qmodel_momentum_bound=None, periodic=None,
          loss=None, loss_fn=None, train_batch=None, prev_train_batch=None,
          stacklevel=1):
  """The `KfacConfig` of KfacOptimizer's arguments (module docstring);
  `periodic`: PeriodicArguments, or None. The objects loss, loss_fn,
  train_batch and prev_train_batch are only checked (against the damping
  rule's needs). `stacklevel`: the warnings' stacklevel counted from the
  caller of `build`."""
  stacklevel += 1
  calibrate = periodic is not None and periodic.calibrate_damping
  # The momentum type, the schedules, the required values.
  if momentum_type not in MOMENTUM_TYPES:
    raise ValueError("Unknown momentum_type %r; expected one of %s." %
                     (momentum_type, ", ".join(MOMENTUM_TYPES)))
  lr_value = _schedule("learning_rate", learning_rate, learning_rate_schedule)
  momentum_value = _schedule("momentum", momentum, momentum_schedule)
  damping_value = _schedule("damping", damping, damping_schedule)
  _check_required(momentum_type, lr_value, momentum_value, damping_value)
  switch = None if periodic is None else periodic.minibatch_phase
  if switch is not None and not (momentum_type.startswith("qmodel") and
                                 adapt_damping):
    raise ValueError(
        "%s(minibatch_phase=...) switches from the exact recipe (the "
        "quadratic model, momentum_type 'qmodel' / 'qmodel_fixedmu', with "
        "adapt_damping=True) to the minibatch recipe; got momentum_type=%r, "
        "adapt_damping=%r." % (owner, momentum_type, adapt_damping))
  update = UpdateRuleConfig(
      momentum_type=momentum_type, learning_rate=learning_rate,
      learning_rate_schedule=learning_rate_schedule, momentum=momentum,
      momentum_schedule=momentum_schedule, norm_constraint=norm_constraint,
      use_weight_decay=use_weight_decay,
      weight_decay_coeff=weight_decay_coeff,
      decoupled_weight_decay=decoupled_weight_decay,
      decoupled_weight_decay_mask=decoupled_weight_decay_mask,
      qmodel_update_rescale=qmodel_update_rescale,
      qmodel_momentum_bound=qmodel_momentum_bound,
      compute_norm_stats=compute_norm_stats)
  rule = DampingConfig(
      damping=damping, damping_schedule=damping_schedule,
      adapt_damping=adapt_damping, min_damping=min_damping)
  # Every number's range; the step hyperparameters when they are numbers.
  for arg, value, value_rule in KfacConfig(
      update=update, damping=rule).step_hyperparameters(
          lr_value, damping_value, momentum_value):
    arguments.check(owner, arg, value, value_rule, allow_none=True)
  numbers = dict(cov_ema_decay=cov_ema_decay, l2_reg=l2_reg,
                 min_damping=min_damping,
                 relative_min_damping=relative_min_damping,
                 precon_damping_mult=precon_damping_mult,
                 qmodel_update_rescale=qmodel_update_rescale,
                 qmodel_momentum_bound=qmodel_momentum_bound)
  for arg, value_rule in _NUMBERS:
    value = numbers[arg]
    if not arguments.is_number(value) and value is not None:
      raise ValueError("%s: %s must be a number, got %r." %
                       (owner, arg, value))
    arguments.check(owner, arg, value, value_rule, allow_none=True)
  if not utils.is_tensor_or_variable(batch_size):
    arguments.check_count(owner, "batch_size", batch_size, 1,
                          allow_none=True)
  arguments.check_count(owner, "damping_adaptation_interval",
                        damping_adaptation_interval, 1)
  estimation_modes.check_mode(estimation_mode)
  _check_dtype(owner, dtype)
  check_placement(placement_strategy, placement_kwargs)
  _check_decoupled_weight_decay(owner, decoupled_weight_decay,
                                decoupled_weight_decay_mask, use_weight_decay)
  placement = PlacementConfig(
      placement_strategy=placement_strategy,
      placement_kwargs=types.MappingProxyType(dict(placement_kwargs)),
      lazy_statistics_sync=lazy_statistics_sync,
      memory_budget=memory_lib.resolve_budget(owner, memory_budget),
      over_budget=memory_fallback.check_over_budget(owner, over_budget),
      is_chief=is_chief)
  # The quadratic model's and the damping rule's arguments.
  qmodel = momentum_type.startswith("qmodel")
  if qmodel_update_rescale is not None and not qmodel:
    raise ValueError("qmodel_update_rescale applies to the momentum types "
                     "'qmodel' / 'qmodel_fixedmu' only (momentum_type=%r)."
                     % momentum_type)
  if qmodel_momentum_bound is not None and momentum_type != "qmodel":
    raise ValueError("qmodel_momentum_bound bounds the momentum the "
                     "quadratic model chooses: it applies to "
                     "momentum_type='qmodel' only (momentum_type=%r)."
                     % momentum_type)
  if qmodel and use_weight_decay:
    raise ValueError(
        "use_weight_decay cannot be combined with momentum_type=%r: the "
        "quadratic model has no learning rate for the decay term. Add the "
        "l2 term to the loss and pass l2_reg instead." % momentum_type)
  if qmodel and norm_constraint is not None:
    raise ValueError(
        "norm_constraint cannot be combined with momentum_type=%r: the "
        "quadratic model already chooses the size of the update."
        % momentum_type)
  if l2_reg < 0 or precon_damping_mult <= 0:
    raise ValueError("l2_reg must be >= 0 and precon_damping_mult > 0, got "
                     "%r and %r." % (l2_reg, precon_damping_mult))
  given = dict(
      damping_adaptation_decay=damping_adaptation_decay,
      damping_adaptation_interval=damping_adaptation_interval,
      update_damping_immediately=update_damping_immediately,
      damping_decrease_rho_threshold=damping_decrease_rho_threshold,
      damping_increase_rho_threshold=damping_increase_rho_threshold,
      min_damping=min_damping, relative_min_damping=relative_min_damping,
      use_passed_loss=use_passed_loss,
      always_use_exact_qmodel_for_damping_adjustment=(
          always_use_exact_qmodel_for_damping_adjustment))
  unused = (() if adapt_damping else _DAMPING_RULE_DEFAULTS) + (
      () if adapt_damping or calibrate else _DAMPING_TARGET_DEFAULTS)
  for arg, default in unused:
    if given[arg] != default:
      # kfac 0.2.x accepted these silently (its examples pass them
      # whatever adapt_damping is): a warning, not an error.
      warnings.warn("%s=%r only matters with adapt_damping=True%s; it is "
                    "ignored (pass that too, or leave %s at %r)." %
                    (arg, given[arg], "" if arg in dict(
                        _DAMPING_RULE_DEFAULTS) else
                     " or calibrate_damping=True", arg, default),
                    IgnoredArgumentWarning, stacklevel=stacklevel)
  owns_damping = False
  if adapt_damping or calibrate:
    what = "adapt_damping=True" if adapt_damping else (
        "calibrate_damping=True")
    damping_rule.check_arguments(
        damping_adaptation_decay, damping_adaptation_interval,
        damping_increase_rho_threshold, damping_decrease_rho_threshold,
        min_damping)
    if damping_schedule is not None:
      raise ValueError("damping_schedule and %s both set the damping: "
                       "choose one." % what)
    if loss_fn is None:
      raise ValueError(
          "%s needs loss_fn=..., a function of a batch that returns the "
          "loss, to evaluate the loss after the update." % what)
    damping, owns_damping = _initial_damping(damping, what, min_damping)
  else:
    for arg, value in (("loss", loss), ("loss_fn", loss_fn),
                       ("train_batch", train_batch),
                       ("prev_train_batch", prev_train_batch)):
      if value is not None:  # kfac 0.2.x accepted them silently
        warnings.warn(
            "%s=... is used by the damping adaptation only and is ignored "
            "here: pass adapt_damping=True (or calibrate_damping=True to "
            "PeriodicInvCovUpdateKfacOpt), or drop it." % arg,
            IgnoredArgumentWarning, stacklevel=stacklevel)
  include = include_damping_in_qmodel_change
  if include is None:
    include = legacy_constants.optimizer_defaults()[
        "include_damping_in_qmodel_change"]
  if not isinstance(include, bool):
    raise ValueError("include_damping_in_qmodel_change must be a bool or "
                     "None, got %r." % (include,))
  return KfacConfig(
      name=name,
      dtype=tf.as_dtype(dtype),
      update=dataclasses.replace(update,
                                 include_damping_in_qmodel_change=include),
      damping=DampingConfig(
          damping=damping, damping_schedule=damping_schedule,
          kfac_owns_damping=owns_damping, adapt_damping=bool(adapt_damping),
          calibrate_damping=calibrate,
          num_calibration_steps=(periodic.num_calibration_steps
                                 if periodic is not None else 0),
          update_damping_immediately=update_damping_immediately,
          damping_adaptation_decay=damping_adaptation_decay,
          damping_adaptation_interval=int(damping_adaptation_interval),
          damping_decrease_rho_threshold=damping_decrease_rho_threshold,
          damping_increase_rho_threshold=damping_increase_rho_threshold,
          min_damping=min_damping, relative_min_damping=relative_min_damping,
          l2_reg=l2_reg, precon_damping_mult=precon_damping_mult,
          use_passed_loss=use_passed_loss,
          always_use_exact_qmodel_for_damping_adjustment=bool(
              always_use_exact_qmodel_for_damping_adjustment),
          print_logs=print_logs),
      curvature=CurvatureConfig(
          cov_ema_decay=cov_ema_decay, estimation_mode=estimation_mode,
          colocate_gradients_with_ops=colocate_gradients_with_ops,
          batch_size=batch_size, compute_params_stats=compute_params_stats,
          periods=None if periodic is None else periodic.periods),
      placement=placement,
      guard=GuardConfig(
          skip_non_finite_steps=bool(skip_non_finite_steps),
          max_consecutive_skipped_steps=max_consecutive_skipped_steps),
      minibatch_phase=switch)


def default_var_list(var_list):
  """kfac 0.2.x's default in a TF1 graph: the graph's trainable variables,
  now (None otherwise, or when `var_list` is given); a var_list given to
  minimize / compute_gradients before the estimator is set up replaces it
  (so a trainable variable that is not a parameter, e.g. a damping
  variable, need not be registered)."""
  if var_list is None and _in_tf1_graph():
    return tf.compat.v1.trainable_variables()
  return None


def _in_tf1_graph():
  """Whether ops go to a TF1 graph (not eager, not a tf.function trace)."""
  if tf.executing_eagerly():
    return False
  graph = tf.compat.v1.get_default_graph()
  return not getattr(graph, "building_function", False)
