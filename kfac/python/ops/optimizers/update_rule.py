"""KfacOptimizer's update rules "regular" and "adam", with the norm
constraint, decoupled weight decay and the velocities (momentum).

With g the gradient, F^-1 the damped approximate inverse Fisher (damping *
precon_damping_mult + l2_reg on the diagonal), mu the momentum, eta the
learning rate and v the velocity:

* "regular": p = F^-1 g (then norm constraint), v <- mu v + p, step = v.
* "adam":    v <- mu v + g, p = F^-1 v (then norm constraint), step = p.

then step += weight_decay_coeff * w with use_weight_decay (kfac 0.2.x's
weight decay) and the change of w is -eta * step. (AdamW's
decoupled_weight_decay is added apart from the step: weight_decay.py.)
The norm constraint scales p by
min(1, sqrt(C / (eta^2 <g', p>))) where g' is the vector p came from, so the
approximate squared Fisher norm of the update is at most C. ("qmodel" /
"qmodel_fixedmu": adaptive/quadratic_model.py.)

Sparse gradients (`tf.IndexedSlices`, optimizers/sparse.py): with a Python
momentum of 0 the step stays sparse (it is applied to the touched rows
only). With momentum, the velocity is dense (every row decays): it is
updated as mu * v followed by a scatter-add of the slices, so the dense
gradient is never built, but the step is dense. use_weight_decay
touches every row, so it densifies the step (decoupled_weight_decay is a
dense change of its own). The norm constraint's
<g', p> is computed on the slices after summing duplicate indices.

Nothing here changes state: the rule fills an `Update`
(optimizers/update.py) that optimizers/commit.py carries out. Two parts of
the step (optimizers/step.py) live here: `Velocities`, the momentum's
state of each variable (shared with the quadratic model), and
`UpdateRule`, the rule itself.
"""

import tensorflow as tf

from kfac.python.ops.layers.dense import factored_grads
from kfac.python.ops.optimizers import sparse
from kfac.python.ops.optimizers import update as update_lib
from kfac.python.ops.tensors import utils


class Velocities:
  """The velocity (momentum state) of each variable, in the StateStore
  under a name made from the variable's (made unique once per variable)."""

  def __init__(self, store):
    self._store = store
    self._keys = {}

  def key(self, var):
    key = self._keys.get(var.ref())
    if key is None:
      used = set(self._keys.values())
      base = "velocity/" + utils.state_name(var)
      key, i = base, 1
      while key in used:
        key = "%s_%d" % (base, i)
        i += 1
      self._keys[var.ref()] = key
    return key

  def get(self, var):
    return self._store.get_or_create(self.key(var), var.shape,
                                     var.dtype.base_dtype)


class UpdateRule:
  """The momentum types "regular" and "adam" (module docstring)."""

  def __init__(self, settings, velocities, learning_rate, momentum):
    """settings: a config.UpdateRuleConfig; velocities: a `Velocities`;
    learning_rate, momentum: numbers, tensors, variables or callables
    (schedules) read when the step is built."""
    self._settings = settings
    self._velocities = velocities
    self._learning_rate = learning_rate
    self._momentum = momentum

  def compute(self, grads_and_vars, estimator, update, read_once=False):
    """Fills `update` with the step of momentum "regular" / "adam";
    `read_once`: nothing but the preconditioning reads the gradients
    (factored_grads/match.py)."""
    settings = self._settings
    update.grads = [tf.convert_to_tensor(g) for g, _ in grads_and_vars]
    if settings.momentum_type == "regular":
      with factored_grads.gradients_read_only_here(read_once):
        precon = estimator.multiply_inverse(grads_and_vars)
      if settings.norm_constraint is not None:
        precon = self.clip(grads_and_vars, precon)
      steps = self.new_velocities(precon, self._momentum, update)
      update.precon = precon
    else:  # adam
      velocities = self.new_velocities(grads_and_vars, self._momentum,
                                       update)
      steps = estimator.multiply_inverse(velocities)
      if settings.norm_constraint is not None:
        steps = self.clip(velocities, steps)
      update.precon = steps
    if settings.use_weight_decay:
      coeff = update_lib.read(settings.weight_decay_coeff)
      steps = [(sparse.dense(s) + utils.cast(coeff, v.dtype) * v, v)
               for s, v in steps]
    lr = update_lib.read(self._learning_rate)
    update.deltas = [(sparse.scale(s, -utils.cast(lr, v.dtype)), v)
                     for s, v in steps]

  # ------------------------------------------------------------ velocities
  def new_velocities(self, vecs_and_vars, decay, update):
    """decay * v + vec for each variable: returns the new velocities and
    adds their assignments to `update`."""
    out = []
    decay = update_lib.read(decay)
    for vec, var in vecs_and_vars:
      if (sparse.is_slices(vec) and utils.is_python_number(decay) and
          decay == 0):
        out.append((vec, var))  # no momentum: the step stays sparse
        continue
      velocity = self._velocities.get(var)
      new = utils.cast(decay, velocity.dtype) * velocity
      if sparse.is_slices(vec):
        new = tf.tensor_scatter_nd_add(new, vec.indices[:, tf.newaxis],
                                       vec.values)
      else:
        new = new + vec
      update.velocity_assigns.append((velocity, new))
      out.append((new, var))
    return out

  def update_velocities(self, vecs_and_vars, decay, vec_coeff=1.0):
    """kfac 0.2.x helper: assigns v <- decay * v + vec_coeff * vec to each
    variable's velocity now; returns [(new velocity, var)] (reading a new
    velocity runs its assignment)."""
    out = []
    decay = update_lib.read(decay)
    for vec, var in vecs_and_vars:
      velocity = self._velocities.get(var)
      new = (utils.cast(decay, velocity.dtype) * velocity +
             utils.cast(vec_coeff, velocity.dtype) * tf.convert_to_tensor(vec))
      with tf.control_dependencies([velocity.assign(new)]):
        out.append((tf.identity(new), var))
    return out

  # ------------------------------------------------------------ norm constraint
  @staticmethod
  def squared_fisher_norm(vecs_and_vars, precon_and_vars):
    terms = [tf.cast(sparse.inner(v, p), tf.float64)
             for (v, _), (p, _) in zip(vecs_and_vars, precon_and_vars)]
    return tf.add_n(terms)

  def clip_coeff(self, vecs_and_vars, precon_and_vars):
    """min(1, sqrt(C / (lr^2 <v, F^-1 v>))) (float64; 1 when the norm is
    0), the factor that puts the update on the norm constraint C."""
    lr = utils.cast(update_lib.read(self._learning_rate), tf.float64)
    sq_norm = self.squared_fisher_norm(vecs_and_vars, precon_and_vars)
    bound = utils.cast(update_lib.read(self._settings.norm_constraint),
                       tf.float64)
    sq_update = lr * lr * sq_norm
    one = tf.ones_like(sq_update)
    positive = sq_update > 0
    return tf.where(
        positive,
        tf.minimum(one, tf.sqrt(bound / tf.where(positive, sq_update, one))),
        one)

  def clip(self, vecs_and_vars, precon_and_vars):
    """Scales the preconditioned vectors so that lr^2 <v, F^-1 v> <= C."""
    coeff = self.clip_coeff(vecs_and_vars, precon_and_vars)
    return [(sparse.scale(p, tf.cast(coeff, p.dtype)), v)
            for p, v in precon_and_vars]
