"""The Fisher estimator: statistics, update ops and preconditioning (layer 6).

`FisherEstimator` turns a finalized `LayerCollection` into factors fed by
the gradient sources of an estimation mode, creates (once, in a
`StateStore`) the variables holding their moving averages and inverses, and
builds the ops that update them. It multiplies vectors by the damped
approximate Fisher / GGN, its powers and its Cholesky factors.

Works in any graph: a TF1 `tf.Graph` under a Session, or a `tf.function`
trace (build a new estimator per trace with the same `state_store`).

As in kfac 0.2.x, the estimator is built lazily: the layer collection is
finalized, the registration checked and the factors made on first use
(`create_ops_and_vars_thunks`, `make_vars_and_create_op_thunks`, the
`multiply*` methods, `factors`, ...), not in the constructor.

This module is the estimator: its core (construction, set-up of the
factors and of the gradient sources, properties), its public methods, and
the three parts they delegate to, made when the factors are (on first
use), each given what it reads in its constructor (below the class, in
this order):

* `Statistics`: the statistics updates (thunks, the checked and
  conditional updates of a training step, the lazy sync's local folds);
* `Inverses`: the inverse updates (thunks, one batched op);
* `Products`: the products with the blocks (multiply*).

Where the update ops run is a placement policy (placement.py), `Replicated`
here; `make_fisher_estimator` (strategies.py) picks another one by the
name of a placement strategy.
"""

import collections
import contextlib
import threading
import weakref

import tensorflow as tf

from kfac.python.ops import lazy
from kfac.python.ops.collection import memory as memory_lib
from kfac.python.ops.collection import memory_fallback
from kfac.python.ops.distribute import collective
from kfac.python.ops.distribute import lazy_sync
from kfac.python.ops.estimation import modes as estimation_modes
from kfac.python.ops.estimation import placement
from kfac.python.ops.layers.base import damping as damping_lib
from kfac.python.ops.numerics import batched_inverse
from kfac.python.ops.reliability import arguments
from kfac.python.ops.reliability import nonfinite
from kfac.python.ops.tensors import state
from kfac.python.ops.tensors import utils


@utils.exclude_from_autograph
class FisherEstimator:
  """Estimates and applies a block-diagonal approximation of the Fisher."""

  def __init__(self,
               variables,
               cov_ema_decay,
               damping,
               layer_collection,
               exps=(-1,),
               estimation_mode="gradients",
               colocate_gradients_with_ops=True,
               name="FisherEstimator",
               compute_cholesky=False,
               compute_cholesky_inverse=False,
               compute_params_stats=False,
               batch_size=None,
               state_store=None,
               lazy_statistics_sync=False,
               skip_non_finite=True,
               sample_step=None,
               memory_budget="auto",
               over_budget="raise"):
    """Creates the estimator.

    Args:
      variables: the variables to estimate the Fisher for; must equal the
        variables registered in `layer_collection` (a callable returning
        them is accepted too).
      cov_ema_decay: decay of the statistics' moving averages.
      damping: float, tensor or variable; lambda * I is (approximately)
        added to the estimated matrix.
      layer_collection: the model's `LayerCollection`.
      exps: the matrix powers the estimator must apply (1 is always
        available).
      estimation_mode: "gradients", "empirical", "curvature_prop",
        "curvature_prop_GGN", "exact" or "exact_GGN" (estimation/modes.py).
      colocate_gradients_with_ops: kept for compatibility; TensorFlow 2's
        gradients always colocate.
      name: prefix of the state variables.
      compute_cholesky: make `multiply_cholesky` available.
      compute_cholesky_inverse: make `multiply_cholesky_inverse` available.
      compute_params_stats: also compute the first-order analogue of the
        statistics (the gradient of each source w.r.t. the variables, divided
        by batch_size), available as `params_stats`.
      batch_size: per-replica batch size; required with compute_params_stats.
      state_store: where variables live (default: a new `StateStore`);
        pass the same store when rebuilding the estimator in a new trace.
      lazy_statistics_sync: under several replicas, reduce the statistics
        across replicas only when the inverses are recomputed
        (distribute/lazy_sync.py) instead of at every statistics update.
      skip_non_finite: a statistics update whose statistics are not all
        finite leaves the factor unchanged, and an inverse update that gives
        non-finite values keeps the previous inverse
        (reliability/nonfinite.py).
      sample_step: None, or a function returning the training step (an
        int64 tensor, e.g. KfacOptimizer.steps_taken): then the random
        draws of the sampled modes for losses registered without a seed are
        stateless functions of (the run's sampling seed, kept in the state
        store so that checkpoints restore it; the loss; the replica; the
        step), so a resumed run draws exactly what an uninterrupted one
        would.
      memory_budget: bytes the K-FAC state (statistics, their moving
        averages, inverses, ...; collection/memory.py) may take: "auto"
        (default) for memory.DEFAULT_BUDGET_FRACTION of the machine's
        physical memory, a number, or None for no check. Checked from the
        static shapes when the factors are made, before any state is
        allocated; over it, a ValueError names the largest layers.
      over_budget: "raise" (default) or "fallback": re-register the
        largest layers with a cheaper approximation until the state fits
        (collection/memory_fallback.py; listed in
        layer_collection.memory_fallbacks, with a warning).

    Raises:
      ValueError: for an unknown mode, a missing batch_size, no registered
        losses, or variables that do not match the registrations.
    """
    estimation_modes.check_mode(estimation_mode)
    arguments.check(type(self).__name__, "cov_ema_decay", cov_ema_decay,
                    arguments.UNIT_INTERVAL)
    if compute_params_stats and batch_size is None:
      raise ValueError("Batch size needs to be passed in when "
                       "compute_params_stats is True.")
    if callable(variables) and not isinstance(variables, tf.Variable):
      self._variables_fn = variables  # resolved on first use
      self._variables = None
    else:
      self._variables_fn = None
      self._variables = list(variables)
    self._cov_ema_decay = cov_ema_decay
    self._damping = damping
    self._damping_func = damping_lib.as_damping_func(damping)
    self._layers = layer_collection
    self._exps = tuple(exps)
    self._estimation_mode = estimation_mode
    self._colocate_gradients_with_ops = colocate_gradients_with_ops
    self._name = name
    self._compute_cholesky = compute_cholesky
    self._compute_cholesky_inverse = compute_cholesky_inverse
    self._compute_params_stats = compute_params_stats
    self._batch_size = batch_size
    self._store = state_store or state.StateStore(name)
    self._params_stats = None
    self._lazy_statistics_sync = bool(lazy_statistics_sync)
    self._skip_non_finite = bool(skip_non_finite)
    self._sample_step = sample_step
    self._memory_budget = memory_lib.resolve_budget(type(self).__name__,
                                                    memory_budget)
    self._over_budget = memory_fallback.check_over_budget(
        type(self).__name__, over_budget)
    self._placement = placement.Replicated()
    # The parts, made by _finalize.
    self._statistics = self._inverses = self._products = None
    self._finalized = False

  def _set_placement(self, policy):
    """Uses the placement policy `policy` (placement.py); before first use
    (the parts are made with it)."""
    if self._finalized:
      raise ValueError("%s: the placement policy is set before the "
                       "estimator's first use." % self._name)
    self._placement = policy

  def _finalize(self):
    """Finalizes the layer collection, checks the registration against
    `variables` and makes the factors (once; kfac 0.2.x did this on first
    use too, so a collection may still be filled after the constructor)."""
    if self._finalized:
      return
    if not self._layers.is_finalized:
      self._layers.finalize()
    # As kfac 0.2.x: each variable registered as often as the losses' graph
    # uses it (TF1 graphs; layer_collection._use_problems).
    self._layers.check_registration(self.variables)
    sources = self._setup()
    factors = self._layers.get_factors()

    def lazy_sync():
      return self._lazy()
    self._statistics = Statistics(
        factors, self._layers.get_blocks(), sources, self._cov_ema_decay,
        self._skip_non_finite, self.replica_examples, self._name, lazy_sync,
        self._placement)
    self._inverses = Inverses(factors, self._name, lazy_sync,
                                       self._placement)
    self._products = Products(self._layers.blocks_and_params())
    self._finalized = True

  # ---------------------------------------------------------------- set-up
  def _setup(self):
    """Makes the factors from the estimation mode's gradient sources;
    returns the statistics' `Sources`."""
    blocks = self._layers.get_blocks()
    sources = estimation_modes.make_sources(self._estimation_mode,
                                            self._layers, self._sample_seeds())
    xs, spans = [], []
    for block in blocks:
      tensors = list(block.tensors_to_compute_grads())
      spans.append((len(xs), len(xs) + len(tensors)))
      xs.extend(tensors)
    n_block_xs = len(xs)
    if self._compute_params_stats:
      xs.extend(self.variables)
    # The statistics read these inside the conditional of the statistics
    # update: there they are built again (lazy.recompute_in_branch), so
    # the sampled backward pass runs only on the steps that update. Only
    # the gradients w.r.t. graph tensors: inside a branch of a tf.function,
    # tf.gradients does not reach a variable read outside the branch. A
    # gradient the branch cannot rebuild (None) keeps the outer tensor.
    lazy_xs = [j for j, x in enumerate(xs)
               if not isinstance(x, tf.Variable) and x.dtype != tf.resource]
    home = None  # lazy.defer's graph of the stand-ins
    if len(lazy_xs) == len(xs):
      # In a tf.function's trace, not even the outer copy is built until
      # something outside a conditional reads it (lazy.defer; TF1 graphs
      # build it now).
      flat, home = lazy.defer(
          [x for _ in sources for x in xs],
          lambda: [g for grads in estimation_modes.gradients_of_sources(
              sources, xs) for g in grads])
      grads = [flat[k * len(xs):(k + 1) * len(xs)]
               for k in range(len(sources))]
    else:
      grads = estimation_modes.gradients_of_sources(sources, xs)
    deferred = home is not None

    def rebuild():
      return [g[j] for g in estimation_modes.gradients_of_sources(
          sources, [xs[j] for j in lazy_xs], fill=deferred)
              for j in range(len(lazy_xs))]
    weights = [s.weight for s in sources]
    if all(w == 1.0 for w in weights):
      weights = None

    block_grads = {id(block): [tuple(g[start:stop]) for g in grads]
                   for block, (start, stop) in zip(blocks, spans)}
    self._instantiate_blocks(block_grads, weights)
    self._check_memory(blocks, block_grads, weights)

    if self._compute_params_stats:
      self._params_stats = self._make_params_stats(
          [g[n_block_xs:] for g in grads], [s.weight for s in sources])
    return Sources([g[j] for g in grads for j in lazy_xs],
                              rebuild, home)

  def _instantiate_blocks(self, block_grads, weights):
    """Makes every block's factors (in the state store) from its gradients
    (block_grads: id(block) -> the block's gradient lists) and registers
    the powers, Cholesky factors, ... the estimator needs."""
    self._layers.check_usable()
    blocks = self._layers.get_blocks()
    for block in blocks:
      block.instantiate_factors(block_grads[id(block)], self._damping_func,
                                weights)
    for factor in self._layers.get_factors():
      factor.attach_state_store(self._store)
    for block in blocks:
      for exp in self._exps:
        if exp != 1:
          block.register_matpower(exp)
      if self._compute_cholesky:
        block.register_cholesky()
      if self._compute_cholesky_inverse:
        block.register_cholesky_inverse()

  def _check_memory(self, blocks, block_grads, weights):
    """The budget check, before any factor state exists (variables are
    made on first use), with the fallback of over_budget="fallback"."""
    rows = memory_lib.memory_table(blocks)
    budget = self._memory_budget
    if (budget is not None and self._over_budget == "fallback" and
        memory_lib.needed_bytes(rows) > budget):

      def adopt(new, old):
        block_grads[id(new)] = block_grads[id(old)]

      def rebuild():
        self._layers.reset_factors()
        self._instantiate_blocks(block_grads, weights)

      rows = memory_fallback.apply(self._layers, rows, budget, adopt,
                                   rebuild)
    memory_lib.check_budget(rows, budget)

  def _sample_seeds(self):
    """Loss index -> the stateless seed of its draws (see sample_step), or
    None without a sample_step (then a loss registered without a seed
    draws from TensorFlow's stateful random ops)."""
    if self._sample_step is None:
      return None
    graph_seed = getattr(tf.compat.v1.get_default_graph(), "seed", None)
    base = self._store.get_or_create("sample_seed", [], tf.int64,
                                     initial_value=int(graph_seed or 0))
    step = tf.cast(self._sample_step(), tf.int64)
    offset = tf.convert_to_tensor(base) * 1000
    if collective.is_distributed():  # each replica draws its own samples
      offset += tf.cast(collective.replica_id(), tf.int64) * 1000003
    return lambda index: tf.stack([offset + index, step])

  def _make_params_stats(self, var_grads, weights):
    stats = []
    for i, var in enumerate(self.variables):
      total = None
      for grads, w in zip(var_grads, weights):
        term = grads[i] * utils.cast(w, grads[i].dtype)
        total = term if total is None else total + term
      stats.append(total / utils.cast(self._batch_size, total.dtype))
    return collective.all_reduce(stats, collective.MEAN)

  # ---------------------------------------------------------- properties
  @property
  def variables(self):
    if self._variables is None:
      self._variables = list(self._variables_fn())
    return self._variables

  @property
  def damping(self):
    return self._damping

  @property
  def blocks(self):
    return self._layers.get_blocks()

  @property
  def factors(self):
    self._finalize()
    return self._layers.get_factors()

  @property
  def name(self):
    return self._name

  @property
  def layers(self):
    return self._layers

  @property
  def estimation_mode(self):
    return self._estimation_mode

  @property
  def mat_type(self):
    return estimation_modes.MAT_TYPES[self._estimation_mode]

  @property
  def params_stats(self):
    if not self._compute_params_stats:
      raise ValueError("params_stats needs compute_params_stats=True.")
    self._finalize()
    return self._params_stats

  @property
  def state_store(self):
    return self._store

  # ------------------------------------------------------------ products
  def multiply_inverse(self, vecs_and_vars):
    self._finalize()
    return self._products.apply(lambda b, v: b.multiply_inverse(v),
                                vecs_and_vars)

  def multiply(self, vecs_and_vars):
    self._finalize()
    return self._products.apply(lambda b, v: b.multiply(v), vecs_and_vars)

  def multiply_matpower(self, exp, vecs_and_vars):
    self._finalize()
    return self._products.apply(lambda b, v: b.multiply_matpower(v, exp),
                                vecs_and_vars)

  def multiply_cholesky(self, vecs_and_vars, transpose=False):
    self._finalize()
    return self._products.apply(
        lambda b, v: b.multiply_cholesky(v, transpose), vecs_and_vars)

  def multiply_cholesky_inverse(self, vecs_and_vars, transpose=False):
    self._finalize()
    return self._products.apply(
        lambda b, v: b.multiply_cholesky_inverse(v, transpose), vecs_and_vars)

  def gradient_operands(self, vecs_and_vars):
    """{weight variable ref: (x, d)} for the dense weight gradients x^T d
    that their blocks may precondition through x and d without reading
    the product (FullyConnectedKFACBasicFB.gradient_operands)."""
    self._finalize()
    return self._products.gradient_operands(vecs_and_vars)

  # ---------------------------------------------------------- statistics
  def checked_cov_update(self, pred, gate=None, should_decay=True,
                         scope=None, conditional_reduction=False):
    """The statistics update of a training step, guarded against
    non-finite values: `Statistics.checked_update`, which says
    what `pred`, `gate`, `should_decay` and `conditional_reduction` do and
    what the returned flag means."""
    self._finalize()
    return self._statistics.checked_update(pred, gate, should_decay, scope,
                                           conditional_reduction)

  def conditional_cov_update(self, pred, scope=None):
    """An op that updates the statistics' moving averages when `pred`
    holds. Under several replicas (eager sync) the statistics are computed
    now and reduced only when `pred` holds, in a conditional taken for all
    replicas at once (collective.cross_replica_cond): no traffic on the
    steps without a statistics update."""
    self._finalize()
    return self._statistics.conditional_update(pred, scope)

  def replica_examples(self):
    """This replica's number of examples (of the first registered loss),
    the weight of its statistics in the cross-replica average."""
    return replica_examples(self._batch_size, self._layers)

  # ------------------------------------------------------------ inverses
  @property
  def inverse_update_uses_collectives(self):
    """Whether the inverse update ops talk to other replicas (then a
    conditional around them must be a collective.cross_replica_cond)."""
    return self._placement.uses_collectives() or self._lazy()

  def inverse_update_op(self, scope=None):
    """One op updating every factor's inverses, as the inverse update
    thunks do together: the damped Cholesky inverses of all factors are
    computed as batches of equal shapes with one float64 fallback
    (numerics/batched_inverse.py), so that the graph grows with the number
    of distinct factor shapes, not of factors. (The per-factor thunks where
    the placement says so.)"""
    self._finalize()
    return self._inverses.update_op(scope)

  # ---------------------------------------------------- update op thunks
  def create_ops_and_vars_thunks(self, scope=None):
    """Thunks that make variables and update ops, one per factor (in the
    order of `factors`); call a factor's variable thunks before its update
    thunks. A covariance update thunk takes `should_decay=True` (False: the
    statistic joins an arithmetic mean instead of the moving average).

    Returns:
      (cov_variable_thunks, cov_update_thunks, inv_variable_thunks,
       inv_update_thunks): four lists.
    """
    self._finalize()
    return (self._statistics.variable_thunks(),
            self._statistics.update_thunks(scope),
            self._inverses.variable_thunks(),
            self._inverses.update_thunks(scope))

  def make_vars_and_create_op_thunks(self, scope=None):
    """Makes all variables now and returns the update thunks (kfac 0.2.x).

    Returns:
      (cov_update_thunks, inv_update_thunks): two lists, one thunk per
      factor; each call builds that factor's update op.
    """
    (cov_var_thunks, cov_update_thunks, inv_var_thunks,
     inv_update_thunks) = self.create_ops_and_vars_thunks(scope)
    for thunk in cov_var_thunks + inv_var_thunks:
      thunk()
    return cov_update_thunks, inv_update_thunks

  def make_vars_and_create_ops(self, scope=None):
    """Makes all variables and builds every update op now.

    Returns:
      An `UpdateOps` namedtuple (cov_update_ops, cov_update_op,
      inv_update_ops, inv_update_op, cov_update_thunks, inv_update_thunks):
      the per-factor ops, one op grouping each kind, and the thunks (as
      make_vars_and_create_op_thunks returns them).
    """
    cov_update_thunks, inv_update_thunks = (
        self.make_vars_and_create_op_thunks(scope))
    cov_update_ops = [t() for t in cov_update_thunks]
    inv_update_ops = [t() for t in inv_update_thunks]
    with self._scope(scope):
      cov_update_op = tf.group(*cov_update_ops, name="cov_update_op")
      inv_update_op = tf.group(*inv_update_ops, name="inv_update_op")
    return UpdateOps(cov_update_ops, cov_update_op, inv_update_ops,
                     inv_update_op, cov_update_thunks, inv_update_thunks)

  # ----------------------------------------------------------- variables
  def instantiate_variables(self):
    for factor in self.factors:
      factor.instantiate_cov_variables()
      factor.instantiate_inv_variables()

  def get_cov_vars(self):
    """The statistics' variables: a tuple with one list per factor (in the
    order of `factors`), as in kfac 0.2.x."""
    self.instantiate_variables()
    return tuple(_cov_vars_of(f) for f in self.factors)

  def get_inv_vars(self):
    """The inverse-related variables: a tuple with one list per factor
    (empty for factors without any, e.g. diagonal ones)."""
    self.instantiate_variables()
    return tuple(list(f.inverse_variables()) for f in self.factors)

  # ------------------------------------------------------------- helpers
  def _scope(self, scope):
    return tf.name_scope(scope or self._name)

  def _lazy(self):
    """Whether the statistics are synchronised lazily here (several
    replicas and lazy_statistics_sync; optimizers/kfac_optimizer.py reads
    it)."""
    return self._lazy_statistics_sync and collective.is_distributed()


UpdateOps = collections.namedtuple(
    "UpdateOps", ["cov_update_ops", "cov_update_op", "inv_update_ops",
                  "inv_update_op", "cov_update_thunks", "inv_update_thunks"])


def _cov_vars_of(factor):
  out = [factor.get_cov_var()]
  if hasattr(factor, "get_cov_dt1"):
    out.append(factor.get_cov_dt1())
  return out


# --------------------------------------------------------------------------
# The Fisher estimator's statistics part: the ops that fold each factor's
# covariance statistics into its moving average, with the non-finite guard
# (reliability/nonfinite.py), the cross-replica reduction (distribute/) and
# the lazy rebuild of the sampled backward pass inside conditionals (lazy/).
#
# `Statistics` is made by `estimator.FisherEstimator` once its factors exist;
# it gets them, the blocks, the gradient sources, the configuration and the
# placement policy (placement.py) in its constructor. Its entry points:
# `variable_thunks`, `update_thunks`, `checked_update` and
# `conditional_update`.


class Sources(collections.namedtuple(
    "Sources", ["grads", "rebuild", "home"])):
  """The gradients of the estimation mode's sources that the statistics
  read (`grads`), the function that builds them again inside a
  conditional (`rebuild`) and lazy.defer's graph of their stand-ins
  (`home`, or None); see lazy.recompute_in_branch."""


def replica_examples(batch_size, layers):
  """This replica's number of examples (of the first registered loss of
  the LayerCollection `layers`, or `batch_size` when given), the weight of
  its statistics in the cross-replica average."""
  if batch_size is not None:
    return tf.constant(float(batch_size), tf.float64)
  towers = layers.towers_by_loss
  return tf.cast(tf.add_n([tf.shape(loss.inputs[0])[0]
                           for loss in towers[0]]), tf.float64)


class Statistics:
  """The FisherEstimator's statistics updates (see module docstring)."""

  def __init__(self, factors, blocks, sources, cov_ema_decay,
               skip_non_finite, examples, name, lazy_sync, placement):
    """Args:
      factors: the estimator's factors, in order.
      blocks: its blocks (their run-time row checks come first).
      sources: a `Sources`.
      cov_ema_decay: the decay of the moving averages.
      skip_non_finite: guard each factor's update against non-finite
        statistics.
      examples: a function returning this replica's number of examples
        (`replica_examples`).
      name: the default name scope.
      lazy_sync: a function saying whether the statistics are synchronised
        lazily (distribute/lazy_sync.py) where the ops are built.
      placement: the placement policy (placement.py).
    """
    self._factors = list(factors)
    self._blocks = list(blocks)
    self._sources = sources
    self._cov_ema_decay = cov_ema_decay
    self._skip_non_finite = skip_non_finite
    self._examples = examples
    self._name = name
    self._lazy = lazy_sync
    self._placement = placement
    self._decay_pairs = weakref.WeakKeyDictionary()
    self._reduced = None

  def _scope(self, scope):
    return tf.name_scope(scope or self._name)

  def variable_thunks(self):
    """One thunk per factor making its statistics' variables."""
    return self._placement.place_statistics(
        [f.instantiate_cov_variables for f in self._factors])

  def _decay_and_weight(self, should_decay, dtype=tf.float64):
    """(decay, weight of the new statistic) of a statistics update:
    should_decay True folds with the estimator's decay, False adds the
    statistic to an arithmetic mean (decay 1, the usual weight 1 - decay;
    kfac 0.2.x's burn-in). A boolean tensor chooses when the op runs; its
    (decay, weight) in `dtype` (the factor's) are then those of the
    Python bool it holds, as the factor computes them."""
    if isinstance(should_decay, (bool, int)) or (
        not tf.is_tensor(should_decay) and hasattr(should_decay, "dtype")):
      if bool(should_decay):
        return self._cov_ema_decay, None
      return 1.0, 1.0 - self._cov_ema_decay
    if not tf.is_tensor(should_decay) or should_decay.dtype != tf.bool:
      raise TypeError("should_decay must be a Python bool or a boolean "
                      "tensor, got %r." % (should_decay,))
    # One pair per graph, tensor and dtype, shared by every factor (a model
    # has hundreds); made free of the control dependencies in scope.
    graph = tf.compat.v1.get_default_graph()
    shareable = graph._get_control_flow_context() is None  # pylint: disable=protected-access
    cache = self._decay_pairs
    key = (should_decay.ref(), tf.as_dtype(dtype).name)
    if shareable and key in cache.get(graph, {}):
      return cache[graph][key]
    with (tf.control_dependencies(None) if shareable else
          contextlib.nullcontext()):
      decay = utils.cast(self._cov_ema_decay, dtype)
      pair = (tf.where(should_decay, decay, tf.constant(1.0, dtype)),
              tf.where(should_decay, 1.0 - decay,
                       utils.cast(1.0 - self._cov_ema_decay, dtype)))
    if shareable:
      cache.setdefault(graph, {})[key] = pair
    return pair

  def update_thunks(self, scope=None):
    """One thunk per factor, placed; thunk(should_decay=True) builds its
    update (see _decay_and_weight)."""
    return self._placement.place_statistics(self._update_thunks(scope))

  def _update_thunks(self, scope):
    if self._lazy():
      corrections = [f.name for f in self._factors
                     if getattr(f, "is_eigen_correction", False)]
      if corrections:
        raise ValueError(
            "lazy_statistics_sync=True does not support EKFAC blocks (their "
            "scalings depend on the basis of the last refresh): %s. Use "
            "lazy_statistics_sync=False or another approximation." %
            ", ".join(corrections))
      examples = self._examples()

      def make_local(factor):
        def thunk(should_decay=True):
          if should_decay is not True:
            raise ValueError(
                "should_decay=%r is not supported with "
                "lazy_statistics_sync=True under several replicas." %
                (should_decay,))
          with self._scope(scope), self._row_checks():
            if not self._skip_non_finite:
              return lazy_sync.fold_op(factor, self._cov_ema_decay, examples)
            pairs = factor.covariance_statistics()
            return nonfinite.guarded_op(
                [t for t, _ in pairs], lambda: lazy_sync.fold_op(
                    factor, self._cov_ema_decay, examples, pairs))
        return thunk
      return [make_local(f) for f in self._factors]
    reduced = self._reduced_statistics(scope)

    def make(factor):
      def thunk(should_decay=True):
        with self._scope(scope), self._row_checks():
          stats = (reduced[factor.name] if reduced is not None else
                   [t for t, _ in factor.covariance_statistics()])
          return self._guarded_assign(factor, stats, should_decay,
                                      self._skip_non_finite)
      return thunk
    return [make(f) for f in self._factors]

  def _guarded_assign(self, factor, stats, should_decay, check):
    """Folds `stats` into the factor's average; with `check`, only when
    they are all finite (else the factor is left as it was)."""
    decay, weight = self._decay_and_weight(should_decay, factor.dtype)
    extra = () if weight is None else (weight,)

    def assign():
      return factor.make_covariance_assign_op(stats, decay, *extra)
    if not check:
      return assign()
    return nonfinite.guarded_op(stats, assign)

  def _in_branch(self, make_op):
    """make_op() with the sources' gradients rebuilt where the statistics
    read them, when that is inside a conditional branch (lazy/)."""
    with lazy.recompute_in_branch(self._sources.grads,
                                  self._sources.rebuild,
                                  home=self._sources.home):
      return make_op()

  def checked_update(self, pred, gate=None, should_decay=True, scope=None,
                     conditional_reduction=False):
    """The statistics update of a training step, guarded against
    non-finite values (reliability/nonfinite.py).

    When `pred` (a Python bool or a boolean tensor) and `gate` (a boolean
    tensor: the step's loss and gradients are finite; None: no guard) hold,
    computes every factor's statistics and, with a gate, folds them in only
    if all of them are finite. Returns a boolean tensor: False when the
    statistics were computed and are not all finite (the step must then be
    skipped), True otherwise. Under several replicas the statistics are
    reduced before the check, so the flag is the same on every replica.
    With lazy_statistics_sync, or `conditional_reduction` (reduce only when
    `pred` holds: conditional_cov_update), each factor is guarded on its
    own and the flag is True.
    """
    always = pred is True
    if self._lazy() or (conditional_reduction and
                        collective.is_distributed()):
      if gate is not None:
        pred = tf.logical_and(pred, gate)
      if self._lazy():
        thunks = self.update_thunks(scope)
        op = utils.cond_op(pred, lambda: self._in_branch(lambda: tf.group(
            *[t(should_decay) for t in thunks])))
      else:
        op = self.conditional_update(pred, scope)
      with tf.control_dependencies([op]):
        return tf.constant(True)

    # The statistics are computed on `pred` alone, so that they run in
    # parallel with the model's backward pass (which `gate` waits for); only
    # folding them in waits for the gate.
    def fold(stats, flag):
      def assign_all():
        return tf.group(*[
            self._guarded_assign(f, stats[f.name], should_decay, False)
            for f in self._factors])
      if flag is None:
        return assign_all()
      return utils.cond_op(tf.logical_and(flag, gate), assign_all)

    def when_pred(make_op):
      return make_op() if always else utils.cond_op(pred, make_op)

    if collective.is_distributed():
      stats = self._reduced_statistics(scope)
      flag = None
      if gate is not None:
        flag = nonfinite.finite_flag(
            [t for factor in self._factors for t in stats[factor.name]])
      op = when_pred(lambda: fold(stats, flag))
      with tf.control_dependencies([op]):
        if flag is None:
          return tf.constant(True)
        if always:
          return tf.identity(flag)
        return tf.logical_or(tf.logical_not(pred), flag)

    def compute_and_fold():
      with self._scope(scope):
        owners, tensors, _ = self._in_branch(self._local_statistics)
        flag = None if gate is None else nonfinite.finite_flag(tensors)
        op = fold(self._by_factor(owners, tensors), flag)
      with tf.control_dependencies([op]):
        return tf.constant(True) if flag is None else tf.identity(flag)
    if always:
      return compute_and_fold()
    return tf.cond(pred, compute_and_fold, lambda: tf.constant(True))

  def _row_checks(self):
    """A context under which statistics are computed after the blocks'
    run-time row checks (reliability/shapes.py)."""
    return tf.control_dependencies([
        c for block in self._blocks
        for c in getattr(block, "row_checks", [])])

  def _local_statistics(self):
    """(factors, statistics, symmetric) of this replica's batch, in order
    (a factor may have several statistics)."""
    owners, tensors, symmetric = [], [], []
    with self._row_checks():
      for factor in self._factors:
        for stat, sym in factor.covariance_statistics():
          owners.append(factor)
          tensors.append(stat)
          symmetric.append(sym)
    return owners, tensors, symmetric

  @staticmethod
  def _by_factor(owners, values):
    out = {}
    for factor, value in zip(owners, values):
      out.setdefault(factor.name, []).append(value)
    return out

  def _reduced_statistics(self, scope=None):
    """Under several replicas: {factor name: statistics of the global
    batch}, computed and reduced now, outside any conditional (one
    collective per dtype, weighted by the replicas' batch sizes); None
    with one replica. Built once per estimator."""
    if not collective.is_distributed():
      return None
    if self._reduced is None:
      with self._scope(scope), tf.name_scope("cross_replica_statistics"):
        owners, tensors, symmetric = self._local_statistics()
        reduced = collective.all_reduce(
            tensors, collective.MEAN, symmetric,
            weight=self._examples())
      self._reduced = self._by_factor(owners, reduced)
    return self._reduced

  def conditional_update(self, pred, scope=None):
    """An op that updates the statistics' moving averages when `pred`
    holds. Under several replicas (eager sync) the statistics are computed
    now and reduced only when `pred` holds, in a conditional taken for all
    replicas at once (collective.cross_replica_cond): no traffic on the
    steps without a statistics update."""
    if not collective.is_distributed() or self._lazy():
      thunks = self.update_thunks(scope)
      return utils.cond_op(pred, lambda: self._in_branch(
          lambda: tf.group(*[t() for t in thunks])))
    with self._scope(scope):
      owners, tensors, symmetric = self._local_statistics()
      examples = self._examples()

    def fold_reduced(tensors, examples):
      with self._scope(scope), tf.name_scope("cross_replica_statistics"):
        reduced = collective.all_reduce(tensors, collective.MEAN, symmetric,
                                        weight=examples)
        stats = self._by_factor(owners, reduced)
        return tf.group(*[
            self._guarded_assign(factor, stats[factor.name], True,
                                 self._skip_non_finite)
            for factor in self._factors])

    return collective.cross_replica_cond(pred, fold_reduced,
                                         (tensors, examples))


# --------------------------------------------------------------------------
# The Fisher estimator's inverses part: the ops that recompute each
# factor's inverses (and eigendecompositions, Cholesky factors, ...) from its
# statistics' moving average, after the lazy statistics sync when there is
# one (distribute/lazy_sync.py), placed by the placement policy
# (placement.py).
#
# `Inverses` is made by `estimator.FisherEstimator` once its factors exist;
# it gets them, the configuration and the placement policy in its
# constructor. Its entry points: `variable_thunks`, `update_thunks` (one
# per factor) and `update_op` (all factors at once, batched by shape).


class Inverses:
  """The FisherEstimator's inverse updates (see module docstring)."""

  def __init__(self, factors, name, lazy_sync, placement):
    """Args:
      factors: the estimator's factors, in order.
      name: the default name scope.
      lazy_sync: a function saying whether the statistics are synchronised
        lazily (then the inverse updates first reduce them) where the ops
        are built.
      placement: the placement policy (placement.py).
    """
    self._factors = list(factors)
    self._name = name
    self._lazy = lazy_sync
    self._placement = placement
    self._sync_ops = {}  # (graph, replica thread) -> the lazy sync op

  def _scope(self, scope):
    return tf.name_scope(scope or self._name)

  def variable_thunks(self):
    """One thunk per factor making its inverses' variables."""
    return [f.instantiate_inv_variables for f in self._factors]

  def update_thunks(self, scope=None):
    """One thunk per factor building its inverse update op (placed)."""
    thunks = self._placement.inverse_thunks(
        self._factors, self._factor_thunks(scope), lambda: self._scope(scope))
    if self._lazy():
      thunks = [self._after_sync(t, scope) for t in thunks]
    return self._placement.place_inverses(thunks)

  def _factor_thunks(self, scope):
    def make(factor):
      def thunk():
        with self._scope(scope):
          return tf.group(*factor.make_inverse_update_ops())
      return thunk
    return [make(f) for f in self._factors]

  def _sync_op(self, scope):
    """One sync of all factors per graph and replica thread, before any
    inverse is computed."""
    key = (tf.compat.v1.get_default_graph(), threading.get_ident())
    if key not in self._sync_ops:
      with self._scope(scope):
        self._sync_ops[key] = lazy_sync.sync_op(self._factors)
    return self._sync_ops[key]

  def _after_sync(self, thunk, scope):
    def synced():
      with tf.control_dependencies([self._sync_op(scope)]):
        return tf.group(thunk())
    return synced

  def update_op(self, scope=None):
    """One op updating every factor's inverses, as the update thunks do
    together: the damped Cholesky inverses of all factors are computed as
    batches of equal shapes with one float64 fallback
    (numerics/batched_inverse.py), so that the graph grows with the number
    of distinct factor shapes, not of factors. (The per-factor thunks where
    the placement policy says so.)"""
    if self._placement.per_factor_inverses():
      return tf.group(*[t() for t in self.update_thunks(scope)])
    sync = [self._sync_op(scope)] if self._lazy() else []
    with tf.control_dependencies(sync), self._scope(scope):
      assigns, deferred = [], []
      for factor in self._factors:
        for var, value in factor.deferred_inverse_values():
          if isinstance(value, batched_inverse.DeferredInverse):
            deferred.append((var, value))
          else:
            assigns.append(nonfinite.assign_if_finite(var, value))
      values = batched_inverse.damped_inverses(
          [(d.mat, d.damping) for _, d in deferred])
      assigns.extend(nonfinite.assign_if_finite(var, value)
                     for (var, _), value in zip(deferred, values))
      return tf.group(*assigns)


# --------------------------------------------------------------------------
# The Fisher estimator's products part: vectors times the damped
# approximate Fisher / GGN, its powers and its Cholesky factors, block by
# block.
#
# `Products` is made by `estimator.FisherEstimator` once its blocks have
# their factors; it gets the (parameters, block) pairs of the
# LayerCollection in its constructor. `apply(fn, vecs_and_vars)` applies a
# block product to every registered layer's vectors (the estimator's
# multiply* methods name the product); `gradient_operands` finds the dense
# weight gradients that their blocks precondition without the product.


class Products:
  """The FisherEstimator's products (see module docstring)."""

  def __init__(self, blocks_and_params):
    """`blocks_and_params`: the LayerCollection's (parameters, block)
    pairs, its `blocks_and_params()`."""
    self._blocks_and_params = list(blocks_and_params)

  def apply(self, fn, vecs_and_vars):
    """Applies fn(block, vector) blockwise; returns [(result, var)] in the
    order of `vecs_and_vars`. `tf.IndexedSlices` vectors reach blocks with
    `supports_indexed_slices = True` unchanged (their results may be
    IndexedSlices too) and are densified for the other blocks."""
    by_ref = {}
    for vec, var in vecs_and_vars:
      if vec is None:
        raise ValueError("No vector (gradient) for variable %s." %
                         utils.variable_name(var))
      by_ref[var.ref()] = (vec if isinstance(vec, tf.IndexedSlices) else
                           tf.convert_to_tensor(vec))
    results = {}
    for params, block in self._blocks_and_params:
      seq = utils.ensure_sequence(params)
      present = [v.ref() in by_ref for v in seq]
      if not any(present):
        continue
      if not all(present):
        missing = [utils.variable_name(v) for v, p in zip(seq, present)
                   if not p]
        raise ValueError("Variables %s are registered in one layer with %s "
                         "but have no vector." %
                         (", ".join(missing), _names(seq)))
      vec = tuple(by_ref[v.ref()] for v in seq)
      if not getattr(block, "supports_indexed_slices", False):
        # Blocks that declare `supports_indexed_slices` (embedding tables)
        # take IndexedSlices as they are; the others get dense tensors.
        vec = tuple(tf.convert_to_tensor(v) for v in vec)
      # Half-precision vectors meet float32 factors (see
      # LayerCollection._full_precision); results go back to their dtype.
      dtypes = [v.dtype for v in vec]
      vec = tuple(_cast_vector(v, tf.float32) if d in _HALF else v
                  for v, d in zip(vec, dtypes))
      out = fn(block, vec if isinstance(params, (list, tuple)) else vec[0])
      for v, r, d in zip(seq, utils.ensure_sequence(out), dtypes):
        results[v.ref()] = _cast_vector(r, d) if d in _HALF else r
    unknown = [utils.variable_name(var) for _, var in vecs_and_vars
               if var.ref() not in results]
    if unknown:
      raise ValueError("Variables %s are not registered with the "
                       "LayerCollection of this estimator." %
                       ", ".join(unknown))
    return [(results[var.ref()], var) for _, var in vecs_and_vars]

  def gradient_operands(self, vecs_and_vars):
    """{weight variable ref: (x, d)} for the dense weight gradients x^T d
    that their blocks may precondition through x and d without reading
    the product (FullyConnectedKFACBasicFB.gradient_operands)."""
    by_ref = {var.ref(): vec for vec, var in vecs_and_vars}
    found = {}
    for params, block in self._blocks_and_params:
      seq = utils.ensure_sequence(params)
      vec = tuple(by_ref.get(v.ref()) for v in seq)
      if (not hasattr(block, "gradient_operands") or
          not all(tf.is_tensor(v) and v.dtype not in _HALF for v in vec)):
        continue
      pair = block.gradient_operands(
          vec if isinstance(params, (list, tuple)) else vec[0])
      if pair is not None:
        found[seq[0].ref()] = pair
    return found


_HALF = (tf.float16, tf.bfloat16)


def _cast_vector(vec, dtype):
  if isinstance(vec, tf.IndexedSlices):
    return tf.IndexedSlices(tf.cast(vec.values, dtype), vec.indices,
                            vec.dense_shape)
  return tf.cast(vec, dtype)


def _names(variables):
  return ", ".join(utils.variable_name(v) for v in variables)
