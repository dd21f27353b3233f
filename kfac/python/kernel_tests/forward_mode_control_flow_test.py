"""Forward-mode products through functional control flow (While / If,
tf.scan, map_fn, nested loops) against tf.autodiff.ForwardAccumulator in
float64, in a TF1 Session graph and in a tf.function.

The op-by-op walk keeps tangents of floating tensors only. A loop that
stacks its outputs (tf.scan) or unstacks its inputs (map_fn) carries the
derivative in TensorList (variant) tensors, so the walk must either model
an op or refuse it (UnsupportedGraph naming the op, upon which the callers
use the whole-graph double backward) -- never hand back a zero tangent."""

import re

import numpy as np
import pytest
import tensorflow as tf

from kfac.python.kernel_tests import reference
from kfac.python.ops import forward_mode
from kfac.python.ops import utils

TOL = dict(rtol=1e-12, atol=1e-12)
RNG = np.random.RandomState(7)
F64 = tf.float64


def _read_outside_scan(v):
  """The bug's repro: the body captures a tensor read outside the loop."""
  r = tf.convert_to_tensor(v)
  return tf.scan(lambda c, e: c * r + e, tf.ones([3], F64),
                 initializer=tf.constant(1.0, F64))


def _variable_captured(v):
  """A while loop whose body reads the variable itself."""
  _, c = tf.while_loop(lambda i, c: i < 3,
                       lambda i, c: (i + 1, tf.sin(c) * v + 1.0),
                       (tf.constant(0), tf.constant(0.5, F64)))
  return c


def _scan_carry(v):
  """The tangent enters through the initializer and rides the carry."""
  return tf.scan(lambda c, e: tf.tanh(c) * e + c, tf.constant([1., 2., 3.],
                                                              F64),
                 initializer=2.0 * tf.convert_to_tensor(v))


def _cond_capture(v):
  """A branch captures a tangent-carrying tensor; the other does not."""
  r = tf.sin(tf.convert_to_tensor(v))
  taken = tf.cond(r > 0, lambda: r * r * 3.0, lambda: tf.constant(0.0, F64))
  other = tf.cond(r < 0, lambda: r * r, lambda: tf.constant(1.0, F64))
  return tf.stack([taken, other])


def _nested_loops(v):
  """A loop in a loop, the inner body capturing the outer body's tensor,
  which depends on a tensor read outside both."""
  r = tf.convert_to_tensor(v)

  def outer(i, c):
    s = c * r

    def inner(j, d):
      return j + 1, d * s + tf.cast(j, F64)

    _, d = tf.while_loop(lambda j, d: j < 2, inner, (tf.constant(0), c))
    return i + 1, tf.tanh(d)

  _, c = tf.while_loop(lambda i, c: i < 3, outer,
                       (tf.constant(0), tf.constant(0.3, F64)))
  return c


def _map_fn(v):
  """map_fn unstacks a tangent-carrying tensor into a TensorList."""
  r = tf.convert_to_tensor(v) * tf.constant([1.0, 2.0, 3.0], F64)
  return tf.map_fn(lambda e: tf.sin(e) * e, r)


# name: (model, value, what the walk's refusal names; None: it walks it).
CASES = {
    "read_outside_scan": (_read_outside_scan, 2.0, "scan/while .*variant"),
    "variable_captured": (_variable_captured, 0.7, "variable handle"),
    "scan_carry": (_scan_carry, 0.4, "scan/while .*variant"),
    "cond_capture": (_cond_capture, 0.9, None),
    "nested_loops": (_nested_loops, 0.8, None),
    "map_fn": (_map_fn, 0.6, "TensorListFromTensor.*variant"),
}


def _reference(model, value, tangent):
  v = tf.Variable(value, dtype=F64)
  with tf.autodiff.ForwardAccumulator(v, tf.constant(tangent, F64)) as acc:
    y = model(v)
  want = acc.jvp(y)
  assert want is not None
  return want.numpy()


@pytest.mark.parametrize("world", ["graph", "function"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_products_through_control_flow_match_forward_accumulator(name,
                                                                 world):
  model, value, refusal = CASES[name]
  tangent = 1.0 if name == "read_outside_scan" else RNG.randn()
  want = _reference(model, value, tangent)
  walked = {}

  def build(variables):
    (v,) = variables
    t = tf.constant(tangent, F64)
    y = model(v)
    try:
      (walk,) = forward_mode.jvp(y, v, t)
    except forward_mode.UnsupportedGraph as e:
      walked["refused"] = str(e)
      walk = tf.constant(np.nan, F64)  # not compared below
    assert walk is not None, "the walk returned a zero tangent"
    (fwd,) = utils.fwd_gradients(y, v, grad_xs=t)
    return [(walk, fwd)]

  ((walk, fwd),) = reference.run_stages(world, [np.float64(value)], build)
  np.testing.assert_allclose(fwd, want, **TOL)
  if refusal is None:
    assert "refused" not in walked, walked
    np.testing.assert_allclose(walk, want, **TOL)
  else:
    assert re.search(refusal, walked["refused"]), walked
  assert np.any(want != 0)  # the test would catch a dropped tangent


def test_refusal_names_the_op():
  """The repro's While stacks its outputs in a TensorList: the walk names
  the While and its variant output instead of returning None."""
  with tf.Graph().as_default():
    v = tf.Variable(2.0, dtype=F64)
    y = _read_outside_scan(v)
    with pytest.raises(forward_mode.UnsupportedGraph,
                       match=r"scan/while \((Stateless)?While\).*variant"):
      forward_mode.jvp(y, v, tf.constant(1.0, F64))
