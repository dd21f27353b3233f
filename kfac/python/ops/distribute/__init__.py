"""Cross-replica support of K-FAC (tf.distribute): how many replicas run the
step, and the guard that keeps multi-replica steps from running silently
wrong while their statistics are not reduced across replicas."""
