r"""Bad input and faults, tried as a user would: what each case does.

Every case runs a small model in one of the three paths (a TF1 Session, a
TF2 tf.function, Keras fit) and is classified:

* "clear error": it raises, and the message names the culprit;
* "keeps working": it runs, and the model's weights and loss stay finite
  (after a bad batch: training continues normally);
* "error, culprit unnamed": it raises without naming the culprit (e.g. a
  TensorFlow internal error);
* "silent": it runs and accepts the input silently, or the run is
  poisoned (non-finite weights or loss) without a word.

The script uses only the public API that kfac had before the reliability
work, so it can be pointed at an older checkout (PYTHONPATH) to compare:

  python examples/benchmarks/fault_cases.py --output=fault_cases.md
"""

import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import tensorflow as tf

import kfac

CASES = []


def case(name, paths, culprit):
  """Registers fn(path) as a case; `culprit`: what a clear error names."""
  def register(fn):
    for path in paths:
      CASES.append((name, path, culprit, fn))
    return fn
  return register


def batches(n, rows=16, seed=0):
  rng = np.random.RandomState(seed)
  return [(rng.randn(rows, 4).astype(np.float32),
           rng.randint(0, 3, rows).astype(np.int32)) for _ in range(n)]


def bad(kind):
  x, y = batches(1, seed=9)[0]
  if kind == "nan":
    x[3, 1] = np.nan
  elif kind == "inf":
    x[3, 1] = np.inf
  elif kind == "empty":
    x, y = x[:0], y[:0]
  return x, y


class Run:
  """A tanh MLP trained by PeriodicInvCovUpdateKfacOpt (TF1, TF2) or Keras
  Kfac; step(batch) returns the loss; weights() the weights."""

  def __init__(self, path, x_rows=None, **opt_args):
    self.path = path
    args = dict(learning_rate=0.05, damping=0.05, invert_every=2)
    args.update(opt_args)
    rng = np.random.RandomState(1)
    inits = [0.5 * rng.randn(4, 6), np.zeros(6), 0.5 * rng.randn(6, 3),
             np.zeros(3)]
    inits = [v.astype(np.float32) for v in inits]
    if path == "keras":
      keras = tf.keras
      self.model = keras.Sequential([
          keras.Input((4,)), keras.layers.Dense(6, activation="tanh"),
          keras.layers.Dense(3)])
      self.model.set_weights(inits)
      loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
      opt = kfac.keras.optimizers.Kfac(model=self.model, loss=loss, **args)
      self.model.compile(optimizer=opt, loss=loss)
      return
    if path == "tf1":
      self.graph = tf.Graph()
      with self.graph.as_default():
        self.vars = [tf.compat.v1.Variable(v) for v in inits]
        self.x = tf.compat.v1.placeholder(tf.float32, [None, 4])
        self.xr = tf.compat.v1.placeholder(tf.float32, [None, 4])
        self.y = tf.compat.v1.placeholder(tf.int32, [None])
        lc = kfac.LayerCollection()
        self.loss = self._model(self.x, self.xr, self.y, lc)
        self.opt = kfac.PeriodicInvCovUpdateKfacOpt(layer_collection=lc,
                                                    **args)
        self.train = self.opt.minimize(self.loss, var_list=self.vars)
        self.sess = tf.compat.v1.Session(graph=self.graph)
        self.sess.run(tf.compat.v1.global_variables_initializer())
      return
    self.vars = [tf.Variable(v) for v in inits]
    self.opt = kfac.PeriodicInvCovUpdateKfacOpt(**args)
    spec = [tf.TensorSpec([None, 4], tf.float32)] * 2 + [
        tf.TensorSpec([None], tf.int32)]

    @tf.function(input_signature=spec)
    def step(x, xr, y):
      lc = kfac.LayerCollection()
      loss = self._model(x, xr, y, lc)
      self.opt.minimize(loss, var_list=self.vars, layer_collection=lc)
      return loss
    self._step = step

  def _model(self, x, x_registered, y, lc):
    w1, b1, w2, b2 = self.vars
    pre = tf.matmul(x, w1) + b1
    hidden = tf.tanh(pre)
    logits = tf.matmul(hidden, w2) + b2
    lc.register_fully_connected((w1, b1), x_registered, pre)
    lc.register_fully_connected((w2, b2), hidden, logits)
    lc.register_softmax_cross_entropy_loss(logits)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=logits))

  def step(self, batch, registered_x=None):
    x, y = batch
    xr = x if registered_x is None else registered_x
    if self.path == "keras":
      self.model.reset_metrics()
      return float(self.model.train_on_batch(x, y))
    if self.path == "tf1":
      return float(self.sess.run([self.loss, self.train],
                                 {self.x: x, self.xr: xr, self.y: y})[0])
    return float(self._step(tf.constant(x), tf.constant(xr),
                            tf.constant(y)).numpy())

  def weights(self):
    if self.path == "keras":
      return self.model.get_weights()
    if self.path == "tf1":
      return self.sess.run(self.vars)
    return [v.numpy() for v in self.vars]

  def finite(self):
    return all(np.all(np.isfinite(w)) for w in self.weights())


def after_bad_batch(path, kind):
  run = Run(path)
  for b in batches(2):
    run.step(b)
  run.step(bad(kind))
  losses = [run.step(b) for b in batches(3, seed=5)]
  return np.all(np.isfinite(losses)) and run.finite()


@case("NaN in a batch", ("tf1", "tf2", "keras"), None)
def nan_batch(path):
  return after_bad_batch(path, "nan")


@case("Inf in a batch", ("tf1", "tf2", "keras"), None)
def inf_batch(path):
  return after_bad_batch(path, "inf")


@case("empty batch", ("tf1", "tf2", "keras"), None)
def empty_batch(path):
  return after_bad_batch(path, "empty")


@case("diverging run (learning rate 1e37)", ("tf1", "tf2", "keras"),
      "consecutive steps had non-finite values")
def diverging(path):
  run = Run(path, learning_rate=1e37, damping=1e-6, momentum=0.0)
  for _ in range(30):
    run.step(batches(1)[0])
  return run.finite()


@case("inputs and outputs of a layer with different batch sizes",
      ("tf1", "tf2"), "inputs and outputs have different numbers of rows")
def row_mismatch(path):
  run = Run(path)
  x, y = batches(1)[0]
  run.step((x, y), registered_x=np.concatenate([x, x[:3]]))
  return None  # accepted: silent


def bad_argument(path, **bad_args):
  Run(path, **bad_args)
  return None


for _arg, _value in (("damping", -1.0), ("learning_rate", -0.1),
                     ("momentum", 1.5), ("cov_ema_decay", 2.0),
                     ("invert_every", 0), ("damping", float("nan"))):
  case("%s=%r" % (_arg, _value), ("tf1", "tf2", "keras"), _arg)(
      lambda path, a=_arg, v=_value: bad_argument(path, **{a: v}))

case("unknown keyword loss_tensor=...", ("tf1", "tf2"), "loss_tensor")(
    lambda path: bad_argument(path, loss_tensor=1.0))


@case("momentum variable set to 1.5 between steps", ("tf1", "tf2"),
      "momentum must be")
def momentum_variable(path):
  if path == "tf2":
    mu = tf.Variable(0.5)
    run = Run(path, momentum=mu)
    run.step(batches(1)[0])
    mu.assign(1.5)
    run.step(batches(1)[0])
    return run.finite()
  run = Run("tf1")
  with run.graph.as_default():
    mu_var = tf.compat.v1.Variable(0.5)
    lc = kfac.LayerCollection()
    loss = run._model(run.x, run.x, run.y, lc)  # pylint: disable=protected-access
    opt = kfac.PeriodicInvCovUpdateKfacOpt(
        learning_rate=0.05, damping=0.05, momentum=mu_var,
        layer_collection=lc, name="mu_opt")
    train = opt.minimize(loss, var_list=run.vars)
    run.sess.run(tf.compat.v1.global_variables_initializer())
    x, y = batches(1)[0]
    run.sess.run(train, {run.x: x, run.y: y})
    mu_var.load(1.5, run.sess)
    for _ in range(20):
      run.sess.run(train, {run.x: x, run.y: y})
  return run.finite()


def half_model(dtype):
  w = tf.Variable(tf.cast(np.eye(4)[:, :3], dtype))
  opt = kfac.PeriodicInvCovUpdateKfacOpt(learning_rate=0.1, damping=0.1)

  @tf.function
  def step(x, y):
    lc = kfac.LayerCollection()
    logits = tf.matmul(tf.cast(x, dtype), w)
    lc.register_fully_connected(w, tf.cast(x, dtype), logits)
    lc.register_softmax_cross_entropy_loss(logits, targets=y)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.cast(logits, tf.float32)))
    opt.minimize(loss, var_list=[w], layer_collection=lc)
    return loss
  for b in batches(3):
    step(*b)
  return bool(np.all(np.isfinite(tf.cast(w, tf.float32).numpy())))


case("float16 model", ("tf2",), "float16")(lambda path: half_model(
    tf.float16))
case("bfloat16 model", ("tf2",), "bfloat16")(lambda path: half_model(
    tf.bfloat16))


def keras_policy(policy):
  tf.keras.mixed_precision.set_global_policy(policy)
  try:
    run = Run("keras")
    losses = [run.step(b) for b in batches(3)]
    return bool(np.all(np.isfinite(losses))) and run.finite()
  finally:
    tf.keras.mixed_precision.set_global_policy("float32")


case("Keras mixed_float16", ("keras",), "mixed")(
    lambda path: keras_policy("mixed_float16"))
case("Keras mixed_bfloat16", ("keras",), "mixed")(
    lambda path: keras_policy("mixed_bfloat16"))


@case("resume from tf.train.Checkpoint(optimizer=opt), default sampler",
      ("tf2",), None)
def resume(path):
  del path
  folder = tempfile.mkdtemp()
  full = Run("tf2")
  data = batches(8)
  for b in data[:4]:
    full.step(b)
  saved = tf.train.Checkpoint(variables=full.vars, optimizer=full.opt).save(
      os.path.join(folder, "c"))
  expected = [full.step(b) for b in data[4:]]
  resumed = Run("tf2")
  tf.train.Checkpoint(variables=resumed.vars,
                      optimizer=resumed.opt).restore(saved)
  got = [resumed.step(b) for b in data[4:]]
  return "exact" if got == expected else "drifts"


def classify(fn, path, culprit):
  try:
    result = fn(path)
  except Exception as e:  # pylint: disable=broad-except
    message = getattr(e, "message", None) or str(e)
    if culprit and culprit.lower() in message.lower():
      return "clear error"
    return "error, culprit unnamed (%s: %s)" % (
        type(e).__name__, " ".join(message.split())[:70])
  if result is None:
    return "silent (accepted)"
  if result == "exact":
    return "keeps working (bit-exact)"
  if result == "drifts":
    return "silent (resumed run drifts)"
  return "keeps working" if result else "silent (non-finite weights/loss)"


def main(argv):
  output = None
  for arg in argv[1:]:
    if arg.startswith("--output="):
      output = arg.split("=", 1)[1]
  rows = []
  for name, path, culprit, fn in CASES:
    verdict = classify(fn, path, culprit)
    rows.append(dict(case=name, path=path, verdict=verdict))
    print("%-62s %-6s %s" % (name, path, verdict), flush=True)
  counts = {}
  for r in rows:
    key = r["verdict"].split(" (")[0]
    counts[key] = counts.get(key, 0) + 1
  print("SUMMARY " + json.dumps(counts))
  if output:
    with open(output, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main(sys.argv)
