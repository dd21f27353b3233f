"""The memory column of the Keras registration report, and the memory
budget and its fallback under Kfac and model.fit."""

import re
import warnings

import keras
import numpy as np
import pytest

import kfac
from kfac.python.ops.collection import memory


@pytest.fixture(autouse=True)
def state_only_budget(monkeypatch):
  """These tests pin the budget's accounting of the state; the working
  memory of inversions (memory.working_bytes) is tested on its own in
  memory_test.py."""
  monkeypatch.setattr(memory, "WORKING_BYTES_PER_ENTRY", 0)


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _data():
  rng = np.random.RandomState(0)
  return rng.randn(32, 30).astype("float32"), rng.randint(0, 3, 32)


def _fit(**kwargs):
  keras.utils.set_random_seed(3)
  model = keras.Sequential([
      keras.Input((30,)), keras.layers.Dense(8, activation="tanh",
                                             name="wide"),
      keras.layers.Dense(3, name="out")])
  opt = kfac.keras.optimizers.Kfac(learning_rate=0.05, damping=0.05,
                                   model=model, loss=LOSS, seed=1, **kwargs)
  model.compile(optimizer=opt, loss=LOSS)
  x, y = _data()
  history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                      verbose=0)
  return model, opt, history.history["loss"]


def _line(report, name):
  (line,) = [l for l in report.splitlines() if l.split()[0].endswith(name)]
  return line


def test_report_shows_each_layers_memory_and_the_total():
  _, opt, _ = _fit(memory_budget=10**6)
  report = opt.registration_report
  assert report.splitlines()[0].split() == [
      "layer", "class", "block", "approx", "calls", "parameters", "memory",
      "note"]
  # wide: A 31x31 and G 8x8, each with its inverse and weight: 2052 floats;
  # out: A 9x9, G 3x3: 182 floats.
  assert _line(report, "wide").split()[7] == "8.0KiB"
  assert _line(report, "out").split()[7] == "728B"
  assert ("K-FAC state: 8.7 KiB in total (8936 bytes); memory budget "
          "976.6 KiB") in report


def test_fallback_trains_as_the_cheaper_approximation_chosen_by_hand():
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model, opt, losses = _fit(memory_budget=4000, over_budget="fallback")
  assert any("registered with kron_in_diag instead of kron" in str(w.message)
             for w in caught)
  ref_model, _, ref_losses = _fit(fisher_approx={"wide": "kron_in_diag"},
                                  memory_budget=None)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  for got, want in zip(model.get_weights(), ref_model.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert losses[-1] < losses[0]
  report = opt.registration_report
  # A diagonal (31 + weight), G 8x8 with its inverse and weight.
  line = _line(report, "wide")
  assert line.split()[7] == "644B"
  assert "memory fallback: kron -> kron_in_diag (was 8.0KiB)" in line
  assert "(1372 bytes)" in report


def test_over_budget_error_names_the_layer():
  with pytest.raises(ValueError) as info:
    _fit(memory_budget=4000)
  message = str(info.value)
  assert re.search(r"over the memory budget of 3.9 KiB \(4000 bytes\)\. "
                   r"Largest layers: \S*Dense\S* \(\S*wide/kernel\S*, "
                   r"\S*wide/bias\S*\): 8.0 KiB", message), message
