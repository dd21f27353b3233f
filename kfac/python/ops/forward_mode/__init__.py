"""Forward-mode derivatives (Jacobian-vector products) on a built graph,
op by op: see walk.py for why, rules.py for the direct rules."""

from kfac.python.ops.forward_mode.walk import jvp
from kfac.python.ops.forward_mode.walk import register_op_rule
from kfac.python.ops.forward_mode.walk import UnsupportedGraph

__all__ = ["jvp", "register_op_rule", "UnsupportedGraph"]
