"""Cross-replica support of K-FAC (tf.distribute): reductions of the
statistics, gradients and quadratic-model terms across replicas, and the
updates of mirrored variables (collective.py); replica counts and
per-replica attributes (replicas.py). See docs/distributed.md."""
