"""Offline data loaders for the kfac examples. Nothing is ever downloaded.

* sklearn's 8x8 digits ship inside the scikit-learn wheel.
* Fashion-MNIST comes from the Debian package `dataset-fashion-mnist`
  (/usr/share/datasets/fashion-mnist) or from its copy in the Keras cache
  ($KERAS_HOME/datasets/fashion-mnist, default ~/.keras), which `make data`
  creates so that `keras.datasets.fashion_mnist.load_data()` works offline.
"""

import gzip
import os
import struct

import numpy as np

FASHION_MNIST_SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"
_FASHION_MNIST_TRAIN_IMAGES = "train-images-idx3-ubyte.gz"

# idx type codes -> numpy dtypes (big-endian, as the format stores them).
_IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path):
  """Reads an idx file (optionally gzip-compressed) into a numpy array.

  Format: two zero bytes, a type code byte, a byte with the number of
  dimensions, one big-endian uint32 per dimension, then the data row-major.
  """
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rb") as f:
    data = f.read()
  if len(data) < 4 or data[0] != 0 or data[1] != 0:
    raise ValueError("%s is not an idx file (bad magic)" % path)
  type_code, ndim = data[2], data[3]
  if type_code not in _IDX_DTYPES:
    raise ValueError("%s: unknown idx type code 0x%02x" % (path, type_code))
  dtype = _IDX_DTYPES[type_code]
  header = 4 + 4 * ndim
  shape = struct.unpack(">%dI" % ndim, data[4:header])
  count = int(np.prod(shape)) if shape else 1
  if len(data) - header != count * dtype.itemsize:
    raise ValueError("%s: size does not match shape %s" % (path, shape))
  array = np.frombuffer(data, dtype=dtype, count=count, offset=header)
  return array.reshape(shape).astype(dtype.newbyteorder("="))


def keras_fashion_mnist_dir():
  """Where keras.datasets.fashion_mnist.load_data() looks for its files."""
  keras_home = os.environ.get("KERAS_HOME")
  if not keras_home:
    home = os.path.expanduser("~")
    if not os.access(home, os.W_OK):  # Keras falls back to /tmp the same way.
      home = "/tmp"
    keras_home = os.path.join(home, ".keras")
  return os.path.join(keras_home, "datasets", "fashion-mnist")


def find_fashion_mnist_file(name=_FASHION_MNIST_TRAIN_IMAGES):
  """Path of a Fashion-MNIST file in the Keras cache or system dir, or None."""
  for directory in (keras_fashion_mnist_dir(), FASHION_MNIST_SYSTEM_DIR):
    path = os.path.join(directory, name)
    if os.path.isfile(path):
      return path
  return None


def load_digits_images():
  """sklearn's 1797 8x8 digits as float32 [1797, 64] in [0, 1]."""
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  images = load_digits().data.astype(np.float32) / 16.0
  return images


def load_fashion_mnist_images(max_examples=None):
  """Fashion-MNIST training images as float32 [N, 784] in [0, 1], or None.

  Args:
    max_examples: keep only the first `max_examples` images (all 60000 when
      None).

  Returns:
    The images, or None when no local copy of the files exists.
  """
  path = find_fashion_mnist_file()
  if path is None:
    return None
  try:
    images = read_idx(path)
  except (OSError, ValueError, EOFError) as e:
    print("datasets: cannot read %s: %s" % (path, e))
    return None
  if max_examples is not None:
    images = images[:max_examples]
  return images.reshape(images.shape[0], -1).astype(np.float32) / 255.0


def load_autoencoder_data(prefer="fashion_mnist", max_examples=None):
  """Returns (name, images [N, D] float32 in [0, 1]) for the autoencoders.

  Args:
    prefer: "fashion_mnist" (use it when present, else digits), "digits", or
      "auto" (same as "fashion_mnist").
    max_examples: optional cap on the number of Fashion-MNIST images.
  """
  if prefer not in ("auto", "fashion_mnist", "digits"):
    raise ValueError("prefer must be 'auto', 'fashion_mnist' or 'digits', "
                     "got %r" % (prefer,))
  if prefer != "digits":
    images = load_fashion_mnist_images(max_examples)
    if images is not None:
      print("datasets: using Fashion-MNIST (%d x %d) from %s" %
            (images.shape[0], images.shape[1],
             os.path.dirname(find_fashion_mnist_file())))
      return "fashion_mnist", images
    print("datasets: Fashion-MNIST not found (run `make data`); "
          "using sklearn digits")
  images = load_digits_images()
  print("datasets: using sklearn digits (%d x %d)" % images.shape)
  return "digits", images
