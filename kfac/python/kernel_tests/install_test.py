"""Installing kfac as a new user would: a fresh venv, its own pip, an extra.

The extras are the only way TensorFlow gets installed with kfac (setup.py
explains why). pip before 23.3 does not normalise a requested extra's name,
so an extra that the metadata spells differently from the README installs
no TensorFlow, with only a warning. These tests copy the tracked source
tree to a temporary folder (a fresh clone), create a venv with
`python -m venv` (whose bundled pip is the old one the README's users have:
23.2 on Python 3.11), install with the README's commands and import
`kfac` and `kfac.keras` from another directory.

Each installs TensorFlow into a new venv (about a minute from the local
package index): slow tier.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.slow

_IMPORT_CHECK = (
    "import kfac, kfac.keras, tensorflow as tf; "
    "print('KFAC_FILE', kfac.__file__); "
    "print('TF', tf.__version__); "
    "print('KERAS_OPT', kfac.keras.optimizers.Kfac.__name__)")


def _run(args, cwd, timeout=900):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PIP_NO_INPUT="1")
  for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
    env.pop(name, None)
  proc = subprocess.run([str(a) for a in args], cwd=str(cwd), env=env,
                        capture_output=True, text=True, timeout=timeout,
                        check=False)
  output = proc.stdout + proc.stderr
  assert proc.returncode == 0, "%s failed:\n%s" % (" ".join(map(str, args)),
                                                  output[-4000:])
  return output


def _fresh_clone(tmp_path):
  """The files git tracks (and the untracked ones it does not ignore)."""
  listed = subprocess.run(
      ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
      cwd=str(ROOT), capture_output=True, check=True).stdout.split(b"\0")
  dest = tmp_path / "src"
  for name in filter(None, listed):
    src = ROOT / name.decode()
    if src.is_file():
      target = dest / name.decode()
      target.parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(src, target)
  return dest


def _base_python():
  """The interpreter behind this venv (a venv's venv would share its pip)."""
  base = pathlib.Path(sys.base_prefix) / "bin" / (
      "python%s" % sysconfig.get_python_version())
  return base if base.exists() else pathlib.Path(sys.executable)


def _new_venv(tmp_path, name):
  venv = tmp_path / name
  _run([_base_python(), "-m", "venv", venv], tmp_path)
  pip_version = _run([venv / "bin" / "python", "-m", "pip", "--version"],
                     tmp_path)
  return venv, pip_version


def _check_imports(venv, elsewhere):
  out = _run([venv / "bin" / "python", "-c", _IMPORT_CHECK], elsewhere)
  assert "KERAS_OPT Kfac" in out, out
  assert "TF 2." in out, out
  return out.split("KFAC_FILE ")[1].split("\n")[0]


def test_editable_install_with_the_readme_command(tmp_path):
  """README: pip install -e ".[tensorflow-cpu]" with the venv's own pip."""
  src = _fresh_clone(tmp_path)
  venv, pip_version = _new_venv(tmp_path, "v")
  out = _run([venv / "bin" / "pip", "install", "-e", ".[tensorflow-cpu]"],
             src)
  assert "does not provide the extra" not in out, (pip_version, out[-3000:])
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  kfac_file = _check_imports(venv, elsewhere)
  assert pathlib.Path(kfac_file).resolve().is_relative_to(src.resolve()), (
      kfac_file)


def test_wheel_install_with_extra_and_metadata(tmp_path):
  """The built wheel names its extras in the form every pip resolves, and
  installing it with the extra brings TensorFlow."""
  src = _fresh_clone(tmp_path)
  venv, pip_version = _new_venv(tmp_path, "w")
  wheels = tmp_path / "wheels"
  _run([venv / "bin" / "pip", "wheel", "--no-deps", "-w", wheels, src],
       tmp_path)
  (wheel,) = list(wheels.glob("kfac-*.whl"))
  with zipfile.ZipFile(wheel) as zf:
    (meta_name,) = [n for n in zf.namelist() if n.endswith("/METADATA")]
    metadata = zf.read(meta_name).decode()
  extras = sorted(line.split(":", 1)[1].strip()
                  for line in metadata.splitlines()
                  if line.startswith("Provides-Extra:"))
  assert "tensorflow-cpu" in extras and "tensorflow" in extras, extras
  assert all("_" not in e for e in extras), extras
  out = _run([venv / "bin" / "pip", "install",
              "%s[tensorflow-cpu]" % wheel], tmp_path)
  assert "does not provide the extra" not in out, (pip_version, out[-3000:])
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  kfac_file = _check_imports(venv, elsewhere)
  assert "site-packages" in kfac_file, kfac_file


def test_import_without_tensorflow_names_the_extra(tmp_path):
  """kfac installed without an extra: `import kfac` says how to install
  TensorFlow instead of a bare ModuleNotFoundError."""
  src = _fresh_clone(tmp_path)
  venv, _ = _new_venv(tmp_path, "n")
  _run([venv / "bin" / "pip", "install", "--no-deps", src], tmp_path)
  proc = subprocess.run([str(venv / "bin" / "python"), "-c", "import kfac"],
                        cwd=str(tmp_path), capture_output=True, text=True,
                        timeout=300, check=False)
  assert proc.returncode != 0
  assert "ModuleNotFoundError" in proc.stderr, proc.stderr
  assert 'pip install "kfac[tensorflow-cpu]"' in proc.stderr, proc.stderr
