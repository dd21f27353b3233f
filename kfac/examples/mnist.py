"""MNIST loaders of the old library's examples (kfac.examples.mnist).

The data comes from `tf.keras.datasets.mnist.load_data()` (which downloads
it once), or, when the environment variable KFAC_MNIST_DIR names a folder,
from the MNIST-format files there (train-images-idx3-ubyte[.gz] and
train-labels-idx1-ubyte[.gz]; Fashion-MNIST has the same format), so that
the examples run offline. Images are scaled to [0, 1].
"""

import gzip
import os

import numpy as np
import tensorflow.compat.v1 as tf

__all__ = [
    "load_mnist_as_tensors",
    "load_mnist_as_dataset",
    "load_mnist_as_iterator",
]

_IMAGE_MAGIC, _LABEL_MAGIC = 2051, 2049


def _read_idx(folder, stem, magic):
  for name in (stem, stem + ".gz"):
    path = os.path.join(folder, name)
    if os.path.exists(path):
      opener = gzip.open if name.endswith(".gz") else open
      with opener(path, "rb") as f:
        data = f.read()
      break
  else:
    raise FileNotFoundError(
        "KFAC_MNIST_DIR=%s has no %s(.gz) (MNIST-format files expected)" %
        (folder, stem))
  found = int.from_bytes(data[:4], "big")
  if found != magic:
    raise ValueError("%s in %s is not an MNIST-format file (magic %d, "
                     "expected %d)" % (stem, folder, found, magic))
  ndim = data[3]
  dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big")
          for i in range(ndim)]
  return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _training_arrays():
  folder = os.environ.get("KFAC_MNIST_DIR")
  if folder:
    return (_read_idx(folder, "train-images-idx3-ubyte", _IMAGE_MAGIC),
            _read_idx(folder, "train-labels-idx1-ubyte", _LABEL_MAGIC))
  (images, labels), _ = tf.keras.datasets.mnist.load_data()
  return images, labels


def load_mnist_as_tensors(flatten_images=True, dtype=tf.float32):
  """The training set as constants: (images, labels, num_examples).

  images: [N, 784] if flatten_images else [N, 28, 28, 1], of `dtype`, values
  in [0, 1]; labels: [N] int32.
  """
  images, labels = _training_arrays()
  num_examples = images.shape[0]
  shape = (num_examples, 28 * 28) if flatten_images else (
      num_examples, 28, 28, 1)
  images = images.reshape(shape).astype(np.float64) / 255.0
  return (tf.constant(images, dtype=dtype),
          tf.constant(labels.astype(np.int32)), num_examples)


def load_mnist_as_dataset(flatten_images=True):
  """(tf.data.Dataset of (image, label) pairs, num_examples)."""
  images, labels, num_examples = load_mnist_as_tensors(
      flatten_images=flatten_images)
  return tf.data.Dataset.from_tensor_slices((images, labels)), num_examples


def load_mnist_as_iterator(num_epochs, batch_size, use_fake_data=False,
                           flatten_images=True):
  """(images, labels) batch tensors of a shuffled, repeated one-shot
  iterator (TF1 graphs). use_fake_data: uniform random images and labels,
  4 batches' worth, seeded, instead of MNIST."""
  if use_fake_data:
    rng = np.random.RandomState(42)
    num_examples = 4 * batch_size
    images = rng.rand(num_examples, 28 * 28)
    if not flatten_images:
      images = images.reshape(num_examples, 28, 28, 1)
    labels = rng.randint(10, size=num_examples)
    dataset = tf.data.Dataset.from_tensor_slices(
        (images.astype(np.float32), labels.astype(np.int64)))
  else:
    dataset, num_examples = load_mnist_as_dataset(
        flatten_images=flatten_images)
  dataset = dataset.shuffle(num_examples).repeat(num_epochs).batch(
      batch_size).prefetch(5)
  return tf.data.make_one_shot_iterator(dataset).get_next()
