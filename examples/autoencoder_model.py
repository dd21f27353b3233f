"""The deep tanh autoencoder shared by the demo and the benchmarks.

Fully connected layers with tanh activations, a linear code layer in the
middle (as in Hinton & Salakhutdinov 2006 and the K-FAC paper), and logits
at the output trained with the sigmoid cross-entropy reconstruction loss
(summed over pixels, averaged over the batch).

Parameters are created from numpy arrays so that several optimizers can start
from exactly the same weights.
"""

import numpy as np
import tensorflow as tf

# The classic deep autoencoder of the K-FAC paper (encoder half).
FULL_MNIST_ENCODER = (784, 1000, 500, 250, 30)


def mirrored_sizes(encoder_sizes):
  """(784, 256, 30) -> [784, 256, 30, 256, 784]."""
  encoder_sizes = list(encoder_sizes)
  return encoder_sizes + encoder_sizes[-2::-1]


def code_layer_index(layer_sizes):
  """Index of the layer that produces the code (linear, no tanh)."""
  return (len(layer_sizes) - 1) // 2 - 1


def init_params(layer_sizes, seed):
  """Glorot-uniform weights [in, out] and zero biases, as float32 numpy."""
  rng = np.random.RandomState(seed)
  params = []
  for fan_in, fan_out in zip(layer_sizes[:-1], layer_sizes[1:]):
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    w = rng.uniform(-limit, limit, size=(fan_in, fan_out)).astype(np.float32)
    b = np.zeros([fan_out], np.float32)
    params.append((w, b))
  return params


def make_variables(params_np, name="autoencoder"):
  """tf.Variables (W, b) per layer, initialised from numpy arrays."""
  variables = []
  for i, (w, b) in enumerate(params_np):
    variables.append((tf.Variable(w, name="%s/w%d" % (name, i)),
                      tf.Variable(b, name="%s/b%d" % (name, i))))
  return variables


def flat_variables(variables):
  return [v for pair in variables for v in pair]


def forward(x, variables, layer_collection=None):
  """Logits of the reconstruction; registers every layer when asked.

  Args:
    x: [batch, D] inputs in [0, 1].
    variables: list of (W, b) from make_variables.
    layer_collection: a kfac.LayerCollection, or None for no registration.

  Returns:
    logits: [batch, D], the pre-activations of the output layer.
  """
  num_sizes = len(variables) + 1
  linear_layers = {code_layer_index([0] * num_sizes), len(variables) - 1}
  h = x
  for i, (w, b) in enumerate(variables):
    pre = tf.matmul(h, w) + b
    if layer_collection is not None:
      layer_collection.register_fully_connected((w, b), h, pre)
    h = pre if i in linear_layers else tf.tanh(pre)
  return h


def reconstruction_loss(x, logits):
  """Sigmoid cross-entropy summed over pixels, averaged over the batch."""
  return tf.reduce_mean(tf.reduce_sum(
      tf.nn.sigmoid_cross_entropy_with_logits(labels=x, logits=logits),
      axis=1))


def register_loss(layer_collection, x, logits):
  layer_collection.register_sigmoid_cross_entropy_loss(logits, targets=x)
