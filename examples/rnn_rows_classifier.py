r"""K-FAC vs Adam on an RNN that reads an image row by row, side by side.

Model: the image's rows are the time steps (28 pixels each for
Fashion-MNIST), a tanh RNN h_t = tanh(x_t W_x + h_{t-1} W_h + b) with h_0 = 0,
then dense 10 (softmax cross-entropy) on the last hidden state.

The recurrent weights are used once per time step, so K-FAC registers them
with the multi-use API, `register_fully_connected_multi` (approximation
"kron_indep", the default: the uses are treated as independent, the block
is T * A (x) G with A and G averaged over uses and examples, and the damping
is normalised by the number of uses T):
  (W_x, b)  inputs [x_1, ..., x_T],      outputs [a_1, ..., a_T]
  W_h       inputs [h_1, ..., h_{T-1}],  outputs [a_2, ..., a_T]
where a_t = x_t W_x + h_{t-1} W_h + b is the pre-activation. Both layers
feed the same a_t; each Kronecker block only needs the gradients with
respect to its outputs, so they are registered separately. (The use at t=1
of W_h is left out: its input h_0 is zero, so it adds nothing to the
gradient.)

This demo shows the TF2 path (docs/tf2.md): each optimizer is created once,
eagerly, and one training step is a tf.function that builds a new
LayerCollection on every trace. Both optimizers start from the same
weights, see the same batches and take turns (see side_by_side.py).

  python examples/rnn_rows_classifier.py                 # Fashion-MNIST if present
  python examples/rnn_rows_classifier.py --dataset=digits --seconds=10

Fashion-MNIST defaults were picked by a small grid at 200 steps (K-FAC with
momentum type "adam": learning rate in {0.01, 0.03, 0.1} x damping in
{0.3, 1, 3}; Adam: learning rate in {1e-3, 3e-3, 1e-2}), the best four
K-FAC and two Adam settings checked at 1000 steps: K-FAC lr 0.01,
damping 0.3 reached 0.27 there, Adam lr 1e-3 0.38.

Measured on 2 shared AMD EPYC cores, TF 2.21, default flags (Fashion-MNIST,
20000 training images, batch 256, 30 s per optimizer; 81 s wall in all):

| optimizer | steps | ms/step | loss at step 1228 | loss at 30.0s | test accuracy |
|---|---:|---:|---:|---:|---:|
| kfac | 1228 | 24.4 | 0.2271 | 0.2271 | 0.8602 |
| adam | 1781 | 16.8 | 0.3364 | 0.3124 | 0.8447 |
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags

import classifier_common as common
import rnn_model
import side_by_side

FLAGS = flags.FLAGS

side_by_side.define_flags()
flags.DEFINE_integer("hidden_units", None, "RNN state size (default: per "
                     "dataset).")

DATASET_DEFAULTS = {
    "fashion_mnist": dict(hidden_units=128, batch_size=256, seconds=30.0,
                          kfac_learning_rate=0.01, kfac_damping=0.3,
                          kfac_momentum_type="adam",
                          adam_learning_rate=1e-3),
    "digits": dict(hidden_units=64, batch_size=128, seconds=10.0,
                   kfac_learning_rate=0.01, kfac_damping=0.3,
                   kfac_momentum_type="adam", adam_learning_rate=3e-3),
}


def init_params(cfg, image_shape, num_classes, seed):
  return rnn_model.init_params(cfg.hidden_units, image_shape, num_classes,
                               seed)


def describe(cfg, image_shape):
  return rnn_model.describe(cfg.hidden_units, image_shape)


def main(argv):
  del argv
  common.main(init_params, rnn_model.forward, DATASET_DEFAULTS, "function",
              describe)


if __name__ == "__main__":
  app.run(main)
