"""The three benchmark workloads: deep autoencoder, convnet, RNN.

Each `Workload` knows its data (Fashion-MNIST from the offline copy, see
examples/datasets.py; sklearn's 8x8 digits for quick runs), its initial
weights, its forward pass (which registers the layers on a LayerCollection
when given one), its loss and its loss registration. Batches are
(inputs, targets) numpy pairs; for the autoencoder the targets are the
inputs.

  autoencoder  784-1000-500-250-30-250-500-1000-784 tanh, linear code,
               sigmoid cross-entropy summed over pixels, + 1e-5/2 ||w||^2
               (the K-FAC paper's MNIST autoencoder; register_fully_connected)
  convnet      28x28 -> conv 5x5 (16) -> pool -> conv 5x5 (32) -> pool ->
               dense 128 -> dense 10, softmax cross-entropy
               (register_conv2d with sub-sampled patches, register_fully_connected)
  rnn          28 rows of 28 pixels -> tanh RNN 128 -> dense 10 on the last
               state (register_fully_connected_multi)
"""

import os
import platform
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=g-import-not-at-top,wrong-import-position
import autoencoder_model
import classifier_common
import convnet_model
import datasets
import rnn_model

AUTOENCODER_L2 = 1e-5


class Data(object):
  """Training inputs/targets, a fixed evaluation subset, and test data."""

  def __init__(self, name, x, y, test_x=None, test_y=None):
    self.name = name
    self.x, self.y = x, y
    self.test_x, self.test_y = test_x, test_y

  def __len__(self):
    return len(self.x)

  def batch(self, indices):
    return self.x[indices], self.y[indices]


class Workload(object):
  """Base class: subclasses define the model; see the module docstring."""

  name = None
  batch_size = 256
  l2_reg = 0.0
  target_dtype = tf.int64

  def load(self, dataset, max_examples):
    raise NotImplementedError

  def init_params(self, data, seed):
    raise NotImplementedError

  def make_variables(self, params_np):
    return {k: tf.Variable(v, name=k.replace("/", "_"))
            for k, v in params_np.items()}

  @staticmethod
  def flat_variables(variables):
    return list(variables.values())

  def forward(self, x, variables, layer_collection=None):
    raise NotImplementedError

  def loss(self, y, logits, variables):
    """The mean training loss (with the L2 term, where there is one)."""
    return classifier_common.mean_cross_entropy(y, logits)

  def register_loss(self, layer_collection, logits, y):
    layer_collection.register_softmax_cross_entropy_loss(logits, targets=y)

  def describe(self, data):
    raise NotImplementedError

  def eval_loss_name(self):
    return "softmax cross-entropy, mean over a fixed training subset"


class Autoencoder(Workload):
  """The deep autoencoder of the K-FAC paper."""

  name = "autoencoder"
  batch_size = 1000
  l2_reg = AUTOENCODER_L2
  target_dtype = tf.float32

  def __init__(self, encoder=(1000, 500, 250, 30)):
    self.encoder = tuple(encoder)

  def load(self, dataset, max_examples):
    name, images = datasets.load_autoencoder_data(
        prefer=dataset, max_examples=max_examples)
    return Data(name, images, images)

  def sizes(self, data):
    return autoencoder_model.mirrored_sizes((data.x.shape[1],) + self.encoder)

  def init_params(self, data, seed):
    return autoencoder_model.init_params(self.sizes(data), seed)

  def make_variables(self, params_np):
    return autoencoder_model.make_variables(params_np)

  @staticmethod
  def flat_variables(variables):
    return autoencoder_model.flat_variables(variables)

  def forward(self, x, variables, layer_collection=None):
    return autoencoder_model.forward(x, variables, layer_collection)

  def loss(self, y, logits, variables):
    l2 = tf.add_n([tf.reduce_sum(tf.square(v))
                   for v in self.flat_variables(variables)])
    return (autoencoder_model.reconstruction_loss(y, logits) +
            0.5 * self.l2_reg * l2)

  def register_loss(self, layer_collection, logits, y):
    autoencoder_model.register_loss(layer_collection, y, logits)

  def describe(self, data):
    return ("autoencoder %s tanh, sigmoid cross-entropy + %g/2 ||w||^2" %
            ("-".join(str(s) for s in self.sizes(data)), self.l2_reg))

  def eval_loss_name(self):
    return ("sigmoid cross-entropy summed over pixels (+ L2), mean over a "
            "fixed training subset")


class _Classifier(Workload):
  """Fashion-MNIST classifiers: images [N, 28, 28], labels [N]."""

  def load(self, dataset, max_examples):
    name, train, test = classifier_common.load_classification_data(
        dataset, max_examples)
    return Data(name, train.images, train.labels, test.images, test.labels)


class Convnet(_Classifier):
  """The convnet of examples/convnet_classifier.py (Fashion-MNIST sizes)."""

  name = "convnet"
  channels, kernel_size, dense_units = ("16", "32"), 5, 128

  def init_params(self, data, seed):
    return convnet_model.init_params(self.channels, self.kernel_size,
                                     self.dense_units, data.x.shape[1:],
                                     classifier_common.NUM_CLASSES, seed)

  def forward(self, x, variables, layer_collection=None):
    return convnet_model.forward(x, variables, layer_collection,
                                 sub_sample_patches=True)

  def describe(self, data):
    return convnet_model.describe(self.channels, self.kernel_size,
                                  self.dense_units, data.x.shape[1:])


class Rnn(_Classifier):
  """The RNN over image rows of examples/rnn_rows_classifier.py."""

  name = "rnn"
  hidden_units = 128

  def init_params(self, data, seed):
    return rnn_model.init_params(self.hidden_units, data.x.shape[1:],
                                 classifier_common.NUM_CLASSES, seed)

  def forward(self, x, variables, layer_collection=None):
    return rnn_model.forward(x, variables, layer_collection)

  def describe(self, data):
    return rnn_model.describe(self.hidden_units, data.x.shape[1:])


WORKLOADS = {w.name: w for w in (Autoencoder(), Convnet(), Rnn())}


def machine_line():
  """One line naming the machine and the software versions."""
  devices = [d.device_type for d in tf.config.list_physical_devices()]
  return ("Machine: %s, %d CPU cores, devices %s; TensorFlow %s, Python %s." %
          (platform.machine(), os.cpu_count() or 0, ", ".join(devices),
           tf.__version__, platform.python_version()))


def get(name, small=False):
  """The workload `name`; small=True shrinks the autoencoder for the 8x8
  digits (quick runs and tests)."""
  if name == "autoencoder" and small:
    return Autoencoder(encoder=(48, 32, 16, 8))
  return WORKLOADS[name]


def random_batch(data, batch_size, seed):
  rng = np.random.RandomState(seed)
  return data.batch(rng.choice(len(data), batch_size, replace=False))


def all_reduced_elements(workload, data, x, y):
  """What one replica of a K-FAC step on the examples (x, y) all-reduces,
  counted on a graph of the model: (statistics elements: the factors'
  statistics as kfac's packed collective sends them, symmetric ones as
  upper triangles; gradient elements; inverse elements: every factor's
  inverses in full)."""
  import kfac  # pylint: disable=g-import-not-at-top
  from kfac.python.ops.distribute import collective  # pylint: disable=g-import-not-at-top
  from kfac.python.ops.estimation import estimator as est_lib  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():
    lc = kfac.LayerCollection()
    plain = workload.make_variables(workload.init_params(data, seed=0))
    logits = workload.forward(tf.constant(x), plain, lc)
    workload.register_loss(lc, logits, tf.constant(y, workload.target_dtype))
    est = est_lib.FisherEstimator(
        variables=workload.flat_variables(plain), cov_ema_decay=0.95,
        damping=1.0, layer_collection=lc)
    stats, symmetric = [], []
    for factor in est.factors:
      for stat, sym in factor.covariance_statistics():
        stats.append(stat)
        symmetric.append(sym)
    return (collective.packed_size(stats, symmetric),
            sum(int(np.prod(v.shape)) for v in
                workload.flat_variables(plain)),
            sum(int(np.prod(v.shape)) for vs in est.get_inv_vars()
                for v in vs))
