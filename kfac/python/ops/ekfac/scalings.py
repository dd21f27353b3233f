"""EKFAC's eigenvalue correction: second moments of per-example gradients
rotated into a Kronecker eigenbasis, without building them where avoidable.

A layer whose weights are shared over P positions (sequence steps, conv
locations, uses) has, for example n, the gradient in its [rows, cols]
matrix view V_n = sum_p x_np g_np^T (x: inputs, with a ones entry for a
bias; g: gradients w.r.t. the outputs). In the basis Q_A (x) Q_G of the
K-FAC factors it is Q_A^T V_n Q_G = sum_p x'_np g'_np^T with x' = Q_A^T x,
g' = Q_G^T g, and EKFAC's scalings are S = mean_n (Q_A^T V_n Q_G)^2
(elementwise square): the exact diagonal of the Fisher in that basis
(George et al. 2018).

Three ways to compute S, all exact:
* P = 1: (x'_n g'_n^T)^2 = x'_n^2 (g'_n^2)^T, so S = (X'^2)^T (G'^2) / N, two
  [N, rows] and [N, cols] squares and one matmul.
* "per_example": build the rotated per-example gradients [N, rows, cols]
  and square them (memory N * rows * cols).
* "gramian": S = mean_n sum_{p,q} (x'_np . x'_nq) (g'_np . g'_nq) taken
  entrywise, i.e. einsum over the positions' pairwise products
  [N, P, P, rows] and [N, P, P, cols] (memory N * P^2 * (rows + cols)).
"auto" chooses per layer from the static shapes, by memory: per-example
gradients unless one example's needs more than PER_EXAMPLE_BUDGET entries
(16 MiB in float32) and the Gramian's needs fewer. Measured
(examples/benchmarks/ekfac_bench.py, docs/benchmarks.md), the Gramian
does P times more multiplications and was slower in every case, 1.4x at
P = 2 to 39x at P = 64, even where it needed 16x less memory; so it is the
fallback for layers whose per-example gradients would not fit, not a
speed-up.
"""

import tensorflow as tf

STRATEGIES = ("auto", "per_example", "gramian")

# Entries of one example's rotated gradient above which "auto" takes the
# Gramian when that needs less memory (2^22 floats: 16 MiB in float32, so
# 2 GiB for a batch of 128).
PER_EXAMPLE_BUDGET = 1 << 22


def check_strategy(strategy):
  if strategy not in STRATEGIES:
    raise ValueError("Unknown EKFAC scaling strategy %r; expected one of %s."
                     % (strategy, list(STRATEGIES)))
  return strategy


def choose_strategy(positions, rows, cols, strategy="auto"):
  """The strategy a layer with `positions` (a Python int or None), `rows`
  and `cols` uses: "factored" when there is one position, else the given
  one; "auto" takes per-example gradients unless they need more than
  PER_EXAMPLE_BUDGET entries per example and the Gramian fewer."""
  check_strategy(strategy)
  if positions == 1:
    return "factored"
  if strategy != "auto":
    return strategy
  per_example = rows * cols
  if positions is None or per_example <= PER_EXAMPLE_BUDGET:
    return "per_example"
  gramian = positions * positions * (rows + cols)
  return "gramian" if gramian < per_example else "per_example"


def memory_per_example(strategy, positions, rows, cols):
  """Entries of the intermediate tensor one example needs."""
  if strategy == "factored":
    return rows + cols
  if strategy == "per_example":
    return rows * cols
  return positions * positions * (rows + cols)


def rotate(x, basis):
  """x [..., n] in the basis' coordinates (x @ basis; None: identity)."""
  if basis is None:
    return x
  return tf.einsum("...i,ij->...j", x, tf.cast(basis, x.dtype))


def sum_of_squares(x, g, strategy):
  """sum_n (sum_p x_np g_np^T)^2 for x [N, P, rows], g [N, P, cols]
  (already rotated), by `strategy` ("factored" needs P = 1)."""
  if strategy == "factored":
    x2 = tf.square(tf.reshape(x, [-1, x.shape[-1]]))
    g2 = tf.square(tf.reshape(g, [-1, g.shape[-1]]))
    return tf.matmul(x2, g2, transpose_a=True)
  if strategy == "per_example":
    per_example = tf.einsum("npi,npj->nij", x, g)
    return tf.reduce_sum(tf.square(per_example), axis=0)
  if strategy == "gramian":
    xx = tf.einsum("npi,nqi->npqi", x, x)
    gg = tf.einsum("npj,nqj->npqj", g, g)
    return tf.einsum("npqi,npqj->ij", xx, gg)
  raise ValueError("Unknown EKFAC scaling strategy %r." % (strategy,))
