#!/usr/bin/env bash
# kfac 0.2.4's own test suite (tensorflow/kfac, kfac/python/kernel_tests),
# run unchanged under this repository's TensorFlow twice: against kfac 0.2.4
# (from PyPI, in a throwaway folder) and against this package; report.py
# then writes OUT/old_suite.json (every test's outcome in both passes, the
# counts and the docs' tables) and prints the tables (docs/migration.md).
#
#   git clone https://github.com/tensorflow/kfac /tmp/tensorflow-kfac
#   examples/old_suite/run.sh /tmp/tensorflow-kfac [OUT]    # about 6 minutes
#   cp OUT/old_suite.json examples/old_suite/results/ && make docs
#
# KFAC_CLONE: a clone of github.com/tensorflow/kfac (a work tree or a bare
# repository); the suite is taken at the commit that set version='0.2.4'.
# OUT (default old_suite_results): where everything goes. tf.keras is
# tf_keras (TF_USE_LEGACY_KERAS=1), the Keras of kfac 0.2.x's Keras tests,
# as TensorFlow documents for Keras 2 code. Env: PY (default .venv/bin/python).
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
CLONE="${1:?usage: run.sh KFAC_CLONE [OUT]}"
OUT="$(mkdir -p "${2:-old_suite_results}" && cd "${2:-old_suite_results}" && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
GITDIR="$(git -C "$CLONE" rev-parse --absolute-git-dir)" || exit 2

COMMIT="$(git --git-dir="$GITDIR" log --format=%H -S"version='0.2.4'" -- setup.py | tail -n 1)"
[ -n "$COMMIT" ] || { echo "run.sh: no commit sets version='0.2.4' in $CLONE" >&2; exit 2; }
echo "kfac 0.2.4's suite at $COMMIT"
echo "$COMMIT" > "$OUT/commit.txt"
rm -rf "$OUT/tests" "$OUT/kfac024" "$OUT/testdeps" && mkdir -p "$OUT/tests/kernel_tests"
git --git-dir="$GITDIR" archive "$COMMIT" kfac/python/kernel_tests | tar -x -C "$OUT/tests/kernel_tests" \
  --strip-components=3 --wildcards '*_test.py' || exit 2
cp "$HERE/conftest.py" "$HERE/pytest.ini" "$OUT/tests/"

# kfac 0.2.4 and what it imports, where only its pass looks; sonnet 2 (one
# old test file imports sonnet) for both passes.
"$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$OUT/kfac024" \
  kfac==0.2.4 tensorflow-probability==0.25.0 dm-tree decorator || exit 2
"$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$OUT/testdeps" \
  dm-sonnet==2.0.2 tabulate || exit 2

run_pass() {  # name pythonpath kfac_folder
  local t0=$SECONDS
  ( cd "$OUT/tests" && env TF_USE_LEGACY_KERAS=1 TF_CPP_MIN_LOG_LEVEL=2 \
      PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$2" EXPECT_KFAC="$3" \
      KFAC_IMPORTED="$OUT/kfac_$1.txt" \
      "$PY" -m pytest -q -p no:cacheprovider --junitxml="$OUT/junit_$1.xml" \
      kernel_tests > "$OUT/pytest_$1.log" 2>&1 )
  echo "pass $1: $(tail -n 1 "$OUT/pytest_$1.log") ($((SECONDS - t0)) s)"
}
run_pass old "$OUT/kfac024:$OUT/testdeps" "$OUT/kfac024/kfac"
run_pass ours "$ROOT:$OUT/testdeps" "$ROOT/kfac"
"$PY" "$HERE/report.py" "$OUT"
