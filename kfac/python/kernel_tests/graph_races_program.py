"""Runs race_scenarios.py under tf.compat.v1.disable_v2_behavior() (control
flow v1, reference variables: the setting of kfac 0.2.x scripts) and
writes JSON to the file named by the first argument: each scenario's races
and, for the scenarios named by the other arguments, whether training with
reference variables gave the same losses and weights as with resource
variables. Run by graph_races_test.py in a subprocess (the switch is
process-wide)."""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import tensorflow as tf

tf.compat.v1.disable_v2_behavior()

from kfac.python.kernel_tests import race_scenarios


def main(path, compared):
  assert not tf.compat.v1.control_flow_v2_enabled()
  out = {"races": {name: race_scenarios.run(name)
                   for name in race_scenarios.SCENARIOS},
         "max_difference": {}}
  for name in compared:
    ref_losses, ref_weights = race_scenarios.trajectory(name, False)
    losses, weights = race_scenarios.trajectory(name, True)
    out["max_difference"][name] = max(
        [float(np.max(np.abs(ref_losses - losses)))] +
        [float(np.max(np.abs(a - b))) for a, b in zip(ref_weights, weights)])
  with open(path, "w") as f:
    json.dump(out, f)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2:])
