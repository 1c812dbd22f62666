"""Partition a FlowGraph into the groups that the compiled graph runs, one step each.

Three kinds of group, in the graph's topological order:
- **anchor**: one operator that runs on a tuned kernel template (GEMM, convolution), plus the
  chain of elementwise operators after it that post-scheduling fusion folds into the
  template's output store (its epilogue), and the view operators the template reads its
  operands or writes its output through (attention's head split and merge: `views`);
- **fused**: a run of consecutive operators that tessera.ops lowers; the ops scheduler turns
  the run into as few kernels as it can (injective chains inline into their consumers,
  reductions take their prologue and epilogue);
- **reference**: one operator tessera cannot lower, run through its numpy reference.

A fused group is a contiguous stretch of the topological order, so it is convex: no path
leaves the group and comes back.  An anchor or reference operator closes the stretch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.operator import Operator
from tessera.graph.tensor import Tensor
from tessera.templates import choose, chosen


@dataclass
class Group:
    """Operators that run as one step; `inputs`/`outputs` are the tensors crossing its border."""

    kind: str  # "anchor", "fused" or "reference"
    ops: list[Operator]
    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)
    reason: str = ""  # why a reference group is not compiled
    prologue: list[Operator] = field(default_factory=list)  # views of the anchor's operands, read in place

    @property
    def anchor(self) -> Operator:
        return self.ops[0]

    @property
    def members(self) -> list[Operator]:
        """Every operator of the group in execution order (the prologue's views first)."""
        return [*self.prologue, *self.ops]

    @property
    def epilogue(self) -> list[Operator]:
        return self.ops[1:] if self.kind == "anchor" else []

    def __repr__(self) -> str:
        kinds = ",".join(op.kind for op in self.ops)
        return f"<{self.kind} group [{kinds}] {len(self.inputs)} in, {len(self.outputs)} out>"


def partition_for(graph: FlowGraph, target: str, lowering_error: Callable[[Operator], str | None]) -> list[Group]:
    """`partition` with the templates registered for `target` as the anchors (tessera.templates)."""
    return partition(graph, lowering_error, lambda op: choose(op, target) is not None,
                     lambda op: chosen(op, target).takes_epilogue(op),
                     lambda op, consumers, outputs: chosen(op, target).views(op, consumers, outputs))  # fmt: skip


Views = Callable[[Operator, dict[Tensor, list[Operator]], set[Tensor]], tuple[list[Operator], list[Operator]]]


def partition(graph: FlowGraph, lowering_error: Callable[[Operator], str | None],
              is_anchor: Callable[[Operator], bool],
              takes_epilogue: Callable[[Operator], bool] = lambda op: True, views: Views | None = None) -> list[Group]:  # fmt: skip
    """Groups of `graph` in execution order.

    `lowering_error(op)` says why op cannot be compiled (None when it can); `is_anchor(op)`
    whether a kernel template takes it; `takes_epilogue(op)` whether that template can fold
    an elementwise tail into its store; `views(anchor, consumers, graph outputs)` the view
    operators producing its operands that its template reads through (each read by the
    anchor alone and reading tensors that exist before it) and those after it that its store
    writes through (instead of an epilogue)."""
    ops = graph.operators
    position = {op: i for i, op in enumerate(ops)}
    consumers = graph.consumers()
    outputs = set(graph.outputs)
    absorbed: set[Operator] = set()
    groups: list[Group] = []
    run: list[Operator] = []
    prologues: dict[Operator, list[Operator]] = {}
    output_views: dict[Operator, list[Operator]] = {}
    for op in ops if views is not None else ():
        if lowering_error(op) is None and is_anchor(op):
            before, after = views(op, consumers, outputs)  # type: ignore[misc]
            before = [v for v in before if lowering_error(v) is None and v not in absorbed]
            after = after if all(lowering_error(v) is None for v in after) else []
            prologues[op], output_views[op] = before, after
            absorbed.update(before)

    def close_run() -> None:
        if run:
            groups.append(Group("fused", list(run)))
            run.clear()

    for op in ops:
        if op in absorbed:
            continue
        reason = lowering_error(op)
        if reason is not None:
            close_run()
            groups.append(Group("reference", [op], reason=reason))
        elif is_anchor(op):
            close_run()
            chain = output_views.get(op) or (_epilogue_chain(op, position, consumers, outputs, lowering_error)
                                             if takes_epilogue(op) else [])  # fmt: skip
            absorbed.update(chain)
            groups.append(Group("anchor", [op, *chain], prologue=prologues.get(op, [])))
        else:
            run.append(op)
    close_run()
    _set_borders(groups, consumers, outputs)
    return groups


def _epilogue_chain(anchor: Operator, position: dict[Operator, int], consumers: dict[Tensor, list[Operator]],
                    outputs: set[Tensor], lowering_error: Callable[[Operator], str | None]) -> list[Operator]:  # fmt: skip
    """The elementwise operators that can be folded into `anchor`'s store: each the only
    consumer of the previous result, of the same shape, whose other operands exist before
    the anchor runs."""
    chain: list[Operator] = []
    current = anchor.outputs[0]
    while len(anchor.outputs) == 1 and current not in outputs:
        users = consumers.get(current, [])
        if len(users) != 1:
            break
        user = users[0]
        if user.opdef.category != "elementwise" or len(user.outputs) != 1 or lowering_error(user) is not None:
            break
        if user.inputs.count(current) != 1 or tuple(user.outputs[0].shape) != tuple(current.shape):
            break
        others = [t for t in user.inputs if t is not current]
        if any(t.producer is not None and position[t.producer] > position[anchor] for t in others):
            break
        chain.append(user)
        current = user.outputs[0]
    return chain


def _set_borders(groups: list[Group], consumers: dict[Tensor, list[Operator]], outputs: set[Tensor]) -> None:
    """Fill each group's inputs (read, produced elsewhere) and outputs (needed elsewhere)."""
    for g in groups:
        members = set(g.members)
        produced = {t for op in g.members for t in op.outputs}
        seen: set[Tensor] = set()
        for op in g.members:
            for t in op.inputs:
                if t not in produced and t not in seen:
                    seen.add(t)
                    g.inputs.append(t)
        g.outputs = [t for op in g.members for t in op.outputs
                     if t in outputs or any(c not in members for c in consumers.get(t, []))]  # fmt: skip
