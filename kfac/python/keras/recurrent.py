"""Keras LSTM and GRU layers on a LayerCollection.

A Keras LSTM / GRU runs its cell inside a loop (a tf.while_loop of the
backend, or unrolled), so the cell's matmuls, and their per-step output
gradients, are out of the reach of the recorded layer calls. While a
`ModelRecorder` records a training step, a recognised LSTM / GRU layer
(`supported`) is computed here instead, by an equivalent formulation with
the layer's own weights and activations whose tensors K-FAC can register:

* the input projection Z = X @ W (+ b) of every time step is one tensor
  [batch, T, gates * units] computed outside the loop (the loop reads its
  steps), so the gradient w.r.t. Z is each step's gate gradient;
* the recurrent product h_{t-1} @ U is computed in the loop, and a zero
  "probe" tensor P [batch, T, gates * units] made outside the loop is added
  to it at each step, so the gradient w.r.t. P is each step's gradient of
  the recurrent product (for GRU with reset_after=True the reset gate
  multiplies the candidate part of that product: its gradient is not the
  input projection's). An LSTM adds the product to Z before any
  nonlinearity, so its gradient is Z's and it needs no probe;
* the inputs of the recurrent kernel are h_{t-1}: the hidden sequence
  shifted by one step, the initial state first.

The weights are shared over the time steps: each is registered with
`register_fully_connected` on [batch, T, ...] inputs and outputs, the dense
family's KFAC-expand over the shared axis (the same registration as a Dense
layer on a sequence; kfac 0.2.4's `register_fully_connected_multi` /
`num_uses` needs one tensor per step, which a loop does not have). The
registrations (`register`):

  LSTM                 (kernel, bias) on X and Z; recurrent_kernel on
                       h_{t-1} and Z (the two blocks share Z's G factor).
  GRU reset_after=True (bias [2, 3 units]: input and recurrent bias) kernel
                       on X and Z (without bias); recurrent_kernel on
                       h_{t-1} and P; the bias as a dense weight [2, 3 units]
                       whose inputs are one-hot: row 0 is added to the input
                       projection, row 1 to the recurrent product, through a
                       second probe Q [batch, T, 2, 3 units] (KFAC-expand
                       over the 2 T uses).
  GRU reset_after=False (bias [3 units]) (kernel, bias) on X and Z; the
                       recurrent kernel's update/reset columns take h_{t-1},
                       its candidate columns r * h_{t-1}: the kernel is used
                       twice per step, registered on [batch, T, 2, units]
                       inputs (h_{t-1}, r_t * h_{t-1}) and a probe
                       [batch, T, 2, 3 units] (each use's unused columns get
                       no gradient).

The loop (tf.scan over the steps) runs as one op with an exact forward-mode
rule (recurrent_loop.py), so the adaptive step's Jacobian-vector products
pass it as a tangent loop instead of a double backward through the whole
graph. The probes, biases and the gates' blocks of Z and U are added and
split outside the loop, whose body is matmuls and elementwise ops only. The forward equals the layer's (same operations, other summation
order: to rounding). Anything else falls back to the generic block with the reason
(`unsupported_reason`): dropout or recurrent dropout in training, masks,
stateful layers, time_major (tf_keras), cells of another class, a cell run
outside such a layer (keras.layers.RNN(cell)), a layer called several times
in one step.
"""

import collections

import tensorflow as tf

from kfac.python.keras import conv_variants
from kfac.python.keras import keras_flavor
from kfac.python.keras import recurrent_loop

# The recorded call of a recognised layer, kept as the cell's
# `Call.preactivations`: `uses` is a list of (param indices into the plan's
# params, inputs, outputs) for register_fully_connected.
Record = collections.namedtuple("Record", ["layer", "uses"])

_KINDS = {"LSTMCell": "lstm", "GRUCell": "gru"}


def cell_kind(layer):
  """"lstm" / "gru" for a Keras LSTMCell / GRUCell, built or not (not
  tf.compat.v1's cells, which have no recurrent_activation), else None."""
  names = keras_flavor.class_names(layer)
  for name, kind in _KINDS.items():
    if name in names and hasattr(layer, "recurrent_activation"):
      return kind
  return None


def cell_params(cell):
  """The cell's parameters in the order of the Record's indices."""
  return [cell.kernel, cell.recurrent_kernel,
          getattr(cell, "bias", None) if cell.use_bias else None]


def is_recurrent_layer(layer):
  """An LSTM / GRU layer whose cell is an LSTMCell / GRUCell."""
  names = keras_flavor.class_names(layer)
  cell = getattr(layer, "cell", None)
  return (("LSTM" in names or "GRU" in names) and cell is not None and
          cell_kind(cell) is not None)


def unsupported_reason(layer, args, mask, training):
  """Why the layer's call cannot be reformulated, or None."""
  cell = layer.cell
  name = type(layer).__name__
  if len(args) > 1:
    # (Keras 3 and tf_keras order call's other arguments differently)
    return "%s called with positional arguments after its inputs" % name
  if mask is not None:
    return "%s called with a mask" % name
  if getattr(layer, "stateful", False):
    return "stateful %s" % name
  if getattr(layer, "time_major", False):
    return "%s with time_major=True" % name
  dropout = (getattr(cell, "dropout", 0.0) or 0.0,
             getattr(cell, "recurrent_dropout", 0.0) or 0.0)
  if training is not False and max(dropout) > 0:
    return ("%s with dropout=%r, recurrent_dropout=%r in training (the "
            "dropout masks are drawn inside the layer)" % ((name,) + dropout))
  return None


def _initial_state(layer, kwargs, batch, units, dtype, count):
  state = kwargs.get("initial_state")
  if state is None:
    zero = tf.zeros(tf.stack([batch, units]), dtype)
    return [zero] * count
  state = tf.nest.flatten(state)
  if len(state) != count:
    raise ValueError("%s %s: initial_state has %d tensors, expected %d." %
                     (type(layer).__name__, keras_flavor.layer_path(layer),
                      len(state), count))
  return [tf.cast(s, dtype) for s in state]


def _weights(cell, dtype):
  """(kernel, recurrent kernel, bias), each read once outside the loop and
  cast to the compute dtype as the layer's autocast does. (The loop is one
  op with a forward-mode rule, recurrent_loop.py: the adaptive step's
  products reach the recurrent kernel through that op's input.)"""
  def read(var):
    return tf.cast(tf.convert_to_tensor(keras_flavor.unwrap_variable(var)),
                   dtype)
  bias = getattr(cell, "bias", None) if cell.use_bias else None
  return (read(cell.kernel), read(cell.recurrent_kernel),
          None if bias is None else read(bias))


def _time_major(x):
  return tf.transpose(x, [1, 0] + list(range(2, x.shape.rank)))


def _batch_major(x):
  return _time_major(x)


def _project(x, kernel):
  """x [batch, T, in] @ kernel as one MatMul (a direct forward-mode rule;
  an Einsum takes the walk's generic rule, a double backward)."""
  shape = tf.concat([tf.shape(x)[:2], tf.shape(kernel)[1:]], 0)
  return tf.reshape(tf.matmul(tf.reshape(x, [-1, x.shape[-1]]), kernel),
                    shape)


def _gate_steps(t, n):
  """The n gate blocks of t [batch, T, n * units], time-major: split once
  outside the loop, so that the loop body neither splits nor slices (a
  slice in the body costs a StridedSliceGrad of the whole step in every
  backward step)."""
  return tf.split(_time_major(t), n, axis=-1)


def lstm_forward(cell, x, state):
  """LSTM over x [batch, T, in] from state (h0, c0). Returns (outputs
  [batch, T, units], (h_T, c_T), uses).

  The recurrent product adds to the input projection Z before any
  nonlinearity, so its per-step gradient is Z's: the recurrent kernel is
  registered on (h_{t-1}, Z), and its G factor is the input kernel's (one
  factor, shared by the layer collection)."""
  kernel, recurrent, bias = _weights(cell, x.dtype)
  z = _project(x, kernel)
  if bias is not None:
    z = z + bias
  act, rec_act = cell.activation, cell.recurrent_activation

  def step(carry, elems, params):
    h, c = carry
    i, f, g, o = [z_t + tf.matmul(h, u) for z_t, u in zip(elems, params)]
    c = rec_act(f) * c + rec_act(i) * act(g)
    h = rec_act(o) * act(c)
    return h, c

  hs, cs = recurrent_loop.scan(step, _gate_steps(z, 4), tuple(state),
                               tf.split(recurrent, 4, axis=1))
  outputs = _batch_major(hs)
  h_prev = _shifted(state[0], hs)
  first = [0, 2] if bias is not None else [0]
  uses = [(first, x, z), ([1], h_prev, z)]
  return outputs, (hs[-1], cs[-1]), uses


def _shifted(h0, hs):
  """[batch, T, units]: h_{t-1} of every step (h0 first)."""
  return tf.stop_gradient(_batch_major(tf.concat([h0[None], hs[:-1]], 0)))


def gru_forward(cell, x, state):
  """GRU over x [batch, T, in] from state (h0,). Returns (outputs,
  (h_T,), uses); see the module docstring for the registrations.

  The probes and biases are added outside the loop (a zero probe added to
  the input of the loop that the step adds to a product has that product's
  gradient), and the gates' blocks are split outside it too."""
  kernel, recurrent, bias = _weights(cell, x.dtype)
  units = cell.units
  reset_after = cell.reset_after
  z = _project(x, kernel)
  act, rec_act = cell.activation, cell.recurrent_activation
  shape = tf.concat([tf.shape(z)[:2], [2, 3 * units]], 0)
  u_z, u_r, u_h = tf.split(recurrent, 3, axis=1)
  if reset_after:
    probe = tf.zeros_like(z)
    x_in, p_in = z, probe
    bias_probe = None
    if bias is not None:
      in_bias, rec_bias = tf.unstack(bias)  # one read (the use check)
      bias_probe = tf.zeros(shape, z.dtype)
      # (unstack: its gradient is one stack, two slices' are two
      # StridedSliceGrads of the whole probe)
      q_in, q_rec = tf.unstack(bias_probe, axis=2)
      x_in = z + (in_bias + q_in)
      p_in = probe + (rec_bias + q_rec)
    elems = _gate_steps(x_in, 3) + _gate_steps(p_in, 3)
  else:
    if bias is not None:
      z = z + bias
    probe = tf.zeros(shape, z.dtype)
    elems = _gate_steps(z, 3) + _gate_steps(probe[:, :, 0, :2 * units], 2) + [
        _time_major(probe[:, :, 1, 2 * units:])]

  def step(carry, elems, params):
    h = carry[0]
    x_z, x_r, x_h, p_z, p_r, p_h = elems
    w_z, w_r, w_h = params
    zg = rec_act(x_z + (tf.matmul(h, w_z) + p_z))
    r = rec_act(x_r + (tf.matmul(h, w_r) + p_r))
    if reset_after:
      hh = act(x_h + r * (tf.matmul(h, w_h) + p_h))
      return (zg * h + (1 - zg) * hh,)
    rh = r * h
    hh = act(x_h + (tf.matmul(rh, w_h) + p_h))
    return zg * h + (1 - zg) * hh, rh

  # (a carry passed through unchanged breaks the loop's gradient in a TF1
  # graph: reset_after carries h alone)
  carried = recurrent_loop.scan(step, elems, (
      (state[0],) if reset_after else (state[0], tf.zeros_like(state[0]))),
                                (u_z, u_r, u_h))
  hs = carried[0]
  outputs = _batch_major(hs)
  h_prev = _shifted(state[0], hs)
  if reset_after:
    uses = [([0], x, z), ([1], h_prev, probe)]
    if bias_probe is not None:
      batch_t = tf.shape(z)[:2]
      onehot = tf.broadcast_to(tf.eye(2, dtype=z.dtype), tf.concat(
          [batch_t, [2, 2]], 0))
      uses.append(([2], onehot, bias_probe))
  else:
    first = [0, 2] if bias is not None else [0]
    rec_inputs = tf.stack(
        [h_prev, tf.stop_gradient(_batch_major(carried[1]))], 2)
    uses = [(first, x, z), ([1], rec_inputs, probe)]
  return outputs, (hs[-1],), uses


def call(layer, args, kwargs):
  """The outputs of a recognised layer's call (as the layer returns them)
  and its Record."""
  # (Keras 3 names the inputs `sequences`, tf_keras `inputs`)
  x = tf.convert_to_tensor(args[0] if args else kwargs.get(
      "sequences", kwargs.get("inputs")))
  cell = layer.cell
  dtype = x.dtype
  if getattr(layer, "go_backwards", False):
    x = tf.reverse(x, [1])
  kind = cell_kind(cell)
  count = 2 if kind == "lstm" else 1
  state = _initial_state(layer, kwargs, tf.shape(x)[0], cell.units,
                         dtype, count)
  forward = lstm_forward if kind == "lstm" else gru_forward
  outputs, states, uses = forward(cell, x, state)
  output = outputs if layer.return_sequences else states[0]
  if layer.return_state:
    if type(layer).__module__.startswith("tf_keras"):
      result = [output] + list(states)
    else:
      result = (output,) + tuple(states)
  else:
    result = output
  return result, Record(layer, uses)


def no_call_reason(cell):
  return ("%s called outside a Keras LSTM / GRU layer (e.g. in "
          "keras.layers.RNN(cell)): its steps run in a loop K-FAC cannot "
          "see" % type(cell).__name__)


def register(lc, plan, calls):
  """Registers a cell's plan from its recorded calls; raises
  conv_variants.Fallback with the reason where it cannot."""
  fallback = conv_variants.Fallback
  records = [c.preactivations for c in calls]
  for record in records:
    if isinstance(record, str):
      raise fallback(record)
  if not all(isinstance(r, Record) for r in records):
    raise fallback(no_call_reason(plan.layer))
  if len(records) != 1:
    raise fallback("%s called %d times in one step" %
                   (type(records[0].layer).__name__, len(records)))
  blocks = []
  for indices, inputs, outputs in records[0].uses:
    params = [plan.params[i] for i in indices]
    blocks.append(lc.register_fully_connected(
        params[0] if len(params) == 1 else tuple(params), inputs, outputs,
        approx=plan.approx))
  return tuple(blocks)
