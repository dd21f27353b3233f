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

This module is the estimator's core (construction, set-up of the factors
and of the gradient sources, properties) and its public methods, which
delegate to three parts made when the factors are (on first use), each
given what it reads in its constructor:

* `statistics.Statistics`: the statistics updates (thunks, the checked and
  conditional updates of a training step, the lazy sync's local folds);
* `inverses.Inverses`: the inverse updates (thunks, one batched op);
* `products.Products`: the products with the blocks (multiply*).

Where the update ops run is a placement policy (placement.py), `Replicated`
here; `make_fisher_estimator` (strategies.py) picks another one by the
name of a placement strategy.
"""

import collections

import tensorflow as tf

from kfac.python.ops import lazy

from kfac.python.ops.collection import memory as memory_lib
from kfac.python.ops.collection import memory_fallback
from kfac.python.ops.layers.base import damping as damping_lib
from kfac.python.ops.estimation import inverses
from kfac.python.ops.estimation import modes as estimation_modes
from kfac.python.ops.estimation import placement
from kfac.python.ops.estimation import products
from kfac.python.ops.estimation import statistics
from kfac.python.ops.tensors import state
from kfac.python.ops.tensors import utils
from kfac.python.ops.distribute import collective
from kfac.python.ops.reliability import arguments


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
    self._statistics = statistics.Statistics(
        factors, self._layers.get_blocks(), sources, self._cov_ema_decay,
        self._skip_non_finite, self.replica_examples, self._name, lazy_sync,
        self._placement)
    self._inverses = inverses.Inverses(factors, self._name, lazy_sync,
                                       self._placement)
    self._products = products.Products(self._layers.blocks_and_params())
    self._finalized = True

  # ---------------------------------------------------------------- set-up
  def _setup(self):
    """Makes the factors from the estimation mode's gradient sources;
    returns the statistics' `statistics.Sources`."""
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
    return statistics.Sources([g[j] for g in grads for j in lazy_xs],
                              rebuild, home)

  def _instantiate_blocks(self, block_grads, weights):
    """Makes every block's factors (in the state store) from its gradients
    (block_grads: id(block) -> the block's gradient lists) and registers
    the powers, Cholesky factors, ... the estimator needs."""
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
    non-finite values: `statistics.Statistics.checked_update`, which says
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
    return statistics.replica_examples(self._batch_size, self._layers)

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
    replicas and lazy_statistics_sync; optimizers/periodic.py reads it)."""
    return self._lazy_statistics_sync and collective.is_distributed()


UpdateOps = collections.namedtuple(
    "UpdateOps", ["cov_update_ops", "cov_update_op", "inv_update_ops",
                  "inv_update_op", "cov_update_thunks", "inv_update_thunks"])


def _cov_vars_of(factor):
  out = [factor.get_cov_var()]
  if hasattr(factor, "get_cov_dt1"):
    out.append(factor.get_cov_dt1())
  return out
