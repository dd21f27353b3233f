"""Adaptive K-FAC: quadratic-model learning rate / momentum, LM damping.

`AdaptiveMixin` is the part of `KfacOptimizer` that implements the
momentum types "qmodel" / "qmodel_fixedmu" and `adapt_damping`; the math
is in `quadratic_model.py` and `damping_adaptation.py`, the exact curvature
products in `curvature_matrix_vector_products.py`.

Quadratic model. With g the gradient of the mean loss, p = F^-1 g the
K-FAC preconditioned gradient (F^-1 with the preconditioner damping
damping * precon_damping_mult + l2_reg) and d the previous update, the
update is delta = alpha p + mu d where (alpha, mu) minimise

    1/2 x^T V^T (C + (damping + l2_reg) I) V x + x^T V^T g,   V = [p, d]

and C is the exact mini-batch curvature of the mean loss: (1/N) times the
summed-loss curvature from `CurvatureMatrixVectorProductComputer`, the
Fisher for the Fisher / empirical-Fisher estimation modes and the GGN for
the *_GGN modes. "qmodel_fixedmu" keeps mu = momentum and solves for alpha
alone. `qmodel_update_rescale` s multiplies both coefficients after the
solve. The recorded `learning_rate` is -alpha * s, `momentum` mu * s.

The predicted change used for the damping rule, `qmodel_change`, is the
model of the update actually applied with the curvature C + l2_reg I, i.e.
without the damping term (as in Martens & Grosse 2015, sec. 6.5, and
kfac-jax's default). With momentum types "regular" / "adam" and
adapt_damping, it is 1/2 delta^T (C + l2_reg I) delta + g^T delta for the
update delta = -learning_rate * step, which costs one exact curvature
product per step (a gradient cannot be taken inside a tf.cond branch, so it
is not limited to the adaptation steps).

Damping rule (`damping_adaptation.py`): rho = (loss after - loss before) /
qmodel_change on the same mini-batch, every damping_adaptation_interval
steps (the steps where the counter is a multiple of it).

* update_damping_immediately=True: on such a step the loss before is the
  passed loss (`minimize`'s loss or `set_loss`; with use_passed_loss=False,
  loss_fn(train_batch) evaluated before the update), and the loss after is
  loss_fn(train_batch) evaluated after the update, in the same step: one
  extra forward pass on adaptation steps only.
* update_damping_immediately=False: on such a step the loss before and the
  predicted change are kept; on the next step loss_fn(prev_train_batch)
  (the previous step's batch, e.g. `CachedDataReader.cached_batch`) is
  evaluated at the current parameters before that step's update.

Only the chief (is_chief=True) adapts the damping. The damping lives in a
float64 state variable (`adaptive/damping`) floored at min_damping; the
preconditioner adds l2_reg to it, so the effective damping never falls
below l2_reg + min_damping * precon_damping_mult.
"""

import tensorflow as tf

from kfac.python.ops import damping_adaptation
from kfac.python.ops import quadratic_model
from kfac.python.ops import utils

# Values an optimizer keeps readable after each step, with their initial
# value (NaN: not computed yet).
_RECORDS = {
    "learning_rate": 0.0,
    "momentum": 0.0,
    "qmodel_change": float("nan"),
    "rho": float("nan"),
    "grad_norm": float("nan"),
    "precon_grad_norm": float("nan"),
    "update_norm": float("nan"),
}
_NORM_RECORDS = ("grad_norm", "precon_grad_norm", "update_norm")


def _inner64(a, b):
  return tf.reduce_sum(utils.cast(a, tf.float64) * utils.cast(b, tf.float64))


def _sum_inner64(xs, ys):
  return tf.add_n([_inner64(x, y) for x, y in zip(xs, ys)])


class AdaptiveMixin:
  """Quadratic model and damping adaptation for KfacOptimizer."""

  # ------------------------------------------------------------ set-up
  def _from_schedule(self, name, value, schedule):
    """`value`, or a function of the step counter when `schedule` is a
    callable step -> value (kfac-jax style schedules)."""
    if schedule is None:
      return value
    if not callable(schedule):
      raise ValueError("%s_schedule must be a callable of the step, got %r."
                       % (name, schedule))
    if value is not None:
      raise ValueError("Pass either %s or %s_schedule, not both (got %s=%r)."
                       % (name, name, name, value))
    return lambda: schedule(tf.convert_to_tensor(self.counter))

  def _init_adaptive(self, momentum_type, qmodel_update_rescale,
                     adapt_damping, update_damping_immediately, is_chief,
                     prev_train_batch, loss, loss_fn, min_damping, l2_reg,
                     damping_adaptation_decay, damping_adaptation_interval,
                     damping_decrease_rho_threshold,
                     damping_increase_rho_threshold, precon_damping_mult,
                     use_passed_loss, train_batch, print_logs,
                     use_weight_decay, norm_constraint, damping_schedule):
    qmodel = momentum_type.startswith("qmodel")
    if qmodel_update_rescale is not None and not qmodel:
      raise ValueError("qmodel_update_rescale applies to the momentum types "
                       "'qmodel' / 'qmodel_fixedmu' only (momentum_type=%r)."
                       % momentum_type)
    if qmodel and use_weight_decay:
      raise ValueError(
          "use_weight_decay cannot be combined with momentum_type=%r: the "
          "quadratic model has no learning rate for the decay term. Add the "
          "l2 term to the loss and pass l2_reg instead." % momentum_type)
    if qmodel and norm_constraint is not None:
      raise ValueError(
          "norm_constraint cannot be combined with momentum_type=%r: the "
          "quadratic model already chooses the size of the update."
          % momentum_type)
    if l2_reg < 0 or precon_damping_mult <= 0:
      raise ValueError("l2_reg must be >= 0 and precon_damping_mult > 0, got "
                       "%r and %r." % (l2_reg, precon_damping_mult))
    if not adapt_damping:
      for arg, value in (("loss", loss), ("loss_fn", loss_fn),
                         ("train_batch", train_batch),
                         ("prev_train_batch", prev_train_batch)):
        if value is not None:
          raise ValueError("%s=... is used by the damping adaptation only: "
                           "pass adapt_damping=True, or drop it." % arg)
      for arg, value, default in (
          ("damping_adaptation_decay", damping_adaptation_decay, 0.95),
          ("damping_adaptation_interval", damping_adaptation_interval, 5),
          ("damping_decrease_rho_threshold", damping_decrease_rho_threshold,
           0.75),
          ("damping_increase_rho_threshold", damping_increase_rho_threshold,
           0.25),
          ("min_damping", min_damping, 1e-8),
          ("update_damping_immediately", update_damping_immediately, True),
          ("use_passed_loss", use_passed_loss, True)):
        if value != default:
          raise ValueError("%s=%r only matters with adapt_damping=True; pass "
                           "adapt_damping=True or leave it at %r." %
                           (arg, value, default))
    else:
      damping_adaptation.check_arguments(
          damping_adaptation_decay, damping_adaptation_interval,
          damping_increase_rho_threshold, damping_decrease_rho_threshold,
          min_damping)
      if damping_schedule is not None:
        raise ValueError("damping_schedule and adapt_damping=True both set "
                         "the damping: choose one.")
      if not use_passed_loss and loss_fn is None:
        raise ValueError("use_passed_loss=False needs loss_fn (the loss "
                         "before the update is loss_fn(train_batch)).")
      if loss_fn is None:
        raise ValueError(
            "adapt_damping=True needs loss_fn=..., a function of a batch that "
            "returns the loss, to evaluate the loss after the update.")
      self._damping = self._make_damping_variable(self._damping)
    self._qmodel_update_rescale = qmodel_update_rescale
    self._adapt_damping = bool(adapt_damping)
    self._update_damping_immediately = update_damping_immediately
    self._is_chief = is_chief
    self._prev_train_batch = prev_train_batch
    self._loss = loss
    self._loss_fn = loss_fn
    self._min_damping = min_damping
    self._l2_reg = l2_reg
    self._adaptation_decay = damping_adaptation_decay
    self._adaptation_interval = int(damping_adaptation_interval)
    self._rho_upper = damping_decrease_rho_threshold
    self._rho_lower = damping_increase_rho_threshold
    self._precon_damping_mult = precon_damping_mult
    self._use_passed_loss = use_passed_loss
    self._train_batch = train_batch
    self._print_logs = print_logs
    self._passed_loss = None

  def _make_damping_variable(self, damping):
    if isinstance(damping, tf.Variable):
      if not damping.dtype.is_floating or damping.shape.rank != 0:
        raise ValueError("adapt_damping=True with a damping variable needs a "
                         "floating-point scalar, got %s %s." %
                         (damping.dtype.name, damping.shape))
      return damping
    if not utils.is_python_number(damping) or damping <= 0:
      raise ValueError(
          "adapt_damping=True needs the initial damping as a positive Python "
          "number (or a scalar tf.Variable to adapt in place), got %r." %
          (damping,))
    return self._store.get_or_create("adaptive/damping", [], tf.float64,
                                     initial_value=float(damping))

  def set_loss(self, loss):
    """The loss before the update for the damping rule (use_passed_loss);
    in a tf.function call it on every trace. `minimize` sets it too."""
    self._loss = loss

  def set_train_batch(self, train_batch):
    """The batch loss_fn evaluates (a structure of tensors or a callable
    returning one); in a tf.function call it on every trace."""
    self._train_batch = train_batch

  def set_prev_train_batch(self, prev_train_batch):
    """The previous step's batch (update_damping_immediately=False)."""
    self._prev_train_batch = prev_train_batch

  # ------------------------------------------------------------ records
  def _record(self, name):
    return self._store.get_or_create("records/" + name, [], tf.float64,
                                     initial_value=_RECORDS[name])

  @property
  def rho(self):
    """The last reduction ratio of the damping rule (NaN before the first)."""
    return utils.cast(self._record("rho"), self._dtype)

  @property
  def qmodel_change(self):
    """The change of the loss the quadratic model predicted for the last
    update (NaN unless the momentum type is qmodel* or adapt_damping)."""
    return utils.cast(self._record("qmodel_change"), self._dtype)

  @property
  def norm_stats(self):
    """{"grad_norm", "precon_grad_norm", "update_norm"}: Euclidean norms of
    the last step's gradient, preconditioned vector and update (float64);
    needs compute_norm_stats=True."""
    if not self._compute_norm_stats:
      raise ValueError("norm_stats needs KfacOptimizer(..., "
                       "compute_norm_stats=True).")
    return {name: tf.convert_to_tensor(self._record(name))
            for name in _NORM_RECORDS}

  def _record_ops(self, update):
    for name in _RECORDS:  # all readable from the first step on
      self._record(name)
    if self._compute_norm_stats:
      grads = update.grads
      update.records["grad_norm"] = tf.sqrt(_sum_inner64(grads, grads))
      precon = [p for p, _ in update.precon]
      update.records["precon_grad_norm"] = tf.sqrt(
          _sum_inner64(precon, precon))
      deltas = [tf.convert_to_tensor(d) for d, _ in update.deltas]
      update.records["update_norm"] = tf.sqrt(_sum_inner64(deltas, deltas))
    if update.model_change is not None:
      update.records["qmodel_change"] = update.model_change
    return [self._record(name).assign(utils.cast(value, tf.float64))
            for name, value in sorted(update.records.items())]

  # ------------------------------------------------------------ curvature
  def _batch_size_value(self):
    if self._batch_size is not None:
      return utils.cast(self._batch_size, tf.float64)
    towers = self._layers.towers_by_loss
    if not towers:
      raise ValueError("The quadratic model needs a registered loss.")
    return tf.cast(tf.add_n([tf.shape(loss.inputs[0])[0]
                             for loss in towers[0]]), tf.float64)

  def _curvature_gram(self, variables, vectors):
    """[[u^T C v for v in vectors] for u in vectors]: the exact curvature of
    the mean loss (C = summed-loss curvature / batch size) on each pair of
    vectors (each a list aligned with `variables`), in float64."""
    from kfac.python.ops import curvature_matrix_vector_products as cmvp  # pylint: disable=g-import-not-at-top
    computer = cmvp.CurvatureMatrixVectorProductComputer(self._layers,
                                                         variables)
    ggn = self._require_estimator().mat_type == "GGN"
    if ggn:
      factors = [computer.multiply_ggn_factor_transpose(v) for v in vectors]
      signs = computer.ggn_factor_signs
    else:
      factors = [computer.multiply_fisher_factor_transpose(v)
                 for v in vectors]
      signs = [None] * len(factors[0])
    n = self._batch_size_value()
    gram = []
    for fu in factors:
      row = []
      for fv in factors:
        terms = []
        for a, b, s in zip(fu, fv, signs):
          prod = utils.cast(a, tf.float64) * utils.cast(b, tf.float64)
          if s is not None:
            prod = prod * tf.constant(s, tf.float64)
          terms.append(tf.reduce_sum(prod))
        row.append(tf.add_n(terms) / n)
      gram.append(row)
    return gram

  def _qmodel_update(self, grads_and_vars):
    """The update alpha p + mu d of the quadratic model (module docstring)."""
    from kfac.python.ops import optimizer as opt_lib  # pylint: disable=g-import-not-at-top
    est = self._require_estimator()
    update = opt_lib._Update()  # pylint: disable=protected-access
    variables = [v for _, v in grads_and_vars]
    grads = [g for g, _ in grads_and_vars]
    precon = [tf.convert_to_tensor(p)
              for p, _ in est.multiply_inverse(grads_and_vars)]
    velocities = [self._velocity(v) for v in variables]
    prev = [tf.convert_to_tensor(v) for v in velocities]
    gram = self._curvature_gram(variables, [precon, prev])
    dots = [[_sum_inner64(precon, precon), _sum_inner64(precon, prev)],
            [None, _sum_inner64(prev, prev)]]
    dots[1][0] = dots[0][1]
    damping = utils.cast(self._read(self._damping), tf.float64)
    l2_reg = tf.constant(float(self._l2_reg), tf.float64)

    def model(extra):
      return [[gram[i][j] + extra * dots[i][j] for j in range(2)]
              for i in range(2)]

    solve_m = model(damping + l2_reg)
    c1 = _sum_inner64(grads, precon)
    c2 = _sum_inner64(grads, prev)
    if self._momentum_type == "qmodel":
      alpha, mu = quadratic_model.solve_two_by_two(
          solve_m[0][0], solve_m[0][1], solve_m[1][1], c1, c2)
    else:
      mu = utils.cast(self._read(self._momentum), tf.float64)
      alpha = quadratic_model.solve_fixed_second(solve_m[0][0], solve_m[0][1],
                                                 c1, mu)
    if self._qmodel_update_rescale is not None:
      scale = utils.cast(self._read(self._qmodel_update_rescale), tf.float64)
      alpha, mu = alpha * scale, mu * scale
    model_m = model(l2_reg)
    update.model_change = quadratic_model.model_value(
        alpha, mu, model_m[0][0], model_m[0][1], model_m[1][1], c1, c2)
    for p, d, var, velocity in zip(precon, prev, variables, velocities):
      delta = (tf.cast(alpha, var.dtype) * p + tf.cast(mu, var.dtype) * d)
      update.deltas.append((delta, var))
      update.velocity_assigns.append((velocity, delta))
    update.precon = list(zip(precon, variables))
    update.grads = grads
    update.records["learning_rate"] = -alpha
    update.records["momentum"] = mu
    return update

  def _model_change(self, grads_and_vars, deltas_and_vars):
    """1/2 delta^T (C + l2_reg I) delta + g^T delta (float64)."""
    variables = [v for _, v in grads_and_vars]
    deltas = [tf.convert_to_tensor(d) for d, _ in deltas_and_vars]
    grads = [g for g, _ in grads_and_vars]
    curvature = self._curvature_gram(variables, [deltas])[0][0]
    sq = _sum_inner64(deltas, deltas)
    return (0.5 * (curvature + float(self._l2_reg) * sq) +
            _sum_inner64(grads, deltas))

  # ------------------------------------------------------------ damping rule
  def _adaptation_step(self):
    counter = tf.convert_to_tensor(self.counter)
    return tf.equal(counter % self._adaptation_interval, 0)

  @staticmethod
  def _batch(batch):
    return batch() if callable(batch) else batch

  def _evaluate_loss_fn(self, batch, what):
    batch = self._batch(batch)
    if batch is None:
      raise ValueError(
          "The damping rule evaluates loss_fn(%s), but %s is not set: pass "
          "it to the constructor or call set_%s(...) (in a tf.function, on "
          "every trace)." % (what, what, what))
    return tf.cast(self._loss_fn(batch), tf.float64)

  def _loss_before(self):
    if self._use_passed_loss:
      loss = self._loss if self._loss is not None else self._passed_loss
      if loss is None:
        raise ValueError(
            "The damping rule needs the loss before the update: use "
            "minimize(loss), pass loss=... / call set_loss(loss), or pass "
            "use_passed_loss=False to evaluate loss_fn(train_batch).")
      return utils.cast(loss, tf.float64)
    return tf.convert_to_tensor(self._store.get_or_create(
        "adaptive/loss_before", [], tf.float64))

  def _apply_rule(self, loss_before, loss_after, model_change, counter):
    """Ops that set rho and the new damping."""
    rho = damping_adaptation.reduction_ratio(loss_before, loss_after,
                                             model_change)
    new = damping_adaptation.adapted_damping(
        self._damping, rho, self._adaptation_decay,
        self._adaptation_interval, self._rho_lower, self._rho_upper,
        self._min_damping)
    ops = [self._record("rho").assign(rho),
           self._damping.assign(tf.cast(new, self._damping.dtype))]
    if self._print_logs:
      ops.append(tf.print("kfac step", counter, "rho", rho, "damping", new,
                          "qmodel_change", model_change, "loss before",
                          loss_before, "after", loss_after))
    return tf.group(*ops)

  def _adaptation_before_update(self, update):
    """Ops to run before the variables change (see the module docstring)."""
    if not (self._adapt_damping and self._is_chief):
      return []
    ops = []
    adapt_now = self._adaptation_step()
    if not self._use_passed_loss:
      keep = self._store.get_or_create("adaptive/loss_before", [], tf.float64)
      ops.append(utils.cond_op(adapt_now, lambda: keep.assign(
          self._evaluate_loss_fn(self._train_batch, "train_batch"))))
    if not self._update_damping_immediately:
      pending = self._store.get_or_create("adaptive/pending", [], tf.int64)
      prev_loss = self._store.get_or_create("adaptive/prev_loss", [],
                                            tf.float64)
      prev_change = self._store.get_or_create("adaptive/prev_change", [],
                                              tf.float64)
      counter = tf.convert_to_tensor(self.counter)

      def evaluate_previous():
        after = self._evaluate_loss_fn(self._prev_train_batch,
                                       "prev_train_batch")
        with tf.control_dependencies([self._apply_rule(
            prev_loss, after, prev_change, counter)]):
          return pending.assign(0)

      ops.append(utils.cond_op(tf.greater(pending, 0), evaluate_previous))
    return ops

  def _adaptation_after_update(self, update, step_op):
    """Runs after `step_op` (the variables have changed)."""
    if not (self._adapt_damping and self._is_chief):
      return step_op
    adapt_now = self._adaptation_step()
    counter = tf.convert_to_tensor(self.counter)
    change = update.model_change
    with tf.control_dependencies([step_op]):
      # Read after step_op, which waits for the ops that store the loss
      # before the update (use_passed_loss=False).
      before = self._loss_before()
      if self._update_damping_immediately:
        def rule():
          after = self._evaluate_loss_fn(self._train_batch, "train_batch")
          return self._apply_rule(before, after, change, counter)
        return utils.cond_op(adapt_now, rule)

      def keep():
        store = self._store
        return tf.group(
            store.get("adaptive/prev_loss").assign(before),
            store.get("adaptive/prev_change").assign(change),
            store.get("adaptive/pending").assign(1))
      return utils.cond_op(adapt_now, keep)

