"""Memory planning: place every intermediate tensor in one arena, reusing space by liveness.

A tensor lives from the step that produces it to the last step that reads it (graph
outputs to the end).  Tensors are placed largest first, each at the lowest offset that
overlaps no already-placed tensor whose lifetime intersects its own (greedy by size, as in
TFLite's arena planner); this is usually within a few percent of the peak of live bytes.
Inputs and constants live outside the arena.  The compiled graph allocates `arena_bytes`
once per distinct set of symbol values and hands each kernel `base + offsets[t]`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.symbolic import numel as shape_numel
from tessera.graph.tensor import Tensor

K = TypeVar("K")


@dataclass
class MemoryPlan:
    """Offsets of the intermediate tensors in one arena, and what that saves."""

    offsets: dict[Tensor, int]
    sizes: dict[Tensor, int]
    lifetimes: dict[Tensor, tuple[int, int]]
    arena_bytes: int  # the peak: what the arena must hold
    naive_bytes: int  # every intermediate in its own buffer
    live_peak_bytes: int  # largest total of simultaneously live bytes (a lower bound)

    def __str__(self) -> str:
        return (f"memory plan: {len(self.offsets)} buffers, arena {self.arena_bytes} B "
                f"(no reuse: {self.naive_bytes} B, live-bytes lower bound {self.live_peak_bytes} B)")  # fmt: skip


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def place_buffers(sizes: Mapping[K, int], lifetimes: Mapping[K, tuple[int, int]]) -> tuple[dict[K, int], int]:
    """Offsets for buffers of `sizes` (already aligned) alive over inclusive step ranges:
    largest first, each at the lowest offset clear of every placed buffer alive at the same
    time.  Returns the offsets and the arena size."""
    placed: list[tuple[int, int, K]] = []
    offsets: dict[K, int] = {}
    for t in sorted(sizes, key=lambda t: (-sizes[t], lifetimes[t][0])):
        lo_t, hi_t = lifetimes[t]
        busy = sorted((o, o + s) for o, s, u in placed if not (lifetimes[u][1] < lo_t or hi_t < lifetimes[u][0]))
        offset = 0
        for lo, hi in busy:
            if offset + sizes[t] <= lo:
                break
            offset = max(offset, hi)
        offsets[t] = offset
        placed.append((offset, sizes[t], t))
    return offsets, max((o + s for o, s, _ in placed), default=0)


def plan_memory(graph: FlowGraph, bindings: Mapping[str, int] | None = None, alignment: int = 256) -> MemoryPlan:
    """Plan the arena for graph with the given symbol values (needed when shapes are symbolic)."""
    bindings = dict(bindings or {})
    steps = graph.operators
    start: dict[Tensor, int] = {}
    end: dict[Tensor, int] = {}
    for i, op in enumerate(steps):
        for t in op.outputs:
            start[t] = end[t] = i
        for t in op.inputs:
            if t in start:
                end[t] = i
    for t in graph.outputs:
        if t in start:
            end[t] = len(steps)
    sizes = {}
    for t in start:
        n = shape_numel(t.shape)
        n = n if isinstance(n, int) else n.evaluate(bindings)
        sizes[t] = _align(max(1, n * t.dtype.nbytes), alignment)

    offsets, arena = place_buffers(sizes, {t: (start[t], end[t]) for t in start})
    live_peak = 0
    for i in range(len(steps) + 1):
        live_peak = max(live_peak, sum(s for t, s in sizes.items() if start[t] <= i <= end[t]))
    lifetimes = {t: (start[t], end[t]) for t in start}
    return MemoryPlan(offsets, sizes, lifetimes, arena, sum(sizes.values()), live_peak)
