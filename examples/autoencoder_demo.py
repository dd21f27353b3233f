r"""K-FAC vs Adam on a deep tanh autoencoder, side by side, in about 2 minutes.

Both optimizers start from the same initial weights and see the same
mini-batches, each in its own TF1-style graph run by a tf.compat.v1.Session
(the classic kfac API). They take turns, a few steps each, so that machine
noise slows both alike. Training time is measured with the evaluation
pauses taken out; the table at the end compares the losses reached at the
same number of seconds.

  python examples/autoencoder_demo.py                  # Fashion-MNIST if present
  python examples/autoencoder_demo.py --dataset=digits --seconds=20
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

import autoencoder_model as model
import side_by_side

FLAGS = flags.FLAGS

side_by_side.define_flags()
flags.DEFINE_string("encoder", None,
                    "Comma-separated encoder sizes after the input, mirrored "
                    "for the decoder (default: per dataset).")

# Per-dataset defaults for the flags left unset. Learning rates and damping
# were picked by a small grid search on this demo (K-FAC: learning rate in
# {0.01, 0.03, 0.1, 0.3, 1}, damping in {0.1, 0.3, 1, 3, 10}, both momentum
# types; Adam: learning rate in {1e-3, 3e-3, 1e-2}).
DATASET_DEFAULTS = {
    "fashion_mnist": dict(encoder="256,128,64,30", batch_size=1000,
                          seconds=45.0, kfac_learning_rate=0.1,
                          kfac_damping=3.0, kfac_momentum_type="adam",
                          adam_learning_rate=3e-3),
    "digits": dict(encoder="48,32,16,8", batch_size=256, seconds=20.0,
                   kfac_learning_rate=0.1, kfac_damping=1.0,
                   kfac_momentum_type="adam", adam_learning_rate=1e-2),
}


def build_graph(cfg, opt_name, params_np, input_dim):
  """One optimizer's graph: returns a dict of the tensors the loop needs."""
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.set_random_seed(FLAGS.seed)
    x = tf.compat.v1.placeholder(tf.float32, [None, input_dim], name="x")
    variables = model.make_variables(params_np)
    var_list = model.flat_variables(variables)
    global_step = tf.compat.v1.train.get_or_create_global_step()
    lc = side_by_side.new_layer_collection(opt_name)
    logits = model.forward(x, variables, layer_collection=lc)
    if lc is not None:
      model.register_loss(lc, x, logits)
    loss = model.reconstruction_loss(x, logits)
    opt, shown = side_by_side.make_optimizer(opt_name, cfg, lc)
    shown = {k: tf.convert_to_tensor(v) for k, v in shown.items()}
    train_op = opt.minimize(loss, var_list=var_list, global_step=global_step)
    init = tf.compat.v1.global_variables_initializer()
  graph.finalize()
  return dict(graph=graph, x=x, loss=loss, train_op=train_op, init=init,
              shown=shown)


class Backend(object):
  """One optimizer's graph and tf.compat.v1.Session (see side_by_side.py)."""

  def __init__(self, cfg, opt_name, params_np, data, eval_data):
    self.data = data
    self.eval_data = eval_data
    self.g = build_graph(cfg, opt_name, params_np, data.shape[1])
    self.sess = tf.compat.v1.Session(graph=self.g["graph"])
    self.sess.run(self.g["init"])

  def batch(self, indices):
    return self.data[indices]

  def train(self, batch):
    self.sess.run(self.g["train_op"], {self.g["x"]: batch})

  def evaluate(self):
    return float(self.sess.run(self.g["loss"], {self.g["x"]: self.eval_data}))

  def shown(self):
    return self.sess.run(self.g["shown"])

  def finish(self):
    self.sess.close()
    return {}


def main(argv):
  del argv
  name, data, cfg, sizes = side_by_side.autoencoder_setup(DATASET_DEFAULTS)
  print("model: %s (tanh, linear code, sigmoid cross-entropy), batch %d, "
        "budget %.0fs per optimizer" % (
            "-".join(str(s) for s in sizes), cfg.batch_size, cfg.seconds))
  side_by_side.print_hyperparameters(cfg)

  rng = np.random.RandomState(FLAGS.seed)
  params_np = model.init_params(sizes, FLAGS.seed)
  eval_data = data[rng.choice(len(data), min(FLAGS.eval_examples, len(data)),
                              replace=False)]
  batches = side_by_side.Batches(len(data), cfg.batch_size, FLAGS.seed)

  trainers = [side_by_side.Trainer(
      opt_name, Backend(cfg, opt_name, params_np, data, eval_data), batches,
      cfg.seconds) for opt_name in FLAGS.optimizers]
  histories = side_by_side.run_in_turns(trainers, FLAGS.chunk_steps)
  side_by_side.print_table(
      histories, "Losses: sigmoid cross-entropy summed over pixels, mean "
      "over a fixed set of %d training images; seconds: training time only."
      % len(eval_data))
  if FLAGS.results_json:
    side_by_side.write_results(FLAGS.results_json, histories, dataset=name)


if __name__ == "__main__":
  app.run(main)
