"""batch_execute: run a fixed number of a list of ops per step, in turn."""

import numbers

import tensorflow as tf


def batch_execute(global_step, thunks, batch_size, name=None):
  """Runs `batch_size` of the `thunks` per value of `global_step`, round
  robin: at step t thunk j runs when (batch_size - 1 + t * batch_size - j)
  mod len(thunks) < batch_size, so steps 0, 1, 2, ... run thunks
  [0..batch_size-1], then the next batch_size (wrapping around), etc.

  Args:
    global_step: integer scalar tensor or variable (the step).
    thunks: list of zero-argument callables, each making one op (or tensor);
      return values are ignored.
    batch_size: int, how many thunks run per step (1 <= batch_size).
    name: name scope of the new ops.

  Returns:
    A list with one op per thunk (a tf.cond that runs the thunk or nothing);
    running all of them runs exactly `batch_size` thunks' ops.
  """
  if (isinstance(batch_size, bool) or
      not isinstance(batch_size, numbers.Integral) or batch_size < 1):
    raise ValueError("batch_execute: batch_size must be a positive int, "
                     "got %r." % (batch_size,))
  thunks = list(thunks)
  num = len(thunks)

  def run(thunk):
    def fn():
      with tf.control_dependencies([thunk()]):
        return tf.constant(True)
    return fn

  with tf.name_scope(name or "batch_execute"):
    step = tf.convert_to_tensor(global_step)
    if not step.dtype.is_integer:
      raise ValueError("batch_execute: global_step must be an integer "
                       "tensor, got %s." % step.dtype.name)
    result = []
    for j, thunk in enumerate(thunks):
      selected = tf.math.floormod(
          batch_size - 1 + step * batch_size - j, num) < batch_size
      out = tf.cond(selected, run(thunk), lambda: tf.constant(False))
      result.append(out.op if not tf.executing_eagerly() else out)
    return result
