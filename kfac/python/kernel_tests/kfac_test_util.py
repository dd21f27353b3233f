"""Tiny models registered with kfac, shared by the tests."""

import contextlib

import numpy as np
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import reference as ref

SIZES = (3, 4, 3)  # input 3, hidden 4 (tanh), 3 outputs


def data(n, seed=0, sizes=SIZES):
  rng = np.random.RandomState(seed)
  x = rng.randn(n, sizes[0])
  labels = rng.randint(0, sizes[-1], n)
  return x, labels


def register_mlp(variables, x, lc, approx=None, generic=None, batch_size=None):
  """Builds the tanh MLP on `variables` ([W0, b0, W1, b1]) and registers its
  layers: dense with `approx`, or generic with `generic` ("full"/"diagonal").
  Returns the logits."""
  record = []
  logits = ref.mlp_forward(variables, x, record=record)
  for params, inputs, outputs in record:
    if generic:
      lc.register_generic(params, batch_size, approx=generic)
    else:
      lc.register_fully_connected(params, inputs, outputs, approx=approx)
  return logits


def layer_slices(sizes=SIZES, bias=True):
  """Flat-parameter index ranges of each layer, in ref.flat order."""
  out, start = [], 0
  for i in range(len(sizes) - 1):
    size = sizes[i] * sizes[i + 1] + (sizes[i + 1] if bias else 0)
    out.append(slice(start, start + size))
    start += size
  return out


def categorical_loss(lc, logits, labels):
  lc.register_softmax_cross_entropy_loss(logits, targets=tf.constant(labels))


def new_store():
  """State that outlives tf.function traces (create it outside the trace)."""
  return kfac.state.StateStore("test_state")


def estimator_stages(store, lc, variables, mode, damping=1e-2, exps=(-1,),
                     decay=0.5, **kwargs):
  """Makes an estimator; returns (estimator, [cov op, inverse op])."""
  est = kfac.estimator.FisherEstimator(
      variables=variables, cov_ema_decay=decay, damping=damping,
      layer_collection=lc, exps=exps, estimation_mode=mode,
      state_store=store, **kwargs)
  (_, cov_op, _, inv_op, _, _) = est.make_vars_and_create_ops()
  return est, [cov_op, inv_op]


@contextlib.contextmanager
def control_flow(version):
  """Builds tf.cond / tf.while_loop with control flow "v1" (as graphs built
  after tf.compat.v1.disable_v2_behavior() do) or "v2" (the default) inside
  the block; the process-wide toggle is restored after it."""
  from tensorflow.python.ops import control_flow_util  # pylint: disable=g-import-not-at-top
  saved = control_flow_util.ENABLE_CONTROL_FLOW_V2
  if version == "v1":
    tf.compat.v1.disable_control_flow_v2()
  elif version != "v2":
    raise ValueError("control flow 'v1' or 'v2', got %r" % (version,))
  try:
    yield version
  finally:
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = saved


@contextlib.contextmanager
def keras_float64(keras):
  """Keras's floatx and (Keras 3) its global dtype policy set to float64
  inside the block, restored after: float64 layers for the brute-force
  comparisons. `keras` is the flavour's module (Keras 3 or tf_keras)."""
  old = keras.backend.floatx()
  config = getattr(keras, "config", None)
  set_policy = getattr(config, "set_dtype_policy", None)
  old_policy = config.dtype_policy() if set_policy else None
  keras.backend.set_floatx("float64")
  if set_policy:
    set_policy("float64")
  try:
    yield
  finally:
    keras.backend.set_floatx(old)
    if set_policy:
      set_policy(old_policy)
