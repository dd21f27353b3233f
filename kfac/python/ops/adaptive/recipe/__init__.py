"""K-FAC's default recipe: what the optimizers do when the user sets only
what they must (docs/recipe.md has the measurements behind each value).

`kfac.keras.optimizers.Kfac(adaptive=True)` applies it: learning rate and
momentum from the exact quadratic model, Levenberg-Marquardt damping
calibrated from INITIAL_DAMPING during the last NUM_CALIBRATION_STEPS of
NUM_BURNIN_STEPS burn-in steps, a damping floor of RELATIVE_MIN_DAMPING
times the curvature scale, and the chosen momentum within
+-QMODEL_MOMENTUM_BOUND.
`recipe.adaptive_kwargs()` gives the same arguments for
`kfac.PeriodicInvCovUpdateKfacOpt` (whose own defaults stay kfac 0.2.x's).

* `conv_registration_options()`: the statistics options of the Keras
  optimizer's convolution layers (kron approximation, one call per step):
  the input factor on a random subset of at most
  8 * dim(A) patch rows per statistics update (docs/recipe.md, "Cost per
  step on real convnets"); depthwise convolutions (per-channel kron) take
  its sub_sample_patches too (8 * (K + 1) rows for K taps).
* `keras_default_approx()`: the approximation of the Keras optimizer's
  layers of a kind where fisher_approx chose none: batch normalization's
  scale and shift in per-channel 2x2 blocks (docs/recipe.md).
* `curvature_scale`: the mean eigenvalue of the K-FAC curvature, read from
  the factors' traces (no decomposition), used by the relative damping floor
  (`relative_min_damping`).

Three recipes (`RECIPES`, `Kfac(adaptive=True, recipe=...)`):
* "exact" (the default): the exact two-direction quadratic model chooses
  the learning rate and momentum at every step, the damping is calibrated
  during burn-in: the low-noise recipe (full batches, growing batches,
  large batches against the gradient noise; `adaptive_kwargs()`).
* "minibatch": the recipe for noisy minibatch training, amortised as the
  anchors of docs/recipe.md do (kfac-jax's stochastic examples, Martens &
  Grosse's code, KAISA): the user's learning rate (or schedule) with a
  fixed momentum, no quadratic model, a norm constraint on the update,
  statistics every MINIBATCH_COV_UPDATE_EVERY steps, inverses and the
  damping rule every MINIBATCH_INVERT_EVERY (`minibatch_kwargs()`).
* "auto" (Keras): "exact" until the measured gradient noise scale passes
  AUTO_SWITCH_RATIO times the batch size, then "minibatch" at
  AUTO_MINIBATCH_LEARNING_RATE, inside one traced step (`switch.py`;
  the core's `minibatch_phase`, `minibatch_phase()`). Not the default: the
  noise scale did not pick the faster recipe (docs/recipe.md, "The
  automatic recipe").
"""

from kfac.python.ops.adaptive.recipe import switch
from kfac.python.ops.adaptive.recipe.scale import curvature_scale  # noqa: F401

# The damping never falls below this times the curvature scale. Measured
# (docs/recipe.md, "The damping floor"): without it the recipe reached the
# benchmark convnet's target after Adam did (and collapsed there in an
# earlier run); 0.1 and 0.3 both before Adam, neither ahead on every
# workload.
RELATIVE_MIN_DAMPING = 0.1
# The momentum the quadratic model chooses stays in [-1, 1] (the learning
# rate is then the model's best for it: qmodel_momentum_bound). Measured
# (docs/recipe.md, "The momentum bound"): unbounded, the zoo's GRU text
# classifier took momenta of -7.7 and then -79.7 once the rule had lowered
# the damping 300-fold, and its weights grew by 10^8 in four steps.
QMODEL_MOMENTUM_BOUND = 1.0
# The initial damping, which the burn-in calibration then moves (by factors
# of 10, then bisecting in log space): the same on every workload.
INITIAL_DAMPING = 1.0
NUM_BURNIN_STEPS = 5
# The burn-in steps that calibrate the damping (the last ones), each
# recomputing every inverse to try its step; the first burn-in step only
# gathers statistics. So the first call inverts nothing (a trial on one
# batch's statistics said least about the damping the averaged ones need),
# which halved ResNet50's first call (docs/recipe.md, "The first burn-in
# step"), and the burn-in inverts four times instead of five.
NUM_CALIBRATION_STEPS = NUM_BURNIN_STEPS - 1
# Statistics (their sampled backward pass and factor products) every this
# many steps; measured by time to target in docs/recipe.md.
COV_UPDATE_EVERY = 2
# A convolution's input statistic A = mean over the N*L patches p p^T costs
# N*L*dim(A)^2 flops, about dim(A)/out_channels (9x for a 3x3 conv with as
# many inputs as outputs) times the layer's forward pass; on a random subset
# of at most 8*dim(A) patch rows (sub_sample_patches=True, an unbiased
# estimate of the same mean) it is a fixed, small cost. Measured in
# docs/recipe.md: the same loss at equal steps, 30% less per step on a BN
# ResNet.
CONV_SUB_SAMPLE_PATCHES = True


# The first steps of Kfac(adaptive=True, recipe="auto") measure the
# gradient noise scale B_simple (adaptive/noise_scale.py) on two halves of
# each batch: about one more forward and backward pass of the batch on each
# of these steps. The other recipes measure it only when asked
# (noise_scale_steps=N): the halves' passes are a second copy of the model
# in the traced step, and the first train_on_batch took half again as long
# with them (EfficientNetB0 90 against 61 CPU s, ResNet50 76 against 51:
# docs/recipe.md, "The gradient noise scale"), for a value the exact recipe
# does not use.
NOISE_SCALE_STEPS = 5
# Asked for with noise_scale_steps alone, one step in NOISE_SCALE_EVERY is
# measured after the first ones (the noise scale grows tenfold and more in
# the first hundreds of steps: docs/recipe.md): about 1% more per step.
NOISE_SCALE_EVERY = 50

# The recipe for noisy minibatch training ("minibatch"). kfac-jax's
# stochastic examples fix the momentum at 0.9 and recompute inverses and
# damping every 50 steps; Martens & Grosse's code inverts every 20; KAISA
# every 10. Measured in docs/recipe.md ("The minibatch recipe").
RECIPES = ("exact", "minibatch", "auto")
MINIBATCH_MOMENTUM = 0.9
MINIBATCH_COV_UPDATE_EVERY = 10
MINIBATCH_INVERT_EVERY = 50
MINIBATCH_NORM_CONSTRAINT = 0.01
# The damping rule's decay per step (raised to the interval: the damping
# moves by at most 0.99963**50 = 0.982 per adaptation), kfac-jax's ResNet-50
# value. Measured in docs/recipe.md: kfac 0.2.x's 0.95 (a factor of 13 per
# adaptation every 50 steps) took the ViT's damping from 1 to 0.006 in 175
# steps, where its training loss rose from 0.50 to 0.77 (best validation
# 0.8330); with this decay 0.8500, and the CNN the same within one seed.
MINIBATCH_DAMPING_DECAY = 0.99963


def _minibatch_settings():
  """The minibatch recipe's update rule, periods and damping rule (the
  same in minibatch_kwargs, keras_minibatch_defaults and
  minibatch_phase)."""
  return dict(momentum=MINIBATCH_MOMENTUM,
              cov_update_every=MINIBATCH_COV_UPDATE_EVERY,
              invert_every=MINIBATCH_INVERT_EVERY,
              damping_adaptation_interval=MINIBATCH_INVERT_EVERY,
              damping_adaptation_decay=MINIBATCH_DAMPING_DECAY,
              norm_constraint=MINIBATCH_NORM_CONSTRAINT)


def minibatch_kwargs(**overrides):
  """Arguments of kfac.PeriodicInvCovUpdateKfacOpt for the "minibatch"
  recipe (pass learning_rate=..., loss_fn=... and, in a TF1 graph,
  train_batch=... too; overrides replace any of these)."""
  kwargs = dict(momentum_type="regular", damping=INITIAL_DAMPING,
                adapt_damping=True,
                relative_min_damping=RELATIVE_MIN_DAMPING,
                **_minibatch_settings())
  kwargs.update(overrides)
  return kwargs


# recipe="auto" (Keras): the exact recipe until the gradient noise scale
# B_simple, measured on NOISE_SCALE_STEPS steps and then one in
# NOISE_SCALE_EVERY, passes the batch size; then the minibatch recipe at this
# learning rate (its best on the CNN and the ViT of the validation
# benchmark's grid 0.02 / 0.05 / 0.1: docs/recipe.md).
AUTO_MINIBATCH_LEARNING_RATE = 0.1
# recipe="auto" switches when B_simple > AUTO_SWITCH_RATIO * batch size.
AUTO_SWITCH_RATIO = 1.0
# With recipe="auto" the noise scale is measured on one step in this many
# after the first NOISE_SCALE_STEPS (its sums decay by 0.8 per measurement:
# a window of some 50 steps). One in NOISE_SCALE_EVERY (50, a window of
# some 250 steps) kept the first steps' large gradients in the estimate
# for the whole of a 60-second run: measured in docs/recipe.md, the CNN's
# never switched in 208 steps.
AUTO_NOISE_SCALE_EVERY = 10


def minibatch_phase(learning_rate):
  """The minibatch recipe as the phase recipe="auto" switches to
  (PeriodicInvCovUpdateKfacOpt's minibatch_phase)."""
  return switch.MinibatchPhase(learning_rate=float(learning_rate),
                               initial_damping=INITIAL_DAMPING,
                               **_minibatch_settings())


def keras_minibatch_defaults():
  """The Keras Kfac arguments that recipe="minibatch" fills in where the
  user left them out (the damping's initial value and floor come from the
  adaptive defaults)."""
  return dict(momentum_type="regular", **_minibatch_settings())


def conv_registration_options():
  """The default registration options (register_conv2d's keyword
  arguments) of the Keras optimizer's kron convolution layers with
  adaptive=True, where the user gave none for the layer."""
  return {"sub_sample_patches": CONV_SUB_SAMPLE_PATCHES}


def adaptive_kwargs(**overrides):
  """Arguments of kfac.PeriodicInvCovUpdateKfacOpt for the default recipe
  (pass loss_fn=... and, in a TF1 graph, train_batch=... too; overrides
  replace any of these)."""
  kwargs = dict(learning_rate=None, momentum=None, momentum_type="qmodel",
                damping=INITIAL_DAMPING, adapt_damping=True,
                calibrate_damping=True, num_burnin_steps=NUM_BURNIN_STEPS,
                num_calibration_steps=NUM_CALIBRATION_STEPS,
                relative_min_damping=RELATIVE_MIN_DAMPING,
                cov_update_every=COV_UPDATE_EVERY,
                qmodel_momentum_bound=QMODEL_MOMENTUM_BOUND)
  if overrides.get("momentum_type", "qmodel") != "qmodel":
    del kwargs["qmodel_momentum_bound"]  # the bound is the model's
  if "num_burnin_steps" in overrides and (
      "num_calibration_steps" not in overrides):
    # Another number of burn-in steps calibrates on all of them (the core's
    # default), as kfac.keras.optimizers.Kfac does with the user's.
    del kwargs["num_calibration_steps"]
  kwargs.update(overrides)
  return kwargs


# Batch normalization's (scale, shift) of C channels as one full 2C x 2C
# block costs (2C)^3 per inverse: EfficientNetB0's 49 batch norms (15 of
# them with 2C >= 1000, up to 2560) took some 9 s of CPU per inverse update,
# MobileNetV2's 52 about 1.3 s. In per-channel 2x2 blocks (each channel's
# scale with its shift, ScaleAndShiftPerChannelFB) they cost O(C) and keep
# the within-channel coupling the diagonal drops; measured in docs/recipe.md
# ("Cost per step on real convnets").
BATCH_NORM_APPROX = "per_channel"


def keras_default_approx():
  """{layer kind: approximation} of Kfac(adaptive=True)'s layers for which
  fisher_approx chose none."""
  return {"batch_norm": BATCH_NORM_APPROX}
