"""CPU schedules: OpenMP-parallel outer loop, serial (vectorisable) inner loop.

* Elementwise kernels run a parallel loop over all dimensions but the last (flattened) and
  a unit-stride loop over the last one, which gcc can vectorise.
* Reduction kernels give each outer index to one thread, which computes the fused
  reductions and the epilogue serially.
"""

from __future__ import annotations

from tessera.ir import stmt as S
from tessera.ops.schedule.buffers import Buffers
from tessera.ops.schedule.loops import declare_coords, i32, index_var, numel
from tessera.ops.schedule.partition import KernelPlan
from tessera.ops.schedule.row import Workers, elementwise_value, outer_extents, row_body


def _parallel(extents: list, body_of) -> S.Stmt:
    """A parallel loop over the flattened `extents`; body_of(coordinates) builds the body."""
    if not extents:
        return body_of([])
    coords = [index_var(f"o{k}") for k in range(len(extents))]
    if len(extents) == 1:
        return S.For(coords[0], i32(0), extents[0], i32(1), body_of(coords), S.PARALLEL)
    flat = index_var("outer")
    body = S.seq(*declare_coords(coords, flat, extents), body_of(coords))
    return S.For(flat, i32(0), numel(extents), i32(1), body, S.PARALLEL)


def lower_elementwise_cpu(plan: KernelPlan, buffers: Buffers) -> S.Stmt:
    anchor = plan.anchor
    shape = list(anchor.shape)
    if not shape:
        return buffers.store(anchor, (), elementwise_value(plan, []))

    def body(outer_coords: list) -> S.Stmt:
        last = index_var("i_inner")
        coords = [*outer_coords, last]
        store = buffers.store(anchor, tuple(coords), elementwise_value(plan, coords))
        return S.For(last, i32(0), shape[-1], i32(1), store)

    if len(shape) == 1:
        return _parallel(shape, lambda c: buffers.store(anchor, tuple(c), elementwise_value(plan, c)))
    return _parallel(shape[:-1], body)


def lower_reduction_cpu(plan: KernelPlan, buffers: Buffers) -> S.Stmt:
    assert plan.outer is not None
    workers = Workers()
    return _parallel(outer_extents(plan), lambda c: row_body(plan, dict(zip(plan.outer, c)), workers, buffers))


def lower_cpu(plan: KernelPlan, buffers: Buffers) -> S.Stmt:
    """The body of the CPU kernel for `plan`."""
    if plan.outer is None:
        return lower_elementwise_cpu(plan, buffers)
    return lower_reduction_cpu(plan, buffers)
