"""A TF1 Session step under MirroredStrategy, written as users write it,
against one replica on the same global batches (run as a program).

    python -m kfac.python.kernel_tests.distribute_session_program \
        WORLD CASE...

configures 2 logical CPU devices before TensorFlow initialises, and for
each CASE trains an 8-16-3 tanh MLP classifier for 5 steps in a
tf.compat.v1.Session: once without a strategy on the global batch of 16,
and once under MirroredStrategy over the 2 devices, the model's variables
made inside `strategy.scope()`, each replica slicing its 8 rows of the
global placeholder batch by `replica_id_in_sync_group`, the step built by
`strategy.extended.call_for_each_replica`. Every step feeds another batch.

WORLD says where the strategy comes from, which decides how TensorFlow
reduces across the replicas:
  graph:  made in each case's tf.Graph (TF2 behaviour), as a Session
          program makes it: ReductionToOneDevice (merge_call, no
          collective ops);
  legacy: the same after tf.compat.v1.disable_v2_behavior() (reference
          variables, control flow v1);
  eager:  made once, eagerly, before the graphs: collective ops.

CASE is PARAMS:STEP:
  PARAMS: "variable" (tf.Variable) or "get_variable"
          (tf.compat.v1.get_variable);
  STEP:   "outside": PeriodicInvCovUpdateKfacOpt made once in the scope,
          minimize() in the replica function;
          "inside": the optimizer made in the replica function (the
          Estimator model_fn pattern);
          "compute_apply": compute_gradients() then apply_gradients();
          "thunks": KfacOptimizer with its explicit statistics and inverse
          update thunks, then apply_gradients().

CASE "utils_all_reduce": kfac.utils.all_sum / all_average of a gradient
in the replica function instead (see run_utils_all_reduce).

Prints one "RESULT {json}" line per case (see distribute_program.compare:
weights_rel, state_rel, identical, moved, ...; and reduction: the class of
the strategy's cross-device reductions).
"""

import json
import sys

import numpy as np
import tensorflow as tf

REPLICAS = 2
GLOBAL_BATCH = 16
STEPS = 5
SIZES = (8, 16, 3)
NAMES = ("p0", "p1", "p2", "p3")

_RNG = np.random.RandomState(7)
INIT = dict(p0=_RNG.randn(8, 16).astype(np.float32) * 0.4,
            p1=_RNG.randn(16).astype(np.float32) * 0.1,
            p2=_RNG.randn(16, 3).astype(np.float32) * 0.4,
            p3=np.zeros(3, np.float32))
X = _RNG.randn(STEPS, GLOBAL_BATCH, 8).astype(np.float32)
Y = _RNG.randint(0, 3, (STEPS, GLOBAL_BATCH)).astype(np.int32)


def make_optimizer(kfac, step_kind):
  if step_kind == "thunks":
    return kfac.KfacOptimizer(
        learning_rate=0.1, damping=0.1, momentum=0.9,
        momentum_type="regular", estimation_mode="exact")
  return kfac.PeriodicInvCovUpdateKfacOpt(
      invert_every=2, cov_update_every=1, learning_rate=0.1, damping=0.1,
      momentum=0.9, estimation_mode="exact")


def make_params(params_kind):
  if params_kind == "variable":
    return [tf.Variable(INIT[n], name=n) for n in NAMES]
  if params_kind == "get_variable":
    return [tf.compat.v1.get_variable(n, initializer=INIT[n])
            for n in NAMES]
  raise ValueError(params_kind)


def mlp_loss(params, x, y, lc):
  """The mean loss of the MLP on (x, y), its layers registered in lc."""
  w0, b0, w1, b1 = params
  h = tf.matmul(x, w0) + b0
  lc.register_fully_connected((w0, b0), x, h)
  a = tf.tanh(h)
  logits = tf.matmul(a, w1) + b1
  lc.register_fully_connected((w1, b1), a, logits)
  lc.register_softmax_cross_entropy_loss(logits, targets=y)
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=y, logits=logits))


def train_step(kfac, opt, params, x, y, replicas, step_kind):
  """One replica's step on its rows of the global batch (x, y)."""
  if replicas > 1:
    r = tf.distribute.get_replica_context().replica_id_in_sync_group
    rows = GLOBAL_BATCH // replicas
    x, y = x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows]
  lc = kfac.LayerCollection()
  # The replicas' gradients are summed: each replica's mean / replicas.
  loss = mlp_loss(params, x, y, lc) / replicas
  if step_kind in ("outside", "inside"):
    return opt.minimize(loss, var_list=params, layer_collection=lc)
  grads = opt.compute_gradients(loss, var_list=params, layer_collection=lc)
  if step_kind == "compute_apply":
    return opt.apply_gradients(grads)
  (cov_vars, cov_thunks, inv_vars,
   inv_thunks) = opt.create_ops_and_vars_thunks()
  for make_vars in cov_vars + inv_vars:
    make_vars()
  with tf.control_dependencies([t() for t in cov_thunks]):
    with tf.control_dependencies([t() for t in inv_thunks]):
      return opt.apply_gradients(grads)


def run(kfac, strategy, case, info=None):
  """({name: [copies]} of the weights, {key: [copies]} of the K-FAC state)
  after STEPS steps; `strategy`: None, a strategy, or a function making one
  in the case's graph. Sets info["reduction"] to the class of the
  strategy's cross-device reductions."""
  params_kind, step_kind = case.split(":")
  with tf.Graph().as_default():
    if callable(strategy):
      strategy = strategy()
    replicas = strategy.num_replicas_in_sync if strategy else 1
    if strategy is not None and info is not None:
      info["reduction"] = type(
          strategy.extended._cross_device_ops).__name__  # pylint: disable=protected-access
    x = tf.compat.v1.placeholder(tf.float32, [GLOBAL_BATCH, SIZES[0]])
    y = tf.compat.v1.placeholder(tf.int32, [GLOBAL_BATCH])
    opts = {}  # replica id -> its optimizer

    def step():
      rid = 0
      if replicas > 1:
        rid = int(tf.get_static_value(
            tf.distribute.get_replica_context().replica_id_in_sync_group))
      if step_kind == "inside":
        opts[rid] = make_optimizer(kfac, step_kind)
      return train_step(kfac, opts.get(rid, opts.get("shared")), params,
                        x, y, replicas, step_kind)

    if strategy is None:
      params = make_params(params_kind)
      if step_kind != "inside":
        opts["shared"] = make_optimizer(kfac, step_kind)
      train = step()
    else:
      with strategy.scope():
        params = make_params(params_kind)
        if step_kind != "inside":
          opts["shared"] = make_optimizer(kfac, step_kind)
        train = strategy.group(
            strategy.extended.call_for_each_replica(step))

    def copies(var):
      if strategy is None:
        return [var]
      return list(strategy.experimental_local_results(var))

    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      for i in range(STEPS):
        sess.run(train, {x: X[i], y: Y[i]})
      weights = {n: sess.run(copies(p)) for n, p in zip(NAMES, params)}
      state = {}
      for opt in opts.values():
        # Optimizers made by each replica find the same state variables.
        for key, var in opt.state_store.variables_by_name.items():
          state.setdefault(key, []).extend(sess.run(copies(var)))
  return weights, state


def run_utils_all_reduce(kfac, strategy):
  """kfac.utils.all_sum / all_average (kfac 0.2.x helpers) in a replica
  function: replica r reduces x_r = (r + 1) * w (w a mirrored variable of 3
  ones) and differentiates loss_r = sum(reduced * (r + 1)) with respect to
  w. Returns, per helper, each replica's reduced value and gradient."""
  out = {}
  with tf.Graph().as_default():
    if callable(strategy):
      strategy = strategy()
    with strategy.scope():
      w = tf.Variable(np.ones(3, np.float32))

    def step(helper):
      rid = tf.cast(tf.distribute.get_replica_context()
                    .replica_id_in_sync_group, tf.float32)
      reduced = helper(tf.convert_to_tensor(w) * (rid + 1.0))
      loss = tf.reduce_sum(reduced * (rid + 1.0))
      return reduced, tf.gradients(loss, [w])[0]

    fetches = {}
    for name in ("all_sum", "all_average"):
      helper = getattr(kfac.utils, name)
      values, grads = strategy.extended.call_for_each_replica(
          step, args=(helper,))
      fetches[name] = (list(strategy.experimental_local_results(values)),
                       list(strategy.experimental_local_results(grads)))
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      for name, (values, grads) in fetches.items():
        out[name] = dict(values=[v.tolist() for v in sess.run(values)],
                         grads=[g.tolist() for g in sess.run(grads)])
  return out


def main(argv):
  world = argv[1]
  if world == "legacy":
    tf.compat.v1.disable_v2_behavior()
  cpus = tf.config.list_physical_devices("CPU")
  tf.config.set_logical_device_configuration(
      cpus[0], [tf.config.LogicalDeviceConfiguration()] * REPLICAS)
  import kfac  # pylint: disable=g-import-not-at-top
  from kfac.python.kernel_tests import distribute_program as dp  # pylint: disable=g-import-not-at-top
  devices = ["/cpu:%d" % i for i in range(REPLICAS)]
  if world == "eager":
    strategy = tf.distribute.MirroredStrategy(devices)
  elif world in ("graph", "legacy"):
    strategy = lambda: tf.distribute.MirroredStrategy(devices)
  else:
    raise ValueError(world)
  for case in argv[2:]:
    if case == "utils_all_reduce":
      print("RESULT " + json.dumps(dict(
          case=case, world=world, **run_utils_all_reduce(kfac, strategy))),
            flush=True)
      continue
    info = {}
    single = run(kfac, None, case)
    many = run(kfac, strategy, case, info)
    result = dp.compare(single, many, names=NAMES, init=INIT)
    result.update(case=case, world=world, replicas=REPLICAS,
                  state_vars=len(many[1]), **info)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
  main(sys.argv)
