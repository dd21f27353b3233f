"""State saved by an earlier kfac loads into today's and trains on the same.

testdata/saved_state/ holds what saved_state_program.py wrote with the kfac
of commit 26f32e0 (before the step was rewritten as explicit parts, issue
52): two Keras 3 `.keras` files (Kfac(adaptive=True), and a fixed-rate Kfac
with periods, a norm constraint and AdamW's weight decay) with their
optimizers' configs, a TF1 `Saver` checkpoint of PeriodicInvCovUpdateKfacOpt
(momentum "adam") and a TF2 `tf.train.Checkpoint` of one with momentum
"qmodel" and the damping rule, each with the weights that version reached 3
steps after saving. Today's kfac loads each, takes the same 3 steps on the
same batches and must reach the same weights (float32 training: 1e-6
relative); the Keras configs must be identical.

The comparison can fail: a continuation from the saved weights with a fresh
K-FAC state (factors, inverses, velocities, counters) ends elsewhere
(checked below for the TF1 checkpoint), and so would a renamed variable
(the Saver and the checkpoints restore by name and fail on a missing one).
"""

import json
import os

import numpy as np
import pytest

from kfac.python.kernel_tests import saved_state_program as program

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata",
                    "saved_state")
RTOL, ATOL = 1e-6, 1e-7
# Keras config keys added since testdata/saved_state was written (26f32e0),
# per optimizer kind: {key: the value a loaded file gets}.
CONFIG_KEYS_SINCE = {"adaptive": {"noise_scale_steps": 0,
                                  "noise_scale_every": 0,
                                  # the recipe's momentum bound
                                  "qmodel_momentum_bound": 1.0}}


def _load(path):
  with np.load(path) as f:
    return {k: f[k] for k in f.files}


def _assert_same(got, expected):
  assert sorted(got) == sorted(expected)
  for k in expected:
    np.testing.assert_allclose(got[k], expected[k], rtol=RTOL, atol=ATOL,
                               err_msg=k)


@pytest.mark.parametrize("world", ["session", "function"])
def test_core_checkpoint_resumes(world, tmp_path):
  out = str(tmp_path / "got.npz")
  {"session": program.session_resume,
   "function": program.function_resume}[world](DATA, out)
  _assert_same(_load(out), _load(os.path.join(DATA, world +
                                               "_expected.npz")))


def test_keras_file_resumes_with_its_config(tmp_path):
  out = str(tmp_path / "got.npz")
  program.keras_resume(DATA, out)
  _assert_same(_load(out), _load(os.path.join(DATA, "keras_expected.npz")))
  with open(out + ".configs.json") as f:
    configs = json.load(f)
  for kind in program.KERAS_OPTIMIZERS:
    with open(os.path.join(DATA, "keras_%s_config.json" % kind)) as f:
      expected = json.load(f)
    # Arguments Kfac gained after the files were written, at the defaults
    # a loaded file gets.
    expected.update(CONFIG_KEYS_SINCE.get(kind, {}))
    assert configs[kind] == expected, kind


def test_a_fresh_kfac_state_ends_elsewhere():
  """The session checkpoint's weights with a new K-FAC state: the same 3
  steps end far from the saved run's (so the resume test sees the state)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  graph, feeds, weights, train, _, init = program._session_graph()  # pylint: disable=protected-access
  with graph.as_default():
    weights_only = tf.compat.v1.train.Saver(var_list=weights)
  with tf.compat.v1.Session(graph=graph) as sess:
    sess.run(init)
    weights_only.restore(sess, os.path.join(DATA, "session_ckpt"))
    program._session_steps(sess, feeds, train, program.STEPS_BEFORE,  # pylint: disable=protected-access
                           program.STEPS_AFTER)
    got = sess.run(weights)
  expected = _load(os.path.join(DATA, "session_expected.npz"))
  diff = max(np.max(np.abs(g - expected["arr_%d" % i]))
             for i, g in enumerate(got))
  assert diff > 1e-3
