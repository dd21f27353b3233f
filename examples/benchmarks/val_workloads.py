"""Workloads and optimizers of keras_validation.py (the Keras
validation-accuracy benchmark).

Workloads, all on Fashion-MNIST (keras.datasets.fashion_mnist.load_data();
`make data` puts the Debian copy where Keras finds it offline): a fixed
seeded subset of the training images for training, the 10,000 test images
for validation.

  cnn          a small residual CNN with batch norm (momentum 0.9): conv 32
               (stride 2) + BN + ReLU, a residual 3x3 conv + BN + ReLU block at 32 channels,
               a strided conv to 64 channels + BN + ReLU, a residual block at
               64 channels, global average pooling, Dense 10
  vit          a small ViT: 7x7 patches (16 tokens) by a strided Conv2D,
               width 64, a learned position embedding, 2 blocks of
               LayerNorm + MultiHeadAttention (4 heads) + LayerNorm + MLP
               (128, gelu), LayerNorm, average pooling, Dense 10
  rnn          GRU(128) over the 28 image rows, Dense 10
  autoencoder  the K-FAC paper's deep autoencoder 784-1000-500-250-30-250-
               500-1000-784 (tanh, a linear code layer, logits out), the
               sigmoid cross-entropy reconstruction loss (Keras's
               binary_crossentropy: the mean over the 784 pixels)

The classifiers are judged by validation accuracy (higher is better), the
autoencoder by its validation reconstruction loss (lower is better).

Optimizers: `kfac` is the default recipe, kfac.keras.optimizers.Kfac(
model=model, adaptive=True), untouched; KFAC_VARIANTS names recipe
ablations as Kfac keyword arguments. The peers are the optimizers Keras
3.15 ships, each with a small learning-rate grid (GRIDS) around its Keras
default or common value; the other arguments are Keras's defaults except
where PEER_NOTES says.
"""

import numpy as np

WORKLOADS = ("cnn", "vit", "rnn", "autoencoder")
PEERS = ("adam", "adamw", "lion", "muon", "schedulefree")

# Learning-rate grids of the peers (make bench-tune runs them all; the
# middle value is what a run uses for a (workload, optimizer) that the
# tuned JSON does not have).
GRIDS = {
    "adam": (3e-4, 1e-3, 3e-3),          # Keras default 1e-3
    "adamw": (3e-4, 1e-3, 3e-3),         # Keras default 1e-3, wd 4e-3
    "lion": (1e-4, 3e-4, 1e-3),          # Keras default 1e-3
    "muon": (1e-3, 3e-3, 1e-2),          # Keras default 1e-3
    "schedulefree": (1e-3, 2.5e-3, 5e-3),  # Keras default 2.5e-3
    "kfac_minibatch": (0.02, 0.05, 0.1),  # the fixed-rate recipe's 0.05
    "kfac_minibatch_decay95": (0.02, 0.05, 0.1),
    "kfac_minibatch_ema": (0.02, 0.05, 0.1),
    "kfac_minibatch_linear": (0.02, 0.05, 0.1),
    "kfac_minibatch_keras_ema": (0.02, 0.05, 0.1),
    "kfac_minibatch_keras_ema_warmup": (0.02, 0.05, 0.1),
}

PEER_NOTES = {
    "adamw": "keras.optimizers.AdamW(learning_rate), Keras's default "
             "weight_decay=0.004",
    "lion": "keras.optimizers.Lion(learning_rate), Keras's default "
            "betas (0.9, 0.99)",
    "muon": "keras.optimizers.Muon(learning_rate, exclude_layers=['head']): "
            "Keras applies its Newton-Schulz step to 2-D kernels only; every "
            "other variable (conv kernels, which are 4-D, biases, "
            "batch/layer-norm scales, the position embedding) and the "
            "excluded output layer 'head' get its AdamW step (adam_lr_ratio="
            "1, adam_weight_decay 0.004); on the CNN that is every conv "
            "kernel, so Muon is nearly AdamW there",
    "schedulefree": "keras.optimizers.ScheduleFreeAdamW(learning_rate), "
                    "warmup_steps=0 (Keras's default); evaluated at its "
                    "averaged point x, with the batch-norm statistics "
                    "recomputed there (see schedule_free_eval)",
}

# Recipe ablations: name -> Kfac keyword arguments on top of
# Kfac(model=model, adaptive=True).
KFAC_VARIANTS = {
    "kfac": {},
    # The quadratic model's momentum unbounded (kfac 0.2.x's solve; the
    # recipe bounds it by 1: docs/recipe.md, "The momentum bound").
    "kfac_unbounded": {"qmodel_momentum_bound": None},
    "kfac_wd": {"weight_decay": 1e-4},
    "kfac_wd3": {"weight_decay": 1e-3},
    "kfac_l2": {"l2_reg": 1e-5},
    "kfac_damping_1e-2": {"damping": 1e-2},
    # The automatic recipe: exact until the measured gradient noise scale
    # passes the batch size, then the minibatch recipe at its default
    # learning rate (docs/recipe.md, "The automatic recipe").
    "kfac_auto": {"recipe": "auto"},
    "kfac_auto_lr05": {"recipe": "auto", "minibatch_learning_rate": 0.05},
    "kfac_auto_r01": {"recipe": "auto", "auto_switch_ratio": 0.1},
    # The recipe before its first burn-in step gathered statistics only.
    "kfac_calibrate_all": {"num_calibration_steps": 5},
    # Large batches (docs/large_batch.md): few steps to the target, so
    # inverses every step and statistics that forget faster.
    "kfac_invert1": {"invert_every": 1},
    "kfac_invert1_decay80": {"invert_every": 1, "cov_ema_decay": 0.8},
    # The levers together, and the convolutions' input statistics on a
    # fifth of the batch (sub_sample_inputs: inputs_to_extract_patches_factor
    # 0.2 of the examples).
    "kfac_damping_1e-2_qmodel_quarter": {"damping": 1e-2,
                                         "qmodel_batch_fraction": 0.25},
    "kfac_damping_1e-2_invert1_decay80": {"damping": 1e-2, "invert_every": 1,
                                          "cov_ema_decay": 0.8},
    "kfac_conv_stats_fifth": {"registration_options": {
        "__class__:Conv2D": {"sub_sample_inputs": True}}},
    # The default recipe on a growing batch (BATCH_GROWTH).
    "kfac_grow8x": {},
    "kfac_qmodel_half": {"qmodel_batch_fraction": 0.5},
    "kfac_qmodel_quarter": {"qmodel_batch_fraction": 0.25},
    "kfac_qmodel_eighth": {"qmodel_batch_fraction": 0.125},
    # The recipe at a fixed rate and momentum (only the damping adapted).
    "kfac_fixed_rate": {"momentum_type": "regular", "learning_rate": 0.05,
                        "momentum": 0.9},
    # The minibatch recipe's damping (docs/recipe.md, "The minibatch
    # recipe's damping"): kfac 0.2.x's decay with a higher floor, and the
    # recipe's decay from a lower initial damping.
    "kfac_minibatch_decay95_floor1": {
        "recipe": "minibatch", "learning_rate": 0.05,
        "damping_adaptation_decay": 0.95, "relative_min_damping": 1.0},
    "kfac_minibatch_decay95_floor3": {
        "recipe": "minibatch", "learning_rate": 0.05,
        "damping_adaptation_decay": 0.95, "relative_min_damping": 3.0},
    "kfac_minibatch_damping1e-2": {"recipe": "minibatch",
                                   "learning_rate": 0.05, "damping": 1e-2},
    "kfac_minibatch_damping1e-3": {"recipe": "minibatch",
                                   "learning_rate": 0.05, "damping": 1e-3},
}
# Growing batches (Martens & Grosse grew theirs): name -> (factor, steps):
# the run's batch B starts at B / factor and grows geometrically to B over
# its first `steps` steps (keras_validation.batch_sizes).
BATCH_GROWTH = {"kfac_grow8x": (8, 30)}


def batch_sizes(name, batch, steps):
  """The batch of each of `steps` steps of optimizer `name` at batch
  `batch`: `batch` throughout, or BATCH_GROWTH's geometric growth."""
  if name not in BATCH_GROWTH:
    return [batch] * steps
  factor, grow = BATCH_GROWTH[name]
  first = max(1, batch // factor)
  return [batch if t >= grow else int(round(
      first * (batch / float(first)) ** (t / float(grow))))
          for t in range(steps)]


# K-FAC recipes that take a learning rate, tuned on a grid as the peers
# are: Kfac(model=..., adaptive=True, recipe="minibatch", learning_rate=v).
# kfac_minibatch_decay95: the recipe with kfac 0.2.x's damping decay 0.95
# (what it had before recipe.MINIBATCH_DAMPING_DECAY; docs/recipe.md).
# kfac_minibatch_ema: the minibatch recipe evaluated at an exponential
# moving average of its weights (WeightAverage; the averaging Schedule-Free
# does, taken as Polyak averaging on top of the recipe).
# kfac_minibatch_linear: the minibatch recipe with its learning rate decayed
# linearly over the run's training budget (linear_decay: the schedule
# kfac-jax's and AlgoPerf's fixed-budget runs use, on the budget's clock).
# kfac_minibatch_keras_ema: averaging done by Kfac itself (Kfac(use_ema=
# True), Keras's fixed ema_momentum 0.99, updated inside the traced step),
# evaluated at the optimizer's average (OptimizerAverage);
# kfac_minibatch_keras_ema_warmup: the same with ema_warmup=True (decay
# min(0.99, (1 + t) / (10 + t)), WeightAverage's rule).
TUNED_KFAC = ("kfac_minibatch", "kfac_minibatch_decay95",
              "kfac_minibatch_ema", "kfac_minibatch_linear",
              "kfac_minibatch_keras_ema", "kfac_minibatch_keras_ema_warmup")
# The smallest fraction of its rate kfac_minibatch_linear decays to.
LINEAR_DECAY_FLOOR = 1e-3
# Decay of kfac_minibatch_ema's average (Keras's ema_momentum default).
EMA_DECAY = 0.99


def linear_decay(name, value, used, budget):
  """The learning rate of `name` (grid value `value`) after `used` of
  `budget` training seconds: value * (1 - used / budget), at least
  LINEAR_DECAY_FLOOR * value, for kfac_minibatch_linear; None for the
  others (their rate stays)."""
  if not name.endswith("_linear"):
    return None
  return value * max(LINEAR_DECAY_FLOOR, 1.0 - used / budget)


def weight_average(name, model, optimizer):
  """What `name` is evaluated at when not at its weights: a WeightAverage
  of the model's weights (kfac_minibatch_ema), the optimizer's own
  average (kfac_minibatch_keras_ema: OptimizerAverage), else None."""
  if "_keras_ema" in name:
    return OptimizerAverage(optimizer, model)
  if name.endswith("_ema"):
    return WeightAverage(model)
  return None


class OptimizerAverage(object):
  """The moving average a Keras optimizer with use_ema=True keeps (the
  one keras.callbacks.SwapEMAWeights evaluates at), in WeightAverage's
  interface (before the optimizer's first step: the model's weights); the
  optimizer updates it in its step (`update` does nothing)."""

  def __init__(self, optimizer, model):
    self.optimizer, self.model = optimizer, model

  @property
  def vars(self):
    if not self.optimizer.built:
      return list(self.model.trainable_variables)
    return list(self.optimizer._trainable_variables)  # pylint: disable=protected-access

  def values(self):
    if not self.optimizer.built:
      return [v.numpy() for v in self.model.trainable_variables]
    return [a.numpy() for a in
            self.optimizer._model_variables_moving_average]  # pylint: disable=protected-access

  def update(self):
    pass


class WeightAverage(object):
  """An exponential moving average of a model's trainable weights, updated
  by `update()` after each step with decay min(decay, (1 + t) / (10 + t))
  at the t-th update (so that the first updates are not pulled towards the
  initial weights); `values()` gives the averages as numpy arrays."""

  def __init__(self, model, decay=EMA_DECAY):
    import tensorflow as tf
    self.decay = decay
    self.vars = list(model.trainable_variables)
    self.avg = [tf.Variable(tf.convert_to_tensor(v), trainable=False)
                for v in self.vars]
    self.count = tf.Variable(0.0, trainable=False)

    @tf.function
    def update():
      t = self.count
      d = tf.minimum(tf.constant(decay, tf.float32), (1.0 + t) / (10.0 + t))
      for a, v in zip(self.avg, self.vars):
        a.assign(d * a + (1.0 - d) * tf.cast(v, a.dtype))
      self.count.assign_add(1.0)

    self.update = update

  def values(self):
    return [a.numpy() for a in self.avg]


def kfac_statistics_elements(opt):
  """The elements of the factor statistics a Kfac optimizer all-reduces at
  each statistics update under a strategy (symmetric square statistics as
  their upper triangles, as kfac's packed collective sends them), counted
  from its layer collection after a traced step; None for other
  optimizers or before the first step."""
  engine = getattr(opt, "_kfac_engine", None)
  report = getattr(engine, "report", None)
  if report is None:
    return None
  count = 0
  for factor in report[2].get_factors():
    shape = [int(d) for d in factor.cov_shape]
    if len(shape) == 2 and shape[0] == shape[1]:
      count += shape[0] * (shape[0] + 1) // 2
    else:
      n = 1
      for d in shape:
        n *= d
      count += n
  return count


def worker_result(argv, lock):
  """Runs one benchmark worker process (argv: its command), printing its
  "PROGRESS " lines under `lock` as they come; its "RESULT " line's JSON,
  or {"error": its last stderr line} when it wrote none."""
  import json
  import subprocess
  proc = subprocess.Popen(argv, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  result = None
  for line in proc.stdout:
    if line.startswith("PROGRESS "):
      with lock:
        print(line[len("PROGRESS "):].rstrip(), flush=True)
    elif line.startswith("RESULT "):
      result = json.loads(line[len("RESULT "):])
  stderr = proc.stderr.read()
  proc.wait()
  if result is None:
    tail = [l for l in stderr.strip().splitlines() if l.strip()][-1:]
    result = {"error": " | ".join(tail) or "exit %d" % proc.returncode}
  return result


def run_jobs(job_list, spawn, parallel, report):
  """Runs spawn(job, lock) for every job, `parallel` (at most 2) at a
  time, in order, printing report(result) under the lock as each ends;
  the results in the jobs' order."""
  import threading
  results = [None] * len(job_list)
  lock, nxt = threading.Lock(), [0]

  def loop():
    while True:
      with lock:
        k = nxt[0]
        nxt[0] += 1
      if k >= len(job_list):
        return
      r = results[k] = spawn(job_list[k], lock)
      with lock:
        print(report(r), flush=True)

  threads = [threading.Thread(target=loop)
             for _ in range(max(1, min(2, parallel)))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return results


def one_thread_run(workload, size, train_examples, val_examples, seed=0):
  """(x, y, x_val, y_val, model, loss) of a single run pinned to one
  TensorFlow thread with Keras seeded (the trace programs' set-up)."""
  import keras
  import tensorflow as tf
  tf.config.threading.set_intra_op_parallelism_threads(1)
  tf.config.threading.set_inter_op_parallelism_threads(1)
  keras.utils.set_random_seed(seed)
  x, y, x_val, y_val = load(workload, train_examples, val_examples, seed)
  return x, y, x_val, y_val, build(workload, size), loss(workload)


def is_loss_metric(workload):
  """True when the validation metric is a loss (lower is better)."""
  return workload == "autoencoder"


def metric_name(workload):
  return "val loss" if is_loss_metric(workload) else "val acc"


def better(workload, a, b):
  """True when metric value a is at least as good as b."""
  return a <= b if is_loss_metric(workload) else a >= b


def load(workload, train_examples, val_examples, seed=0):
  """(x_train, y_train, x_val, y_val) of one workload, float32 in [0, 1]."""
  import keras
  try:
    (x, y), (vx, vy) = keras.datasets.fashion_mnist.load_data()
  except Exception as e:  # pylint: disable=broad-except
    raise RuntimeError(
        "keras_validation needs Fashion-MNIST: run `make data` (it copies "
        "the Debian package dataset-fashion-mnist where "
        "keras.datasets.fashion_mnist.load_data() finds it offline); "
        "loading failed with %s: %s" % (type(e).__name__, e))
  order = np.random.RandomState(seed).permutation(len(x))[:train_examples]
  x, y = x[order], y[order]
  vx, vy = vx[:val_examples], vy[:val_examples]
  def prep(images):
    images = images.astype("float32") / 255.0
    if workload in ("cnn", "vit"):
      return images[..., None]
    if workload == "autoencoder":
      return images.reshape(len(images), -1)
    return images  # rnn: [batch, 28 rows, 28 pixels]
  x, vx = prep(x), prep(vx)
  if workload == "autoencoder":
    return x, x, vx, vx
  return x, y.astype("int32"), vx, vy.astype("int32")


def _position_layer():
  """A Keras layer class adding a learned position embedding (built here so
  that importing this module does not import Keras)."""
  from keras import layers
  from keras import ops

  class PositionEmbedding(layers.Layer):
    """x [batch, T, D] + Embedding(T, D)(arange(T))."""

    def __init__(self, length, dim, **kwargs):
      super().__init__(**kwargs)
      self.length, self.dim = length, dim
      self.position = layers.Embedding(length, dim, name="position")

    def call(self, x):
      return x + self.position(ops.arange(self.length))

    def get_config(self):
      return dict(super().get_config(), length=self.length, dim=self.dim)

  return PositionEmbedding


def build(workload, size="full"):
  """The Keras model of a workload (logits out; the last layer is 'head')."""
  import keras
  from keras import layers
  tiny = size == "tiny"
  if workload == "cnn":
    c1, c2 = (4, 8) if tiny else (32, 64)
    inputs = keras.Input((28, 28, 1))
    def conv_bn(x, ch, stride=1):
      x = layers.Conv2D(ch, 3, strides=stride, padding="same",
                        use_bias=False)(x)
      # momentum 0.9 (PyTorch's 0.1), not Keras's 0.99: these activations'
      # variances are ~1e-2, and with 0.99 the moving variance keeps its
      # initial 1 for hundreds of steps (measured: validation accuracy
      # 0.19 after 312 Adam steps that reached 0.85 in training).
      return layers.ReLU()(layers.BatchNormalization(momentum=0.9)(x))
    x = conv_bn(inputs, c1, 2)                       # 14x14x32
    x = layers.Add()([x, conv_bn(x, c1)])            # residual block
    x = conv_bn(x, c2, 2)                            # 7x7x64
    x = layers.Add()([x, conv_bn(x, c2)])            # residual block
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(10, name="head")(x), name="cnn")
  if workload == "vit":
    dim, heads = (8, 2) if tiny else (64, 4)
    inputs = keras.Input((28, 28, 1))
    x = layers.Conv2D(dim, 7, strides=7)(inputs)     # 4x4 patches of 7x7
    x = layers.Reshape((16, dim))(x)
    x = _position_layer()(16, dim)(x)
    for _ in range(2):
      y = layers.LayerNormalization(epsilon=1e-6)(x)
      y = layers.MultiHeadAttention(heads, dim // heads)(y, y)
      x = layers.Add()([x, y])
      y = layers.LayerNormalization(epsilon=1e-6)(x)
      y = layers.Dense(2 * dim, activation="gelu")(y)
      x = layers.Add()([x, layers.Dense(dim)(y)])
    x = layers.LayerNormalization(epsilon=1e-6)(x)
    x = layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, layers.Dense(10, name="head")(x), name="vit")
  if workload == "rnn":
    inputs = keras.Input((28, 28))
    x = layers.GRU(8 if tiny else 128)(inputs)
    return keras.Model(inputs, layers.Dense(10, name="head")(x), name="rnn")
  if workload == "autoencoder":
    sizes = (16, 8, 4) if tiny else (1000, 500, 250, 30)
    inputs = keras.Input((784,))
    x = inputs
    for width in sizes[:-1]:
      x = layers.Dense(width, activation="tanh")(x)
    x = layers.Dense(sizes[-1], name="code")(x)      # linear code layer
    for width in sizes[-2::-1]:
      x = layers.Dense(width, activation="tanh")(x)
    return keras.Model(inputs, layers.Dense(784, name="head")(x),
                       name="autoencoder")
  raise ValueError("unknown workload %r; one of %s" % (workload,
                                                         ", ".join(WORKLOADS)))


def loss(workload):
  import keras
  if workload == "autoencoder":
    return keras.losses.BinaryCrossentropy(from_logits=True)
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def metrics(workload):
  return [] if workload == "autoencoder" else ["accuracy"]


def optimizer_names():
  return tuple(KFAC_VARIANTS) + TUNED_KFAC + PEERS


def make_optimizer(name, model, value=None):
  """The optimizer `name` for `model`; value: the peer's learning rate."""
  import keras
  if name in KFAC_VARIANTS:
    import kfac.keras  # pylint: disable=g-import-not-at-top
    kwargs = dict(KFAC_VARIANTS[name])
    if "registration_options" in kwargs:
      # "__class__:Conv2D" keys (JSON-able, as recorded with the results):
      # options for a layer class the model does not have are left out
      # (Kfac refuses keys that match no layer); on such a model the
      # variant is the default recipe.
      present = {type(layer).__name__ for layer in model._flatten_layers()}  # pylint: disable=protected-access
      kwargs["registration_options"] = {
          k: v for k, v in kwargs["registration_options"].items()
          if not k.startswith("__class__:") or k.split(":", 1)[1] in present}
    try:
      return kfac.keras.optimizers.Kfac(model=model, adaptive=True, **kwargs)
    except (TypeError, ValueError) as e:
      raise ValueError("K-FAC variant %r: Kfac(model=..., adaptive=True, "
                       "**%r) was rejected: %s" % (name, kwargs, e))
  if name not in GRIDS:
    raise ValueError("unknown optimizer %r; one of %s" % (
        name, ", ".join(optimizer_names())))
  lr = GRIDS[name][len(GRIDS[name]) // 2] if value is None else value
  if name in TUNED_KFAC:
    import kfac.keras  # pylint: disable=g-import-not-at-top
    extra = ({"damping_adaptation_decay": 0.95}
             if name == "kfac_minibatch_decay95" else
             {"use_ema": True, "ema_momentum": EMA_DECAY,
              "ema_warmup": name.endswith("_warmup")}
             if "_keras_ema" in name else {})
    return kfac.keras.optimizers.Kfac(model=model, adaptive=True,
                                      recipe="minibatch", learning_rate=lr,
                                      **extra)
  if name == "adam":
    return keras.optimizers.Adam(lr)
  if name == "adamw":
    return keras.optimizers.AdamW(lr)
  if name == "lion":
    return keras.optimizers.Lion(lr)
  if name == "muon":
    return keras.optimizers.Muon(lr, exclude_layers=["head"])
  return schedule_free_adamw_class()(lr)


def schedule_free_adamw_class():
  """keras.optimizers.ScheduleFreeAdamW with its update fixed for the
  TensorFlow backend.

  Keras 3.15.1's update_step reads `momentum_old = momentum.value` and
  then updates the slot in place; on the TensorFlow backend `.value` is the
  variable itself, not a snapshot, so the x it recovers uses the NEW z and
  the model variable becomes y_t = (1 - 1/t) y_{t-1} + z_t / t, the running
  average of z with gradients taken there (measured: 3 steps on a
  quadratic match that to 1e-7 and miss the method by 1e-2). And its build
  assigns the initial weights to z, but when `fit` builds the optimizer z
  starts at zero all the same (why was not investigated), so the first
  step sets every weight to about -lr sign(g)
  (measured on this benchmark's CNN: every kernel moved by its own size
  plus lr, the loss at log(10) ever after, training accuracy 0.099 after an
  epoch at 2.5e-3). This subclass computes the method from a snapshot of z
  taken before the update, z taken as the weights themselves at step 1 (Defazio et al. 2024, without warm-up: z <- z -
  lr g / (sqrt(v / (1 - beta_2^t)) + eps), x <- (1 - 1/t) x + z / t,
  y <- (1 - beta_1) z + beta_1 x, the gradient taken at y).
  """
  import keras
  from keras import ops

  class ScheduleFreeAdamW(keras.optimizers.ScheduleFreeAdamW):
    """ScheduleFreeAdamW whose x is recovered from z before z's update."""

    def update_step(self, gradient, variable, learning_rate):
      dtype = variable.dtype
      lr = ops.cast(learning_rate, dtype)
      gradient = ops.cast(gradient, dtype)
      t = ops.cast(self.iterations + 1, dtype)
      beta_1 = ops.cast(self.beta_1, dtype)
      beta_2 = ops.cast(self.beta_2, dtype)
      if self.warmup_steps > 0:
        lr = lr * ops.minimum(t / ops.cast(self.warmup_steps, dtype), 1.0)
      index = self._get_variable_index(variable)
      z_var, v_var = self._momentums[index], self._velocities[index]
      # z and x of the previous step, read before any update; z starts at
      # the initial weights (see the class docstring).
      y_old = ops.convert_to_tensor(variable)
      z_old = ops.where(ops.equal(self.iterations, 0), y_old,
                        ops.convert_to_tensor(z_var))
      x_old = (y_old - (1.0 - beta_1) * z_old) / beta_1
      v_new = beta_2 * ops.convert_to_tensor(v_var) + (
          1.0 - beta_2) * ops.square(gradient)
      denom = ops.sqrt(v_new / (1.0 - ops.power(beta_2, t))) + ops.cast(
          self.epsilon, dtype)
      z_new = z_old - lr * gradient / denom
      x_new = (1.0 - 1.0 / t) * x_old + z_new / t
      self.assign(v_var, v_new)
      self.assign(z_var, z_new)
      self.assign(variable, (1.0 - beta_1) * z_new + beta_1 * x_new)

  return ScheduleFreeAdamW


class schedule_free_eval(object):  # pylint: disable=invalid-name
  """Context: the model's weights at ScheduleFreeAdamW's evaluation point.

  Keras 3.15's ScheduleFreeAdamW keeps the model variables at the
  interpolation y = (1 - beta_1) z + beta_1 x, where z (its `momentum`
  slot) takes the gradient steps and x is the running average the method
  is meant to be evaluated at (Defazio et al. 2024); Keras has no switch
  to the evaluation weights, so evaluating the model as it stands judges
  y. Inside the context every variable with a slot holds
  x = (y - (1 - beta_1) z) / beta_1, and the batch-norm moving statistics
  are recomputed at x (a forward pass in training mode over `bn_batches`,
  as a cumulative average); on exit y and the moving statistics that
  training left are restored. With `average` (a WeightAverage) the
  weights are its averages instead, whatever the optimizer, with the
  batch-norm statistics recomputed the same way. Does nothing for other
  optimizers without one.
  """

  def __init__(self, model, optimizer, bn_batches=(), average=None):
    self.model, self.opt, self.bn_batches = model, optimizer, bn_batches
    self.average = average
    self.saved = []

  def __enter__(self):
    import keras
    if self.average is not None:
      # A WeightAverage: the model evaluated at its averages.
      for var, avg in zip(self.average.vars, self.average.values()):
        self.saved.append((var, np.array(var.numpy())))
        var.assign(avg)
      self._recompute_batch_norm()
      return self
    if not isinstance(self.opt, keras.optimizers.ScheduleFreeAdamW):
      return self
    if not self.opt.built:
      return self
    beta_1 = float(self.opt.beta_1)
    for var in self.model.trainable_variables:
      z = self.opt._momentums[self.opt._get_variable_index(var)]  # pylint: disable=protected-access
      y = np.array(var.numpy())
      self.saved.append((var, y))
      var.assign((y - (1.0 - beta_1) * np.array(z.numpy())) / beta_1)
    self._recompute_batch_norm()
    return self

  def _recompute_batch_norm(self):
    import keras
    bns = [l for l in self.model._flatten_layers()  # pylint: disable=protected-access
           if isinstance(l, keras.layers.BatchNormalization)]
    if bns and len(self.bn_batches):
      for bn in bns:
        for v in (bn.moving_mean, bn.moving_variance):
          self.saved.append((v, np.array(v.numpy())))
      momenta = [bn.momentum for bn in bns]
      for k, batch in enumerate(self.bn_batches):
        for bn in bns:
          bn.momentum = k / (k + 1.0)  # cumulative average of the batches
        self.model(batch, training=True)
      for bn, m in zip(bns, momenta):
        bn.momentum = m

  def __exit__(self, *unused):
    for var, value in self.saved:
      var.assign(value)
    self.saved = []
    return False
