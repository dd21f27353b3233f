"""K-FAC whose statistic and inverse updates run in background threads.

`AsyncInvCovUpdateKfacOpt` is a `KfacOptimizer` for TF1 Session programs
whose training op only applies the preconditioned step with the inverses
it finds; the factor statistic updates and inverse updates run on their own
in threads started by `run_cov_inv_ops(sess)`, placed round robin on
`cov_devices` / `inv_devices` (e.g. one GPU trains while another inverts):

    opt = kfac.AsyncInvCovUpdateKfacOpt(cov_devices=["/gpu:1"],
                                        inv_devices=["/gpu:1"], ...)
    train_op = opt.minimize(loss)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      opt.run_cov_inv_ops(sess)
      for _ in range(steps):
        sess.run(train_op)
      opt.stop_cov_inv_ops(sess)

Each thread repeatedly takes the next op of one shared cycle (every
factor's statistic update, then every factor's inverse update) and runs it,
so the updates interleave with training in an order that depends on timing:
the run is not reproducible step by step. Until the first inverse update
has run, a step is zero (Kronecker factors) or the gradient over the damping
(diagonal factors, whose statistics start at zero).

The statistic ops read the model's inputs by themselves, so they must come
from the graph (tf.data iterators, queues, variables): a feed_dict reaches
only the training op, and `run_cov_inv_ops` refuses statistics that read a
tf.compat.v1.placeholder. Errors raised in a thread stop all of them and are
raised again by `stop_cov_inv_ops`.
"""

import itertools
import threading

import tensorflow as tf

from kfac.python.ops.optimizers import kfac_optimizer
from kfac.python.ops.tensors import utils

# Threads when num_cov_inv_update_threads is None: half the number of ops,
# at least 1 and at most this.
_MAX_NUM_COV_INV_UPDATE_THREADS = 10


@utils.exclude_from_autograph
class AsyncInvCovUpdateKfacOpt(kfac_optimizer.KfacOptimizer):
  """KfacOptimizer whose statistic and inverse updates run asynchronously
  in background threads of a tf.compat.v1.Session (module docstring)."""

  def __init__(self, cov_devices, inv_devices,
               num_cov_inv_update_threads=None, **kfac_kwargs):
    """Args:
      cov_devices: device strings for the statistic updates, round robin
        over the factors (None or empty: no placement).
      inv_devices: the same for the inverse updates.
      num_cov_inv_update_threads: threads running the updates; None: half
        the number of update ops, between 1 and 10.
      **kfac_kwargs: KfacOptimizer arguments (placement_strategy is
        "round_robin" and cannot be given).
    """
    if "placement_strategy" in kfac_kwargs:
      raise TypeError(
          "AsyncInvCovUpdateKfacOpt places its update ops round robin on "
          "cov_devices / inv_devices: do not pass placement_strategy (got "
          "%r)." % (kfac_kwargs["placement_strategy"],))
    if num_cov_inv_update_threads is not None and (
        isinstance(num_cov_inv_update_threads, bool) or
        int(num_cov_inv_update_threads) != num_cov_inv_update_threads or
        num_cov_inv_update_threads < 1):
      raise ValueError("num_cov_inv_update_threads must be None or an "
                       "integer >= 1, got %r." % (num_cov_inv_update_threads,))
    self._num_cov_inv_update_threads = num_cov_inv_update_threads
    self._cov_inv_ops = None
    self._coord = None
    self._threads = None
    super().__init__(placement_strategy="round_robin",
                     cov_devices=cov_devices, inv_devices=inv_devices,
                     **kfac_kwargs)

  @property
  def cov_inv_ops(self):
    """The ops the threads cycle through: the statistic updates of every
    factor, then their inverse updates (built by apply_gradients)."""
    if self._cov_inv_ops is None:
      raise ValueError("AsyncInvCovUpdateKfacOpt has no update ops yet: "
                       "call minimize() or apply_gradients() first.")
    return list(self._cov_inv_ops)

  @property
  def num_cov_inv_update_threads(self):
    """The number of threads run_cov_inv_ops starts."""
    if self._num_cov_inv_update_threads is not None:
      return int(self._num_cov_inv_update_threads)
    return min(max(len(self.cov_inv_ops) // 2, 1),
               _MAX_NUM_COV_INV_UPDATE_THREADS)

  def apply_gradients(self, grads_and_vars, global_step=None, name=None,
                      layer_collection=None):
    """The training op (a K-FAC step with the current inverses); also
    builds the statistic and inverse update ops run by the threads."""
    if tf.inside_function():
      raise RuntimeError(
          "AsyncInvCovUpdateKfacOpt runs its statistic and inverse updates "
          "in threads of a tf.compat.v1.Session and cannot be used inside a "
          "tf.function; use PeriodicInvCovUpdateKfacOpt there.")
    grads_and_vars = self._prepare(grads_and_vars, layer_collection)
    if self._cov_inv_ops is None:
      est = self._require_estimator()
      est.instantiate_variables()
      (_, cov_thunks, _, inv_thunks) = est.create_ops_and_vars_thunks(
          scope=self.get_name())
      with tf.name_scope(self.get_name() + "_async"):
        self._cov_inv_ops = [thunk() for thunk in cov_thunks + inv_thunks]
    return self._step(grads_and_vars, global_step, name)

  def _check_distributable(self):
    raise NotImplementedError(
        "AsyncInvCovUpdateKfacOpt with several replicas (%s): its update "
        "ops run in Session threads outside the replicas' step; use "
        "PeriodicInvCovUpdateKfacOpt under a distribution strategy." %
        type(tf.distribute.get_strategy()).__name__)

  # ------------------------------------------------------------ threads
  def run_cov_inv_ops(self, sess):
    """Starts the threads that run the statistic and inverse updates in
    `sess` until stop_cov_inv_ops(sess)."""
    ops = self.cov_inv_ops
    if self._threads is not None:
      raise RuntimeError("run_cov_inv_ops was called twice: call "
                         "stop_cov_inv_ops(sess) before starting again.")
    if sess.graph is not ops[0].graph:
      raise ValueError("run_cov_inv_ops: the session runs another graph "
                       "than the one the optimizer built its ops in.")
    fed = _placeholders(ops)
    if fed:
      raise ValueError(
          "AsyncInvCovUpdateKfacOpt: the statistic updates read the "
          "placeholder(s) %s, which the background threads cannot feed. "
          "Feed the model from the graph (tf.data iterator, queue or "
          "variables) or use PeriodicInvCovUpdateKfacOpt." %
          ", ".join(sorted(fed)))
    self._coord = tf.compat.v1.train.Coordinator()
    cycle = itertools.cycle(ops)
    lock = threading.Lock()

    def next_op():
      with lock:
        return next(cycle)

    def work():
      with self._coord.stop_on_exception():
        while not self._coord.should_stop():
          sess.run(next_op())

    self._threads = [
        threading.Thread(target=work, name="kfac_cov_inv_%d" % i,
                         daemon=True)
        for i in range(self.num_cov_inv_update_threads)]
    for thread in self._threads:
      thread.start()

  def stop_cov_inv_ops(self, sess):
    """Stops the threads and waits for them; raises again an error one of
    them met."""
    del sess  # The threads hold it.
    if self._threads is None:
      return
    coord, threads = self._coord, self._threads
    self._coord, self._threads = None, None
    coord.request_stop()
    coord.join(threads)


def _placeholders(ops):
  """Names of the tf.compat.v1.placeholder ops that `ops` depend on."""
  seen, found, stack = set(), set(), list(ops)
  while stack:
    op = stack.pop()
    if op in seen:
      continue
    seen.add(op)
    if op.type == "Placeholder":
      found.add(op.name)
    stack.extend(t.op for t in op.inputs)
    stack.extend(op.control_inputs)
  return found
