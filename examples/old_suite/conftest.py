"""conftest.py of the old suite's copied tests (run.sh puts it beside them).

kfac 0.2.4's test files disable TF2 behaviour in their `__main__` block,
which pytest does not run: done here, once, before they are imported. Which
`kfac` the tests import is decided by PYTHONPATH alone; it is written to
$KFAC_IMPORTED and must lie under $EXPECT_KFAC (else the pass stops)."""
import os

import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()

import kfac  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

if os.environ.get("KFAC_IMPORTED"):
  with open(os.environ["KFAC_IMPORTED"], "w") as f:
    f.write(kfac.__file__ + "\n")
if not os.path.realpath(kfac.__file__).startswith(
    os.path.realpath(os.environ.get("EXPECT_KFAC", "/"))):
  raise RuntimeError("the old suite imported kfac from %s, expected under %s"
                     % (kfac.__file__, os.environ.get("EXPECT_KFAC")))
