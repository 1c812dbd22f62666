"""CUDA schedules.

* Elementwise: 256-thread blocks, each thread ELEMENTS_PER_THREAD elements one block-width
  apart (so every access stays coalesced); a block whose elements are all in range runs them
  without guards, which lets the compiler issue all their loads before the first store: four
  times the bytes in flight of one element per thread, which is what reaches HBM bandwidth
  (one 2-byte element per thread moved ~1.2 TB/s on the H200).
* Reductions, by the amount of work per outer index (reduction extent and epilogue size):
  - `thread`: one thread per outer index, serial loops: tiny reductions and contractions
    (naive matmul/convolution: neighbouring threads read neighbouring columns);
  - `warp`: one warp per outer index, 8 per block, lanes stride over the domain and combine
    with shuffles: medium rows (up to 1024 elements);
  - `block`: one block per outer index, warp shuffles then shared memory: long or symbolic
    rows (1024 threads when there is only one outer index).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.compute import ReduceCompute
from tessera.ir.func import LaunchConfig
from tessera.ops.schedule.buffers import Buffers
from tessera.ops.schedule.loops import ceil_div, declare_coords, i32, index_var, numel
from tessera.ops.schedule.partition import KernelPlan
from tessera.ops.schedule.reduction import WARP
from tessera.ops.schedule.row import Cooperative, Workers, elementwise_value, outer_extents, row_body

ELEMENTWISE_BLOCK = 256
ELEMENTS_PER_THREAD = 4
THREAD_BLOCK = 128
WARPS_PER_BLOCK = 8
ROW_BLOCK = 256


@dataclass(frozen=True)
class CudaSchedule:
    kind: str  # "elementwise", "thread", "warp" or "block"
    threads: int


def _static_numel(extents) -> int | None:
    n = numel(extents)
    return int(n.value) if isinstance(n, E.Const) else None


def choose_schedule(plan: KernelPlan) -> CudaSchedule:
    if plan.outer is None:
        return CudaSchedule("elementwise", ELEMENTWISE_BLOCK)
    if any(r.tag == "contraction" for r in plan.reductions):
        return CudaSchedule("thread", THREAD_BLOCK)
    work = [_static_numel(r.reduce_extents) for r in plan.reductions]
    if not isinstance(plan.anchor, ReduceCompute):
        work.append(_static_numel([plan.anchor.shape[p] for p in range(plan.anchor.rank) if p not in plan.outer]))
    if _static_numel(outer_extents(plan)) == 1:
        return CudaSchedule("block", 1024)
    if any(w is None for w in work):
        return CudaSchedule("block", ROW_BLOCK)
    most = max(work, default=1)
    if most <= 32:
        return CudaSchedule("thread", THREAD_BLOCK)
    if most <= 1024:
        return CudaSchedule("warp", WARP * WARPS_PER_BLOCK)
    return CudaSchedule("block", ROW_BLOCK)


def _tid() -> E.Expr:
    return E.HardwareIndex("threadIdx.x")


def _bid() -> E.Expr:
    return E.HardwareIndex("blockIdx.x")


def lower_cuda(plan: KernelPlan, buffers: Buffers) -> tuple[S.Stmt, LaunchConfig, CudaSchedule]:
    """The body and launch configuration of the CUDA kernel for `plan`."""
    sched = choose_schedule(plan)
    if sched.kind == "elementwise":
        shape = list(plan.anchor.shape)
        total = numel(shape)
        per_block = sched.threads * ELEMENTS_PER_THREAD
        first = index_var("first")

        def element(j: int, guarded: bool) -> S.Stmt:
            flat = index_var(f"idx{j}{'' if guarded else 'f'}")
            coords = [index_var(f"i{j}{'' if guarded else 'f'}_{k}") for k in range(len(shape))]
            store = buffers.store(plan.anchor, tuple(coords), elementwise_value(plan, coords))
            work = S.seq(*declare_coords(coords, flat, shape), store)
            return S.seq(S.DeclareVar(flat, first + i32(j * sched.threads)),
                         S.If(E.Binary("<", flat, total), work) if guarded else work)  # fmt: skip

        whole = E.Binary("<=", _bid() * i32(per_block) + i32(per_block), total)
        body = S.seq(
            S.DeclareVar(first, _bid() * i32(per_block) + _tid()),
            S.If(whole, S.seq(*(element(j, False) for j in range(ELEMENTS_PER_THREAD))),
                 S.seq(*(element(j, True) for j in range(ELEMENTS_PER_THREAD)))),  # fmt: skip
        )
        return body, LaunchConfig((ceil_div(total, per_block),), (i32(sched.threads),)), sched

    extents = outer_extents(plan)
    total = numel(extents)
    coords = [index_var(f"o{k}") for k in range(len(extents))]
    outer = dict(zip(plan.outer, coords))
    row = index_var("row")
    if sched.kind == "thread":
        first = _bid() * i32(sched.threads) + _tid()
        workers: Workers = Workers()
        grid = ceil_div(total, sched.threads)
    elif sched.kind == "warp":
        first = _bid() * i32(WARPS_PER_BLOCK) + _tid() // i32(WARP)
        workers = Cooperative(_tid() % i32(WARP), WARP, block=False)
        grid = ceil_div(total, WARPS_PER_BLOCK)
    else:
        first = _bid()
        workers = Cooperative(_tid(), sched.threads, block=True)
        grid = total
    inner = S.seq(*declare_coords(coords, row, extents), row_body(plan, outer, workers, buffers))
    # Whole warps (and whole blocks) share a row, so the guard never splits a shuffle or barrier.
    body = S.seq(S.DeclareVar(row, first), S.If(E.Binary("<", row, total), inner))
    return body, LaunchConfig((grid,), (i32(sched.threads),)), sched
