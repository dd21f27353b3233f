"""Where K-FAC keeps its state: variables created once, found again by name.

A `tf.function` may trace a training step several times, and in TF2 the
LayerCollection and the blocks and factors built from it are rebuilt on every
trace. The state they use (factor statistics, inverses, velocities, counters)
must not be: it lives in a `StateStore`, keyed by stable names that the layer
collection derives from the registered parameters in registration order.
Variables are created under `tf.init_scope()`, i.e. eagerly in a TF2 program
and in the current graph under a TF1 Session, never inside a trace.
"""

import contextlib

import tensorflow as tf

from kfac.python.ops.tensors import utils


class StateStore(tf.Module):
  """A name -> variable map whose variables are created outside any trace.

  It is a `tf.Module`, so `tf.train.Checkpoint(store=...)` saves everything.
  """

  def __init__(self, name="kfac_state"):
    super().__init__(name=name)
    self._store_vars = {}
    # Restored values waiting for their variable (not a checkpoint
    # dependency: tf.train.Checkpoint restores the variables themselves).
    object.__setattr__(self, "_pending", {})

  def get_or_create(self, key, shape, dtype, initial_value=0.0):
    """Returns the variable `key`, creating it (filled with `initial_value`)
    the first time. A second request must agree on shape and dtype."""
    shape = tf.TensorShape(shape)
    dtype = tf.as_dtype(dtype)
    var = self._store_vars.get(key)
    if var is not None:
      if (not isinstance(var, tf.distribute.DistributedValues) and
          _multi_replica_strategy() is not None):
        raise ValueError(
            "K-FAC state %r was created outside the %s that now runs "
            "K-FAC with several replicas (as a plain variable, which the "
            "replicas would share). Create the optimizer's state inside "
            "the strategy: run the first training step under it before "
            "reading optimizer properties (counter, damping, ...)." %
            (key, type(tf.distribute.get_strategy()).__name__))
      if var.dtype.base_dtype != dtype or not var.shape.is_compatible_with(
          shape):
        raise ValueError(
            "K-FAC state %r exists with shape %s and dtype %s but is now "
            "requested with shape %s and dtype %s. Did the registered layers "
            "change between traces?" % (key, var.shape, var.dtype.name, shape,
                                        dtype.name))
      return var
    if not shape.is_fully_defined():
      raise ValueError("K-FAC state %r needs a fully defined shape, got %s." %
                       (key, shape))
    pending = self._pending.pop(key, None)
    if pending is not None and tuple(pending.shape) != tuple(shape.as_list()):
      raise ValueError(
          "Restored K-FAC state %r has shape %s but the model now needs %s. "
          "Was it saved from a different model?" % (key, pending.shape, shape))
    strategy = _multi_replica_strategy()
    with tf.init_scope(), _root_name_scope():
      if pending is not None:
        value = tf.constant(pending, dtype=dtype)
      else:
        value = tf.fill(shape.as_list(), utils.cast(initial_value, dtype))
      name = _sanitize(self.name + "/" + key)
      # Created now, in the outermost (eager) context, with its value: not a
      # variable for tf.function to lift (see _unlifted). A step traced by
      # tf.function is then traced once, not a second time because its
      # first trace created variables.
      lifting = _unlifted()
      if strategy is None:
        var = tf.Variable(value, trainable=False, name=name, **lifting)
      else:
        var = _replica_local_variable(strategy, value, name, lifting)
    self._store_vars[key] = var
    return var

  def restore(self, values):
    """Sets the state from a {key: numpy array} map (a saved `numpy_state`).

    Variables that exist are assigned now; the others are created with
    their restored value when first requested (K-FAC state is created on
    the first traced step, which may come after loading)."""
    for key, value in values.items():
      var = self._store_vars.get(key)
      if var is None:
        self._pending[key] = value
      else:
        if tuple(var.shape) != tuple(value.shape):
          raise ValueError(
              "Restored K-FAC state %r has shape %s but the variable has "
              "shape %s." % (key, value.shape, var.shape))
        var.assign(value)

  @property
  def unused_restored_keys(self):
    """Keys restored by `restore` that no variable has asked for yet."""
    return sorted(self._pending)

  def numpy_state(self):
    """{key: numpy array} of every variable, plus values restored but not
    yet used (so saving right after loading loses nothing)."""
    out = dict(self._pending)
    out.update({k: v.numpy() for k, v in self._store_vars.items()})
    return out

  def get(self, key):
    return self._store_vars[key]

  def __contains__(self, key):
    return key in self._store_vars

  @property
  def variables_by_name(self):
    return dict(self._store_vars)


def _multi_replica_strategy():
  """The strategy when K-FAC state is requested for several replicas."""
  if not tf.distribute.has_strategy():
    return None
  strategy = tf.distribute.get_strategy()
  return strategy if strategy.num_replicas_in_sync > 1 else None


def _unlifted():
  """tf.Variable's arguments for K-FAC state created in eager mode (under
  init_scope while a tf.function traces the step): not recorded as created
  by the function. tf.function traces a function again when its first trace
  created variables (only then it can lift their initializers); the state
  is created here eagerly and already holds its value, so there is nothing
  to lift and the first trace is kept. Empty in a TF1 graph."""
  if tf.executing_eagerly():
    return {"experimental_enable_variable_lifting": False}
  return {}


def _replica_local_variable(strategy, value, name, lifting=None):
  """A variable with one copy per replica (see distribute/collective.py:
  every replica assigns it the same, already reduced, values), read from
  the first replica in cross-replica context and saved from it."""
  kwargs = dict(trainable=False, name=name,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                **(lifting or {}))
  if tf.distribute.has_strategy():
    # TF1 graph: init_scope stays in the graph and in the replica (or
    # cross-replica) context, where the strategy creates the variable.
    var = tf.Variable(value, **kwargs)
    if not tf.executing_eagerly():
      _save_once(var)
    return var
  # TF2: init_scope left the function graph that strategy.run entered.
  with strategy.scope():
    return tf.Variable(value, **kwargs)


def _root_name_scope():
  """In a TF1 graph: the top-level name scope, so that a state variable's
  name is "<store name>/<key>" wherever the step is built (a Saver's
  checkpoint keys must not depend on the name scopes opened before, which
  differ between one and several replicas). A no-op elsewhere (TF2 state
  is saved by object, not by name)."""
  if tf.executing_eagerly():
    return contextlib.nullcontext()
  return tf.compat.v1.get_default_graph().name_scope(None)


def _save_once(var):
  """A TF1 graph's GLOBAL_VARIABLES list the replica-local variable once
  (a tf.compat.v1.train.Saver saves it from the first replica and restores
  every copy) instead of each replica's copy under its own name, so that a
  checkpoint restores under any number of replicas."""
  graph = tf.compat.v1.get_default_graph()
  listed = graph.get_collection_ref(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
  components = {id(v) for v in var.values}
  listed[:] = [v for v in listed if id(v) not in components]
  if not any(v is var for v in listed):
    listed.append(var)


def _sanitize(name):
  allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                "0123456789._-/")
  return "".join(c if c in allowed else "_" for c in name)
