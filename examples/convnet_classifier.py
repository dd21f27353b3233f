r"""K-FAC vs Adam on a small convnet classifier, side by side.

Model: image -> [conv 5x5 (relu, bias) -> 2x2 max-pool] x 2 -> dense (relu)
-> dense 10 (softmax cross-entropy). K-FAC registers the convolutions with
`register_conv2d` (Kronecker factors over patches and output channels,
damping normalised by the number of spatial locations), the dense layers
with `register_fully_connected`, and the loss with
`register_softmax_cross_entropy_loss`; it runs as
`PeriodicInvCovUpdateKfacOpt` (statistics every step, inverses every
--invert_every steps) in the classic TF1 style: each optimizer has its own
tf.Graph and tf.compat.v1.Session. Both optimizers start from the same
weights, see the same batches and take turns (see side_by_side.py).

  python examples/convnet_classifier.py                  # Fashion-MNIST if present
  python examples/convnet_classifier.py --dataset=digits --seconds=10

The conv input statistics are estimated from a random subset of patches
(kfac's sub_sample_patches=True: at most 8 x the statistic's dimension rows
per step, see --sub_sample_patches); on this model that cuts the K-FAC step
time by more than half and changes the losses by less than 0.005 over the
first 40 steps.

Fashion-MNIST defaults were picked by a small grid at 60 steps (K-FAC with
momentum type "adam": learning rate in {0.03, 0.1, 0.3} x damping in
{0.3, 1, 3}; damping 0.3 with learning rate >= 0.1 diverged; Adam: learning
rate in {3e-4, 1e-3, 3e-3}), the best three K-FAC and two Adam settings
checked at 200 steps: K-FAC lr 0.1, damping 1 reached 0.26 there, Adam
lr 3e-3 0.31.

Measured on 2 shared AMD EPYC cores, TF 2.21, default flags (Fashion-MNIST,
20000 training images, batch 256, 40 s per optimizer; 107 s wall in all):

| optimizer | steps | ms/step | loss at step 230 | loss at 40.0s | test accuracy |
|---|---:|---:|---:|---:|---:|
| kfac | 230 | 174.4 | 0.2553 | 0.2526 | 0.8743 |
| adam | 399 | 100.3 | 0.2975 | 0.2213 | 0.8874 |

K-FAC reaches a lower loss per step; its steps cost 1.7x Adam's (the
sampled backward pass, the statistics and the preconditioning), so at equal
time Adam is ahead on this small convnet.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags

import classifier_common as common
import convnet_model
import side_by_side

FLAGS = flags.FLAGS

side_by_side.define_flags()
flags.DEFINE_list("conv_channels", None, "Output channels of each conv "
                  "layer (default: per dataset).")
flags.DEFINE_integer("kernel_size", None, "Conv kernel size (default: per "
                     "dataset).")
flags.DEFINE_integer("dense_units", None, "Units of the hidden dense layer "
                     "(default: per dataset).")
flags.DEFINE_integer("sub_sample_patches", -1, "K-FAC: estimate each conv "
                     "input statistic from a random subset of at most this "
                     "many patches per step; 0: all patches; -1: kfac's "
                     "sub_sample_patches=True, 8 x the statistic's "
                     "dimension.")

DATASET_DEFAULTS = {
    "fashion_mnist": dict(conv_channels=["16", "32"], kernel_size=5,
                          dense_units=128, batch_size=256, seconds=40.0,
                          kfac_learning_rate=0.1, kfac_damping=1.0,
                          kfac_momentum_type="adam",
                          adam_learning_rate=3e-3),
    "digits": dict(conv_channels=["16", "32"], kernel_size=3,
                   dense_units=64, batch_size=128, seconds=10.0,
                   kfac_learning_rate=0.1, kfac_damping=1.0,
                   kfac_momentum_type="adam", adam_learning_rate=3e-3),
}


def init_params(cfg, image_shape, num_classes, seed):
  return convnet_model.init_params(cfg.conv_channels, cfg.kernel_size,
                                   cfg.dense_units, image_shape, num_classes,
                                   seed)


def _sub_sample_patches():
  if FLAGS.sub_sample_patches == -1:
    return True
  return FLAGS.sub_sample_patches or None


def forward(images, variables, layer_collection=None):
  return convnet_model.forward(images, variables, layer_collection,
                               sub_sample_patches=_sub_sample_patches())


def describe(cfg, image_shape):
  return convnet_model.describe(cfg.conv_channels, cfg.kernel_size,
                                cfg.dense_units, image_shape)


def main(argv):
  del argv
  common.main(init_params, forward, DATASET_DEFAULTS, "session", describe)


if __name__ == "__main__":
  app.run(main)
