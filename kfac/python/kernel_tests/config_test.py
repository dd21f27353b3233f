"""The typed configuration (kfac/python/ops/optimizers/config.py).

* Every setting of KfacOptimizer and PeriodicInvCovUpdateKfacOpt is one
  field of `KfacConfig`, listed once, with a docstring; the objects that
  are not settings (the collection, the variables, the loss and batches)
  are not fields.
* The groups are frozen.
* The constructors' arguments arrive in the config unchanged (periods
  included), and `optimizer.config` is read-only.
* The Keras `Kfac`'s `get_config` round-trips it: `Kfac.from_config(
  opt.get_config())` builds a core optimizer with the same configuration
  (hyperparameter variables compared by value, callables by name)."""

import ast
import dataclasses
import inspect
import typing

import numpy as np
import pytest
import tensorflow as tf

import kfac
import kfac.keras
from kfac.python.keras import keras_flavor
from kfac.python.ops.optimizers import config as config_lib
from kfac.python.ops.optimizers import kfac_optimizer

keras = keras_flavor.keras_module()

# Constructor arguments that are objects the program hands the optimizer,
# not settings (config.py's docstring), and the two that are not kept:
# tf_replicator (only None is accepted) and the catch-all kfac_kwargs.
NOT_SETTINGS = {"self", "layer_collection", "var_list", "loss", "loss_fn",
                "train_batch", "prev_train_batch", "qmodel_layer_collection",
                "tf_replicator", "kfac_kwargs"}
# Fields derived from the arguments, not arguments themselves.
DERIVED = {"kfac_owns_damping", "periods"}


def _groups(cls=config_lib.KfacConfig):
  """[(path, dataclass)] of the config and its groups."""
  out = [("", cls)]
  hints = typing.get_type_hints(cls)
  for f in dataclasses.fields(cls):
    for t in (hints[f.name],) + typing.get_args(hints[f.name]):
      if dataclasses.is_dataclass(t):
        out += [(f.name + "." + p if p else f.name, c) for p, c in _groups(t)]
  return out


def _leaf_fields():
  """[field name] of every group's fields that are not groups."""
  names = []
  for _, cls in _groups():
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
      if not any(dataclasses.is_dataclass(t) for t in
                 (hints[f.name],) + typing.get_args(hints[f.name])):
        names.append(f.name)
  return names


def test_every_setting_is_one_field():
  args = set()
  for fn in (kfac_optimizer.KfacOptimizer.__init__,
             kfac_optimizer.PeriodicInvCovUpdateKfacOpt.__init__):
    args |= set(inspect.signature(fn).parameters)
  settings = args - NOT_SETTINGS
  fields = _leaf_fields()
  assert len(fields) == len(set(fields)), "a setting listed twice"
  assert settings <= set(fields), sorted(settings - set(fields))
  assert set(fields) - settings <= DERIVED, sorted(set(fields) - settings)


def test_every_field_has_a_docstring():
  tree = ast.parse(inspect.getsource(config_lib))
  for node in tree.body:
    if not (isinstance(node, ast.ClassDef) and any(
        isinstance(d, ast.Call) and "dataclass" in ast.unparse(d.func)
        for d in node.decorator_list)):
      continue
    body = node.body
    for i, item in enumerate(body):
      if isinstance(item, ast.AnnAssign):
        doc = body[i + 1] if i + 1 < len(body) else None
        assert (isinstance(doc, ast.Expr) and
                isinstance(doc.value, ast.Constant) and
                isinstance(doc.value.value, str)), (
                    "%s.%s has no docstring" % (node.name,
                                                ast.unparse(item.target)))


def test_groups_are_frozen():
  for path, cls in _groups():
    assert cls.__dataclass_params__.frozen, path or "KfacConfig"
  cfg = config_lib.KfacConfig()
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.name = "other"  # pytype: disable=not-writable
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.damping.min_damping = 1.0  # pytype: disable=not-writable


def test_constructor_arguments_arrive_in_the_config():
  opt = kfac.PeriodicInvCovUpdateKfacOpt(
      learning_rate=0.3, damping=0.02, momentum=0.7, momentum_type="regular",
      norm_constraint=2.0, cov_ema_decay=0.9, invert_every=7,
      cov_update_every=3, num_burnin_steps=4, estimation_mode="empirical",
      skip_non_finite_steps=False, max_consecutive_skipped_steps=3,
      l2_reg=1e-4, name="cfg")
  cfg = opt.config
  assert (cfg.update.learning_rate, cfg.update.momentum,
          cfg.update.momentum_type, cfg.update.norm_constraint) == (
              0.3, 0.7, "regular", 2.0)
  assert (cfg.damping.damping, cfg.damping.l2_reg) == (0.02, 1e-4)
  # An explicit cov_ema_decay is raised to the power cov_update_every, as
  # in kfac 0.2.x (periodic.py).
  assert cfg.curvature.cov_ema_decay == pytest.approx(0.9**3, rel=1e-15)
  assert cfg.curvature.estimation_mode == "empirical"
  assert (cfg.curvature.periods.invert_every,
          cfg.curvature.periods.cov_update_every,
          cfg.curvature.periods.num_burnin_steps) == (7, 3, 4)
  assert (cfg.guard.skip_non_finite_steps,
          cfg.guard.max_consecutive_skipped_steps) == (False, 3)
  assert cfg.name == "cfg"
  with pytest.raises(AttributeError):
    opt.config = config_lib.KfacConfig()
  # The base optimizer has no periods: the program runs the estimator's
  # update ops itself.
  base = kfac.KfacOptimizer(learning_rate=0.1, damping=0.1)
  assert base.config.curvature.periods is None


def _comparable(value):
  """A config's value for comparison: variables and tensors by value,
  callables by qualified name, dataclasses field by field."""
  if dataclasses.is_dataclass(value):
    return {f.name: _comparable(getattr(value, f.name))
            for f in dataclasses.fields(value)}
  if isinstance(value, dict):
    return {k: _comparable(v) for k, v in value.items()}
  if isinstance(value, (tf.Variable, tf.Tensor)) or hasattr(value, "numpy"):
    return ("value", float(np.asarray(value)))
  if callable(value) and not isinstance(value, type):
    return ("callable", getattr(value, "__qualname__", repr(type(value))))
  return value


@pytest.mark.parametrize("kwargs", [
    dict(adaptive=True),
    dict(adaptive=True, momentum_type="regular", learning_rate=0.05,
         weight_decay=1e-3),
    dict(learning_rate=0.1, damping=0.01, momentum=0.8, invert_every=3,
         cov_update_every=2, norm_constraint=1.5, cov_ema_decay=0.9,
         estimation_mode="empirical", weight_decay_coeff=0.2,
         use_weight_decay=True),
], ids=["recipe", "fixed_rate_recipe", "fixed"])
def test_keras_get_config_round_trips_the_config(kwargs):
  model = keras.Sequential([keras.Input((4,)),
                            keras.layers.Dense(3, name="d")])
  opt = kfac.keras.optimizers.Kfac(model=model, seed=1,
                                   loss="mean_squared_error", **kwargs)
  again = type(opt).from_config(opt.get_config())
  assert again.get_config() == opt.get_config()
  first = _comparable(opt.kfac_optimizer.config)
  second = _comparable(again.kfac_optimizer.config)
  assert first == second
  # (and the comparison sees a difference)
  other = type(opt).from_config(dict(opt.get_config(), name="other"))
  assert _comparable(other.kfac_optimizer.config) != first
