"""The Keras model zoo: the models users train, built from Keras layers.

Every builder takes `size` ("full": the benchmark's model; "tiny": the same
architecture, a few units wide, for the tests) and returns an uncompiled
Keras 3 model; `data(name, n, seed)` returns (x, y) for it. The losses are
`LOSSES[name]` (all from logits except where the model ends in a softmax).

  mobilenetv2     keras.applications.MobileNetV2(alpha=0.35), 32x32x3, 10 classes
  resnet50        keras.applications.ResNet50, 32x32x3, 10 classes
  efficientnetb0  keras.applications.EfficientNetB0, 32x32x3, 10 classes
  bn_resnet       a small ResNet with batch norm (3 stages of 2 residual
                  blocks, 16/32/64 channels), 32x32x3, 10 classes
  vit             a vision transformer: 4x4 patches by a strided Conv2D, a
                  learned position embedding, 2 pre-norm blocks
                  (MultiHeadAttention, LayerNormalization, a gelu MLP), mean
                  pooling, 10 classes
  gpt             a causal (GPT-style) transformer over 32 tokens: token and
                  position embeddings, 2 pre-norm blocks with
                  MultiHeadAttention(use_causal_mask=True), next-token logits
  lstm, gru       text classifiers: Embedding -> LSTM / GRU (64) -> Dense 4

Images are Fashion-MNIST (padded to 32x32, three channels) when the
offline copy is present (`make data`), else random class templates plus
noise; the sequence tasks are synthetic: "which of four marker tokens
occurs most often" for the text classifiers, and sequences x[t+1] = (a x[t]
+ b) mod 32 with a per-sequence (a, b) for the GPT (the model must infer
(a, b) from the context). Pixels are in [0, 1], except for EfficientNetB0,
which gets them in [0, 255]: its first layer is a Rescaling(1/255) (the
keras.applications documentation: EfficientNet takes [0, 255] pixels). Fed
[0, 1], every optimizer trained it on inputs 255 times too small.
"""

import numpy as np

import keras
from keras import layers
from keras import ops

IMAGE_MODELS = ("mobilenetv2", "resnet50", "efficientnetb0", "bn_resnet",
                "vit")
TEXT_MODELS = ("lstm", "gru")
NAMES = IMAGE_MODELS + ("gpt",) + TEXT_MODELS
APPLICATIONS = ("mobilenetv2", "resnet50", "efficientnetb0")

VOCAB, SEQ = 32, 32


def _applications(name, size):
  shape = (32, 32, 3)
  if name == "mobilenetv2":
    return keras.applications.MobileNetV2(
        weights=None, input_shape=shape, classes=10,
        alpha=0.35)
  if name == "resnet50":
    return keras.applications.ResNet50(weights=None, input_shape=shape,
                                       classes=10)
  return keras.applications.EfficientNetB0(weights=None, input_shape=shape,
                                           classes=10)


def _bn_resnet(size):
  widths = (16, 32, 64) if size == "full" else (4, 4, 4)
  x = inputs = keras.Input((32, 32, 3))
  x = layers.Conv2D(widths[0], 3, padding="same", use_bias=False)(x)
  x = layers.ReLU()(layers.BatchNormalization()(x))
  for stage, width in enumerate(widths):
    for block in range(2):
      stride = 2 if stage > 0 and block == 0 else 1
      shortcut = x
      y = layers.Conv2D(width, 3, strides=stride, padding="same",
                        use_bias=False)(x)
      y = layers.ReLU()(layers.BatchNormalization()(y))
      y = layers.Conv2D(width, 3, padding="same", use_bias=False)(y)
      y = layers.BatchNormalization()(y)
      if stride != 1 or shortcut.shape[-1] != width:
        shortcut = layers.Conv2D(width, 1, strides=stride,
                                 use_bias=False)(shortcut)
        shortcut = layers.BatchNormalization()(shortcut)
      x = layers.ReLU()(layers.Add()([y, shortcut]))
  x = layers.GlobalAveragePooling2D()(x)
  return keras.Model(inputs, layers.Dense(10)(x), name="bn_resnet")


class AddPosition(layers.Layer):
  """x [batch, T, D] + a learned position embedding of arange(T) (the
  keras.io pattern: the lookup has no batch axis)."""

  def __init__(self, length, dim, **kwargs):
    super().__init__(**kwargs)
    self.length, self.dim = length, dim
    self.position = layers.Embedding(length, dim, name="position")

  def call(self, x):
    return x + self.position(ops.arange(self.length))

  def get_config(self):
    return dict(super().get_config(), length=self.length, dim=self.dim)


def _transformer_block(x, heads, dim, causal):
  y = layers.LayerNormalization(epsilon=1e-6)(x)
  y = layers.MultiHeadAttention(heads, dim // heads)(
      y, y, use_causal_mask=causal)
  x = layers.Add()([x, y])
  y = layers.LayerNormalization(epsilon=1e-6)(x)
  y = layers.Dense(2 * dim, activation="gelu")(y)
  y = layers.Dense(dim)(y)
  return layers.Add()([x, y])


def _vit(size):
  dim, heads = (64, 4) if size == "full" else (8, 2)
  inputs = keras.Input((32, 32, 3))
  x = layers.Conv2D(dim, 4, strides=4)(inputs)  # 8x8 patches of 4x4
  x = layers.Reshape((64, dim))(x)
  x = AddPosition(64, dim)(x)
  for _ in range(2):
    x = _transformer_block(x, heads, dim, causal=False)
  x = layers.LayerNormalization(epsilon=1e-6)(x)
  x = layers.GlobalAveragePooling1D()(x)
  return keras.Model(inputs, layers.Dense(10)(x), name="vit")


def _gpt(size):
  dim, heads = (64, 4) if size == "full" else (8, 2)
  tokens = keras.Input((SEQ,), dtype="int32")
  x = layers.Embedding(VOCAB, dim)(tokens)
  x = AddPosition(SEQ, dim)(x)
  for _ in range(2):
    x = _transformer_block(x, heads, dim, causal=True)
  x = layers.LayerNormalization(epsilon=1e-6)(x)
  return keras.Model(tokens, layers.Dense(VOCAB)(x), name="gpt")


def _recurrent(name, size):
  units = 64 if size == "full" else 4
  cell = layers.LSTM if name == "lstm" else layers.GRU
  tokens = keras.Input((SEQ,), dtype="int32")
  x = layers.Embedding(VOCAB, 16 if size == "full" else 4)(tokens)
  x = cell(units)(x)
  return keras.Model(tokens, layers.Dense(4)(x), name=name)


def build(name, size="full"):
  """The model `name` (see the module docstring)."""
  if name in APPLICATIONS:
    return _applications(name, size)
  if name == "bn_resnet":
    return _bn_resnet(size)
  if name == "vit":
    return _vit(size)
  if name == "gpt":
    return _gpt(size)
  if name in TEXT_MODELS:
    return _recurrent(name, size)
  raise ValueError("unknown zoo model %r; one of %s" % (name, NAMES))


def loss(name):
  # keras.applications end in a softmax; the others give logits.
  return keras.losses.SparseCategoricalCrossentropy(
      from_logits=name not in APPLICATIONS)


def _images(n, seed):
  try:
    (x, y), _ = keras.datasets.fashion_mnist.load_data()
    order = np.random.RandomState(seed).permutation(len(x))[:n]
    x = np.pad(x[order], ((0, 0), (2, 2), (2, 2))).astype("float32") / 255.
    return np.repeat(x[..., None], 3, axis=-1), y[order].astype("int32")
  except Exception:  # pylint: disable=broad-except
    r = np.random.RandomState(seed)
    templates = np.random.RandomState(1234).rand(10, 32, 32, 3)
    y = r.randint(0, 10, n).astype("int32")
    x = templates[y] + 0.5 * r.rand(n, 32, 32, 3)
    return x.astype("float32"), y


def _counting(n, seed):
  r = np.random.RandomState(seed)
  x = r.randint(4, VOCAB, size=(n, SEQ))
  y = r.randint(0, 4, n)
  for i in range(n):  # marker y most often, the others less
    counts = r.permutation(4)
    counts = np.where(counts == y[i], 6, r.randint(0, 5, 4))
    places = r.permutation(SEQ)[:counts.sum()]
    x[i, places] = np.repeat(np.arange(4), counts)
  return x.astype("int32"), y.astype("int32")


def _affine_sequences(n, seed):
  r = np.random.RandomState(seed)
  a = r.choice([1, 3, 5, 7], size=(n, 1))
  b = r.randint(0, VOCAB, size=(n, 1))
  x = np.zeros((n, SEQ + 1), np.int64)
  x[:, :1] = r.randint(0, VOCAB, size=(n, 1))
  for t in range(SEQ):
    x[:, t + 1] = (a[:, 0] * x[:, t] + b[:, 0]) % VOCAB
  return x[:, :-1].astype("int32"), x[:, 1:].astype("int32")


def data(name, n, seed=0):
  """(x, y) numpy arrays: n examples for model `name`."""
  if name in IMAGE_MODELS:
    x, y = _images(n, seed)
    return (x * 255. if name == "efficientnetb0" else x), y
  if name == "gpt":
    return _affine_sequences(n, seed)
  return _counting(n, seed)


def weight_shares(model, report):
  """From a Kfac registration report: (share of the trainable parameters
  under a non-diagonal block, share under a generic fallback, the layers
  that fell back, the layers under diagonal blocks)."""
  rows = {}
  for line in report.splitlines()[2:]:
    fields = line.split()
    if len(fields) >= 3 and fields[2].endswith("FB"):
      rows[fields[0]] = (fields[2], "fallback" in line)
  total = kron = generic = 0
  fallbacks, diagonal = [], []
  for layer in _layers(model):
    count = sum(int(np.prod(w.shape)) for w in layer.trainable_weights)
    path = layer.path if hasattr(layer, "path") else layer.name
    if not count or path not in rows:
      continue
    block, fell_back = rows[path]
    total += count
    if fell_back:
      generic += count
      fallbacks.append(path)
    elif "Diagonal" in block or "Naive" in block:
      diagonal.append(path)
    else:
      kron += count
  total = max(total, 1)
  return kron / total, generic / total, fallbacks, diagonal


def _layers(model):
  """The layers that own weights directly (recursively through nested
  models and layers)."""
  out = []
  for layer in model._flatten_layers(include_self=False):  # pylint: disable=protected-access
    if layer._trainable_variables and not isinstance(layer, keras.Model):  # pylint: disable=protected-access
      out.append(layer)
  return out
