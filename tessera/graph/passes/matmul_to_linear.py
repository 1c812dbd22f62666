"""Rewrite x @ W with a constant 2-D W into linear(x, W^T), transposing W once at compile time.

The GEMM templates read B K-major ([N, K], as linear's weight is) on their fastest path
(wgmma/TMA), and ONNX exporters write projections as MatMul with a [K, N] initializer.
Folding the transpose into the constant here keeps every run free of a per-call transpose
and leaves one anchor form (linear) for the epilogue fusion and QKV merging passes.
"""

from __future__ import annotations

import numpy as np

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.operator import Operator
from tessera.graph.tensor import Tensor


def matmul_to_linear(graph: FlowGraph) -> int:
    """Rewrite in place; returns the number of matmuls turned into linears."""
    count = 0
    ops = []
    transposed: dict[Tensor, Tensor] = {}  # one transposed copy per weight, however many users
    for op in graph.operators:
        x, w = (op.inputs + [None, None])[:2] if op.kind == "matmul" else (None, None)
        if (op.kind != "matmul" or not w.is_constant or w.producer is not None or w.ndim != 2
                or x.ndim < 2 or x.dtype != w.dtype):  # fmt: skip
            ops.append(op)
            continue
        if w not in transposed:
            transposed[w] = Tensor.constant(np.ascontiguousarray(w.data.T), name=w.name + "_t")
        linear = Operator("linear", [x, transposed[w]], [], {}, op.name)
        linear.outputs = list(op.outputs)  # the same result tensor: no use needs rewriting
        linear.outputs[0].producer = linear
        ops.append(linear)
        count += 1
    if count:
        graph.set_operators(ops)
    return count
