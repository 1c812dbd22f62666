"""`lower_graph`: a whole FlowGraph as one computation (placeholders for its inputs and constants),
for checking the lowering end to end and for graphs that fit in one build."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.lowering.core import LoweringError, dim_expr
from tessera.graph.lowering.table import lower_operator, lowering_error
from tessera.graph.tensor import Tensor
from tessera.ir import expr as E
from tessera.ir.compute import Placeholder, TensorNode, placeholder


@dataclass
class LoweredGraph:
    """A graph's outputs as compute nodes over `placeholders`, one per tensor of `tensors` (the
    graph inputs, then the constants the lowered operators read)."""

    graph: FlowGraph
    tensors: list[Tensor]
    placeholders: list[Placeholder]
    outputs: list[TensorNode]
    symbols: dict[str, E.Expr]

    def arrays(self, inputs: Sequence[Any]) -> list[Any]:
        """The arrays to call the built computation with: the graph inputs, then the constants' data."""
        n = len(self.graph.inputs)
        if len(inputs) != n:
            raise LoweringError(f"graph {self.graph.name} takes {n} inputs, got {len(inputs)}")
        return list(inputs) + [np.asarray(t.data) for t in self.tensors[n:]]


def lower_graph(graph: FlowGraph, symbols: dict[str, E.Expr] | None = None, *,
                inline_scalars: bool = False) -> LoweredGraph:  # fmt: skip
    """Lower every operator of graph; a LoweringError names every operator that cannot be lowered."""
    problems = [f"{op.name} ({op.kind}): {r}" for op in graph.operators if (r := lowering_error(op)) is not None]
    if problems:
        raise LoweringError(f"graph {graph.name} has operators that cannot be lowered: " + "; ".join(problems))
    symbols = {} if symbols is None else symbols
    env: dict[Tensor, TensorNode] = {}
    tensors: list[Tensor] = []
    holders: list[Placeholder] = []

    def node(t: Tensor) -> TensorNode:
        if t not in env:
            if t.producer is not None:
                raise LoweringError(f"{t.name} is used before its producer {t.producer.name}")
            env[t] = placeholder([dim_expr(d, symbols) for d in t.shape], t.dtype, f"c{len(holders)}_{t.name}")
            tensors.append(t)
            holders.append(env[t])
        return env[t]

    for t in graph.inputs:
        node(t)
    for op in graph.operators:
        outs = lower_operator(op, [node(t) for t in op.inputs], symbols, inline_scalars=inline_scalars)
        env.update(zip(op.outputs, outs))
    return LoweredGraph(graph, tensors, holders, [node(t) for t in graph.outputs], symbols)
