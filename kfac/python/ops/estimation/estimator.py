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
`FisherEstimatorRoundRobin` (the class `make_fisher_estimator` returns by
default) and `FisherEstimatorReplicaRoundRobin` add the device placement
strategies of placement.py.
"""

import collections
import threading

import tensorflow as tf

from kfac.python.ops.layers.base import damping as damping_lib
from kfac.python.ops.estimation import modes as estimation_modes
from kfac.python.ops import lazy
from kfac.python.ops import placement
from kfac.python.ops.tensors import state
from kfac.python.ops.tensors import utils
from kfac.python.ops.distribute import collective
from kfac.python.ops.distribute import lazy_sync
from kfac.python.ops.reliability import arguments
from kfac.python.ops.reliability import nonfinite


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
               sample_step=None):
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
    self._source_grads, self._rebuild_source_grads = [], None
    self._lazy_statistics_sync = bool(lazy_statistics_sync)
    self._lazy_sync_ops = {}
    self._skip_non_finite = bool(skip_non_finite)
    self._sample_step = sample_step
    self._finalized = False

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
    self._setup()
    self._finalized = True

  # ---------------------------------------------------------------- set-up
  def _setup(self):
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
    grads = estimation_modes.gradients_of_sources(sources, xs)
    # The statistics read these inside the conditional of the statistics
    # update: there they are built again (lazy.recompute_in_branch), so
    # the sampled backward pass runs only on the steps that update. Only
    # the gradients w.r.t. graph tensors: inside a branch of a tf.function,
    # tf.gradients does not reach a variable read outside the branch. A
    # gradient the branch cannot rebuild (None) keeps the outer tensor.
    lazy_xs = [j for j, x in enumerate(xs)
               if not isinstance(x, tf.Variable) and x.dtype != tf.resource]
    self._source_grads = [g[j] for g in grads for j in lazy_xs]
    self._rebuild_source_grads = lambda: [
        g[j] for g in estimation_modes.gradients_of_sources(
            sources, [xs[j] for j in lazy_xs], fill=False)
        for j in range(len(lazy_xs))]
    weights = [s.weight for s in sources]
    if all(w == 1.0 for w in weights):
      weights = None

    for block, (start, stop) in zip(blocks, spans):
      grads_list = [tuple(g[start:stop]) for g in grads]
      block.instantiate_factors(grads_list, self._damping_func, weights)
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

    if self._compute_params_stats:
      self._params_stats = self._make_params_stats(
          [g[n_block_xs:] for g in grads], [s.weight for s in sources])

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

  # -------------------------------------------------------- products
  def _apply(self, fn, vecs_and_vars):
    """Applies fn(block, vector) blockwise; returns [(result, var)] in the
    order of `vecs_and_vars`. `tf.IndexedSlices` vectors reach blocks with
    `supports_indexed_slices = True` unchanged (their results may be
    IndexedSlices too) and are densified for the other blocks."""
    self._finalize()
    by_ref = {}
    for vec, var in vecs_and_vars:
      if vec is None:
        raise ValueError("No vector (gradient) for variable %s." %
                         utils.variable_name(var))
      by_ref[var.ref()] = (vec if isinstance(vec, tf.IndexedSlices) else
                           tf.convert_to_tensor(vec))
    results = {}
    for params, block in self._layers.blocks_and_params():
      seq = utils.ensure_sequence(params)
      present = [v.ref() in by_ref for v in seq]
      if not any(present):
        continue
      if not all(present):
        missing = [utils.variable_name(v) for v, p in zip(seq, present) if not p]
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
    self._finalize()
    by_ref = {var.ref(): vec for vec, var in vecs_and_vars}
    found = {}
    for params, block in self._layers.blocks_and_params():
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

  def multiply_inverse(self, vecs_and_vars):
    return self._apply(lambda b, v: b.multiply_inverse(v), vecs_and_vars)

  def multiply(self, vecs_and_vars):
    return self._apply(lambda b, v: b.multiply(v), vecs_and_vars)

  def multiply_matpower(self, exp, vecs_and_vars):
    return self._apply(lambda b, v: b.multiply_matpower(v, exp), vecs_and_vars)

  def multiply_cholesky(self, vecs_and_vars, transpose=False):
    return self._apply(lambda b, v: b.multiply_cholesky(v, transpose),
                       vecs_and_vars)

  def multiply_cholesky_inverse(self, vecs_and_vars, transpose=False):
    return self._apply(lambda b, v: b.multiply_cholesky_inverse(v, transpose),
                       vecs_and_vars)

  # ---------------------------------------------------------- update ops
  def _scope(self, scope):
    return tf.name_scope(scope or self._name)

  def _cov_variable_thunks(self):
    return [f.instantiate_cov_variables for f in self.factors]

  def _inv_variable_thunks(self):
    return [f.instantiate_inv_variables for f in self.factors]

  def _lazy(self):
    return self._lazy_statistics_sync and collective.is_distributed()

  def _decay_and_weight(self, should_decay):
    """(decay, weight of the new statistic) of a statistics update:
    should_decay True folds with the estimator's decay, False adds the
    statistic to an arithmetic mean (decay 1, the usual weight 1 - decay;
    kfac 0.2.x's burn-in). A boolean tensor chooses when the op runs."""
    if isinstance(should_decay, (bool, int)) or (
        not tf.is_tensor(should_decay) and hasattr(should_decay, "dtype")):
      if bool(should_decay):
        return self._cov_ema_decay, None
      return 1.0, 1.0 - self._cov_ema_decay
    if not tf.is_tensor(should_decay) or should_decay.dtype != tf.bool:
      raise TypeError("should_decay must be a Python bool or a boolean "
                      "tensor, got %r." % (should_decay,))
    decay = tf.where(should_decay,
                     tf.cast(self._cov_ema_decay, tf.float64),
                     tf.constant(1.0, tf.float64))
    return decay, 1.0 - tf.cast(self._cov_ema_decay, tf.float64)

  def _cov_update_thunks(self, scope=None):
    """One thunk per factor; thunk(should_decay=True) builds its update
    (see _decay_and_weight)."""
    if self._lazy():
      corrections = [f.name for f in self.factors
                     if getattr(f, "is_eigen_correction", False)]
      if corrections:
        raise ValueError(
            "lazy_statistics_sync=True does not support EKFAC blocks (their "
            "scalings depend on the basis of the last refresh): %s. Use "
            "lazy_statistics_sync=False or another approximation." %
            ", ".join(corrections))
      examples = self.replica_examples()

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
      return [make_local(f) for f in self.factors]
    reduced = self._reduced_statistics(scope)

    def make(factor):
      def thunk(should_decay=True):
        with self._scope(scope), self._row_checks():
          stats = (reduced[factor.name] if reduced is not None else
                   [t for t, _ in factor.covariance_statistics()])
          return self._guarded_assign(factor, stats, should_decay,
                                      self._skip_non_finite)
      return thunk
    return [make(f) for f in self.factors]

  def _guarded_assign(self, factor, stats, should_decay, check):
    """Folds `stats` into the factor's average; with `check`, only when
    they are all finite (else the factor is left as it was)."""
    decay, weight = self._decay_and_weight(should_decay)
    extra = () if weight is None else (weight,)

    def assign():
      return factor.make_covariance_assign_op(stats, decay, *extra)
    if not check:
      return assign()
    return nonfinite.guarded_op(stats, assign)

  def _in_branch(self, make_op):
    """make_op() with the sources' gradients rebuilt where the statistics
    read them, when that is inside a conditional branch (lazy/)."""
    with lazy.recompute_in_branch(self._source_grads,
                                  self._rebuild_source_grads):
      return make_op()

  def checked_cov_update(self, pred, gate=None, should_decay=True,
                         scope=None, conditional_reduction=False):
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
        thunks = self._cov_update_thunks(scope)
        op = utils.cond_op(pred, lambda: self._in_branch(lambda: tf.group(
            *[t(should_decay) for t in thunks])))
      else:
        op = self.conditional_cov_update(pred, scope)
      with tf.control_dependencies([op]):
        return tf.constant(True)

    # The statistics are computed on `pred` alone, so that they run in
    # parallel with the model's backward pass (which `gate` waits for); only
    # folding them in waits for the gate.
    def fold(stats, flag):
      def assign_all():
        return tf.group(*[
            self._guarded_assign(f, stats[f.name], should_decay, False)
            for f in self.factors])
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
            [t for factor in self.factors for t in stats[factor.name]])
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
        c for block in self.blocks
        for c in getattr(block, "row_checks", [])])

  def _local_statistics(self):
    """(factors, statistics, symmetric) of this replica's batch, in order
    (a factor may have several statistics)."""
    owners, tensors, symmetric = [], [], []
    with self._row_checks():
      for factor in self.factors:
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
    if getattr(self, "_reduced", None) is None:
      with self._scope(scope), tf.name_scope("cross_replica_statistics"):
        owners, tensors, symmetric = self._local_statistics()
        reduced = collective.all_reduce(
            tensors, collective.MEAN, symmetric,
            weight=self.replica_examples())
      self._reduced = self._by_factor(owners, reduced)
    return self._reduced

  def conditional_cov_update(self, pred, scope=None):
    """An op that updates the statistics' moving averages when `pred`
    holds. Under several replicas (eager sync) the statistics are computed
    now and reduced only when `pred` holds, in a conditional taken for all
    replicas at once (collective.cross_replica_cond): no traffic on the
    steps without a statistics update."""
    if not collective.is_distributed() or self._lazy():
      thunks = self._cov_update_thunks(scope)
      return utils.cond_op(pred, lambda: self._in_branch(
          lambda: tf.group(*[t() for t in thunks])))
    with self._scope(scope):
      owners, tensors, symmetric = self._local_statistics()
      examples = self.replica_examples()

    def fold_reduced(tensors, examples):
      with self._scope(scope), tf.name_scope("cross_replica_statistics"):
        reduced = collective.all_reduce(tensors, collective.MEAN, symmetric,
                                        weight=examples)
        stats = self._by_factor(owners, reduced)
        return tf.group(*[
            self._guarded_assign(factor, stats[factor.name], True,
                                 self._skip_non_finite)
            for factor in self.factors])

    return collective.cross_replica_cond(pred, fold_reduced,
                                         (tensors, examples))

  def replica_examples(self):
    """This replica's number of examples (of the first registered loss),
    the weight of its statistics in the cross-replica average."""
    if self._batch_size is not None:
      return tf.constant(float(self._batch_size), tf.float64)
    towers = self._layers.towers_by_loss
    return tf.cast(tf.add_n([tf.shape(loss.inputs[0])[0]
                             for loss in towers[0]]), tf.float64)

  @property
  def inverse_update_uses_collectives(self):
    """Whether the inverse update ops talk to other replicas (then a
    conditional around them must be a collective.cross_replica_cond)."""
    return self._lazy()

  def _inv_update_thunks(self, scope=None):
    thunks = self._inverse_thunks(scope)
    if not self._lazy():
      return thunks

    def after_sync(thunk):
      def synced():
        # One sync of all factors per graph and replica thread, before
        # any inverse is computed.
        key = (tf.compat.v1.get_default_graph(), threading.get_ident())
        if key not in self._lazy_sync_ops:
          with self._scope(scope):
            self._lazy_sync_ops[key] = lazy_sync.sync_op(self.factors)
        with tf.control_dependencies([self._lazy_sync_ops[key]]):
          return tf.group(thunk())
      return synced
    return [after_sync(t) for t in thunks]

  def _inverse_thunks(self, scope=None):
    """One thunk per factor building its inverse update op."""
    def make(factor):
      def thunk():
        with self._scope(scope):
          return tf.group(*factor.make_inverse_update_ops())
      return thunk
    return [make(f) for f in self.factors]

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
    return (self._cov_variable_thunks(), self._cov_update_thunks(scope),
            self._inv_variable_thunks(), self._inv_update_thunks(scope))

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


UpdateOps = collections.namedtuple(
    "UpdateOps", ["cov_update_ops", "cov_update_op", "inv_update_ops",
                  "inv_update_op", "cov_update_thunks", "inv_update_thunks"])


def _cov_vars_of(factor):
  out = [factor.get_cov_var()]
  if hasattr(factor, "get_cov_dt1"):
    out.append(factor.get_cov_dt1())
  return out


_HALF = (tf.float16, tf.bfloat16)


def _cast_vector(vec, dtype):
  if isinstance(vec, tf.IndexedSlices):
    return tf.IndexedSlices(tf.cast(vec.values, dtype), vec.indices,
                            vec.dense_shape)
  return tf.cast(vec, dtype)


def _names(variables):
  return ", ".join(utils.variable_name(v) for v in variables)


class FisherEstimatorRoundRobin(placement.RoundRobinPlacementMixin,
                                FisherEstimator):
  """FisherEstimator placing each factor's update ops on `cov_devices` /
  `inv_devices` in round-robin order (placement.py); without devices, the
  plain estimator."""


class FisherEstimatorReplicaRoundRobin(
    placement.ReplicaRoundRobinPlacementMixin, FisherEstimator):
  """FisherEstimator whose inverses are computed once across replicas
  (distribute/inverse_placement.py)."""


_STRATEGIES = {None: FisherEstimatorRoundRobin,
               "round_robin": FisherEstimatorRoundRobin,
               "replica_round_robin": FisherEstimatorReplicaRoundRobin}


def estimator_class(placement_strategy):
  """The estimator class of a placement strategy (None, "round_robin" or
  "replica_round_robin")."""
  try:
    return _STRATEGIES[placement_strategy]
  except (KeyError, TypeError):
    raise ValueError("Unknown placement_strategy %r; expected None, "
                     "'round_robin' or 'replica_round_robin'." %
                     (placement_strategy,))


def make_fisher_estimator(placement_strategy=None, **kwargs):
  """Creates a FisherEstimator with a device placement strategy.

  Args:
    placement_strategy: None or "round_robin" (a FisherEstimatorRoundRobin;
      kwargs cov_devices / inv_devices / trans_devices place its ops), or
      "replica_round_robin" (FisherEstimatorReplicaRoundRobin).
    **kwargs: FisherEstimator arguments, plus the strategy's.

  Raises:
    ValueError: for an unknown placement strategy.
  """
  return estimator_class(placement_strategy)(**kwargs)
