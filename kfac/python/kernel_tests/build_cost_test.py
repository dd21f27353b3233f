"""The cost of building the K-FAC step (issue 32, item 1), checked without
timing:

* a Keras `fit` / `train_on_batch` step and a custom tf.function step are
  traced once: the K-FAC state is created eagerly during the first trace,
  so tf.function keeps that trace instead of tracing the step a second
  time (as it does for a function whose first trace created variables;
  saving and resuming: keras_optimizer_test.py, resume_test.py);
* the traced step (with adaptive=True: statistics, batched inverses,
  quadratic model, damping rule) grows linearly with the depth of a model
  of equal layers, by a stated number of graph nodes per layer.
"""

import numpy as np
import pytest
import tensorflow as tf

import kfac
import kfac.keras
from kfac.python.keras import keras_flavor

keras = keras_flavor.keras_module()


def _model(seed=0):
  keras.utils.set_random_seed(seed)
  return keras.Sequential([
      keras.Input((6, 6, 2)),
      keras.layers.Conv2D(3, 3, name="conv"),
      keras.layers.BatchNormalization(name="bn"),
      keras.layers.ReLU(),
      keras.layers.Flatten(),
      keras.layers.Dense(4, name="dense"),
  ])


def _data():
  rng = np.random.RandomState(0)
  return (rng.rand(16, 6, 6, 2).astype(np.float32),
          rng.randint(0, 4, 16).astype(np.int32))


def _count_applies(opt):
  """Counts the optimizer's K-FAC step builds (one per trace)."""
  count = [0]
  apply_fn = opt._kfac_apply  # pylint: disable=protected-access

  def counted(*args, **kwargs):
    count[0] += 1
    return apply_fn(*args, **kwargs)
  opt._kfac_apply = counted  # pylint: disable=protected-access
  return count


def _loss():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_fit_traces_the_step_once():
  for adaptive in (True, False):
    model = _model()
    kwargs = dict(adaptive=True) if adaptive else dict(
        learning_rate=0.01, damping=0.01)
    opt = kfac.keras.optimizers.Kfac(model=model, loss=_loss(), **kwargs)
    model.compile(optimizer=opt, loss=_loss())
    count = _count_applies(opt)
    x, y = _data()
    losses = [float(model.train_on_batch(x, y)) for _ in range(3)]
    assert count[0] == 1, (adaptive, count[0])
    assert np.all(np.isfinite(losses)), losses
    assert len(opt.state_store.variables_by_name) > 10


def test_custom_loop_traces_the_step_once():
  model = _model()
  opt = kfac.keras.optimizers.Kfac(model=model, loss=_loss(),
                                   learning_rate=0.01, damping=0.01)
  count = _count_applies(opt)
  x, y = _data()
  loss_fn = _loss()

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  for _ in range(3):
    step(x, y)
  assert step.experimental_get_tracing_count() == 1
  assert count[0] == 1



def _step_graph_size(depth, adaptive=True):
  """Nodes of the traced K-FAC step (the function and every function it
  calls: conditional branches) of `depth` Dense+ReLU layers of width 8."""
  keras.utils.set_random_seed(0)
  layers = [keras.Input((8,))]
  for i in range(depth):
    layers += [keras.layers.Dense(8, name="d%d" % i), keras.layers.ReLU()]
  layers.append(keras.layers.Dense(3, name="out"))
  model = keras.Sequential(layers)
  kwargs = dict(adaptive=True) if adaptive else dict(
      learning_rate=0.01, damping=0.01)
  opt = kfac.keras.optimizers.Kfac(model=model, loss=_loss(), **kwargs)
  model.compile(optimizer=opt, loss=_loss())  # the damping rule's loss
  loss_fn = _loss()

  @tf.function
  def step(x, y):
    opt.set_train_batch((x, y))
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  graph_def = step.get_concrete_function(
      tf.TensorSpec([16, 8], tf.float32),
      tf.TensorSpec([16], tf.int32)).graph.as_graph_def()
  return len(graph_def.node) + sum(
      len(f.node_def) for f in graph_def.library.function)


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_step_graph_grows_linearly_with_depth():
  sizes = {d: _step_graph_size(d) for d in (1, 2, 4)}
  first, second = sizes[2] - sizes[1], (sizes[4] - sizes[2]) / 2
  # Linear: the cost of a layer does not grow with the layers before it
  # (measured: 311 nodes per Dense+ReLU layer with adaptive=True, the same
  # for every added layer; 478 before the quadratic model's inner products
  # became one Gram per variable and the normalized traces took shared
  # constants; 306 with the gradient noise scale's measurement, 270
  # without it, on 2026-12-05).
  assert second <= first, sizes
  assert second <= 340, sizes


def test_shared_constants_are_made_once_per_graph():
  """utils.shared_constant: one Const per graph, value and dtype, free of
  the control dependencies, device and colocation in scope; a fresh one
  in eager mode and inside TF1 control flow. utils.trace uses them and
  equals tf.linalg.trace."""
  from kfac.python.ops.tensors import utils  # pylint: disable=g-import-not-at-top
  mats = np.random.RandomState(0).randn(3, 5, 5)
  np.testing.assert_array_equal(utils.trace(tf.constant(mats)),
                                tf.linalg.trace(tf.constant(mats)))
  np.testing.assert_allclose(utils.trace(tf.constant(mats)),
                             np.trace(mats, axis1=1, axis2=2), rtol=1e-15)
  assert float(utils.shared_constant(2.5, tf.float64)) == 2.5
  with tf.Graph().as_default() as graph:
    gate = tf.constant(1.0)
    with tf.control_dependencies([gate]), tf.device("/cpu:0"):
      first = utils.shared_constant(7, tf.float32)
      traced = utils.trace(tf.eye(4))
    again = utils.shared_constant(7, tf.float32)
    assert first is again
    assert utils.shared_constant(7, tf.float64) is not first
    assert utils.shared_constant(8, tf.float32) is not first
    assert not first.op.control_inputs and not first.op.device
    mat = tf.compat.v1.placeholder(tf.float32, [4, 4])
    count = lambda: sum(op.type == "Const" for op in graph.get_operations())  # pylint: disable=unnecessary-lambda-assignment
    before = count()
    for _ in range(3):
      utils.trace(mat)
    assert count() == before  # the first trace in the graph made them
    inside = []

    def body(i):
      inside.append(utils.shared_constant(7, tf.float32))
      return i + 1
    tf.compat.v1.while_loop(lambda i: i < 2, body, [tf.constant(0)])
    assert inside[0] is not first
    with tf.compat.v1.Session() as sess:
      assert sess.run(traced) == 4.0
  with tf.Graph().as_default():
    assert utils.shared_constant(7, tf.float32) is not first


def _count_model_calls(model):
  """Counts the model's training-mode calls while tracing (the training
  forward pass and each of the damping rule's evaluations of the loss)."""
  count = [0]
  call = model.call

  def counted(*args, **kwargs):
    if not tf.executing_eagerly():
      count[0] += 1
    return call(*args, **kwargs)
  object.__setattr__(model, "call", counted)
  return count


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_damping_rule_reuses_the_training_loss_in_fit():
  """With adaptive=True (calibration in burn-in, then the damping rule) the
  loss before the update is fit's own training loss (the same value: the
  rule replays the training pass's dropout masks), and the calibration's
  trial and the rule's loss after the update share one evaluation
  (optimizers/step.py): the traced step calls the model twice
  (training pass, the loss after a trial or an update), was 5, then 3. In
  a custom loop whose loss is not model.compute_loss, loss_fn evaluates it
  (in the calibration and before the rule): 4 calls. The gradient noise
  scale's measurement (on by default) adds its two halves' calls (in a
  conditional that runs on the measured steps only). The value kept as the
  loss before the update is the training loss (the float64 brute force of
  the rule with dropout: keras_dropout_damping_test.py)."""
  for custom, noise in ((False, False), (True, False), (False, True)):
    model = _model()
    off = (dict(noise_scale_steps=5, noise_scale_every=50) if noise else
           dict(noise_scale_steps=0, noise_scale_every=0))
    opt = kfac.keras.optimizers.Kfac(model=model, loss=_loss(),
                                     adaptive=True, **off)
    model.compile(optimizer=opt, loss=_loss())
    count = _count_model_calls(model)
    x, y = _data()
    if custom:
      loss_fn = _loss()

      @tf.function
      def step(x, y):
        with tf.GradientTape() as tape:
          loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.set_train_batch((x, y))
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss
      step(x, y)
    else:
      model.train_on_batch(x, y)
    assert count[0] == (4 if custom else 2) + (2 if noise else 0), (
        custom, noise, count[0])
  # fit's loss is the one kept as the loss before the update: on the first
  # step after the burn-in (an adaptation step) it equals the loss
  # train_on_batch returns.
  model = _model()
  opt = kfac.keras.optimizers.Kfac(model=model, loss=_loss(), adaptive=True,
                                   num_burnin_steps=1)
  model.compile(optimizer=opt, loss=_loss())
  x, y = _data()
  model.train_on_batch(x, y)
  loss = float(model.train_on_batch(x, y))
  kept = float(opt.kfac_optimizer.state_store.get(
      "adaptive/loss_before").numpy())
  assert kept == pytest.approx(loss, rel=1e-6)
