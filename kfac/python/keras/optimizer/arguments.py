"""The arguments of the Keras Kfac optimizer: which it accepts, what they
must satisfy, and the default recipe's values for adaptive=True."""

from kfac.python.ops.adaptive import recipe
from kfac.python.ops.reliability import arguments

# Hyperparameters kept in variables, so that callbacks and users can change
# them between steps without retracing.
MUTABLE_HYPERPARAMETERS = ("learning_rate", "damping", "momentum",
                           "weight_decay_coeff", "norm_constraint",
                           "weight_decay")
CORE_DEFAULTS = {"momentum": 0.9, "weight_decay_coeff": 0.1}
# Keras optimizer options that do not make sense for K-FAC: rejected.
KERAS_ONLY_OPTIONS = ("clipnorm", "clipvalue", "global_clipnorm", "use_ema",
                      "ema_momentum", "ema_overwrite_frequency",
                      "loss_scale_factor", "gradient_accumulation_steps",
                      "jit_compile", "is_legacy_optimizer")
# What the hyperparameters must satisfy (reliability/arguments.py).
RULES = {"damping": arguments.POSITIVE, "momentum": arguments.MOMENTUM,
         "weight_decay_coeff": arguments.NON_NEGATIVE,
         "norm_constraint": arguments.POSITIVE,
         "weight_decay": arguments.NON_NEGATIVE}
# Core arguments that Kfac sets itself (adaptive=True / calibrate_damping).
OWNED_CORE_ARGUMENTS = ("loss", "loss_fn", "prev_train_batch", "train_batch",
                        "adapt_damping", "use_passed_loss",
                        "update_damping_immediately")


def _check_kwargs(kfac_kwargs):
  bad = [k for k in kfac_kwargs if k in KERAS_ONLY_OPTIONS]
  if bad:
    raise ValueError(
        "Kfac does not support the Keras optimizer option(s) %s. K-FAC "
        "bounds its steps with norm_constraint=... and decays weights with "
        "weight_decay=... (AdamW's)." % ", ".join(bad))
  if (kfac_kwargs.get("weight_decay") is not None and
      kfac_kwargs.get("use_weight_decay")):
    raise ValueError(
        "Kfac got weight_decay=%r (AdamW's decoupled weight decay) and "
        "use_weight_decay=True (kfac 0.2.x's, with weight_decay_coeff): both "
        "decay the weights; choose one (weight_decay also works with "
        "adaptive=True)." % (kfac_kwargs["weight_decay"],))
  if "qmodel_layer_collection" in kfac_kwargs:
    raise ValueError(
        "Kfac builds the quadratic model's collection itself: pass "
        "qmodel_batch_fraction=... (the share of each batch its curvature "
        "products use) instead of qmodel_layer_collection.")
  for key in ("layer_collection", "var_list", "name"):
    if key in kfac_kwargs:
      raise ValueError("Pass %s as an argument of Kfac, not in kfac_kwargs."
                       % key)
  for key in OWNED_CORE_ARGUMENTS:
    if key in kfac_kwargs:
      raise ValueError(
          "Kfac sets %s itself: adaptive=True adapts the damping, and the "
          "damping rule evaluates model.compute_loss on the step's batch "
          "(the one fit passes, or optimizer.set_train_batch((x, y)) in a "
          "custom loop) before and after the update." % key)


def fixed_rate(adaptive, kfac_kwargs):
  """Whether adaptive=True runs the recipe with a fixed learning rate and
  momentum (momentum_type="regular"): only the damping is adapted."""
  return bool(adaptive) and kfac_kwargs.get("momentum_type") == "regular"


def check_before_base(learning_rate, adaptive, kfac_kwargs):
  """The checks that must come before the Keras base class is built."""
  _check_kwargs(kfac_kwargs)
  momentum_type = kfac_kwargs.get("momentum_type", "qmodel" if adaptive
                                  else "adam")
  if "loss_tensor" in kfac_kwargs:
    raise ValueError(
        "Kfac(loss_tensor=...) is a TF1-graph argument (a loss tensor built "
        "before the optimizer): in TF2 pass the loss to "
        "optimizer.minimize(loss, var_list) inside the tf.function; the "
        "damping rule (adaptive=True) evaluates model.compute_loss itself.")
  if fixed_rate(adaptive, kfac_kwargs):
    if not arguments.is_number(learning_rate) or isinstance(learning_rate,
                                                            bool):
      raise ValueError(
          "Kfac(adaptive=True, momentum_type='regular') takes the learning "
          "rate from you (the recipe adapts only the damping): pass "
          "learning_rate=<a number>, e.g. 0.05 (docs/keras.md), got %r."
          % (learning_rate,))
  elif adaptive:
    if learning_rate is not None:
      raise ValueError(
          "learning_rate must be None with adaptive=True, which chooses the "
          "learning rate at every step from the "
          "quadratic model: pass learning_rate=None (got %r)." %
          (learning_rate,))
    if not str(momentum_type).startswith("qmodel"):
      raise ValueError(
          "adaptive=True uses momentum_type 'qmodel' (or 'qmodel_fixedmu' "
          "with a momentum, or 'regular' with a learning_rate), got %r."
          % (momentum_type,))
    if momentum_type == "qmodel" and kfac_kwargs.get("momentum") is not None:
      raise ValueError(
          "adaptive=True (momentum_type 'qmodel') chooses the momentum too: "
          "drop momentum=%r, or pass momentum_type='qmodel_fixedmu'." %
          (kfac_kwargs["momentum"],))
  elif learning_rate is None:
    raise ValueError("Kfac needs learning_rate (adaptive=False).")
  fraction = kfac_kwargs.get("qmodel_batch_fraction")
  if fraction is not None:
    if (not arguments.is_number(fraction) or isinstance(fraction, bool) or
        not 0 < fraction <= 1):
      raise ValueError("Kfac's qmodel_batch_fraction must be a number in "
                       "(0, 1] (the share of each batch the quadratic "
                       "model's curvature products use), got %r."
                       % (fraction,))
    if not str(momentum_type).startswith("qmodel"):
      raise ValueError(
          "qmodel_batch_fraction is used by the quadratic model only "
          "(adaptive=True, or momentum_type 'qmodel' / 'qmodel_fixedmu'); "
          "got momentum_type=%r." % (momentum_type,))
  if arguments.is_number(learning_rate):
    arguments.check("Kfac", "learning_rate", learning_rate,
                    arguments.NON_NEGATIVE)


def with_recipe_defaults(damping, adaptive, kfac_kwargs):
  """(damping, kfac_kwargs) with the default recipe's values filled in where
  adaptive=True and the user left them out (kfac/python/ops/adaptive/recipe,
  docs/recipe.md)."""
  kfac_kwargs = dict(kfac_kwargs)
  if adaptive:
    kfac_kwargs.setdefault("relative_min_damping",
                           recipe.RELATIVE_MIN_DAMPING)
    kfac_kwargs.setdefault("cov_update_every", recipe.COV_UPDATE_EVERY)
    if damping is None:
      damping = recipe.INITIAL_DAMPING
      if not fixed_rate(adaptive, kfac_kwargs):
        # (With a fixed learning rate the calibration judges a single step
        # without its momentum, and chose dampings 100x too large:
        # docs/recipe.md.)
        kfac_kwargs.setdefault("calibrate_damping", True)
        if "num_burnin_steps" not in kfac_kwargs:
          kfac_kwargs["num_burnin_steps"] = recipe.NUM_BURNIN_STEPS
          # (A num_burnin_steps of the user's calibrates on all of them,
          # unless num_calibration_steps says otherwise.)
          if kfac_kwargs["calibrate_damping"]:
            kfac_kwargs.setdefault("num_calibration_steps",
                                   recipe.NUM_CALIBRATION_STEPS)
  return damping, kfac_kwargs


CONSTRUCTOR_DOC = """K-FAC as a Keras optimizer.

  Args:
    learning_rate: the step size (a float; change it with
      `optimizer.learning_rate = ...` or kfac.keras.callbacks).
    damping: Tikhonov damping added to the Fisher blocks (a float, kept in a
      variable like learning_rate). With adaptive=True it is the initial
      damping and may be left out: the default recipe then starts from 1.0
      and calibrates it during 5 burn-in steps, in which the weights do not
      move (calibrate_damping=True, num_burnin_steps=5; the first only
      gathers statistics, the other 4 try the step: num_calibration_steps=4).
    model: the Keras model to train (its layers are watched from now on).
    loss: the model's Keras loss(es) (default: the loss given to compile).
    loss_weights: per-output loss coefficients (as in compile).
    fisher_approx: {layer name or layer class: approximation name}.
    layer_collection: not supported (the collection is built from the
      model); must be None.
    adaptive: True: the default recipe (docs/recipe.md): learning rate
      and momentum from the quadratic model (momentum_type "qmodel"),
      damping adapted by the Levenberg-Marquardt rule and never below
      relative_min_damping=0.1 times the curvature scale (pass
      learning_rate=None; see the module docstring). With
      momentum_type="regular" and a learning_rate (and momentum, default
      0.9): the recipe with that fixed rate and momentum, only the damping
      adapted (docs/keras.md: better on keras.applications convnets with
      depthwise convolutions, and no curvature products). Its losses are
      registered at the scale of the Keras loss (coefficient: loss weight /
      outputs per example Keras averages over); without adaptive, as in
      kfac 0.2.x, with the loss weight (docs/keras.md, "Coefficients").
    train_batch: the batch the damping rule evaluates, (x, y) or (x, y,
      sample_weight) or a callable returning one (default: fit's batch;
      custom loops call set_train_batch in the step).
    name: the optimizer's name (also the prefix of its state variables).
    seed: seed of the sampled targets (default: TensorFlow's global seed
      when one is set, else 0; kept in the config and in checkpoints).
    weight_decay: AdamW's decoupled weight decay (default None: none), as
      Keras's optimizers apply it: every trainable variable w that
      `optimizer.exclude_from_weight_decay(var_list=..., var_names=...)`
      does not exclude gets w <- w - lr * wd * w once per step, lr being
      the step's learning rate (adaptive=True: the one the quadratic model
      chose for this step). It is not preconditioned and enters neither the
      momentum nor the quadratic model nor the damping rule's predicted
      change (kfac/python/ops/optimizers/weight_decay.py says why this
      step's rate). A variable like damping: `optimizer.weight_decay = ...`
      or a kfac.keras.callbacks schedule changes it between steps. Not with
      use_weight_decay=True.
    **kfac_kwargs: registration_options={layer name or class: {option:
      value}} (convolution statistics options: sub_sample_inputs,
      sub_sample_patches, patch_mask; DepthwiseConv2D: sub_sample_patches),
      and the arguments of
      kfac.PeriodicInvCovUpdateKfacOpt
      (momentum, momentum_type, invert_every, cov_update_every,
      num_burnin_steps, calibrate_damping, num_calibration_steps,
      cov_ema_decay, estimation_mode,
      norm_constraint, use_weight_decay and weight_decay_coeff (kfac
      0.2.x's weight decay: not with weight_decay), l2_reg,
      precon_damping_mult, damping_adaptation_interval, min_damping, ...).
  """
