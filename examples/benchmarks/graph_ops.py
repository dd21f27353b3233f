"""Counts the TensorFlow ops a program creates, by the kind of graph they go
into, and fingerprints their sequence of op types.

`install()` wraps `tf.Graph`'s op creation (every graph: a TF1 Graph, a
tf.function's FuncGraph, the conditional branches' graphs) and, at exit,
prints one line `GRAPH_OPS {"counts": {graph kind: ops}, "types_sha256":
...}`. Two runs of one program that create the same op types in the same
order, for example one training step traced from two source trees of kfac,
print the same line: their steps run the same graph, so a difference in
their step times is the machine's, not the code's (tree_step_time.py).
"""

import atexit
import collections
import hashlib
import json
import sys


def install(stream=None):
  """Starts counting; the line is printed to `stream` (stdout) at exit."""
  from tensorflow.python.framework import ops  # pylint: disable=g-import-not-at-top
  counts = collections.Counter()
  digest = hashlib.sha256()
  create = ops.Graph._create_op_internal  # pylint: disable=protected-access

  def counted(graph, op_type, *args, **kwargs):
    counts[type(graph).__name__] += 1
    digest.update(op_type.encode() + b";")
    return create(graph, op_type, *args, **kwargs)

  ops.Graph._create_op_internal = counted  # pylint: disable=protected-access

  @atexit.register
  def report():
    out = stream or sys.stdout
    out.write("GRAPH_OPS %s\n" % json.dumps(
        {"counts": dict(sorted(counts.items())),
         "types_sha256": digest.hexdigest()}))
    out.flush()


def parse(text):
  """The GRAPH_OPS record in a program's output, or None."""
  for line in text.splitlines():
    if line.startswith("GRAPH_OPS "):
      return json.loads(line[len("GRAPH_OPS "):])
  return None
