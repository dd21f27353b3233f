"""The Keras model zoo (examples/benchmarks/zoo_models.py) trains with the
default recipe, every layer with weights under a non-diagonal block.

Each model (keras.applications MobileNetV2 (alpha 0.35), ResNet50 and
EfficientNetB0 on 32x32x3; a small BN ResNet, a ViT, a GPT-style causal
transformer, LSTM and GRU text classifiers) is built at the benchmark's
size, compiled with `Kfac(model=model, adaptive=True)` and nothing else,
and takes STEPS train_on_batch steps on one fixed batch of its data. Checks:

* the registration report names a block for every layer that owns
  trainable weights, none of them a generic fallback and none diagonal
  (the share of parameters under Kronecker or full blocks is 100%);
* every loss is finite and the training loss falls: the last step's loss
  (after the recipe's 5 burn-in steps, which calibrate the damping and
  leave the weights, and 4 updates) is at least 3% below the first one's
  (on one fixed batch the quadratic model's steps must make progress).
  (ResNet50 with 2 burn-in steps: OPTIONS below.)

The whole zoo is the slow tier (the applications take minutes to build on
2 cores); `make bench` runs the side-by-side table (keras_zoo.py).
"""

import os
import pathlib
import sys

import numpy as np
import pytest

import keras

import kfac  # pylint: disable=unused-import
import kfac.keras

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] /
                       "examples" / "benchmarks"))
import zoo_models  # pylint: disable=g-import-not-at-top,wrong-import-position

STEPS = 10  # the recipe's 5 burn-in steps (weights still) and 5 more
BATCH = 32
# ResNet50's factors include three of 4609 x 4609: each burn-in step that
# tries a damping recomputes every inverse (about 30 s of a 2-core
# machine's CPU against 1.5 s for a later step; 574 s for this model's test
# in CI with the recipe's 4 calibrating steps). Its test calibrates on one
# burn-in step after one that only gathers statistics; the recipe's own
# burn-in is the other eight models' (and keras_adaptive_test's).
OPTIONS = {"resnet50": dict(num_burnin_steps=2, num_calibration_steps=1)}


def _train(name):
  keras.utils.set_random_seed(0)
  model = zoo_models.build(name)
  # EfficientNetB0's Dropout layers make the training loss of one batch
  # random from step to step (5.5-6.4 during the burn-in, whose weights do
  # not move): more than the 3% fall checked below. (The damping rule now
  # evaluates with the training pass's masks and settles at 1.3 there,
  # where it went to 1e5 before; the loss still falls far slower than the
  # 6.38 -> 0.78 in 4 updates without dropout: docs/keras.md.) The check
  # here is the registration and the steps; dropout is off.
  for layer in model._flatten_layers():  # pylint: disable=protected-access
    if isinstance(layer, keras.layers.Dropout):
      layer.rate = 0.0
  x, y = zoo_models.data(name, BATCH, seed=0)
  options = OPTIONS.get(name, {})
  opt = kfac.keras.optimizers.Kfac(model=model, adaptive=True, **options)
  model.compile(optimizer=opt, loss=zoo_models.loss(name))
  steps = STEPS - 5 + options.get("num_burnin_steps", 5)
  losses = [float(model.train_on_batch(x, y)) for _ in range(steps)]
  return model, opt, losses


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo_models.NAMES)
def test_zoo_model_trains_with_every_layer_under_a_kronecker_block(name):
  model, opt, losses = _train(name)
  report = opt.registration_report
  kron, generic, fallbacks, diagonal = zoo_models.weight_shares(model,
                                                                report)
  assert not fallbacks, report
  assert not diagonal, report
  assert generic == 0 and kron == pytest.approx(1.0), report
  assert np.all(np.isfinite(losses)), losses
  assert losses[-1] < 0.97 * losses[0], losses


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_images_reach_each_application_in_its_documented_range():
  # EfficientNetB0 starts with Rescaling(1/255): it takes [0, 255] pixels;
  # the other image models take the data as it is, in [0, 1].
  model = zoo_models.build("efficientnetb0")
  x, _ = zoo_models.data("efficientnetb0", 8, seed=0)
  # The first Rescaling layer, found by its type: its name depends on how
  # many Rescaling layers the process made before ("rescaling_1", ...).
  rescaling = next(layer for layer in model.layers
                   if isinstance(layer, keras.layers.Rescaling))
  scaled = np.asarray(rescaling(x))
  assert scaled.min() >= 0.0 and 0.5 < scaled.max() <= 1.0
  for name in ("mobilenetv2", "resnet50", "bn_resnet", "vit"):
    x, _ = zoo_models.data(name, 8, seed=0)
    assert x.min() >= 0.0 and 0.5 < x.max() <= 1.0, name


def test_weight_shares_reads_the_report():
  # A hand-written report: "d" (8 weights) under a Kronecker block, "c" (4)
  # under a diagonal one, "r" (7) fell back to the generic diagonal.
  inputs = keras.Input((3,))
  dense = keras.layers.Dense(2, name="d")
  other = keras.layers.Dense(1, name="c")
  cell = keras.layers.Dense(1, name="r", use_bias=True)
  model = keras.Model(inputs, [dense(inputs), other(inputs),
                               cell(keras.layers.Concatenate()(
                                   [inputs, inputs]))])
  report = "\n".join([
      "layer  class  block  approx  calls  parameters  note",
      "-----  -----  -----  ------  -----  ----------  ----",
      "d  Dense  FullyConnectedKFACBasicFB  default  1  d/kernel, d/bias",
      "c  Dense  ConvDiagonalFB  diagonal  1  c/kernel, c/bias",
      "r  Dense  NaiveDiagonalFB  diagonal  0  r/kernel, r/bias  "
      "fallback: no K-FAC block",
      "loss: x"])
  kron, generic, fallbacks, diagonal = zoo_models.weight_shares(model,
                                                                report)
  assert (kron, generic) == (pytest.approx(8 / 19), pytest.approx(7 / 19))
  assert fallbacks == ["r"] and diagonal == ["c"]


if __name__ == "__main__":
  sys.exit(pytest.main([os.path.abspath(__file__), "-q"]))


@pytest.mark.slow  # two 64-step fits of the GRU
@pytest.mark.parametrize("bound", [1.0, None])
def test_the_gru_does_not_blow_up_under_the_momentum_bound(bound):
  """The zoo's GRU text classifier, make bench's setting (seed 0, batch 64,
  the same batches in order). With the recipe's bound of 1 (docs/recipe.md,
  "The momentum bound") the momentum stays within the bound, the weights'
  squared norm within a few times its start and the loss near ln 4.

  Unbounded (kfac 0.2.x's solve) the quadratic model picks momenta beyond 1
  from step 7 on, which is what makes the bounded run's first assertion able
  to fail. In a process of its own on an Intel Xeon it then chose -7.7 and
  -79.7 at steps 55 and 56 and the squared norm grew from about 1e2 to over
  1e9 by step 60; that blow-up is not asserted: the trajectory after some 40
  steps depends on the CPU's rounding and the threads (CI's run of the same
  64 steps stayed below 3.3 in momentum), and a test must not depend on the
  machine."""
  keras.utils.set_random_seed(0)
  model = zoo_models.build("gru", "full")
  steps, batch, zoo_steps = 64, 64, 200
  # keras_zoo.py's data and first call (its held-out batch), then the first
  # 64 of its 200 steps.
  x, y = zoo_models.data("gru", (zoo_steps + 1) * batch, 0)
  opt = kfac.keras.optimizers.Kfac(model=model, adaptive=True,
                                   qmodel_momentum_bound=bound)
  model.compile(optimizer=opt, loss=zoo_models.loss("gru"))
  model.train_on_batch(x[zoo_steps * batch:], y[zoo_steps * batch:])
  n = steps * batch

  def squared_norm():
    return sum(float(np.sum(np.square(v.numpy())))
               for v in model.trainable_variables)
  start = squared_norm()
  momenta = []

  class Record(keras.callbacks.Callback):

    def on_train_batch_end(self, step, logs=None):
      momenta.append(float(opt.kfac_optimizer.momentum))
  losses = model.fit(x[:n], y[:n], batch_size=batch, epochs=1,
                     shuffle=False, verbose=0,
                     callbacks=[Record()]).history["loss"]
  end = squared_norm()
  if bound is None:  # the momenta the bound exists to cut
    assert max(abs(m) for m in momenta) > 1.5
  else:
    assert max(abs(m) for m in momenta) <= bound * (1 + 1e-6)
    assert end < 3 * start
    assert losses[-1] < 1.5  # ln 4 = 1.386: no optimizer learns the task here
