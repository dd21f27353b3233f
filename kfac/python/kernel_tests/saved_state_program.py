"""Writes, or resumes from, K-FAC state saved by one version of kfac.

    python saved_state_program.py write DIR WORLD
    python saved_state_program.py resume DIR WORLD OUT.npz

WORLD is one of:
  keras      Keras 3 model.fit with Kfac(adaptive=True) and with a fixed-rate
             Kfac with periods, a norm constraint and AdamW's weight decay:
             `model.save(...keras)` after 7 steps (past the recipe's burn-in)
             and the optimizers' get_config() as JSON;
  session    a TF1 Session with PeriodicInvCovUpdateKfacOpt (momentum
             "adam", invert_every 2, cov_update_every 1) and a
             tf.compat.v1.train.Saver checkpoint after 3 steps;
  function   a TF2 tf.function with PeriodicInvCovUpdateKfacOpt (adapted
             damping, momentum "qmodel") and a tf.train.Checkpoint of the
             weights and the optimizer after 3 steps.

`write` saves the state into DIR and then takes 3 more steps, writing the
weights after them to DIR/<world>_expected.npz; `resume` restores the state
from DIR with the kfac on sys.path, takes the same 3 steps on the same
batches and writes the weights to OUT.npz. kfac/python/kernel_tests/
saved_state_test.py resumes, with today's kfac, the files that a former
version wrote (kernel_tests/testdata/saved_state/: written by the kfac of
commit 26f32e0, before the step was rewritten as parts) and compares."""

import json
import os
import sys

import numpy as np

WORLDS = ("keras", "session", "function")
N, D_IN, D_OUT, BATCH = 64, 5, 3, 16
STEPS_BEFORE, STEPS_AFTER = 3, 3


def _data():
  rng = np.random.RandomState(0)
  x = rng.randn(N, D_IN).astype(np.float32)
  y = rng.randint(0, D_OUT, size=N).astype(np.int32)
  return x, y


def _batch(step):
  x, y = _data()
  i = (step * BATCH) % N
  return x[i:i + BATCH], y[i:i + BATCH]


def _weights0():
  rng = np.random.RandomState(1)
  return [(rng.randn(D_IN, 8) * 0.5).astype(np.float32),
          np.zeros(8, np.float32),
          (rng.randn(8, D_OUT) * 0.5).astype(np.float32),
          np.zeros(D_OUT, np.float32)]


# ------------------------------------------------------------------ keras
KERAS_OPTIMIZERS = {
    "adaptive": dict(adaptive=True),
    "fixed": dict(learning_rate=0.05, damping=0.01, momentum=0.8,
                  invert_every=2, cov_update_every=1, norm_constraint=1.0,
                  weight_decay=1e-3),
}
KERAS_STEPS_BEFORE = 7


def _keras_model(kind):
  import keras  # pylint: disable=g-import-not-at-top
  import kfac.keras  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([
      keras.Input((D_IN,)),
      keras.layers.Dense(8, activation="tanh", name="hidden"),
      keras.layers.Dense(D_OUT, activation="softmax", name="out")])
  model.set_weights(_weights0())
  opt = kfac.keras.optimizers.Kfac(model=model, seed=3,
                                   loss="sparse_categorical_crossentropy",
                                   **KERAS_OPTIMIZERS[kind])
  model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
  return model


def _keras_fit(model, first, steps):
  for step in range(first, first + steps):
    x, y = _batch(step)
    model.train_on_batch(x, y)


def keras_write(out_dir):
  expected = {}
  for kind in KERAS_OPTIMIZERS:
    model = _keras_model(kind)
    _keras_fit(model, 0, KERAS_STEPS_BEFORE)
    model.save(os.path.join(out_dir, "keras_%s.keras" % kind))
    with open(os.path.join(out_dir, "keras_%s_config.json" % kind), "w") as f:
      json.dump(_jsonable(model.optimizer.get_config()), f, indent=1,
                sort_keys=True)
    _keras_fit(model, KERAS_STEPS_BEFORE, STEPS_AFTER)
    for i, w in enumerate(model.get_weights()):
      expected["%s_%d" % (kind, i)] = w
  np.savez(os.path.join(out_dir, "keras_expected.npz"), **expected)


def keras_resume(in_dir, out_path):
  from kfac.python.keras import saving_utils  # pylint: disable=g-import-not-at-top
  got, configs = {}, {}
  for kind in KERAS_OPTIMIZERS:
    model = saving_utils.load_model(
        os.path.join(in_dir, "keras_%s.keras" % kind))
    configs[kind] = _jsonable(model.optimizer.get_config())
    _keras_fit(model, KERAS_STEPS_BEFORE, STEPS_AFTER)
    for i, w in enumerate(model.get_weights()):
      got["%s_%d" % (kind, i)] = w
  np.savez(out_path, **got)
  with open(out_path + ".configs.json", "w") as f:
    json.dump(configs, f, indent=1, sort_keys=True)


def _jsonable(config):
  return json.loads(json.dumps(config, default=repr))


# ---------------------------------------------------------------- session
def _mlp(tf, x, weights):
  h = tf.tanh(tf.matmul(x, weights[0]) + weights[1])
  return tf.matmul(h, weights[2]) + weights[3], h


def _session_graph():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import kfac  # pylint: disable=g-import-not-at-top
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.set_random_seed(5)
    x = tf.compat.v1.placeholder(tf.float32, [BATCH, D_IN])
    y = tf.compat.v1.placeholder(tf.int32, [BATCH])
    weights = [tf.compat.v1.get_variable("w%d" % i, initializer=w,
                                         use_resource=True)
               for i, w in enumerate(_weights0())]
    logits, h = _mlp(tf, x, weights)
    pre_h = tf.matmul(x, weights[0]) + weights[1]
    lc = kfac.LayerCollection()
    lc.register_fully_connected((weights[0], weights[1]), x, pre_h)
    lc.register_fully_connected((weights[2], weights[3]), h, logits)
    lc.register_softmax_cross_entropy_loss(logits)
    loss = tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                       logits=logits))
    opt = kfac.PeriodicInvCovUpdateKfacOpt(
        learning_rate=0.05, damping=0.05, layer_collection=lc,
        momentum=0.9, momentum_type="adam", invert_every=2,
        cov_update_every=1, var_list=weights)
    train = opt.minimize(loss, var_list=weights)
    saver = tf.compat.v1.train.Saver()
    init = tf.compat.v1.global_variables_initializer()
  return graph, (x, y), weights, train, saver, init


def _session_steps(sess, feeds, train, first, steps):
  for step in range(first, first + steps):
    bx, by = _batch(step)
    sess.run(train, {feeds[0]: bx, feeds[1]: by})


def session_write(out_dir):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  graph, feeds, weights, train, saver, init = _session_graph()
  with tf.compat.v1.Session(graph=graph) as sess:
    sess.run(init)
    _session_steps(sess, feeds, train, 0, STEPS_BEFORE)
    saver.save(sess, os.path.join(out_dir, "session_ckpt"),
               write_meta_graph=False, write_state=False)
    _session_steps(sess, feeds, train, STEPS_BEFORE, STEPS_AFTER)
    np.savez(os.path.join(out_dir, "session_expected.npz"),
             *sess.run(weights))


def session_resume(in_dir, out_path):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  graph, feeds, weights, train, saver, _ = _session_graph()
  with tf.compat.v1.Session(graph=graph) as sess:
    saver.restore(sess, os.path.join(in_dir, "session_ckpt"))
    _session_steps(sess, feeds, train, STEPS_BEFORE, STEPS_AFTER)
    np.savez(out_path, *sess.run(weights))


# --------------------------------------------------------------- function
def _function_setup():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import kfac  # pylint: disable=g-import-not-at-top
  tf.random.set_seed(5)
  weights = [tf.Variable(w, name="w%d" % i)
             for i, w in enumerate(_weights0())]

  def loss_of(batch):
    logits, _ = _mlp(tf, batch[0], weights)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=batch[1], logits=logits))

  opt = kfac.PeriodicInvCovUpdateKfacOpt(
      learning_rate=None, damping=0.1, momentum=None,
      momentum_type="qmodel", adapt_damping=True,
      damping_adaptation_interval=1, invert_every=1, loss_fn=loss_of)

  @tf.function
  def step(bx, by):
    pre_h = tf.matmul(bx, weights[0]) + weights[1]
    h = tf.tanh(pre_h)
    logits = tf.matmul(h, weights[2]) + weights[3]
    lc = kfac.LayerCollection()
    lc.register_fully_connected((weights[0], weights[1]), bx, pre_h)
    lc.register_fully_connected((weights[2], weights[3]), h, logits)
    lc.register_softmax_cross_entropy_loss(logits)
    loss = tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=by,
                                                       logits=logits))
    opt.set_train_batch((bx, by))
    train = opt.minimize(loss, var_list=weights, layer_collection=lc)
    with tf.control_dependencies([train]):
      return tf.identity(loss)

  ckpt = tf.train.Checkpoint(weights=weights, optimizer=opt)
  return weights, step, ckpt


def _function_steps(step_fn, first, steps):
  for step in range(first, first + steps):
    bx, by = _batch(step)
    step_fn(bx, by)


def function_write(out_dir):
  weights, step_fn, ckpt = _function_setup()
  _function_steps(step_fn, 0, STEPS_BEFORE)
  ckpt.write(os.path.join(out_dir, "function_ckpt"))
  _function_steps(step_fn, STEPS_BEFORE, STEPS_AFTER)
  np.savez(os.path.join(out_dir, "function_expected.npz"),
           *[w.numpy() for w in weights])


def function_resume(in_dir, out_path):
  weights, step_fn, ckpt = _function_setup()
  # Build every K-FAC variable first (one traced step on a throwaway copy
  # of nothing: the restore below overwrites weights and state alike).
  _function_steps(step_fn, 0, 1)
  ckpt.read(os.path.join(in_dir, "function_ckpt")).assert_consumed()
  _function_steps(step_fn, STEPS_BEFORE, STEPS_AFTER)
  np.savez(out_path, *[w.numpy() for w in weights])


def main(argv):
  mode, directory, world = argv[1:4]
  if world not in WORLDS:
    raise SystemExit("world must be one of %s" % (WORLDS,))
  if mode == "write":
    os.makedirs(directory, exist_ok=True)
    {"keras": keras_write, "session": session_write,
     "function": function_write}[world](directory)
  elif mode == "resume":
    {"keras": keras_resume, "session": session_resume,
     "function": function_resume}[world](directory, argv[4])
  else:
    raise SystemExit(__doc__)


if __name__ == "__main__":
  main(sys.argv)
