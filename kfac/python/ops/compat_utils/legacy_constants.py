"""`set_global_constants` of the old fisher_factors, fisher_blocks, utils and
optimizer modules, mapped onto this package's explicit configuration.

The old library steered its factors through module-level knobs read while
ops were built. This package has none: each setting is either explicit
configuration, the one fixed behaviour (the old default), or an explicit
argument of the registration or function it affects. The old calls still
work:

* a setting of the curvature model (pi_type, normalize_damping_power,
  eigenvalue clipping, sub-sampling of conv inputs) changes the default
  `CurvatureOptions` (layers/base/curvature_options.py) that a `LayerCollection` made
  afterwards picks up; `include_damping_in_qmodel_change` changes the
  default of `KfacOptimizer(include_damping_in_qmodel_change=None)` for
  optimizers made afterwards. Objects that exist keep their configuration:
  nothing is read from here while ops are built;
* a value equal to our behaviour (the old default), or one that changed
  only where ops were placed (tower_strategy), is accepted silently;
* a value that only tuned speed, naming or placement, or had no effect in
  the old library either, is accepted with a `LegacyConstantWarning` saying
  what we do instead;
* a value that would change the curvature model in a way we do not offer
  raises ValueError naming the setting and the alternative;
* an unknown setting raises TypeError (as a wrong keyword argument would).

`LEGACY_SETTINGS` documents every old setting: its old default and what
happens to other values. `curvature_defaults()` / `optimizer_defaults()`
read the current defaults; `restore_defaults()` puts back the old library's.
"""

import dataclasses
import numbers
import warnings

from kfac.python.ops.layers.base import curvature_options


class LegacyConstantWarning(UserWarning):
  """An old global constant was set to a value this package ignores."""


def _warn(module, name, value, why):
  warnings.warn("%s.set_global_constants(%s=%r) is ignored: %s" %
                (module, name, value, why), LegacyConstantWarning,
                stacklevel=4)


def _error(module, name, value, why):
  raise ValueError("%s.set_global_constants(%s=%r) is not supported: %s" %
                   (module, name, value, why))


def _bool(module, name, value):
  if not isinstance(value, bool):
    raise ValueError("%s.set_global_constants: %s must be a bool, got %r." %
                     (module, name, value))
  return value


def _number(module, name, value, minimum=None):
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError("%s.set_global_constants: %s must be a number, got %r."
                     % (module, name, value))
  if minimum is not None and value < minimum:
    raise ValueError("%s.set_global_constants: %s must be >= %s, got %r." %
                     (module, name, minimum, value))
  return value


# setting -> (old default, what a value does, the values it takes, the
# explanation). What a value does: "curvature" sets that field of the
# default CurvatureOptions, "optimizer" the default of KfacOptimizer's
# argument of that name (any value, the old default included); otherwise a
# value other than the old default is accepted ("accept"), warned about
# ("warn") or rejected ("error"). Applied by `apply`.
_FACTORS = "kfac.fisher_factors"
_BLOCKS = "kfac.fisher_blocks"
_UTILS = "kfac.utils"
_OPTIMIZER = "kfac.optimizer"

LEGACY_SETTINGS = {
    _OPTIMIZER: {
        "include_damping_in_qmodel_change": (
            False, "optimizer", "bool",
            "the default of KfacOptimizer(include_damping_in_qmodel_change="
            "...): whether the predicted change of the loss used by the "
            "damping rule (qmodel_change) includes the damping term"),
    },
    _FACTORS: {
        "init_covariances_at_zero": (
            True, "warn", "bool",
            "covariance moving averages start at zero and are zero-debiased "
            "(this setting was read at import time in the old library, so "
            "setting it had no effect there either)"),
        "zero_debias": (
            True, "warn", "bool",
            "covariance moving averages are always zero-debiased (after t "
            "updates the two differ by a factor 1 - decay^t)"),
        "init_inverses_at_zero": (
            True, "warn", "bool",
            "inverses are computed from the statistics before first use "
            "(read at import time in the old library; no effect there "
            "either)"),
        "eigenvalue_decomposition_threshold": (
            4, "curvature", "positive",
            "CurvatureOptions.eigenvalue_decomposition_threshold: how many "
            "inverses of a factor make them use its eigendecomposition (and "
            "so the eigenvalue clipping)"),
        "eigenvalue_clipping_threshold": (
            0.0, "curvature", "nonnegative",
            "CurvatureOptions.eigenvalue_clipping_threshold: eigenvalues of "
            "a factor's eigendecomposition are raised to at least this"),
        "assume_zero_mean_activations": (
            False, "error", "bool",
            "the SUA conv input factor always estimates the activations' "
            "mean"),
        "subtract_mean_contrib_from_cov": (
            True, "error", "bool",
            "the SUA conv input factor always separates the mean from the "
            "covariance"),
        "sub_sample_inputs": (
            False, "curvature", "bool",
            "CurvatureOptions.sub_sample_inputs: the default of "
            "register_conv2d(sub_sample_inputs=...) for kron layers"),
        "inputs_to_extract_patches_factor": (
            0.2, "curvature", "positive",
            "CurvatureOptions.inputs_to_extract_patches_factor: the fraction "
            "of the examples that sub_sample_inputs=True keeps"),
        "sub_sample_patches": (
            False, "warn", "bool",
            "sub-sampling of patches is chosen per layer: pass "
            "sub_sample_patches=True (or a number of patches) to "
            "register_conv2d; statistics use all patches"),
        "max_num_patches": (
            10000000, "warn", "positive",
            "pass sub_sample_patches=<number of patches> to register_conv2d"),
        "max_num_patches_per_dimension": (
            3.0, "warn", "positive",
            "pass sub_sample_patches=<number of patches> to register_conv2d"),
        "tower_strategy": (
            "separate", "accept", ("separate", "concat"),
            "towers' statistics are always computed on their concatenation; "
            "the results are the same"),
        "get_sanitized_name_fn": (
            None, "warn", "callable",
            "factor variables are named after their factors"),
        "use_patches_second_moment_op": (
            False, "warn", "bool",
            "conv statistics are computed with standard ops"),
    },
    _BLOCKS: {
        "normalize_damping_power": (
            1.0, "curvature", "nonnegative",
            "CurvatureOptions.normalize_damping_power: blocks shared over c "
            "positions split damping / c^power"),
        "pi_type": (
            "tracenorm", "curvature", ("tracenorm", "off"),
            "CurvatureOptions.pi_type: how Kronecker blocks split the "
            "damping between their factors"),
    },
    _UTILS: {
        "posdef_inv_method": (
            "cholesky", "warn", ("cholesky", "matrix_inverse", "eig"),
            "factor inverses always use Cholesky (with a float64 fallback "
            "for ill-conditioned float32 factors); utils.posdef_inv takes "
            "method= explicitly"),
        "tf_replicator": (
            None, "error", "any",
            "TF-Replicator does not exist in TensorFlow 2; use a "
            "tf.distribute strategy"),
    },
}


def _validate(module, name, value, kind):
  if kind == "bool":
    return _bool(module, name, value)
  if kind == "positive":
    _number(module, name, value)
    if value <= 0:
      raise ValueError("%s.set_global_constants: %s must be positive, got "
                       "%r." % (module, name, value))
    return value
  if kind == "nonnegative":
    return _number(module, name, value, minimum=0)
  if kind == "callable":
    if not callable(value):
      raise ValueError("%s.set_global_constants: %s must be callable, got "
                       "%r." % (module, name, value))
    return value
  if isinstance(kind, tuple) and value not in kind:
    raise ValueError("%s.set_global_constants: %s must be one of %s, got %r."
                     % (module, name, ", ".join(map(repr, kind)), value))
  return value


def apply(module, settings):
  """Checks the keyword arguments of `module`'s old set_global_constants
  (None means "leave unchanged", as in the old library) and warns or
  raises as documented in `LEGACY_SETTINGS`."""
  table = LEGACY_SETTINGS[module]
  unknown = sorted(set(settings) - set(table))
  if unknown:
    raise TypeError("%s.set_global_constants() got unexpected keyword "
                    "argument(s) %s; known: %s." %
                    (module, ", ".join(unknown), ", ".join(sorted(table))))
  curvature, optimizer = {}, {}
  for name in table:  # a stable order for the messages
    value = settings.get(name)
    if value is None:
      continue
    default, action, kind, why = table[name]
    _validate(module, name, value, kind)
    if action == "curvature":
      curvature[name] = value
      continue
    if action == "optimizer":
      optimizer[name] = value
      continue
    if default is not None and value == default and (
        type(value) is type(default) or isinstance(default, float)):
      continue
    if action == "accept":
      continue
    if action == "warn":
      _warn(module, name, value, why)
    else:
      _error(module, name, value, why)
  global _curvature_defaults
  if curvature:
    try:
      _curvature_defaults = dataclasses.replace(_curvature_defaults,
                                                **curvature)
    except ValueError as e:
      raise ValueError("%s.set_global_constants: %s" % (module, e)) from None
  _optimizer_defaults.update(optimizer)


# The defaults that objects made from now on pick up (see the module doc).
_curvature_defaults = curvature_options.CurvatureOptions()
_optimizer_defaults = {"include_damping_in_qmodel_change": False}


def curvature_defaults():
  """The CurvatureOptions a LayerCollection made now gets by default."""
  return _curvature_defaults


def optimizer_defaults():
  """{"include_damping_in_qmodel_change": ...}: the defaults a KfacOptimizer
  made now gets for its arguments left at None."""
  return dict(_optimizer_defaults)


def restore_defaults():
  """Undoes every set_global_constants call: the old library's defaults."""
  global _curvature_defaults
  _curvature_defaults = curvature_options.CurvatureOptions()
  _optimizer_defaults["include_damping_in_qmodel_change"] = False


def set_fisher_factors_constants(init_covariances_at_zero=None,
                                 zero_debias=None,
                                 init_inverses_at_zero=None,
                                 eigenvalue_decomposition_threshold=None,
                                 eigenvalue_clipping_threshold=None,
                                 assume_zero_mean_activations=None,
                                 subtract_mean_contrib_from_cov=None,
                                 sub_sample_inputs=None,
                                 inputs_to_extract_patches_factor=None,
                                 sub_sample_patches=None,
                                 max_num_patches=None,
                                 max_num_patches_per_dimension=None,
                                 tower_strategy=None,
                                 get_sanitized_name_fn=None,
                                 use_patches_second_moment_op=None):
  """The old `fisher_factors.set_global_constants` (see the module doc)."""
  apply(_FACTORS, dict(
      init_covariances_at_zero=init_covariances_at_zero,
      zero_debias=zero_debias,
      init_inverses_at_zero=init_inverses_at_zero,
      eigenvalue_decomposition_threshold=eigenvalue_decomposition_threshold,
      eigenvalue_clipping_threshold=eigenvalue_clipping_threshold,
      assume_zero_mean_activations=assume_zero_mean_activations,
      subtract_mean_contrib_from_cov=subtract_mean_contrib_from_cov,
      sub_sample_inputs=sub_sample_inputs,
      inputs_to_extract_patches_factor=inputs_to_extract_patches_factor,
      sub_sample_patches=sub_sample_patches,
      max_num_patches=max_num_patches,
      max_num_patches_per_dimension=max_num_patches_per_dimension,
      tower_strategy=tower_strategy,
      get_sanitized_name_fn=get_sanitized_name_fn,
      use_patches_second_moment_op=use_patches_second_moment_op))


def set_fisher_blocks_constants(normalize_damping_power=None, pi_type=None):
  """The old `fisher_blocks.set_global_constants` (see the module doc)."""
  apply(_BLOCKS, dict(normalize_damping_power=normalize_damping_power,
                      pi_type=pi_type))


def set_utils_constants(posdef_inv_method=None, tf_replicator=None):
  """The old `utils.set_global_constants` (see the module doc)."""
  apply(_UTILS, dict(posdef_inv_method=posdef_inv_method,
                     tf_replicator=tf_replicator))


def set_optimizer_constants(include_damping_in_qmodel_change=None):
  """The old `optimizer.set_global_constants` (see the module doc)."""
  apply(_OPTIMIZER, dict(
      include_damping_in_qmodel_change=include_damping_in_qmodel_change))
