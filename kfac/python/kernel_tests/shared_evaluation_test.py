"""The calibration's trial and the immediate damping rule share one
evaluation of loss_fn in the step's graph (optimizers/step.py):
every variable, the damping and the rule's records equal those of the two
separate evaluations, step by step, in float64 (TF1 Sessions with control
flow v1 and v2, tf.function), and the graph evaluates loss_fn once."""

import contextlib

import numpy as np
import pytest

from kfac.python.kernel_tests import adaptive_test as at
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.ops.adaptive import quadratic_model

BURNIN = 3
STEPS = 8


@contextlib.contextmanager
def _separate_evaluations(separate):
  """With separate=True, the step is built as before the shared
  evaluation: a conditional of its own for each."""
  if not separate:
    yield
    return
  cls = quadratic_model.DampingController
  saved = cls.shares_evaluation
  cls.shares_evaluation = lambda self, trial: False
  try:
    yield
  finally:
    cls.shares_evaluation = saved


@contextlib.contextmanager
def _counted_loss(calls):
  """Counts the evaluations of loss_fn built (traced) into the graph."""
  saved = at._loss

  def loss(*args):
    calls.append(1)
    return saved(*args)
  at._loss = loss
  try:
    yield
  finally:
    at._loss = saved


def _run(world, separate, kwargs):
  calls = []
  with _separate_evaluations(separate), _counted_loss(calls):
    trainer = at.Trainer(world, at._inits(), kwargs)
    history = []
    for batch in at._batches(STEPS):
      trainer.step(batch)
      history.append((trainer.params(), trainer.records()))
  return history, len(calls)


@pytest.mark.parametrize("world, control_flow", [
    ("graph", "v2"), ("graph", "v1"), ("function", "v2")])
@pytest.mark.parametrize("decay", [None, 1e-2])
def test_shared_evaluation_equals_separate_ones(world, control_flow, decay):
  kwargs = dict(damping=1e-2, num_burnin_steps=BURNIN,
                calibrate_damping=True, adapt_damping=True,
                damping_adaptation_interval=2,
                update_damping_immediately=True, learning_rate=None,
                momentum=None, momentum_type="qmodel")
  if decay is not None:
    kwargs["decoupled_weight_decay"] = decay
  with util.control_flow(control_flow):
    shared, shared_calls = _run(world, False, kwargs)
    separate, separate_calls = _run(world, True, kwargs)
  # One evaluation of loss_fn in the graph instead of two (the Trainer's
  # loss before the update is the passed loss: no evaluation).
  assert (shared_calls, separate_calls) == (1, 2)
  dampings = set()
  for step, ((params, rec), (ref_params, ref_rec)) in enumerate(
      zip(shared, separate)):
    for a, b in zip(params, ref_params):
      np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15,
                                 err_msg="step %d" % step)
    for key in rec:
      np.testing.assert_allclose(rec[key], ref_rec[key], rtol=1e-12,
                                 err_msg="%s, step %d" % (key, step))
    dampings.add(float(rec["damping"]))
  # The calibration and the rule both moved the damping.
  assert len(dampings) >= 4, dampings
  # Burn-in steps left the parameters where they were; later steps moved.
  start = at._inits()
  for a, b in zip(shared[BURNIN - 1][0], start):
    np.testing.assert_array_equal(a, b)
  assert any(np.any(a != b) for a, b in zip(shared[-1][0], start))
