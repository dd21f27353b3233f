r"""Milliseconds per training step of K-FAC through Keras and the core API.

Model: the CNN of examples/keras_fit_classifier.py on 28x28 images,
  Conv2D 32 3x3 relu -> MaxPool 2 -> Conv2D 64 3x3 relu -> MaxPool 2
  -> Flatten (1600) -> Dense 128 relu -> Dense 10 (softmax cross-entropy),
batch 256, Fashion-MNIST images when present (random images otherwise).
Every configuration starts from the same weights and cycles through the
same 8 batches.

Configurations:
  fit_adam          Keras model.fit with keras.optimizers.Adam (the baseline)
  fit_kfac          Keras model.fit with kfac.keras.optimizers.Kfac
  loop_kfac         Keras model, custom tf.function step, Kfac.apply_gradients
  loop_kfac_xla     the same step with tf.function(jit_compile=True)
  session_kfac      the same network written with raw tf.nn ops in a
                    tf.compat.v1 Graph, layers registered by hand on a
                    kfac.LayerCollection (register_conv2d,
                    register_fully_connected,
                    register_categorical_predictive_distribution),
                    kfac.PeriodicInvCovUpdateKfacOpt run by session.run
  function_kfac     the raw network in a TF2 tf.function: LayerCollection
                    built inside the traced step, opt.minimize(...,
                    layer_collection=lc) (docs/tf2.md)
  loop_adam, loop_adam_xla  (not run by default) the custom loop with Adam,
                    without / with XLA

K-FAC settings are the same everywhere: invert_every 10, cov_update_every 1,
momentum 0.9 (type "adam"), damping 1e-2, learning rate 1e-3, cov_ema_decay
0.95, estimation_mode "gradients" (one sampled target per example), no
sub-sampling of conv patches (the Keras optimizer has no option for it).

Each measurement is a fresh worker process: it builds the configuration,
runs --warmup_blocks untimed blocks (the first traces the step), then times
--blocks_per_round blocks of `invert_every` consecutive steps, so every
block holds exactly one K-FAC inverse update. For model.fit the steps run in
one fit call and a block is the time between Keras's on_train_batch_end
callbacks of its last step and of the previous block's last step (so fit's
own per-step overhead counts); the other loops read the loss of every step,
as training loops do (session_kfac: session.run([train_op, loss]); the
traced steps return it and the loop reads it with float(); the table below
was measured before that, with the loss read once per block). ms/step is
the median over all blocks of (block time / block length). Workers run in interleaved rounds with a rotating order, so machine
noise hits every configuration alike.

Writes keras_step_time.md (table), keras_step_time.png (bar plot) and
keras_step_time.json to --output_dir.

  python examples/benchmarks/keras_step_time.py                 # ~6 minutes
  python examples/benchmarks/keras_step_time.py --rounds=3 --blocks_per_round=4

Measured on 2 shared AMD EPYC cores (other jobs running), TF 2.21, Keras
3.15, Python 3.11, Fashion-MNIST, default flags (5 min wall):

| configuration | ms/step (median) | IQR | ratio to fit_adam | ratio to session_kfac |
|---|---:|---:|---:|---:|
| fit_adam | 83.9 | 79.0-89.4 | 1.00x | - |
| fit_kfac | 244.6 | 230.9-250.3 | 2.92x | 0.85x |
| loop_kfac | 278.2 | 251.4-281.3 | 3.32x | 0.97x |
| loop_kfac_xla | 429.9 | 421.5-440.1 | 5.13x | 1.50x |
| session_kfac | 286.4 | 276.7-291.5 | 3.42x | 1.00x |
| function_kfac | 278.7 | 277.1-280.0 | 3.32x | 0.97x |

All six K-FAC runs reach the same loss after 40 steps (0.649 on the first
batch; Adam 0.576 at lr 1e-3), so the four K-FAC paths do the same work.

* K-FAC costs about 3x an Adam step on this CNN with every statistic
  updated every step. The largest single item is the input statistic of
  the second convolution (ExtractImagePatches over 11x11 positions x 256
  images, then a [30976, 289] x [30976, 289] product); the core's
  register_conv2d(sub_sample_patches=...) would cut it, but the Keras
  optimizer has no option to pass it (convnet_classifier.py uses it).
* The Keras integration adds no overhead over the core API: model.fit +
  Kfac was 0.76-0.85x the TF1 Session time in two runs, the custom loop
  0.93-0.97x; the TF2 tf.function core path is 0.97-1.01x the Session.
* The custom loop is slower than model.fit by 1.1-1.3x for Adam as for
  K-FAC (loop_adam / fit_adam 1.19x and 1.27x in two runs; not
  investigated).
* XLA (jit_compile=True) is slower on CPU for this CNN, with Adam too:
  loop_adam_xla / loop_adam 2.5x in two runs, loop_kfac_xla / loop_kfac
  1.4-1.8x in three, plus 20-80 s of compilation in the first step.
"""

import json
import os
import platform
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import datasets
import keras_fit_classifier as fit_example
import step_time_plot  # this script's own folder

keras = tf.keras
FLAGS = flags.FLAGS

ALL_CONFIGS = ("fit_adam", "fit_kfac", "loop_kfac", "loop_kfac_xla",
               "session_kfac", "function_kfac", "loop_adam", "loop_adam_xla")
DEFAULT_CONFIGS = ALL_CONFIGS[:6]
DESCRIPTIONS = {
    "fit_adam": "Keras model.fit + Adam",
    "fit_kfac": "Keras model.fit + Kfac",
    "loop_kfac": "Keras, custom tf.function loop + Kfac",
    "loop_kfac_xla": "Keras, custom loop + Kfac, jit_compile=True",
    "session_kfac": "raw tf.nn, TF1 Session + PeriodicInvCovUpdateKfacOpt",
    "function_kfac": "raw tf.nn, TF2 tf.function + PeriodicInvCovUpdateKfacOpt",
    "loop_adam": "Keras, custom tf.function loop + Adam",
    "loop_adam_xla": "Keras, custom loop + Adam, jit_compile=True",
}
NUM_BATCHES = 8
IMAGE_SIDE = 28
NUM_CLASSES = 10

flags.DEFINE_integer("batch_size", 256, "Mini-batch size.")
flags.DEFINE_integer("invert_every", 10, "K-FAC inverse period; also the "
                     "length of a timed block.")
flags.DEFINE_integer("rounds", 2, "Interleaved rounds; each starts one "
                     "worker per configuration.")
flags.DEFINE_integer("blocks_per_round", 3, "Timed blocks per worker.")
flags.DEFINE_integer("warmup_blocks", 1, "Untimed blocks per worker (the "
                     "first one traces / compiles the step).")
flags.DEFINE_list("configs", list(DEFAULT_CONFIGS), "Which configurations "
                  "(also known: loop_adam, loop_adam_xla: the custom loop "
                  "with Adam, to separate XLA's own cost from K-FAC's).")
flags.DEFINE_list("conv_channels", ["32", "64"], "Conv channels.")
flags.DEFINE_integer("dense_units", 128, "Hidden dense units.")
flags.DEFINE_enum("data", "auto", ["auto", "random", "fashion_mnist"],
                  "Fashion-MNIST images when present ('auto'), else random "
                  "images and labels.")
flags.DEFINE_integer("seed", 0, "Seed.")
flags.DEFINE_string("output_dir", "/tmp/kfac_keras_bench", "Where to write "
                    "the table and the plot.")
flags.DEFINE_string("worker", None, "Internal: run one configuration and "
                    "print its block times as JSON.")

KFAC_SETTINGS = dict(invert_every=10, cov_update_every=1, momentum=0.9,
                     momentum_type="adam", damping=1e-2, learning_rate=1e-3,
                     cov_ema_decay=0.95, estimation_mode="gradients")
ADAM_LEARNING_RATE = 1e-3


def kfac_settings():
  return dict(KFAC_SETTINGS, invert_every=FLAGS.invert_every)


# ------------------------------------------------------------------ data
def load_batches():
  """(name, images [NUM_BATCHES, batch, 28, 28, 1], labels [NUM_BATCHES,
  batch] int64)."""
  n = NUM_BATCHES * FLAGS.batch_size
  rng = np.random.RandomState(FLAGS.seed)
  images = labels = None
  if FLAGS.data != "random":
    images = datasets.load_fashion_mnist_images(n)
    if images is None and FLAGS.data == "fashion_mnist":
      raise app.UsageError("Fashion-MNIST not found; run `make data`.")
    if images is not None and len(images) == n:
      labels = datasets.read_idx(datasets.find_fashion_mnist_file(
          "train-labels-idx1-ubyte.gz"))[:n].astype(np.int64)
  if labels is None:
    name = "random images"
    images = rng.uniform(size=(n, IMAGE_SIDE * IMAGE_SIDE)).astype(np.float32)
    labels = rng.randint(0, NUM_CLASSES, size=n).astype(np.int64)
  else:
    name = "Fashion-MNIST"
  return name, (images.reshape(NUM_BATCHES, FLAGS.batch_size, IMAGE_SIDE,
                               IMAGE_SIDE, 1),
                labels.reshape(NUM_BATCHES, FLAGS.batch_size))


def keras_model():
  return fit_example.build_model(
      (IMAGE_SIDE, IMAGE_SIDE), NUM_CLASSES, FLAGS.conv_channels,
      FLAGS.dense_units, padding="valid", batch_norm=False, seed=FLAGS.seed)


def initial_weights():
  """The Keras model's initial weights, in layer order (kernel, bias)."""
  return keras_model().get_weights()


# ------------------------------------------------------------------ raw model
_STRIDES = [1, 1, 1, 1]


def raw_forward(images, variables, layer_collection=None):
  """The CNN with tf.nn ops; registers its layers when given a collection.

  `variables`: [conv1 w, b, conv2 w, b, dense w, b, logits w, b]."""
  lc = layer_collection
  h = images
  num_convs = len(variables) // 2 - 2
  for i in range(num_convs):
    w, b = variables[2 * i], variables[2 * i + 1]
    pre = tf.nn.conv2d(h, w, strides=_STRIDES, padding="VALID") + b
    if lc is not None:
      lc.register_conv2d((w, b), _STRIDES, "VALID", h, pre)
    h = tf.nn.max_pool2d(tf.nn.relu(pre), ksize=2, strides=2,
                         padding="VALID")
  h = tf.reshape(h, [-1, int(np.prod(h.shape[1:]))])
  for i in range(num_convs, num_convs + 2):
    w, b = variables[2 * i], variables[2 * i + 1]
    pre = tf.matmul(h, w) + b
    if lc is not None:
      lc.register_fully_connected((w, b), h, pre)
    h = tf.nn.relu(pre) if i == num_convs else pre
  return h


def mean_cross_entropy(labels, logits):
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))


def make_core_kfac(layer_collection=None):
  import kfac
  return kfac.PeriodicInvCovUpdateKfacOpt(layer_collection=layer_collection,
                                          **kfac_settings())


# ------------------------------------------------------------------ runners
class TracedStepTimingMixin(object):
  """Timing of a traced train_step(images, labels) over the batches."""

  def _use_traced_step(self, train_step):
    self.train_step = train_step
    self.tf_batches = [(tf.constant(x), tf.constant(y))
                       for x, y in zip(self.images, self.labels)]
    self.step = 0

  def block_times(self, num_blocks, block):
    times = []
    for _ in range(num_blocks):
      start = time.perf_counter()
      for _ in range(block):
        # The loss read every step, as training loops do.
        float(self.train_step(*self.tf_batches[self.step % NUM_BATCHES]))
        self.step += 1
      times.append((time.perf_counter() - start) / block)
    return times


class KerasFitRunner(object):
  """model.fit over all the steps at once; block times from callbacks."""

  def __init__(self, use_kfac, weights, batches):
    import kfac
    self.images, self.labels = batches
    self.model = keras_model()
    self.model.set_weights(weights)
    if use_kfac:
      settings = kfac_settings()
      opt = kfac.keras.optimizers.Kfac(
          learning_rate=settings.pop("learning_rate"),
          damping=settings.pop("damping"), model=self.model,
          loss=fit_example.LOSS, seed=FLAGS.seed, **settings)
    else:
      opt = keras.optimizers.Adam(ADAM_LEARNING_RATE)
    self.model.compile(optimizer=opt, loss=fit_example.LOSS,
                       jit_compile=False)

  def block_times(self, num_blocks, block):
    steps = num_blocks * block
    order = np.arange(steps) % NUM_BATCHES
    ends = []

    class Clock(keras.callbacks.Callback):

      def on_train_batch_begin(self, batch, logs=None):
        if not ends:
          ends.append(time.perf_counter())

      def on_train_batch_end(self, batch, logs=None):
        ends.append(time.perf_counter())

    self.model.fit(
        self.images[order].reshape((-1,) + self.images.shape[2:]),
        self.labels[order].reshape(-1), batch_size=self.images.shape[1],
        epochs=1, shuffle=False, verbose=0, callbacks=[Clock()])
    ends = np.array(ends)
    return list((ends[block::block] - ends[:-1:block]) / block)

  def loss_value(self):
    probs = self.model(self.images[0], training=False)
    return float(tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
        self.labels[0], probs)))


class KerasLoopRunner(TracedStepTimingMixin, KerasFitRunner):
  """A custom tf.function step calling the optimizer's apply_gradients."""

  def __init__(self, use_kfac, jit_compile, weights, batches):
    super().__init__(use_kfac, weights, batches)
    model, opt = self.model, self.model.optimizer
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    @tf.function(jit_compile=jit_compile)
    def train_step(images, labels):
      with tf.GradientTape() as tape:
        loss = loss_fn(labels, model(images, training=True))
      grads = tape.gradient(loss, model.trainable_variables)
      opt.apply_gradients(zip(grads, model.trainable_variables))
      return loss

    self._use_traced_step(train_step)



class SessionRunner(object):
  """The raw network in a tf.compat.v1 Graph, K-FAC by session.run."""

  def __init__(self, weights, batches):
    import kfac
    self.images, self.labels = batches
    self.graph = tf.Graph()
    with self.graph.as_default():
      tf.compat.v1.set_random_seed(FLAGS.seed)
      self.x = tf.compat.v1.placeholder(tf.float32,
                                        (None,) + self.images.shape[2:])
      self.y = tf.compat.v1.placeholder(tf.int64, [None])
      variables = [tf.Variable(w) for w in weights]
      lc = kfac.LayerCollection()
      logits = raw_forward(self.x, variables, layer_collection=lc)
      lc.register_categorical_predictive_distribution(logits)
      self.loss = mean_cross_entropy(self.y, logits)
      opt = make_core_kfac(lc)
      self.train_op = opt.minimize(
          self.loss, var_list=variables,
          global_step=tf.compat.v1.train.get_or_create_global_step())
      init = tf.compat.v1.global_variables_initializer()
    self.graph.finalize()
    self.sess = tf.compat.v1.Session(graph=self.graph)
    self.sess.run(init)
    self.step = 0

  def block_times(self, num_blocks, block):
    times = []
    for _ in range(num_blocks):
      start = time.perf_counter()
      for _ in range(block):
        i = self.step % NUM_BATCHES
        # The loss fetched with the step, as training loops do.
        self.sess.run([self.train_op, self.loss], {self.x: self.images[i],
                                                   self.y: self.labels[i]})
        self.step += 1
      times.append((time.perf_counter() - start) / block)
    return times

  def loss_value(self):
    return float(self.sess.run(self.loss, {self.x: self.images[0],
                                           self.y: self.labels[0]}))


class FunctionRunner(TracedStepTimingMixin):
  """The raw network in a TF2 tf.function; the collection is built inside
  the traced step, the optimizer once outside (docs/tf2.md)."""

  def __init__(self, weights, batches):
    import kfac
    self.images, self.labels = batches
    tf.random.set_seed(FLAGS.seed)
    self.variables = [tf.Variable(w) for w in weights]
    variables = self.variables
    opt = make_core_kfac()

    @tf.function
    def train_step(images, labels):
      lc = kfac.LayerCollection()
      logits = raw_forward(images, variables, layer_collection=lc)
      lc.register_categorical_predictive_distribution(logits)
      loss = mean_cross_entropy(labels, logits)
      opt.minimize(loss, var_list=variables, layer_collection=lc)
      return loss

    self._use_traced_step(train_step)


  def loss_value(self):
    logits = raw_forward(self.tf_batches[0][0], self.variables)
    return float(mean_cross_entropy(self.tf_batches[0][1], logits))


def make_runner(name, weights, batches):
  if name == "fit_adam":
    return KerasFitRunner(False, weights, batches)
  if name == "fit_kfac":
    return KerasFitRunner(True, weights, batches)
  if name in ("loop_kfac", "loop_kfac_xla", "loop_adam", "loop_adam_xla"):
    return KerasLoopRunner("kfac" in name, name.endswith("_xla"), weights,
                           batches)
  if name == "session_kfac":
    return SessionRunner(weights, batches)
  if name == "function_kfac":
    return FunctionRunner(weights, batches)
  raise app.UsageError("unknown configuration %r (known: %s)" %
                       (name, ", ".join(ALL_CONFIGS)))


# ------------------------------------------------------------------ driver
def run_worker(name):
  """Builds one configuration, warms up, times blocks; prints JSON."""
  _, batches = load_batches()
  weights = initial_weights()
  start = time.perf_counter()
  runner = make_runner(name, weights, batches)
  block = FLAGS.invert_every
  num_blocks = FLAGS.warmup_blocks + FLAGS.blocks_per_round
  # model.fit runs all blocks in one call; the others go block by block.
  times = runner.block_times(num_blocks, block)
  total_s = time.perf_counter() - start
  print("WORKER_RESULT " + json.dumps(dict(
      times=times[FLAGS.warmup_blocks:], warmup=times[:FLAGS.warmup_blocks],
      loss=runner.loss_value(), total_s=total_s)), flush=True)


def spawn_worker(name):
  argv = [sys.executable, os.path.abspath(__file__), "--worker=" + name]
  for flag in ("batch_size", "invert_every", "blocks_per_round",
               "warmup_blocks", "data", "seed", "dense_units"):
    argv.append("--%s=%s" % (flag, getattr(FLAGS, flag)))
  argv.append("--conv_channels=%s" % ",".join(FLAGS.conv_channels))
  out = subprocess.run(argv, capture_output=True, text=True, check=False)
  for line in out.stdout.splitlines():
    if line.startswith("WORKER_RESULT "):
      return json.loads(line[len("WORKER_RESULT "):])
  raise RuntimeError("worker %s failed (exit %d):\n%s" % (
      name, out.returncode, out.stderr[-4000:]))


def write_plot(path, names, medians, spreads, title):
  colors = {"fit_adam": "#888888", "fit_kfac": "#1f77b4",
            "loop_kfac": "#2ca02c", "loop_kfac_xla": "#98df8a",
            "session_kfac": "#ff7f0e", "function_kfac": "#ffbb78",
            "loop_adam": "#aaaaaa", "loop_adam_xla": "#cccccc"}
  step_time_plot.write_step_time_plot(
      path, names, medians, spreads, title,
      [colors.get(n, "#555555") for n in names], label_format="%.0f")


def main(argv):
  del argv
  if FLAGS.worker:
    run_worker(FLAGS.worker)
    return
  unknown = [n for n in FLAGS.configs if n not in ALL_CONFIGS]
  if unknown:
    raise app.UsageError("unknown configurations %s (known: %s)" % (
        ", ".join(unknown), ", ".join(ALL_CONFIGS)))
  data_name, _ = load_batches()
  block = FLAGS.invert_every
  model_text = "conv 3x3 %s -> dense %d -> dense 10" % (
      "/".join(FLAGS.conv_channels), FLAGS.dense_units)
  print("CNN %s, batch %d, data: %s, TF %s, Keras %s, %d CPUs" % (
      model_text, FLAGS.batch_size, data_name, tf.__version__,
      fit_example.keras_version(), os.cpu_count()), flush=True)
  start = time.perf_counter()
  names = list(FLAGS.configs)
  times = {n: [] for n in names}
  losses, build = {}, {n: [] for n in names}
  for r in range(FLAGS.rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for name in order:
      result = spawn_worker(name)
      times[name].extend(result["times"])
      losses[name] = result["loss"]
      build[name].append(result["total_s"])
    print("round %d/%d (%.0fs): %s" % (
        r + 1, FLAGS.rounds, time.perf_counter() - start, "  ".join(
            "%s %.1f ms" % (n, 1e3 * np.median(times[n])) for n in names)),
          flush=True)

  ms = {n: 1e3 * np.array(times[n]) for n in names}
  medians = [float(np.median(ms[n])) for n in names]
  q25 = [float(np.percentile(ms[n], 25)) for n in names]
  q75 = [float(np.percentile(ms[n], 75)) for n in names]

  def ratio(name, base):
    if base not in ms:
      return "-"
    return "%.2fx" % (np.median(ms[name]) / np.median(ms[base]))

  lines = [
      "CNN %s on 28x28 images, batch %d, %s; TF %s, Keras %s, Python %s, %d "
      "CPUs (%s)." % (model_text, FLAGS.batch_size, data_name,
                      tf.__version__, fit_example.keras_version(),
                      platform.python_version(), os.cpu_count(),
                      platform.machine()),
      "K-FAC: invert_every %d, cov_update_every 1, momentum 0.9 (adam), "
      "damping 1e-2, lr 1e-3, sampled Fisher; Adam lr 1e-3." % block,
      "ms/step: median over %d blocks of %d steps per configuration (each "
      "block holds one K-FAC inverse update), %d interleaved rounds of fresh "
      "worker processes, warm-up (%d block%s, with the trace) excluded." % (
          FLAGS.rounds * FLAGS.blocks_per_round, block, FLAGS.rounds,
          FLAGS.warmup_blocks, "" if FLAGS.warmup_blocks == 1 else "s"),
      "",
      "| configuration | what | ms/step (median) | IQR | ratio to fit_adam "
      "| ratio to session_kfac |",
      "|---|---|---:|---:|---:|---:|",
  ]
  for n, m, lo, hi in zip(names, medians, q25, q75):
    to_session = ratio(n, "session_kfac") if "kfac" in n else "-"
    lines.append("| %s | %s | %.1f | %.1f-%.1f | %s | %s |" % (
        n, DESCRIPTIONS[n], m, lo, hi, ratio(n, "fit_adam"), to_session))
  lines += ["", "Worker wall time (process start excluded: build, trace, "
            "warm-up, timed blocks), median: %s." % ", ".join(
                "%s %.0fs" % (n, np.median(build[n])) for n in names),
            "Loss on the first batch after each worker's %d steps (sanity): "
            "%s." % ((FLAGS.warmup_blocks + FLAGS.blocks_per_round) * block,
                     ", ".join("%s %.3f" % (n, losses[n]) for n in names))]
  table = "\n".join(lines)
  print()
  print(table)

  os.makedirs(FLAGS.output_dir, exist_ok=True)
  md_path = os.path.join(FLAGS.output_dir, "keras_step_time.md")
  png_path = os.path.join(FLAGS.output_dir, "keras_step_time.png")
  json_path = os.path.join(FLAGS.output_dir, "keras_step_time.json")
  with open(md_path, "w") as f:
    f.write(table + "\n")
  with open(json_path, "w") as f:
    json.dump(dict(ms_per_step={n: list(ms[n]) for n in names},
                   medians=dict(zip(names, medians)), losses=losses,
                   batch_size=FLAGS.batch_size, data=data_name), f, indent=1)
  write_plot(png_path, names, medians,
             [np.subtract(medians, q25), np.subtract(q75, medians)],
             "Keras CNN, batch %d, TF %s, %d CPUs" % (
                 FLAGS.batch_size, tf.__version__, os.cpu_count()))
  print("\nwrote %s, %s and %s (%.0fs in all)" % (
      md_path, png_path, json_path, time.perf_counter() - start))


if __name__ == "__main__":
  app.run(main)
