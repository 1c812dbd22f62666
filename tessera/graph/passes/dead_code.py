"""Dead-code elimination: drop operators none of whose outputs reach a graph output."""

from __future__ import annotations

from tessera.graph.flow_graph import FlowGraph


def eliminate_dead_code(graph: FlowGraph) -> int:
    """Remove unused operators in place; returns how many were removed."""
    live = {t for t in graph.outputs}
    kept = []
    for op in reversed(graph.operators):
        if any(t in live for t in op.outputs):
            kept.append(op)
            live.update(op.inputs)
    removed = len(graph.operators) - len(kept)
    graph.set_operators(reversed(kept))
    return removed
