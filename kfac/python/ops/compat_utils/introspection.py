"""Small questions about tensors and objects: shapes, class names,
variable kinds."""

import tensorflow as tf


def get_shape(tensor):
  """The shape as a tuple: ints where static, scalar tensors elsewhere.

  Raises ValueError for a tensor of unknown rank."""
  if tensor.shape.rank is None:
    raise ValueError("Unknown rank for tensor {}.".format(tensor))
  static = tensor.shape.as_list()
  if all(d is not None for d in static):
    return tuple(static)
  dynamic = tf.shape(tensor)
  return tuple(d if d is not None else dynamic[i]
               for i, d in enumerate(static))


def cls_name(obj):
  """The name of obj's class."""
  return type(obj).__name__


def is_reference_variable(x):
  """Whether x is a TF1 reference (non-resource) variable."""
  if hasattr(x, "_should_act_as_ref_variable"):
    return True
  if not isinstance(x, tf.Variable):
    return False
  handle = getattr(x, "_handle", None)
  return handle is None and type(x).__name__ == "RefVariable"


def multiline_print(lists):
  """tf.print of several lines: `lists` is a list of tuples, one per line,
  of things tf.print accepts."""
  combined = list(lists[0])
  for line in lists[1:]:
    line = tuple(line)
    if line and isinstance(line[0], str):
      combined += ["\n" + line[0]] + list(line[1:])
    else:
      combined += ["\n"] + list(line)
  return tf.print(*combined)


def value_copy(var):
  """A tensor holding `var`'s value when it runs, that later assignments
  in the same run do not change.

  A resource variable's read is such a tensor (its assignments copy on
  write). A TF1 reference variable's read forwards the variable's buffer,
  which Assign / AssignAdd then change in place: a value read before an
  assignment and used after it would show the assigned value (the damping
  calibration's saved weights restored the trial's weights that way). The
  Snapshot op copies a buffer it cannot forward."""
  if is_reference_variable(var):
    return tf.raw_ops.Snapshot(input=var.read_value())
  return tf.identity(var.read_value())
