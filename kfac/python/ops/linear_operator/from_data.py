"""One pass over a dataset: the statistics of a CurvatureOperator averaged
over its batches (`operator_from_data`, the body of
`curvature.curvature_from_data` and `CurvatureOperator.from_data`; this
module does not import curvature.py).

The model is registered by a user function `model_fn(batch, layer_collection)`
(it runs the model on the batch and registers the layers and the losses;
what it returns is ignored). The statistics are averaged over the whole
dataset, weighted by the examples of each batch (an exact mean, not the
optimizer's moving average): after the pass every factor holds the mean of
its statistic over all examples.

EKFAC blocks need two passes: pass 1 accumulates every factor whose
`is_eigen_correction` is falsy, then the estimator's inverse update ops
refresh the eigenbases, then pass 2 accumulates the eigenvalue corrections
(factors with `is_eigen_correction=True`) in those bases. Models without
such factors make one pass.

Runs eagerly (the statistics of a batch are computed by a tf.function) or in
a TF1 graph with `session=`.
"""

import time

import tensorflow as tf

from kfac.python.ops.estimation import estimator as estimator_lib
from kfac.python.ops.collection import layer_collection as lc_lib
from kfac.python.ops.tensors import state
from kfac.python.ops.tensors import utils
from kfac.python.ops.linear_operator import spectral

__all__ = ["operator_from_data"]


class _Progress:
  """A line every `every` batches and at the end of a pass."""

  def __init__(self, verbose, every, label):
    self._verbose = verbose
    self._every = max(1, int(every))
    self._label = label
    self._start = time.time()
    self.batches = 0
    self.examples = 0.0

  def update(self, examples):
    self.batches += 1
    self.examples += float(examples)
    if self._verbose and self.batches % self._every == 0:
      self._line()

  def _line(self, done=False):
    print("%s: %d batches, %d examples, %.1f s%s" %
          (self._label, self.batches, int(round(self.examples)),
           time.time() - self._start, " (done)" if done else ""),
          flush=True)

  def finish(self):
    if self._verbose:
      self._line(done=True)


def _is_correction(factor):
  return bool(getattr(factor, "is_eigen_correction", False))


def _check_steps(dataset, steps):
  if steps is not None:
    if int(steps) < 1:
      raise ValueError("steps must be a positive number of batches, got %r."
                       % (steps,))
    return int(steps)
  if isinstance(dataset, tf.data.Dataset):
    cardinality = tf.get_static_value(dataset.cardinality())
    if (cardinality is not None and
        int(cardinality) == int(tf.data.INFINITE_CARDINALITY)):
      raise ValueError("The dataset repeats forever: pass steps= (the "
                       "number of batches of the pass).")
  return None


def _batches(dataset, steps):
  for i, batch in enumerate(dataset):
    if steps is not None and i >= steps:
      return
    yield batch


@utils.exclude_from_autograph
class _Statistics:
  """Builds the registration and the estimator on a batch (in the current
  graph), with the statistics in one StateStore. Its methods are not
  converted by autograph (kfac builds graphs with plain Python), while the
  user's model_fn, called from the traced step itself, is."""

  def __init__(self, model_fn, damping, estimation_mode, name):
    self.model_fn = model_fn
    self._damping = damping
    self._mode = estimation_mode
    self._name = name
    self.store = state.StateStore(name + "_statistics")
    self.estimator = None

  def new_collection(self):
    return lc_lib.LayerCollection(name=self._name)

  def estimator_of(self, lc):
    est = estimator_lib.FisherEstimator(
        variables=lambda: lc.registered_variables, cov_ema_decay=0.5,
        damping=self._damping, layer_collection=lc,
        estimation_mode=self._mode, state_store=self.store,
        name=self._name)
    est.instantiate_variables()
    self.estimator = est
    return est

  def accumulate(self, lc, phase):
    """This batch's statistics added to the means of the factors of
    `phase` (1: not eigen corrections, 2: eigen corrections); returns the
    batch's number of examples (after the update)."""
    op, examples = self.accumulate_op(self.estimator_of(lc), phase)
    with tf.control_dependencies([op]):
      return tf.identity(examples)

  @staticmethod
  def accumulate_op(est, phase):
    examples = est.replica_examples()
    ops = [f.make_covariance_update_op(1.0, ema_weight=examples)
           for f in est.factors if _is_correction(f) == (phase == 2)]
    return tf.group(*ops), examples

  def refresh_bases(self, lc):
    thunks = self.estimator_of(lc).create_ops_and_vars_thunks()[3]
    tf.group(*[t() for t in thunks])

  def needs_bases(self):
    """Whether the views need the estimator's inverse update: EKFAC
    (eigen corrections) or blocks viewed through their stored inverses."""
    est = self.estimator
    return (any(_is_correction(f) for f in est.factors) or
            any(spectral.block_kind(b) == "dense" for b in est.blocks))


def operator_from_data(operator_class, model_fn, dataset, damping, damped,
                       estimation_mode, steps, verbose, log_every, session,
                       name):
  """An `operator_class` (a CurvatureOperator class) of the statistics
  averaged over `dataset`; see curvature.curvature_from_data for the
  arguments (all required here)."""
  if not callable(model_fn):
    raise TypeError("model_fn must be callable as model_fn(batch, "
                    "layer_collection), got %r." % (model_fn,))
  steps = _check_steps(dataset, steps)
  stats = _Statistics(model_fn, damping, estimation_mode, name)
  if tf.executing_eagerly():
    est = _eager_passes(stats, dataset, steps, verbose, log_every)
    op = operator_class(est.layers, damped=damped, name=name)
  else:
    if session is None:
      raise ValueError(
          "curvature_from_data in a graph: called inside a tf.function it "
          "cannot run its own pass (call it eagerly); in a TF1 graph pass "
          "session= (a tf.compat.v1.Session of this graph).")
    est = _session_passes(stats, dataset, steps, verbose, log_every, session)
    op = operator_class(est.layers, damped=damped, name=name)
    session.run(tf.compat.v1.variables_initializer(op.state_variables))
    session.run(op.refresh())
  object.__setattr__(op, "statistics_store", stats.store)
  return op


def _eager_passes(stats, dataset, steps, verbose, log_every):
  def make(phase):
    def step(batch):
      lc = stats.new_collection()
      stats.model_fn(batch, lc)
      return stats.accumulate(lc, phase)
    return tf.function(step, reduce_retracing=True)

  first = None
  progress = _Progress(verbose, log_every, "curvature statistics, pass 1")
  accumulate = make(1)
  for batch in _batches(dataset, steps):
    if first is None:
      first = batch
    progress.update(accumulate(batch).numpy())
  if first is None:
    raise ValueError("The dataset gave no batch.")
  progress.finish()
  if not stats.needs_bases():
    return stats.estimator

  def refresh(batch):
    lc = stats.new_collection()
    stats.model_fn(batch, lc)
    stats.refresh_bases(lc)
  tf.function(refresh)(first)
  if any(_is_correction(f) for f in stats.estimator.factors):
    progress = _Progress(verbose, log_every, "curvature statistics, pass 2 "
                         "(eigenvalue corrections)")
    accumulate = make(2)
    for batch in _batches(dataset, steps):
      progress.update(accumulate(batch).numpy())
    progress.finish()
  return stats.estimator


def _session_passes(stats, dataset, steps, verbose, log_every, session):
  if not isinstance(dataset, tf.data.Dataset):
    raise TypeError("In a TF1 graph, dataset must be a tf.data.Dataset, got "
                    "%r." % (dataset,))
  iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
  lc = stats.new_collection()
  stats.model_fn(iterator.get_next(), lc)
  est = stats.estimator_of(lc)
  phases = {1: stats.accumulate_op(est, 1), 2: stats.accumulate_op(est, 2)}
  bases = tf.group(*[t() for t in est.create_ops_and_vars_thunks()[3]])
  session.run(tf.compat.v1.variables_initializer(stats.store.variables))

  def run_pass(phase, label):
    session.run(iterator.initializer)
    progress = _Progress(verbose, log_every, label)
    while steps is None or progress.batches < steps:
      try:
        _, examples = session.run(phases[phase])
      except tf.errors.OutOfRangeError:
        break
      progress.update(examples)
    if progress.batches == 0:
      raise ValueError("The dataset gave no batch.")
    progress.finish()

  run_pass(1, "curvature statistics, pass 1")
  session.run(bases)
  if any(_is_correction(f) for f in est.factors):
    run_pass(2, "curvature statistics, pass 2 (eigenvalue corrections)")
  return est
