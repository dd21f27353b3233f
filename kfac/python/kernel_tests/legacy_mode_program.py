"""Runs scenarios of legacy_scenarios.py under
tf.compat.v1.disable_v2_behavior() (control flow v1, reference variables,
v1 `Dimension` shapes: the setting of kfac 0.2.x scripts) and writes the
results to the .npz file named by the first argument; the other arguments
name the scenarios (legacy_scenarios.SCENARIOS). Run by
legacy_mode_test.py in a subprocess, since the switch is process-wide."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import tensorflow as tf

tf.compat.v1.disable_v2_behavior()

from kfac.python.kernel_tests import legacy_scenarios


def main(path, names):
  assert not tf.executing_eagerly()
  assert not tf.compat.v1.control_flow_v2_enabled()
  np.savez(path, **legacy_scenarios.run(names))


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2:])
