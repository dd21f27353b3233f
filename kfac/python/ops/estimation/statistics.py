"""The Fisher estimator's statistics part: the ops that fold each factor's
covariance statistics into its moving average, with the non-finite guard
(reliability/nonfinite.py), the cross-replica reduction (distribute/) and
the lazy rebuild of the sampled backward pass inside conditionals (lazy/).

`Statistics` is made by `estimator.FisherEstimator` once its factors exist;
it gets them, the blocks, the gradient sources, the configuration and the
placement policy (placement.py) in its constructor. Its entry points:
`variable_thunks`, `update_thunks`, `checked_update` and
`conditional_update`.
"""

import collections
import contextlib
import weakref

import tensorflow as tf

from kfac.python.ops import lazy
from kfac.python.ops.tensors import utils
from kfac.python.ops.distribute import collective
from kfac.python.ops.distribute import lazy_sync
from kfac.python.ops.reliability import nonfinite


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
