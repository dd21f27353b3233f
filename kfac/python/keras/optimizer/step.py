"""The Keras Kfac optimizer's step inside the traced train step: the
model's LayerCollection for this trace (registered from the layers the
forward pass recorded, with the compiled or given losses), the batch and
loss the damping rule evaluates, the core K-FAC update, and the TensorBoard
scalars after it: KerasStep, a part of the engine (engine.KfacEngine)."""

import contextlib
import warnings

import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from kfac.python.keras import keras_flavor
from kfac.python.keras import layer_recorder
from kfac.python.keras import utils as keras_utils
from kfac.python.keras.optimizer import losses
from kfac.python.ops.adaptive import recipe
from kfac.python.ops.collection import layer_collection as lc_lib
from kfac.python.ops.distribute import collective
from kfac.python.ops.tensors import utils as kfac_utils


class KerasStep:
  """The per-trace work of the Keras Kfac optimizer: `apply` builds one
  K-FAC step in the traced train step; `loss_fn` is the damping rule's
  loss, `decays` the weight decay's mask (both given to the core)."""

  def __init__(self, engine):
    self._engine = engine
    self._warned = set()
    self._step_batch = None  # (graph, batch) given by set_train_batch
    self._decay_choice = {}  # Keras variable ref -> decays (this trace)

  # -------------------------------------------------------------- adaptive
  def set_train_batch(self, train_batch):
    """The batch (x, y) or (x, y, sample_weight) the damping rule evaluates
    (adaptive=True or calibrate_damping=True) in a custom tf.function loop:
    call it in the step, before apply_gradients. model.fit needs no call."""
    self._step_batch = (current_graph(), train_batch)

  def _batch(self):
    """(x, y, sample_weight) of this step for the damping rule."""
    pending = self._step_batch
    batch = None
    if pending is not None and pending[0] is current_graph():
      batch = pending[1]
    elif self._engine.train_batch is not None:
      batch = self._engine.train_batch
    if callable(batch):
      batch = batch()
    if batch is None:
      recorded = layer_recorder.recorder_for(self._engine.model).loss_args()
      if recorded is None or recorded.get("x") is None:
        raise ValueError(
            "Kfac's damping rule (adaptive=True / calibrate_damping=True) "
            "evaluates the loss on the step's batch, but none was found: in "
            "a custom loop call optimizer.set_train_batch((x, y)) in the "
            "step, before apply_gradients.")
      return (recorded["x"], recorded.get("y"),
              recorded.get("sample_weight"))
    batch = tuple(batch)
    if len(batch) not in (2, 3):
      raise ValueError("train_batch must be (x, y) or (x, y, sample_weight), "
                       "got %d elements." % len(batch))
    return batch if len(batch) == 3 else batch + (None,)

  def _training_loss(self, batch, replicas):
    """The training forward pass's own loss (model.compute_loss in this
    trace) when it is loss_fn(batch) before the update: computed on
    this very batch, Keras 3 (whose random layers draw from seed states,
    which loss_fn replays: same masks), one replica; else None, and
    the damping rule evaluates loss_fn(batch) before the update.
    Saves a forward pass of the model, in the graph and on each step that
    evaluates the loss (adaptation and burn-in steps)."""
    if replicas > 1 or keras_flavor.legacy_keras_active():
      return None  # tf_keras's default dropout is not replayed
    recorded = layer_recorder.recorder_for(self._engine.model).loss_args()
    if not recorded or recorded.get("loss") is None:
      return None
    same = all(recorded.get(name) is value for name, value in zip(
        ("x", "y", "sample_weight"), batch))
    return recorded["loss"] if same else None

  def loss_fn(self, batch):
    """The training loss on `batch` with the dropout masks of the step's
    training forward pass, leaving the model's state as it was (see the
    package docstring)."""
    x, y, sample_weight = batch
    model = self._engine.model

    def loss():
      y_pred = model(x, training=True)
      return model.compute_loss(x=x, y=y, y_pred=y_pred,
                                sample_weight=sample_weight)
    return self._stateless(loss)

  def _stateless(self, compute):
    """compute() -- a training-mode call of the model, unrecorded -- run
    with the random layers' seed states of the step's training forward pass
    and the model's state restored after it; its output (a structure of
    tensors) once restored."""
    model = self._engine.model
    recorder = layer_recorder.recorder_for(model)
    state = keras_flavor.state_variables(model)
    known = {v.ref() for v in state}
    replay = recorder.random_states()
    state += [v for v, _ in replay if v.ref() not in known]
    saved = [tf.identity(v.read_value()) for v in state]
    with tf.control_dependencies(saved):
      # The seed states as the training forward pass found them: the
      # evaluation draws the same masks.
      replayed = [v.assign(value, read_value=False) for v, value in replay]
    with tf.control_dependencies(saved + replayed):
      with recorder.paused():
        out = compute()
    with tf.control_dependencies(tf.nest.flatten(out)):
      restored = [v.assign(value, read_value=False)
                  for v, value in zip(state, saved)]
    with tf.control_dependencies(restored):
      return tf.nest.map_structure(tf.identity, out)

  def _qmodel_collection(self):
    """A LayerCollection with the model's losses on the first
    ceil(qmodel_batch_fraction * batch) examples of the step's batch, from
    an extra training-mode forward pass of those rows (state left as it
    was): the quadratic model's exact curvature products are taken there
    (the core's qmodel_layer_collection)."""
    x, y, _ = self._batch()
    first = tf.nest.flatten(x)[0]
    rows = tf.cast(tf.math.ceil(
        self._engine.qmodel_fraction *
        tf.cast(tf.shape(first)[0], tf.float64)), tf.int32)
    head = lambda t: t[:rows]  # pylint: disable=unnecessary-lambda-assignment
    x_rows = tf.nest.map_structure(head, x)
    y_rows = None if y is None else tf.nest.map_structure(head, y)
    model = self._engine.model
    y_pred = self._stateless(lambda: model(x_rows, training=True))
    loss, weights = self.losses()
    lc = lc_lib.LayerCollection()
    keras_utils.register_loss_pairs(
        lc, keras_utils.loss_pairs(model, loss, weights, y_pred), y_rows,
        average_over_outputs=self._engine.adaptive)
    return lc

  # -------------------------------------------------------------- the step
  def _warn(self, key, message):
    if key not in self._warned:
      self._warned.add(key)
      warnings.warn(message, UserWarning, stacklevel=4)

  def losses(self):
    """(loss, loss_weights) for the registration: those given to Kfac, or
    else those of model.compile. Given both ways, they must agree."""
    compiled, compiled_weights = losses.compiled_loss(self._engine.model)
    loss, weights = self._engine.loss, self._engine.loss_weights
    if loss is None:
      loss = compiled
    elif compiled is not None and not losses.same_losses(loss, compiled):
      raise ValueError(
          "Kfac(loss=%s) disagrees with model.compile(loss=%s): K-FAC would "
          "precondition for another loss than the one the model trains on. "
          "Give the loss once, to model.compile; Kfac(model=...) takes it "
          "from there." % (losses.describe(loss), losses.describe(compiled)))
    if weights is None:
      weights = compiled_weights
    elif (compiled_weights is not None and
          not losses.same_weights(weights, compiled_weights)):
      raise ValueError(
          "Kfac(loss_weights=%r) disagrees with model.compile(loss_weights="
          "%r). Give them once, to model.compile; Kfac(model=...) takes "
          "them from there." % (weights, compiled_weights))
    return loss, weights

  def apply(self, grads, variables, iteration, use_weight_decay):
    """One K-FAC step for Keras (grads, variables); returns the op."""
    if tf.executing_eagerly():
      raise RuntimeError(
          "Kfac needs the forward pass and the update in one traced step: "
          "model.fit with run_eagerly=True, or an eager custom loop, is not "
          "supported. Trace the step with tf.function.")
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if replicas > 1 and self._engine.adaptive:
      raise NotImplementedError(
          "Kfac(adaptive=True) under a tf.distribute strategy with %d "
          "replicas is not supported yet (it writes the chosen learning rate "
          "into the optimizer's mirrored hyperparameter inside the step). "
          "Use a fixed learning rate, or one replica." % replicas)
    if self._engine.model is None:
      raise ValueError(
          "Kfac has no model: create it with Kfac(..., model=model), call "
          "optimizer.register_model(model), or load a saved model with "
          "kfac.keras.saving_utils.load_model.")
    # Keras's LossScaleOptimizer (mixed_float16) applies this optimizer in
    # a conditional branch: the statistics' sampled backward pass must be
    # built in the graph of the forward pass, which encloses the branch.
    forward = keras_utils.forward_graph(self._engine.model)
    current = tf.compat.v1.get_default_graph()
    in_branch = forward is not None and forward is not current
    core = self._engine.core
    if in_branch and (core._momentum_type.startswith("qmodel") or  # pylint: disable=protected-access
                      core._adapt_damping or core.calibrate_damping):  # pylint: disable=protected-access
      raise NotImplementedError(
          "Kfac with the quadratic model or the damping rule (adaptive=True, "
          "momentum_type='qmodel*', adapt_damping, calibrate_damping) is not "
          "supported under Keras's LossScaleOptimizer (the mixed_float16 "
          "policy) yet: its curvature products would be taken inside the "
          "loss scaling's conditional, away from the forward pass. Use the "
          "mixed_bfloat16 policy, float32, or a fixed learning rate and "
          "damping.")
    with forward.as_default() if in_branch else contextlib.nullcontext():
      lc = self._register(variables, replicas)
      if self._engine.adaptive or self._engine.core.calibrate_damping:
        batch = self._batch()
        self._engine.core.set_train_batch(batch)
        self._engine.core.set_train_batch_loss(
            self._training_loss(batch, replicas))
      if self._engine.qmodel_fraction is not None:
        self._engine.core.set_qmodel_layer_collection(
            self._qmodel_collection())
      if in_branch:  # the sources and their gradients, built there
        self._engine.core.set_layer_collection(lc)
        self._engine.core.estimator.instantiate_variables()
    tf_vars = [keras_flavor.unwrap_variable(v) for v in variables]
    if self._engine.hyper.get("weight_decay") is not None:
      # Keras's exclude_from_weight_decay, read on the Keras variables.
      self._decay_choice = {t.ref(): bool(use_weight_decay(v))
                            for v, t in zip(variables, tf_vars)}
    op = self._engine.core.apply_gradients(list(zip(grads, tf_vars)),
                                         layer_collection=lc)
    return self._after_apply(op, iteration)

  def decays(self, variable):
    """Whether the core's `variable` decays: not excluded by
    exclude_from_weight_decay (Keras's own rule, on the Keras variable)."""
    decays = self._decay_choice.get(variable.ref())
    if decays is None:
      raise ValueError("Kfac's weight decay got the variable %s, which is "
                       "not one of the step's." % variable.name)
    return decays

  def _register(self, variables, replicas):
    """The model's LayerCollection for this trace."""
    # The samples of a step are drawn from (seed, steps taken): a step the
    # non-finite guard skipped (which Keras counts in `iterations`) does
    # not shift the samples of the steps after it.
    # The seed is K-FAC state too: a checkpoint restores it.
    seed_var = self._engine.state.get_or_create(
        "keras_sample_seed", [], tf.int64, initial_value=self._engine.seed)
    seed = tf.stack([tf.convert_to_tensor(seed_var),
                     self._engine.core.steps_taken()])
    if replicas > 1:  # each replica samples its own targets
      seed = seed + tf.stack([
          tf.cast(collective.replica_id(), tf.int64) * 1000003,
          tf.constant(0, tf.int64)])
    keras_utils.name_state_by_structure(self._engine.model)
    lc, rows, loss_lines = keras_utils.register_model_rows(
        self._engine.model, *self.losses(),
        fisher_approx=self._engine.fisher_approx, seed=seed,
        variables=variables, warn=self._warn,
        registration_options=self._engine.options,
        default_conv_options=(recipe.conv_registration_options()
                              if self._engine.adaptive else None),
        default_approx=(recipe.keras_default_approx()
                        if self._engine.adaptive else None),
        # The default recipe was tuned on the Keras loss's own scale; the
        # 0.2.x-style optimizer keeps kfac 0.2.x's coefficients.
        average_over_outputs=self._engine.adaptive)
    # Formatted when read (the memory column needs the factors, which the
    # core optimizer makes from the collection).
    self._engine.report = (rows, loss_lines, lc)
    return lc

  def _after_apply(self, op, iteration):
    """The learning rate display, warnings and summaries after the step."""
    if self._engine.adaptive and not self._engine.fixed_rate:
      # Show the learning rate the quadratic model chose.
      with tf.control_dependencies([op]):
        lr = keras_flavor.unwrap_variable(
            self._engine.learning_rate_variable())
        op = tf.group(lr.assign(tf.cast(self._engine.core.learning_rate,
                                        lr.dtype), read_value=False))
    unused = self._engine.state.unused_restored_keys
    if unused:
      self._warn("unused_state", (
          "kfac: %d restored K-FAC state values match no variable of this "
          "model (e.g. %s); they are not used. K-FAC state is keyed by "
          "variable names: give the layers explicit names when rebuilding a "
          "model in the same process." % (len(unused), unused[0])))
    with tf.control_dependencies([op]):
      self._summaries(iteration)
    return op

  def _summaries(self, iteration):
    """TensorBoard scalars when a default summary writer is active (a no-op
    otherwise, and inside XLA, which cannot compile summary writes)."""
    if kfac_utils.in_xla_context():
      return
    step = tf.cast(iteration, tf.int64)
    write_scalar("kfac/learning_rate", self._engine.learning_rate_tensor(),
                 step)
    write_scalar("kfac/skipped_steps", self._engine.core.skipped_steps, step)
    for name in ("damping", "momentum"):
      var = self._engine.hyper.get(name)
      if var is not None:
        write_scalar("kfac/" + name, var, step)
    core = self._engine.core
    if self._engine.adaptive:  # (the quadratic model's momentum)
      if "momentum" not in self._engine.hyper:
        write_scalar("kfac/momentum", core.momentum, step)
    if self._engine.adaptive or core.calibrate_damping:
      write_scalar("kfac/rho", core.rho, step)
      write_scalar("kfac/qmodel_change", core.qmodel_change, step)


def write_scalar(tag, value, step):
  """tf.summary.scalar without needing the tensorboard package: a float32
  scalar tagged for TensorBoard's scalars plugin (a no-op without a default
  writer)."""
  metadata = summary_pb2.SummaryMetadata()
  metadata.plugin_data.plugin_name = "scalars"
  tf.summary.write(tag, tf.cast(value, tf.float32), step=step,
                   metadata=metadata)


def current_graph():
  return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
