"""Exact resume with default settings (the sampled Fisher, no seed given
anywhere): an uninterrupted run against one that is killed (SIGKILL) after
its checkpoint and resumed in a new process, in a TF1 Session with
tf.compat.v1.train.Saver, in a tf.function with
tf.train.Checkpoint(optimizer=opt), and under Keras with
tf.train.Checkpoint(model=..., optimizer=...): the 20 losses after the
restore and the final weights are bit-identical. (resume_program.py runs
each part in its own process.)"""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import distribute_test

_PROGRAM = [sys.executable, "-m", "kfac.python.kernel_tests.resume_program"]


def _result(stdout):
  lines = [l for l in stdout.splitlines() if l.startswith("RESULT ")]
  assert lines, stdout[-3000:]
  return json.loads(lines[-1][len("RESULT "):])


def _run(world, action, folder):
  proc = subprocess.run(_PROGRAM + [world, action, folder],
                        capture_output=True, text=True, timeout=600,
                        env=distribute_test.env(), check=False)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  return _result(proc.stdout)


def _save_and_kill(world, folder):
  """Starts a run that checkpoints and trains on; kills it with SIGKILL a
  few steps after the checkpoint."""
  proc = subprocess.Popen(_PROGRAM + [world, "save", folder],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True, env=distribute_test.env())
  try:
    for line in proc.stdout:
      if line.startswith("SAVED"):
        break
    else:
      pytest.fail("the run ended before its checkpoint")
  finally:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL


@pytest.mark.slow
@pytest.mark.parametrize("world", ["tf1", "tf2", "keras"])
def test_killed_and_resumed_run_equals_the_uninterrupted_one(world, tmp_path):
  full = _run(world, "full", str(tmp_path))
  _save_and_kill(world, str(tmp_path))
  resumed = _run(world, "restore", str(tmp_path))
  assert len(resumed["losses"]) == 20
  assert resumed["losses"] == full["losses"]
  assert resumed["weights"] == full["weights"]
  assert full["losses"][-1] < full["losses"][0]  # it trained


def test_checkpoint_of_the_core_optimizer_holds_all_its_state(tmp_path):
  """tf.train.Checkpoint(optimizer=opt) saves every K-FAC variable (the
  optimizer tracks its state store), and a TF1 Saver's default variables
  (the graph's global variables) include them all."""
  variables = [tf.Variable(np.eye(2, dtype=np.float32))]
  opt = kfac.PeriodicInvCovUpdateKfacOpt(learning_rate=0.1, damping=0.1,
                                         invert_every=1)

  @tf.function
  def step():
    lc = kfac.LayerCollection()
    x = tf.constant([[1.0, 2.0], [3.0, -1.0]])
    logits = tf.matmul(x, variables[0])
    lc.register_fully_connected(variables[0], x, logits)
    lc.register_categorical_predictive_distribution(logits)
    opt.minimize(tf.reduce_sum(logits), var_list=variables,
                 layer_collection=lc)

  step()
  step()
  path = tf.train.Checkpoint(optimizer=opt).save(str(tmp_path / "c"))
  saved = {name for name, _ in tf.train.list_variables(path)}
  store = opt.state_store.variables_by_name
  assert len(store) > 5
  for key in store:
    assert any(("kfac_state/" in name and key.replace("/", ".S") in name)
               or key in name for name in saved), key
  fresh = kfac.PeriodicInvCovUpdateKfacOpt(learning_rate=0.1, damping=0.1,
                                           invert_every=1)
  tf.train.Checkpoint(optimizer=fresh).restore(path)
  # Restored values wait for their variables, created on the first use.
  assert int(fresh.counter.numpy()) == 2

  with tf.Graph().as_default():
    w = tf.compat.v1.Variable(np.eye(2, dtype=np.float32))
    x = tf.constant([[1.0, 2.0], [3.0, -1.0]])
    logits = tf.matmul(x, w)
    lc = kfac.LayerCollection()
    lc.register_fully_connected(w, x, logits)
    lc.register_categorical_predictive_distribution(logits)
    graph_opt = kfac.PeriodicInvCovUpdateKfacOpt(
        learning_rate=0.1, damping=0.1, layer_collection=lc)
    graph_opt.minimize(tf.reduce_sum(logits), var_list=[w])
    global_vars = {v.ref() for v in tf.compat.v1.global_variables()}
    for var in graph_opt.state_store.variables_by_name.values():
      assert var.ref() in global_vars, var.name
