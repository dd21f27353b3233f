"""A training program for resume_test.py: default K-FAC settings (the
sampled Fisher, no seed anywhere), checkpointed the standard way of each
world, so that the test can compare an uninterrupted run with one resumed
in a new process.

  python -m kfac.python.kernel_tests.resume_program WORLD ACTION DIR

WORLD: tf1 (Session + tf.compat.v1.train.Saver), tf2 (tf.function +
tf.train.Checkpoint(optimizer=opt)), keras (model.fit's train_on_batch +
tf.train.Checkpoint(model=..., optimizer=...)).
ACTION: full (RESTORE_AT + STEPS steps, prints the losses and weights of
the last STEPS), save (RESTORE_AT steps, checkpoint, prints "SAVED", then
keeps training until killed), restore (restores, STEPS steps, prints).
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import kfac

RESTORE_AT, STEPS = 5, 20
SIZES = (6, 8, 3)


def batch(step):
  rng = np.random.RandomState(1000 + step)
  return (rng.randn(16, SIZES[0]).astype(np.float32),
          rng.randint(0, SIZES[-1], 16).astype(np.int32))


def inits():
  rng = np.random.RandomState(0)
  return [(0.5 * rng.randn(SIZES[0], SIZES[1])).astype(np.float32),
          np.zeros(SIZES[1], np.float32),
          (0.5 * rng.randn(SIZES[1], SIZES[2])).astype(np.float32),
          np.zeros(SIZES[2], np.float32)]


def forward(variables, x, lc):
  w1, b1, w2, b2 = variables
  pre = tf.matmul(x, w1) + b1
  hidden = tf.tanh(pre)
  logits = tf.matmul(hidden, w2) + b2
  lc.register_fully_connected((w1, b1), x, pre)
  lc.register_fully_connected((w2, b2), hidden, logits)
  lc.register_softmax_cross_entropy_loss(logits)  # sampled targets
  return logits


def loss_of(logits, y):
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=y, logits=logits))


def make_opt(lc=None):
  return kfac.PeriodicInvCovUpdateKfacOpt(
      learning_rate=0.05, damping=0.05, invert_every=3, layer_collection=lc)


def report(losses, weights):
  print("RESULT " + json.dumps(dict(
      losses=[float(l) for l in losses],
      weights=[np.asarray(w).tolist() for w in weights])), flush=True)


def steps_to_run(action):
  if action == "full":
    return range(RESTORE_AT + STEPS)
  if action == "save":
    return range(10**6)
  return range(RESTORE_AT, RESTORE_AT + STEPS)


def checkpointed_loop(action, save, step):
  """Runs step(i) for the action's steps (save() before step RESTORE_AT
  when saving); returns the losses from step RESTORE_AT on."""
  losses = []
  for i in steps_to_run(action):
    if action == "save" and i == RESTORE_AT:
      save()
      print("SAVED", flush=True)
    value = step(i)
    if i >= RESTORE_AT:
      losses.append(value)
  return losses


def run_tf1(action, folder):
  with tf.Graph().as_default():
    variables = [tf.compat.v1.Variable(v) for v in inits()]
    x = tf.compat.v1.placeholder(tf.float32, [None, SIZES[0]])
    y = tf.compat.v1.placeholder(tf.int32, [None])
    lc = kfac.LayerCollection()
    loss = loss_of(forward(variables, x, lc), y)
    train = make_opt(lc).minimize(loss, var_list=variables)
    saver = tf.compat.v1.train.Saver()  # default: all global variables
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      if action == "restore":
        saver.restore(sess, tf.train.latest_checkpoint(folder))
      def step(i):
        bx, by = batch(i)
        return sess.run([loss, train], {x: bx, y: by})[0]

      losses = checkpointed_loop(
          action, lambda: saver.save(sess, os.path.join(folder, "ckpt")),
          step)
      report(losses, sess.run(variables))


def run_tf2(action, folder):
  variables = [tf.Variable(v) for v in inits()]
  opt = make_opt()

  @tf.function
  def step_fn(x, y):
    lc = kfac.LayerCollection()
    loss = loss_of(forward(variables, x, lc), y)
    opt.minimize(loss, var_list=variables, layer_collection=lc)
    return loss

  ckpt = tf.train.Checkpoint(variables=variables, optimizer=opt)
  if action == "restore":
    # (K-FAC variables are created at the first step and restored then.)
    ckpt.restore(tf.train.latest_checkpoint(folder))
  losses = checkpointed_loop(
      action, lambda: ckpt.save(os.path.join(folder, "ckpt")),
      lambda i: step_fn(*(tf.constant(v) for v in batch(i))).numpy())
  report(losses, [v.numpy() for v in variables])


def run_keras(action, folder):
  from kfac.python.keras import keras_flavor  # pylint: disable=g-import-not-at-top
  keras = keras_flavor.keras_module()
  model = keras.Sequential([
      keras.Input((SIZES[0],)),
      keras.layers.Dense(SIZES[1], activation="tanh", name="hidden"),
      keras.layers.Dense(SIZES[2], name="logits")])
  model.set_weights(inits())
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  opt = kfac.keras.optimizers.Kfac(learning_rate=0.05, damping=0.05,
                                   model=model, loss=loss, invert_every=3)
  model.compile(optimizer=opt, loss=loss)
  ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
  if action == "restore":
    ckpt.restore(tf.train.latest_checkpoint(folder))
  def step(i):
    model.reset_metrics()  # the loss of this batch, not a running mean
    return model.train_on_batch(*batch(i))

  losses = checkpointed_loop(
      action, lambda: ckpt.save(os.path.join(folder, "ckpt")), step)
  report(losses, model.get_weights())


def main(argv):
  world, action, folder = argv[1:4]
  {"tf1": run_tf1, "tf2": run_tf2, "keras": run_keras}[world](action,
                                                             folder)


if __name__ == "__main__":
  main(sys.argv)
