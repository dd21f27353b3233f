"""No unordered variable accesses in K-FAC's TF1 training ops.

A TF1 graph has no automatic control dependencies: a read of a variable
that neither feeds its assignment nor waits for it sees the old or the new
value from run to run (the damping calibration's race, fixed in
adaptive/damping_rule.py, showed in about one run in six). And a TF1
reference variable's read forwards the variable's buffer, which in-place
assignments change: a value read before an assignment and used after it
is the assigned value (the calibration trial's saved weights were, so
with reference variables the burn-in steps moved the weights).
graph_races.py finds both statically; these tests check the finder on
small graphs (each kind found, ordered and exclusive accesses not
reported), then the training ops of the recipe and of the old library's
modes (race_scenarios.py) with control flow v1 and v2 and under
tf.compat.v1.disable_v2_behavior(), and that training with reference
variables equals training with resource variables.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from kfac.python.kernel_tests import graph_races
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import race_scenarios


def _cast_pattern(ordered):
  """The calibration's old pattern: tf.cast of a float64 variable to
  float64 returns the variable; `last * 2` feeds the assignment of `last`,
  `last * 3` feeds another variable's (unless ordered before it)."""
  last = tf.Variable(1.0, dtype=tf.float64, name="last")
  other = tf.Variable(0.0, dtype=tf.float64, name="other")
  value = tf.cast(last, tf.float64)
  third = value * 3.0
  deps = [third] if ordered else []
  with tf.control_dependencies(deps):
    set_last = last.assign(value * 2.0)
  set_other = other.assign(third)
  return tf.group(set_last, set_other)


@pytest.mark.parametrize("ordered", [False, True])
def test_finds_the_cast_pattern(ordered):
  with tf.Graph().as_default():
    op = _cast_pattern(ordered)
    found = graph_races.races(op)
  if ordered:
    assert found == []
  else:
    assert len(found) == 1, found
    assert found[0].variable == "last"
    assert (found[0].first_kind, found[0].second_kind) == ("write", "read")


def test_finds_unordered_writes_and_ref_variables():
  with tf.Graph().as_default():
    ref = tf.compat.v1.Variable(1.0, use_resource=False, name="ref")
    plain = tf.Variable(1.0, name="plain")
    ops = [ref.assign(2.0), ref.assign_add(1.0), plain.assign(3.0),
           plain.assign(4.0)]
    found = graph_races.races(tf.group(*ops))
  assert sorted(r.variable for r in found) == ["plain", "ref"]
  assert all(r.second_kind in ("write", "add") for r in found)


@pytest.mark.parametrize("control_flow", ["v1", "v2"])
def test_conditionals(control_flow):
  """Branches of one conditional never both run (v1: not compared); a
  race inside a branch's body is found (v2: the body is analysed), and an
  If op counts as a write of what its body writes."""
  with util.control_flow(control_flow), tf.Graph().as_default():
    v = tf.Variable(1.0, name="v")
    pred = tf.compat.v1.placeholder(tf.bool, [])
    exclusive = tf.cond(pred, lambda: v.assign(2.0).op,
                        lambda: tf.group(v.assign_add(v.read_value())))
    assert graph_races.races(exclusive) == []

    def racy():
      read = v.read_value() * 2.0
      return tf.group(v.assign(5.0), tf.identity(read))
    inside = tf.cond(pred, racy, tf.no_op)
    found = graph_races.races(inside)
    assert len(found) == 1 and found[0].variable == "v", found
    outside = tf.group(tf.cond(pred, lambda: v.assign(1.0).op, tf.no_op),
                       tf.identity(v.read_value()))
    found = graph_races.races(outside)
    assert len(found) == 1, found


def test_finds_an_aliased_read_of_a_reference_variable():
  """tf.identity of a reference variable taken before an in-place
  assign_add and used after it (the calibration trial's old save); a
  Snapshot copy (introspection.value_copy) is not reported, nor are users
  of the variable's own snapshot (RefVariable.value(), TF1's live read)."""
  from kfac.python.ops.compat_utils import introspection  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():
    for copy in (False, True):
      v = tf.compat.v1.Variable([1.0, 2.0], use_resource=False,
                                name="w%d" % copy)
      saved = (introspection.value_copy(v) if copy else
               tf.identity(v.read_value()))
      with tf.control_dependencies([saved]):
        trial = v.assign_add([0.5, 0.5])
      with tf.control_dependencies([trial]):
        after = v.value() * 2.0  # the live read: the trial's value
      with tf.control_dependencies([after]):
        restore = v.assign(saved)
      found = graph_races.races(tf.group(restore, after))
      if copy:
        assert found == []
      else:
        assert [r.second_kind for r in found] == ["aliased read"], found
        with tf.compat.v1.Session() as sess:
          sess.run(v.initializer)
          sess.run(restore)
          # What the finder reports happens: the restore restored the trial.
          np.testing.assert_array_equal(sess.run(v), [1.5, 2.5])


@pytest.mark.parametrize("control_flow", ["v1", "v2"])
@pytest.mark.parametrize("name", sorted(race_scenarios.SCENARIOS))
def test_training_ops_have_no_races(name, control_flow):
  with util.control_flow(control_flow):
    found = race_scenarios.run(name)
  assert found == {key: [] for key in found}


@pytest.mark.parametrize("name", ["recipe_step", "recipe_ekfac"])
def test_reference_variables_train_as_resource_variables(name):
  """The recipe's calibration saves the weights, tries the step and
  restores them: with reference variables (tf.compat.v1.get_variable in a
  TF1 graph without resource variables) the saved values were the
  variables' buffers, the restore restored the trial, and the burn-in
  steps moved the weights (the 3rd fetched loss differed by 0.05)."""
  with util.control_flow("v1"):
    ref_losses, ref_weights = race_scenarios.trajectory(name, False)
    losses, weights = race_scenarios.trajectory(name, True)
  np.testing.assert_array_equal(ref_losses, losses)
  for a, b in zip(ref_weights, weights):
    np.testing.assert_array_equal(a, b)
  # The burn-in (5 steps) left the weights alone; later steps moved them.
  assert len(set(ref_losses[:2].tolist())) == 2
  assert np.any(ref_weights[0] != _initial(name))


def test_reference_variables_with_control_flow_v2_are_named():
  """TensorFlow cannot assign a reference variable inside a control flow
  v2 conditional (a TypeError about AssignAdd's input types): the step
  says which variables and what to change instead."""
  with util.control_flow("v2"):
    with pytest.raises(ValueError, match=r"reference variables filt, w1, "
                       r"b1, w2, emb with control flow v2.*use_resource="
                       r"True"):
      race_scenarios.trajectory("old_periodic", False, steps=1)


def _initial(name):
  with tf.Graph().as_default():
    race_scenarios.SCENARIOS[name]()
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      return sess.run(tf.compat.v1.trainable_variables()[0])


def test_under_disable_v2_behavior(tmp_path):
  """The scenarios in the setting of kfac 0.2.x scripts (a subprocess:
  tf.compat.v1.disable_v2_behavior() is process-wide)."""
  path = str(tmp_path / "races.json")
  program = os.path.join(os.path.dirname(__file__), "graph_races_program.py")
  compared = ["recipe_step", "recipe_with_decay", "recipe_ekfac",
              "old_adapted_damping", "old_periodic", "old_adam_momentum"]
  proc = subprocess.run([sys.executable, program, path] + compared,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(path) as f:
    out = json.load(f)
  assert sorted(out["races"]) == sorted(race_scenarios.SCENARIOS)
  for name, fetches in out["races"].items():
    assert fetches and all(v == [] for v in fetches.values()), (name, fetches)
  assert out["max_difference"] == {name: 0.0 for name in compared}


def test_global_step_increment_waits_for_the_hooks_read():
  """Estimator and MonitoredSession hooks fetch the global step's cached
  read (training_util's GLOBAL_STEP_READ_KEY) beside the training op; K-FAC
  increments the step after it, as TensorFlow's own _increment_global_step
  does, so that the hooks see the step before the increment in every
  run."""
  from tensorflow.python.training import training_util  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    read = training_util._get_or_create_global_step_read()  # pylint: disable=protected-access
    train, _ = race_scenarios.old_periodic()["train_op and loss"]
    assert graph_races.races([train, read]) == []
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      feed = {"images:0": np.zeros([race_scenarios.N, 6, 6, 2]),
              "labels:0": np.zeros([race_scenarios.N], np.int32)}
      steps = [sess.run([train, read], feed)[1] for _ in range(3)]
  assert steps == [0, 1, 2]
