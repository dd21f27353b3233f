"""Old import path kfac.python.ops.op_queue (kfac 0.2.x): see
kfac_utils/op_queue.py."""

from kfac.python.ops.kfac_utils.op_queue import OpQueue  # pylint: disable=unused-import
