"""kfac 0.2.x's kfac.keras.utils contract.

TF1 graph (a tf_keras model built inside tf.compat.v1.Graph, as with v2
behaviour disabled): get_layer_collection(model, loss) needs no trace; it
registers the layers from their graph nodes: the blocks get the nodes'
input tensors and the pre-activations behind fused activations, the loss
the logits behind the softmax, BatchNormalization its normalised inputs
(checked against numpy in both learning phases); a K-FAC step on that
collection equals the step on a hand-made registration; list / dict /
class-key fisher_approx, loss lists / dicts / loss_weights and their
errors (class keys that match no layer are unused, as in 0.2.x); nested
models and a model called twice; register_layer; register_loss in 0.2.x's
forms (lc, layer, loss) with loss= / layer= keywords and coeff / seed /
reuse, and ours (lc, loss, prediction), and its errors; the loss
coefficient is 0.2.x's (the loss weight; a K-FAC step equals a hand
registration with coeff 1 for a 2-output mse); get_loss_fn against the
compiled loss.

TF2: Keras 3 (and eagerly built tf_keras) outside a trace raise an error
naming the traced usage; inside a tf.function get_layer_collection returns
the LayerCollection and register_model (collection, report); get_loss_fn
eagerly against the compiled loss. serialize_loss / serialize_fisher_approx
/ get_parent.
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.keras import utils
from kfac.python.ops import fisher_blocks
from kfac.python.ops import losses as loss_functions
from kfac.python.ops.optimizers import kfac_optimizer

# keras and tf_keras are required (make venv installs tf_keras): missing,
# collection fails.
import keras  # pylint: disable=g-import-not-at-top,g-bad-import-order
import tf_keras  # pylint: disable=g-import-not-at-top,g-bad-import-order
import tf_keras.src.backend  # pylint: disable=g-import-not-at-top,g-bad-import-order  (get_session)

L = tf_keras.layers
RNG = np.random.RandomState(0)


def _cnn(**bn):
  return tf_keras.Sequential([
      L.Conv2D(3, 3, activation="relu", input_shape=(6, 6, 2), name="conv"),
      L.BatchNormalization(name="bn", **bn),
      L.Flatten(),
      L.Dense(4, activation="tanh", name="d1"),
      L.Dense(3, activation="softmax", name="d2"),
  ])


def _two_outputs():
  inp = L.Input(shape=(5,))
  h = L.Dense(4, activation="relu", name="h")(inp)
  out1 = L.Dense(1, activation="sigmoid", name="out1")(h)
  out2 = L.Dense(3, name="out2")(h)
  return tf_keras.Model(inputs=inp, outputs=[out1, out2])


# -- TF1 graph: registration from the layers' graph nodes ---------------------


def test_graph_registration_uses_the_layers_tensors():
  with tf.Graph().as_default():
    model = _cnn()
    lc = utils.get_layer_collection(model, "categorical_crossentropy",
                                    seed=7)
    assert isinstance(lc, kfac.LayerCollection)
    conv, bn, _, d1, d2 = model.layers
    conv_block = lc.fisher_blocks[conv.trainable_weights]
    assert isinstance(conv_block, fisher_blocks.ConvKFCBasicFB)
    assert conv_block._inputs[0] is conv.input
    # The pre-activations: the input of the Relu op.
    assert conv.output.op.type == "Relu"
    assert conv_block._outputs[0] is conv.output.op.inputs[0]
    assert lc.fisher_blocks[d1.weights]._outputs[0] is d1.output.op.inputs[0]
    assert isinstance(lc.fisher_blocks[bn.trainable_weights],
                      fisher_blocks.ScaleAndShiftFullFB)
    (loss,) = lc.losses
    assert isinstance(loss, loss_functions.CategoricalLogitsNegativeLogProbLoss)
    assert loss.params is utils.get_parent(d2.output)
    assert loss._default_seed == 7
    assert lc.loss_names == ["sparse_softmax_cross_entropy_loss"]
    assert lc.loss_coeffs[loss] == 1.0
    assert lc.loss_colocation_ops[loss] is loss.params
    assert set(v.ref() for v in lc.registered_variables) == set(
        v.ref() for v in model.trainable_weights)


@pytest.mark.parametrize("phase", [1, 0])
def test_graph_batch_norm_inputs_are_the_normalised_inputs(phase):
  with tf.Graph().as_default():
    model = tf_keras.Sequential([
        L.Dense(4, input_shape=(3,), name="d"),
        L.BatchNormalization(name="bn", momentum=0.5)])
    bn = model.layers[1]
    lc = utils.get_layer_collection(model, "mse")
    block = lc.fisher_blocks[bn.trainable_weights]
    sess = tf_keras.src.backend.get_session()
    sess.run(tf.compat.v1.global_variables_initializer())
    sess.run([bn.gamma.assign([2.0, 0.5, 1.5, 3.0]),
              bn.beta.assign([0.1, -0.2, 0.3, 0.0]),
              bn.moving_mean.assign([0.2, 0.1, -0.3, 0.4]),
              bn.moving_variance.assign([1.5, 0.7, 2.0, 0.9])])
    x = RNG.rand(8, 3).astype(np.float32)
    feed = {model.input: x, tf_keras.backend.learning_phase(): phase}
    h, got = sess.run([bn.input, block._inputs[0]], feed)
    if phase:
      mean, var = h.mean(0), h.var(0)
    else:
      mean, var = sess.run([bn.moving_mean, bn.moving_variance])
    np.testing.assert_allclose(got, (h - mean) / np.sqrt(var + bn.epsilon),
                               rtol=1e-4, atol=1e-4)


def test_graph_kfac_step_equals_hand_registration():
  with tf.Graph().as_default():
    tf.compat.v1.set_random_seed(0)
    x = tf.constant(RNG.rand(16, 3).astype(np.float32))
    y = tf.constant(RNG.rand(16, 2).astype(np.float32))
    inp = L.Input(tensor=x)
    d1, d2 = L.Dense(4, activation="tanh", name="d1"), L.Dense(2, name="d2")
    out = d2(d1(inp))
    model = tf_keras.Model(inp, out)
    loss = tf.reduce_mean(tf.square(out - y))
    by_utils = utils.get_layer_collection(model, "mse")
    by_hand = kfac.LayerCollection()
    d1_node, d2_node = d1.inbound_nodes[-1], d2.inbound_nodes[-1]
    by_hand.register_fully_connected(tuple(d1.weights), inp,
                                     d1_node.output_tensors.op.inputs[0])
    by_hand.register_fully_connected(tuple(d2.weights),
                                     d2_node.input_tensors, out)
    # kfac 0.2.x's coefficient: the loss weight, 1 (not 1/2 for the mean
    # Keras takes over the 2 outputs).
    by_hand.register_squared_error_loss(out, coeff=1.0)
    train_ops = []
    for lc in (by_utils, by_hand):
      opt = kfac_optimizer.PeriodicInvCovUpdateKfacOpt(
          learning_rate=0.1, damping=0.01, layer_collection=lc,
          estimation_mode="exact", invert_every=1, cov_update_every=1,
          momentum=0.0)
      train_ops.append(opt.minimize(loss, var_list=model.trainable_weights))
    sess = tf_keras.src.backend.get_session()
    sess.run(tf.compat.v1.global_variables_initializer())
    start = sess.run(model.trainable_weights)
    results = []
    for train in train_ops:
      for var, value in zip(model.trainable_weights, start):
        var.load(value, sess)
      sess.run(train)
      results.append(sess.run(model.trainable_weights))
    for a, b in zip(*results):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert not all(np.allclose(a, s) for a, s in zip(results[0], start))


@pytest.mark.parametrize("fisher_approx", [
    # A list covers the layers with trainable weights, in order.
    ["diagonal", "kron_out_diag", "kron_both_diag"],
    {"conv": "diagonal", "d1": "kron_out_diag", "d2": "kron_both_diag"},
    {L.Conv2D: "diagonal", L.Dense: "kron_both_diag", "d1": "kron_out_diag"},
    {"kfac_class_Conv2D": "diagonal", "kfac_class_Dense": "kron_both_diag",
     "d1": "kron_out_diag"},
    # Class keys that match no layer are unused (kfac 0.2.x).
    {L.Conv2D: "diagonal", L.Dense: "kron_both_diag", "d1": "kron_out_diag",
     L.Conv1D: "kron", "kfac_class_Embedding": "kron"},
])
def test_graph_fisher_approx_forms(fisher_approx):
  with tf.Graph().as_default():
    model = tf_keras.Sequential([
        L.Conv2D(3, 3, input_shape=(6, 6, 2), name="conv"),
        L.Flatten(), L.Dense(4, trainable=False),
        L.Dense(4, activation="relu", name="d1"), L.Dense(3, name="d2")])
    lc = utils.get_layer_collection(
        model, keras.losses.MeanSquaredError(), fisher_approx=fisher_approx)
    conv, _, _, d1, d2 = model.layers
    assert isinstance(lc.fisher_blocks[conv.weights],
                      fisher_blocks.ConvDiagonalFB)
    assert lc.fisher_blocks[d1.weights]._diagonal_approx_for_output
    assert not lc.fisher_blocks[d1.weights]._diagonal_approx_for_input
    assert lc.fisher_blocks[d2.weights]._diagonal_approx_for_input
    assert lc.fisher_blocks[d2.weights]._diagonal_approx_for_output


@pytest.mark.parametrize("kwargs, message", [
    (dict(fisher_approx=[]), r"Number of fisher_approx and layers"),
    (dict(fisher_approx=["kron"] * 4), r"Number of fisher_approx and layers"),
    (dict(fisher_approx={"nope": "kron"}), r"fisher_approx.*nope"),
    (dict(fisher_approx="kron"), r"fisher_approx must be a list or dict"),
    (dict(loss=["mse"]), r"Number of loss dict items"),
    (dict(loss={"out1": "mse"}), r"loss dict keys don't match"),
    (dict(loss="mse"), r"More output layers than losses"),
    (dict(loss=["mse", "mse"], loss_weights=[0.1]),
     r"Number of loss_weights and layers"),
    (dict(loss=["mse", "mse"], loss_weights={"x": 1.0}),
     r"loss_weights without a matching layer"),
    (dict(loss=["mse", "mse"], loss_weights={0.1, 0.2}),
     r"loss_weights must be a list or dict"),
    (dict(loss=["mse", "msle"]), r"Unsupported loss function: .*'msle'"),
])
def test_graph_argument_errors(kwargs, message):
  with tf.Graph().as_default():
    model = _two_outputs()
    with pytest.raises(ValueError, match=message):
      utils.get_layer_collection(model, **kwargs)


@pytest.mark.parametrize("loss, weights", [
    (["binary_crossentropy",
      tf_keras.losses.CategoricalCrossentropy(from_logits=True)], [0.1, 0.9]),
    ({"out1": "binary_crossentropy",
      "out2": tf_keras.losses.CategoricalCrossentropy(from_logits=True)},
     {"out2": 0.9}),
])
def test_graph_multiple_losses(loss, weights):
  with tf.Graph().as_default():
    model = _two_outputs()
    lc = utils.get_layer_collection(model, loss, loss_weights=weights)
    l1 = lc._loss_dict["sigmoid_cross_entropy_loss"][0]
    l2 = lc._loss_dict["sparse_softmax_cross_entropy_loss"][0]
    assert isinstance(l1, loss_functions.MultiBernoulliNegativeLogProbLoss)
    assert l1.params is model.outputs[0].op.inputs[0]  # behind the sigmoid
    assert l2.params is model.outputs[1]
    assert lc.loss_coeffs[l1] == (0.1 if isinstance(weights, list) else 1.0)
    assert lc.loss_coeffs[l2] == 0.9
    assert lc.loss_colocation_ops[l2] is model.outputs[1]


def test_graph_nested_models_and_latest_call():
  with tf.Graph().as_default():
    inner = tf_keras.Sequential([L.Dense(3, input_shape=(2,), name="a"),
                                 L.Dense(2, activation="relu", name="b")])
    inp = L.Input(shape=(2,))
    out = L.Dense(1, name="c")(inner(inp))
    model = tf_keras.Model(inp, out)
    lc = utils.get_layer_collection(
        model, "mse", fisher_approx=["kron_in_diag", "kron_out_diag", None])
    a, b = inner.layers
    assert lc.fisher_blocks[a.weights]._diagonal_approx_for_input
    assert lc.fisher_blocks[b.weights]._diagonal_approx_for_output
    # The nested call's tensors (the latest node), not the inner model's own.
    assert lc.fisher_blocks[a.weights]._inputs[0] is inp
    # A model called twice (on Keras inputs) registers its latest call.
    second = L.Input(tensor=tf.constant(RNG.rand(4, 2).astype(np.float32)))
    model(second)
    lc = utils.get_layer_collection(model, "mse")
    assert lc.fisher_blocks[a.weights]._inputs[0] is second
    # Nested models with several outputs cannot stand for one output.
    two = tf_keras.Model(inp, [out, out * 2.0])
    i2 = L.Input(shape=(2,))
    outer = tf_keras.Model(i2, two(i2))
    with pytest.raises(ValueError, match="Nested models with multiple"):
      utils.get_layer_collection(outer, loss=["mse", "mse"])


def test_graph_register_layer_and_register_loss_of_a_layer():
  with tf.Graph().as_default():
    model = _cnn()
    lc = kfac.LayerCollection()
    for layer in model.layers:
      utils.register_layer(lc, layer, fisher_approx="diagonal"
                           if layer.name == "d1" else None)
    utils.register_loss(lc, model.layers[-1], "categorical_crossentropy",
                        coeff=0.5)
    assert isinstance(lc.fisher_blocks[model.layers[3].weights],
                      fisher_blocks.FullyConnectedDiagonalFB)
    (loss,) = lc.losses
    assert loss.params is model.layers[-1].output.op.inputs[0]
    assert lc.loss_coeffs[loss] == 0.5
    assert len(lc.get_blocks()) == 4


@pytest.mark.parametrize("call", [
    # kfac 0.2.x's signature register_loss(layer_collection, layer, loss,
    # **kwargs), in each of its forms (get_layer_collection of 0.2.x used
    # the last one).
    lambda lc, layer, out: utils.register_loss(
        lc, layer, "mse", coeff=0.5, seed=3),
    lambda lc, layer, out: utils.register_loss(
        lc, layer, loss="mse", coeff=0.5, seed=3),
    lambda lc, layer, out: utils.register_loss(
        lc, layer=layer, loss="mse", coeff=0.5, seed=3),
    lambda lc, layer, out: utils.register_loss(
        layer_collection=lc, layer=layer, loss="mse", coeff=0.5, seed=3),
    # Ours: a loss applied to a tensor.
    lambda lc, layer, out: utils.register_loss(lc, "mse", out, coeff=0.5,
                                               seed=3),
    lambda lc, layer, out: utils.register_loss(
        lc, loss="mse", prediction=out, coeff=0.5, seed=3),
    lambda lc, layer, out: utils.register_loss(
        lc, "mse", prediction=out, coeff=0.5, seed=3),
])
def test_graph_register_loss_forms(call):
  with tf.Graph().as_default():
    model = _cnn()
    layer = model.layers[-1]
    lc = kfac.LayerCollection()
    call(lc, layer, layer.output)
    (loss,) = lc.losses
    assert isinstance(loss, loss_functions.NormalMeanNegativeLogProbLoss)
    assert loss.params is layer.output  # mse: the output itself
    assert lc.loss_coeffs[loss] == 0.5
    assert loss._default_seed == 3


def test_graph_register_loss_reuse_and_errors():
  with tf.Graph().as_default():
    model = _cnn()
    layer = model.layers[-1]
    lc = kfac.LayerCollection()
    utils.register_loss(lc, layer, "categorical_crossentropy", name="ce")
    # kfac 0.2.x forwarded **kwargs to the registration: reuse adds a tower.
    utils.register_loss(lc, layer, "categorical_crossentropy", name="ce",
                        reuse=True)
    assert len(lc._loss_dict["ce"]) == 2
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) "
                       r"bogus"):
      utils.register_loss(lc, layer, "mse", bogus=1)
    with pytest.raises(TypeError, match="needs the loss"):
      utils.register_loss(lc, layer)
    with pytest.raises(TypeError, match="prediction is missing"):
      utils.register_loss(lc, loss="mse")
    with pytest.raises(TypeError, match="either a layer .* or prediction="):
      utils.register_loss(lc, layer, "mse", prediction=layer.output)
    with pytest.raises(TypeError, match="prediction given twice"):
      utils.register_loss(lc, "mse", layer.output, prediction=layer.output)


def test_graph_get_loss_fn_equals_compiled_loss():
  with tf.Graph().as_default():
    model = _two_outputs()
    model.layers[1].kernel_regularizer = None
    losses = ["binary_crossentropy",
              tf_keras.losses.CategoricalCrossentropy(from_logits=True)]
    model.compile("sgd", losses, loss_weights=[0.3, 0.7])
    loss_fn = utils.get_loss_fn(model, losses, loss_weights={"out1": 0.3,
                                                             "out2": 0.7})
    x = RNG.rand(6, 5).astype(np.float32)
    y1 = RNG.randint(0, 2, (6, 1)).astype(np.float32)
    y2 = np.eye(3, dtype=np.float32)[RNG.randint(0, 3, 6)]
    total = loss_fn((tf.constant(x), [tf.constant(y1), tf.constant(y2)]))
    sess = tf_keras.src.backend.get_session()
    expected = model.test_on_batch(x, [y1, y2])[0]
    np.testing.assert_allclose(sess.run(total), expected, rtol=1e-5)


# -- TF2 ----------------------------------------------------------------------


def test_eager_outside_a_trace_names_the_traced_usage():
  k3 = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  legacy = tf_keras.Sequential([L.Dense(2, input_shape=(3,))])
  for model in (k3, legacy):
    with pytest.raises(RuntimeError, match=r"kfac.keras.utils.watch\(model\)"
                       r".*inside the tf.function"):
      utils.get_layer_collection(model, "mse")
    with pytest.raises(RuntimeError, match=r"symbolic Keras tensors"):
      utils.register_layer(kfac.LayerCollection(), model.layers[0])


def test_keras3_in_a_trace_returns_the_collection():
  model = keras.Sequential([keras.Input((3,)),
                            keras.layers.Dense(4, activation="relu"),
                            keras.layers.Dense(2, activation="softmax")])
  utils.watch(model)
  found = {}

  @tf.function(autograph=False)
  def trace(x):
    model(x, training=True)
    found["lc"] = utils.get_layer_collection(
        model, "categorical_crossentropy", fisher_approx=["diagonal", None])
    found["both"] = utils.register_model(model, "categorical_crossentropy")
    return x

  trace.get_concrete_function(tf.TensorSpec([None, 3], tf.float32))
  lc = found["lc"]
  assert isinstance(lc, kfac.LayerCollection)
  dense = model.layers[0]
  assert isinstance(lc.fisher_blocks[(dense.kernel.value, dense.bias.value)],
                    fisher_blocks.FullyConnectedDiagonalFB)
  lc2, report = found["both"]
  assert isinstance(lc2, kfac.LayerCollection) and "Dense" in report


def test_eager_get_loss_fn_equals_compiled_loss():
  model = keras.Sequential([
      keras.Input((3,)),
      keras.layers.Dense(4, activation="relu", kernel_regularizer="l2"),
      keras.layers.Dense(2)])
  loss = keras.losses.MeanSquaredError()
  model.compile("sgd", loss)
  x = RNG.rand(5, 3).astype(np.float32)
  y = RNG.rand(5, 2).astype(np.float32)
  loss_fn = utils.get_loss_fn(model, "mse", training=False)
  got = float(loss_fn((x, y)))
  np.testing.assert_allclose(got, model.evaluate(x, y, verbose=0), rtol=1e-5)
  np.testing.assert_allclose(float(loss_fn((x, y), prediction=model(x))),
                             got, rtol=1e-6)
  assert got > float(tf.reduce_mean(tf.square(model(x) - y)))  # has the l2


def test_serialize_helpers_and_get_parent():
  assert utils.serialize_loss("mse") == "mse"
  assert utils.serialize_loss(
      {"a": keras.losses.binary_crossentropy, "b": "mse"}) == {
          "a": "binary_crossentropy", "b": "mse"}
  assert utils.serialize_loss(
      [tf_keras.losses.categorical_crossentropy]) == [
          "categorical_crossentropy"]
  assert utils.serialize_fisher_approx(
      {keras.layers.Dense: "full", "conv": "diagonal"}) == {
          "kfac_class_Dense": "full", "conv": "diagonal"}
  assert utils.serialize_fisher_approx(["full"]) == ["full"]
  with tf.Graph().as_default():
    a = tf.constant([[1.0, 2.0]])
    assert utils.get_parent(tf.nn.relu(a)) is a
    with pytest.raises(ValueError, match="more than one parent"):
      utils.get_parent(a + a)
  with pytest.raises(ValueError, match="not a graph tensor"):
    utils.get_parent(tf.constant(1.0))
