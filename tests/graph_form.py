"""The form of a FlowGraph, to compare a pass's result with the graph expected after it."""

from __future__ import annotations

from tessera.graph import FlowGraph
from tessera.graph.tensor import Tensor


def form(g: FlowGraph) -> tuple[list[str], dict[str, int]]:
    """Each output as an expression (operator kinds with their normalised attributes, graph inputs
    by name, constants by dtype and value), and how many operators of each kind the graph holds:
    equal for graphs that compute the same way, whatever the order of their operator lists."""
    memo: dict[Tensor, str] = {}

    def expr(t: Tensor) -> str:
        if t not in memo:
            p = t.producer
            if p is None:
                memo[t] = f"{t.dtype.short}{t.data.tolist()}" if t.is_constant else t.name
            else:
                attrs = p.opdef.normalize_attrs(dict(p.attrs))
                parts = [expr(a) for a in p.inputs] + [f"{k}={v!r}" for k, v in sorted(attrs.items())]
                index = f"[{p.outputs.index(t)}]" if len(p.outputs) > 1 else ""
                memo[t] = f"{p.kind}({', '.join(parts)}){index}"
        return memo[t]

    return [expr(t) for t in g.outputs], dict(g.summary())
