"""The Kfac class the user sees: `Kfac` is the class of the Keras that
`tf.keras` resolves to and of the engine in use (kfac_class), each defined
in source in its own module, which imports its Keras:

* keras3.Kfac: a Keras 3 optimizer;
* legacy_keras.Kfac: a tf_keras (Keras 2) optimizer, TF2;
* keras/graph_optimizer.Kfac: kfac 0.2.x's graph-mode Kfac, the tf_keras
  class of its v1 engine in a TF1 graph (legacy_keras's docstring says why
  it is a class of its own).

The Keras 3 and TF2 tf_keras classes are registered for Keras
serialization as "kfac>Kfac" when this module is imported."""

from kfac.python.keras import keras_flavor


def kfac_class(legacy=None):
  """The Kfac class of the Keras 3 (legacy=False) or tf_keras flavour
  (default: the one tf.keras resolves to); for tf_keras in a TF1 graph (v2
  behaviour disabled, or inside a tf.compat.v1.Graph), the graph-mode
  class of its v1 engine."""
  if legacy is None:
    legacy = keras_flavor.legacy_keras_active()
  if not legacy:
    from kfac.python.keras.optimizer import keras3  # pylint: disable=g-import-not-at-top
    return keras3.Kfac
  if keras_flavor.v1_graph_mode():
    from kfac.python.keras import graph_optimizer  # pylint: disable=g-import-not-at-top
    return graph_optimizer.Kfac
  from kfac.python.keras.optimizer import legacy_keras  # pylint: disable=g-import-not-at-top
  return legacy_keras.Kfac


def __getattr__(name):
  # `Kfac`, looked up where it is used: the class of the engine in use.
  if name == "Kfac":
    return kfac_class()
  raise AttributeError("module %r has no attribute %r" % (__name__, name))


# The flavour's TF2 class, registered for Keras serialization on import.
if keras_flavor.legacy_keras_active():
  from kfac.python.keras.optimizer import legacy_keras  # pylint: disable=g-import-not-at-top,unused-import
else:
  from kfac.python.keras.optimizer import keras3  # pylint: disable=g-import-not-at-top,unused-import
