"""The non-finite guard (reliability/nonfinite.py): a bad batch changes no
state, is counted, and training then goes on exactly as if it had not been
fed; a run that keeps producing non-finite values stops with an error that
says what was not finite. TF1 Session and TF2 tf.function (the tf.function
runs of the two training tests, and Keras fit with adaptive=True, in the
slow tier)."""

import numpy as np
import pytest
import tensorflow as tf

import kfac
from kfac.python.kernel_tests import kfac_test_util as util
from kfac.python.kernel_tests import reference as ref
from kfac.python.ops.numerics import linalg
from kfac.python.ops.losses import sampling

WORLDS = ref.WORLDS
SIZES = (4, 6, 3)
N = 8

FIXED = dict(learning_rate=0.05, damping=0.01, momentum=0.9)
ADAPTIVE = dict(learning_rate=None, momentum=None, momentum_type="qmodel",
                damping=0.05, adapt_damping=True,
                damping_adaptation_interval=1)


def _loss(variables, x, y):
  logits = ref.mlp_forward(variables, x)
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=y, logits=logits))


class Trainer:
  """One PeriodicInvCovUpdateKfacOpt step per call on a tanh MLP with dense
  (Kronecker) blocks, in a TF1 Session or a tf.function. The batch
  dimension is unknown (an empty batch can be fed)."""

  def __init__(self, world, opt_kwargs, seed=0):
    self.world = world
    self.kwargs = dict(invert_every=2, cov_ema_decay=0.9,
                       estimation_mode="exact")
    self.kwargs.update(opt_kwargs)
    self.adaptive = bool(self.kwargs.get("adapt_damping"))
    inits = ref.mlp_inits(SIZES, seed=seed, dtype=np.float32)
    if world == "graph":
      self.graph = tf.Graph()
      with self.graph.as_default():
        self.variables = [tf.Variable(v) for v in inits]
        self.opt = self._make_opt()
        self.x = tf.compat.v1.placeholder(tf.float32, [None, SIZES[0]])
        self.y = tf.compat.v1.placeholder(tf.int32, [None])
        self.op = self._train_op(self.x, self.y)
        self.global_step = tf.compat.v1.train.get_global_step()
        self.sess = tf.compat.v1.Session(graph=self.graph)
        self.sess.run(tf.compat.v1.global_variables_initializer())
    else:
      self.variables = [tf.Variable(v) for v in inits]
      self.opt = self._make_opt()
      self._step = tf.function(lambda x, y: self._train_op(x, y) and None)

  def _make_opt(self):
    kwargs = dict(self.kwargs)
    if self.adaptive:
      kwargs["loss_fn"] = lambda b: _loss(self.variables, *b)
    return kfac.PeriodicInvCovUpdateKfacOpt(**kwargs)

  def _train_op(self, x, y):
    lc = kfac.LayerCollection()
    logits = util.register_mlp(self.variables, x, lc)
    lc.register_softmax_cross_entropy_loss(logits, targets=y)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=logits))
    if self.adaptive:
      self.opt.set_train_batch((x, y))
    global_step = (tf.compat.v1.train.get_or_create_global_step()
                   if self.world == "graph" else None)
    return self.opt.minimize(loss, var_list=self.variables,
                             layer_collection=lc, global_step=global_step)

  def step(self, batch):
    if self.world == "graph":
      self.sess.run(self.op, {self.x: batch[0], self.y: batch[1]})
    else:
      self._step(tf.constant(batch[0]), tf.constant(batch[1]))

  def _read(self, values):
    if self.world == "graph":
      return self.sess.run(values)
    return [v.numpy() for v in values]

  def state(self):
    """{name: value} of the model's variables and every K-FAC state
    variable except the guard's own counters."""
    store = {k: v for k, v in self.opt.state_store.variables_by_name.items()
             if "skipped_steps" not in k}
    names = ["model/%d" % i for i in range(len(self.variables))]
    names += sorted(store)
    values = self._read(list(self.variables) + [store[k] for k in
                                                sorted(store)])
    return dict(zip(names, values))

  def skipped(self):
    return self._read([self.opt.skipped_steps,
                       self.opt.consecutive_skipped_steps])


def _batches(num, seed=0):
  rng = np.random.RandomState(seed)
  return [(rng.randn(N, SIZES[0]).astype(np.float32),
           rng.randint(0, SIZES[-1], N).astype(np.int32))
          for _ in range(num)]


def _bad_batch(kind, seed=7):
  x, y = _batches(1, seed)[0]
  if kind == "nan":
    x[2, 1] = np.nan
  elif kind == "inf":
    x[5, 0] = np.inf
  else:  # empty
    x, y = x[:0], y[:0]
  return x, y


def _assert_same_state(a, b):
  assert sorted(a) == sorted(b)
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)


BAD_KINDS = ("nan", "inf", "empty")


def _run_with_bad_batches(clean, guarded, good, step, state, skipped):
  """Feeds good[0], good[1], then before each further good batch one bad
  batch of each kind (the first at an inverse step: invert_every=2) to
  `guarded`, and only the good batches to `clean`: after each bad batch
  the state equals the state before it, bit for bit; after each good
  batch it equals the clean run's."""
  for batch in good[:2]:
    step(clean, batch)
    step(guarded, batch)
  for i, kind in enumerate(BAD_KINDS):
    before = state(guarded)
    step(guarded, _bad_batch(kind))
    _assert_same_state(state(guarded), before)
    assert skipped(guarded) == [i + 1, 1], kind
    step(clean, good[2 + i])
    step(guarded, good[2 + i])
    _assert_same_state(state(guarded), state(clean))
    assert skipped(guarded) == [i + 1, 0], kind


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
@pytest.mark.parametrize("opt", ["fixed", "adaptive"])
def test_bad_batches_change_nothing_and_training_goes_on_as_without_them(
    world, opt):
  """NaN, Inf and empty batches between good ones: see
  _run_with_bad_batches. The skipped steps advance neither the counter nor
  global_step."""
  kwargs = FIXED if opt == "fixed" else ADAPTIVE
  clean, guarded = Trainer(world, kwargs), Trainer(world, kwargs)
  _run_with_bad_batches(clean, guarded, _batches(5), Trainer.step,
                        Trainer.state, Trainer.skipped)
  assert clean.skipped() == [0, 0]
  if world == "graph":
    assert guarded.sess.run(guarded.global_step) == 5


@pytest.mark.parametrize("world", WORLDS)
def test_first_skip_warns_with_what_was_not_finite(world, capfd):
  trainer = Trainer(world, FIXED)
  trainer.step(_batches(1)[0])
  capfd.readouterr()
  trainer.step(_bad_batch("nan"))
  trainer.step(_bad_batch("nan"))
  err = capfd.readouterr().err
  assert err.count("WARNING: kfac:") == 1  # the first time only
  assert "skipped step 1" in err
  assert "not finite: loss, gradient of" in err


@pytest.mark.parametrize("world", ref.WORLDS_TF2_SLOW)
@pytest.mark.parametrize("opt", ["fixed", "adaptive"])
def test_a_diverging_run_stops_after_the_allowed_skips(world, opt):
  """A learning rate far too large (its update overflows), or an input
  that stays infinite: after max_consecutive_skipped_steps in a row the
  step raises, naming what was not finite. The weights stay finite."""
  kwargs = dict(FIXED if opt == "fixed" else ADAPTIVE,
                max_consecutive_skipped_steps=3)
  if opt == "fixed":
    kwargs.update(learning_rate=1e37, damping=1e-6, momentum=0.0)
  trainer = Trainer(world, kwargs)
  batches = _batches(1)
  if opt == "adaptive":  # the adaptive rule would not diverge: poison x
    batches = [_bad_batch("inf")]
  with pytest.raises(tf.errors.InvalidArgumentError) as info:
    for _ in range(40):
      trainer.step(batches[0])
  message = info.value.message
  assert "3 consecutive steps had non-finite values" in message
  # The fixed run's update overflows; the adaptive run's input is Inf
  # (tanh keeps the loss finite, not the first layer's gradient).
  culprit = "update of" if opt == "fixed" else "gradient of"
  assert "not finite: " + culprit in message
  assert all(np.all(np.isfinite(v)) for k, v in trainer.state().items()
             if k.startswith("model/"))


@pytest.mark.parametrize("world", WORLDS)
def test_guard_off_lets_a_bad_batch_poison_the_statistics(world):
  """skip_non_finite_steps=False removes the checks (the opt-out): the
  same NaN batch then writes NaN into the weights. (This is what the
  guard prevents; it also shows the tests above can fail.)"""
  trainer = Trainer(world, dict(FIXED, skip_non_finite_steps=False))
  trainer.step(_batches(1)[0])
  trainer.step(_bad_batch("nan"))
  state = trainer.state()
  assert not np.all(np.isfinite(state["model/0"]))


def test_invalid_max_consecutive_skipped_steps():
  with pytest.raises(ValueError, match="max_consecutive_skipped_steps"):
    kfac.PeriodicInvCovUpdateKfacOpt(max_consecutive_skipped_steps=0,
                                     **FIXED)


def test_manual_statistics_ops_leave_a_factor_unchanged_on_a_bad_batch():
  """kfac 0.2.x's pattern (make_vars_and_create_op_thunks, the update ops
  run by the user): each factor's statistics update is guarded on its own,
  and an inverse update from non-finite statistics keeps the old inverse."""
  with tf.Graph().as_default():
    variables = [tf.Variable(v) for v in
                 ref.mlp_inits(SIZES, seed=1, dtype=np.float32)]
    x = tf.compat.v1.placeholder(tf.float32, [None, SIZES[0]])
    y = tf.compat.v1.placeholder(tf.int32, [None])
    lc = kfac.LayerCollection()
    logits = util.register_mlp(variables, x, lc)
    lc.register_softmax_cross_entropy_loss(logits, targets=y)
    opt = kfac.KfacOptimizer(learning_rate=0.1, damping=0.01,
                             layer_collection=lc, estimation_mode="exact")
    cov_thunks, inv_thunks = opt.make_vars_and_create_op_thunks()
    cov_op = tf.group(*[t() for t in cov_thunks])
    inv_op = tf.group(*[t() for t in inv_thunks])
    factors = opt.estimator.factors
    cov_vars = [f.get_cov_var() for f in factors]
    inv_vars = [v for f in factors for v in f.inverse_variables()]
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      bx, by = _batches(1)[0]
      sess.run(cov_op, {x: bx, y: by})
      sess.run(inv_op)
      before = sess.run(cov_vars + inv_vars)
      bad_x, bad_y = _bad_batch("nan")
      sess.run(cov_op, {x: bad_x, y: bad_y})
      sess.run(inv_op)
      after = sess.run(cov_vars + inv_vars)
      for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
      # A factor poisoned by hand: its inverse is not replaced by NaNs (the
      # other factors' may change: the pi-adjusted damping reads it).
      own = factors[0].inverse_variables()
      own_before = sess.run(own)
      sess.run(cov_vars[0].assign(tf.fill(cov_vars[0].shape, np.nan)))
      sess.run(inv_op)
      for a, b in zip(sess.run(own), own_before):
        np.testing.assert_array_equal(a, b)
      assert all(np.all(np.isfinite(v)) for v in sess.run(inv_vars))


@pytest.mark.parametrize("world", WORLDS)
def test_inverses_retry_in_float64_when_float32_is_not_finite(world):
  """A factor with an entry near float32's range passes the cheap bound
  (a huge damping) but overflows when symmetrised in float32: the inverse
  and the eigendecomposition are recomputed in float64, finite and equal
  to the float64 result."""
  mat = np.array([[3e38, 0.0], [0.0, 1.0]], np.float32)
  damping = 1e34

  def build():
    m = tf.constant(mat)
    inv = linalg.damped_inverse(m, damping)
    evals, evecs = linalg.eigh(m)
    return inv, evals, evecs

  if world == "graph":
    with tf.Graph().as_default():
      with tf.compat.v1.Session() as sess:
        inv, evals, evecs = sess.run(build())
  else:
    inv, evals, evecs = (t.numpy() for t in tf.function(build)())
  expected = np.linalg.inv(mat.astype(np.float64) + damping * np.eye(2))
  # (1 / 3e38 is a float32 subnormal, which the CPU may flush to zero.)
  np.testing.assert_allclose(inv, expected, rtol=1e-6, atol=1e-38)
  assert np.all(np.isfinite(inv))
  np.testing.assert_allclose(np.sort(evals), [1.0, 3e38], rtol=1e-6)
  assert np.all(np.isfinite(evecs))


@pytest.mark.parametrize("world", WORLDS)
def test_sampling_from_non_finite_logits_gives_valid_classes(world):
  """Rows with NaN or +Inf logits (or no finite entry) are sampled as if
  uniform; -Inf (a masked class) is never drawn."""
  logits = np.array([[np.nan, 0.0, 1.0], [np.inf, 0.0, 0.0],
                     [-np.inf, -np.inf, -np.inf], [0.0, -np.inf, 0.0]] * 50,
                    np.float32)

  def build():
    return [sampling.random_categorical(tf.constant(logits), seed)
            for seed in (3, [3, 4])]

  if world == "graph":
    with tf.Graph().as_default():
      with tf.compat.v1.Session() as sess:
        samples = sess.run(build())
  else:
    samples = [s.numpy() for s in tf.function(build)()]
  for ids in samples:
    assert ids.min() >= 0 and ids.max() < 3
    assert not np.any(ids[3::4] == 1)  # the masked class


# ------------------------------------------------------------------ Keras
def _keras_model(keras):
  rng = np.random.RandomState(3)
  model = keras.Sequential([
      keras.Input((SIZES[0],)),
      keras.layers.Dense(SIZES[1], activation="tanh", name="hidden"),
      keras.layers.Dense(SIZES[2], name="logits")])
  model.set_weights([(0.5 * rng.randn(*w.shape)).astype(np.float32)
                     for w in model.get_weights()])
  return model


@pytest.mark.slow  # over 4 s in the fast tier (docs/testing.md)
@pytest.mark.parametrize("adaptive", [
    False, pytest.param(True, marks=pytest.mark.slow)])  # end to end: fit
def test_keras_fit_skips_bad_batches_and_goes_on_as_without_them(adaptive):
  """model.fit (train_on_batch) with Kfac, sampled Fisher (the samples
  follow the steps taken, not Keras's iterations): see
  _run_with_bad_batches."""
  from kfac.python.keras import keras_flavor  # pylint: disable=g-import-not-at-top
  keras = keras_flavor.keras_module()
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def compiled():
    model = _keras_model(keras)
    options = (dict(learning_rate=None, adaptive=True) if adaptive else
               dict(learning_rate=0.05, momentum=0.9))
    opt = kfac.keras.optimizers.Kfac(damping=0.05, model=model, loss=loss,
                                     invert_every=2, seed=11, **options)
    model.compile(optimizer=opt, loss=loss)
    return model, opt

  def state(run):
    model, opt = run
    values = {"w%d" % i: w for i, w in enumerate(model.get_weights())}
    values.update({k: v for k, v in opt.state_store.numpy_state().items()
                   if "skipped_steps" not in k})
    return values

  def skipped(run):
    core = run[1].kfac_optimizer
    return [int(core.skipped_steps.numpy()),
            int(core.consecutive_skipped_steps.numpy())]

  _run_with_bad_batches(compiled(), compiled(), _batches(5, seed=21),
                        lambda run, batch: run[0].train_on_batch(*batch),
                        state, skipped)
