"""Fold an inference batch_norm into the conv2d that feeds it.

conv(x, W, b) followed by batch_norm(mean, var, gamma, beta, eps) equals conv(x, W', b')
with scale = gamma / sqrt(var + eps), W' = W * scale (per output channel) and
b' = (b - mean) * scale + beta.  Applies when every parameter is a constant and the conv's
result feeds nothing but the batch_norm.
"""

from __future__ import annotations

import numpy as np

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.operator import Operator
from tessera.graph.tensor import Tensor


def _const(t: Tensor) -> bool:
    return t.is_constant and t.producer is None


def fold_batchnorm(graph: FlowGraph) -> int:
    """Rewrite in place; returns the number of batch_norms folded."""
    users = graph.consumers()
    outputs = set(graph.outputs)
    replace: dict[Operator, Operator] = {}
    drop: set[Operator] = set()
    for bn in graph.operators:
        if bn.kind != "batch_norm" or not all(_const(t) for t in bn.inputs[1:]):
            continue
        conv = bn.inputs[0].producer
        if conv is None or conv.kind != "conv2d" or conv in replace or not all(_const(t) for t in conv.inputs[1:]):
            continue
        if users.get(conv.outputs[0]) != [bn] or conv.outputs[0] in outputs:
            continue
        mean, var, gamma, beta = (t.data.astype(np.float64) for t in bn.inputs[1:])
        w = conv.inputs[1].data
        scale = gamma / np.sqrt(var + bn.attrs["eps"])
        bias = conv.inputs[2].data.astype(np.float64) if len(conv.inputs) == 3 else np.zeros_like(mean)
        new_w = Tensor.constant((w.astype(np.float64) * scale.reshape(-1, 1, 1, 1)).astype(w.dtype),
                                name=conv.inputs[1].name + "_bn")  # fmt: skip
        new_b = Tensor.constant(((bias - mean) * scale + beta).astype(w.dtype), name=bn.outputs[0].name + "_bias")
        folded = Operator("conv2d", [conv.inputs[0], new_w, new_b], [], dict(conv.attrs), conv.name)
        # The folded conv produces the batch_norm's output tensor, so no use needs rewriting.
        folded.outputs = [bn.outputs[0]]
        replace[conv] = folded
        drop.add(bn)
    if not replace:
        return 0
    ops = [replace.get(op, op) for op in graph.operators if op not in drop]
    for op in replace.values():
        op.outputs[0].producer = op
    graph.set_operators(ops)
    return len(replace)
