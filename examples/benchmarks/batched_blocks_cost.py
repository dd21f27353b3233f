r"""What batching the per-block preconditioning across same-shape blocks
would save (issue 53's last unmeasured design option).

K-FAC's step preconditions each Kronecker block's gradient on its own:
reshape the gradient to its [d_in, d_out] matrix view, multiply on the left
by the input factor's damped inverse and on the right by the output
factor's, scale, reshape back: one small op chain per block, run one after
another by TensorFlow's executor. On convnets with many layers
(MobileNetV2: 105 blocks) the executor's per-op work was measured as about
a fifth of the step (docs/recipe.md, "Where a step goes"). Blocks whose
factors have the same shapes could be preconditioned in one batched
product instead: stack their gradients, one batched matmul per side with
the inverses kept stacked, unstack.

This program measures both forms on the Kronecker blocks of a zoo model
(examples/benchmarks/zoo_models.py): every Conv2D and Dense layer of the
model (the layers Kfac's default registers as `kron` blocks) gives a block
with d_in = kernel rows (k_h k_w c_in, or the Dense input) plus one for a
bias and d_out = the output channels; depthwise convolutions, normalisation
and embedding layers are left out (their blocks are already one batched op
or diagonal). Inverses are float32 variables (stacked per shape group in
the batched form, as that form would store them), the gradients are
variables read at each call (as the backward pass hands them over, one
tensor per layer), and each form returns one preconditioned tensor per
layer. Timed: CPU seconds per call of each form's tf.function, TensorFlow
pinned to one thread (the validation benchmark's setting) or left at its
default (--threads=0), best of --rounds rounds of --calls calls, the forms
interleaved round by round; the two forms' results are compared
(rtol 1e-5).

  python examples/benchmarks/batched_blocks_cost.py \
      --models=mobilenetv2,efficientnetb0,bn_resnet,vit,gpt \
      --output_dir=bench_results

Writes batched_blocks_cost.json and batched_blocks_cost.md in
--output_dir.
"""

import argparse
import collections
import datetime
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import machine


def kron_shapes(model):
  """[(d_in, d_out)] of the model's Conv2D and Dense layers, in order."""
  import keras
  out = []
  for layer in _all_layers(model):
    if isinstance(layer, keras.layers.DepthwiseConv2D):
      continue
    if isinstance(layer, (keras.layers.Conv2D, keras.layers.Dense)):
      kernel = layer.kernel.shape
      d_in = int(np.prod(kernel[:-1])) + (1 if layer.use_bias else 0)
      out.append((d_in, int(kernel[-1])))
  return out


def _all_layers(model):
  import keras
  for layer in model.layers:
    if isinstance(layer, keras.Model):
      yield from _all_layers(layer)
    else:
      yield layer
      # MultiHeadAttention's projections are EinsumDense, not Dense: the
      # zoo's transformers contribute their MLP and head layers only.


def build_forms(shapes, seed=0):
  """(per_block_fn, batched_fn, n_groups, (a_inv, b_inv, grads)): two
  tf.functions computing the same preconditioned gradients, the number of
  shape groups, and their numpy inputs (for a reference)."""
  import tensorflow as tf
  rng = np.random.default_rng(seed)

  def spd_inverse(n):
    a = rng.standard_normal((n, 2 * n)).astype(np.float32) / np.sqrt(2 * n)
    return np.linalg.inv(a @ a.T + np.eye(n, dtype=np.float32)).astype(
        np.float32)

  a_inv = [spd_inverse(i) for i, _ in shapes]
  b_inv = [spd_inverse(o) for _, o in shapes]
  # Gradients in the layer's own shape flattened to [d_in * d_out] (the
  # form a kernel-and-bias pair reaches the block in).
  grads_np = [rng.standard_normal(i * o).astype(np.float32)
              for i, o in shapes]
  grads = [tf.Variable(g) for g in grads_np]
  a_vars = [tf.Variable(m) for m in a_inv]
  b_vars = [tf.Variable(m) for m in b_inv]
  scale = tf.constant(0.5)

  groups = collections.OrderedDict()
  for k, shape in enumerate(shapes):
    groups.setdefault(shape, []).append(k)
  a_stacked = {s: tf.Variable(np.stack([a_inv[k] for k in ks]))
               for s, ks in groups.items()}
  b_stacked = {s: tf.Variable(np.stack([b_inv[k] for k in ks]))
               for s, ks in groups.items()}

  @tf.function
  def per_block():
    out = []
    for k, (i, o) in enumerate(shapes):
      mat = tf.reshape(grads[k], [i, o])
      mat = tf.matmul(a_vars[k], mat)
      mat = tf.matmul(mat, b_vars[k])
      out.append(tf.reshape(mat * scale, [-1]))
    return out

  @tf.function
  def batched():
    out = [None] * len(shapes)
    for (i, o), ks in groups.items():
      if len(ks) == 1:
        k = ks[0]
        mat = tf.reshape(grads[k], [i, o])
        mat = tf.matmul(a_stacked[(i, o)][0], mat)
        out[k] = tf.reshape(tf.matmul(mat, b_stacked[(i, o)][0]) * scale,
                            [-1])
        continue
      mats = tf.reshape(tf.stack([grads[k] for k in ks]), [len(ks), i, o])
      mats = tf.matmul(a_stacked[(i, o)], mats)
      mats = tf.matmul(mats, b_stacked[(i, o)]) * scale
      for j, piece in enumerate(tf.unstack(tf.reshape(mats,
                                                      [len(ks), -1]))):
        out[ks[j]] = piece
    return out

  return per_block, batched, len(groups), (a_inv, b_inv, grads_np)


def _op_count(fn):
  return len(fn.get_concrete_function().graph.get_operations())


def time_forms(fns, calls, rounds):
  """Best CPU and wall ms per call of each fn, interleaved round by
  round."""
  for fn in fns:
    fn()
  cpu = [[] for _ in fns]
  wall = [[] for _ in fns]
  for _ in range(rounds):
    for j, fn in enumerate(fns):
      c0, w0 = time.process_time(), time.perf_counter()
      for _ in range(calls):
        fn()
      cpu[j].append((time.process_time() - c0) / calls * 1e3)
      wall[j].append((time.perf_counter() - w0) / calls * 1e3)
  return [min(c) for c in cpu], [min(w) for w in wall]


def measure(name, calls, rounds):
  import tensorflow as tf
  import zoo_models
  model = zoo_models.build(name)
  shapes = kron_shapes(model)
  per_block, batched, n_groups, _ = build_forms(shapes)
  a = per_block()
  b = batched()
  for x, y in zip(a, b):
    np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=1e-5, atol=1e-5)
  (cpu_pb, cpu_b), (wall_pb, wall_b) = time_forms([per_block, batched],
                                                  calls, rounds)
  flops = sum(2 * i * o * (i + o) for i, o in shapes)
  del tf
  return {"model": name, "blocks": len(shapes), "shape_groups": n_groups,
          "blocks_in_shared_groups": sum(
              1 for s in shapes if shapes.count(s) > 1),
          "gflop_per_call": flops / 1e9,
          "ops_per_block_form": _op_count(per_block),
          "ops_batched_form": _op_count(batched),
          "cpu_ms_per_block": cpu_pb, "cpu_ms_batched": cpu_b,
          "wall_ms_per_block": wall_pb, "wall_ms_batched": wall_b}


def table(rows):
  lines = [
      "| model | Kronecker blocks | shape groups (blocks sharing a shape) "
      "| GFLOP | graph ops, per block / batched | CPU ms, per block "
      "| CPU ms, batched | saved | wall ms, per block / batched |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(
        "| %s | %d | %d (%d) | %.3f | %d / %d | %.2f | %.2f | %.2f ms "
        "(%.0f %%) | %.2f / %.2f |" % (
            r["model"], r["blocks"], r["shape_groups"],
            r["blocks_in_shared_groups"], r["gflop_per_call"],
            r["ops_per_block_form"], r["ops_batched_form"],
            r["cpu_ms_per_block"], r["cpu_ms_batched"],
            r["cpu_ms_per_block"] - r["cpu_ms_batched"],
            100 * (1 - r["cpu_ms_batched"] / r["cpu_ms_per_block"]),
            r["wall_ms_per_block"], r["wall_ms_batched"]))
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default="mobilenetv2,efficientnetb0,"
                      "bn_resnet,vit,gpt")
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--threads", type=int, default=1,
                      help="TensorFlow threads (0: its default)")
  parser.add_argument("--output_dir", default="bench_results")
  args = parser.parse_args(argv)
  import tensorflow as tf
  if args.threads:
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
  rows = []
  for name in args.models.split(","):
    rows.append(measure(name, args.calls, args.rounds))
    print(table(rows[-1:]), flush=True)
  os.makedirs(args.output_dir, exist_ok=True)
  head = ("Command: `python examples/benchmarks/batched_blocks_cost.py %s`; "
          "%s, %s, TF %s, %s thread(s); best of %d rounds of %d calls.\n\n"
          % (" ".join(sys.argv[1:] if argv is None else argv),
             datetime.date.today().isoformat(), machine.cpu_name(),
             tf.__version__, args.threads or "default", args.rounds,
             args.calls))
  with open(os.path.join(args.output_dir, "batched_blocks_cost.json"),
            "w") as f:
    # "tables": what docs render from (examples/benchmarks/doc_tables.py).
    json.dump({"head": head, "rows": rows,
               "tables": {"cost": head + table(rows)}}, f, indent=1)
  with open(os.path.join(args.output_dir, "batched_blocks_cost.md"),
            "w") as f:
    f.write(head + table(rows))
  print(head + table(rows))


if __name__ == "__main__":
  main()
