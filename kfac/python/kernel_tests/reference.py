"""Float64 brute-force references and a two-world test runner.

The references never use kfac code: per-example Jacobians come from
`tf.GradientTape`, output curvatures from closed forms or tape Hessians, and
everything is assembled with numpy in float64.
"""

import numpy as np
import pytest
import tensorflow as tf

WORLDS = ("graph", "function")

# For oracle tests whose TF2 run repeats the same math at a high tracing cost:
# the TF1 graph run stays in the fast tier (make test), the tf.function run
# goes to the slow tier (make test-slow). Every file keeps other tests that
# run in both worlds in the fast tier, and the TF1-vs-TF2 training tests
# (optimizer_test, keras_*_test) check that the worlds agree.
WORLDS_TF2_SLOW = ("graph",
                   pytest.param("function", marks=pytest.mark.slow))


def run_stages(world, inits, build):
  """Runs `build(variables)` in a TF1 Session graph or in one tf.function.

  `build` gets tf.Variables made from the numpy arrays `inits` and returns a
  list of stages; a stage is a tf.Operation / None (run for its effects) or a
  structure of tensors (fetched). Stages run in order. Returns the fetched
  numpy structures (None for op stages).
  """
  if world == "graph":
    with tf.Graph().as_default():
      variables = [tf.Variable(v) for v in inits]
      stages = build(variables)
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        results = []
        for stage in stages:
          fetched = sess.run(stage) if stage is not None else None
          results.append(None if _is_op(stage) else fetched)
        return results
  if world == "function":
    variables = [tf.Variable(v) for v in inits]

    @tf.function
    def fn():
      stages = build(variables)
      return [None if _is_op(s) else s for s in stages]

    out = fn()
    return tf.nest.map_structure(
        lambda t: None if t is None else t.numpy(), out)
  raise ValueError(world)


def _is_op(stage):
  return stage is None or isinstance(stage, tf.Operation)


# ---------------------------------------------------------------- models
def mlp_inits(sizes, seed=0, dtype=np.float64, bias=True, scale=0.7):
  """[W0, b0, W1, b1, ...] with W_i of shape [sizes[i], sizes[i+1]]."""
  rng = np.random.RandomState(seed)
  out = []
  for i in range(len(sizes) - 1):
    out.append((scale * rng.randn(sizes[i], sizes[i + 1])).astype(dtype))
    if bias:
      out.append((0.1 * rng.randn(sizes[i + 1])).astype(dtype))
  return out


def mlp_forward(params, x, bias=True, activation=np.tanh, record=None):
  """Forward pass of a tanh MLP (works on numpy arrays and tensors alike).

  With `record`, appends (layer params, inputs, pre-activations) per layer.
  """
  step = 2 if bias else 1
  h = x
  n_layers = len(params) // step
  act = tf.tanh if activation is np.tanh else activation
  for i in range(n_layers):
    w = params[step * i]
    pre = tf.matmul(h, w)
    layer_params = w
    if bias:
      pre = pre + params[step * i + 1]
      layer_params = (w, params[step * i + 1])
    if record is not None:
      record.append((layer_params, h, pre))
    h = pre if i == n_layers - 1 else act(pre)
  return h


def flat(arrays):
  return np.concatenate([np.reshape(a, [-1]) for a in arrays])


def per_example_jacobians(forward, inits, x):
  """J[n]: d outputs(x_n) / d flat(params), shape [N, out, P] (float64)."""
  variables = [tf.Variable(v.astype(np.float64)) for v in inits]
  x = tf.constant(x, tf.float64)
  jacs = []
  for n in range(x.shape[0]):
    with tf.GradientTape() as tape:
      out = forward(variables, x[n:n + 1])
      out = tf.reshape(out, [-1])
    parts = tape.jacobian(out, variables,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    jacs.append(np.concatenate(
        [np.reshape(p.numpy(), [out.shape[0], -1]) for p in parts], axis=1))
  return np.stack(jacs)


def outputs(forward, inits, x):
  variables = [tf.constant(v.astype(np.float64)) for v in inits]
  return forward(variables, tf.constant(x, tf.float64)).numpy()


def softmax(z):
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def sigmoid(z):
  return 1.0 / (1.0 + np.exp(-z))


def categorical_fisher(logits_row):
  p = softmax(logits_row)
  return np.diag(p) - np.outer(p, p)


def bernoulli_fisher(logits_row):
  p = sigmoid(logits_row)
  return np.diag(p * (1 - p))


def tape_hessian(fn, z_row):
  """Hessian of a scalar fn at the vector z_row (float64, via tapes)."""
  z = tf.Variable(np.asarray(z_row, np.float64))
  with tf.GradientTape() as outer:
    with tf.GradientTape() as inner:
      value = fn(z)
    grad = inner.gradient(value, z)
  return outer.jacobian(grad, z).numpy()


def curvature(jacs, out_mats):
  """(1/N) sum_n J_n^T M_n J_n."""
  total = sum(j.T @ m @ j for j, m in zip(jacs, out_mats))
  return total / len(jacs)


def empirical_fisher(per_example_grads):
  g = np.asarray(per_example_grads)
  return g.T @ g / g.shape[0]


def per_example_loss_grads(forward, inits, x, loss_fn):
  """d loss_fn(outputs(x_n), n) / d flat(params) per example, [N, P]."""
  variables = [tf.Variable(v.astype(np.float64)) for v in inits]
  x = tf.constant(x, tf.float64)
  out = []
  for n in range(x.shape[0]):
    with tf.GradientTape() as tape:
      value = loss_fn(forward(variables, x[n:n + 1]), n)
    out.append(flat([g.numpy() for g in tape.gradient(value, variables)]))
  return np.stack(out)


def pi_damped_kron(a, g, damping):
  """Dense (A + pi sqrt(l) I) kron (G + sqrt(l)/pi I), pi from traces."""
  pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
  root = np.sqrt(damping)
  return np.kron(a + pi * root * np.eye(a.shape[0]),
                 g + root / pi * np.eye(g.shape[0]))


def sym_matpower(mat, exp):
  evals, evecs = np.linalg.eigh(0.5 * (mat + mat.T))
  return (evecs * evals**exp) @ evecs.T
