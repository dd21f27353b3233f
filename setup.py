"""Packaging for kfac: K-FAC for current TensorFlow (2.16-2.21)."""

from setuptools import find_packages, setup

# TensorFlow is deliberately NOT in install_requires. "tensorflow" and
# "tensorflow-cpu" (and e.g. "tensorflow-macos", "tf-nightly") are different
# distributions providing the same `tensorflow` module; depending on one of
# them would install a second TensorFlow beside the one the user already has.
# Pick one with an extra, as with the old kfac 0.2.x:
#   pip install "kfac[tensorflow]"      # or
#   pip install "kfac[tensorflow-cpu]"
# Extra names are spelled in their normalised form (PEP 685: lower case,
# dashes). setuptools writes them that way into the metadata whatever the
# spelling here, and pip before 23.3 compares the requested name without
# normalising it: "[tensorflow_cpu]" silently installs no TensorFlow there,
# "[tensorflow-cpu]" works with every pip >= 21 (and pip >= 23.3 accepts
# both spellings).
# tensorflow-probability is not required: the core samples and evaluates its
# predictive distributions with TensorFlow ops. tfp >= 0.24 cannot import its
# distributions without `tf-keras`, which requires the full `tensorflow`
# wheel. `loss.dist` (a tfp distribution, for users who want one) imports
# it lazily; the "distributions" extra installs it for environments that
# already use `tensorflow`.
# TensorFlow 2.15 is admitted for one path only: tf.estimator.Estimator and
# tf.compat.v1.estimator.tpu.TPUEstimator, which need the
# `tensorflow-estimator` package (TF <= 2.15; it no longer imports with
# 2.16+). The "estimator" / "estimator-cpu" extras pin that TensorFlow and
# its estimator (and numpy < 2, which TF 2.15 was built against); the rest
# of the library targets 2.16-2.21 and is not tested on 2.15 beyond the
# subset that `make test-tf215` runs (docs/distributed.md).
REQUIRED = [
    "numpy",
    "absl-py",
]

EXTRAS = {
    "tensorflow": ["tensorflow>=2.16"],
    "tensorflow-cpu": ["tensorflow-cpu>=2.16"],
    "distributions": ["tensorflow-probability>=0.24", "tf-keras"],
    "estimator": ["tensorflow==2.15.*", "tensorflow-estimator==2.15.*",
                  "numpy<2"],
    "estimator-cpu": ["tensorflow-cpu==2.15.*",
                      "tensorflow-estimator==2.15.*", "numpy<2"],
    # Everything a test imports is required: a missing one fails the test
    # run (pytest.ini: fail_on_skip), never skips it. TensorFlow
    # Probability: curvature_operator_test checks that its distributions
    # take kfac.linear_operator operators; scipy: the block-diagonal
    # references of curvature_matrix_vector_products_test; h5py: the HDF5
    # save / load tests. tf-keras is installed by `make venv` (it requires
    # the full `tensorflow` wheel, so it cannot be listed here).
    "tests": ["pytest", "pytest-xdist>=3.2", "scikit-learn", "scipy", "h5py",
              "tensorflow-probability>=0.24"],
    "examples": ["scikit-learn", "matplotlib"],
}

setup(
    name="kfac",
    version="0.3.0.dev0",
    description=(
        "K-FAC (Kronecker-Factored Approximate Curvature) optimizer for "
        "TensorFlow 2.16+, API-compatible with the TF1 kfac 0.2.x library."
    ),
    license="Apache-2.0",
    packages=find_packages(include=["kfac", "kfac.*"]),
    python_requires=">=3.10",
    install_requires=REQUIRED,
    extras_require=EXTRAS,
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Science/Research",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    keywords="tensorflow optimizer kfac second-order natural-gradient",
)
