"""kfac.keras: Keras layers and losses are registered as K-FAC expects.

What is checked (float64 throughout: Keras floatx is float64 for the
module; hyperparameters are powers of two, exact in the float32 variables
the optimizer keeps them in):
- Layer zoo, end to end, against hand registration in a TF1 graph. Each
  layer kind is a branch `inputs -> layer -> (Flatten)`; the branches of a
  group (dense, conv, lookup_and_norm, fisher_approx) are concatenated into
  one head Dense(3) with logits and SparseCategoricalCrossentropy(
  from_logits=True), trained for TWO full-batch `model.fit` steps of
  `kfac.keras.optimizers.Kfac` (estimation_mode="exact", invert_every=1,
  momentum 0). The reference runs the same two steps of
  `kfac.PeriodicInvCovUpdateKfacOpt` in a `tf.compat.v1.Graph` + Session on
  a raw-TF rewrite of the model (tf.nn.conv2d / conv3d / depthwise_conv2d /
  conv2d_transpose, tf.gather, tf.nn.moments ...) with the same initial
  weights, registered by hand with the LayerCollection API (padded
  convolutions registered as VALID on explicitly padded inputs, another
  route than Keras's "SAME" / "CAUSAL"). The new weights agree to 1e-10
  relative to the largest weight change (measured: <= 3e-15); the
  registration report names the expected block class for every layer.
  Layers: Dense (fused relu, rank-2 and rank-3 inputs, no bias), EinsumDense
  (2-d kernel; and MultiHeadAttention's four projections in a transformer
  block, kernels [D, H, K] / [H, K, D] registered with output_axes),
  Conv2D (strides 2, same, relu), Conv1D (causal, dilation 2), Conv3D,
  Conv2DTranspose (strides 2, same, relu; and "diagonal" by name),
  Conv1DTranspose (valid, output_padding 1), Conv3DTranspose,
  DepthwiseConv2D (multiplier 2), Embedding, BatchNormalization (training),
  LayerNormalization (last axis; two axes without center),
  GroupNormalization (a small conv net with 2 groups; groups=-1 with the
  "diagonal" approximation by name), a position embedding added to token
  embeddings (ids tf.range(T) without a batch axis), a shared Dense,
  Conv2D and Embedding (multi-use blocks), LSTM and GRU (reset_after both
  ways; the reference unrolls the recurrence in Python and registers the
  kernels over the steps by hand, see _recurrent_branches), and the generic
  diagonal fallbacks (BatchNormalization(axis=1),
  GroupNormalization(axis=1) and without scale, a position embedding
  multiplied with the tokens, a Dense shared by two sequences) with their UserWarning and "fallback" report line.
  fisher_approx by layer name, class and "__class__:Name" key.
  Conv2D channels_first cannot run on CPU (asserted); its traced
  registration is checked to be the NCHW convolution, and so is a
  channels_first Conv2DTranspose's.
- Losses. For mse, categorical, sparse categorical and binary
  cross-entropy, from_logits True and False (activation fused in the last
  Dense or a separate Activation layer; from_logits=True on a softmax /
  sigmoid output, which Keras computes from the logits behind it), as
  strings and as loss objects, rank-2 and rank-3 outputs: inside a
  tf.function, coeff * GGN of the registered loss (multiply_ggn on basis
  vectors) equals the tape Hessian of N * (the Keras loss of
  `model.compute_loss`) w.r.t. the logits times k, the outputs per example
  Keras averages over (written per case), with the default
  average_over_outputs=False (kfac 0.2.x's coefficient: the loss weight),
  and the Hessian itself with average_over_outputs=True (the recipe's), to
  1e-9 relative (the whole N*D x N*D matrix: per-example blocks and zero
  cross-example blocks; measured: <= 3e-16). The registered logits are
  also checked against numpy's x @ W + b.
- Errors: unsupported loss, from_logits=False on an output that can
  leave [0, 1] (linear, relu, tanh), reduction "sum" / "none",
  ignore_class, fisher_approx name keys naming no layer (class keys that
  match no layer are unused, as in kfac 0.2.x), non-string approximations, unknown approximations (named by the
  LayerCollection error), dynamic non-batch output shapes.

Keras flavour: written against `keras_flavor.keras_module()`; the file
passes with Keras 3 and with tf_keras (TF_USE_LEGACY_KERAS=1).
"""

import re
import warnings

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.keras import keras_flavor
from kfac.python.keras import layer_registration
from kfac.python.keras import loss_registration
from kfac.python.keras import utils as keras_utils
from kfac.python.kernel_tests import kfac_test_util

keras = keras_flavor.keras_module()

N = 4          # batch size
CLASSES = 3    # head outputs
LR = 0.25      # powers of two: exact in float32 hyperparameter variables
DAMPING = 0.03125
STEP_REL = 1e-10   # zoo: weight changes, relative to the largest change
LOSS_REL = 1e-9    # losses: coeff * GGN vs tape Hessian


@pytest.fixture(autouse=True, scope="module")
def float64_keras():
  """floatx float64 for this module. Keras 3 also caches a global dtype
  policy the first time any layer is built (from floatx at that moment), so
  after other tests built layers, floatx alone would not change the layers'
  dtype: the policy is set too, and both are restored."""
  with kfac_test_util.keras_float64(keras):
    yield


def _rng(seed):
  return np.random.RandomState(seed)


def _report_blocks(report):
  """{layer name (last path component): block class} of a report."""
  blocks = {}
  for line in report.splitlines()[2:]:
    if line.startswith(("loss: ", "K-FAC state: ")):
      continue
    cells = line.split()
    blocks[cells[0].split("/")[-1]] = cells[2]
  return blocks


def _report_line(report, name):
  for line in report.splitlines()[2:]:
    if line.split()[0].split("/")[-1] == name:
      return line
  raise AssertionError("no report line for %s in\n%s" % (name, report))


# =========================================================== the layer zoo
# Each layer kind is a branch `inputs -> layer -> (Flatten)`; the branches of
# a group are concatenated into one head Dense(3), so a group costs one
# trace. In "exact" mode every layer's block is its own, so a wrong
# registration shows in that layer's variables (the first step) and the
# assertion names the layer.


class Branch:
  """inputs: numpy arrays; keras_body(K, keras_inputs) -> features;
  ref_body(lc, v, xs) -> features, registering by hand on lc (v: {layer
  name: [its trainable tf.Variables in layer.trainable_weights order]});
  blocks: {layer name: block class}; fallback: {layer name: (layer class,
  words of the reason)}."""

  def __init__(self, inputs, keras_body, ref_body, blocks, fallback=None):
    self.inputs = inputs
    self.keras_body = keras_body
    self.ref_body = ref_body
    self.blocks = blocks
    self.fallback = fallback or {}


def _dense_branches(r):
  out = []

  # Dense, fused relu, rank-2 inputs.
  def ref(lc, v, xs):
    w, b = v["dense_relu"]
    pre = tf.matmul(xs[0], w) + b
    lc.register_fully_connected((w, b), xs[0], pre)
    return tf.nn.relu(pre)
  out.append(Branch(
      [r.randn(N, 5)],
      lambda K, x: K.layers.Dense(4, activation="relu",
                                  name="dense_relu")(x[0]),
      ref, {"dense_relu": "FullyConnectedKFACBasicFB"}))

  # Dense on rank-3 inputs [N, T, in] (KFAC-expand over the T positions).
  def ref(lc, v, xs):
    w, b = v["dense_rank3"]
    pre = tf.einsum("ntf,fu->ntu", xs[0], w) + b
    lc.register_fully_connected((w, b), xs[0], pre)
    return tf.nn.relu(pre)
  out.append(Branch(
      [r.randn(N, 3, 2)],
      lambda K, x: K.layers.Dense(4, activation="relu",
                                  name="dense_rank3")(x[0]),
      ref, {"dense_rank3": "FullyConnectedKFACBasicFB"}))

  # Dense without a bias: the kernel alone.
  def ref(lc, v, xs):
    (w,) = v["dense_nobias"]
    pre = tf.matmul(xs[0], w)
    lc.register_fully_connected(w, xs[0], pre)
    return pre
  out.append(Branch(
      [r.randn(N, 3)],
      lambda K, x: K.layers.Dense(2, use_bias=False,
                                  name="dense_nobias")(x[0]),
      ref, {"dense_nobias": "FullyConnectedKFACBasicFB"}))

  # EinsumDense 'ab,bc->ac' with bias 'c', fused tanh.
  def ref(lc, v, xs):
    w, b = v["einsum"]
    pre = tf.matmul(xs[0], w) + b
    lc.register_fully_connected((w, b), xs[0], pre)
    return tf.tanh(pre)
  out.append(Branch(
      [r.randn(N, 5)],
      lambda K, x: K.layers.EinsumDense("ab,bc->ac", output_shape=3,
                                        bias_axes="c", activation="tanh",
                                        name="einsum")(x[0]),
      ref, {"einsum": "FullyConnectedKFACBasicFB"}))

  # A Dense layer called on two inputs: multi-use (kron_indep).
  def ref(lc, v, xs):
    w, b = v["shared_dense"]
    pres = [tf.matmul(x, w) + b for x in xs]
    lc.register_fully_connected_multi((w, b), list(xs), pres)
    return tf.concat([tf.nn.relu(p) for p in pres], axis=1)

  def body(K, x):
    shared = K.layers.Dense(3, activation="relu", name="shared_dense")
    return K.layers.Concatenate()([shared(x[0]), shared(x[1])])
  out.append(Branch(
      [r.randn(N, 4), r.randn(N, 4)], body, ref,
      {"shared_dense": "FullyConnectedMultiIndepFB"}))

  # A Dense shared by two sequences [N, T, in]: no multi-use block takes
  # positions within a use, so the generic diagonal fallback.
  def ref(lc, v, xs):
    w, b = v["shared_seq"]
    pres = [tf.einsum("ntf,fu->ntu", x, w) + b for x in xs]
    lc.register_generic((w, b), N, approx="diagonal")
    return tf.concat(pres, axis=1)

  def body(K, x):
    shared = K.layers.Dense(2, name="shared_seq")
    return K.layers.Concatenate(axis=1)([shared(x[0]), shared(x[1])])
  out.append(Branch(
      [r.randn(N, 2, 3), r.randn(N, 2, 3)], body, ref,
      {"shared_seq": "NaiveDiagonalFB"},
      {"shared_seq": ("Dense", "called 2 times in one step on inputs with "
                      "positions")}))
  return out


def _conv_branches(r):
  out = []

  # Conv2D, strides 2, 'same', fused relu, channels_last. The reference
  # pads explicitly (TF SAME: 5 -> 3 with a 3x3 kernel and stride 2 pads
  # one on each side) and registers a VALID convolution.
  def ref(lc, v, xs):
    k, b = v["conv2d"]
    xp = tf.pad(xs[0], [[0, 0], [1, 1], [1, 1], [0, 0]])
    pre = tf.nn.conv2d(xp, k, [1, 2, 2, 1], "VALID") + b
    lc.register_conv2d((k, b), [1, 2, 2, 1], "VALID", xp, pre)
    return tf.nn.relu(pre)
  out.append(Branch(
      [r.randn(N, 5, 5, 2)],
      lambda K, x: K.layers.Conv2D(3, 3, strides=2, padding="same",
                                   activation="relu", name="conv2d")(x[0]),
      ref, {"conv2d": "ConvKFCBasicFB"}))

  # Conv1D, causal, dilation 2: left padding (k - 1) * d = 2, then VALID.
  def ref(lc, v, xs):
    k, b = v["conv1d"]
    xp = tf.pad(xs[0], [[0, 0], [2, 0], [0, 0]])
    pre = tf.nn.convolution(xp, k, padding="VALID", dilations=[2]) + b
    lc.register_conv1d((k, b), 1, "VALID", xp, pre, dilations=2)
    return pre
  out.append(Branch(
      [r.randn(N, 6, 2)],
      lambda K, x: K.layers.Conv1D(3, 2, padding="causal", dilation_rate=2,
                                   name="conv1d")(x[0]),
      ref, {"conv1d": "ConvKFCBasicFB"}))

  # DepthwiseConv2D, depth_multiplier 2, valid, bias.
  def ref(lc, v, xs):
    k, b = v["depthwise"]
    pre = tf.nn.depthwise_conv2d(xs[0], k, [1, 1, 1, 1], "VALID") + b
    lc.register_depthwise_conv2d((k, b), xs[0], pre, [1, 1, 1, 1], "VALID",
                                 approx="kron")
    return pre
  out.append(Branch(
      [r.randn(N, 4, 4, 2)],
      lambda K, x: K.layers.DepthwiseConv2D(2, depth_multiplier=2,
                                            name="depthwise")(x[0]),
      ref, {"depthwise": "DepthwiseConvKFCBasicFB"}))

  # Conv3D, valid, channels_last.
  def ref(lc, v, xs):
    k, b = v["conv3d"]
    pre = tf.nn.conv3d(xs[0], k, [1, 1, 1, 1, 1], "VALID") + b
    lc.register_convolution((k, b), xs[0], pre, "VALID")
    return pre
  out.append(Branch(
      [r.randn(N, 3, 3, 3, 1)],
      lambda K, x: K.layers.Conv3D(2, 2, name="conv3d")(x[0]),
      ref, {"conv3d": "ConvKFCBasicFB"}))

  # A Conv2D shared by two images: multi-use (kron_indep).
  def ref(lc, v, xs):
    k, b = v["shared_conv"]
    pres = [tf.nn.conv2d(x, k, [1, 1, 1, 1], "VALID") + b for x in xs]
    lc.register_conv2d_multi((k, b), [1, 1, 1, 1], "VALID", list(xs), pres)
    return tf.concat(pres, axis=-1)

  def body(K, x):
    shared = K.layers.Conv2D(2, 2, name="shared_conv")
    return K.layers.Concatenate()([shared(x[0]), shared(x[1])])
  out.append(Branch(
      [r.randn(N, 3, 3, 1), r.randn(N, 3, 3, 1)], body, ref,
      {"shared_conv": "ConvKFCBasicMultiIndepFB"}))

  # Conv2DTranspose, strides 2, 'same', fused relu: 3x3 -> 6x6.
  def ref(lc, v, xs):
    k, b = v["deconv"]
    pre = tf.nn.conv2d_transpose(xs[0], k, [N, 6, 6, 2], [1, 2, 2, 1],
                                 "SAME") + b
    lc.register_conv2d_transpose((k, b), xs[0], pre, 2, "SAME")
    return tf.nn.relu(pre)
  out.append(Branch(
      [r.randn(N, 3, 3, 2)],
      lambda K, x: K.layers.Conv2DTranspose(2, 3, strides=2, padding="same",
                                            activation="relu",
                                            name="deconv")(x[0]),
      ref, {"deconv": "ConvTransposeKFCBasicBiasFB"}))

  # Conv1DTranspose, strides 2, 'valid', output_padding 1: 3 -> 7.
  def ref(lc, v, xs):
    k, b = v["deconv1d"]
    pre = tf.nn.conv1d_transpose(xs[0], k, [N, 7, 2], 2, "VALID") + b
    lc.register_conv1d_transpose((k, b), xs[0], pre, 2, "VALID")
    return pre
  out.append(Branch(
      [r.randn(N, 3, 2)],
      lambda K, x: K.layers.Conv1DTranspose(2, 2, strides=2,
                                            output_padding=1,
                                            name="deconv1d")(x[0]),
      ref, {"deconv1d": "ConvTransposeKFCBasicBiasFB"}))

  # Conv3DTranspose, strides (2, 1, 1), 'valid': 2x2x2 -> 4x3x3.
  def ref(lc, v, xs):
    k, b = v["deconv3d"]
    pre = tf.nn.conv3d_transpose(xs[0], k, [N, 4, 3, 3, 2],
                                 [1, 2, 1, 1, 1], "VALID") + b
    lc.register_conv_transpose((k, b), xs[0], pre, [2, 1, 1], "VALID")
    return pre
  out.append(Branch(
      [r.randn(N, 2, 2, 2, 1)],
      lambda K, x: K.layers.Conv3DTranspose(2, 2, strides=(2, 1, 1),
                                            name="deconv3d")(x[0]),
      ref, {"deconv3d": "ConvTransposeKFCBasicBiasFB"}))

  return out


def _lookup_and_norm_branches(r):
  out = []

  # Embedding [N, T] ids -> [N, T, D] -> Flatten.
  ids = r.randint(0, 6, size=(N, 3)).astype(np.int32)
  ids[0, 0] = ids[0, 1]  # a repeated id within an example

  def ref(lc, v, xs):
    (table,) = v["embedding"]
    looked_up = tf.gather(table, xs[0])
    lc.register_embedding(table, xs[0], looked_up)
    return looked_up
  out.append(Branch(
      [ids], lambda K, x: K.layers.Embedding(6, 2, name="embedding")(x[0]),
      ref, {"embedding": "EmbeddingKFACFB"}))

  # A shared Embedding on two id inputs, one id per example each.
  def ref(lc, v, xs):
    (table,) = v["shared_emb"]
    looked_up = [tf.gather(table, x) for x in xs]
    lc.register_fully_connected_multi(table, list(xs), looked_up,
                                      dense_inputs=False)
    return tf.concat(looked_up, axis=1)

  def body(K, x):
    shared = K.layers.Embedding(5, 2, name="shared_emb")
    return K.layers.Concatenate(axis=1)([shared(x[0]), shared(x[1])])
  out.append(Branch(
      [np.array([0, 3, 3, 1], np.int32), np.array([3, 4, 0, 3], np.int32)],
      body, ref, {"shared_emb": "EmbeddingMultiIndepFB"}))

  # BatchNormalization in training mode on [N, H, W, C], channel axis -1.
  def ref(lc, v, xs):
    gamma, beta = v["batch_norm"]
    mean, var = tf.nn.moments(xs[0], [0, 1, 2], keepdims=True)
    normalized = (xs[0] - mean) / tf.sqrt(var + 1e-3)
    out = normalized * gamma + beta
    lc.register_scale_and_shift((gamma, beta), normalized, out)
    return out
  out.append(Branch(
      [r.randn(N, 2, 2, 3)],
      lambda K, x: K.layers.BatchNormalization(name="batch_norm")(x[0]),
      ref, {"batch_norm": "ScaleAndShiftFullFB"}))

  # BatchNormalization over a channel axis that is not the last one: the
  # scale-and-shift block cannot take it (see layer_registration), so the
  # generic diagonal fallback.
  def ref(lc, v, xs):
    gamma, beta = v["bn_axis1"]
    mean, var = tf.nn.moments(xs[0], [0, 2], keepdims=True)
    normalized = (xs[0] - mean) / tf.sqrt(var + 1e-3)
    out = normalized * gamma[:, None] + beta[:, None]
    lc.register_generic((gamma, beta), N, approx="diagonal")
    return out
  out.append(Branch(
      [r.randn(N, 3, 2)],
      lambda K, x: K.layers.BatchNormalization(axis=1, name="bn_axis1")(x[0]),
      ref, {"bn_axis1": "NaiveDiagonalFB"},
      {"bn_axis1": ("BatchNormalization", "axis 1, not the last axis")}))

  # LayerNormalization over the last axis of [N, T, F].
  def ref(lc, v, xs):
    gamma, beta = v["layer_norm"]
    mean, var = tf.nn.moments(xs[0], [2], keepdims=True)
    normalized = (xs[0] - mean) / tf.sqrt(var + 1e-3)
    out = normalized * gamma + beta
    lc.register_scale_and_shift((gamma, beta), normalized, out)
    return out
  out.append(Branch(
      [r.randn(N, 2, 4)],
      lambda K, x: K.layers.LayerNormalization(name="layer_norm")(x[0]),
      ref, {"layer_norm": "ScaleAndShiftFullFB"}))

  # LayerNormalization over the two trailing axes, scale only.
  def ref(lc, v, xs):
    (gamma,) = v["ln_2axes"]
    mean, var = tf.nn.moments(xs[0], [1, 2], keepdims=True)
    normalized = (xs[0] - mean) / tf.sqrt(var + 1e-3)
    out = normalized * gamma
    lc.register_scale_and_shift(gamma, normalized, out)
    return out
  out.append(Branch(
      [r.randn(N, 2, 3)],
      lambda K, x: K.layers.LayerNormalization(axis=[1, 2], center=False,
                                               name="ln_2axes")(x[0]),
      ref, {"ln_2axes": "ScaleAndShiftFullFB"}))
  return out


def _group_norm(x, groups, eps=1e-3):
  """Group normalisation by hand: channels (last axis) in `groups`
  consecutive groups, moments per example over a group's channels and the
  spatial axes."""
  shape = x.shape.as_list()
  grouped = tf.reshape(x, shape[:-1] + [groups, shape[-1] // groups])
  axes = list(range(1, len(shape) - 1)) + [len(shape)]
  mean, var = tf.nn.moments(grouped, axes, keepdims=True)
  return tf.reshape((grouped - mean) / tf.sqrt(var + eps), shape)


def _group_norm_branches(r):
  out = []

  # A small conv net: Conv2D -> GroupNormalization(2 groups of 2 channels)
  # -> relu -> Conv2D.
  def ref(lc, v, xs):
    k1, b1 = v["gn_conv1"]
    gamma, beta = v["group_norm"]
    k2, b2 = v["gn_conv2"]
    pre = tf.nn.conv2d(xs[0], k1, [1, 1, 1, 1], "VALID") + b1
    lc.register_conv2d((k1, b1), [1, 1, 1, 1], "VALID", xs[0], pre)
    normalized = _group_norm(pre, 2)
    h = normalized * gamma + beta
    lc.register_scale_and_shift((gamma, beta), normalized, h)
    h = tf.nn.relu(h)
    pre2 = tf.nn.conv2d(h, k2, [1, 1, 1, 1], "VALID") + b2
    lc.register_conv2d((k2, b2), [1, 1, 1, 1], "VALID", h, pre2)
    return pre2

  def body(K, x):
    h = K.layers.Conv2D(4, 2, name="gn_conv1")(x[0])
    h = K.layers.GroupNormalization(groups=2, name="group_norm")(h)
    h = K.layers.Activation("relu")(h)
    return K.layers.Conv2D(2, 2, name="gn_conv2")(h)
  out.append(Branch(
      [r.randn(N, 4, 4, 2)], body, ref,
      {"gn_conv1": "ConvKFCBasicFB", "group_norm": "ScaleAndShiftFullFB",
       "gn_conv2": "ConvKFCBasicFB"}))

  # Instance normalisation (groups=-1: one channel per group) of a
  # sequence, "diagonal" by name.
  def ref(lc, v, xs):
    gamma, beta = v["instance_norm"]
    normalized = _group_norm(xs[0], 3)
    h = normalized * gamma + beta
    lc.register_scale_and_shift((gamma, beta), normalized, h,
                                approx="diagonal")
    return h
  out.append(Branch(
      [r.randn(N, 4, 3)],
      lambda K, x: K.layers.GroupNormalization(groups=-1,
                                               name="instance_norm")(x[0]),
      ref, {"instance_norm": "ScaleAndShiftDiagonalFB"}))

  # Channel axis 1 of [N, C, L]: the block cannot take it (generic).
  def ref(lc, v, xs):
    gamma, beta = v["gn_axis1"]
    x = tf.transpose(xs[0], [0, 2, 1])
    h = _group_norm(x, 2) * gamma + beta
    lc.register_generic((gamma, beta), N, approx="diagonal")
    return tf.transpose(h, [0, 2, 1])
  out.append(Branch(
      [r.randn(N, 4, 3)],
      lambda K, x: K.layers.GroupNormalization(groups=2, axis=1,
                                               name="gn_axis1")(x[0]),
      ref, {"gn_axis1": "NaiveDiagonalFB"},
      {"gn_axis1": ("GroupNormalization", "axis 1, not the last axis")}))

  # Without scale: only beta, no scale-and-shift block (generic).
  def ref(lc, v, xs):
    (beta,) = v["gn_noscale"]
    h = _group_norm(xs[0], 2) + beta
    lc.register_generic(beta, N, approx="diagonal")
    return h
  out.append(Branch(
      [r.randn(N, 3, 4)],
      lambda K, x: K.layers.GroupNormalization(groups=2, scale=False,
                                               name="gn_noscale")(x[0]),
      ref, {"gn_noscale": "NaiveDiagonalFB"},
      {"gn_noscale": ("GroupNormalization", "without scale")}))
  return out


class _TokenAndPosition:
  """The keras.io transformer pattern: tokens [N, T] -> token embedding +
  position embedding of tf.range(T) (ids without a batch axis); `combine`
  is how the positions join the tokens."""

  def __init__(self, name, combine):
    self.name, self.combine = name, combine

  def __call__(self, K, x):
    combine, name = self.combine, self.name

    class TokPos(K.layers.Layer):

      def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tok = K.layers.Embedding(6, 2, name=name + "_tok")
        self.pos = K.layers.Embedding(4, 2, name=name + "_pos")

      def call(self, tokens):
        positions = self.pos(tf.range(tf.shape(tokens)[1]))
        return combine(self.tok(tokens), positions)

    return TokPos(name=self.name)(x[0])


def _position_branches(r):
  out = []
  tokens = r.randint(0, 6, size=(N, 3)).astype(np.int32)

  # Added to the tokens: the position table registered on the ids tiled
  # over the batch and the sum (its gradient is each example's own).
  def ref(lc, v, xs):
    tok, pos = v["tok_pos"]
    ids = tf.range(3)
    total = tf.gather(tok, xs[0]) + tf.gather(pos, ids)
    lc.register_embedding(tok, xs[0], total)
    lc.register_embedding(pos, tf.broadcast_to(ids, [N, 3]), total)
    return total
  out.append(Branch([tokens], _TokenAndPosition("tok_pos", tf.add), ref,
                    {"tok_pos_tok": "EmbeddingKFACFB",
                     "tok_pos_pos": "EmbeddingKFACFB"}))

  # Multiplied with the tokens: no per-example gradient of the lookup
  # (generic).
  def ref(lc, v, xs):
    tok, pos = v["tok_times_pos"]
    looked_up = tf.gather(tok, xs[0])
    lc.register_embedding(tok, xs[0], looked_up)
    lc.register_generic(pos, N, approx="diagonal")
    return looked_up * tf.gather(pos, tf.range(3))
  out.append(Branch([tokens], _TokenAndPosition("tok_times_pos",
                                                tf.multiply), ref,
                    {"tok_times_pos_tok": "EmbeddingKFACFB",
                     "tok_times_pos_pos": "NaiveDiagonalFB"},
                    {"tok_times_pos_pos": ("Embedding", "used by Mul, not "
                                           "by one addition")}))
  return out


def _fisher_approx_branches(r):
  # fisher_approx (see ZOO): "kron_reduce" for every Conv2D by class, but
  # "diagonal" for conv_b by name (a name wins over a class), and
  # "diagonal" for every Dense by a "__class__:Dense" key (how a config
  # stores class keys).
  def ref(lc, v, xs):
    ka, ba = v["conv_a"]
    kb, bb = v["conv_b"]
    w, b = v["mid"]
    pre_a = tf.nn.conv2d(xs[0], ka, [1, 1, 1, 1], "VALID") + ba
    lc.register_conv2d((ka, ba), [1, 1, 1, 1], "VALID", xs[0], pre_a,
                       approx="kron_reduce")
    pre_b = tf.nn.conv2d(pre_a, kb, [1, 1, 1, 1], "VALID") + bb
    lc.register_conv2d((kb, bb), [1, 1, 1, 1], "VALID", pre_a, pre_b,
                       approx="diagonal")
    h = tf.reshape(pre_b, [N, -1])
    pre = tf.matmul(h, w) + b
    lc.register_fully_connected((w, b), h, pre, approx="diagonal")
    return pre

  def body(K, x):
    h = K.layers.Conv2D(2, 2, name="conv_a")(x[0])
    h = K.layers.Conv2D(2, 2, name="conv_b")(h)
    return K.layers.Dense(3, name="mid")(K.layers.Flatten()(h))
  out = [Branch([r.randn(N, 4, 4, 2)], body, ref,
                {"conv_a": "ConvKFCReduceFB", "conv_b": "ConvDiagonalFB",
                 "mid": "FullyConnectedDiagonalFB"})]

  # A Conv2DTranspose with "diagonal" by name (tf_keras's Conv2DTranspose
  # is a Conv2D: the name wins over the Conv2D class key).
  def ref(lc, v, xs):
    k, b = v["deconv_diag"]
    pre = tf.nn.conv2d_transpose(xs[0], k, [N, 4, 4, 2], [1, 2, 2, 1],
                                 "VALID") + b
    lc.register_conv2d_transpose((k, b), xs[0], pre, 2, "VALID",
                                 approx="diagonal")
    return pre
  out.append(Branch(
      [r.randn(N, 2, 2, 3)],
      lambda K, x: K.layers.Conv2DTranspose(2, 2, strides=2,
                                            name="deconv_diag")(x[0]),
      ref, {"deconv_diag": "ConvTransposeDiagonalFB"}))
  return out


def _separable_grouped_branches(r):
  out = []

  # SeparableConv2D, depth_multiplier 2, same, dilation 2, fused relu: the
  # reference computes the depthwise and the pointwise convolutions
  # separately and registers the pair by hand.
  def ref(lc, v, xs):
    dk, pk, b = v["separable"]
    mid = tf.nn.depthwise_conv2d(xs[0], dk, [1, 1, 1, 1], "SAME",
                                 dilations=[2, 2])
    pre = tf.nn.conv2d(mid, pk, [1, 1, 1, 1], "VALID") + b
    lc.register_separable_conv2d(dk, (pk, b), xs[0], mid, pre, 1, "SAME",
                                 rate=2, approx=("kron", None))
    return tf.nn.relu(pre)
  out.append(Branch(
      [r.randn(N, 5, 5, 2)],
      lambda K, x: K.layers.SeparableConv2D(
          3, 2, depth_multiplier=2, padding="same", dilation_rate=2,
          activation="relu", name="separable")(x[0]),
      ref, {"separable": "DepthwiseConvKFCBasicFB+ConvKFCBasicFB"}))

  # Conv2D with groups=2 (4 input channels, 4 outputs): the reference is two
  # convolutions of channel slices, concatenated.
  def ref(lc, v, xs):
    k, b = v["grouped"]
    pre = tf.concat([tf.nn.conv2d(xj, kj, [1, 1, 1, 1], "VALID")
                     for xj, kj in zip(tf.split(xs[0], 2, axis=-1),
                                       tf.split(k, 2, axis=-1))], -1) + b
    lc.register_grouped_convolution((k, b), xs[0], pre, "VALID", 2)
    return pre
  out.append(Branch(
      [r.randn(N, 3, 3, 4)],
      lambda K, x: K.layers.Conv2D(4, 2, groups=2, name="grouped")(x[0]),
      ref, {"grouped": "GroupedConvKFCBasicFB"}))
  return out


def _attention_branches(r):
  # A transformer block: MultiHeadAttention (its query / key / value
  # projections EinsumDense 'abc,cde->abde', the output projection
  # 'abcd,cde->abe': dense maps over [batch, T] with kernels [D, H, K] and
  # [H, K, D]), a residual, LayerNormalization and a per-position Dense.
  # The reference registers the projections with output_axes (2 for the
  # query / key / value kernels) and the attention's [N, T, H, K] output
  # as the output projection's inputs (flattened by the registration).
  # key_dim 4: the scale 1/sqrt(key_dim) = 0.5 is exact in float32 (Keras
  # 3's attention casts a Python float scale through a float32 constant).
  heads, key_dim = 2, 4

  def ref(lc, v, xs):
    x = xs[0]
    wq, bq, wk, bk, wv, bv, wo, bo = v["mha"]
    proj = []
    for w, b in ((wq, bq), (wk, bk), (wv, bv)):
      pre = tf.einsum("abc,cde->abde", x, w) + b
      lc.register_fully_connected((w, b), x, pre, output_axes=2)
      proj.append(pre)
    q, k, val = proj
    scores = tf.einsum("aecd,abcd->acbe", k, q / np.sqrt(key_dim))
    att = tf.einsum("acbe,aecd->abcd", tf.nn.softmax(scores, axis=-1), val)
    out = tf.einsum("abcd,cde->abe", att, wo) + bo
    lc.register_fully_connected((wo, bo), att, out)
    gamma, beta = v["ln"]
    h = x + out
    mean, var = tf.nn.moments(h, [2], keepdims=True)
    normalized = (h - mean) / tf.sqrt(var + 1e-3)
    h = normalized * gamma + beta
    lc.register_scale_and_shift((gamma, beta), normalized, h)
    w, b = v["ffn"]
    pre = tf.einsum("ntd,de->nte", h, w) + b
    lc.register_fully_connected((w, b), h, pre)
    return tf.nn.relu(pre)

  def body(K, x):
    att = K.layers.MultiHeadAttention(heads, key_dim, name="mha")(x[0], x[0])
    h = K.layers.LayerNormalization(name="ln")(K.layers.Add()([x[0], att]))
    return K.layers.Dense(3, activation="relu", name="ffn")(h)
  dense = "FullyConnectedKFACBasicFB"
  return [Branch([r.randn(N, 3, 4)], body, ref,
                 {"query": dense, "key": dense, "value": dense,
                  "attention_output": dense, "ln": "ScaleAndShiftFullFB",
                  "ffn": dense})]


def _recurrent_branches(r):
  # LSTM and GRU (reset_after both ways), default activations (tanh,
  # sigmoid), T = 3 steps. The reference unrolls the recurrence in Python
  # (one tensor per step, the recurrent kernel read once) and registers by
  # hand what recurrent.py registers: the input kernel on the inputs and
  # the input projection Z (one [N, T, .] tensor), the recurrent kernel on
  # h_{t-1} and a zero probe [N, T, .] added to the recurrent product
  # (KFAC-expand over the steps); a reset_after GRU's bias [2, 3u] on
  # one-hot inputs and a probe [N, T, 2, 3u] (row 0 with the input
  # projection, row 1 with the recurrent product); a reset_after=False
  # GRU's recurrent kernel on [N, T, 2, u] inputs (h_{t-1}, r_t h_{t-1}).
  steps, units = 3, 2
  dense = "FullyConnectedKFACBasicFB"

  def lstm_ref(lc, v, xs):
    w, u, b = v["lstm"]
    x, u = xs[0], _read_once(u)
    z = tf.einsum("ntd,dg->ntg", x, w) + b
    probe = tf.zeros_like(z)
    h = c = tf.zeros([N, units], tf.float64)
    prev = []
    for t in range(steps):
      prev.append(h)
      i, f, g, o = tf.split(z[:, t] + (tf.matmul(h, u) + probe[:, t]), 4, 1)
      c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
      h = tf.sigmoid(o) * tf.tanh(c)
    lc.register_fully_connected((w, b), x, z)
    lc.register_fully_connected(u_var(v, "lstm"), tf.stack(prev, 1), probe)
    return h

  def gru_ref(lc, v, xs):
    w, u, b = v["gru"]
    x, u = xs[0], _read_once(u)
    z = tf.einsum("ntd,dg->ntg", x, w)
    probe = tf.zeros_like(z)
    bias_probe = tf.zeros([N, steps, 2, 3 * units], tf.float64)
    b_in, b_rec = tf.unstack(b)
    h = tf.zeros([N, units], tf.float64)
    prev = []
    for t in range(steps):
      prev.append(h)
      xp = z[:, t] + b_in + bias_probe[:, t, 0]
      inner = tf.matmul(h, u) + probe[:, t] + (b_rec + bias_probe[:, t, 1])
      zg = tf.sigmoid(xp[:, :units] + inner[:, :units])
      rg = tf.sigmoid(xp[:, units:2 * units] + inner[:, units:2 * units])
      hh = tf.tanh(xp[:, 2 * units:] + rg * inner[:, 2 * units:])
      h = zg * h + (1 - zg) * hh
    lc.register_fully_connected(w, x, z)
    lc.register_fully_connected(u_var(v, "gru"), tf.stack(prev, 1), probe)
    lc.register_fully_connected(
        b, tf.constant(np.broadcast_to(np.eye(2), (N, steps, 2, 2))),
        bias_probe)
    return h

  def gru_before_ref(lc, v, xs):
    w, u, b = v["gru_before"]
    x, u = xs[0], _read_once(u)
    z = tf.einsum("ntd,dg->ntg", x, w) + b
    probe = tf.zeros([N, steps, 2, 3 * units], tf.float64)
    h = tf.zeros([N, units], tf.float64)
    prev, hs = [], []
    for t in range(steps):
      inner = (tf.matmul(h, u[:, :2 * units]) +
               probe[:, t, 0, :2 * units])
      zg = tf.sigmoid(z[:, t, :units] + inner[:, :units])
      rg = tf.sigmoid(z[:, t, units:2 * units] + inner[:, units:])
      prev.append(tf.stack([h, rg * h], 1))
      hh = tf.tanh(z[:, t, 2 * units:] + (
          tf.matmul(rg * h, u[:, 2 * units:]) + probe[:, t, 1, 2 * units:]))
      h = zg * h + (1 - zg) * hh
      hs.append(h)
    lc.register_fully_connected((w, b), x, z)
    lc.register_fully_connected(u_var(v, "gru_before"),
                                tf.stop_gradient(tf.stack(prev, 1)), probe)
    return tf.stack(hs, 1)

  def u_var(v, name):
    return v[name][1]

  def _read_once(u):
    # One op reads the kernel, as in a loop (the TF1 use check counts the
    # ops reading a variable, through identities).
    return tf.reshape(u, u.shape)

  x = r.randn(N, steps, 3)
  return [
      Branch([x], lambda K, x: K.layers.LSTM(units, name="lstm")(x[0]),
             lstm_ref, {"lstm_cell": dense + "+" + dense}),
      Branch([x], lambda K, x: K.layers.GRU(units, name="gru")(x[0]),
             gru_ref, {"gru_cell": "+".join([dense] * 3)}),
      Branch([x], lambda K, x: K.layers.GRU(
          units, reset_after=False, return_sequences=True,
          name="gru_before")(x[0]),
             gru_before_ref, {"gru_cell": dense + "+" + dense}),
  ]


# "head" (the last Dense) is diagonal only in the fisher_approx group, whose
# "__class__:Dense" key covers it.
ZOO = {
    "dense": (_dense_branches, None),
    "conv": (_conv_branches, None),
    "separable_grouped": (_separable_grouped_branches, None),
    "lookup_and_norm": (_lookup_and_norm_branches, None),
    "attention": (_attention_branches, None),
    "group_norm": (_group_norm_branches, {"instance_norm": "diagonal"}),
    "position": (_position_branches, None),
    # (two groups: both GRU rows are named gru_cell)
    "recurrent": (lambda r: _recurrent_branches(r)[:2], None),
    "gru_reset_before": (lambda r: _recurrent_branches(r)[2:], None),
    "fisher_approx": (_fisher_approx_branches, {
        "conv_b": "diagonal", "deconv_diag": "diagonal",
        keras.layers.Conv2D: "kron_reduce",
        layer_registration.CLASS_KEY_PREFIX + "Dense": "diagonal"}),
}
LABELS = np.array([0, 1, 2, 1], dtype=np.int32)


def _zoo_group(name):
  make, fisher_approx = ZOO[name]
  return make(_rng(1)), fisher_approx


def _keras_model(branches):
  inputs, features = [], []
  for branch in branches:
    ins = [keras.Input(x.shape[1:], dtype=x.dtype.name,
                       name="in%d" % (len(inputs) + i))
           for i, x in enumerate(branch.inputs)]
    h = branch.keras_body(keras, ins)
    if len(h.shape) > 2:
      h = keras.layers.Flatten()(h)
    inputs += ins
    features.append(h)
  h = (keras.layers.Concatenate()(features) if len(features) > 1
       else features[0])
  logits = keras.layers.Dense(CLASSES, name="head")(h)
  return keras.Model(inputs, logits)


def _flat(h):
  return tf.reshape(h, [N, -1]) if h.shape.rank > 2 else h


def _initial_weights(model, seed):
  """{layer name: [numpy values]}, assigned to the model."""
  r = _rng(seed)
  weights = {}
  for layer in model.layers:
    values = [0.5 * r.randn(*w.shape) for w in layer.trainable_weights]
    for var, value in zip(layer.trainable_weights, values):
      var.assign(value)
    if values:
      weights[layer.name] = values
  return weights


def _kfac_kwargs():
  return dict(invert_every=1, estimation_mode="exact", momentum=0.0)


def _keras_steps(branches, fisher_approx, steps=2):
  model = _keras_model(branches)
  init = _initial_weights(model, seed=7)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  opt = kfac.keras.optimizers.Kfac(
      learning_rate=LR, damping=DAMPING, model=model, loss=loss,
      fisher_approx=fisher_approx, seed=0, **_kfac_kwargs())
  model.compile(optimizer=opt, loss=loss)
  xs = [x for branch in branches for x in branch.inputs]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.fit(xs, LABELS, batch_size=N, epochs=steps, shuffle=False,
              verbose=0)
  new = {layer.name: [w.numpy() for w in layer.trainable_weights]
         for layer in model.layers if layer.trainable_weights}
  return init, new, opt.registration_report, caught


def _reference_steps(branches, init, head_approx=None, steps=2):
  with tf.Graph().as_default():
    v = {name: [tf.Variable(w) for w in values]
         for name, values in init.items()}
    lc = kfac.LayerCollection()
    features = [_flat(branch.ref_body(lc, v, [tf.constant(x)
                                              for x in branch.inputs]))
                for branch in branches]
    h = tf.concat(features, axis=1) if len(features) > 1 else features[0]
    w, b = v["head"]
    logits = tf.matmul(h, w) + b
    lc.register_fully_connected((w, b), h, logits, approx=head_approx)
    lc.register_categorical_predictive_distribution(logits)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.constant(LABELS), logits=logits))
    # Damping in a float32 variable, as the Keras optimizer keeps it: the
    # damping of a block shared over c positions is damping / c computed in
    # the damping's dtype (damping.scaled_damping_func), so a Python float
    # here would differ by float32 rounding of 1/c (~1e-8 relative).
    damping = tf.Variable(DAMPING, dtype=tf.float32)
    opt = kfac.PeriodicInvCovUpdateKfacOpt(
        learning_rate=LR, damping=damping, layer_collection=lc,
        **_kfac_kwargs())
    flat = [var for values in v.values() for var in values]
    train = opt.minimize(loss, var_list=flat)
    blocks = sorted(type(block).__name__ for block in lc.get_blocks())
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      for _ in range(steps):
        sess.run(train)
      return {name: sess.run(values) for name, values in v.items()}, blocks


# The recurrent groups build a Python-unrolled reference: the slow tier
# (keras_recurrent_test.py covers LSTM / GRU in the fast tier).
_SLOW_GROUPS = ("recurrent", "gru_reset_before")


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("group", [
    pytest.param(g, marks=pytest.mark.slow) if g in _SLOW_GROUPS else g
    for g in sorted(ZOO)])
def test_layer_zoo_two_fit_steps_match_hand_registration(group):
  branches, fisher_approx = _zoo_group(group)
  # Only the fisher_approx group's "__class__:Dense" key covers the head.
  head_approx = "diagonal" if group == "fisher_approx" else None
  init, keras_new, report, caught = _keras_steps(branches, fisher_approx)
  ref_new, ref_blocks = _reference_steps(branches, init, head_approx)
  assert sorted(keras_new) == sorted(ref_new) == sorted(init)
  deltas = {name: [r - i for r, i in zip(ref_new[name], init[name])]
            for name in init}
  scale = max(np.abs(d).max() for ds in deltas.values() for d in ds)
  assert scale > 1e-2, "the steps must move the weights"
  errors = {}
  for name in init:
    for i, (k, r, d) in enumerate(zip(keras_new[name], ref_new[name],
                                      deltas[name])):
      assert np.abs(d).max() > 0, (name, i)
      errors["%s[%d]" % (name, i)] = np.abs(k - r).max() / scale
  assert max(errors.values()) < STEP_REL, errors

  expected = {"head": ("FullyConnectedDiagonalFB" if head_approx
                       else "FullyConnectedKFACBasicFB")}
  fallbacks = {}
  for branch in branches:
    expected.update(branch.blocks)
    fallbacks.update(branch.fallback)
  assert _report_blocks(report) == expected, report
  # (a SeparableConv2D's row names its two blocks, joined by "+")
  assert sorted(n for v in expected.values() for n in v.split("+")) == \
      ref_blocks

  messages = [str(w.message) for w in caught
              if issubclass(w.category, UserWarning) and
              str(w.message).startswith("kfac: layer")]
  assert len(messages) == len(fallbacks), messages
  for name, (layer_class, reason) in fallbacks.items():
    mine = [m for m in messages if re.search(r"'(\S+/)?%s'" % name, m)]
    assert len(mine) == 1, (name, messages)
    assert "generic 'diagonal'" in mine[0], mine[0]
    assert layer_class in mine[0] and reason in mine[0], mine[0]
    line = _report_line(report, name)
    assert "fallback: " in line and reason in line, report
  assert report.count("fallback") == len(fallbacks), report


# =========================================================== losses
LN = 3         # batch of the loss checks
LT = 2         # positions of the rank-3 outputs
LF = 2         # inputs features


class LossCase:
  """kind: the Keras loss; form: "string" or "object" (from_logits=...);
  act: the output activation (None: linear); where: "fused" into the last
  Dense or a separate "layer"; rank3: outputs [N, T, C]."""

  def __init__(self, kind, form, from_logits=False, act=None,
               where="fused", rank3=False):
    self.kind, self.form, self.from_logits = kind, form, from_logits
    self.act, self.where, self.rank3 = act, where, rank3

  @property
  def name(self):
    return "-".join(str(p) for p in (
        self.kind, self.form, "logits" if self.from_logits else "probs",
        self.act or "linear", self.where, "rank3" if self.rank3 else "rank2"))

  def loss(self):
    """Built inside the test, after floatx is float64 (loss dtypes)."""
    if self.form == "string":
      return self.kind
    cls = {"mse": keras.losses.MeanSquaredError,
           "categorical_crossentropy": keras.losses.CategoricalCrossentropy,
           "sparse_categorical_crossentropy":
               keras.losses.SparseCategoricalCrossentropy,
           "binary_crossentropy": keras.losses.BinaryCrossentropy}[self.kind]
    if self.kind == "mse":
      return cls()
    return cls(from_logits=self.from_logits)


def _loss_cases():
  cases = [LossCase("mse", "string"), LossCase("mse", "object"),
           LossCase("mse", "string", rank3=True)]
  for kind, act in (("categorical_crossentropy", "softmax"),
                    ("sparse_categorical_crossentropy", "softmax"),
                    ("binary_crossentropy", "sigmoid")):
    cases += [
        LossCase(kind, "object", from_logits=True),
        LossCase(kind, "string", act=act, where="fused"),
        LossCase(kind, "object", act=act, where="layer"),
        # from_logits=True on a softmax / sigmoid output: Keras warns and
        # uses the logits behind it; so must kfac.
        LossCase(kind, "object", from_logits=True, act=act, where="fused"),
    ]
  cases += [
      LossCase("categorical_crossentropy", "object", from_logits=True,
               rank3=True),
      LossCase("categorical_crossentropy", "string", act="softmax",
               where="layer", rank3=True),
      LossCase("sparse_categorical_crossentropy", "string", act="softmax",
               rank3=True),
      LossCase("binary_crossentropy", "object", act="sigmoid", rank3=True),
  ]
  return cases


LOSS_CASES = _loss_cases()


def _loss_model(case, classes):
  inputs = keras.Input((LT, LF) if case.rank3 else (LF,))
  if case.where == "fused":
    out = keras.layers.Dense(classes, activation=case.act, name="out")(inputs)
  else:
    out = keras.layers.Dense(classes, name="out")(inputs)
    out = keras.layers.Activation(case.act, name="act")(out)
  return keras.Model(inputs, out)


def _loss_data(case, classes, r):
  lead = (LN, LT) if case.rank3 else (LN,)
  x = r.randn(*(lead + (LF,)))
  if case.kind == "sparse_categorical_crossentropy":
    y = r.randint(0, classes, size=lead).astype(np.int32)
  elif case.kind == "categorical_crossentropy":
    y = np.eye(classes)[r.randint(0, classes, size=lead)]
  elif case.kind == "binary_crossentropy":
    y = r.uniform(size=lead + (classes,))  # soft targets
  else:
    y = r.randn(*(lead + (classes,)))
  return x, y


def _curvatures(model, loss, x, y):
  """({average_over_outputs: coeff * GGN of the registered loss}, tape
  Hessian of N * Keras loss w.r.t. the logits, the logits, report), as
  numpy, in one trace."""
  keras_utils.watch(model)
  x = tf.constant(x)
  y = tf.constant(y)
  out = {}

  def registered_ggn(average):
    lc, report = keras_utils.register_model(model, loss,
                                            average_over_outputs=average)
    out["report"] = report
    registered = lc.losses_with_coeffs()
    assert len(registered) == 1, registered
    loss_fn, coeff = registered[0]
    z = loss_fn.inputs[0]
    size = z.shape.num_elements()
    ggn = []
    for i in range(size):
      basis = tf.reshape(tf.one_hot(i, size, dtype=z.dtype), z.shape)
      ggn.append(tf.reshape(coeff * loss_fn.multiply_ggn(basis), [-1]))
    # mse / binary register a [N, size] reshape of the tensor on the path.
    on_path = z.op.inputs[0] if z.op.type == "Reshape" else z
    return tf.stack(ggn, axis=1), on_path

  @tf.function
  def curvatures():
    pred = model(x, training=True)
    value = model.compute_loss(x=x, y=y, y_pred=pred)
    ggn = {}
    for average in (False, True):
      ggn[average], on_path = registered_ggn(average)
    size = on_path.shape.num_elements()
    hess = []
    grad = tf.gradients(LN * value, on_path)[0]
    assert grad is not None, (
        "the registered logits %s are not what the Keras loss is computed "
        "from" % on_path.name)
    grad = tf.reshape(grad, [-1])
    for i in range(size):
      hess.append(tf.reshape(tf.gradients(grad[i], on_path)[0], [-1]))
    return ggn, tf.stack(hess), on_path

  ggn, hess, logits = curvatures()
  return ({k: v.numpy() for k, v in ggn.items()}, hess.numpy(),
          logits.numpy(), out["report"])


def _outputs_averaged(case, classes):
  """k: the outputs per example Keras averages the loss over (by hand):
  every entry of an mse / binary output, every position of a categorical
  one."""
  positions = LT if case.rank3 else 1
  if case.kind in ("mse", "binary_crossentropy"):
    return positions * classes
  return positions


@pytest.mark.parametrize("case", LOSS_CASES, ids=[c.name for c in LOSS_CASES])
def test_registered_loss_curvature_is_keras_hessian(case):
  classes = 2 if case.kind == "binary_crossentropy" else 3
  r = _rng(LOSS_CASES.index(case))
  model = _loss_model(case, classes)
  x, y = _loss_data(case, classes, r)
  loss = case.loss()
  model.compile(optimizer="sgd", loss=loss)
  with warnings.catch_warnings():
    # Keras warns about from_logits=True on a softmax output (on purpose).
    warnings.simplefilter("ignore")
    ggn, hess, logits, report = _curvatures(model, loss, x, y)
  # The registered logits are the Dense layer's x @ W + b.
  w, b = [v.numpy() for v in model.get_layer("out").trainable_weights]
  np.testing.assert_allclose(logits, x @ w + b, rtol=1e-12, atol=1e-12)
  size = logits.size
  assert ggn[True].shape == ggn[False].shape == hess.shape == (size, size)
  # Block diagonal over examples: nothing couples two examples.
  per = size // LN
  for n in range(LN):
    for m in range(LN):
      if n != m:
        assert not hess[n * per:(n + 1) * per, m * per:(m + 1) * per].any()
  scale = np.abs(hess).max()
  assert scale > 1e-3
  k = _outputs_averaged(case, classes)
  # The recipe's coefficient: the Keras loss per example.
  err = np.abs(ggn[True] - hess).max() / scale
  assert err < LOSS_REL, (case.name, err)
  # kfac 0.2.x's: the loss summed over the k outputs of an example.
  err = np.abs(ggn[False] - k * hess).max() / (k * scale)
  assert err < LOSS_REL, (case.name, k, err)
  behind = case.act is not None and case.kind != "mse"
  assert ("logits found behind" in report) == behind, report


# =========================================================== conv NCHW
def test_conv2d_channels_first_cannot_run_on_cpu_but_registers_as_nchw():
  """TensorFlow's CPU Conv2D kernel supports NHWC only, so a channels_first
  Keras Conv2D cannot run here (no numbers to compare; the NCHW block
  itself is checked against NHWC in conv_blocks_test). What can be checked
  on CPU: the traced registration is the NCHW convolution the layer is."""
  x = _rng(2).randn(N, 2, 5, 5)
  inputs = keras.Input((2, 5, 5))
  h = keras.layers.Conv2D(3, 3, strides=2, padding="same", activation="relu",
                          data_format="channels_first", name="conv")(inputs)
  model = keras.Model(inputs,
                      keras.layers.Dense(3, name="head")(
                          keras.layers.Flatten()(h)))
  with pytest.raises(tf.errors.UnimplementedError,
                     match="only supports the NHWC tensor format on the CPU"):
    model(x)

  keras_utils.watch(model)
  conv = model.get_layer("conv")
  params = tuple(keras_flavor.unwrap_variable(v)
                 for v in conv.trainable_weights)
  found = {}

  @tf.function(autograph=False)
  def trace(x):
    model(x, training=True)
    lc, report = keras_utils.register_model(
        model, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    found["report"] = report
    (call,) = keras_utils.watch(model).calls(conv)
    # The same params registered again (a tower) must carry the same
    # convolution: the collection raises on any other spec.
    block = lc.register_conv2d(params, [1, 1, 2, 2], "SAME", call.inputs,
                               call.preactivations, data_format="NCHW",
                               reuse=True)
    found["towers"] = block.num_registered_towers
    # ... and the checks bite: the inputs are NCHW; padding two rows and
    # columns before (not one on each side) gives the same output shape but
    # another convolution.
    with pytest.raises(ValueError, match="expects 2 input channels"):
      lc.register_conv2d(params, [1, 2, 2, 1], "SAME", call.inputs,
                         call.preactivations, data_format="NHWC", reuse=True)
    with pytest.raises(ValueError, match="is now reused with"):
      lc.register_conv2d(params, [1, 1, 2, 2],
                         [[0, 0], [0, 0], [2, 0], [2, 0]], call.inputs,
                         call.preactivations, data_format="NCHW", reuse=True)
    return call.inputs

  trace.get_concrete_function(tf.TensorSpec([None, 2, 5, 5], tf.float64))
  assert _report_blocks(found["report"])["conv"] == "ConvKFCBasicFB"
  assert found["towers"] == 2


def test_conv2d_transpose_channels_first_registers_as_nchw():
  """Keras 3's CPU kernel is NHWC only (tf_keras transposes around it), so
  what is checked in both flavours is the traced registration: the NCHW
  transposed convolution block, on the NCHW inputs and pre-activations
  (the NHWC reading of the same tensors is an error naming the kernel)."""
  inputs = keras.Input((2, 3, 3))
  h = keras.layers.Conv2DTranspose(
      3, 2, strides=2, activation="relu", data_format="channels_first",
      name="deconv")(inputs)
  model = keras.Model(inputs, keras.layers.Dense(3, name="head")(
      keras.layers.Flatten()(h)))
  keras_utils.watch(model)
  deconv = model.get_layer("deconv")
  params = tuple(keras_flavor.unwrap_variable(v)
                 for v in deconv.trainable_weights)
  found = {}

  @tf.function(autograph=False)
  def trace(x):
    model(x, training=True)
    lc, found["report"] = keras_utils.register_model(
        model, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    (call,) = keras_utils.watch(model).calls(deconv)
    found["pre"] = call.preactivations.shape.as_list()
    block = lc.register_conv2d_transpose(
        params, call.inputs, call.preactivations, 2, "VALID",
        data_format="NCHW", reuse=True)
    found["towers"] = block.num_registered_towers
    with pytest.raises(ValueError, match="deconv.*needs inputs with 2 "
                       "channels"):
      lc.register_conv2d_transpose(params, call.inputs, call.preactivations,
                                   2, "VALID", reuse=True)
    return x

  trace.get_concrete_function(tf.TensorSpec([None, 2, 3, 3], tf.float64))
  assert (_report_blocks(found["report"])["deconv"] ==
          "ConvTransposeKFCBasicBiasFB"), found["report"]
  assert found["pre"] == [None, 3, 6, 6] and found["towers"] == 2


# =========================================================== errors
def _dense_model(classes=3, act=None, name="dense"):
  inputs = keras.Input((2,))
  return keras.Model(inputs, keras.layers.Dense(classes, activation=act,
                                                name=name)(inputs))


def _trace_registration(model, loss, x=None, signature=None, **kwargs):
  """Traces model(x) + get_layer_collection (no execution); returns the
  report."""
  keras_utils.watch(model)
  found = {}

  @tf.function(autograph=False)  # errors keep their type
  def trace(x):
    model(x, training=True)
    found["report"] = keras_utils.register_model(model, loss,
                                                       **kwargs)[1]
    return x

  if signature is None:
    signature = tf.TensorSpec([None, 2], tf.float64)
  trace.get_concrete_function(signature)
  return found["report"]


@pytest.mark.parametrize("loss,match", [
    ("huber", r"cannot register the loss 'huber'.*supported losses are"),
    (lambda: keras.losses.Huber(), r"cannot register the loss 'Huber'"),
    (lambda: keras.losses.MeanSquaredError(reduction="sum"),
     r"reduction='sum'.*batch mean"),
    (lambda: keras.losses.MeanSquaredError(reduction="none"),
     r"reduction='none'.*batch mean"),
    (lambda: keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=0), r"ignore_class"),
    ("categorical_crossentropy",
     r"from_logits=False takes the model output .* as probabilities, but "
     r"it comes from a (BiasAdd|AddV2|Add|Identity) op and can take values "
     r"in \[-inf, inf\], outside \[0, 1\].*end the model with a softmax"),
    (lambda: keras.losses.BinaryCrossentropy(),
     r"can take values in \[-inf, inf\], outside \[0, 1\].*"
     r"from_logits=True.*sigmoid activation"),
])
def test_unsupported_losses_raise_clear_errors(loss, match):
  if callable(loss):
    loss = loss()
  with pytest.raises(layer_registration.RegistrationError, match=match):
    _trace_registration(_dense_model(), loss)


@pytest.mark.parametrize("act,loss,bounds", [
    ("relu", "categorical_crossentropy", r"\[0, inf\]"),
    ("tanh", "binary_crossentropy", r"\[-1, 1\]"),
])
def test_outputs_that_can_leave_the_unit_interval_are_not_probabilities(
    act, loss, bounds):
  with pytest.raises(layer_registration.RegistrationError,
                     match=r"comes from a \w+ op and can take values in %s, "
                     r"outside \[0, 1\]" % bounds):
    _trace_registration(_dense_model(act=act), loss)


def test_dynamic_non_batch_output_shape_raises():
  inputs = keras.Input((None, 2))
  model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
  signature = tf.TensorSpec([None, None, 2], tf.float64)
  for loss, what in (("mse", "the prediction"),
                     ("binary_crossentropy", "the logits"),
                     (keras.losses.CategoricalCrossentropy(from_logits=True),
                      "the logits")):
    if loss == "binary_crossentropy":
      loss = keras.losses.BinaryCrossentropy(from_logits=True)
    with pytest.raises(layer_registration.RegistrationError,
                       match=r"non-batch shape of %s to be static, got "
                       r"\(None," % what):
      _trace_registration(model, loss, signature=signature)


def test_fisher_approx_errors():
  model = _dense_model(name="dense")
  loss = keras.losses.MeanSquaredError()
  # A name key naming no layer, when the optimizer is created.
  with pytest.raises(layer_registration.RegistrationError,
                     match=r"fisher_approx key 'nope' matches no layer of "
                     r"model .*\(layers: (.*, )?dense(, .*)?\)"):
    kfac.keras.optimizers.Kfac(learning_rate=LR, damping=DAMPING,
                               model=model, loss=loss,
                               fisher_approx={"nope": "diagonal"})
  # Class keys need not match a layer (kfac 0.2.x): they are unused.
  for key in (keras.layers.Conv2D, "__class__:Conv2D", "kfac_class_Conv2D"):
    kfac.keras.optimizers.Kfac(learning_rate=LR, damping=DAMPING,
                               model=model, loss=loss,
                               fisher_approx={key: "diagonal"})
    report = _trace_registration(model, loss,
                                 fisher_approx={key: "kron_reduce"})
    assert _report_blocks(report) == {"dense": "FullyConnectedKFACBasicFB"}, (
        report)
  with pytest.raises(layer_registration.RegistrationError,
                     match=r"keys must be layer names or layer classes"):
    _trace_registration(model, loss, fisher_approx={3: "diagonal"})
  # Approximations that are not strings (None is the layer's default, as
  # in kfac 0.2.x).
  for value in (3, ["kron"]):
    with pytest.raises(layer_registration.RegistrationError,
                       match=r"fisher_approx\['dense'\] must be an "
                       r"approximation name \(a string\)"):
      _trace_registration(model, loss, fisher_approx={"dense": value})
  # An approximation the layer's registration does not know: the
  # LayerCollection's error names it and the layer's variable.
  with pytest.raises(ValueError, match=r"Unknown approximation 'bogus' for "
                     r"fully connected layer \(.*dense/kernel"):
    _trace_registration(model, loss, fisher_approx={"dense": "bogus"})
  conv_in = keras.Input((3, 3, 1))
  conv_model = keras.Model(conv_in, keras.layers.Flatten()(
      keras.layers.Conv2D(1, 2, name="conv")(conv_in)))
  with pytest.raises(ValueError, match=r"Unknown approximation 'kron_indep' "
                     r"for conv2d layer \(.*conv/kernel"):
    _trace_registration(conv_model, loss,
                        signature=tf.TensorSpec([None, 3, 3, 1], tf.float64),
                        fisher_approx={keras.layers.Conv2D: "kron_indep"})


def test_fisher_approx_on_a_fallback_layer_and_generic_full():
  """A generic layer takes the generic approximations; a layer that falls
  back ignores a specific approximation (and says so in the report)."""
  inputs = keras.Input((4, 1))
  h = keras.layers.SeparableConv1D(1, 2, name="sep1d")(inputs)
  model = keras.Model(inputs, keras.layers.Flatten()(h))
  signature = tf.TensorSpec([None, 4, 1], tf.float64)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    report = _trace_registration(model, "mse", signature=signature,
                                 fisher_approx={"sep1d": "full"})
  assert _report_blocks(report) == {"sep1d": "NaiveFullFB"}, report
  assert "fallback: " in _report_line(report, "sep1d")
  messages = [str(w.message) for w in caught]
  assert any("generic 'full'" in m and "sep1d" in m for m in messages), (
      messages)


def test_grouped_and_separable_out_of_reach_fall_back_naming_the_layer():
  """A grouped Conv2D asked for an approximation its block lacks, and a
  SeparableConv1D (no block), get the generic diagonal with a warning
  naming the layer and the reason; registration_options on a grouped
  convolution is an error naming it."""
  inputs = keras.Input((4, 4, 4))
  h = keras.layers.Conv2D(4, 2, groups=2, name="gconv")(inputs)
  h = keras.layers.Reshape((9, 4))(h)
  h = keras.layers.SeparableConv1D(2, 2, name="sep1d")(h)
  model = keras.Model(inputs, keras.layers.Flatten()(h))
  signature = tf.TensorSpec([None, 4, 4, 4], tf.float64)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    report = _trace_registration(model, "mse", signature=signature,
                                 fisher_approx={"gconv": "kron_reduce"})
  assert _report_blocks(report) == {"gconv": "NaiveDiagonalFB",
                                    "sep1d": "NaiveDiagonalFB"}, report
  messages = [str(w.message) for w in caught
              if str(w.message).startswith("kfac: layer")]
  assert len(messages) == 2, messages
  assert any("'gconv'" in m and "no 'kron_reduce' approximation" in m
             for m in messages), messages
  assert any("'sep1d'" in m and "only SeparableConv2D" in m
             for m in messages), messages
  with pytest.raises(layer_registration.RegistrationError,
                     match="gconv.*only Conv1D/2D/3D"):
    _trace_registration(model, "mse", signature=signature,
                        registration_options={"gconv": {
                            "sub_sample_inputs": 2}})


def test_conv_transpose_out_of_reach_falls_back_naming_the_layer():
  """A Conv2DTranspose asked for an approximation its block lacks gets the
  generic diagonal with a warning naming the layer and the reason (the
  same layer without it gets its block and no warning); registration_options
  on it are an error naming it."""
  inputs = keras.Input((3, 3, 2))
  h = keras.layers.Conv2DTranspose(2, 2, strides=2, name="deconv")(inputs)
  model = keras.Model(inputs, keras.layers.Flatten()(h))
  signature = tf.TensorSpec([None, 3, 3, 2], tf.float64)
  for approx, block, warned in ((None, "ConvTransposeKFCBasicBiasFB", 0),
                                ("kron_reduce", "NaiveDiagonalFB", 1)):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      report = _trace_registration(model, "mse", signature=signature,
                                   fisher_approx={"deconv": approx})
    assert _report_blocks(report) == {"deconv": block}, report
    messages = [str(w.message) for w in caught
                if str(w.message).startswith("kfac: layer")]
    assert len(messages) == warned, messages
  assert ("'deconv'" in messages[0] and "Conv2DTranspose" in messages[0] and
          "no 'kron_reduce' approximation (only 'kron', 'diagonal' and "
          "'ekfac')" in messages[0]), (
              messages)
  with pytest.raises(layer_registration.RegistrationError,
                     match="deconv.*only Conv1D/2D/3D"):
    _trace_registration(model, "mse", signature=signature,
                        registration_options={"deconv": {
                            "sub_sample_inputs": 2}})


def test_report_names_each_parameter_of_layers_in_a_subclassed_model():
  """The parameter column shows each variable's own path: the tf.Variables
  behind Keras 3 variables of layers nested in a subclassed model are all
  named after the outer model ("subclassed/kernel:0")."""

  class Outer(keras.Model):

    def __init__(self):
      super().__init__(name="subclassed")
      self.first = keras.layers.Dense(3, name="inner_a")
      self.second = keras.layers.Dense(2, name="inner_b")
      self.extra = self.add_weight(shape=(2,), name="extra")

    def call(self, x):
      return self.second(self.first(x)) + self.extra

  model = Outer()
  model(np.zeros((1, 2)))
  planned = kfac.keras.optimizers.Kfac(
      learning_rate=LR, damping=DAMPING, model=model,
      loss="mse").registration_report
  traced = _trace_registration(model, "mse")
  for report in (planned, traced):
    for name in ("inner_a", "inner_b"):
      params = _report_line(report, name).split()[5:7]
      assert [re.sub(r":0,?$", "", p.rstrip(",")).split("/")[-2:]
              for p in params] == [[name, "kernel"], [name, "bias"]], report
  # The model's own weight (an orphan, generic) by its own name too.
  # (Keras 3: its path "subclassed/extra"; tf_keras: "extra:0".)
  assert re.match(r"(subclassed/)?extra(:0)?$",
                  _report_line(traced, "subclassed").split()[5]), traced
