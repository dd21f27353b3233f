"""Block-diagonal factors (CurvatureOptions factor_block_size,
block_diagonal_test.py) through the Keras optimizer: Kfac(...,
factor_block_size=b) takes the steps of the core optimizer in a TF1 graph
whose collection has the option (relative 1e-4, float32), keeps the
blocks' state, and names a bad value."""

import numpy as np
import pytest

import kfac
import kfac.keras
from kfac.python.keras import keras_flavor
from kfac.python.kernel_tests import keras_adaptive_test as kat
from kfac.python.kernel_tests import keras_optimizer_test as kbase
from kfac.python.ops.layers.base import curvature_options

Options = curvature_options.CurvatureOptions


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_keras_fit_equals_tf1_graph_steps():
  """Kfac(adaptive=True, factor_block_size=4) in `fit` takes the steps of
  the core optimizer in a TF1 graph whose collection has
  CurvatureOptions(factor_block_size=4) (A of 7 and 9 rows, G of 8 in
  blocks; G of 3 whole), and they differ from the whole factors' steps."""
  model, opt = kat._adaptive(kbase.sequential_model(), factor_block_size=4)  # pylint: disable=protected-access
  kbase._fit(model, 0, kat.N_STEPS)  # pylint: disable=protected-access
  want = kat._tf1_adaptive_reference(  # pylint: disable=protected-access
      kat.N_STEPS, curvature_options=Options(factor_block_size=4))
  kbase._assert_weights(model.get_weights(), want["weights"], rtol=1e-4,  # pylint: disable=protected-access
                        atol=1e-6)
  whole = kat._tf1_adaptive_reference(kat.N_STEPS)  # pylint: disable=protected-access
  assert max(np.max(np.abs(a - b)) for a, b in
             zip(want["weights"], whole["weights"])) > 1e-3
  shapes = {k: v.shape for k, v in opt.state_store.numpy_state().items()
            if k.endswith("/cov")}
  assert sorted(shapes.values()) == sorted(
      [(2, 4, 4), (2, 4, 4), (3, 3, 3), (3, 3)]), shapes
  config = opt.get_config()
  assert config["factor_block_size"] == 4
  again = kfac.keras.optimizers.Kfac.from_config(config)
  assert again.get_config()["factor_block_size"] == 4


@pytest.mark.parametrize("bad", [-1, 1, 2.5, True, "4"])
def test_keras_bad_block_size_is_named(bad):
  with pytest.raises(ValueError, match="factor_block_size"):
    kfac.keras.optimizers.Kfac(adaptive=True, factor_block_size=bad)


@pytest.mark.slow  # subprocess: the file again under tf_keras
def test_tf_keras():
  """This file again under tf_keras (TF_USE_LEGACY_KERAS=1)."""
  if keras_flavor.legacy_keras_active():
    return  # this is the run under tf_keras
  kbase.run_file_under_tf_keras(__file__)
