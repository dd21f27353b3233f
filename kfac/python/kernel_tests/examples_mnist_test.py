"""kfac.examples.mnist (the old examples' loader): MNIST-format files from
KFAC_MNIST_DIR, scaling, shapes, the fake-data iterator, clear errors."""

import gzip
import struct

import numpy as np
import pytest
import tensorflow as tf

from kfac.examples import mnist


def _write_idx(path, array, magic, compress=True):
  header = struct.pack(">I", magic) + b"".join(
      struct.pack(">I", d) for d in array.shape)
  data = header + array.astype(np.uint8).tobytes()
  if compress:
    with gzip.open(str(path) + ".gz", "wb") as f:
      f.write(data)
  else:
    with open(path, "wb") as f:
      f.write(data)


@pytest.fixture
def mnist_dir(tmp_path, monkeypatch):
  rng = np.random.RandomState(0)
  images = rng.randint(0, 256, size=(6, 28, 28))
  labels = rng.randint(0, 10, size=6)
  _write_idx(tmp_path / "train-images-idx3-ubyte", images, 2051)
  _write_idx(tmp_path / "train-labels-idx1-ubyte", labels, 2049,
             compress=False)
  monkeypatch.setenv("KFAC_MNIST_DIR", str(tmp_path))
  return images, labels


def test_tensors_from_local_files(mnist_dir):
  images, labels = mnist_dir
  x, y, n = mnist.load_mnist_as_tensors()
  assert n == 6 and x.dtype == tf.float32 and y.dtype == tf.int32
  np.testing.assert_allclose(x.numpy(), images.reshape(6, 784) / 255.0,
                             rtol=1e-7)
  np.testing.assert_array_equal(y.numpy(), labels)
  x, _, _ = mnist.load_mnist_as_tensors(flatten_images=False,
                                        dtype=tf.float64)
  assert x.shape == (6, 28, 28, 1) and x.dtype == tf.float64


def test_iterator_in_a_tf1_graph(mnist_dir):
  _, labels = mnist_dir
  with tf.Graph().as_default():
    x, y = mnist.load_mnist_as_iterator(1, 6)
    with tf.compat.v1.Session() as sess:
      xs, ys = sess.run([x, y])
  assert xs.shape == (6, 784)
  assert sorted(ys) == sorted(labels)  # one shuffled epoch


def test_fake_data_is_seeded():
  with tf.Graph().as_default():
    x, y = mnist.load_mnist_as_iterator(1, 3, use_fake_data=True,
                                        flatten_images=False)
    with tf.compat.v1.Session() as sess:
      xs, ys = sess.run([x, y])
  assert xs.shape == (3, 28, 28, 1) and ys.dtype == np.int64
  rng = np.random.RandomState(42)
  pool = rng.rand(12, 784).astype(np.float32)
  for row in xs.reshape(3, 784):
    assert np.any(np.all(pool == row, axis=1))


def test_missing_and_wrong_files_are_named(tmp_path, monkeypatch):
  monkeypatch.setenv("KFAC_MNIST_DIR", str(tmp_path))
  with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
    mnist.load_mnist_as_tensors()
  _write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((2, 28, 28)),
             2049)
  with pytest.raises(ValueError, match="not an MNIST-format file"):
    mnist.load_mnist_as_tensors()
