"""TF1 training graphs whose variable accesses graph_races.py checks: the
default recipe and the old library's optimizers and modes, on a model with a
dense layer (weights from tf.compat.v1.get_variable: reference variables
under tf.compat.v1.disable_v2_behavior()), a convolution and an output
layer. Each scenario builds a fresh graph and returns {name: races} for the
fetches a training loop runs (the training op with the loss, and the
old library's separate update ops where the scenario has them).

Run in this process by graph_races_test.py (control flow v1 and v2) and
under disable_v2_behavior() by graph_races_program.py.
"""

import numpy as np
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import graph_races
from kfac.python.ops.adaptive import recipe

N = 8


def _model(approx="kron", conv_approx="kron"):
  """(loss, loss_fn, layer collection, batch placeholders, variables)."""
  rng = np.random.RandomState(0)

  def init(shape):
    return tf.compat.v1.constant_initializer(
        0.3 * rng.randn(*shape).astype(np.float32))
  images = tf.compat.v1.placeholder(tf.float32, [N, 6, 6, 2], "images")
  labels = tf.compat.v1.placeholder(tf.int32, [N], "labels")
  shapes = {"filt": [3, 3, 2, 4], "w1": [36, 5], "b1": [5], "w2": [5, 3],
            "emb": [7, 3]}
  var = {k: tf.compat.v1.get_variable(k, s, tf.float32, initializer=init(s))
         for k, s in shapes.items()}

  def forward(batch, lc=None):
    x, y = batch
    conv = tf.nn.conv2d(x, var["filt"], [1, 2, 2, 1], "SAME")
    flat = tf.reshape(tf.nn.relu(conv), [N, 36])
    pre = tf.matmul(flat, var["w1"]) + var["b1"]
    # An embedding of ids taken from the labels (sparse gradients: the
    # update scatters into the table).
    ids = tf.math.floormod(y * 3 + 1, 7)
    looked_up = tf.nn.embedding_lookup(var["emb"], ids)
    logits = tf.matmul(tf.tanh(pre), var["w2"]) + looked_up
    if lc is not None:
      lc.register_embedding(var["emb"], ids, looked_up)
      lc.register_conv2d(var["filt"], [1, 2, 2, 1], "SAME", x, conv,
                         approx=conv_approx)
      lc.register_fully_connected((var["w1"], var["b1"]), flat, pre,
                                  approx=approx)
      lc.register_fully_connected(var["w2"], tf.tanh(pre), logits,
                                  approx=approx)
      lc.register_softmax_cross_entropy_loss(logits, targets=y)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=logits))

  lc = kfac.LayerCollection()
  batch = (images, labels)
  loss = forward(batch, lc)
  return loss, lambda b: forward(b), lc, batch, list(var.values())


def _periodic(kwargs, approx="kron", conv_approx="kron", prev=False):
  loss, loss_fn, lc, batch, variables = _model(approx, conv_approx)
  kwargs = dict(kwargs)
  if kwargs.get("adapt_damping") or kwargs.get("calibrate_damping"):
    kwargs["loss_fn"] = loss_fn
  opt = kfac.PeriodicInvCovUpdateKfacOpt(layer_collection=lc, **kwargs)
  if "loss_fn" in kwargs:
    opt.set_train_batch(batch)
    if prev:
      opt.set_prev_train_batch(batch)
  train = opt.minimize(loss, var_list=variables,
                       global_step=tf.compat.v1.train.get_or_create_global_step())
  return {"train_op and loss": [train, loss]}


def recipe_step():
  return _periodic(recipe.adaptive_kwargs())


def recipe_with_decay():
  return _periodic(recipe.adaptive_kwargs(decoupled_weight_decay=1e-3))


def recipe_ekfac():
  return _periodic(recipe.adaptive_kwargs(), approx="ekfac",
                   conv_approx="ekfac")


def old_periodic():
  return _periodic(dict(learning_rate=0.1, damping=0.01, momentum=0.9,
                        cov_update_every=2, invert_every=3))


def old_adam_momentum():
  """kfac 0.2.x's default momentum ("adam") with a norm constraint."""
  return _periodic(dict(learning_rate=0.05, damping=0.01, momentum=0.9,
                        momentum_type="adam", norm_constraint=1e-2))


def old_adapted_damping():
  """kfac 0.2.x's adaptive mode: the rule on the previous batch."""
  return _periodic(dict(learning_rate=None, momentum=None,
                        momentum_type="qmodel", damping=0.1,
                        adapt_damping=True, damping_adaptation_interval=2,
                        update_damping_immediately=False), prev=True)


def qmodel_fixed_momentum():
  return _periodic(dict(learning_rate=None, momentum=0.9,
                        momentum_type="qmodel_fixedmu", damping=0.1,
                        estimation_mode="curvature_prop"))


def manual_update_ops():
  """The old KfacOptimizer pattern: statistics before the step, the
  inverses run by themselves."""
  loss, _, lc, _, variables = _model()
  opt = kfac.KfacOptimizer(learning_rate=0.1, damping=0.01, momentum=0.9,
                           layer_collection=lc)
  cov_thunks, inv_thunks = opt.make_vars_and_create_op_thunks()
  cov_op = tf.group(*[t() for t in cov_thunks])
  inv_op = tf.group(*[t() for t in inv_thunks])
  with tf.control_dependencies([cov_op]):
    train = opt.minimize(loss, var_list=variables)
  return {"train_op and loss": [train, loss], "inv_update_op": [inv_op]}


SCENARIOS = {f.__name__: f for f in (
    recipe_step, recipe_with_decay, recipe_ekfac, old_periodic,
    old_adam_momentum, old_adapted_damping, qmodel_fixed_momentum, manual_update_ops)}


def run(name):
  """{fetch name: [race as a string]} of one scenario, in a new graph."""
  with tf.Graph().as_default():
    fetches = SCENARIOS[name]()
    return {key: [str(tuple(r)) for r in graph_races.races(value)]
            for key, value in fetches.items()}


def trajectory(name, use_resource, steps=8):
  """(fetched losses, final weights) of `steps` Session runs of a
  scenario's training op on fixed random batches, the model's weights
  resource or reference variables."""
  graph = tf.Graph()
  with graph.as_default():
    with tf.compat.v1.variable_scope("", use_resource=use_resource):
      train, loss = SCENARIOS[name]()["train_op and loss"]
    weights = tf.compat.v1.trainable_variables()
    kinds = {type(w).__name__ for w in weights}
    expected = "ResourceVariable" if use_resource else "RefVariable"
    assert kinds == {expected}, kinds
    images = graph.get_tensor_by_name("images:0")
    labels = graph.get_tensor_by_name("labels:0")
    rng = np.random.RandomState(0)
    losses = []
    with tf.compat.v1.Session(graph=graph) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      for _ in range(steps):
        feed = {images: rng.randn(N, 6, 6, 2).astype(np.float32),
                labels: rng.randint(0, 3, N)}
        losses.append(sess.run([train, loss], feed)[1])
      return np.array(losses), sess.run(weights)
