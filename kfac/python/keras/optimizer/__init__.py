"""`kfac.keras.optimizers.Kfac`: K-FAC as a Keras optimizer (this package;
kfac/python/keras/optimizers.py is the thin kfac 0.2.4 path users import).

    model.compile(optimizer=kfac.keras.optimizers.Kfac(
        learning_rate=0.1, damping=0.01, model=model,
        loss="sparse_categorical_crossentropy"), loss=...)
    model.fit(...)

How it works. Creating the optimizer with `model=` installs a recorder on the
model's layers (layer_registration). Keras traces `fit`'s train step into one
graph: the forward pass records each layer's inputs and pre-activations, and
the optimizer's update, which runs in the same graph, registers the layers
and the loss on a fresh LayerCollection (kfac.keras.utils.
get_layer_collection) and applies one `PeriodicInvCovUpdateKfacOpt` step:
statistics every `cov_update_every` steps, inverses every `invert_every`
steps, then the preconditioned update. All K-FAC state lives in the core
optimizer's StateStore, created on the first step and found again on every
retrace; it is saved by `model.save(...)` (with the Keras optimizer
variables) and by `tf.train.Checkpoint`.

Sampled targets use stateless random ops seeded with (seed, steps taken; the
seed is kept with the K-FAC state), so a run restored from a checkpoint
continues on exactly the same trajectory.

adaptive=True: the learning rate and momentum come from the quadratic model
(momentum_type "qmodel") and the damping from the Levenberg-Marquardt rule
(adapt_damping), optionally calibrated during burn-in (num_burnin_steps,
calibrate_damping=True). The rule evaluates the training loss
(`model.compute_loss` on `model(x, training=True)`) on the step's batch
before and after the update, on the function the step optimised: the
random layers draw the masks of the step's training forward pass, whose
gradient and curvature define the update and its predicted change (the
layer recorder reads the random states of the model's random layers at
the start of its training-mode call, and each evaluation sets them back
to those values: keras_flavor.random_state_variables; Keras 3: every layer
holding a keras.random.SeedGenerator (Dropout, SpatialDropout,
GaussianNoise / GaussianDropout, MultiHeadAttention's dropout, ...);
tf_keras: layers on a tf.random.Generator). Around each evaluation the
model's non-trainable and metric variables are saved and restored, so
BatchNorm statistics are updated once per step as usual and the seed
states advance once per step, as without the rule. In `fit` (Keras 3, one
replica) the loss before the update is not evaluated again: the train
step's own `compute_loss` value is that loss (step.py,
KerasStep._training_loss). Not replayed: random
ops called with seed=None (Keras 3's global seed generator) and tf_keras's
default dropout (stateful ops): there the evaluations draw other masks
than the training pass and their noise enters rho. The batch is the one `fit` passes
to `compute_loss`; a custom loop calls `optimizer.set_train_batch((x, y))`
before `apply_gradients`. After each step the learning rate the model chose
is written to `optimizer.learning_rate`.

Both Keras flavours: `Kfac` is the class of the Keras that `tf.keras`
resolves to (Keras 3, or tf_keras with TF_USE_LEGACY_KERAS=1), and, for
tf_keras in a TF1 graph, kfac 0.2.x's graph-mode class of its v1 engine
(keras/graph_optimizer.py; legacy_keras.py says why it is a class of its
own). Each is defined in source in a module that imports its Keras.

Modules: engine (KfacEngine, the K-FAC part a Keras Kfac holds: what Kfac
accepts and the default recipe's values, set-up, model, hyperparameter
variables; KfacOptimizerBase, what the Keras classes show, delegated to
their engine; KerasStep, the engine's per-trace registration and K-FAC
update), losses (compiled vs given losses), config (get_config /
from_config, saved variables), keras3 and legacy_keras (the Keras 3 and
TF2 tf_keras Kfac classes), classes (kfac_class: which class; `Kfac`).
"""
