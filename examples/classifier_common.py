"""What the two classifier demos share: labelled data, optimizers, backends.

A demo supplies a model as two functions,

  init_params(cfg, image_shape, num_classes, seed) -> {name: float32 array}
  forward(images, variables, layer_collection=None) -> logits

(`variables` maps the same names to tf.Variables; `forward` registers its
layers in `layer_collection` when one is given) and per-dataset defaults for
the flags (its own ones included; `cfg` holds their values), then calls
`main`. The loss is the softmax cross-entropy averaged over the batch,
registered with `register_softmax_cross_entropy_loss`.

Two backends run a training step (see side_by_side.py for the loop):
`SessionBackend`, the classic TF1 style (own tf.Graph and
tf.compat.v1.Session per optimizer), and `FunctionBackend`, the TF2 style
(a tf.function step that builds a new LayerCollection on every trace, with
the optimizer created once outside it; see docs/tf2.md).
"""

import numpy as np
import tensorflow as tf

import datasets
import side_by_side

FLAGS = side_by_side.FLAGS

NUM_CLASSES = 10
# Test examples held out of sklearn's 1797 digits (a fixed random subset).
DIGITS_TEST_EXAMPLES = 360
# Examples per forward pass when evaluating (bounds the activation memory).
EVAL_CHUNK = 1000
LOSS_FORMAT = "%.4f"


class LabelledData(object):
  """Images [N, side, side] float32 in [0, 1] and int64 labels [N]."""

  def __init__(self, images, labels):
    if len(images) != len(labels):
      raise ValueError("%d images but %d labels" % (len(images), len(labels)))
    self.images = images
    self.labels = labels.astype(np.int64)

  def __len__(self):
    return len(self.images)

  def subset(self, indices):
    return LabelledData(self.images[indices], self.labels[indices])


def _fashion_mnist_file(name):
  path = datasets.find_fashion_mnist_file(name)
  if path is None:
    raise IOError("Fashion-MNIST file %s not found (run `make data`)" % name)
  return path


def load_classification_data(prefer, max_examples):
  """Returns (name, train LabelledData, test LabelledData), offline.

  Args:
    prefer: "auto" or "fashion_mnist" (Fashion-MNIST when present, else
      digits) or "digits".
    max_examples: cap on the number of Fashion-MNIST training images.
  """
  name, flat = datasets.load_autoencoder_data(prefer=prefer,
                                              max_examples=max_examples)
  side = int(round(np.sqrt(flat.shape[1])))
  images = flat.reshape(-1, side, side)
  if name == "fashion_mnist":
    labels = datasets.read_idx(
        _fashion_mnist_file("train-labels-idx1-ubyte.gz"))[:len(images)]
    test_images = datasets.read_idx(
        _fashion_mnist_file("t10k-images-idx3-ubyte.gz"))
    test_labels = datasets.read_idx(
        _fashion_mnist_file("t10k-labels-idx1-ubyte.gz"))
    test = LabelledData(test_images.astype(np.float32) / 255.0, test_labels)
    return name, LabelledData(images, labels), test
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  everything = LabelledData(images, load_digits().target)
  perm = np.random.RandomState(0).permutation(len(everything))
  return (name, everything.subset(perm[DIGITS_TEST_EXAMPLES:]),
          everything.subset(perm[:DIGITS_TEST_EXAMPLES]))


def make_variables(params_np):
  return {k: tf.Variable(v, name=k) for k, v in params_np.items()}


def mean_cross_entropy(labels, logits):
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))


class _Backend(object):
  """Evaluation shared by both backends; subclasses define _sums(x, y)."""

  def __init__(self, train, eval_data, test):
    self.train_data = train
    self.eval_data = eval_data
    self.test = test

  def _sums(self, images, labels):
    """(summed cross-entropy, number correct) on one chunk."""
    raise NotImplementedError

  def _mean_loss_and_accuracy(self, data):
    loss = correct = 0.0
    for start in range(0, len(data), EVAL_CHUNK):
      part = slice(start, start + EVAL_CHUNK)
      l, c = self._sums(data.images[part], data.labels[part])
      loss += float(l)
      correct += float(c)
    return loss / len(data), correct / len(data)

  def batch(self, indices):
    return self.train_data.subset(indices)

  def evaluate(self):
    return self._mean_loss_and_accuracy(self.eval_data)[0]

  def finish(self):
    loss, accuracy = self._mean_loss_and_accuracy(self.test)
    self.close()
    return {"test loss": loss, "test accuracy": accuracy}

  def close(self):
    pass


def _sums_of(labels, logits):
  loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))
  correct = tf.reduce_sum(tf.cast(
      tf.equal(tf.argmax(logits, axis=1), labels), tf.float32))
  return loss, correct


class SessionBackend(_Backend):
  """One optimizer in its own tf.Graph, run by a tf.compat.v1.Session."""

  def __init__(self, opt_name, cfg, forward, params_np, train, eval_data,
               test):
    super().__init__(train, eval_data, test)
    graph = tf.Graph()
    with graph.as_default():
      tf.compat.v1.set_random_seed(FLAGS.seed)
      self.x = tf.compat.v1.placeholder(
          tf.float32, (None,) + train.images.shape[1:], name="images")
      self.y = tf.compat.v1.placeholder(tf.int64, [None], name="labels")
      variables = make_variables(params_np)
      lc = side_by_side.new_layer_collection(opt_name)
      logits = forward(self.x, variables, layer_collection=lc)
      if lc is not None:
        lc.register_softmax_cross_entropy_loss(logits)
      loss = mean_cross_entropy(self.y, logits)
      opt, shown = side_by_side.make_optimizer(opt_name, cfg, lc)
      self.train_op = opt.minimize(
          loss, var_list=list(variables.values()),
          global_step=tf.compat.v1.train.get_or_create_global_step())
      self.shown_ops = {k: tf.convert_to_tensor(v) for k, v in shown.items()}
      self.sums = _sums_of(self.y, logits)
      init = tf.compat.v1.global_variables_initializer()
    graph.finalize()
    self.sess = tf.compat.v1.Session(graph=graph)
    self.sess.run(init)

  def train(self, batch):
    self.sess.run(self.train_op, {self.x: batch.images, self.y: batch.labels})

  def _sums(self, images, labels):
    return self.sess.run(self.sums, {self.x: images, self.y: labels})

  def shown(self):
    return self.sess.run(self.shown_ops)

  def close(self):
    self.sess.close()


class FunctionBackend(_Backend):
  """One optimizer in TF2 style: tf.Variables and tf.function steps."""

  def __init__(self, opt_name, cfg, forward, params_np, train, eval_data,
               test):
    super().__init__(train, eval_data, test)
    tf.random.set_seed(FLAGS.seed)
    variables = make_variables(params_np)
    var_list = list(variables.values())
    # Created once, outside the traced step: it owns all optimizer state.
    opt, self._shown = side_by_side.make_optimizer(opt_name, cfg)

    # autograph=False: the step has no Python control flow that depends on
    # tensors, and converting the kfac library's code costs seconds per trace.
    @tf.function(autograph=False)
    def train_step(images, labels):
      # A new collection on every trace; the state is found again by name.
      lc = side_by_side.new_layer_collection(opt_name)
      logits = forward(images, variables, layer_collection=lc)
      loss = mean_cross_entropy(labels, logits)
      if lc is None:
        opt.minimize(loss, var_list=var_list)
      else:
        lc.register_softmax_cross_entropy_loss(logits)
        opt.minimize(loss, var_list=var_list, layer_collection=lc)

    spec = tf.TensorSpec((None,) + train.images.shape[1:], tf.float32)

    @tf.function(input_signature=[spec, tf.TensorSpec([None], tf.int64)],
                 autograph=False)
    def sums(images, labels):
      return _sums_of(labels, forward(images, variables))

    # Trace now, so that the clock of the first step does not count it.
    batch = min(cfg.batch_size, len(train))
    train_step.get_concrete_function(
        tf.TensorSpec((batch,) + train.images.shape[1:], tf.float32),
        tf.TensorSpec([batch], tf.int64))
    self._train_step = train_step
    self._sums_fn = sums

  def train(self, batch):
    self._train_step(batch.images, batch.labels)

  def _sums(self, images, labels):
    return self._sums_fn(images, labels)

  def shown(self):
    return {k: float(tf.convert_to_tensor(v)) for k, v in self._shown.items()}


BACKENDS = {"session": SessionBackend, "function": FunctionBackend}


def main(init_params, forward, dataset_defaults, backend, describe):
  """Loads the data, trains every optimizer side by side, prints the table.

  Args:
    init_params, forward: the model, see above.
    dataset_defaults: {dataset name: {flag name: default}} for the flags
      left unset (seconds, batch_size, K-FAC and Adam hyperparameters and the
      model's own flags).
    backend: "session" or "function".
    describe: function(cfg, image_shape) -> a line describing the model.

  Returns:
    The runs' side_by_side.History objects.
  """
  name, train, test = load_classification_data(FLAGS.dataset,
                                               FLAGS.max_examples)
  if FLAGS.dataset == "fashion_mnist" and name != "fashion_mnist":
    raise ValueError("--dataset=fashion_mnist but it is not available; "
                     "run `make data`.")
  cfg = side_by_side.Config(dataset_defaults[name])
  image_shape = train.images.shape[1:]
  print("model: %s, batch %d, budget %.0fs per optimizer (%s)" % (
      describe(cfg, image_shape), cfg.batch_size, cfg.seconds,
      "tf.compat.v1.Session" if backend == "session" else "tf.function"))
  side_by_side.print_hyperparameters(cfg)
  params_np = init_params(cfg, image_shape, NUM_CLASSES, FLAGS.seed)
  rng = np.random.RandomState(FLAGS.seed)
  eval_data = train.subset(rng.choice(
      len(train), min(FLAGS.eval_examples, len(train)), replace=False))
  batches = side_by_side.Batches(len(train), cfg.batch_size, FLAGS.seed)
  trainers = []
  for opt_name in FLAGS.optimizers:
    b = BACKENDS[backend](opt_name, cfg, forward, params_np, train,
                          eval_data, test)
    trainers.append(side_by_side.Trainer(opt_name, b, batches, cfg.seconds,
                                         loss_format=LOSS_FORMAT))
  histories = side_by_side.run_in_turns(trainers, FLAGS.chunk_steps)
  side_by_side.print_table(
      histories, "Losses: softmax cross-entropy, mean over a fixed set of %d "
      "training examples; test: the %d held-out examples, after the "
      "budget; seconds: training time only." % (len(eval_data), len(test)),
      loss_format=LOSS_FORMAT)
  if FLAGS.results_json:
    side_by_side.write_results(FLAGS.results_json, histories, dataset=name,
                               backend=backend)
  return histories

