"""KfacOptimizer's constructor arguments: checks, schedules and defaults.

Each helper takes care of one part of what `KfacOptimizer.__init__` is
given, in the order the constructor runs them (so the same bad input gets
the same error):
1. `reject_tf_replicator`: kfac 0.2.x's TF-Replicator no longer exists;
2. `resolve`: the momentum type, each schedule instead of its constant
   (`learning_rate_schedule` ...), and which of learning_rate / momentum /
   damping the momentum type requires or forbids;
3. `check`: every number's range (reliability/arguments.py); tensors,
   variables and callables are checked with every step, from the list it
   returns (`runtime_checks`);
4. `check_placement`: the placement strategy exists and takes the extra
   keyword arguments;
5. `default_var_list`: kfac 0.2.x's default var_list in a TF1 graph.
"""

import inspect

import tensorflow as tf

from kfac.python.ops.estimation import strategies as est_lib
from kfac.python.ops.estimation import modes as estimation_modes
from kfac.python.ops.reliability import arguments
from kfac.python.ops.tensors import utils

MOMENTUM_TYPES = ("regular", "adam", "qmodel", "qmodel_fixedmu")

# The hyperparameters that may also be tensors, variables or callables
# (checked with every step), with their rules; "damping" is special-cased.
_STEP_HYPERPARAMETERS = (
    ("learning_rate", arguments.NON_NEGATIVE),
    ("damping", None),
    ("momentum", arguments.MOMENTUM),
    ("weight_decay_coeff", arguments.NON_NEGATIVE),
    ("norm_constraint", arguments.POSITIVE),
    ("decoupled_weight_decay", arguments.NON_NEGATIVE),
)
# The hyperparameters that must be Python numbers (or None).
_NUMBERS = (
    ("cov_ema_decay", arguments.UNIT_INTERVAL),
    ("l2_reg", arguments.NON_NEGATIVE),
    ("min_damping", arguments.NON_NEGATIVE),
    ("relative_min_damping", arguments.NON_NEGATIVE),
    ("precon_damping_mult", arguments.POSITIVE),
    ("qmodel_update_rescale", arguments.POSITIVE),
)


def reject_tf_replicator(tf_replicator):
  """Raises ValueError unless `tf_replicator` is None."""
  if tf_replicator is not None:
    raise ValueError(
        "tf_replicator=%r: TF-Replicator is not supported by this version "
        "of kfac (it no longer exists). Run the step under a "
        "tf.distribute strategy instead (e.g. MirroredStrategy or "
        "TPUStrategy, see docs/distributed.md); K-FAC then reduces its "
        "statistics across replicas itself." % (tf_replicator,))


def resolve(args, from_schedule):
  """A copy of the dict `args` with learning_rate, momentum and damping
  replaced by their schedules where given (`from_schedule(name, value,
  schedule)`, AdaptiveMixin._from_schedule); raises ValueError for an
  unknown momentum type or a value it requires / forbids."""
  momentum_type = args["momentum_type"]
  if momentum_type not in MOMENTUM_TYPES:
    raise ValueError("Unknown momentum_type %r; expected one of %s." %
                     (momentum_type, ", ".join(MOMENTUM_TYPES)))
  args = dict(args)
  for name in ("learning_rate", "momentum", "damping"):
    args[name] = from_schedule(name, args[name], args[name + "_schedule"])
  _check_required(momentum_type, args["learning_rate"], args["momentum"],
                  args["damping"])
  return args


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


def check(owner, args):
  """Checks the hyperparameters in the dict `args` (reliability/
  arguments.py): numbers now; returns [(name, value, rule)] of the ones
  that may be tensors, variables or callables, for `runtime_checks`."""
  checked = _step_hyperparameters(args)
  for name, value, rule in checked:
    arguments.check(owner, name, value, rule, allow_none=True)
  for name, rule in _NUMBERS:
    if not arguments.is_number(args[name]) and args[name] is not None:
      raise ValueError("%s: %s must be a number, got %r." %
                       (owner, name, args[name]))
    arguments.check(owner, name, args[name], rule, allow_none=True)
  if not utils.is_tensor_or_variable(args["batch_size"]):
    arguments.check_count(owner, "batch_size", args["batch_size"], 1,
                          allow_none=True)
  arguments.check_count(owner, "damping_adaptation_interval",
                        args["damping_adaptation_interval"], 1)
  estimation_modes.check_mode(args["estimation_mode"])
  _check_dtype(owner, args["dtype"])
  return checked


def _step_hyperparameters(args):
  """[(name, value, rule)] of the hyperparameters checked with every step.
  The damping rule keeps the damping >= min_damping: with a positive floor
  the damping may start at 0."""
  floor = args["min_damping"]
  adaptive_floor = (args["adapt_damping"] and
                    arguments.is_number(floor) and floor > 0)
  damping_rule = (arguments.NON_NEGATIVE if adaptive_floor
                  else arguments.POSITIVE)
  return [(name, args[name], damping_rule if rule is None else rule)
          for name, rule in _STEP_HYPERPARAMETERS]


def _check_dtype(owner, dtype):
  try:
    tf.as_dtype(dtype)
  except TypeError:
    raise ValueError("%s: dtype must be a floating-point dtype, got %r." %
                     (owner, dtype)) from None
  if not tf.as_dtype(dtype).is_floating:
    raise ValueError("%s: dtype must be a floating-point dtype, got %r." %
                     (owner, dtype))


def runtime_checks(owner, checked, owned):
  """Assertions of the hyperparameters in `checked` (from `check`) given as
  tensors, variables or callables, except the names in `owned` (the
  optimizer's own adapted values)."""
  return arguments.runtime_checks(
      owner, [(n, v, r) for n, v, r in checked if n not in owned])


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
