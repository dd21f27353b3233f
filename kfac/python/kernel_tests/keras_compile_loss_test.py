"""Kfac(model=...) without a loss takes the loss and loss_weights given to
model.compile; given to both, they must agree (spellings aside)."""

import keras
import numpy as np
import pytest

import kfac.keras

RNG = np.random.RandomState(0)
X = RNG.randn(64, 6).astype("float32")
Y_CLASS = RNG.randint(0, 3, 64)
Y_REG = RNG.randn(64, 2).astype("float32")


def _one_output():
  keras.utils.set_random_seed(1)
  return keras.Sequential([keras.Input((6,)),
                           keras.layers.Dense(5, activation="tanh"),
                           keras.layers.Dense(3, activation="softmax")])


def _two_outputs():
  keras.utils.set_random_seed(2)
  inp = keras.Input((6,))
  hidden = keras.layers.Dense(5, activation="tanh", name="h")(inp)
  a = keras.layers.Dense(2, name="a")(hidden)
  b = keras.layers.Dense(2, name="b")(hidden)
  return keras.Model(inp, [a, b])


def _train(model, kfac_kwargs, compile_kwargs, x, y, steps=3):
  opt = kfac.keras.optimizers.Kfac(learning_rate=0.05, damping=0.1,
                                   model=model, seed=4, invert_every=1,
                                   **kfac_kwargs)
  model.compile(optimizer=opt, **compile_kwargs)
  model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=steps,
            shuffle=False, verbose=0)
  return [w.copy() for w in model.get_weights()]


def _assert_same(a, b):
  assert len(a) == len(b)
  for u, v in zip(a, b):
    np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-7)


def _assert_differ(a, b):
  assert max(float(np.max(np.abs(u - v))) for u, v in zip(a, b)) > 1e-4


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_loss_from_compile_takes_the_steps_of_the_loss_given_to_kfac():
  loss = "sparse_categorical_crossentropy"
  both = _train(_one_output(), dict(loss=loss), dict(loss=loss), X, Y_CLASS)
  from_compile = _train(_one_output(), {}, dict(loss=loss), X, Y_CLASS)
  _assert_same(both, from_compile)
  start = _one_output().get_weights()
  _assert_differ(start, from_compile)  # it trained


@pytest.mark.slow  # two more fits of the first test
def test_other_spellings_of_the_same_loss_agree():
  got = _train(_one_output(), dict(
      loss=keras.losses.SparseCategoricalCrossentropy()),
               dict(loss="sparse_categorical_crossentropy"), X, Y_CLASS)
  want = _train(_one_output(), {}, dict(
      loss="sparse_categorical_crossentropy"), X, Y_CLASS)
  _assert_same(got, want)


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_loss_weights_from_compile():
  losses, weights = ["mse", "mse"], [1.0, 0.3]
  given = _train(_two_outputs(), dict(loss=losses, loss_weights=weights),
                 dict(loss=losses, loss_weights=weights), X, [Y_REG, Y_REG])
  from_compile = _train(_two_outputs(), {},
                        dict(loss=losses, loss_weights=weights), X,
                        [Y_REG, Y_REG])
  _assert_same(given, from_compile)
  unweighted = _train(_two_outputs(), {}, dict(loss=losses), X,
                      [Y_REG, Y_REG])
  _assert_differ(from_compile, unweighted)  # the weights were used


@pytest.mark.parametrize("kfac_kwargs, compile_kwargs, shown", [
    (dict(loss="mse"), dict(loss="sparse_categorical_crossentropy"),
     ("Kfac(loss='mse')", "model.compile(loss='sparse_categorical_crossen")),
    (dict(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
     dict(loss="sparse_categorical_crossentropy"),
     ("from_logits=True", "model.compile(loss='sparse_categorical_cross")),
])
def test_a_loss_that_disagrees_with_compile_is_an_error(kfac_kwargs,
                                                        compile_kwargs, shown):
  with pytest.raises(ValueError, match="disagrees") as error:
    _train(_one_output(), kfac_kwargs, compile_kwargs, X, Y_CLASS, steps=1)
  for text in shown:
    assert text in str(error.value), str(error.value)


def test_loss_weights_that_disagree_with_compile_are_an_error():
  with pytest.raises(ValueError, match=r"loss_weights=\[1.0, 1.0\]\) "
                     r"disagrees with model.compile\(loss_weights=\[1.0, "
                     r"0.3\]"):
    _train(_two_outputs(), dict(loss_weights=[1.0, 1.0]),
           dict(loss=["mse", "mse"], loss_weights=[1.0, 0.3]), X,
           [Y_REG, Y_REG], steps=1)
