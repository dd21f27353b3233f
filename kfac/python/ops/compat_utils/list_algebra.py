"""Arithmetic on lists of tensors and of (tensor, variable) pairs."""

import tensorflow as tf


def _check_match_lists_of_pairs(list1, list2):
  if len(list1) != len(list2):
    raise ValueError("The two lists of (tensor, variable) pairs differ in "
                     "length: %d vs %d." % (len(list1), len(list2)))
  for (_, var1), (_, var2) in zip(list1, list2):
    if var1 is not var2:
      raise ValueError("The variables referenced by the two arguments "
                       "must match.")


def sprod(scalar, list_):
  """scalar * each item."""
  return tuple(scalar * item for item in list_)


def sprod_p(scalar, list_):
  """scalar * each tensor of a list of (tensor, variable) pairs."""
  return tuple((scalar * item, var) for item, var in list_)


def sum_(list1, list2):
  """Elementwise sum of two lists of tensors."""
  return tuple(a + b for a, b in zip(list1, list2))


def sum_p(list1, list2):
  """Elementwise sum of two lists of (tensor, variable) pairs over the same
  variables."""
  _check_match_lists_of_pairs(list1, list2)
  return tuple((a + b, var) for (a, var), (b, _) in zip(list1, list2))


def ip(list1, list2):
  """Inner product of two lists of tensors (sum of all elementwise
  products)."""
  terms = [tf.reduce_sum(a * b) for a, b in zip(list1, list2)]
  if not terms:
    raise ValueError("ip needs non-empty lists of tensors.")
  return tf.add_n(terms)


def ip_p(list1, list2):
  """Inner product of two lists of (tensor, variable) pairs over the same
  variables."""
  _check_match_lists_of_pairs(list1, list2)
  return ip([a for a, _ in list1], [b for b, _ in list2])


def assert_variables_match_pairs_list(a_and_vars, b_and_vars,
                                      error_message=None):
  """Raises ValueError (naming the mismatching positions) unless both lists
  of (tensor, variable) pairs have the same variables in the same order."""
  a_vars = [v for _, v in a_and_vars]
  b_vars = [v for _, v in b_and_vars]
  bad = [i for i, (a, b) in enumerate(zip(a_vars, b_vars)) if a is not b]
  if len(a_vars) != len(b_vars):
    bad.append(min(len(a_vars), len(b_vars)))
  if bad:
    msg = ("Mismatch on variable lists at indices %s.\n\nFirst list:  %s\n\n"
           "Second list:  %s \n" % (", ".join(map(str, bad)),
                                    ", ".join(map(str, a_vars)),
                                    ", ".join(map(str, b_vars))))
    if error_message:
      msg = "%s %s" % (error_message, msg)
    raise ValueError(msg)
