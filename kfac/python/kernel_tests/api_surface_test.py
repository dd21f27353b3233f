"""Every public name and signature of kfac 0.2.4 exists in ours.

The old package is installed into a throwaway folder
(`pip install --no-deps --target`, cached under the system's temporary
folder; KFAC_OLD_PACKAGE_DIR names an unpacked copy instead) and read
statically by api_surface.py: it is never imported. Each deliberate
difference is listed in DELIBERATE below with its reason and must have a
migration note in docs/migration.md naming it; a listed difference that no
longer exists fails the test too, so the list stays true.
"""

import os
import subprocess
import sys
import tempfile

import pytest

from kfac.python.kernel_tests import api_surface

OLD_VERSION = "0.2.4"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

# key (module or module.name[.method]) -> why we differ. The key's last two
# dotted parts (e.g. fisher_factors.FullFactor) appear in docs/migration.md.
DELIBERATE = {
    "kfac.python.keras.optimizers.Kfac.__init__":
        "the old first parameter _sentinel made every argument keyword-only, so positions were never usable; name defaults to 'Kfac'",
    "kfac.python.keras.optimizers.Kfac.apply_gradients":
        "Keras 3's apply_gradients has no name argument (the tf_keras class keeps it)",
    "kfac.python.keras.optimizers.Kfac.get_updates":
        "the graph-mode Kfac (tf_keras in a TF1 graph) has it; the TF2 classes fit through apply_gradients",
    "kfac.python.keras.optimizers.Kfac.layers":
        "the graph-mode Kfac has it; in TF2 the collection is rebuilt per trace: registration_report and kfac_optimizer show it",
    "kfac.python.keras.optimizers.Kfac.name":
        "an instance attribute set by Keras (opt.name works)",
    "kfac.python.keras.optimizers.Kfac.register_train_batch":
        "the graph-mode Kfac has it; in TF2 call set_train_batch(batch) in the step (model.fit needs none)",
    "kfac.python.keras.optimizers.getfullargspec":
        "a module import of the old file, not API",
    "kfac.python.keras.utils.K":
        "a module import of the old file (keras.backend), not API",
    "kfac.python.keras.utils.activations":
        "a module import of the old file, not API",
    "kfac.python.keras.utils.layers":
        "a module import of the old file, not API",
    "kfac.python.keras.utils.losses":
        "a module import of the old file, not API",
    "kfac.python.ops.fisher_blocks.InputOutputMultiTower":
        "internal mixin of the old blocks; towers live in every block here",
    "kfac.python.ops.fisher_blocks.InputOutputMultiTowerMultiUse":
        "internal mixin of the old multi-use blocks",
    "kfac.python.ops.fisher_blocks.KroneckerProductFB":
        "block internals: factors via block.factors, damping is the optimizer's",
    "kfac.python.ops.fisher_blocks.ScaleAndShiftDiagonalFB":
        "block constructors: broadcast dims and has_shift come from the registered params",
    "kfac.python.ops.fisher_blocks.ScaleAndShiftFullFB":
        "block constructors: broadcast dims and has_shift come from the registered params",
    "kfac.python.ops.fisher_factors.ConvDiagonalFactor":
        "factor constructors are internal (made by registration)",
    "kfac.python.ops.fisher_factors.ConvInputMultiKF":
        "multi-use conv factors: register_conv2d_multi builds its own factors",
    "kfac.python.ops.fisher_factors.ConvOutputMultiKF":
        "multi-use conv factors: register_conv2d_multi builds its own factors",
    "kfac.python.ops.fisher_factors.ConvInputSUAKroneckerFactor":
        "factor internals: inverses and powers are computed by the factor base class",
    "kfac.python.ops.fisher_factors.DenseSquareMatrixFactor":
        "factor internals: inverses and powers are computed by the factor base class",
    "kfac.python.ops.fisher_factors.DiagonalFactor":
        "factor internals: inverses and powers are computed by the factor base class",
    "kfac.python.ops.fisher_factors.DiagonalKroneckerFactor":
        "factor constructors are internal; the dtype follows the inputs",
    "kfac.python.ops.fisher_factors.DiagonalMultiKF":
        "multi-use diagonal factors are built by register_*_multi",
    "kfac.python.ops.fisher_factors.FisherFactor":
        "factor internals: inverses and powers are computed by the factor base class",
    "kfac.python.ops.fisher_factors.FullyConnectedMultiKF":
        "factor internals; num_uses is required (it sets the statistics' normalisation)",
    "kfac.python.ops.fisher_factors.ScaleAndShiftDiagonalFactor":
        "factor constructors: shapes and broadcast dims come from the registered params",
    "kfac.python.ops.fisher_factors.ScaleAndShiftFullFactor":
        "factor constructors: shapes and broadcast dims come from the registered params",
    "kfac.python.ops.fisher_factors.ScaleAndShiftFactor":
        "the old base class of both scale-and-shift factors",
    "kfac.python.ops.fisher_factors.graph_func_to_id":
        "factors are keyed by their inputs here, not by graph functions",
    "kfac.python.ops.fisher_factors.graph_func_to_string":
        "factors are keyed by their inputs here, not by graph functions",
    "kfac.python.ops.kfac_utils.data_reader_alt.CachedDataReader.__init__":
        "the second positional argument is still the old num_examples (the largest batch), now named max_batch_size; num_examples= is accepted",
    "kfac.python.ops.kfac_utils.data_reader_alt.VariableBatchReader.__init__":
        "the second positional argument is still the old num_examples (the largest batch), now named max_batch_size; num_examples= is accepted",
    "kfac.python.ops.kfac_utils.periodic_inv_cov_update_kfac_opt.PeriodicInvCovUpdateKfacOpt.kfac_update_ops":
        "minimize / apply_gradients build the whole step",
    "kfac.python.ops.placement.RoundRobinPlacementMixin.create_ops_and_vars_thunks":
        "the method lives on the estimator (FisherEstimator.create_ops_and_vars_thunks)",
    "kfac.python.ops.placement.ReplicaRoundRobinPlacementMixin.create_ops_and_vars_thunks":
        "the method lives on the estimator (FisherEstimator.create_ops_and_vars_thunks)",
    "kfac.python.ops.utils.DistributedVarOp":
        "TF-Replicator / TF1 distribution internals; tf.distribute is used instead",
    "kfac.python.ops.utils.MirroredVariableWrapper":
        "TF-Replicator / TF1 distribution internals; tf.distribute is used instead",
}


def _old_package():
  given = os.environ.get("KFAC_OLD_PACKAGE_DIR")
  if given:
    return given
  target = os.path.join(tempfile.gettempdir(), "kfac-%s-api" % OLD_VERSION)
  if os.path.exists(os.path.join(target, "kfac", "__init__.py")):
    return target
  result = subprocess.run(
      [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
       "--disable-pip-version-check", "--target", target,
       "kfac==%s" % OLD_VERSION],
      capture_output=True, text=True, timeout=300, check=False)
  if result.returncode != 0:
    pytest.fail("kfac %s could not be installed from the package registry "
                "(offline? set KFAC_OLD_PACKAGE_DIR to an unpacked copy), so "
                "the API surface cannot be compared: %s" %
                (OLD_VERSION, result.stderr.strip()[-300:]))
  return target


@pytest.fixture(scope="module")
def problems():
  return api_surface.compare(_old_package())


def test_every_old_public_name_and_signature_exists(problems):
  unexpected = ["%s: %s" % (k, p) for k, p in problems
                if not any(k == d or k.startswith(d + ".")
                           for d in DELIBERATE)]
  assert not unexpected, "\n".join(unexpected)


def test_deliberate_differences_are_real_and_documented(problems):
  with open(os.path.join(ROOT, "docs", "migration.md")) as f:
    migration = f.read()
  keys = [k for k, _ in problems]
  stale = [d for d in DELIBERATE
           if not any(k == d or k.startswith(d + ".") for k in keys)]
  assert not stale, "listed as different but compatible now: %s" % stale
  undocumented = [d for d in DELIBERATE
                  if ".".join(d.split(".")[-2:]) not in migration]
  assert not undocumented, (
      "deliberate differences without a note in docs/migration.md: %s" %
      undocumented)
