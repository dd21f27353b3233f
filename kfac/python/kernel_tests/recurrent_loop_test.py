"""kfac/python/keras/recurrent_loop.py: a loop as one op whose forward-mode
rule is a tangent loop.

Against tf.autodiff.ForwardAccumulator / tf.GradientTape on the same step
run eagerly (float64, 1e-12), in a TF1 Session graph and in a tf.function
(reference.run_stages). The JVPs come from the op-by-op walk itself
(forward_mode.jvp, which raises UnsupportedGraph where it cannot walk: a
plain tf.scan on the path makes it raise), so a pass means the walk took
the loop's rule, not the whole-graph double backward.
"""

import numpy as np
import pytest
import tensorflow as tf

from kfac.python.keras import recurrent_loop
from kfac.python.kernel_tests import reference as ref
from kfac.python.ops import forward_mode

TOL = dict(rtol=1e-12, atol=1e-12)
T, B, D, H = 5, 3, 2, 4


def _step(carry, elems, params):
  """Two carries (one feeds the other), two elems, three params."""
  h, c = carry
  x_t, p_t = elems
  u, w, s = params
  h_new = tf.tanh(tf.matmul(x_t, w) + tf.matmul(h, u) + p_t) * s + 0.5 * c
  return h_new, tf.sigmoid(c + h)


def _inits():
  rng = np.random.RandomState(0)
  return [rng.randn(T, B, D), rng.randn(T, B, H), rng.randn(B, H),
          rng.randn(B, H), rng.randn(H, H), rng.randn(D, H), rng.randn(H)]


def _tangents():
  rng = np.random.RandomState(1)
  return [rng.randn(*np.shape(v)) for v in _inits()]


def _split(vs):
  return tuple(vs[:2]), tuple(vs[2:4]), tuple(vs[4:])


def _eager_reference(skip):
  """(jvps of both stacked carries, gradients of their sum of squares) of
  the plain tf.scan, eagerly; tangents of the indices in `skip` zero."""
  vs = [tf.constant(v) for v in _inits()]
  tangents = [tf.zeros_like(v) if i in skip else tf.constant(t)
              for i, (v, t) in enumerate(zip(vs, _tangents()))]
  with tf.GradientTape() as tape:
    tape.watch(vs)
    with tf.autodiff.ForwardAccumulator(vs, tangents) as acc:
      elems, init, params = _split(vs)
      out = tf.scan(lambda c, e: _step(c, e, params), elems,
                    initializer=init)
    loss = sum(tf.reduce_sum(o * o) for o in out)
  return [acc.jvp(o).numpy() for o in out], [
      g.numpy() for g in tape.gradient(loss, vs)]


@pytest.mark.parametrize("world", ref.WORLDS)
@pytest.mark.parametrize("gradient_first", [False, True])
@pytest.mark.parametrize("skip", [(), (1, 3, 6)])
def test_jvp_and_gradient_equal_the_eager_ones(world, gradient_first, skip):
  """The walk's JVP through the loop op (some tangents None: the probe-like
  elems, an initial state, a param) and the reverse-mode gradient through
  it; with gradient_first the gradient is built first (TensorFlow then
  adds outputs to the call op, which the rule leaves without tangent)."""
  want_jvp, want_grad = _eager_reference(skip)
  tangents = _tangents()

  def build(vs):
    xs = [tf.convert_to_tensor(v) for v in vs]  # the tensors the loop takes
    elems, init, params = _split(xs)
    out = recurrent_loop.scan(_step, elems, init, params)
    loss = sum(tf.reduce_sum(o * o) for o in out)
    if gradient_first:
      grads = tf.gradients(loss, vs)
    jvps = forward_mode.jvp(
        list(out), [x for i, x in enumerate(xs) if i not in skip],
        [tf.constant(t) for i, t in enumerate(tangents) if i not in skip])
    if not gradient_first:
      grads = tf.gradients(loss, vs)
    return [(jvps, grads)]

  jvps, grads = ref.run_stages(world, _inits(), build)[0]
  for got, want in zip(jvps, want_jvp):
    np.testing.assert_allclose(got, want, **TOL)
  for got, want in zip(grads, want_grad):
    np.testing.assert_allclose(got, want, **TOL)


def test_a_plain_scan_is_refused_by_the_walk():
  """The premise: without the op's rule the walk cannot pass the loop."""
  @tf.function
  def build():
    vs = [tf.constant(v) for v in _inits()]
    elems, init, params = _split(vs)
    out = tf.scan(lambda c, e: _step(c, e, params), elems, initializer=init)
    return forward_mode.jvp([out[0]], [vs[4]], [tf.ones_like(vs[4])])

  with pytest.raises(forward_mode.UnsupportedGraph, match="variant output"):
    build.get_concrete_function()


@pytest.mark.parametrize("world", ref.WORLDS)
def test_the_whole_graph_fallback_differentiates_through_the_loop_op(world):
  """Where another op on the path makes the walk refuse it (TF1 control
  flow), fwd_gradients falls back to the whole-graph double backward,
  which differentiates through the loop op's function twice."""
  from kfac.python.ops.compat_utils import forward_gradients  # pylint: disable=g-import-not-at-top
  want_jvp, _ = _eager_reference(())
  tangents = _tangents()

  def build(vs):
    xs = [tf.convert_to_tensor(v) for v in vs]
    elems, init, params = _split(xs)
    out = recurrent_loop.scan(_step, elems, init, params)
    return [forward_gradients.whole_graph_jvp(
        list(out), xs, [tf.constant(t) for t in tangents])]

  jvps = ref.run_stages(world, _inits(), build)[0]
  for got, want in zip(jvps, want_jvp):
    np.testing.assert_allclose(got, want, **TOL)
