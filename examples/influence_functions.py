r"""Influence functions and a Laplace evidence with EKFAC on Fashion-MNIST.

1. Trains a small classifier (784 -> hidden tanh -> 10) with Adam.
2. Builds the damped EKFAC approximation of its GGN over the training set
   in one pass (`kfac.linear_operator.curvature_from_data`, approx
   "ekfac") and, with it, the influence of every training image on the
   loss of a test image (Koh & Liang 2017):

     I(z_i, z_test) = - grad L(z_test)^T (G + damping I)^-1 grad L(z_i)

   (the change of the test loss when z_i is up-weighted: negative values
   help the prediction, positive ones harm it). Writes the most helpful and
   most harmful training images as a PNG grid.
3. Checks the inverse-curvature products: on a subset of the training set
   it builds EKFAC and K-FAC from that subset and solves
   (G + damping I) x = grad L(z_test) with conjugate gradients on the exact
   damped GGN of the subset (`ExactCurvatureOperator`); reports the
   relative error of EKFAC's and K-FAC's solution (the damping added to
   their eigenvalues, and for K-FAC also split between its factors by the
   pi rule, as the optimizer does), against the exact solve and against
   the exact GGN's diagonal blocks' (the best a block-diagonal
   approximation can do), and the correlation of their influence scores
   with the exact ones.
4. Picks the prior precision delta by the Laplace approximation of the log
   marginal likelihood (MacKay 1992; Immer et al. 2021):

     log p(D | delta) ~= sum_i log p(y_i | x_i, w) - delta/2 |w|^2
                         + P/2 log delta - 1/2 log det(N G + delta I)

   with log det(N G + delta I) = sum_k log(N e_k + delta) from the
   eigenvalues e_k of the undamped operator (`eigenvalues()`, exact for
   the EKFAC / K-FAC blocks), over a grid of delta; plots it for EKFAC and
   K-FAC.

  python examples/influence_functions.py                 # about 3 minutes
  python examples/influence_functions.py --train_examples=2000 --epochs=2
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import classifier_common

import kfac

FLAGS = flags.FLAGS
flags.DEFINE_integer("train_examples", 10000, "Training images used.")
flags.DEFINE_integer("hidden", 32, "Hidden units.")
flags.DEFINE_integer("epochs", 4, "Adam epochs.")
flags.DEFINE_integer("batch_size", 250, "Batch size (training and passes).")
flags.DEFINE_float("damping", 1e-3, "Damping of the influence products.")
flags.DEFINE_list("check_dampings", ["1e-3", "1e-2", "1e-1"],
                  "Dampings of the exact (CG) comparison.")
flags.DEFINE_integer("check_examples", 500,
                     "Training subset of the exact (CG) comparison.")
flags.DEFINE_integer("test_index", 0, "The test image explained.")
flags.DEFINE_integer("show", 8, "Helpful / harmful images shown.")
flags.DEFINE_string("output_dir", "influence_results", "Where to write.")
flags.DEFINE_integer("seed", 0, "Seed of the weights and the data order.")

CLASSES = ("T-shirt", "Trouser", "Pullover", "Dress", "Coat", "Sandal",
           "Shirt", "Sneaker", "Bag", "Boot")


def make_variables(hidden, seed):
  rng = np.random.RandomState(seed)
  shapes = {"w1": (784, hidden), "w2": (hidden, 10)}
  out = []
  for name in ("w1", "b1", "w2", "b2"):
    if name.startswith("w"):
      fan_in = shapes[name][0]
      value = rng.randn(*shapes[name]) / np.sqrt(fan_in)
    else:
      value = np.zeros(shapes["w" + name[1]][1])
    out.append(tf.Variable(value.astype(np.float32), name=name))
  return out


def logits_of(variables, x, lc=None, approx="ekfac"):
  w1, b1, w2, b2 = variables
  pre = tf.matmul(x, w1) + b1
  h = tf.tanh(pre)
  logits = tf.matmul(h, w2) + b2
  if lc is not None:
    lc.register_fully_connected((w1, b1), x, pre, approx=approx)
    lc.register_fully_connected((w2, b2), h, logits, approx=approx)
  return logits


def model_fn_for(variables, approx):
  def model_fn(batch, lc):
    x, y = batch
    logits = logits_of(variables, x, lc, approx)
    lc.register_softmax_cross_entropy_loss(logits, targets=y)
  return model_fn


def per_example_losses(variables, x, y):
  return tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=y, logits=logits_of(variables, x))


def train(variables, x, y, epochs, batch_size, seed):
  opt = tf.keras.optimizers.Adam(3e-3)

  @tf.function
  def step(bx, by):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(per_example_losses(variables, bx, by))
    opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return loss

  rng = np.random.RandomState(seed)
  for epoch in range(epochs):
    perm = rng.permutation(len(x))
    losses = [float(step(x[perm[i:i + batch_size]], y[perm[i:i + batch_size]]))
              for i in range(0, len(x) - batch_size + 1, batch_size)]
    print("epoch %d  loss %.4f" % (epoch + 1, np.mean(losses)), flush=True)


def flat_gradients(variables, x, y, batch_size):
  """Per-example loss gradients, [N, P] (flattened like the operator)."""
  @tf.function
  def jac(bx, by):
    with tf.GradientTape() as tape:
      losses = per_example_losses(variables, bx, by)
    parts = tape.jacobian(losses, variables)
    return tf.concat([tf.reshape(p, [tf.shape(bx)[0], -1]) for p in parts],
                     axis=1)
  return np.concatenate([jac(x[i:i + batch_size], y[i:i + batch_size]).numpy()
                         for i in range(0, len(x), batch_size)])


def dataset(x, y, batch_size):
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)


def operator_from(variables, x, y, approx, damping, batch_size, verbose=1):
  return kfac.linear_operator.curvature_from_data(
      model_fn_for(variables, approx), dataset(x, y, batch_size),
      damping=damping, estimation_mode="exact", verbose=verbose,
      log_every=max(1, len(x) // batch_size // 2))


def _rel(value, reference):
  return float(np.linalg.norm(value - reference) / np.linalg.norm(reference))


def output_layer_frobenius(variables, x, y, ops):
  """||F - approximation||_F / ||F||_F of the output layer's block (small
  enough for the exact GGN block as a dense matrix)."""
  exact = kfac.linear_operator.ExactCurvatureOperator(
      model_fn_for(variables, "kron"), (tf.constant(x), tf.constant(y)),
      curvature="ggn", variables=variables[2:])
  fisher = exact.to_dense().numpy().astype(np.float64)
  out = {}
  for approx, op in ops.items():
    block = op.layer_collection.get_blocks()[1]
    dense = block.full_fisher_block().numpy().astype(np.float64)
    out[approx] = float(np.linalg.norm(fisher - dense) /
                        np.linalg.norm(fisher))
  return out


def check_against_cg(variables, x, y, g_test, grads, dampings, batch_size):
  """EKFAC / K-FAC solves against CG on the exact damped GGN of (x, y), for
  each damping: {damping: {"ekfac": ..., "kron": ..., "cg_...": ...}}."""
  ops = {approx: operator_from(variables, x, y, approx, dampings[0],
                               batch_size, verbose=0)
         for approx in ("ekfac", "kron")}
  out = {"frobenius": output_layer_frobenius(variables, x, y, ops)}
  for damping in dampings:
    exact = kfac.linear_operator.ExactCurvatureOperator(
        model_fn_for(variables, "kron"), (tf.constant(x), tf.constant(y)),
        curvature="ggn", damping=damping, tolerance=1e-6, max_iter=3000)
    start = time.time()
    reference = exact.solvevec(tf.constant(g_test)).numpy()
    row = {"cg_seconds": time.time() - start, "examples": len(x),
           "cg_relative_residual": float(
               np.linalg.norm(exact.matvec(tf.constant(reference)).numpy() -
                              g_test) / np.linalg.norm(g_test))}
    ref_scores = -grads @ reference
    # The best any block-diagonal approximation can do: the exact GGN's
    # diagonal blocks (one per layer), each solved by CG.
    blocks, start = [], 0
    for layer in (variables[:2], variables[2:]):
      size = sum(int(np.prod(v.shape)) for v in layer)
      part = kfac.linear_operator.ExactCurvatureOperator(
          model_fn_for(variables, "kron"), (tf.constant(x), tf.constant(y)),
          curvature="ggn", damping=damping, variables=layer, tolerance=1e-6,
          max_iter=3000)
      blocks.append(part.solvevec(tf.constant(
          g_test[start:start + size])).numpy())
      start += size
    block_reference = np.concatenate(blocks)
    row["block_exact"] = {"relative_error": _rel(block_reference, reference)}
    # The same damping for both: added to the eigenvalues (EKFAC's damping;
    # for K-FAC also its pi split, the optimizer's, which adds more).
    variants = [("ekfac", ops["ekfac"], kfac.linear_operator.EigenvalueDamping(
        damping)), ("kron", ops["kron"], kfac.linear_operator.EigenvalueDamping(
            damping)), ("kron_pi", ops["kron"], damping)]
    for approx, op, how in variants:
      damped = kfac.linear_operator.CurvatureOperator(op.layer_collection,
                                                      damping=how)
      solution = damped.solvevec(tf.constant(g_test)).numpy()
      scores = -grads @ solution
      row[approx] = {
          "relative_error": _rel(solution, reference),
          "block_relative_error": _rel(solution, block_reference),
          "score_correlation": float(np.corrcoef(scores, ref_scores)[0, 1])}
    out["%g" % damping] = row
  return out


def laplace_evidence(op, variables, x, y, deltas):
  """Log marginal likelihoods over `deltas` (see the module docstring).

  The prior adds delta to N times the curvature's eigenvalues exactly (the
  undamped operator's `eigenvalues()`, exact for Kronecker and EKFAC
  blocks), not by the pi rule the optimizer's damping uses."""
  n = float(len(x))
  w = np.concatenate([v.numpy().reshape(-1) for v in variables])
  p = float(len(w))
  log_lik = -float(tf.reduce_sum(per_example_losses(variables, x, y)))
  evals = kfac.linear_operator.CurvatureOperator(
      op.layer_collection, damped=False).eigenvalues().numpy()
  evals = np.maximum(evals.astype(np.float64), 0.0)
  return [log_lik - 0.5 * delta * float(w @ w) + 0.5 * p * np.log(delta) -
          0.5 * float(np.sum(np.log(n * evals + delta))) for delta in deltas]


def save_grid(path, test_image, test_label, predicted, train_x, train_y,
              helpful, harmful, scores):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  cols = len(helpful)
  fig, axes = plt.subplots(3, cols, figsize=(1.6 * cols, 5.6))
  for ax in axes.ravel():
    ax.axis("off")
  axes[0, 0].imshow(test_image.reshape(28, 28), cmap="gray")
  axes[0, 0].set_title("test: %s\npredicted %s" % (
      CLASSES[test_label], CLASSES[predicted]), fontsize=8)
  for row, (name, idx) in enumerate((("helpful", helpful),
                                     ("harmful", harmful)), start=1):
    for col, i in enumerate(idx):
      axes[row, col].imshow(train_x[i].reshape(28, 28), cmap="gray")
      axes[row, col].set_title("%s %s\n%.2g" % (name, CLASSES[train_y[i]],
                                                scores[i]), fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def save_evidence_plot(path, deltas, curves):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for name, values in curves.items():
    ax.semilogx(deltas, values, marker="o", label=name)
  ax.set_xlabel("prior precision delta")
  ax.set_ylabel("Laplace log marginal likelihood")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv):
  del argv
  tf.random.set_seed(FLAGS.seed)
  name, train_data, test_data = classifier_common.load_classification_data(
      "fashion_mnist", FLAGS.train_examples)
  if name != "fashion_mnist":
    raise SystemExit("Fashion-MNIST not found: run `make data`.")
  x = train_data.images.reshape(-1, 784).astype(np.float32)
  y = train_data.labels.astype(np.int32)
  os.makedirs(FLAGS.output_dir, exist_ok=True)

  variables = make_variables(FLAGS.hidden, FLAGS.seed)
  train(variables, x, y, FLAGS.epochs, FLAGS.batch_size, FLAGS.seed)
  test_x = test_data.images[FLAGS.test_index].reshape(1, 784).astype(
      np.float32)
  test_y = np.array([test_data.labels[FLAGS.test_index]], np.int32)
  predicted = int(np.argmax(logits_of(variables, test_x).numpy()))

  # Influence of every training image with EKFAC over the training set.
  start = time.time()
  op = operator_from(variables, x, y, "ekfac", FLAGS.damping,
                     FLAGS.batch_size)
  build_seconds = time.time() - start
  g_test = flat_gradients(variables, test_x, test_y, 1)[0]
  s_test = op.solvevec(tf.constant(g_test)).numpy()
  grads = flat_gradients(variables, x, y, FLAGS.batch_size)
  scores = -grads @ s_test
  order = np.argsort(scores)
  helpful, harmful = order[:FLAGS.show], order[::-1][:FLAGS.show]
  grid = os.path.join(FLAGS.output_dir, "influence_grid.png")
  save_grid(grid, test_x[0], int(test_y[0]), predicted, x, y, helpful,
            harmful, scores)
  print("influence: EKFAC over %d images built in %.1f s; most helpful "
        "labels %s, most harmful %s; %s" % (
            len(x), build_seconds, [CLASSES[y[i]] for i in helpful[:4]],
            [CLASSES[y[i]] for i in harmful[:4]], grid), flush=True)

  # Inverse-curvature products against CG on the exact damped GGN.
  m = FLAGS.check_examples
  dampings = [float(d) for d in FLAGS.check_dampings]
  check = check_against_cg(variables, x[:m], y[:m], g_test, grads[:m],
                           dampings, min(FLAGS.batch_size, m))
  print("output layer block: ||F - EKFAC|| / ||F|| = %.3f, K-FAC %.3f" % (
      check["frobenius"]["ekfac"], check["frobenius"]["kron"]), flush=True)
  for damping, row in check.items():
    if damping == "frobenius":
      continue
    print("check on %d images, damping %s (CG %.1f s, residual %.1e): "
          "exact diagonal blocks: relative error %.3f" % (
              m, damping, row["cg_seconds"], row["cg_relative_residual"],
              row["block_exact"]["relative_error"]), flush=True)
    for approx in ("ekfac", "kron", "kron_pi"):
      print("  %-7s relative error %.3f (to the exact diagonal blocks' "
            "solve %.3f), influence score correlation %.3f" % (
                approx, row[approx]["relative_error"],
                row[approx]["block_relative_error"],
                row[approx]["score_correlation"]), flush=True)

  # Laplace evidence over the prior precision.
  deltas = list(np.logspace(-1, 3, 9))
  curves = {"ekfac": laplace_evidence(op, variables, x, y, deltas)}
  kron = operator_from(variables, x, y, "kron", FLAGS.damping,
                       FLAGS.batch_size, verbose=0)
  curves["kron"] = laplace_evidence(kron, variables, x, y, deltas)
  best = {k: float(deltas[int(np.argmax(v))]) for k, v in curves.items()}
  save_evidence_plot(os.path.join(FLAGS.output_dir, "laplace_evidence.png"),
                     deltas, curves)
  print("laplace: best prior precision EKFAC %.3g, K-FAC %.3g" %
        (best["ekfac"], best["kron"]), flush=True)

  results = {"tables": {"check": check_table(check),
                        "laplace": "| | EKFAC | K-FAC |\n|---|---:|---:|\n"
                                   "| best prior precision | %.3g | %.3g |" %
                                   (best["ekfac"], best["kron"])},
             "train_examples": len(x), "test_index": FLAGS.test_index,
             "test_label": int(test_y[0]), "predicted": predicted,
             "helpful": [int(i) for i in helpful],
             "harmful": [int(i) for i in harmful],
             "helpful_scores": [float(scores[i]) for i in helpful],
             "harmful_scores": [float(scores[i]) for i in harmful],
             "check": check, "deltas": [float(d) for d in deltas],
             "evidence": curves, "best_delta": best,
             "build_seconds": build_seconds}
  with open(os.path.join(FLAGS.output_dir, "results.json"), "w") as f:
    json.dump(results, f, indent=1)


def check_table(check):
  """The inverse-product check as markdown: per damping, the relative error
  of each solution to the exact solve (and the influence scores'
  correlation with the exact ones)."""
  lines = ["| damping | exact diagonal blocks | EKFAC | K-FAC, damping on the "
           "eigenvalues | K-FAC, pi split (the optimizer's) |",
           "|---|---:|---:|---:|---:|"]
  for damping, row in check.items():
    if damping == "frobenius":
      continue
    lines.append("| %s | %.3f | %s |" % (
        damping, row["block_exact"]["relative_error"], " | ".join(
            "%.3f (corr. %.3f)" % (row[a]["relative_error"],
                                   row[a]["score_correlation"])
            for a in ("ekfac", "kron", "kron_pi"))))
  lines += ["", "Output layer's block: relative Frobenius distance to the "
            "exact GGN block %.3f (EKFAC), %.3f (K-FAC)." % (
                check["frobenius"]["ekfac"], check["frobenius"]["kron"])]
  return "\n".join(lines)


if __name__ == "__main__":
  app.run(main)
