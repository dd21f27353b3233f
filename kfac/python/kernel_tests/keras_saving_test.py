"""Keras saving and preemption with the Keras Kfac optimizer.

A run of `fit` is interrupted (an exception raised from a callback at a
given epoch or step) and resumed in a NEW model with a NEW Kfac through
each of Keras's saving paths: BackupAndRestore (save_freq="epoch" and an
integer save_freq), ModelCheckpoint (save_weights_only True and False),
save_weights / load_weights and model.save / load_model. The resumed run
ends with the model weights AND the whole K-FAC state (factors, inverses,
damping, counters, velocities, sampling seed: the optimizer's state store)
bit-identical (relative difference 0) to the uninterrupted run's.

BackupAndRestore with an integer save_freq does not continue a mid-epoch
backup on the uninterrupted run's batches, with any optimizer (measured
with Adam under tf_keras: 1.3e-2 max weight difference): Keras 3 takes the
interrupted epoch again from its first batch (it records the epoch, not
the batch); tf_keras skips the steps already taken but not their data.
There the resumed run is compared, bit for bit, with a run fed the same
batches without interruption.

Loading into a model of another shape and loading a truncated file keep
Keras's / TensorFlow's clear errors (.weights.h5 and tf.train.Checkpoint).

Runs under the Keras of `tf.keras` (Keras 3 by default);
`test_tf_keras` runs this file again with TF_USE_LEGACY_KERAS=1."""

import functools
import os
import re

import numpy as np
import pytest

import kfac
import kfac.keras
from kfac.python.keras import keras_flavor
from kfac.python.kernel_tests import keras_optimizer_test

keras = keras_flavor.keras_module()
LEGACY = keras_flavor.legacy_keras_active()

N, D_IN, D_OUT, BATCH, EPOCHS = 48, 6, 3, 16, 3  # 3 steps an epoch
# Kfac takes its sampling seed from the global seed when built. The
# interrupted and uninterrupted runs are built under the same one (whatever
# tests ran before in this process), a resumed Kfac under another: only a
# restored sampling seed makes it equal.
RUN_SEED, RESUME_SEED = 0, 7


def _data():
  rng = np.random.RandomState(0)
  x = rng.randn(N, D_IN).astype(np.float32)
  y = rng.randint(0, D_OUT, size=N).astype(np.int32)
  return x, y


def _model(hidden=8, global_seed=RUN_SEED):
  keras.utils.set_random_seed(global_seed)
  model = keras.Sequential([
      keras.Input((D_IN,)),
      keras.layers.Dense(hidden, activation="tanh", name="hidden"),
      keras.layers.Dense(D_OUT, activation="softmax", name="out")])
  rng = np.random.RandomState(1)
  model.set_weights([(rng.randn(*w.shape) * 0.5).astype(np.float32)
                     for w in model.get_weights()])
  opt = kfac.keras.optimizers.Kfac(
      model=model, adaptive=True, loss="sparse_categorical_crossentropy",
      invert_every=2)
  model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
  return model


def _fit(model, epochs, initial_epoch=0, callbacks=(), rows=N):
  x, y = _data()
  model.fit(x[:rows], y[:rows], batch_size=BATCH, epochs=epochs,
            initial_epoch=initial_epoch, shuffle=False, verbose=0,
            callbacks=list(callbacks))


def _state(model):
  """The model's weights and the optimizer's whole state, as numpy."""
  state = {"weights/%d" % i: w for i, w in enumerate(model.get_weights())}
  for key, value in model.optimizer.state_store.numpy_state().items():
    state["kfac/" + key] = value
  state["iterations"] = np.asarray(model.optimizer.iterations.numpy())
  for i, var in enumerate(model.optimizer.variables):
    state["optimizer_variables/%d" % i] = np.asarray(var.numpy())
  return state


def _assert_identical(got, want):
  assert sorted(got) == sorted(want)
  assert len([k for k in want if k.startswith("kfac/")]) > 10
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@functools.lru_cache(maxsize=None)
def _uninterrupted(epochs=EPOCHS):
  model = _model()
  _fit(model, epochs)
  return _state(model)


class _ResumeStart(keras.callbacks.Callback):
  """Records where a resumed fit starts: its first epoch, and the model's
  and optimizer's whole state as its first batch begins (after every
  restore of on_train_begin)."""

  def __init__(self):
    super().__init__()
    self.epoch, self.state = None, None

  def on_epoch_begin(self, epoch, logs=None):
    if self.epoch is None:
      self.epoch = epoch

  def on_train_batch_begin(self, batch, logs=None):
    if self.state is None:
      self.state = _state(self.model)


def _assert_resumed_at(start, epoch, fresh):
  """The resumed fit began at `epoch` with the optimizer at that epoch's
  step, in the uninterrupted run's state after `epoch` epochs, and that
  state is not a fresh model's (a restore that does nothing fails here)."""
  assert start.epoch == epoch, (start.epoch, epoch)
  steps = epoch * (N // BATCH)
  assert int(start.state["iterations"]) == steps, (
      start.state["iterations"], steps)
  want = _uninterrupted(epoch)
  if LEGACY:
    # tf_keras restores the optimizer's variables when they are created, in
    # the first step: at its start only the model's weights are back.
    start_weights = {k: v for k, v in start.state.items()
                     if k.startswith("weights/")}
    assert sorted(start_weights) == sorted(
        k for k in want if k.startswith("weights/"))
    for key, value in start_weights.items():
      np.testing.assert_array_equal(value, want[key], err_msg=key)
  else:
    _assert_identical(start.state, want)
  for key, value in fresh.items():
    if key.startswith("weights/"):
      assert not np.array_equal(value, want[key]), key
  assert int(fresh["iterations"]) == 0


class _Interrupt(keras.callbacks.Callback):
  """Raises at the start of `epoch` (and of its batch `batch`)."""

  def __init__(self, epoch, batch=0):
    super().__init__()
    self._epoch, self._batch, self._current = epoch, batch, None

  def on_epoch_begin(self, epoch, logs=None):
    self._current = epoch

  def on_train_batch_begin(self, batch, logs=None):
    if self._current == self._epoch and batch == self._batch:
      raise _Preempted("epoch %d, batch %d" % (self._epoch, batch))


class _Preempted(Exception):
  pass


def _interrupted(callbacks, epoch, batch=0):
  model = _model()
  with pytest.raises(_Preempted):
    _fit(model, EPOCHS, callbacks=list(callbacks) + [_Interrupt(epoch, batch)])
  return model


def _backup_and_restore_per_epoch(tmp_path):
  backup = str(tmp_path / "backup")
  _interrupted([keras.callbacks.BackupAndRestore(backup)], epoch=2, batch=1)
  resumed = _model(global_seed=RESUME_SEED)  # a new model and a new Kfac
  fresh = _state(resumed)
  start = _ResumeStart()
  _fit(resumed, EPOCHS,
       callbacks=[keras.callbacks.BackupAndRestore(backup), start])
  # The backup is of epoch 1's end: the resumed fit starts at epoch 2.
  _assert_resumed_at(start, 2, fresh)
  _assert_identical(_state(resumed), _uninterrupted())


def test_backup_and_restore_per_epoch_resumes_bit_for_bit(tmp_path):
  _backup_and_restore_per_epoch(tmp_path)


def _restore_nothing(self, *args, **kwargs):
  del self, args, kwargs


@pytest.mark.parametrize("disabled", ["backup_and_restore", "kfac_state"])
def test_resume_test_fails_when_the_restore_does_nothing(tmp_path,
                                                         monkeypatch,
                                                         disabled):
  """The resume test above fails on a build whose restore does nothing:
  BackupAndRestore restoring nothing (the resumed fit trains from scratch),
  or Kfac loading none of its state (the model's weights come back, the
  K-FAC factors, inverses and counters do not)."""
  if disabled == "backup_and_restore" and LEGACY:
    # tf_keras's callback sets up its state, then restores through it.
    from tf_keras.src.distribute import worker_training_state  # pylint: disable=g-import-not-at-top
    monkeypatch.setattr(worker_training_state.WorkerTrainingState, "restore",
                        _restore_nothing)
  elif disabled == "backup_and_restore":
    monkeypatch.setattr(keras.callbacks.BackupAndRestore, "on_train_begin",
                        _restore_nothing)
  else:
    monkeypatch.setattr(type(_model().optimizer), "load_own_variables",
                        _restore_nothing)
  with pytest.raises(AssertionError) as info:
    _backup_and_restore_per_epoch(tmp_path)
  # Caught by the checks of where the resumed fit starts, not later.
  assert "_assert_resumed_at" in [entry.name for entry in info.traceback]


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_backup_and_restore_per_steps_resumes_bit_for_bit(tmp_path):
  backup = str(tmp_path / "backup")
  # Saved after every 2 steps (counted across epochs): the last backup is
  # after step 4, epoch 1's first batch.
  _interrupted([keras.callbacks.BackupAndRestore(backup, save_freq=2)],
               epoch=1, batch=2)
  resumed = _model(global_seed=RESUME_SEED)
  start = _ResumeStart()
  _fit(resumed, EPOCHS,
       callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=2),
                  start])
  # Restored: the optimizer resumes at the backup's step 4, in epoch 1.
  assert start.epoch == 1, start.epoch
  assert int(start.state["iterations"]) == 4, start.state["iterations"]
  # Neither Keras continues a mid-epoch backup on the uninterrupted run's
  # batches (Adam neither): Keras 3 records the epoch only and takes epoch 1
  # again from its first batch; tf_keras starts epoch 1 at step 1 but
  # feeds the data from the epoch's start, and its later epochs go on in
  # that shifted stream. The resumed run equals, bit for bit, a run fed
  # the same batches in order after the backup's 4 steps.
  x, y = _data()
  if LEGACY:
    after_backup = [(0, 2 * BATCH), (2 * BATCH, N), (0, 2 * BATCH)]
  else:
    after_backup = [(0, N), (0, N)]
  same_batches = _model()
  for first, last in [(0, N), (0, BATCH)] + after_backup:
    same_batches.fit(x[first:last], y[first:last], batch_size=BATCH,
                     epochs=1, shuffle=False, verbose=0)
  want = _state(same_batches)
  _assert_identical(_state(resumed), want)


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("weights_only", [True, False])
def test_model_checkpoint_resumes_bit_for_bit(tmp_path, weights_only):
  path = str(tmp_path / ("ckpt.weights.h5" if weights_only else "ckpt.keras"))
  _interrupted([keras.callbacks.ModelCheckpoint(
      path, save_weights_only=weights_only)], epoch=2)
  if weights_only:
    resumed = _model(global_seed=RESUME_SEED)
    resumed.load_weights(path)
  else:
    resumed = kfac.keras.saving_utils.load_model(path)
    assert resumed.optimizer.model is resumed
  _fit(resumed, EPOCHS, initial_epoch=2)
  _assert_identical(_state(resumed), _uninterrupted())


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("how", [
    "save_weights", "save",
    pytest.param("keras_load_model", marks=pytest.mark.slow)])  # 19 s
def test_saved_and_loaded_model_resumes_bit_for_bit(tmp_path, how):
  first = _model()
  _fit(first, 1)
  if how == "save_weights":
    path = str(tmp_path / "model.weights.h5")
    first.save_weights(path)
    resumed = _model(global_seed=RESUME_SEED)
    resumed.load_weights(path)
  else:
    path = str(tmp_path / "model.keras")
    first.save(path)
    if how == "save":
      resumed = kfac.keras.saving_utils.load_model(path)
    else:
      resumed = keras.models.load_model(path)
      resumed.optimizer.register_model(resumed)
  _assert_identical(_state(resumed), _state(first))
  _fit(resumed, EPOCHS, initial_epoch=1)
  _assert_identical(_state(resumed), _uninterrupted())


def test_load_into_a_mismatched_model_names_the_variable(tmp_path):
  path = str(tmp_path / "small.weights.h5")
  small = _model(hidden=16)
  _fit(small, 1, rows=BATCH)
  small.save_weights(path)
  with pytest.raises(ValueError) as info:
    _model(hidden=32).load_weights(path)
  # The layer (or variable), and both shapes.
  message = str(info.value)
  assert "hidden" in message and "(6, 16)" in message, message[:2000]
  assert "(6, 32)" in message, message[:2000]


def test_load_of_a_truncated_file_names_it(tmp_path):
  path = str(tmp_path / "cut.weights.h5")
  model = _model()
  _fit(model, 1, rows=BATCH)
  model.save_weights(path)
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    f.truncate(size // 2)
  with pytest.raises(OSError) as info:
    _model().load_weights(path)
  # h5py's read error ("Unable to synchronously open file (truncated file:
  # eof = ...)"; it does not repeat the path).
  assert "truncated file" in str(info.value), repr(info.value)


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
def test_tf_checkpoint_errors_stay_tensorflows(tmp_path):
  """tf.train.Checkpoint (what tf_keras's BackupAndRestore writes): a
  Dense(16) checkpoint restored into Dense(32) fails in restore() with
  TensorFlow's shape error, and a truncated data file with its read
  error, before any K-FAC step."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  small = _model(hidden=16)
  _fit(small, 1, rows=BATCH)
  path = tf.train.Checkpoint(model=small, optimizer=small.optimizer).save(
      str(tmp_path / "ckpt"))
  big = _model(hidden=32)
  with pytest.raises(ValueError) as info:
    tf.train.Checkpoint(model=big, optimizer=big.optimizer).restore(path)
  # "Received incompatible tensor with shape (6, 16) when attempting to
  # restore variable with shape (6, 32) and name .../hidden/kernel:0" (the
  # first variable TensorFlow restores: the kernel or the bias).
  assert re.search(r"shape \((6, )?16,?\) .* shape \((6, )?32,?\) and name "
                   r"\S*hidden/", str(info.value)), str(info.value)[:2000]
  (data,) = [f for f in os.listdir(str(tmp_path)) if ".data-" in f]
  data = os.path.join(str(tmp_path), data)
  with open(data, "r+b") as f:
    f.truncate(os.path.getsize(data) // 2)
  same = _model(hidden=16)
  with pytest.raises(IndexError, match="Read less bytes than requested"):
    tf.train.Checkpoint(model=same, optimizer=same.optimizer).restore(path)


@pytest.mark.slow  # subprocess: the file again under tf_keras
def test_tf_keras():
  """This file's tests again under tf_keras (TF_USE_LEGACY_KERAS=1)."""
  if LEGACY:
    return  # this is the run under tf_keras
  # tf_keras restores Kfac's state through tf.train.Checkpoint's tracking,
  # not load_own_variables: "kfac_state" disables nothing there.
  keras_optimizer_test.run_file_under_tf_keras(
      __file__, "not tf_keras and not kfac_state")
