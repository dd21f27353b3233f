"""The RNN over image rows shared by the RNN demo and the benchmarks.

The image's rows are the time steps, a tanh RNN h_t = tanh(x_t W_x +
h_{t-1} W_h + b) with h_0 = 0, then a dense layer (logits) on the last
state. The recurrent weights are used once per time step, so K-FAC
registers them with `register_fully_connected_multi` ("kron_indep"):
  (W_x, b)  inputs [x_1, ..., x_T],      outputs [a_1, ..., a_T]
  W_h       inputs [h_1, ..., h_{T-1}],  outputs [a_2, ..., a_T]
where a_t = x_t W_x + h_{t-1} W_h + b is the pre-activation. (The use of W_h
at t=1 is left out: its input h_0 is zero.)
"""

import numpy as np
import tensorflow as tf

import convnet_model


def init_params(hidden_units, image_shape, num_classes, seed):
  """Glorot-uniform input and output weights, orthogonal W_h, zero biases."""
  rng = np.random.RandomState(seed)
  width, hidden = image_shape[1], hidden_units
  q, r = np.linalg.qr(rng.randn(hidden, hidden))
  glorot = convnet_model.glorot_uniform
  return {
      "rnn/w_x": glorot(rng, (width, hidden), width, hidden),
      "rnn/b": np.zeros([hidden], np.float32),
      "rnn/w_h": (q * np.sign(np.diag(r))).astype(np.float32),
      "out/w": glorot(rng, (hidden, num_classes), hidden, num_classes),
      "out/b": np.zeros([num_classes], np.float32),
  }


def forward(images, variables, layer_collection=None):
  """Logits [batch, classes] of images [batch, rows, width].

  Args:
    images: float32 [batch, rows, width]; row t is the input at time t.
    variables: {name: tf.Variable} with the names of init_params.
    layer_collection: a kfac.LayerCollection, or None for no registration.
  """
  w_x, b, w_h = variables["rnn/w_x"], variables["rnn/b"], variables["rnn/w_h"]
  xs = tf.unstack(images, axis=1)
  states, pre_activations = [], []
  h = None
  for x in xs:
    a = tf.matmul(x, w_x) + b
    if h is not None:  # h_0 = 0
      a += tf.matmul(h, w_h)
    h = tf.tanh(a)
    pre_activations.append(a)
    states.append(h)
  w_out, b_out = variables["out/w"], variables["out/b"]
  logits = tf.matmul(h, w_out) + b_out
  if layer_collection is not None:
    lc = layer_collection
    lc.register_fully_connected_multi((w_x, b), xs, pre_activations)
    lc.register_fully_connected_multi(w_h, states[:-1], pre_activations[1:])
    lc.register_fully_connected((w_out, b_out), h, logits)
  return logits


def describe(hidden_units, image_shape):
  return ("%d rows of %d pixels -> tanh RNN %d -> dense 10 on the last "
          "state" % (image_shape[0], image_shape[1], hidden_units))
