"""A recurrent loop as one op with an exact forward-mode rule.

The adaptive step's curvature products are Jacobian-vector products pushed
op by op through the built graph (kfac/python/ops/forward_mode). A loop's
ops are out of that walk's reach: tf.scan's stacked inputs and outputs are
TensorLists, and the walk refuses them, so the products went through the
whole-graph double backward (a reverse pass through the network and the
loop, then the reverse of that reverse: on a GRU(128) over 28 steps, most
of the adaptive step's cost).

`scan` runs the loop inside one function call op whose inputs and outputs
are plain tensors, and registers for that op the loop's forward derivative
(`forward_mode.register_op_rule`): a tangent loop carrying the tangents of
the carried state. The forward states of every step are outputs of the
forward loop, so the tangent loop does not recompute the recurrence: at
step t it rebuilds the step from the forward state of step t - 1 and
pushes the tangents through it with the same op-by-op walk (the step's
ops: matmuls, adds, activations). The result is the exact derivative of
the loop, in one loop of about twice the forward step's cost.
"""

import tensorflow as tf

from kfac.python.ops import forward_mode


def _zeros_if_none(tangent, like):
  return tf.zeros_like(like) if tangent is None else tangent


def scan(step, elems, init, params):
  """tf.scan(step) over time-major `elems` from `init`, as one op.

  Args:
    step: step(carry, elems_t, params) -> the new carry (a tuple of
      tensors); like tf.scan, the stacked carries are the outputs.
    elems: tuple of tensors [T, ...], read one step at a time.
    init: tuple of tensors, the initial carry.
    params: tuple of tensors the step uses at every step (weights).

  Returns:
    A tuple with one tensor [T, ...] per carried tensor.
  """
  # (tensors, not variables: a variable's handle as the op's input would
  # send the walk to the whole-graph method)
  elems, init, params = [tuple(tf.convert_to_tensor(t) for t in group)
                         for group in (elems, init, params)]
  n_e, n_c = len(elems), len(init)

  def loop(*args):
    es, cs, ps = args[:n_e], args[n_e:n_e + n_c], args[n_e + n_c:]
    out = tf.scan(lambda carry, e: tuple(step(carry, e, ps)), es,
                  initializer=cs)
    return tuple(out)

  outputs = tf.function(loop, autograph=False)(*(elems + init + params))
  outputs = tuple(outputs)
  op = outputs[0].op
  if any(o.op is not op for o in outputs) or len(op.outputs) != n_c:
    raise ValueError("recurrent_loop.scan: the loop's outputs are not the "
                     "outputs of one call op (%s)" % op.type)

  def rule(op_, tangents):
    """The tangents of the stacked carries (then None for any output
    TensorFlow's gradient machinery added to the op since)."""
    d_elems = tangents[:n_e]
    d_init = tangents[n_e:n_e + n_c]
    d_params = tangents[n_e + n_c:n_e + n_c + len(params)]
    extra = [None] * (len(op_.outputs) - n_c)
    if all(t is None for t in tangents):
      return [None] * len(op_.outputs)
    # The carry before each step: the initial one, then the forward's.
    prev = tuple(tf.concat([c[None], o[:-1]], 0)
                 for c, o in zip(init, outputs))
    with_tangent = [i for i, t in enumerate(d_elems) if t is not None]
    param_tangents = [i for i, t in enumerate(d_params) if t is not None]

    def tangent_step(d_carry, xs):
      es, cs = xs[:n_e], xs[n_e:n_e + n_c]
      des = dict(zip(with_tangent, xs[n_e + n_c:]))
      es = [tf.identity(e) for e in es]
      cs = [tf.identity(c) for c in cs]
      ps = [tf.identity(p) for p in params]
      new = tuple(step(tuple(cs), tuple(es), tuple(ps)))
      sources = cs + [es[i] for i in with_tangent] + [
          ps[i] for i in param_tangents]
      source_tangents = list(d_carry) + [des[i] for i in with_tangent] + [
          d_params[i] for i in param_tangents]
      jvps = forward_mode.jvp(list(new), sources, source_tangents)
      return tuple(_zeros_if_none(j, n) for j, n in zip(jvps, new))

    d_init0 = tuple(_zeros_if_none(t, c) for t, c in zip(d_init, init))
    d_out = tf.scan(tangent_step,
                    elems + prev + tuple(d_elems[i] for i in with_tangent),
                    initializer=d_init0)
    return list(d_out) + extra

  forward_mode.register_op_rule(op, rule)
  return outputs
