"""Drop reshapes that move no data a kernel needs moved: reshapes to the shape they already
have, and the flatten / unflatten pair around a linear (or a lowbit_linear).

GPT-2's Conv1D (in every front end) and ONNX exports of 3-D linears write
    y = reshape(linear(reshape(x, [M, K]), W, b), [..., N])      with x [..., K], M = prod(...)
but linear maps each K-vector of x to an N-vector and reshapes keep the rows' order, so y is
linear(x, W, b).  Where x's rows are grouped otherwise ([.., H, D] heads merged by the
flatten), one reshape of x to [..., K] replaces the pair.  Without the pair, the reshape of the linear's result no longer stands
between the GEMM and the ops after it: a residual add or an activation folds into the GEMM's
epilogue, and the flatten, which cost a copy kernel when its input came from another
kernel, is gone.
"""

from __future__ import annotations

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.operator import Operator
from tessera.graph.passes._match import Uses

# Ops mapping each K-vector of x [..., K] to an N-vector of y [..., N] (tessera.quantize's layers
# flatten x for lowbit_linear as Conv1D does for linear).
ROW_WISE = frozenset({"linear", "lowbit_linear"})


def drop_reshapes(graph: FlowGraph) -> int:
    """Rewrite in place; returns the number of identity reshapes dropped plus linears rewritten."""
    drop: set[Operator] = set()
    for op in list(graph.operators):  # reshapes to their own shape
        if op.kind == "reshape" and op.outputs[0].shape == op.inputs[0].shape and op.outputs[0] not in graph.outputs:
            graph.replace_uses(op.outputs[0], op.inputs[0])
            drop.add(op)
    identities = len(drop)
    uses = Uses(graph)
    replace: dict[Operator, Operator] = {}
    added: list[Operator] = []
    for lin in graph.operators:
        flat = lin.inputs[0].producer if lin.kind in ROW_WISE else None
        if flat is None or flat.kind != "reshape":
            continue
        x, y = flat.inputs[0], lin.outputs[0]
        unflat = uses.only_user(y)
        if unflat is None or unflat.kind != "reshape":
            continue
        out = unflat.outputs[0]
        # out's rows are y's rows regrouped, so reshaping x's rows the same way first is equal.
        rows = (*out.shape[:-1], flat.outputs[0].shape[-1])
        if out.ndim < 1 or out.shape[-1] != y.shape[-1] or out.dtype != y.dtype:
            continue
        if rows != x.shape:
            if not all(isinstance(d, int) for d in rows):
                continue
            regroup = Operator.create("reshape", [x], {"shape": list(rows)}, name=flat.name + "_rows")
            added.append(regroup)
            x = regroup.outputs[0]
        # The linear computes the unflatten's tensor: no use needs rewriting.
        replace[lin] = Operator(lin.kind, [x, *lin.inputs[1:]], [out], dict(lin.attrs), lin.name)
        drop.add(unflat)
        if uses.only_user(flat.outputs[0]) is lin:
            drop.add(flat)
    if drop:
        graph.set_operators([replace.get(op, op) for op in graph.operators if op not in drop] + added)
    return identities + len(replace)
