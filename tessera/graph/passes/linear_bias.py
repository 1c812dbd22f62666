"""Fold `linear(x, W) + b` (b a constant vector over the output features) into `linear(x, W, b)`.

ONNX exports write a projection as MatMul + Add (matmul_to_linear makes the MatMul a
linear); torch's addmm arrives as linear with its bias.  With the bias inside the linear,
the GEMM template adds it in its store, the epilogue chain after it (a residual add, an
activation) stays the same as the torch path's, and merge_qkv merges biased Q/K/V
projections into one GEMM whose bias is concatenated too.
"""

from __future__ import annotations

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.operator import Operator
from tessera.graph.passes._match import Uses, other_input
from tessera.graph.tensor import Tensor


def _bias_vector(b: Tensor, y: Tensor, n: object) -> Tensor | None:
    """b as an [n] constant, if adding it to y broadcasts it along y's last axis only."""
    if not (b.is_constant and b.producer is None and b.dtype == y.dtype) or b.ndim == 0 or b.ndim > y.ndim:
        return None
    if b.shape[-1] != n or any(d != 1 for d in b.shape[:-1]):
        return None
    return b if b.ndim == 1 else Tensor.constant(b.data.reshape(-1), name=b.name + "_vec")


def fold_linear_bias(graph: FlowGraph) -> int:
    """Rewrite in place; returns the number of bias adds folded into linears."""
    uses = Uses(graph)
    replace: dict[Operator, Operator] = {}
    drop: list[Operator] = []
    for op in graph.operators:
        if op.kind != "linear" or len(op.inputs) != 2:
            continue
        y = op.outputs[0]
        add = uses.only_user(y)
        b = other_input(add, y) if add is not None and add.kind == "add" else None
        bias = _bias_vector(b, y, op.inputs[1].shape[0]) if b is not None else None
        if bias is None or add.outputs[0].shape != y.shape or add.outputs[0].dtype != y.dtype:
            continue
        # The biased linear computes the add's output tensor: no use needs rewriting.
        replace[op] = Operator("linear", [*op.inputs, bias], list(add.outputs), {}, op.name)
        drop.append(add)
    if replace:
        gone = set(drop)
        graph.set_operators([replace.get(op, op) for op in graph.operators if op not in gone])
    return len(replace)
