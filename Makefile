# Developer entry points for kfac.
#   make test      create .venv (first time only) and run the fast test tier
#                  (under 8 minutes on 2 cores; prints the 25 slowest tests)
#   make test-slow the slow tier only (TEST_WORKERS pytest-xdist workers, each
#                  test on the next free worker); make test-all: both tiers
#   .ci/run        what CI runs: both tiers, the TF 2.15 tests, and a check
#                  that every collected test passed (docs/testing.md)
#   make demo      adaptive K-FAC vs Adam on the K-FAC paper's deep autoencoder
#                  (about 2 minutes; plots in demo_results/)
#   make demo-autoencoder  fixed-damping K-FAC vs Adam on a smaller autoencoder
#   make demo-convnet  K-FAC vs Adam on a convnet classifier (about 2 minutes)
#   make demo-rnn  K-FAC vs Adam on an RNN over image rows (about 1.5 minutes)
#   make demo-keras  K-FAC vs Adam with Keras model.fit on a CNN (about 2 minutes)
#   make demo-adaptive  adaptive K-FAC (quadratic model, adapted damping, growing
#                  batch) vs tuned K-FAC and Adam on the K-FAC paper's autoencoder
#                  (about 6 minutes; plots in adaptive_autoencoder_results/)
#   make bench     the benchmark suite (examples/benchmarks/make_bench.py runs its programs
#                  one after another into bench_results/, each timed; what each measures,
#                  its result and the suite's time: docs/benchmarks.md)
#   make bench-step  only the step time against the old kfac 0.2.4 and SGD
#                  (autoencoder_step_time.py: train_op alone and with the loss fetched,
#                  TF2 behaviour and disable_v2_behavior(), batch 256 and 1000; its
#                  time in make bench's time table, docs/benchmarks.md); BENCH_STEP_FLAGS adds flags,
#                  e.g. BENCH_STEP_FLAGS=--threads=1 for CPU times on a loaded machine
#   make bench-tune  the hyperparameter grids of the time-to-target benchmark (about 2 hours)
#                  and of keras_validation.py (the peers' learning rates, 64 runs: an
#                  hour on the 2-core machine; writes examples/benchmarks/keras_validation_tuned.json)
#   make docs      render every generated table of README.md and docs/ from the
#                  results file its marker names (examples/benchmarks/doc_tables.py)
#   make docs-check  fail when a generated table differs from its results file or
#                  a doc names a make target, program, flag or path that does not
#                  exist (no TensorFlow; seconds; also a fast test)
#   make data      best-effort offline Fashion-MNIST for Keras
#   make test-tf215  the Estimator / TPUEstimator tests and a core subset under
#                  TensorFlow 2.15 in .venv-tf215 (about 1.5 min to install
#                  the first time)
#   make clean     remove build outputs; `make distclean` also removes .venv
#                  and .venv-tf215

SHELL := /bin/bash

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.stamp-setup
EXTRAS := tensorflow-cpu,tests,examples

FMNIST_SRC   := /usr/share/datasets/fashion-mnist
FMNIST_FILES := train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz \
                t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz

# Less TensorFlow start-up noise in every recipe below.
export TF_CPP_MIN_LOG_LEVEL := 2

.PHONY: all venv venv-tf215 test-tf215 data test test-slow test-all demo demo-autoencoder \
        demo-convnet demo-rnn demo-keras demo-adaptive bench bench-step bench-tune clean \
        distclean docs docs-check

all: test

venv: $(STAMP)

# Re-installs only when setup.py changes (or the venv is gone).
$(STAMP): setup.py
	@if [ ! -x "$(VPY)" ]; then \
	  echo "creating $(VENV) with $$($(PYTHON) --version 2>&1)"; \
	  $(PYTHON) -m venv $(VENV); \
	fi
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --progress-bar off -e ".[$(EXTRAS)]"
	@# tf-keras (Keras 2, for TF_USE_LEGACY_KERAS=1 users) requires the full
	@# `tensorflow` wheel; --no-deps installs it beside tensorflow-cpu. Its
	@# version must match TensorFlow's.
	tfv=$$($(VPY) -c "import tensorflow as tf; print('.'.join(tf.__version__.split('.')[:2]))") && \
	  $(VPY) -m pip install --progress-bar off --no-deps "tf-keras==$$tfv.*"
	@touch $@

# Best effort: never fails the build. Puts the Debian Fashion-MNIST files
# where keras.datasets.fashion_mnist.load_data() looks for them, so that it
# works offline.
data:
	@missing=0; \
	for f in $(FMNIST_FILES); do [ -f "$(FMNIST_SRC)/$$f" ] || missing=1; done; \
	if [ $$missing = 1 ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "data: installing Debian package dataset-fashion-mnist"; \
	  if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	        apt-get install -y -qq dataset-fashion-mnist) >/dev/null 2>&1; then \
	    missing=0; \
	    for f in $(FMNIST_FILES); do [ -f "$(FMNIST_SRC)/$$f" ] || missing=1; done; \
	  else \
	    echo "data: note: apt-get install dataset-fashion-mnist failed"; \
	  fi; \
	fi; \
	if [ $$missing = 1 ]; then \
	  echo "data: note: Fashion-MNIST not available in $(FMNIST_SRC); examples fall back to sklearn digits"; \
	  exit 0; \
	fi; \
	dest="$${KERAS_HOME:-$${HOME:-/tmp}/.keras}/datasets/fashion-mnist"; \
	if mkdir -p "$$dest" 2>/dev/null; then \
	  ok=1; \
	  for f in $(FMNIST_FILES); do \
	    cmp -s "$(FMNIST_SRC)/$$f" "$$dest/$$f" || cp "$(FMNIST_SRC)/$$f" "$$dest/$$f" || ok=0; \
	  done; \
	  if [ $$ok = 1 ]; then echo "data: Fashion-MNIST ready in $$dest"; \
	  else echo "data: note: could not copy Fashion-MNIST into $$dest"; fi; \
	else \
	  echo "data: note: cannot create $$dest"; \
	fi; \
	exit 0

# pytest exits 5 when it collected no tests: that is a failure too. A
# skipped, xfailed or xpassed test fails the run (pytest.ini: fail_on_skip).
# PYTEST_ARGS: more pytest arguments (.ci/run passes --run_log=FILE).
PYTEST_ARGS ?=
define run_pytest
	@rc=0; $(VPY) -m pytest kfac -q $(1) $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc = 5 ]; then echo "error: pytest collected no tests" >&2; fi; \
	exit $$rc
endef

# The fast tier (every capability, float64 oracles, both graph worlds, Keras
# fit, docs and README snippets): under 8 minutes of pytest on 2 cores, in
# TEST_WORKERS processes (pytest-xdist; a file's tests stay in one process).
TEST_WORKERS ?= 2

# One TensorFlow thread (intra- and inter-op) per worker: the workers fill
# the cores already, and TensorFlow's own thread pools spun on the core the
# other worker needed (the fast tier ran faster with this, side by side on
# the same machine; the rule: docs/testing.md). The slow tier keeps
# TensorFlow's defaults: its subprocesses run several logical devices.
test: export TF_NUM_INTRAOP_THREADS := 1
test: export TF_NUM_INTEROP_THREADS := 1
test: export OMP_NUM_THREADS := 1
test: venv data
	$(call run_pytest,-m "not slow" -n $(TEST_WORKERS) --dist loadfile --durations=25)

# The slow tier alone: subprocess runs (tf_keras flavour, examples,
# benchmark smoke runs, install into a fresh venv, the distributed matrix)
# and long end-to-end checks, in TEST_WORKERS processes that each take the
# next test (worksteal: a worker that is done takes tests queued for the
# other). The tests are safe side by side: free ports, their own temporary
# folders, one process tree each.
test-slow: venv data
	$(call run_pytest,-m slow -n $(TEST_WORKERS) --dist worksteal --durations=60)

test-all: test test-slow

# The K-FAC paper's autoencoder: adaptive K-FAC vs tuned Adam, equal time.
demo: venv data
	$(VPY) examples/adaptive_autoencoder.py --optimizers=kfac_adaptive,adam \
	  --seconds=$(DEMO_SECONDS) --num_burnin_steps=5 --output_dir=demo_results

demo-autoencoder: venv data
	$(VPY) examples/autoencoder_demo.py

demo-convnet: venv data
	$(VPY) examples/convnet_classifier.py

demo-rnn: venv data
	$(VPY) examples/rnn_rows_classifier.py

demo-keras: venv data
	$(VPY) examples/keras_fit_classifier.py

demo-adaptive: venv data
	$(VPY) examples/adaptive_autoencoder.py

# The docs' generated tables and references (plain Python, no venv needed).
docs:
	$(PYTHON) examples/benchmarks/doc_tables.py

docs-check:
	$(PYTHON) examples/benchmarks/doc_tables.py --check

# The old library (kfac 0.2.4, frozen TF1 code) is the baseline of the step
# benchmark. It goes into its own folder, without dependencies, so that it is
# never imported by anything but the benchmark's worker for it.
OLD_KFAC := .bench_deps/kfac-0.2.4

# The old kfac imports tensorflow_probability (which needs dm-tree and
# decorator); they go into the same folder so that only its worker sees them.
OLD_KFAC_STAMP := $(OLD_KFAC)/.stamp-kfac-0.2.4-tfp

$(OLD_KFAC_STAMP):
	rm -rf $(OLD_KFAC)
	$(VPY) -m pip install --quiet --no-deps --target $(OLD_KFAC) kfac==0.2.4 \
	  tensorflow-probability==0.25.0 dm-tree decorator && touch $@ || \
	  echo "bench: note: could not install kfac==0.2.4; its column is skipped"

# kfac-jax (DeepMind's K-FAC for JAX) is the peer of kfac_jax_step_time.py:
# it goes into its own folder with its pinned JAX stack (jax/jaxlib 0.8.3 CPU;
# kfac-jax 0.0.8 fails on jax 0.9.2 and 0.10.2), which only that benchmark's
# kfac-jax worker puts on its path (about 650 MB, git-ignored).
KFAC_JAX_VERSION := 0.0.8
KFAC_JAX := .bench_deps/kfac-jax-$(KFAC_JAX_VERSION)
KFAC_JAX_PINS := kfac-jax==$(KFAC_JAX_VERSION) jax==0.8.3 jaxlib==0.8.3 \
  optax==0.2.8 chex==0.1.92 distrax==0.1.9 tfp-nightly==0.26.0.dev20261027
KFAC_JAX_STAMP := $(KFAC_JAX)/.stamp-kfac-jax-$(KFAC_JAX_VERSION)

$(KFAC_JAX_STAMP):
	rm -rf $(KFAC_JAX)
	$(VPY) -m pip install --quiet --target $(KFAC_JAX) $(KFAC_JAX_PINS) && touch $@ || \
	  echo "bench: note: could not install kfac-jax $(KFAC_JAX_VERSION); its column is skipped"

BENCH_OUT := bench_results
# make bench BENCH_FLAGS=--resume: run only the programs not yet finished
BENCH_FLAGS :=
DEMO_SECONDS := 45

bench: venv data $(OLD_KFAC_STAMP) $(KFAC_JAX_STAMP)
	$(VPY) examples/benchmarks/make_bench.py --output_dir=$(BENCH_OUT) \
	  --old_kfac_path=$(OLD_KFAC) --kfac_jax_path=$(KFAC_JAX) $(BENCH_FLAGS)
	@echo "bench: tables and plots in $(BENCH_OUT)/"

BENCH_STEP_FLAGS :=

bench-step: venv data $(OLD_KFAC_STAMP)
	$(VPY) examples/benchmarks/autoencoder_step_time.py --old_kfac_path=$(OLD_KFAC) \
	  --output_dir=$(BENCH_OUT) $(BENCH_STEP_FLAGS)

bench-tune: venv data
	$(VPY) examples/benchmarks/time_to_target.py --tune --output_dir=$(BENCH_OUT)
	$(VPY) examples/benchmarks/keras_validation.py --tune --output_dir=$(BENCH_OUT)

clean:
	rm -rf build dist *.egg-info bench_results adaptive_autoencoder_results demo_results \
	  .bench_deps .pytest_cache $(STAMP)
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -print0 | xargs -0 rm -rf

distclean: clean
	rm -rf $(VENV) $(VENV215)

# ---------------------------------------------------------------- TF 2.15
# tf.estimator (Estimator, TPUEstimator) lives in `tensorflow-estimator`,
# which TensorFlow 2.16+ no longer ships. `make test-tf215` builds a second
# venv, .venv-tf215, with TensorFlow 2.15 (the "estimator-cpu" extra of
# setup.py: tensorflow-cpu 2.15, tensorflow-estimator 2.15, numpy < 2; plus
# pytest and scipy), installed once (again when setup.py changes; about
# 1.5 minutes), and runs there:
#  (a) kfac/python/kernel_tests/estimator_tf215_test.py, the Estimator,
#      MirroredStrategy Estimator and TPUEstimator(use_tpu=False) tests and
#      examples/distributed_estimator.py. The normal tiers never collect it
#      (conftest.py puts it in collect_ignore unless tensorflow_estimator is
#      installed); it is named explicitly here;
#  (b) the core's TF1 Session tests (TF215_CORE): every kernel test file of
#      the optimizer, factors, blocks, layer collection, losses, estimation
#      modes, curvature products, adaptive rules, schedules, data readers,
#      async updates and the strategy guards, in its TF1 world only
#      (-k "not function": the tf.function twins of the same math, and the
#      TF1-vs-TF2 training test, stay with the 2.16+ tiers), fast tier only
#      (-m "not slow": the slow tier's subprocess runs use the main venv's
#      packages). All of them pass unchanged on 2.15.1. Not run on 2.15:
#      keras_*_test (Keras 3 is 2.16+; 2.15 ships Keras 2), docs_test and
#      examples/benchmarks/install tests (they target the 2.16+ venv),
#      distribute_test (its programs run in the 2.16+ venv).
VENV215    := .venv-tf215
VPY215     := $(VENV215)/bin/python
STAMP215   := $(VENV215)/.stamp-setup
KT         := kfac/python/kernel_tests
TF215_CORE := $(addprefix $(KT)/,optimizer_test.py layer_collection_test.py \
  fisher_factors_test.py fisher_blocks_test.py loss_functions_test.py \
  estimator_test.py curvature_matrix_vector_products_test.py adaptive_test.py \
  multi_use_test.py conv_factors_test.py conv_blocks_test.py embedding_test.py \
  weight_sharing_test.py scale_shift_test.py schedules_test.py \
  counter_random_test.py data_reader_test.py \
  async_inv_cov_update_kfac_opt_test.py distribute_guard_test.py \
  forward_mode_test.py lazy_statistics_test.py factored_grads_test.py \
  recipe_switch_test.py block_diagonal_test.py)

venv-tf215: $(STAMP215)

$(STAMP215): setup.py
	@if [ ! -x "$(VPY215)" ]; then \
	  echo "creating $(VENV215) with $$($(PYTHON) --version 2>&1)"; \
	  $(PYTHON) -m venv $(VENV215); \
	fi
	$(VPY215) -m pip install --quiet --upgrade pip
	$(VPY215) -m pip install --progress-bar off -e ".[estimator-cpu]" pytest scipy
	@$(VPY215) -c "import tensorflow as tf, tensorflow_estimator; \
	  assert tf.__version__.startswith('2.15.'), tf.__version__; \
	  print('$(VENV215): TensorFlow', tf.__version__)"
	@touch $@

# -k: the Estimator file whole, the core files without their tf.function
# variants.
test-tf215: $(STAMP215)
	@rc=0; $(VPY215) -m pytest -q --durations=10 -m "not slow" \
	  -k "estimator_tf215 or not function" \
	  $(KT)/estimator_tf215_test.py $(TF215_CORE) || rc=$$?; \
	if [ $$rc = 5 ]; then echo "error: pytest collected no tests" >&2; fi; \
	exit $$rc

# Optional: the fast tier under Debian's Bazel 4, offline (docs/bazel.md).
# Installs bazel-bootstrap, and bazel-bootstrap-source (whose mock rules_cc
# and rules_java the WORKSPACE uses), with apt when they are missing; the
# tests run with the Python of $(VENV). Not part of `make test` or CI.
BAZEL_DEBS  := bazel-bootstrap bazel-bootstrap-source
BAZEL_FLAGS ?= --jobs=2 --local_test_jobs=1
OLD_KFAC_DIR := $(CURDIR)/$(VENV)/kfac-0.2.4-api

.PHONY: bazel-test
bazel-test: venv data
	@if ! command -v bazel >/dev/null 2>&1 || [ ! -d /usr/src/bazel-bootstrap/mock_repos ]; then \
	  if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
	    echo "bazel-test: needs the Debian packages $(BAZEL_DEBS)" >&2; exit 1; \
	  fi; \
	  echo "bazel-test: installing Debian packages $(BAZEL_DEBS)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq $(BAZEL_DEBS) >/dev/null || exit 1; \
	fi
	@# api_surface_test compares with kfac 0.2.4, fetched here (Bazel runs offline).
	@[ -f $(OLD_KFAC_DIR)/kfac/__init__.py ] || $(VPY) -m pip install -q --no-deps \
	  --disable-pip-version-check --target $(OLD_KFAC_DIR) kfac==0.2.4
	bazel test $(BAZEL_FLAGS) --test_env=PATH=$(CURDIR)/$(VENV)/bin:/usr/local/bin:/usr/bin:/bin \
	  --test_env=KFAC_OLD_PACKAGE_DIR=$(OLD_KFAC_DIR) //...
