"""Move a GEMM or convolution down to its one elementwise consumer when that consumer reads a
tensor produced after it, so the partitioner can fold the consumer into the GEMM's stores.

The partitioner folds an elementwise tail into an anchor's epilogue only when the tail's other
operands exist before the anchor runs (the group runs where the anchor is).  In a Llama MLP,
`silu(x @ Wg) * (x @ Wu)` is often ordered gate, up, silu, mul: the product's operand silu(...)
comes after the up projection, which then writes its output for a separate multiply kernel.
Running the up projection just before the product is always legal: its inputs exist where it
was, and the product is the only reader of its output.
"""

from __future__ import annotations

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.passes._match import Uses

ANCHOR_KINDS = frozenset({"linear", "matmul", "conv2d", "lowbit_linear"})


def sink_anchors_to_epilogues(graph: FlowGraph) -> int:
    """Reorder in place; returns the number of operators moved."""
    uses = Uses(graph)
    order = list(graph.operators)
    moved = 0
    for op in list(order):
        if op.kind not in ANCHOR_KINDS or len(op.outputs) != 1:
            continue
        user = uses.only_user(op.outputs[0])
        if user is None or user.opdef.category != "elementwise":
            continue
        position = {o: i for i, o in enumerate(order)}
        late = [t for t in user.inputs if t is not op.outputs[0] and t.producer is not None
                and position[t.producer] > position[op]]  # fmt: skip
        if late:
            order.remove(op)
            order.insert(order.index(user), op)
            moved += 1
    if moved:
        graph.set_operators(order)
    return moved
