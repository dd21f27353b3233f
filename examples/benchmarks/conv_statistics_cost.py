r"""What K-FAC's convolution statistics cost, next to one gradient step.

Layer: a 3x3 convolution, SAME padding, stride 1, 64 -> 64 channels with a
bias, on [batch, 32, 32, 64] float32 inputs (batch 128 by default), i.e.
L = 1024 output locations per example and patches of K*C = 576 entries
(577 with the bias). Measured in one process, each piece in its own
tf.function, as the median of --repeats timed calls after warm-up calls
(calls interleaved: one call of every piece per round):

  gradient step     forward + backward of the conv and a cheap loss
                    (sum of tanh(pre)^2), gradients w.r.t. filter and bias
  A (kron)          the KFC input statistic from all N*L patches (and,
                    separately, the patch extraction it contains)
  A (kron), sub-sampled
                    sub_sample_inputs / sub_sample_patches variants
  A (kron_sua)      the SUA input statistic (channel moments only)
  A (kron_reduce)   the KFAC-reduce input statistic (location sums)
  G                 the output-gradient statistic (N*L rows of 64)
  inverse update    damped inverses of A and G (pi rule), as refreshed
                    every `invert_every` steps

The statistics are timed as the factor's moving-average update op
(statistic + EMA assign), with the output gradients given as a tensor.
Memory: bytes of the factor statistics (and of one inverse each) and of the
patch matrix that the full kron statistic materialises.

  python examples/benchmarks/conv_statistics_cost.py [--batch=128] \
      [--output_dir=examples/benchmarks/results]
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import tensorflow as tf

import machine  # (examples/benchmarks, the script's folder)
import results_files

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
from kfac.python.ops.layers.conv import factors as conv_factors
from kfac.python.ops.layers.conv import sua_factor
from kfac.python.ops.layers.base import damping as damping_lib
from kfac.python.ops.layers.conv import patches as patches_lib
from kfac.python.ops.tensors import state


def _interleaved_medians(fns, repeats, warmup):
  """Median seconds per call of each fn; the calls are interleaved (one
  call of every fn per round) so that machine noise hits all alike."""
  for fn in fns:
    for _ in range(warmup):
      fn()
  times = [[] for _ in fns]
  for _ in range(repeats):
    for fn, out in zip(fns, times):
      start = time.perf_counter()
      fn()
      out.append(time.perf_counter() - start)
  return [statistics.median(t) for t in times]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--side", type=int, default=32)
  parser.add_argument("--channels", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--output_dir", default=None,
                      help="Where to write conv_statistics_cost.md and .json "
                      "(the tables the docs show); none: print only.")
  args = parser.parse_args(argv)

  n, side, c = args.batch, args.side, args.channels
  rng = np.random.RandomState(0)
  x = tf.constant(rng.randn(n, side, side, c).astype(np.float32))
  g = tf.constant((1e-3 * rng.randn(n, side, side, c)).astype(np.float32))
  w = tf.Variable((0.05 * rng.randn(3, 3, c, c)).astype(np.float32))
  b = tf.Variable(np.zeros(c, np.float32))
  filter_shape = (3, 3, c, c)
  store = state.StateStore("conv_cost")

  @tf.function
  def gradient_step():
    with tf.GradientTape() as tape:
      pre = tf.nn.conv2d(x, w, 1, "SAME") + b
      loss = tf.reduce_sum(tf.square(tf.tanh(pre)))
    return tape.gradient(loss, [w, b])

  def input_factor(name, **kwargs):
    factor = conv_factors.ConvInputKroneckerFactor(
        (x,), filter_shape, "SAME", (1, 1), (1, 1), None, None, True,
        kwargs.get("sub_sample_inputs"), kwargs.get("sub_sample_patches"))
    factor.set_name(name)
    return factor

  factors = [
      ("A (kron), all patches", input_factor("a_full")),
      ("A (kron), sub_sample_inputs=%d (N/2 examples)" % -(-n // 2),
       input_factor("a_in", sub_sample_inputs=-(-n // 2))),
      ("A (kron), sub_sample_inputs=16",
       input_factor("a_in16", sub_sample_inputs=16)),
      ("A (kron), sub_sample_patches=True (8 * 577 rows)",
       input_factor("a_patch", sub_sample_patches=True)),
      ("A (kron), sub_sample_patches=32768",
       input_factor("a_patch32k", sub_sample_patches=32768)),
      ("A (kron_sua), channel moments",
       sua_factor.ConvInputSUAKroneckerFactor((x,), filter_shape, True)),
      ("A (kron_reduce), location sums",
       conv_factors.ConvInputReduceKroneckerFactor(
           (x,), filter_shape, "SAME", (1, 1), (1, 1), None, True)),
      ("G (kron), output gradients",
       conv_factors.ConvOutputKroneckerFactor(((g,),))),
  ]
  for i, (_, factor) in enumerate(factors):
    if factor.name == type(factor).__name__:
      factor.set_name("f%d" % i)
    factor.attach_state_store(store)
    factor.instantiate_cov_variables()

  spec = patches_lib.make_conv_spec((3, 3), 1, 1, "SAME")

  @tf.function
  def extraction_only():
    return tf.reduce_sum(patches_lib.extract_patches(x, spec)[:, 0, 0, 0])

  pieces = [("gradient step (forward + backward)", gradient_step),
            ("(patch extraction alone, part of A (kron))", extraction_only)]
  for label, factor in factors:
    def update(f=factor):
      f.make_covariance_update_op(0.95)  # runs: tf.function keeps effects
    pieces.append((label, tf.function(update)))

  # Inverse update of the kron factors (A full, G), pi-damped.
  a_factor, g_factor = factors[0][1], factors[-1][1]
  dfunc = damping_lib.as_damping_func(1e-3 / (side * side))
  in_d, out_d = damping_lib.pi_adjusted_damping_funcs(a_factor, g_factor,
                                                      dfunc)
  a_factor.register_matpower(-1, in_d)
  g_factor.register_matpower(-1, out_d)
  for f in (a_factor, g_factor):
    f.instantiate_inv_variables()

  @tf.function
  def inverse_update():
    a_factor.make_inverse_update_ops()
    g_factor.make_inverse_update_ops()

  pieces.append(("inverse update (A^-1 and G^-1, every invert_every steps)",
                 inverse_update))
  medians = _interleaved_medians([fn for _, fn in pieces], args.repeats,
                                 args.warmup)
  rows = [(label, t) for (label, _), t in zip(pieces, medians)]
  t_grad = medians[0]
  updates = dict(rows)

  dim_a = 9 * c + 1
  patches_bytes = n * side * side * 9 * c * 4
  mem = [
      ("A statistic [%d, %d] float32" % (dim_a, dim_a), dim_a * dim_a * 4),
      ("G statistic [%d, %d] float32" % (c, c), c * c * 4),
      ("one inverse each of A and G", (dim_a * dim_a + c * c) * 4),
      ("kron_sua statistic [%d, %d] (+ [%d, %d] and [%d, %d] per power)" %
       (c + 1, c + 1, c, c, c + 1, c + 1), (c + 1) * (c + 1) * 4),
      ("patch matrix of the full kron statistic [%d, %d]" %
       (n * side * side, 9 * c), patches_bytes),
      ("layer inputs [%d, %d, %d, %d]" % (n, side, side, c),
       n * side * side * c * 4),
  ]

  head = ("Machine: %s, %d logical CPUs; TensorFlow %s; batch %d, %dx%dx%d "
          "inputs, 3x3 SAME conv to %d channels, float32; median of %d "
          "calls." % (machine.cpu_name(), os.cpu_count(), tf.__version__, n,
                      side, side, c, c, args.repeats))
  cost = ["| piece | ms | x gradient step |", "|---|---:|---:|"]
  for label, seconds in rows:
    cost.append("| %s | %.1f | %.2f |" % (label, 1e3 * seconds,
                                          seconds / t_grad))
  full = updates[factors[0][0]] + updates[factors[-1][0]]
  cost.append("| **statistics update, kron (A + G)** | %.1f | %.2f |" %
              (1e3 * full, full / t_grad))
  memory = ["| memory | bytes | MiB |", "|---|---:|---:|"]
  for label, size in mem:
    memory.append("| %s | %d | %.2f |" % (label, size, size / 2.0**20))
  tables = {"machine": head, "cost": "\n".join(cost),
            "memory": "\n".join(memory)}
  text = "\n\n".join((head, tables["cost"], tables["memory"])) + "\n"
  print(text)
  if args.output_dir:
    results_files.write(
        args.output_dir, "conv_statistics_cost", text,
        dict(args=vars(args), tables=tables,
             ms={label: 1e3 * sec for label, sec in rows}, bytes=dict(mem)))
    print("Wrote conv_statistics_cost.md and .json to %s" % args.output_dir)

if __name__ == "__main__":
  main()
