"""R replicas against 1 replica on the same global batch (run as a program).

    python -m kfac.python.kernel_tests.distribute_program R WORLD CASE...
    python -m kfac.python.kernel_tests.distribute_program R tf1_checkpoint \
        CASE...     (TF1 Saver checkpoints from R replicas to 1 and back)
    python -m kfac.python.kernel_tests.distribute_program multiworker \
        TASK_INDEX PORT0,PORT1 CASE...    (one process per worker)

configures R logical CPU devices (before TensorFlow initialises, hence a
program of its own), and for each CASE ("model:optimizer[:uneven]") trains
the model for STEPS steps once without a strategy on the global batch and
once under MirroredStrategy over R devices, each replica on its shard, in
WORLD "tf1" (Session, call_for_each_replica) or "tf2" (tf.function,
strategy.run). The "tf1" strategy is made eagerly before the graphs, and
TensorFlow then reduces with collective ops; in WORLD "tf1_graph" it is
made in each case's graph, and in "tf1_legacy" after
tf.compat.v1.disable_v2_behavior(): TensorFlow then reduces with
ReductionToOneDevice (merge_call). Prints one JSON line per case:

  weights_rel: max |W_R - W_1| / max |W_1| over the model's variables;
  state_rel:   the same over the K-FAC state (statistics, inverses,
               velocities, counters, damping), variable by variable;
  records_rel: the same over the recorded scalars (rho, the quadratic
               model's learning rate and momentum, norms), which a 2x2
               solve or a difference of losses amplifies;
  identical:   every replica's copy of every weight and every state
               variable is bit-identical;
  digest:      a hash of the R-replica run's weights;
  moved:       max |W_1 - W_init| (the run did train).

Each replica's loss is its mean loss times n_r / N (its share of the global
batch), so that the replicas' summed gradients are the global batch's mean
gradient (the tf.compat.v1 optimizer convention under a strategy). With
":uneven" the shards have different sizes (3 + 5 for R = 2). With
":estimator" (TF1) the replicas' losses are not scaled, and the step is
built as an Estimator builds it (the strategy's "scale the loss for the
Estimator" mode), where compute_gradients scales a mean loss by 1 / R.
With ":replica_round_robin" both runs use that placement strategy (each
factor's inverses computed on one replica and broadcast); with
":lazy_statistics_sync" the statistics are reduced only at inversion steps
(the moving averages, stale between them, and the replicas' local
accumulators are left out of state_rel).
"""

import contextlib
import hashlib
import json
import os
import sys

import numpy as np
import tensorflow as tf

GLOBAL_BATCH = 8
STEPS = 5

_RNG = np.random.RandomState(0)
DATA = dict(
    x=_RNG.randn(GLOBAL_BATCH, 4).astype(np.float32),
    img=_RNG.randn(GLOBAL_BATCH, 5, 5, 2).astype(np.float32),
    ids=_RNG.randint(0, 6, size=(GLOBAL_BATCH,)).astype(np.int32),
    y=_RNG.randint(0, 3, GLOBAL_BATCH).astype(np.int32))
INIT = dict(
    w1=_RNG.randn(4, 5).astype(np.float32) * 0.5,
    b1=np.zeros(5, np.float32),
    w2=_RNG.randn(5, 3).astype(np.float32) * 0.5,
    b2=np.zeros(3, np.float32),
    k=_RNG.randn(3, 3, 2, 3).astype(np.float32) * 0.3,
    wc=_RNG.randn(27, 3).astype(np.float32) * 0.3,
    emb=_RNG.randn(6, 5).astype(np.float32) * 0.5,
    ws=_RNG.randn(4, 4).astype(np.float32) * 0.4)
MODEL_VARS = dict(dense=["w1", "b1", "w2", "b2"], conv=["k", "wc"],
                  embedding=["emb", "w2", "b2"],
                  multi_use=["ws", "w1", "b1", "w2", "b2"])


def make_optimizer(kfac, name, loss_fn):
  """The optimizer of a case; loss_fn(batch) is the model's mean loss."""
  opt = _make_optimizer(kfac, name, loss_fn, **_placement_kwargs())
  return opt


def _placement_kwargs():
  kwargs = {}
  if FLAGS["replica_round_robin"]:
    kwargs["placement_strategy"] = "replica_round_robin"
  if FLAGS["lazy_statistics_sync"]:
    kwargs["lazy_statistics_sync"] = True
  return kwargs


def _make_optimizer(kfac, name, loss_fn, **extra):
  if name == "adaptive":  # qmodel + Levenberg-Marquardt damping rule
    return kfac.PeriodicInvCovUpdateKfacOpt(
        invert_every=1, learning_rate=None, momentum=None,
        momentum_type="qmodel", damping=0.1, estimation_mode="exact",
        adapt_damping=True, damping_adaptation_interval=2, loss_fn=loss_fn,
        **extra)
  if name == "adaptive_delayed":  # the rule on the next step's batch
    return kfac.PeriodicInvCovUpdateKfacOpt(
        invert_every=2, learning_rate=0.05, momentum=0.5, damping=0.1,
        estimation_mode="exact", adapt_damping=True,
        damping_adaptation_interval=2, update_damping_immediately=False,
        use_passed_loss=False, loss_fn=loss_fn, **extra)
  if name == "periodic":  # momentum, invert/cov every 2, burn-in
    return kfac.PeriodicInvCovUpdateKfacOpt(
        invert_every=2, cov_update_every=2, num_burnin_steps=1,
        learning_rate=0.05, damping=0.05, momentum=0.9,
        estimation_mode="exact", cov_ema_decay=0.9, **extra)
  if name == "every_step":  # statistics every step, inverses every 2
    return kfac.PeriodicInvCovUpdateKfacOpt(
        invert_every=2, learning_rate=0.05, damping=0.05, momentum=0.9,
        estimation_mode="exact", cov_ema_decay=0.9, **extra)
  if name == "qmodel":  # learning rate and momentum from the exact model
    return kfac.PeriodicInvCovUpdateKfacOpt(
        invert_every=1, learning_rate=None, momentum=None,
        momentum_type="qmodel", damping=0.1, estimation_mode="exact",
        **extra)
  if name == "regular":  # KfacOptimizer with explicit update ops
    return kfac.KfacOptimizer(
        learning_rate=0.1, damping=0.1, momentum=0.5,
        momentum_type="regular", norm_constraint=1.0,
        estimation_mode="exact", **extra)
  raise ValueError(name)


def model(case, v, data, lc):
  """The case's model on `data`, registered in `lc` (every layer EKFAC
  under the ":ekfac" flag); the mean loss."""
  y = data["y"]
  if FLAGS["ekfac"]:
    lc.set_default_fully_connected_approximation("ekfac")
    lc.set_default_conv2d_approximation("ekfac")
    lc.set_default_fully_connected_multi_approximation("ekfac")
  if case == "conv":
    c = tf.nn.conv2d(data["img"], v["k"], [1, 1, 1, 1], "VALID")
    lc.register_conv2d(v["k"], [1, 1, 1, 1], "VALID", data["img"], c)
    a = tf.reshape(tf.tanh(c), [-1, 27])
    logits = tf.matmul(a, v["wc"])
    # Under ":ekfac" this layer stays K-FAC: its input factor (27 inputs,
    # 8 examples) is rank-deficient, and EKFAC's scalings in a degenerate
    # eigenspace depend on which eigenvectors eigh returns for it, which
    # rounding decides differently on one and on several replicas.
    lc.register_fully_connected(v["wc"], a, logits,
                                approx="kron" if FLAGS["ekfac"] else None)
  else:
    if case == "dense":
      h = tf.matmul(data["x"], v["w1"]) + v["b1"]
      lc.register_fully_connected((v["w1"], v["b1"]), data["x"], h)
      a = tf.tanh(h)
    elif case == "embedding":
      e = tf.gather(v["emb"], data["ids"])
      lc.register_embedding(v["emb"], data["ids"], e)
      a = tf.tanh(e)
    elif case == "multi_use":  # one weight applied twice
      a1 = tf.matmul(data["x"], v["ws"])
      t1 = tf.tanh(a1)
      a2 = tf.matmul(t1, v["ws"])
      lc.register_fully_connected_multi(v["ws"], [data["x"], t1], [a1, a2])
      t2 = tf.tanh(a2)
      h = tf.matmul(t2, v["w1"]) + v["b1"]
      lc.register_fully_connected((v["w1"], v["b1"]), t2, h)
      a = tf.tanh(h)
    logits = tf.matmul(a, v["w2"]) + v["b2"]
    lc.register_fully_connected((v["w2"], v["b2"]), a, logits)
  lc.register_softmax_cross_entropy_loss(logits, targets=y)
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=y, logits=logits))


def _loss_fn(kfac, case, v):
  return lambda batch: model(case, v, batch, kfac.LayerCollection())


def shard_sizes(replicas, uneven):
  if uneven:
    assert replicas == 2
    return [3, 5]
  return [GLOBAL_BATCH // replicas] * replicas


def replica_batch(replicas, uneven):
  """This replica's shard of DATA and its share n_r / N of the batch."""
  if replicas == 1:
    return {k: tf.constant(v) for k, v in DATA.items()}, 1.0
  ctx = tf.distribute.get_replica_context()
  rid = int(tf.get_static_value(ctx.replica_id_in_sync_group))
  sizes = shard_sizes(replicas, uneven)
  start = sum(sizes[:rid])
  data = {k: tf.constant(v[start:start + sizes[rid]])
          for k, v in DATA.items()}
  return data, sizes[rid] / float(GLOBAL_BATCH)


def local(strategy, var):
  if strategy is None:
    return [var]
  return list(strategy.experimental_local_results(var))


# The flags of the running case (":estimator", ":replica_round_robin",
# ":lazy_statistics_sync").
FLAGS = {"estimator": False, "replica_round_robin": False,
         "lazy_statistics_sync": False, "ekfac": False}

# Under the lazy sync: the replicas' own accumulators (only there, and
# different by design), and the moving averages, which lag behind the eager
# ones between inversion steps.
_LAZY_LOCAL = "/local_"
_LAZY_STALE = ("/cov", "/cov_weight", "/cov_dt1")


def _step_fn(kfac, case, opt, v, names, replicas, uneven, global_step):
  def step():
    lc = kfac.LayerCollection()
    data, share = replica_batch(replicas, uneven)
    if FLAGS["estimator"]:
      share = 1.0  # compute_gradients scales it
    loss = model(case, v, data, lc) * share
    # The damping rule's batches (the data do not change between steps).
    opt.set_train_batch(data)
    opt.set_prev_train_batch(data)
    var_list = [v[n] for n in names]
    if isinstance(opt, kfac.PeriodicInvCovUpdateKfacOpt):
      return opt.minimize(loss, var_list=var_list, global_step=global_step,
                          layer_collection=lc)
    # KfacOptimizer: statistics and inverses every step, then the update.
    grads = opt.compute_gradients(loss, var_list=var_list,
                                  layer_collection=lc)
    (cov_vars, cov_thunks, inv_vars,
     inv_thunks) = opt.create_ops_and_vars_thunks()
    for make_vars in cov_vars + inv_vars:
      make_vars()
    with tf.control_dependencies([t() for t in cov_thunks]):
      with tf.control_dependencies([t() for t in inv_thunks]):
        return opt.apply_gradients(grads, global_step=global_step)
  return step


def run_tf1(kfac, strategy, case, optname, replicas, uneven, steps=STEPS,
            save=None, restore=None):
  """`steps` steps in a Session; `restore` / `save`: a checkpoint path
  read after initialisation / written after the steps
  (tf.compat.v1.train.Saver over the graph's global variables)."""
  names = MODEL_VARS[case]
  with tf.Graph().as_default():
    if callable(strategy):  # made in the graph: ReductionToOneDevice
      strategy = strategy()
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
      # get_variable: a Saver then saves a mirrored variable once (a V2
      # tf.Variable's per-replica copies stay in GLOBAL_VARIABLES).
      v = {n: tf.compat.v1.get_variable(n, initializer=INIT[n])
           for n in names}
      global_step = tf.compat.v1.train.get_or_create_global_step()
      opt = make_optimizer(kfac, optname, _loss_fn(kfac, case, v))
      step = _step_fn(kfac, case, opt, v, names, replicas, uneven,
                      global_step)
      if strategy is None:
        train = step()
      else:
        scaling = (strategy._scale_loss_for_estimator_enabled()  # pylint: disable=protected-access
                   if FLAGS["estimator"] else contextlib.nullcontext())
        with scaling:
          train = strategy.group(
              strategy.extended.call_for_each_replica(step))
      store = opt.state_store.variables_by_name
      saver = tf.compat.v1.train.Saver()
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        if restore:
          saver.restore(sess, restore)
        for _ in range(steps):
          sess.run(train)
        if save:
          saver.save(sess, save)
        weights = {n: sess.run(local(strategy, v[n])) for n in names}
        state = {k: sess.run(local(strategy, var)) for k, var in store.items()}
        weights["global_step"] = sess.run(local(strategy, global_step))
  return weights, state


def run_tf2(kfac, strategy, case, optname, replicas, uneven):
  names = MODEL_VARS[case]
  scope = strategy.scope() if strategy else contextlib.nullcontext()
  with scope:
    v = {n: tf.Variable(INIT[n], name=n) for n in names}
  opt = make_optimizer(kfac, optname, _loss_fn(kfac, case, v))
  step = _step_fn(kfac, case, opt, v, names, replicas, uneven, None)
  return train_tf2(strategy, step, STEPS, opt, {n: v[n] for n in names})


def train_tf2(strategy, step, steps, opt, variables):
  """Runs `step` (strategy.run under a strategy) `steps` times in a
  tf.function; ({name: copies} of `variables`, {key: copies} of the
  optimizer's state)."""

  @tf.function
  def train():
    if strategy is None:
      step()
    else:
      strategy.run(step)

  for _ in range(steps):
    train()
  weights = {n: [c.numpy() for c in local(strategy, var)]
             for n, var in variables.items()}
  state = {k: [c.numpy() for c in local(strategy, var)]
           for k, var in opt.state_store.variables_by_name.items()}
  return weights, state


def _rel(copy, ref):
  """Relative max difference; NaN in both places (records not yet set)
  counts as equal, NaN in one only as infinitely far."""
  copy, ref = np.asarray(copy, np.float64), np.asarray(ref, np.float64)
  both = np.isnan(copy) & np.isnan(ref)
  diff = np.where(both, 0.0, np.abs(copy - ref))
  if np.isnan(diff).any():
    return float("inf")
  scale = np.max(np.abs(np.where(both, 0.0, ref)), initial=0.0)
  return float(np.max(diff, initial=0.0) / max(scale, 1e-6))


def compare(single, many, case=None, names=None, init=None):
  """The comparison of the R-replica run `many` with the one-replica run
  `single`, each ({name: copies} of the weights, {key: copies} of the
  state); the model's variable `names` and their initial values `init`
  (default: the case's, of this program)."""
  (w1, s1), (wr, sr) = single, many
  names = MODEL_VARS[case] if names is None else names
  init = INIT if init is None else init
  out = {"weights_rel": 0.0, "state_rel": 0.0, "records_rel": 0.0,
         "basis_rel": 0.0, "identical": True, "moved": 0.0, "differ": []}
  for name in names:
    out["moved"] = max(out["moved"],
                       float(np.max(np.abs(w1[name][0] - init[name]))))
  # The R-replica weights, bit for bit (to compare placement strategies).
  out["digest"] = hashlib.sha1(b"".join(
      np.ascontiguousarray(wr[name][0]).tobytes()
      for name in names)).hexdigest()
  if FLAGS["lazy_statistics_sync"]:
    sr = {k: v for k, v in sr.items() if _LAZY_LOCAL not in k}
    s1 = {k: v for k, v in s1.items() if not k.endswith(_LAZY_STALE)}
    sr = {k: v for k, v in sr.items() if not k.endswith(_LAZY_STALE)}
  for key in ("weights_rel", "state_rel"):
    one, rep = (w1, wr) if key == "weights_rel" else (s1, sr)
    if sorted(one) != sorted(rep):
      raise AssertionError("different variables: %s vs %s" %
                           (sorted(one), sorted(rep)))
    for name in one:
      # The records (rho, the quadratic model's rate and momentum, ...) are
      # scalars from a 2x2 solve or a loss difference: compared apart.
      # EKFAC's eigenvectors: rounding moves them by (rounding / eigen-gap),
      # more than the averages they are computed from; compared apart.
      where = ("records_rel" if name.startswith("records/") else
               "basis_rel" if name.endswith("/eigvectors") else key)
      for copy in rep[name]:
        rel = _rel(copy, one[name][0])
        if rel > out[where]:
          out[where], out[where + "_worst"] = rel, name
        if not np.array_equal(copy, rep[name][0], equal_nan=True):
          out["identical"] = False
          out["differ"].append(name)
  return out


def main_multiworker(argv):
  """multiworker TASK_INDEX PORT0,PORT1,... CASE...: one worker (one CPU
  replica) of a MultiWorkerMirroredStrategy cluster on localhost."""
  index, ports = int(argv[2]), argv[3].split(",")
  os.environ["TF_CONFIG"] = json.dumps({
      "cluster": {"worker": ["localhost:%s" % p for p in ports]},
      "task": {"type": "worker", "index": index}})
  import kfac  # pylint: disable=g-import-not-at-top
  # Created first: it configures the collective ops of this process.
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  replicas = strategy.num_replicas_in_sync
  for spec in argv[4:]:
    parts = spec.split(":")
    case, optname, uneven = parts[0], parts[1], "uneven" in parts[2:]
    for flag in FLAGS:
      FLAGS[flag] = flag in parts[2:]
    single = run_tf2(kfac, None, case, optname, 1, False)
    many = run_tf2(kfac, strategy, case, optname, replicas, uneven)
    result = compare(single, many, case)
    result.update(case=spec, world="multiworker", replicas=replicas,
                  worker=index)
    print("RESULT " + json.dumps(result), flush=True)


def main_checkpoint(kfac, strategy, replicas, specs):
  """TF1 Saver checkpoints across replica counts: R replicas for 3 steps,
  saved, restored in a one-replica graph for the other 2 (and the other
  way round), against 5 straight one-replica steps."""
  import tempfile  # pylint: disable=g-import-not-at-top
  for spec in specs:
    case, optname = spec.split(":")[:2]
    with tempfile.TemporaryDirectory() as tmp:
      ref = run_tf1(kfac, None, case, optname, 1, False)
      run_tf1(kfac, strategy, case, optname, replicas, False, steps=3,
              save=os.path.join(tmp, "many"))
      down = run_tf1(kfac, None, case, optname, 1, False, steps=2,
                     restore=os.path.join(tmp, "many"))
      run_tf1(kfac, None, case, optname, 1, False, steps=3,
              save=os.path.join(tmp, "one"))
      up = run_tf1(kfac, strategy, case, optname, replicas, False, steps=2,
                   restore=os.path.join(tmp, "one"))
    for label, run in (("down", down), ("up", up)):
      result = compare(ref, run, case)
      result.update(case=spec + ":" + label, world="tf1_checkpoint",
                    replicas=replicas)
      print("RESULT " + json.dumps(result), flush=True)


def main(argv):
  if argv[1] == "multiworker":
    main_multiworker(argv)
    return
  replicas, world = int(argv[1]), argv[2]
  if world == "tf1_legacy":
    tf.compat.v1.disable_v2_behavior()
  cpus = tf.config.list_physical_devices("CPU")
  tf.config.set_logical_device_configuration(
      cpus[0], [tf.config.LogicalDeviceConfiguration()] * replicas)
  import kfac  # pylint: disable=g-import-not-at-top
  # One strategy for the whole program: a second MirroredStrategy over the
  # same devices reuses the collective keys of the first.
  devices = ["/cpu:%d" % i for i in range(replicas)]
  if world == "tf1_graph":
    # Made in each case's graph, as a Session program makes it: TensorFlow
    # then reduces with ReductionToOneDevice, not collective ops (so does
    # a strategy made under disable_v2_behavior, world "tf1_legacy").
    strategy = lambda: tf.distribute.MirroredStrategy(devices)
  else:
    strategy = tf.distribute.MirroredStrategy(devices)
  if world == "tf1_checkpoint":
    main_checkpoint(kfac, strategy, replicas, argv[3:])
    return
  if world not in ("tf1", "tf1_graph", "tf1_legacy", "tf2"):
    raise ValueError("unknown world %r" % world)
  run = run_tf2 if world == "tf2" else run_tf1
  for spec in argv[3:]:
    parts = spec.split(":")
    case, optname, uneven = parts[0], parts[1], "uneven" in parts[2:]
    for flag in FLAGS:
      FLAGS[flag] = flag in parts[2:]
    single = run(kfac, None, case, optname, 1, False)
    many = run(kfac, strategy, case, optname, replicas, uneven)
    result = compare(single, many, case)
    result.update(case=spec, world=world, replicas=replicas)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
  main(sys.argv)
