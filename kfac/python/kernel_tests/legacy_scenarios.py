"""Graph builds at every size threshold of the linear algebra, run in one
process's TF1 graph world (legacy_mode_test.py runs them under
tf.compat.v1.disable_v2_behavior() in a subprocess, through
legacy_mode_program.py, and with TF2 behaviour in its own process).

Each scenario builds its graphs, runs them in Sessions and returns a dict of
numpy arrays (decisions as 0/1 arrays), so that the two processes' results
can be compared entry by entry and with numpy.

The thresholds, each on both sides:
* linalg.CPU_BLOCKED_MIN: damped inverses of static matrices wider than it
  use xla_linalg's blocked recursion on CPU (float32 and float64);
* xla_linalg.BASE_SIZE: the recursion's leaves (its routines called
  directly, as XLA would get them);
* the float32 bound of linalg._float32_is_unsafe (the float64 retry);
* factored_grads.prefer_factored's row limit, static and run-time batch;
* K-FAC training through all of them: factor widths 256 and 257 (the
  blocked inverse in the optimizer), batches on both sides of the factored
  limit, a convolution with a 289-wide input factor, through the old
  library's update-thunk API (make_vars_and_create_op_thunks).
"""

import numpy as np
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import factored_grads_test
from kfac.python.ops.layers.dense import factored_grads
from kfac.python.ops.numerics import linalg
from kfac.python.ops.numerics import xla_linalg

DAMPING = 0.05
# prefer_factored for x [rows, 100], d [rows, 200]:
# 100*200*300 // (100^2 + 200^2 + 100*200) = 85 rows.
FACTORED_LIMIT = 85


def spd(n, seed=0):
  """A symmetric positive definite matrix with eigenvalues 0.1 .. 3."""
  rng = np.random.RandomState(seed + n)
  q, _ = np.linalg.qr(rng.randn(n, n))
  return (q * np.linspace(0.1, 3.0, n)) @ q.T


def evaluate(world, build, *inputs):
  """build(*tensors) evaluated on `inputs`, pairs (numpy array, static
  shape with None for run-time sizes), in a TF1 Session graph ("graph") or
  in a tf.function ("function"); returns numpy values."""
  if world == "function":
    specs = [tf.TensorSpec(shape, tf.as_dtype(value.dtype))
             for value, shape in inputs]
    fn = tf.function(build, input_signature=specs)
    return tf.nest.map_structure(
        lambda t: t.numpy(), fn(*[value for value, _ in inputs]))
  with tf.Graph().as_default():
    placeholders = [tf.compat.v1.placeholder(tf.as_dtype(value.dtype), shape)
                    for value, shape in inputs]
    fetches = build(*placeholders)
    with tf.compat.v1.Session() as sess:
      return sess.run(fetches, dict(zip(placeholders,
                                        [value for value, _ in inputs])))


def inverse_thresholds(world="graph"):
  """damped_inverse on both sides of CPU_BLOCKED_MIN (and whether it chose
  the blocked recursion), and the recursion's routines on both sides of
  BASE_SIZE."""
  out = {}
  for n in (linalg.CPU_BLOCKED_MIN, linalg.CPU_BLOCKED_MIN + 1):
    for dtype in (np.float32, np.float64):
      key = "damped_inverse/%d/%s" % (n, np.dtype(dtype).name)
      blocked = []

      def build(mat):
        blocked.append(linalg.use_cpu_blocked(mat))
        return linalg.damped_inverse(mat, DAMPING)
      value = spd(n).astype(dtype)
      out[key] = evaluate(world, build, (value, value.shape))
      out[key + "/blocked"] = np.array(blocked[-1])
  for n in (xla_linalg.BASE_SIZE, xla_linalg.BASE_SIZE + 1, 257):
    def build_recursion(mat):
      chol, chol_inv = xla_linalg.cholesky_and_inverse(mat)
      return chol, chol_inv, xla_linalg.spd_inverse(mat)
    values = evaluate(world, build_recursion, (spd(n), (n, n)))
    for name, value in zip(("chol", "chol_inv", "inverse"), values):
      out["xla_linalg/%d/%s" % (n, name)] = value
  return out


def float32_bound(world="graph"):
  """The float64 retry on both sides of the float32 bound: the identity of
  size 100 has trace 100 and row sum 1, so the bound is 10*100*eps*1."""
  out = {}
  bound = 10 * 100 * 1.1920929e-07
  for side, scale in (("above", 1.01), ("below", 0.99)):
    damping = scale * bound

    def build(mat):
      return (linalg._float32_is_unsafe(mat, damping),  # pylint: disable=protected-access
              tf.linalg.diag_part(linalg.damped_inverse(mat, damping)))
    eye = np.eye(100, dtype=np.float32)
    unsafe, diag = evaluate(world, build, (eye, eye.shape))
    out["float32_bound/%s/unsafe" % side] = np.array(unsafe)
    out["float32_bound/%s/inverse_diag" % side] = diag
  return out


def factored_choice(world="graph"):
  """prefer_factored's decision one row below and at the limit, with a
  static and a run-time number of rows (1: factored, 2: plain)."""
  out = {}

  def build(x):
    d = tf.zeros([tf.shape(x)[0], 200])
    return factored_grads.prefer_factored(
        x, d, lambda: tf.constant(1), lambda: tf.constant(2))
  for static in (True, False):
    for rows in (FACTORED_LIMIT - 1, FACTORED_LIMIT):
      x = np.zeros([rows, 100], np.float32)
      value = evaluate(world, build, (x, [rows if static else None, 100]))
      out["factored_choice/%s/%d" % ("static" if static else "dynamic",
                                     rows)] = np.array(value)
  return out


# K-FAC training: two dense layers whose input factors are 256 and 257 wide
# (255 and 256 inputs plus the bias), a convolution with a 3x3x32 + 1 = 289
# wide input factor, and batches below and above the factored limits.
WIDE_BATCHES = (16, 300, 16)


def _wide_model(x, images, variables, lc):
  (w1, b1), (w2, b2), (k3, b3), w4 = variables
  pre1 = tf.matmul(x, w1) + b1
  h1 = tf.tanh(pre1)
  pre2 = tf.matmul(tf.concat([h1, x[:, :1]], 1), w2) + b2
  conv = tf.nn.conv2d(images, k3, strides=1, padding="SAME") + b3
  pooled = tf.reduce_mean(tf.tanh(conv), axis=[1, 2])
  logits = tf.matmul(tf.concat([tf.tanh(pre2), pooled], 1), w4)
  if lc is not None:
    lc.register_fully_connected((w1, b1), x, pre1)
    lc.register_fully_connected((w2, b2), tf.concat([h1, x[:, :1]], 1), pre2)
    lc.register_conv2d((k3, b3), (1, 1, 1, 1), "SAME", images, conv)
    lc.register_fully_connected(w4, tf.concat([tf.tanh(pre2), pooled], 1),
                                logits)
    lc.register_softmax_cross_entropy_loss(logits)
  return logits


def _wide_variables(rng):
  def var(*shape, fan_in=None):
    return tf.Variable(rng.randn(*shape) / np.sqrt(fan_in or shape[0]))
  return [(var(255, 255), var(255)), (var(256, 6), var(6)),
          (var(3, 3, 32, 4, fan_in=288), var(4)), var(10, 3)]


def wide_training():
  """Four K-FAC steps in float64 through the old library's pattern (update
  thunks run by the script), then the parameters and losses."""
  rng = np.random.RandomState(1)
  data = [(rng.randn(n, 255), rng.randn(n, 4, 4, 32),
           rng.randint(0, 3, n)) for n in WIDE_BATCHES]
  out = {}
  with tf.Graph().as_default():
    tf.compat.v1.set_random_seed(0)
    x = tf.compat.v1.placeholder(tf.float64, [None, 255])
    images = tf.compat.v1.placeholder(tf.float64, [None, 4, 4, 32])
    labels = tf.compat.v1.placeholder(tf.int64, [None])
    variables = _wide_variables(rng)
    flat = tf.nest.flatten(variables)
    lc = kfac.LayerCollection()
    logits = _wide_model(x, images, variables, lc)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits))
    opt = kfac.KfacOptimizer(learning_rate=0.2, damping=0.05, momentum=0.5,
                             layer_collection=lc, var_list=flat,
                             dtype="float64")
    cov_thunks, inv_thunks = opt.make_vars_and_create_op_thunks()
    cov_op = tf.group(*[thunk() for thunk in cov_thunks])
    inv_op = tf.group(*[thunk() for thunk in inv_thunks])
    train_op = opt.minimize(loss, var_list=flat)
    factor_widths = sorted(
        int(tf.compat.dimension_value(f.shape[-1]))
        for cov_vars in opt.get_cov_vars() for f in cov_vars
        if f.shape.rank == 2)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      losses = []
      for step, (xb, ib, yb) in enumerate(data + data[:1]):
        feed = {x: xb, images: ib, labels: yb}
        sess.run(cov_op, feed)
        if step % 2 == 0:
          sess.run(inv_op, feed)
        _, value = sess.run([train_op, loss], feed)
        losses.append(value)
      params = sess.run(flat)
  out["wide/losses"] = np.array(losses)
  out["wide/factor_widths"] = np.array(factor_widths)
  for i, value in enumerate(params):
    out["wide/param%d" % i] = value
  return out


# factored_grads_test's trainings: (fixed K-FAC with a run-time batch,
# static batches, adaptive K-FAC), batches on both sides of every layer's
# limit.
FACTORED_SIZES = factored_grads_test.SIZES
FACTORED_CASES = {"fixed_dynamic": (False, False),
                  "fixed_static": (False, True),
                  "adaptive_dynamic": (True, False)}


def factored_training(case, plain=False):
  """One of FACTORED_CASES with the factored form (or the plain product
  only), and how often the blocks chose between the two."""
  calls = []
  real_prefer, real_factors = (factored_grads.prefer_factored,
                               factored_grads.gradient_factors)

  def counting_prefer(*args):
    calls.append(1)
    return real_prefer(*args)

  prefix = "%s/%s/" % ("plain" if plain else "factored", case)
  try:
    factored_grads.prefer_factored = counting_prefer
    if plain:
      factored_grads.gradient_factors = lambda vector, has_bias: None
    params = factored_grads_test._train_tf1(*FACTORED_CASES[case])  # pylint: disable=protected-access
  finally:
    factored_grads.prefer_factored = real_prefer
    factored_grads.gradient_factors = real_factors
  out = {prefix + "prefer_calls": np.array(len(calls))}
  for i, value in enumerate(params):
    out[prefix + "param%d" % i] = value
  return out


# distribute_program.py's models (dense, conv, embedding, a weight used
# twice; K-FAC and EKFAC blocks) and optimizers (burn-in and periods,
# KfacOptimizer with explicit update ops, the quadratic model, the damping
# rules), trained 5 steps without a strategy in a TF1 Session.
LAYER_KINDS_FAST = ("dense:adaptive", "conv:periodic:ekfac")
LAYER_KINDS_SLOW = ("dense:periodic", "conv:periodic", "embedding:periodic",
                    "multi_use:periodic", "dense:qmodel",
                    "dense:adaptive_delayed", "conv:regular",
                    "dense:periodic:ekfac", "embedding:periodic:ekfac",
                    "multi_use:periodic:ekfac")


def layer_kinds(specs):
  """Weights ("w") and K-FAC state ("s") after each case's run."""
  from kfac.python.kernel_tests import distribute_program  # pylint: disable=g-import-not-at-top
  out = {}
  for spec in specs:
    parts = spec.split(":")
    for flag in distribute_program.FLAGS:
      distribute_program.FLAGS[flag] = flag in parts[2:]
    weights, state = distribute_program.run_tf1(kfac, None, parts[0],
                                                parts[1], 1, False)
    for kind, values in (("w", weights), ("s", state)):
      for name, value in values.items():
        out["kinds/%s/%s/%s" % (spec, kind, name)] = np.asarray(value)
  return out


def cond_uses():
  """The registration check's use count of a variable that a conditional
  reads: in both branches (one use per execution; with control flow v1 the
  variable feeds a Switch in each branch, as a fused BatchNormalization with
  no learning phase set does), and twice outside any conditional (two uses,
  registered once: a problem). {"uses/<case>": number of problems}."""
  out = {}
  for case in ("both_branches", "outside_twice"):
    with tf.Graph().as_default():
      x = tf.constant(np.arange(12.0).reshape(4, 3))
      pred = tf.compat.v1.placeholder_with_default(True, [])
      w = tf.compat.v1.get_variable("w", initializer=np.ones((3, 2)),
                                    use_resource=True)
      if case == "both_branches":
        y = tf.cond(pred, lambda: tf.matmul(x, w),
                    lambda: 2.0 * tf.matmul(x, w))
      else:
        y = tf.matmul(x, w) + tf.matmul(2.0 * x, w)
      lc = kfac.LayerCollection()
      lc.register_fully_connected(w, x, y)
      lc.register_squared_error_loss(y)
      problems = lc._use_problems([w])  # pylint: disable=protected-access
      out["uses/" + case] = np.asarray(len(problems))
  return out


# Scenario name -> builder; legacy_mode_program.py takes names from here.
SCENARIOS = {
    "inverse_thresholds": inverse_thresholds,
    "float32_bound": float32_bound,
    "factored_choice": factored_choice,
    "wide_training": wide_training,
    "cond_uses": cond_uses,
    "kinds_fast": lambda: layer_kinds(LAYER_KINDS_FAST),
    "kinds_slow": lambda: layer_kinds(LAYER_KINDS_SLOW),
}
for _case in FACTORED_CASES:
  SCENARIOS["factored_" + _case] = (
      lambda case=_case: factored_training(case))
  SCENARIOS["plain_" + _case] = (
      lambda case=_case: factored_training(case, plain=True))


def run(names):
  out = {}
  for name in names:
    out.update(SCENARIOS[name]())
  return out
