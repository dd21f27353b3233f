"""Where each block's parameters sit in the flattened parameter vector, and
how the block's matrix view permutes them.

The flattened order (the order of `CurvatureOperator.variables`): blocks in
the layer collection's registration order; within a block its parameters
in registration order ((W, b): W then b); each flattened row-major.

A block's matrix view (spectral.view_functions) is a reshaping of its
parameters: for most blocks the identity permutation of the flat entries
([in(+1), out] for (W, b)), for per-channel blocks a transposition. The
permutation is computed once, in numpy, by applying the block's own view
functions to index-valued vectors, so vectors are moved between the flat
layout and the views with one gather (or none) for any number of columns.
"""

import numpy as np
import tensorflow as tf

from kfac.python.ops.collection import layer_collection as lc_lib
from kfac.python.ops.tensors import utils
from kfac.python.ops.linear_operator import spectral


class BlockLayout:
  """One block's place in the flat vector and its view permutation."""

  def __init__(self, block, params_key, offset):
    self.block = block
    self.kind = spectral.block_kind(block)
    self.params = utils.ensure_sequence(params_key)
    self.as_tuple = isinstance(params_key, (list, tuple))
    self.shapes = []
    for v in self.params:
      if not v.shape.is_fully_defined():
        raise ValueError("Variable %s of layer %s needs a static shape for a "
                         "curvature operator, got %s." %
                         (utils.variable_name(v), block.name, v.shape))
      self.shapes.append([int(d) for d in v.shape])
    self.sizes = [int(np.prod(s)) for s in self.shapes]
    self.offset = offset
    self.size = sum(self.sizes)
    self.view_shape, self.perm, self.inv_perm = [self.size, 1], None, None

  @property
  def name(self):
    return "%s (%s)" % (self.block.name, type(self.block).__name__)

  def _templates(self):
    parts, start = [], 0
    for shape, size in zip(self.shapes, self.sizes):
      parts.append(tf.reshape(tf.range(start, start + size,
                                       dtype=tf.float64), shape))
      start += size
    return tuple(parts) if self.as_tuple else parts[0]

  def index_views(self):
    """A function building (the view of the index-valued vector, the
    flattened from_view of the index-valued view), or None for the dense
    fallback (a flat column)."""
    fns = spectral.view_functions(self.block, self.kind)
    if fns is None:
      return None
    to_view, from_view = fns

    def build():
      template = self._templates()
      view = tf.convert_to_tensor(to_view(template))
      positions = tf.reshape(tf.range(tf.size(view), dtype=tf.float64),
                             tf.shape(view))
      back = from_view(positions, template)
      flat_back = tf.concat([tf.reshape(t, [-1])
                             for t in utils.ensure_sequence(back)], axis=0)
      return view, flat_back
    return build

  def set_permutations(self, view, back):
    """Checks and keeps the permutations computed from index_views()."""
    perm = np.rint(np.reshape(view, [-1])).astype(np.int64)
    inv = np.rint(back).astype(np.int64)
    ident = np.arange(self.size)
    if (perm.size != self.size or inv.size != self.size or
        not np.array_equal(np.sort(perm), ident) or
        not np.array_equal(perm[inv], ident)):
      raise ValueError(
          "The matrix view of block %s is not a rearrangement of its %d "
          "parameters (view shape %s), so the curvature operator cannot use "
          "it." % (self.name, self.size, list(np.shape(view))))
    self.view_shape = list(np.shape(view))
    self.perm = None if np.array_equal(perm, ident) else perm
    self.inv_perm = None if np.array_equal(inv, ident) else inv

  def to_views(self, rows):
    """rows [m, size] (flat vectors) -> [m, *view_shape]."""
    if self.perm is not None:
      rows = tf.gather(rows, self.perm, axis=1)
    return tf.reshape(rows, tf.concat([tf.shape(rows)[:1],
                                       self.view_shape], axis=0))

  def from_views(self, views):
    """[m, *view_shape] -> rows [m, size]."""
    rows = tf.reshape(views, [-1, self.size])
    if self.inv_perm is not None:
      rows = tf.gather(rows, self.inv_perm, axis=1)
    return rows


def evaluate(build):
  """numpy values of the tensors `build()` returns, computed eagerly (or in
  a private graph when the program runs a TF1 graph): for static
  bookkeeping that must not add ops to the user's graph."""
  with tf.init_scope():
    if tf.executing_eagerly():
      return tf.nest.map_structure(np.asarray, build())
  graph = tf.Graph()
  with graph.as_default():
    out = build()
    with tf.compat.v1.Session(graph=graph) as sess:
      return sess.run(out)


def make_layouts(layer_collection):
  """The BlockLayouts of a collection's blocks, in the flattened order (the
  view permutations of all blocks computed in one evaluation)."""
  layouts, offset = [], 0
  for params, block in layer_collection.blocks_and_params():
    layout = BlockLayout(block, params, offset)
    layouts.append(layout)
    offset += layout.size
  if not layouts:
    raise ValueError("LayerCollection %s has no registered layers." %
                     getattr(layer_collection, "name", layer_collection))
  builds = [(l, l.index_views()) for l in layouts]
  builds = [(l, b) for l, b in builds if b is not None]
  if builds:
    values = evaluate(lambda: [b() for _, b in builds])
    for (layout, _), (view, back) in zip(builds, values):
      layout.set_permutations(view, back)
  return layouts


def layer_collection_of(source):
  """The LayerCollection of an estimator or optimizer (finalizing it), or
  the collection itself."""
  if isinstance(source, lc_lib.LayerCollection):
    return source
  if hasattr(source, "layers") and hasattr(source, "factors"):
    if not getattr(source, "_finalized", True) and tf.executing_eagerly():
      raise ValueError(
          "The estimator %s has not built its statistics yet, and cannot "
          "eagerly (it differentiates the registered graph): build its ops "
          "first (make_vars_and_create_ops, or a training step) inside a "
          "tf.function or TF1 graph, then make the operator." %
          getattr(source, "name", source))
    source.factors  # pylint: disable=pointless-statement
    return source.layers
  raise TypeError("Expected a FisherEstimator or LayerCollection (or a "
                  "KfacOptimizer), got %r." %
                  (source,))
