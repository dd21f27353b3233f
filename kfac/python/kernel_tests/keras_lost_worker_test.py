"""A lost worker: tf_keras `fit` with Kfac under MultiWorkerMirroredStrategy
(2 localhost worker processes, TF_CONFIG) and BackupAndRestore
(save_freq="epoch"). Worker 1 kills itself with SIGKILL in the middle of
epoch 1; worker 0, blocked in the step's collectives, is killed too; the
job is restarted (both workers, the same backup directory), as
tf.distribute's fault tolerance documents. The restarted job resumes from
the backup of epoch 0 and ends with weights bit-identical to an
uninterrupted 2-worker run's (the same collectives on the same data in the
same order), on both workers.

keras_lost_worker_program.py is one worker. Keras 3 `fit` under
MultiWorkerMirroredStrategy is broken upstream (keras issue 20585), so
this runs under tf_keras (TF_USE_LEGACY_KERAS=1)."""

import json
import signal
import subprocess
import sys

import pytest

from kfac.python.kernel_tests import distribute_test

pytestmark = pytest.mark.slow  # 3 jobs of 2 processes

_PROGRAM = [sys.executable, "-m",
            "kfac.python.kernel_tests.keras_lost_worker_program"]
_TIMEOUT = 600


def _env():
  return dict(distribute_test.env(), TF_USE_LEGACY_KERAS="1")


def _start(backup, kill_epoch=-1, kill_batch=0):
  ports = ",".join(str(p) for p in distribute_test.free_ports(2))
  return [subprocess.Popen(
      _PROGRAM + [str(i), ports, backup, str(kill_epoch), str(kill_batch)],
      env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      cwd=distribute_test._ROOT) for i in range(2)]  # pylint: disable=protected-access


def _result(proc):
  stdout, stderr = proc.communicate(timeout=_TIMEOUT)
  assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
  lines = [l for l in stdout.splitlines() if l.startswith("RESULT ")]
  assert lines, stdout[-3000:]
  return json.loads(lines[-1][len("RESULT "):])


def _job(backup):
  procs = _start(backup)
  try:
    return [_result(p) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()


def test_job_restarted_after_a_lost_worker_equals_the_uninterrupted_one(
    tmp_path):
  uninterrupted = _job(str(tmp_path / "uninterrupted"))
  backup = str(tmp_path / "backup")
  procs = _start(backup, kill_epoch=1, kill_batch=1)
  try:
    stdout, _ = procs[1].communicate(timeout=_TIMEOUT)
    assert procs[1].returncode == -signal.SIGKILL, stdout[-3000:]
    assert "KILLED" in stdout
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()  # worker 0 waits for the lost one
      p.communicate()
  assert procs[0].returncode != 0  # it did not finish alone
  restarted = _job(backup)
  for got, want in zip(restarted, uninterrupted):
    assert want["epochs_run"] == [0, 1, 2]
    assert got["epochs_run"] == [1, 2]  # resumed from epoch 0's backup
    assert got["iterations"] == want["iterations"] == 6
    assert got["weights"] == want["weights"]  # bit for bit
  assert restarted[0]["weights"] == restarted[1]["weights"]
  assert uninterrupted[0]["weights"] != _initial_weights()  # it trained


def _initial_weights():
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(1)
  shapes = [(4, 5), (5,), (5, 3), (3,)]
  return [(rng.randn(*s) * 0.5).astype(np.float32).tolist() for s in shapes]
