"""examples/benchmarks/graph_ops.py, which tree_step_time.py uses to show
that two source trees build the same step graph: programs that create the
same ops in the same order print the same record, and any other op, or
another order, changes it."""

import os
import pathlib
import subprocess
import sys

import kfac

BENCHMARKS = pathlib.Path(os.path.realpath(kfac.__file__)).parents[1] / (
    "examples/benchmarks")

PROGRAM = """
import sys
sys.path.insert(0, %r)
import graph_ops
graph_ops.install()
import tensorflow as tf
@tf.function
def f(x):
  %s
  return tf.cond(x[0] > 0, lambda: x * 2.0, lambda: x - 1.0)
f(tf.constant([1.0, 2.0]))
with tf.Graph().as_default():
  tf.constant(1.0) + tf.constant(2.0)
"""


def _record(body):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  out = subprocess.run([sys.executable, "-c", PROGRAM % (str(BENCHMARKS),
                                                          body)],
                       env=env, capture_output=True, text=True, timeout=300,
                       check=True).stdout
  sys.path.insert(0, str(BENCHMARKS))
  try:
    import graph_ops  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.pop(0)
  return graph_ops.parse(out)


def test_the_same_ops_print_the_same_record_and_others_do_not():
  one = _record("y = tf.square(x) + tf.abs(x)")
  again = _record("y = tf.square(x) + tf.abs(x)")
  assert one == again
  counts = one["counts"]
  # The tf.function's graph, its two conditional branches, the TF1 graph.
  assert counts["FuncGraph"] > 0 and counts["CondBranchFuncGraph"] >= 2
  assert counts["Graph"] >= 3
  swapped = _record("y = tf.abs(x) + tf.square(x)")
  assert swapped["counts"] == one["counts"]  # as many ops, in another order
  assert swapped["types_sha256"] != one["types_sha256"]
  other = _record("y = tf.square(x) + tf.sqrt(x)")
  assert other["types_sha256"] != one["types_sha256"]
