r"""CPU milliseconds of the quadratic model's two curvature products (J p and
J d of a Keras model's outputs, kfac's op-by-op forward mode) with every
forward-mode rule, against the same products with some rules removed (those
ops then take the generic path: their gradient differentiated again).

What the direct rules of issue 32's convnets buy, measured alone: the
products are one part of an adaptive step, too small a part for a
side-by-side `fit` on a shared machine to resolve. Both variants are traced
in one process on the same model, inputs and tangents, TensorFlow limited to
one thread; they alternate in --rounds rounds (order reversed every other
round) of --calls calls each; ms is the process CPU time per call, best and
median round. The products of the two variants are also compared (equal up
to float32 rounding: the rules are exact; the model runs in inference mode
so that no dropout draw differs).

  python examples/benchmarks/products_step_time.py                   # ~3 min
  python examples/benchmarks/products_step_time.py --models=mobilenetv2 \
      --without=Relu6,Pad

Models: keras.applications EfficientNetB0 (effnet), MobileNetV2 (alpha 0.35),
ResNet50, all 32x32x3 inputs and 10 classes, and `tiny` (a few layers with
the same ops, for the tests). Writes products_step_time.md and .json.
"""

import json
import os
import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS
NEW_RULES = ("Pad", "MirrorPad", "PadV2", "Select", "SelectV2", "Relu6",
             "LeakyRelu", "Elu", "IdentityN")
flags.DEFINE_list("models", ["effnet", "mobilenetv2"], "effnet, "
                  "mobilenetv2, resnet50, tiny.")
flags.DEFINE_list("without", list(NEW_RULES), "Op types whose direct rules "
                  "the second variant goes without.")
flags.DEFINE_integer("batch_size", 64, "Rows of the products.")
flags.DEFINE_integer("calls", 10, "Calls per timed round.")
flags.DEFINE_integer("rounds", 6, "Alternating timed rounds.")
flags.DEFINE_string("output_dir", "/tmp/kfac_products_step_time", "Where to "
                    "write products_step_time.md and .json.")


def _tiny(keras):
  """Padding, ReLU6, swish and dropout around two small convolutions."""
  inputs = keras.Input((32, 32, 3))
  h = keras.layers.ZeroPadding2D(1)(inputs)
  h = keras.layers.Conv2D(4, 3, strides=2, activation="relu6")(h)
  h = keras.layers.DepthwiseConv2D(3, padding="same", activation="swish")(h)
  h = keras.layers.Dropout(0.2)(h)
  h = keras.layers.GlobalAveragePooling2D()(h)
  return keras.Model(inputs, keras.layers.Dense(10)(h))


def _build(keras, name):
  if name == "tiny":
    return _tiny(keras)
  apps = keras.applications
  builders = {
      "effnet": lambda: apps.EfficientNetB0(
          weights=None, input_shape=(32, 32, 3), classes=10),
      "resnet50": lambda: apps.ResNet50(
          weights=None, input_shape=(32, 32, 3), classes=10),
      "mobilenetv2": lambda: apps.MobileNetV2(
          weights=None, input_shape=(32, 32, 3), classes=10, alpha=0.35),
  }
  if name not in builders:
    raise ValueError("--models: unknown model %r (effnet, mobilenetv2, "
                     "resnet50, tiny)." % name)
  return builders[name]()


def _measure(name):
  """{variant: {nodes, ms_rounds, value}} for one model."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  from kfac.python.keras import keras_flavor  # pylint: disable=g-import-not-at-top
  from kfac.python.ops import forward_mode  # pylint: disable=g-import-not-at-top
  from kfac.python.ops.forward_mode import rules  # pylint: disable=g-import-not-at-top

  keras.utils.set_random_seed(0)
  model = _build(keras, name)
  rng = np.random.RandomState(0)
  x = tf.constant(rng.rand(FLAGS.batch_size, 32, 32, 3).astype("float32"))
  variables = [keras_flavor.unwrap_variable(v)
               for v in model.trainable_variables]
  tangents = [[tf.constant(rng.randn(*v.shape).astype("float32"))
               for v in variables] for _ in range(2)]

  def products():
    @tf.function
    def run():
      y = model(x, training=False)
      total = tf.constant(0.0)
      for t in tangents:  # J p and J d, as the quadratic model takes them
        jv = forward_mode.jvp([y], variables, t)[0]
        total += tf.reduce_sum(jv * jv)
      return total
    run()  # traced here, with the rules in place now
    return run

  unknown = [k for k in FLAGS.without if k not in rules.RULES]
  if unknown:
    raise ValueError("--without: no direct rule for %s." % unknown)
  variants = {"all rules": products()}
  removed = {k: rules.RULES.pop(k) for k in FLAGS.without}
  try:
    variants["without " + ",".join(FLAGS.without)] = products()
  finally:
    rules.RULES.update(removed)
  out = {}
  for key, fn in variants.items():
    out[key] = dict(
        nodes=len(fn.get_concrete_function().graph.get_operations()),
        value=float(fn()), ms_rounds=[])
  order = list(variants.items())
  for r in range(FLAGS.rounds):
    for key, fn in (order if r % 2 == 0 else order[::-1]):
      fn()
      start = time.process_time()
      for _ in range(FLAGS.calls):
        fn()
      out[key]["ms_rounds"].append(
          (time.process_time() - start) / FLAGS.calls * 1000)
  return out


def main(argv):
  del argv
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.threading.set_intra_op_parallelism_threads(1)
  tf.config.threading.set_inter_op_parallelism_threads(1)
  results = {name: _measure(name) for name in FLAGS.models}
  lines = ["| model | variant | graph nodes | CPU ms per call (best) | "
           "median | sum of squared products |",
           "|---|---|---:|---:|---:|---:|"]
  for name, variants in results.items():
    for key, r in variants.items():
      rounds = sorted(r["ms_rounds"])
      lines.append("| %s | %s | %d | %.1f | %.1f | %.6g |" % (
          name, key, r["nodes"], rounds[0], rounds[len(rounds) // 2],
          r["value"]))
  table = "\n".join(lines) + "\n"
  print(table)
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  with open(os.path.join(FLAGS.output_dir, "products_step_time.md"),
            "w") as f:
    f.write(table)
  with open(os.path.join(FLAGS.output_dir, "products_step_time.json"),
            "w") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  app.run(main)
