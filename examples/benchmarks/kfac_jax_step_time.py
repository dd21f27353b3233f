r"""This kfac against kfac-jax (DeepMind's K-FAC for JAX) on the autoencoder.

Model: the K-FAC paper's deep autoencoder 784-1000-500-250-30-250-500-1000-784,
tanh (linear code layer), sigmoid cross-entropy summed over pixels and
averaged over the batch, + 1e-5/2 ||w||^2 (biases included); Fashion-MNIST.

Configurations (each in its own worker processes):
  sgd_tf            SGD with momentum 0.9 in a TF tf.function step: the floor
  kfac_tf_function  this kfac, PeriodicInvCovUpdateKfacOpt in a tf.function
  kfac_session      this kfac, the same optimizer in a TF1 Session (not in
                    the default --configs)
  kfac_jax          kfac_jax.Optimizer (its step is jit-compiled by the
                    library)
  sgd_jax           SGD with momentum 0.9 in a jax.jit step: JAX's floor

Same hyperparameters for both K-FACs: fixed learning rate 0.1 and damping 10
(kfac's autoencoder values, examples/benchmarks/time_to_target.py DEFAULTS),
momentum 0.9 in the same form (update = mu * previous update - lr * F^-1 g:
this kfac's momentum_type="regular"), statistics every step with a
zero-debiased moving average of decay 0.95, inverses every 10 steps (the
first at step 0), no burn-in, the sampled Fisher (one sampled target per
example: estimation_mode "gradients" here, "fisher_gradients" in kfac-jax),
l2_reg 1e-5 added to the damping, pi-adjusted factored damping. Both start
from the same numpy weights and see the same batches in the same order (the
sampled targets differ: each library draws its own). docs/benchmarks.md
lists where the two libraries' definitions differ.

Each worker runs blocks of --invert_every steps; every block holds exactly
one inverse update. The first --warmup_blocks blocks (tracing and
compilation) are not timed. ms/step is the median over the timed blocks of
(block time / block length), over --rounds interleaved rounds of fresh
workers with a rotating order. Between blocks (untimed) the first round's
workers at the first batch size run --loss_steps steps and evaluate the training objective (cross-entropy + L2, float32) on a
fixed subset of the training images at the --loss_at steps: the loss at
equal steps.

kfac-jax and its JAX stack are looked up in --kfac_jax_path (`make bench`
installs them there with `pip install --target`, see KFAC_JAX_PINS); only
the JAX workers put that folder on their path, and they never import
TensorFlow.

  python examples/benchmarks/kfac_jax_step_time.py   # ~7 CPU-minutes
  python examples/benchmarks/kfac_jax_step_time.py --batch_sizes=256 \
      --rounds=3 --configs=kfac_tf_function,kfac_jax
"""

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
# No TensorFlow (nor kfac) at the top: the JAX workers must not import it.
from absl import app
from absl import flags
import numpy as np

FLAGS = flags.FLAGS

ALL_CONFIGS = ("sgd_tf", "kfac_tf_function", "kfac_session", "kfac_jax",
               "sgd_jax")
JAX_CONFIGS = ("kfac_jax", "sgd_jax")
DEFAULT_CONFIGS = ("sgd_tf", "kfac_tf_function", "kfac_jax", "sgd_jax")

# Keep in step with KFAC_JAX_PINS in the Makefile. kfac-jax 0.0.8 (the
# newest release) fails inside its graph matcher on jax 0.9.2 and 0.10.2.
KFAC_JAX_VERSION = "0.0.8"
KFAC_JAX_PINS = ("kfac-jax==0.0.8 jax==0.8.3 jaxlib==0.8.3 optax==0.2.8 "
                 "chex==0.1.92 distrax==0.1.9 tfp-nightly==0.26.0.dev20261027")

flags.DEFINE_list("batch_sizes", ["1000", "256"], "Mini-batch sizes; the "
                  "loss table and curve use the first.")
flags.DEFINE_list("configs", list(DEFAULT_CONFIGS),
                  "Configurations, from: %s." % ", ".join(ALL_CONFIGS))
flags.DEFINE_integer("rounds", 2, "Interleaved rounds of fresh workers.")
flags.DEFINE_integer("invert_every", 10, "K-FAC inverse period; also the "
                     "length of a timed block.")
flags.DEFINE_integer("warmup_blocks", 2, "Untimed blocks per worker "
                     "(tracing, compilation).")
flags.DEFINE_integer("blocks_per_round", 2, "Timed blocks per worker after "
                     "the first round.")
flags.DEFINE_integer("loss_steps", 100, "Steps of the first round's "
                     "workers at the first batch size (all blocks after the "
                     "warm-up are timed).")
flags.DEFINE_list("loss_at", ["10", "20", "50", "100"], "Steps at which the "
                  "first round's workers evaluate the loss.")
flags.DEFINE_float("learning_rate", 0.1, "K-FAC learning rate (both).")
flags.DEFINE_float("damping", 10.0, "K-FAC damping (both).")
flags.DEFINE_float("momentum", 0.9, "Momentum (all optimizers).")
flags.DEFINE_float("cov_ema_decay", 0.95, "Decay of the statistics' moving "
                   "average (both K-FACs).")
flags.DEFINE_float("l2_reg", 1e-5, "L2 coefficient: l2/2 ||w||^2 in the "
                   "loss, and l2 added to the K-FAC damping.")
flags.DEFINE_float("sgd_learning_rate", 0.003, "SGD learning rate "
                   "(time_to_target.py's autoencoder value).")
flags.DEFINE_list("encoder", ["1000", "500", "250", "30"], "Encoder widths "
                  "after the input layer (the decoder mirrors them).")
flags.DEFINE_enum("data", "auto", ["auto", "fashion_mnist", "digits"],
                  "Fashion-MNIST ('auto': when present, else sklearn's "
                  "digits).")
flags.DEFINE_integer("max_images", 20000, "Training images used (batches "
                     "cycle through them).")
flags.DEFINE_integer("eval_examples", 2000, "Training images on which the "
                     "loss is evaluated.")
flags.DEFINE_string("kfac_jax_path", ".bench_deps/kfac-jax-" +
                    KFAC_JAX_VERSION, "Folder holding kfac-jax and its JAX "
                    "stack (pip --target).")
flags.DEFINE_enum("missing_kfac_jax", "error", ["error", "skip"],
                  "When kfac-jax is not installed: stop with an error, or "
                  "skip the JAX configurations with a note.")
flags.DEFINE_integer("seed", 0, "Seed of the weights, the batch order and "
                     "the Fisher samples.")
flags.DEFINE_string("output_dir", "bench_results", "Where to write results.")
flags.DEFINE_string("worker", None, "Internal: run one configuration.")
flags.DEFINE_string("worker_input", None, "Internal: the .npz of a worker.")
flags.DEFINE_integer("worker_batch_size", None, "Internal.")
flags.DEFINE_integer("worker_steps", None, "Internal.")


class KfacJaxMissing(Exception):
  pass


def missing_message(path, detail=None):
  path = os.path.abspath(path)
  lines = ["error: kfac-jax is not installed in %s%s." % (
      path, " (%s)" % detail if detail else "")]
  lines.append("Install it with `make bench` (which runs the other "
               "benchmarks too), or alone with:")
  lines.append("  %s -m pip install --target %s %s" % (
      sys.executable, path, KFAC_JAX_PINS))
  lines.append("or leave the JAX side out: --configs=sgd_tf,kfac_tf_function"
               " (or --missing_kfac_jax=skip).")
  return "\n".join(lines)


def kfac_jax_installed(path):
  return os.path.isdir(os.path.join(path, "kfac_jax")) and os.path.isdir(
      os.path.join(path, "jax"))


# ------------------------------------------------------------------ data


def layer_sizes(input_dim):
  encoder = [input_dim] + [int(s) for s in FLAGS.encoder]
  return encoder + encoder[-2::-1]


def linear_layers(num_layers):
  """Indices of the layers without tanh: the code layer and the output."""
  return {num_layers // 2 - 1, num_layers - 1}


def prepare_inputs(directory):
  """Writes the images and the initial weights once; returns a summary."""
  sys.path.insert(0, os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  import datasets  # numpy only
  prefer = "fashion_mnist" if FLAGS.data == "auto" else FLAGS.data
  name, images = datasets.load_autoencoder_data(
      prefer=prefer, max_examples=FLAGS.max_images)
  if FLAGS.data == "fashion_mnist" and name != "fashion_mnist":
    raise app.UsageError("Fashion-MNIST not found; run `make data`.")
  images = np.ascontiguousarray(images[:FLAGS.max_images], np.float32)
  rng = np.random.RandomState(FLAGS.seed)
  order = rng.permutation(len(images))
  sizes = layer_sizes(images.shape[1])
  arrays = dict(images=images[order], eval=images[:FLAGS.eval_examples])
  # Glorot-uniform weights [in, out], zero biases (autoencoder_model.py's
  # initialisation), drawn once here for every worker.
  for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    arrays["w%d" % i] = rng.uniform(-limit, limit, size=(fan_in, fan_out)
                                   ).astype(np.float32)
    arrays["b%d" % i] = np.zeros([fan_out], np.float32)
  path = os.path.join(directory, "inputs.npz")
  np.savez(path, **arrays)
  return dict(path=path, data=name, sizes=sizes, num_images=len(images))


def load_inputs(path):
  with np.load(path) as f:
    arrays = {k: f[k] for k in f.files}
  num_layers = len([k for k in arrays if k.startswith("w")])
  params = [(arrays["w%d" % i], arrays["b%d" % i]) for i in range(num_layers)]
  return arrays["images"], arrays["eval"], params


def batch_at(images, batch_size, step):
  """The mini-batch of `step`: consecutive slices, cycling over the data."""
  num_batches = len(images) // batch_size
  i = step % num_batches
  return images[i * batch_size:(i + 1) * batch_size]


# ---------------------------------------------------------------- TF side


class TFRunner(object):
  """This kfac (tf.function or Session) or SGD in a tf.function."""

  def __init__(self, name, params_np, images, eval_images, batch_size):
    import tensorflow as tf
    sys.path.insert(0, os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    import autoencoder_model as model
    self.tf, self.model = tf, model
    self.name = name
    num_batches = len(images) // batch_size
    self.num_batches = num_batches
    self.session = None
    if name == "kfac_session":
      self._build_session(params_np, images, eval_images, batch_size)
      return
    tf.random.set_seed(FLAGS.seed)
    self.batches = [tf.constant(batch_at(images, batch_size, i))
                    for i in range(num_batches)]
    self.eval_images = tf.constant(eval_images)
    self.variables = model.make_variables(params_np, name=name)
    var_list = model.flat_variables(self.variables)

    if name == "sgd_tf":
      velocities = [tf.Variable(tf.zeros_like(v)) for v in var_list]

      @tf.function
      def train_step(x):
        with tf.GradientTape() as tape:
          loss = self._loss(x, model.forward(x, self.variables))
        grads = tape.gradient(loss, var_list)
        for v, g, var in zip(velocities, grads, var_list):
          v.assign(FLAGS.momentum * v + g)
          var.assign_sub(FLAGS.sgd_learning_rate * v)
        return loss
    else:
      import kfac
      opt = kfac.PeriodicInvCovUpdateKfacOpt(**kfac_kwargs())

      @tf.function
      def train_step(x):
        lc = kfac.LayerCollection()
        logits = model.forward(x, self.variables, layer_collection=lc)
        model.register_loss(lc, x, logits)
        loss = self._loss(x, logits)
        opt.minimize(loss, var_list=var_list, layer_collection=lc)
        return loss

    @tf.function
    def eval_loss(x):
      return self._loss(x, model.forward(x, self.variables))

    self.train_step, self.eval_fn = train_step, eval_loss

  def _loss(self, x, logits, variables=None):
    tf = self.tf
    variables = self.variables if variables is None else variables
    l2 = tf.add_n([tf.reduce_sum(tf.square(v))
                   for v in self.model.flat_variables(variables)])
    return (self.model.reconstruction_loss(x, logits) +
            0.5 * FLAGS.l2_reg * l2)

  def _build_session(self, params_np, images, eval_images, batch_size):
    tf, model = self.tf, self.model
    import kfac
    self.feeds = [batch_at(images, batch_size, i)
                  for i in range(self.num_batches)]
    self.eval_images = eval_images
    graph = tf.Graph()
    with graph.as_default():
      tf.compat.v1.set_random_seed(FLAGS.seed)
      self.x = tf.compat.v1.placeholder(tf.float32, [None, images.shape[1]])
      variables = model.make_variables(params_np)
      var_list = model.flat_variables(variables)
      lc = kfac.LayerCollection()
      logits = model.forward(self.x, variables, layer_collection=lc)
      model.register_loss(lc, self.x, logits)
      self.loss = self._loss(self.x, logits, variables)
      opt = kfac.PeriodicInvCovUpdateKfacOpt(layer_collection=lc,
                                             **kfac_kwargs())
      self.train_op = opt.minimize(
          self.loss, var_list=var_list,
          global_step=tf.compat.v1.train.get_or_create_global_step())
      init = tf.compat.v1.global_variables_initializer()
    graph.finalize()
    self.session = tf.compat.v1.Session(graph=graph)
    self.session.run(init)

  def step(self, i):
    if self.session is not None:
      # The loss fetched with the step, as Session training loops do.
      self.session.run([self.train_op, self.loss],
                       {self.x: self.feeds[i % self.num_batches]})
    else:
      self.last = self.train_step(self.batches[i % self.num_batches])

  def sync(self):
    if self.session is None:
      self.last.numpy()

  def eval_loss(self):
    if self.session is not None:
      return float(self.session.run(self.loss, {self.x: self.eval_images}))
    return float(self.eval_fn(self.eval_images))

  def describe(self):
    return "TensorFlow %s" % self.tf.__version__


def kfac_kwargs():
  return dict(learning_rate=FLAGS.learning_rate, damping=FLAGS.damping,
              momentum=FLAGS.momentum, momentum_type="regular",
              cov_ema_decay=FLAGS.cov_ema_decay,
              invert_every=FLAGS.invert_every, cov_update_every=1, num_burnin_steps=0, l2_reg=FLAGS.l2_reg,
              estimation_mode="gradients")


# --------------------------------------------------------------- JAX side


class JaxRunner(object):
  """kfac_jax.Optimizer, or SGD with momentum in jax.jit."""

  def __init__(self, name, params_np, images, eval_images, batch_size):
    # tensorflow_probability's JAX substrate (kfac-jax -> distrax) imports
    # TensorFlow when it can; keep it out of this process.
    sys.modules["tensorflow"] = None
    try:
      import jax
      import jax.numpy as jnp
      if name == "kfac_jax":
        import kfac_jax
    except ImportError as e:
      raise KfacJaxMissing("%s: %s" % (type(e).__name__, e))
    self.jax, self.jnp = jax, jnp
    self.num_batches = len(images) // batch_size
    self.batches = [jnp.asarray(batch_at(images, batch_size, i))
                    for i in range(self.num_batches)]
    self.eval_images = jnp.asarray(eval_images)
    self.params = [(jnp.asarray(w), jnp.asarray(b)) for w, b in params_np]
    linear = linear_layers(len(params_np))
    l2_reg = FLAGS.l2_reg

    def forward(params, x):
      h = x
      for i, (w, b) in enumerate(params):
        pre = jnp.matmul(h, w) + b
        h = pre if i in linear else jnp.tanh(pre)
      return h

    def loss_fn(params, x, register=False):
      logits = forward(params, x)
      if register:
        kfac_jax.register_sigmoid_cross_entropy_loss(logits, x)
      # Sigmoid cross-entropy with logits, as tf.nn computes it.
      ce = (jnp.maximum(logits, 0.0) - logits * x +
            jnp.log1p(jnp.exp(-jnp.abs(logits))))
      l2 = sum(jnp.sum(jnp.square(v))
               for v in jax.tree_util.tree_leaves(params))
      return jnp.mean(jnp.sum(ce, axis=1)) + 0.5 * l2_reg * l2

    self.eval_fn = jax.jit(loss_fn)
    self.key = jax.random.PRNGKey(FLAGS.seed)
    if name == "kfac_jax":
      self.optimizer = kfac_jax.Optimizer(
          value_and_grad_func=jax.value_and_grad(
              lambda p, x: loss_fn(p, x, register=True)),
          l2_reg=l2_reg,
          learning_rate_schedule=lambda _: FLAGS.learning_rate,
          momentum_schedule=lambda _: FLAGS.momentum,
          damping_schedule=lambda _: FLAGS.damping,
          num_burnin_steps=0,
          estimation_mode="fisher_gradients",
          num_estimator_samples=1,
          curvature_ema=FLAGS.cov_ema_decay,
          curvature_update_period=1,
          inverse_update_period=FLAGS.invert_every,
          multi_device=False)
      self.state = self.optimizer.init(self.params, self.key, self.batches[0])
      # Every dense layer (weights and bias) must be one Kronecker block,
      # as in this kfac's register_fully_connected((w, b), ...).
      estimator = getattr(self.optimizer, "_estimator", None)
      num_blocks = len(getattr(estimator, "blocks", params_np))
      if num_blocks != len(params_np):
        raise RuntimeError("kfac-jax registered %d blocks, expected %d" %
                           (num_blocks, len(params_np)))
      self.step = self._kfac_step
      self.version = kfac_jax.__version__
    else:
      velocities = jax.tree_util.tree_map(jnp.zeros_like, self.params)
      grad_fn = jax.value_and_grad(loss_fn)
      lr, mu = FLAGS.sgd_learning_rate, FLAGS.momentum

      @jax.jit
      def sgd_step(params, velocities, x):
        loss, grads = grad_fn(params, x)
        velocities = jax.tree_util.tree_map(lambda v, g: mu * v + g,
                                            velocities, grads)
        params = jax.tree_util.tree_map(lambda p, v: p - lr * v, params,
                                        velocities)
        return params, velocities, loss

      self.velocities, self.sgd_step = velocities, sgd_step
      self.step = self._sgd_step
      self.version = None

  def _kfac_step(self, i):
    self.key, key = self.jax.random.split(self.key)
    self.params, self.state, _ = self.optimizer.step(
        self.params, self.state, key, batch=self.batches[i % self.num_batches],
        global_step_int=i)

  def _sgd_step(self, i):
    self.params, self.velocities, _ = self.sgd_step(
        self.params, self.velocities, self.batches[i % self.num_batches])

  def sync(self):
    self.jax.block_until_ready(self.params)

  def eval_loss(self):
    return float(self.eval_fn(self.params, self.eval_images))

  def describe(self):
    text = "jax %s (%s)" % (self.jax.__version__,
                            self.jax.devices()[0].platform)
    if self.version:
      text = "kfac-jax %s, %s" % (self.version, text)
    return text


# ----------------------------------------------------------------- worker


def run_worker(name):
  """Builds one configuration, runs its blocks; prints one JSON line."""
  images, eval_images, params = load_inputs(FLAGS.worker_input)
  batch_size, steps = FLAGS.worker_batch_size, FLAGS.worker_steps
  start = time.perf_counter()
  try:
    if name in JAX_CONFIGS:
      runner = JaxRunner(name, params, images, eval_images, batch_size)
    else:
      runner = TFRunner(name, params, images, eval_images, batch_size)
  except KfacJaxMissing as e:
    print("KFAC_JAX_MISSING " + str(e), flush=True)
    sys.exit(3)
  build_s = time.perf_counter() - start
  loss_at = {int(s) for s in FLAGS.loss_at}
  block = FLAGS.invert_every
  losses = {0: runner.eval_loss()}
  times, warmup_s = [], 0.0
  for b in range(steps // block):
    start = time.perf_counter()
    for i in range(b * block, (b + 1) * block):
      runner.step(i)
    runner.sync()
    elapsed = time.perf_counter() - start
    if b < FLAGS.warmup_blocks:
      warmup_s += elapsed
    else:
      times.append(elapsed / block)
    if (b + 1) * block in loss_at:
      losses[(b + 1) * block] = runner.eval_loss()
  print("WORKER_RESULT " + json.dumps(dict(
      times=times, losses=losses, build_s=build_s, warmup_s=warmup_s,
      version=runner.describe())), flush=True)


def spawn_worker(name, inputs, batch_size, steps):
  env = dict(os.environ)
  if name in JAX_CONFIGS:
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.abspath(FLAGS.kfac_jax_path)] +
        [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("JAX_PLATFORMS", "cpu")
  argv = [sys.executable, os.path.abspath(__file__), "--worker=" + name,
          "--worker_input=" + inputs, "--worker_batch_size=%d" % batch_size,
          "--worker_steps=%d" % steps]
  for flag in ("invert_every", "warmup_blocks", "learning_rate", "damping",
               "momentum", "cov_ema_decay", "l2_reg", "sgd_learning_rate",
               "seed"):
    argv.append("--%s=%r" % (flag, getattr(FLAGS, flag)))
  argv.append("--loss_at=" + ",".join(FLAGS.loss_at))
  out = subprocess.run(argv, env=env, capture_output=True, text=True,
                       check=False)
  for line in out.stdout.splitlines():
    if line.startswith("KFAC_JAX_MISSING "):
      raise KfacJaxMissing(line[len("KFAC_JAX_MISSING "):])
    if line.startswith("WORKER_RESULT "):
      result = json.loads(line[len("WORKER_RESULT "):])
      result["losses"] = {int(k): v for k, v in result["losses"].items()}
      return result
  raise RuntimeError("worker %s (batch %d) failed:\n%s" % (
      name, batch_size, out.stderr[-4000:]))


# ----------------------------------------------------------------- report


def summarize(results, names, batch_sizes):
  """{batch: {name: dict(median, q25, q75, blocks)}}."""
  summary = {}
  for batch in batch_sizes:
    summary[batch] = {}
    for name in names:
      times = [t for r in results.get((name, batch), []) for t in r["times"]]
      if not times:
        continue
      ms = 1e3 * np.array(times)
      summary[batch][name] = dict(
          median=float(np.median(ms)), q25=float(np.percentile(ms, 25)),
          q75=float(np.percentile(ms, 75)), blocks=len(ms))
  return summary


def write_report(output_dir, info, summary, losses, names, skipped):
  """Markdown table, JSON and PNG; returns the markdown text."""
  batch_sizes = list(summary)
  lines = [
      "Deep autoencoder %s, %s; %s; Python %s, %d CPUs (%s)." % (
          "-".join(str(s) for s in info["sizes"]), info["data"],
          "; ".join(info["versions"]),
          platform.python_version(), os.cpu_count() or 0,
          platform.machine()),
      "Both K-FACs: lr %g, damping %g, momentum %g (update = mu * previous "
      "update - lr * F^-1 g), statistics every step (EMA %g), inverses every "
      "%d steps, sampled Fisher, l2 %g. SGD: lr %g, momentum %g." % (
          FLAGS.learning_rate, FLAGS.damping, FLAGS.momentum,
          FLAGS.cov_ema_decay, FLAGS.invert_every, FLAGS.l2_reg,
          FLAGS.sgd_learning_rate, FLAGS.momentum),
      "ms/step: median over blocks of %d steps (each holds one inverse "
      "update), %d interleaved rounds of fresh worker processes, the first "
      "%d blocks of each worker (tracing, compilation) excluded." % (
          FLAGS.invert_every, FLAGS.rounds, FLAGS.warmup_blocks),
      "",
      "| optimizer | %s |" % " | ".join(
          "batch %d: ms/step (IQR)" % b for b in batch_sizes),
      "|---|%s" % ("---:|" * len(batch_sizes)),
  ]
  for name in names:
    cells = []
    for b in batch_sizes:
      s = summary[b].get(name)
      cells.append("-" if s is None else "%.1f (%.1f-%.1f)" % (
          s["median"], s["q25"], s["q75"]))
    lines.append("| %s | %s |" % (name, " | ".join(cells)))
  ratios = []
  for b in batch_sizes:
    s = summary[b]
    if "kfac_jax" in s:
      parts = ["%s/kfac_jax %.2fx" % (n, s[n]["median"] /
                                      s["kfac_jax"]["median"])
               for n in ("kfac_tf_function", "kfac_session") if n in s]
      if "sgd_tf" in s and "sgd_jax" in s:
        parts.append("sgd_tf/sgd_jax %.2fx" % (s["sgd_tf"]["median"] /
                                               s["sgd_jax"]["median"]))
      if parts:
        ratios.append("batch %d: %s" % (b, ", ".join(parts)))
  if ratios:
    lines += ["", "Ratios of medians: %s." % "; ".join(ratios)]
  loss_batch = batch_sizes[0]
  loss_names = [n for n in names if (n, loss_batch) in losses]
  if loss_names:
    steps = sorted({s for n in loss_names for s in losses[(n, loss_batch)]})
    lines += [
        "",
        "Training loss (cross-entropy summed over pixels + L2, mean over %d "
        "fixed training images) at equal steps, batch %d, first round:" % (
            FLAGS.eval_examples, loss_batch),
        "",
        "| optimizer | %s |" % " | ".join("step %d" % s for s in steps),
        "|---|%s" % ("---:|" * len(steps)),
    ]
    for n in loss_names:
      row = losses[(n, loss_batch)]
      lines.append("| %s | %s |" % (n, " | ".join(
          "%.2f" % row[s] if s in row else "-" for s in steps)))
  if skipped:
    lines += ["", "Skipped: %s." % "; ".join(skipped)]
  table = "\n".join(lines)

  os.makedirs(output_dir, exist_ok=True)
  md_path = os.path.join(output_dir, "kfac_jax_step_time.md")
  with open(md_path, "w") as f:
    f.write(table + "\n")
  with open(os.path.join(output_dir, "kfac_jax_step_time.json"), "w") as f:
    json.dump(dict(
        info=info, names=names, skipped=skipped,
        ms_per_step={str(b): v for b, v in summary.items()},
        losses={"%s@%d" % k: {str(s): l for s, l in v.items()}
                for k, v in losses.items()}), f, indent=1)
  write_plot(os.path.join(output_dir, "kfac_jax_step_time.png"), info,
             summary, losses, names, loss_batch)
  return table


COLORS = dict(sgd_tf="#888888", kfac_tf_function="#1f77b4",
              kfac_session="#17becf", kfac_jax="#d62728", sgd_jax="#bbbbbb")
# The JAX curves are dashed: they lie on top of their TF twins.
LINES = dict(kfac_jax="s--", sgd_jax="s--")


def write_plot(path, info, summary, losses, names, loss_batch):
  """Left: ms/step per batch size; right: loss at equal steps."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(11.0, 4.0))
  batch_sizes = list(summary)
  height = 0.8 / max(1, len(names))
  for j, name in enumerate(names):
    ys, meds, errs = [], [], [[], []]
    for k, b in enumerate(batch_sizes):
      s = summary[b].get(name)
      if s is None:
        continue
      ys.append(k + (j - (len(names) - 1) / 2.0) * height)
      meds.append(s["median"])
      errs[0].append(s["median"] - s["q25"])
      errs[1].append(s["q75"] - s["median"])
    if not ys:
      continue
    ax_t.barh(ys, meds, height=height * 0.9, xerr=errs, capsize=2,
              color=COLORS.get(name, "#444444"), label=name)
    for y, m, hi in zip(ys, meds, errs[1]):
      ax_t.text(m + hi, y, " %.0f" % m, va="center", fontsize=7)
  ax_t.set_yticks(range(len(batch_sizes)))
  ax_t.set_yticklabels(["batch %d" % b for b in batch_sizes])
  ax_t.invert_yaxis()
  ax_t.set_xlabel("ms per step (median; bars: interquartile range)")
  ax_t.legend(fontsize=7, loc="lower right")
  ax_t.set_title("ms/step", fontsize=9)
  for name in names:
    row = losses.get((name, loss_batch))
    if not row:
      continue
    steps = sorted(row)
    ax_l.plot(steps, [row[s] for s in steps], LINES.get(name, "o-"),
              label=name, color=COLORS.get(name, "#444444"),
              markersize=4 if name in LINES else 6)
  ax_l.set_xlabel("step")
  ax_l.set_ylabel("training loss (fixed subset)")
  ax_l.set_title("loss at equal steps, batch %d" % loss_batch, fontsize=9)
  ax_l.legend(fontsize=7)
  fig.suptitle("Deep autoencoder %s, %s: this kfac vs kfac-jax (%d CPUs)" % (
      "-".join(str(s) for s in info["sizes"]), info["data"],
      os.cpu_count() or 0), fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ------------------------------------------------------------------- main


def main(argv):
  del argv
  if FLAGS.worker:
    run_worker(FLAGS.worker)
    return
  unknown = [n for n in FLAGS.configs if n not in ALL_CONFIGS]
  if unknown:
    raise app.UsageError("unknown configurations %s (known: %s)" % (
        ", ".join(unknown), ", ".join(ALL_CONFIGS)))
  names = list(FLAGS.configs)
  skipped = []
  if any(n in JAX_CONFIGS for n in names) and not kfac_jax_installed(
      FLAGS.kfac_jax_path):
    if FLAGS.missing_kfac_jax == "error":
      sys.exit(missing_message(FLAGS.kfac_jax_path))
    print("note: kfac-jax is not installed in %s (make bench installs it); "
          "%s skipped" % (FLAGS.kfac_jax_path, ", ".join(
              n for n in names if n in JAX_CONFIGS)), flush=True)
    skipped += ["%s (kfac-jax not installed)" % n for n in names
                if n in JAX_CONFIGS]
    names = [n for n in names if n not in JAX_CONFIGS]
  batch_sizes = [int(b) for b in FLAGS.batch_sizes]
  block = FLAGS.invert_every
  first_steps = max(FLAGS.loss_steps // block,
                    FLAGS.warmup_blocks + 1) * block
  later_steps = (FLAGS.warmup_blocks + FLAGS.blocks_per_round) * block

  tmp = tempfile.mkdtemp(prefix="kfac_jax_bench_")
  try:
    info = prepare_inputs(tmp)
    if info["num_images"] < max(batch_sizes):
      raise app.UsageError("%d images: fewer than a batch" %
                           info["num_images"])
    print("model %s, data: %s (%d images), batch sizes %s, configs %s" % (
        "-".join(str(s) for s in info["sizes"]), info["data"],
        info["num_images"], batch_sizes, ", ".join(names)), flush=True)
    results, losses, versions = {}, {}, {}  # versions: an ordered set
    for r in range(FLAGS.rounds):
      for batch in batch_sizes:
        # Only the first round's workers of the first batch size run the
        # --loss_steps steps of the loss table.
        steps = (first_steps if r == 0 and batch == batch_sizes[0] else
                 later_steps)
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
          if name in JAX_CONFIGS and any(name in s for s in skipped):
            continue
          try:
            result = spawn_worker(name, info["path"], batch, steps)
          except KfacJaxMissing as e:
            if FLAGS.missing_kfac_jax == "error":
              sys.exit(missing_message(FLAGS.kfac_jax_path, str(e)))
            print("note: %s skipped: %s" % (name, e), flush=True)
            skipped.append("%s (%s)" % (name, e))
            continue
          results.setdefault((name, batch), []).append(result)
          versions[result["version"]] = None
          if r == 0 and batch == batch_sizes[0]:
            losses[(name, batch)] = result["losses"]
          print("round %d/%d batch %d %s: %.1f ms/step (%d blocks; "
                "warm-up %.1f s)%s" % (
                    r + 1, FLAGS.rounds, batch, name,
                    1e3 * np.median(result["times"]), len(result["times"]),
                    result["warmup_s"],
                    ", loss %s" % " ".join(
                        "%d:%.1f" % kv for kv in sorted(
                            result["losses"].items()))
                    if (name, batch) in losses and r == 0 else ""),
                flush=True)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  names = [n for n in names if any((n, b) in results for b in batch_sizes)]
  # "jax 0.8.3 (cpu)" of sgd_jax is part of kfac_jax's line: once is enough.
  info["versions"] = [v for v in versions
                      if not any(v != w and v in w for w in versions)]
  summary = summarize(results, names, batch_sizes)
  table = write_report(FLAGS.output_dir, info, summary, losses, names,
                       skipped)
  print()
  print(table)
  print("\nwrote kfac_jax_step_time.md, .json and .png in %s" %
        FLAGS.output_dir)


if __name__ == "__main__":
  app.run(main)
