"""Graph operators as tessera.ops compute definitions.

`lower_operator(op, inputs, symbols)` builds the compute nodes of one FlowGraph operator from
nodes for its inputs, with the shapes (int32 expressions, see `dim_expr`), dtypes and semantics
of the op's numpy reference; `lowering_error(op)` says beforehand why an operator cannot be
lowered (the graph compiler then runs it in its reference and tells the user).  LOWERINGS is the
table kind -> rule; the rules live by op family in elementwise.py, reduce.py, nn.py and shape.py
(onnx_ops.py: the kinds the ONNX front end added),
the shared machinery (size bindings, conforming shapes) in core.py.

    from tessera import ops
    from tessera.graph.lowering import dim_expr, lower_operator

    symbols = {}
    x = ops.placeholder([dim_expr(d, symbols) for d in t.shape], t.dtype)   # t: the graph tensor
    (y,) = lower_operator(op, [x], symbols)
    f = ops.build([y], [x])
"""

from tessera.graph.lowering.core import LoweringError, dim_expr
from tessera.graph.lowering.graph import LoweredGraph, lower_graph
from tessera.graph.lowering.table import LOWERINGS, NOT_LOWERED, Lowering, lower_operator, lowering_error

__all__ = ["LOWERINGS", "NOT_LOWERED", "Lowering", "LoweredGraph", "LoweringError", "dim_expr", "lower_graph",
           "lower_operator", "lowering_error"]  # fmt: skip
