"""The K-FAC core: graph-building ops usable in TF1 graphs and tf.function."""
