"""CPU schedules: OpenMP-parallel outer loop, serial (vectorisable) inner loop.

* Elementwise kernels run a parallel loop over all dimensions but the last (flattened) and
  a unit-stride loop over the last one, which gcc can vectorise.
* Reduction kernels give each outer index to one thread, which computes the fused
  reductions and the epilogue serially.
"""

from __future__ import annotations

from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ops.schedule.buffers import Buffers
from tessera.ops.schedule.loops import declare_coords, i32, index_var, numel
from tessera.ops.schedule.partition import KernelPlan
from tessera.ops.schedule.row import Workers, elementwise_value, outer_extents, row_body

# Below this many elements of work a kernel runs on one thread: starting and joining an OpenMP
# team costs more than it saves (and far more on a loaded machine, where a descheduled
# worker holds up the join).  Work with symbolic sizes stays parallel.
MIN_PARALLEL_WORK = 1 << 15


def _static_size(extents: list) -> int | None:
    n = 1
    for e in extents:
        if not isinstance(e, E.Const):
            return None
        n *= int(e.value)
    return n


def _parallel(extents: list, body_of, work_per_index: int | None = 1) -> S.Stmt:
    """A loop over the flattened `extents`, parallel unless the whole work (the outer size
    times `work_per_index`, when known) is small; body_of(coordinates) builds the body."""
    if not extents:
        return body_of([])
    size = _static_size(extents)
    small = size is not None and work_per_index is not None and size * work_per_index < MIN_PARALLEL_WORK
    kind = S.SERIAL if small or size == 1 else S.PARALLEL
    coords = [index_var(f"o{k}") for k in range(len(extents))]
    if len(extents) == 1:
        return S.For(coords[0], i32(0), extents[0], i32(1), body_of(coords), kind)
    flat = index_var("outer")
    body = S.seq(*declare_coords(coords, flat, extents), body_of(coords))
    return S.For(flat, i32(0), numel(extents), i32(1), body, kind)


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
    return _parallel(shape[:-1], body, _static_size(shape[-1:]))


class SimdSums(Workers):
    """One thread per outer index; a floating-point sum's innermost loop is a SIMD loop (gcc may
    vectorise it, reassociating the sum as `#pragma omp simd reduction` allows)."""

    def loop(self, vars_, extents, body: S.Stmt, name: str) -> S.Stmt:  # noqa: ANN001
        nest = super().loop(vars_, extents, body, name)
        is_sum = (isinstance(body, S.Assign) and isinstance(body.value, E.Binary) and body.value.op == "+"
                  and body.value.a is body.var and body.var.dtype.is_float)  # fmt: skip
        if not is_sum:
            return nest
        return _mark_innermost(nest, body)


def _mark_innermost(s: S.Stmt, body: S.Stmt) -> S.Stmt:
    if isinstance(s, S.For):
        if s.body is body:
            return S.For(s.var, s.start, s.stop, s.step, s.body, S.SIMD)
        return S.For(s.var, s.start, s.stop, s.step, _mark_innermost(s.body, body), s.kind)
    if isinstance(s, S.Seq):
        return S.Seq([_mark_innermost(x, body) for x in s.stmts])
    return s


def lower_reduction_cpu(plan: KernelPlan, buffers: Buffers) -> S.Stmt:
    assert plan.outer is not None
    workers = SimdSums()
    return _parallel(outer_extents(plan), lambda c: row_body(plan, dict(zip(plan.outer, c)), workers, buffers),
                     _row_work(plan))  # fmt: skip


def _row_work(plan: KernelPlan) -> int | None:
    """Elements one outer index reads in its reductions (None when a size is symbolic)."""
    total = 0
    for r in plan.reductions:
        n = _static_size(list(r.reduce_extents))
        if n is None:
            return None
        total += n
    return max(total, 1)


def lower_cpu(plan: KernelPlan, buffers: Buffers) -> S.Stmt:
    """The body of the CPU kernel for `plan`."""
    if plan.outer is None:
        return lower_elementwise_cpu(plan, buffers)
    return lower_reduction_cpu(plan, buffers)
