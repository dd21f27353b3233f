"""LSTM / GRU registrations (kfac/python/keras/recurrent.py) against float64
brute force.

The formulation a recorded Keras step runs for an LSTM / GRU layer
(`recurrent.lstm_forward` / `gru_forward`: the input projection outside the
loop, zero probes added to the recurrent products) is registered as the
Keras integration registers it (register_fully_connected per use, KFAC-expand
over the time steps), in a TF1 Session graph and in a tf.function
(reference.run_stages), with the exact GGN of a squared error on h_T.

References (never kfac code): an unrolled forward written here (a Python
loop over the steps, tensors of its own per step) whose per-step "taps"
(zeros added to the input projection and to the recurrent products) give,
by tape Jacobians per example, J_nt = d h_T(x_n) / d tap_t. With c uses per
example (T time steps, 2 T for the two uses of a GRU recurrent kernel with
reset_after=False and for the input / recurrent rows of a GRU bias with
reset_after=True):
  A = 1/(N c) sum_{n, uses} [a, 1][a, 1]^T   (a: the use's inputs; the 1 only
                                             with a bias in the block)
  G = 1/(N c) sum_{n, uses} J^T 2I J         (2I: the squared error's
                                             Hessian)
and the preconditioned gradient is (c A (x) G + damping)^-1 with the
pi-split damping of damping / c (as the dense family damps a block shared
over c positions), applied to the weights reshaped to [in, out].
Tolerances: 1e-9 relative on the factors (float64), 1e-8 on the solves.
"""

import types

import numpy as np
import pytest
import tensorflow as tf

from kfac.python.keras import recurrent
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref

TOL = dict(rtol=1e-9, atol=1e-12)
N, T, D, U = 3, 4, 3, 2
KINDS = ("lstm", "gru", "gru_reset_before")


def _gates(kind):
  return 4 if kind == "lstm" else 3


def _inits(kind, seed):
  rng = np.random.RandomState(seed)
  g = _gates(kind) * U
  bias = 0.3 * rng.randn(2, g) if kind == "gru" else 0.3 * rng.randn(g)
  return [0.7 * rng.randn(D, g), 0.7 * rng.randn(U, g), bias]


def _cell(kind, vs):
  return types.SimpleNamespace(
      kernel=vs[0], recurrent_kernel=vs[1], bias=vs[2], use_bias=True,
      units=U, activation=tf.tanh, recurrent_activation=tf.sigmoid,
      reset_after=kind == "gru")


def _formulation(kind, vs, x):
  forward = recurrent.lstm_forward if kind == "lstm" else recurrent.gru_forward
  h0 = tf.zeros([x.shape[0], U], x.dtype)
  state = [h0, h0] if kind == "lstm" else [h0]
  _, states, uses = forward(_cell(kind, vs), x, state)
  return states[0], uses


# ------------------------------------------------------------- brute force
def _unrolled(kind, w, x, taps):
  """h_T and the per-step inputs of every use, from a Python loop over the
  steps; taps[name][t] are added where the module docstring says."""
  kernel, rec, bias = w
  n = x.shape[0]
  h = tf.zeros([n, U], tf.float64)
  c = tf.zeros([n, U], tf.float64)
  inputs = {"in": [], "rec": [], "rec2": []}
  for t in range(T):
    xt = x[:, t]
    inputs["in"].append(xt)
    inputs["rec"].append(h)
    if kind == "lstm":
      gates = (tf.matmul(xt, kernel) + bias + taps["in"][t]) + (
          tf.matmul(h, rec) + taps["rec"][t])
      i, f, g, o = [gates[:, k * U:(k + 1) * U] for k in range(4)]
      c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
      h = tf.sigmoid(o) * tf.tanh(c)
      continue
    if kind == "gru":
      xp = tf.matmul(xt, kernel) + bias[0] + taps["in"][t]
      inner = tf.matmul(h, rec) + bias[1] + taps["rec"][t]
      z = tf.sigmoid(xp[:, :U] + inner[:, :U])
      r = tf.sigmoid(xp[:, U:2 * U] + inner[:, U:2 * U])
      hh = tf.tanh(xp[:, 2 * U:] + r * inner[:, 2 * U:])
    else:
      xp = tf.matmul(xt, kernel) + bias + taps["in"][t]
      inner = tf.matmul(h, rec[:, :2 * U]) + taps["rec"][t]
      z = tf.sigmoid(xp[:, :U] + inner[:, :U])
      r = tf.sigmoid(xp[:, U:2 * U] + inner[:, U:])
      inputs["rec2"].append(r * h)
      hh = tf.tanh(xp[:, 2 * U:] + tf.matmul(r * h, rec[:, 2 * U:]) +
                   taps["rec2"][t])
    h = z * h + (1 - z) * hh
  return h, inputs


def _tap_widths(kind):
  g = _gates(kind) * U
  if kind == "gru_reset_before":
    return {"in": g, "rec": 2 * U, "rec2": U}
  return {"in": g, "rec": g}


def _brute_force(kind, inits, x):
  """{use name: (inputs [N, steps, in], J [N, steps, U, width])}."""
  w = [tf.constant(v) for v in inits]
  widths = _tap_widths(kind)
  jac = {name: [] for name in widths}
  ins = None
  for n in range(N):
    taps = {name: [tf.zeros([1, width], tf.float64) for _ in range(T)]
            for name, width in widths.items()}
    names = sorted(widths)
    flat = [tap for name in names for tap in taps[name]]
    with tf.GradientTape(persistent=True) as tape:
      tape.watch(flat)
      h, inputs = _unrolled(kind, w, tf.constant(x[n:n + 1]), taps)
      h = tf.reshape(h, [-1])
    parts = tape.jacobian(h, flat, experimental_use_pfor=False)
    del tape
    for k, name in enumerate(names):
      jac[name].append(np.stack(
          [p.numpy()[:, 0] for p in parts[k * T:(k + 1) * T]]))
  _, inputs = _unrolled(kind, w, tf.constant(x), {
      name: [tf.zeros([N, width], tf.float64)] * T
      for name, width in widths.items()})
  ins = {name: np.stack([v.numpy() for v in values], 1)
         for name, values in inputs.items() if values}
  return ins, {name: np.stack(j) for name, j in jac.items()}


def _factors(rows, jacs):
  """A and G of the module docstring from rows [N, c, in] and Jacobians
  [N, c, out, width]."""
  count = rows.shape[0] * rows.shape[1]
  a = np.einsum("nci,ncj->ij", rows, rows) / count
  g = 2.0 * np.einsum("ncoi,ncoj->ij", jacs, jacs) / count
  return a, g


def _with_ones(rows):
  return np.concatenate([rows, np.ones(rows.shape[:2] + (1,))], axis=2)


def _pad(jac, before, after):
  return np.pad(jac, [(0, 0), (0, 0), (0, 0), (before, after)])


def _expected(kind, inits, x):
  """[(A, G)] per registered block, in registration order."""
  ins, jac = _brute_force(kind, inits, x)
  g = _gates(kind) * U
  if kind == "lstm":
    return [_factors(_with_ones(ins["in"]), jac["in"]),
            _factors(ins["rec"], jac["rec"])]
  if kind == "gru":
    eye = np.broadcast_to(np.eye(2), (N, T, 2, 2)).reshape(N, 2 * T, 2)
    bias_jac = np.stack([jac["in"], jac["rec"]], 2).reshape(N, 2 * T, U, g)
    return [_factors(ins["in"], jac["in"]), _factors(ins["rec"], jac["rec"]),
            _factors(eye, bias_jac)]
  rows = np.stack([ins["rec"], ins["rec2"]], 2).reshape(N, 2 * T, U)
  uses = np.stack([_pad(jac["rec"], 0, U), _pad(jac["rec2"], 2 * U, 0)],
                  2).reshape(N, 2 * T, U, g)
  return [_factors(_with_ones(ins["in"]), jac["in"]), _factors(rows, uses)]


# ------------------------------------------------------------- kfac
def _run(world, kind, inits, x, fetch, damping=1e-2):
  store = util.new_store()
  targets = np.random.RandomState(99).randn(N, U)

  def build(vs):
    import kfac  # pylint: disable=g-import-not-at-top
    lc = kfac.LayerCollection()
    h, uses = _formulation(kind, vs, tf.constant(x))
    for indices, inputs, outputs in uses:
      params = tuple(vs[i] for i in indices)
      lc.register_fully_connected(params[0] if len(params) == 1 else params,
                                  inputs, outputs)
    lc.register_squared_error_loss(h, targets=tf.constant(targets))
    est, ops = util.estimator_stages(store, lc, vs, "exact_GGN",
                                     damping=damping)
    return ops + [fetch(est, vs)]

  return ref.run_stages(world, inits, build)[-1]


def _data(seed):
  rng = np.random.RandomState(seed)
  return rng.randn(N, T, D), rng


def _uses_per_example(kind, block):
  return 2 * T if kind != "lstm" and block > 0 and (
      kind == "gru_reset_before" or block == 2) else T


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
def test_factors_and_preconditioned_gradient_are_the_brute_force_ones(
    world, kind):
  inits = _inits(kind, 1)
  x, rng = _data(2)
  damping = 0.03
  vec = [rng.randn(*i.shape) for i in inits]

  def fetch(est, vs):
    pairs = [(tf.constant(v), var) for v, var in zip(vec, vs)]
    return ([[tf.identity(f.get_cov()) for f in b.factors()]
             for b in est.blocks],
            [r for r, _ in est.multiply_inverse(pairs)])

  factors, inv = _run(world, kind, inits, x, fetch, damping=damping)
  expected = _expected(kind, inits, x)
  assert len(factors) == len(expected)
  for (a, g), (want_a, want_g) in zip(factors, expected):
    np.testing.assert_allclose(a, want_a, **TOL)
    np.testing.assert_allclose(g, want_g, **TOL)
  # The blocks' parameters: kernel (+ bias) / recurrent kernel / bias.
  groups = ([[0, 2], [1]] if kind != "gru" else [[0], [1], [2]])
  for block, (indices, (a, g)) in enumerate(zip(groups, expected)):
    c = _uses_per_example(kind, block)
    dense = c * ref.pi_damped_kron(a, g, damping / c)
    flat = np.concatenate([vec[i].ravel() for i in indices])
    want = np.linalg.solve(dense, flat)
    got = np.concatenate([inv[i].ravel() for i in indices])
    np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-11)


def test_the_probes_carry_each_steps_gradient():
  """The gradient w.r.t. the registered outputs (input projection, probes)
  is the tap Jacobian of the unrolled reference, step by step (a check of
  the formulation itself, independent of the factors)."""
  for kind in KINDS:
    inits = _inits(kind, 3)
    x, _ = _data(4)
    vs = [tf.Variable(v) for v in inits]
    _, jac = _brute_force(kind, inits, x)
    # d sum_n h_T[n, 0] / d outputs == sum over the batch of J rows 0.

    @tf.function
    def grads():
      h, uses = _formulation(kind, vs, tf.constant(x))
      # (the probes are zeros made in the graph: tf.gradients reaches them)
      return tf.gradients(tf.reduce_sum(h[:, 0]), [u[2] for u in uses])
    got = [g.numpy() for g in grads()]
    np.testing.assert_allclose(got[0], jac["in"][:, :, 0], **TOL)
    rec = got[1]
    if kind == "gru_reset_before":
      np.testing.assert_allclose(rec[:, :, 0, :2 * U], jac["rec"][:, :, 0],
                                 **TOL)
      np.testing.assert_allclose(rec[:, :, 1, 2 * U:], jac["rec2"][:, :, 0],
                                 **TOL)
      assert not rec[:, :, 0, 2 * U:].any() and not rec[:, :, 1, :2 * U].any()
    else:
      np.testing.assert_allclose(rec, jac["rec"][:, :, 0], **TOL)


def test_lstm_recurrent_kernel_shares_the_input_kernels_output_factor():
  """The LSTM's recurrent product adds to the input projection before any
  nonlinearity, so both kernels are registered on Z: one G factor (its
  statistics computed once; the values are checked against the brute force
  in test_factors_and_preconditioned_gradient_are_the_brute_force_ones)."""
  import kfac  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():
    vs = [tf.Variable(v) for v in _inits("lstm", 1)]
    lc = kfac.LayerCollection()
    h, uses = _formulation("lstm", vs, tf.constant(_data(2)[0]))
    for idx, ins, outs in uses:
      lc.register_fully_connected(
          tuple(vs[i] for i in idx) if len(idx) > 1 else vs[idx[0]], ins,
          outs)
    lc.register_squared_error_loss(h, targets=tf.zeros_like(h))
    est, _ = util.estimator_stages(util.new_store(), lc, vs, "exact_GGN")
    kernel, rec = est.blocks
    assert uses[0][2] is uses[1][2]
    assert kernel.factors()[1] is rec.factors()[1]
    assert kernel.factors()[0] is not rec.factors()[0]


def _loop_body_op_types(graph):
  """The op types of the While bodies inside the function call ops of
  `graph` (recurrent_loop.scan's loop)."""
  types_ = set()
  for op in graph.get_operations():
    if op.type not in ("PartitionedCall", "StatefulPartitionedCall"):
      continue
    fn = graph._get_function(op.get_attr("f").name)  # pylint: disable=protected-access
    for inner in fn.graph.get_operations():
      if inner.type in ("While", "StatelessWhile"):
        body = fn.graph._get_function(  # pylint: disable=protected-access
            inner.get_attr("body").name)
        types_ |= {o.type for o in body.graph.get_operations()}
  return types_


@pytest.mark.parametrize("kind", KINDS)
def test_the_loop_body_neither_splits_nor_slices(kind):
  """The gates' blocks, probes and biases are split outside the loop: a
  split or slice in the body costs a copy per step, and a slice a
  StridedSliceGrad of the whole step in every backward step (measured: a
  third of the statistics' cost of a GRU(128) step)."""
  with tf.Graph().as_default() as graph:
    vs = [tf.Variable(v) for v in _inits(kind, 1)]
    _formulation(kind, vs, tf.constant(_data(2)[0]))
    body = _loop_body_op_types(graph)
  assert "MatMul" in body, body  # (the loop was found)
  assert not body & {"Split", "SplitV", "StridedSlice", "Slice", "Unpack",
                     "Einsum"}, body
