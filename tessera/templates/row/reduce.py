"""Row reductions (sum, mean, max, min) and softmax over the last axis of x[R, C] (CUDA).

Every kernel is a template over a `RowSchedule` (see its docstring): how many threads share
a row, how wide each load is, how many loads each thread keeps in flight and whether the row
stays in registers between reading and writing.  LayerNorm and RMSNorm, built on the same
schedules, live in norm.py; kinds.py picks a schedule from the shape and dtype.

The kernel language has no device functions, so each template spells out its cross-thread
combine step: `block_reduce` when one block owns a row, otherwise a `shfl_xor` butterfly
over the `lanes` threads of the row (aligned lane groups inside one warp).  Every thread of
the block reaches the combine step, also those whose row is past the end of x (their loads
are skipped instead): shuffles and barriers need the whole warp or block.
"""

from __future__ import annotations

import functools

import tessera as ts
from tessera import f32, i32
from tessera.ir.dtypes import DataType
from tessera.templates.row.norm import make_layernorm, make_rmsnorm
from tessera.templates.row.schedule import SCALAR_BLOCK, VECTOR_BYTES, RowSchedule, check_schedule

__all__ = ["RowSchedule", "make_layernorm", "make_rmsnorm", "make_row_reduce", "make_softmax"]

# Softmax works in base 2: exp(x - m) = exp2(x * log2(e) - m * log2(e)).  The scaled values
# feed exp2 (one MUFU.EX2, the multiply fused into the subtraction), where expf costs a
# range reduction of several more instructions per element.
LOG2E = 1.4426950408889634
_INIT = {"sum": 0.0, "mean": 0.0, "max": -float("inf"), "min": float("inf")}


@functools.cache
def make_row_reduce(op: str, dtype: DataType, schedule: RowSchedule = SCALAR_BLOCK) -> ts.Kernel:
    """kernel(x, y): y[r] = op(x[r, :]) for op in sum, mean, max, min; y has x's dtype.

    Accumulates in float32; max/min propagate NaN.  Reads the row once (`cached` and `raw` are ignored).
    """
    if op not in _INIT:
        raise ValueError(f"unknown reduction {op!r}; choose one of {sorted(_INIT)}")
    check_schedule(dtype, schedule)
    T, THREADS, LANES, VEC, PT = dtype, schedule.threads, schedule.lanes, schedule.vec, schedule.per_thread
    ROWS, STEP, OFFSETS, BLOCK = schedule.rows_per_block, LANES * PT, schedule.shuffle_offsets, schedule.block_combine
    INIT = _INIT[op]
    RED = "sum" if op == "mean" else op

    @ts.kernel(target="cuda", name=f"row_{op}_{T.short}_{schedule}")
    def row_reduce(x: T["R", "C"], y: T["R"]):
        R = x.shape[0]
        C = x.shape[1]
        ts.attrs.grid = ts.ceil_div(R, ROWS)
        ts.attrs.block = THREADS
        row = ts.block_idx.x * ROWS + ts.thread_idx.x // LANES
        lane = ts.thread_idx.x % LANES
        active = row < R
        loads = C // VEC
        acc = INIT
        for base in range(lane, loads, STEP):
            v = ts.register_tensor(T, [PT, VEC])
            for k in ts.unroll(PT):  # issue every load of the step before using one
                i = base + k * LANES
                if active and i < loads:
                    if VEC == 1:
                        v[k, 0] = x[row, i]
                    else:
                        ts.copy_vector(v[k, 0], x[row, i * VEC], VECTOR_BYTES)
            for k in ts.unroll(PT):
                if active and base + k * LANES < loads:
                    for j in ts.unroll(VEC):
                        if RED == "sum":
                            acc += ts.cast(v[k, j], f32)
                        elif RED == "max":
                            acc = max(acc, ts.cast(v[k, j], f32))
                        else:
                            acc = min(acc, ts.cast(v[k, j], f32))
        total = acc
        if BLOCK:
            total = ts.block_reduce(acc, RED)
        for d in OFFSETS:
            if RED == "sum":
                total = total + ts.shfl_xor(total, ts.cast(d, i32))
            elif RED == "max":
                total = max(total, ts.shfl_xor(total, ts.cast(d, i32)))
            else:
                total = min(total, ts.shfl_xor(total, ts.cast(d, i32)))
        if lane == 0 and active:
            if op == "mean":
                y[row] = total / ts.cast(C, f32)
            else:
                y[row] = total

    return row_reduce


@functools.cache
def make_softmax(dtype: DataType, schedule: RowSchedule = SCALAR_BLOCK) -> ts.Kernel:
    """kernel(x, y): y = softmax(x) over the last axis, computed in float32."""
    check_schedule(dtype, schedule)
    if schedule.raw:
        return _make_softmax_cached_raw(dtype, schedule)
    return (_make_softmax_cached if schedule.cached else _make_softmax_streaming)(dtype, schedule)


def _make_softmax_cached(dtype: DataType, schedule: RowSchedule) -> ts.Kernel:
    # One read of x: the row is loaded into registers, its max and sum of exponentials are
    # reduced, and y is written from the exponentials kept in registers (one exp per element).
    # Values are kept scaled by log2(e) (see LOG2E), so row_max is too.
    T, THREADS, LANES, VEC, PT = dtype, schedule.threads, schedule.lanes, schedule.vec, schedule.per_thread
    ROWS, OFFSETS, BLOCK = schedule.rows_per_block, schedule.shuffle_offsets, schedule.block_combine

    @ts.kernel(target="cuda", name=f"softmax_{T.short}_{schedule}")
    def softmax_cached(x: T["R", "C"], y: T["R", "C"]):
        R = x.shape[0]
        C = x.shape[1]
        ts.attrs.grid = ts.ceil_div(R, ROWS)
        ts.attrs.block = THREADS
        row = ts.block_idx.x * ROWS + ts.thread_idx.x // LANES
        lane = ts.thread_idx.x % LANES
        active = row < R
        loads = C // VEC
        v = ts.register_tensor(T, [PT, VEC])
        for k in ts.unroll(PT):
            i = lane + k * LANES
            if active and i < loads:
                if VEC == 1:
                    v[k, 0] = x[row, i]
                else:
                    ts.copy_vector(v[k, 0], x[row, i * VEC], VECTOR_BYTES)
        f = ts.register_tensor(f32, [PT, VEC])
        m = -float("inf")
        for k in ts.unroll(PT):
            if active and lane + k * LANES < loads:
                for j in ts.unroll(VEC):
                    f[k, j] = ts.cast(v[k, j], f32) * LOG2E
                    m = max(m, f[k, j])
        row_max = m
        if BLOCK:
            row_max = ts.block_reduce(m, "max")
        for d in OFFSETS:
            row_max = max(row_max, ts.shfl_xor(row_max, ts.cast(d, i32)))
        s = 0.0
        for k in ts.unroll(PT):
            if active and lane + k * LANES < loads:
                for j in ts.unroll(VEC):
                    f[k, j] = ts.exp2(f[k, j] - row_max)
                    s += f[k, j]
        total = s
        if BLOCK:
            total = ts.block_reduce(s, "sum")
        for d in OFFSETS:
            total = total + ts.shfl_xor(total, ts.cast(d, i32))
        inv = 1.0 / total
        o = ts.register_tensor(T, [PT, VEC])
        for k in ts.unroll(PT):
            i = lane + k * LANES
            if active and i < loads:
                for j in ts.unroll(VEC):
                    o[k, j] = f[k, j] * inv
                if VEC == 1:
                    y[row, i] = o[k, 0]
                else:
                    ts.copy_vector(y[row, i * VEC], o[k, 0], VECTOR_BYTES)

    return softmax_cached


def _make_softmax_cached_raw(dtype: DataType, schedule: RowSchedule) -> ts.Kernel:
    # One read of x, the row kept as loaded (x's dtype): half the registers of caching float32
    # exponentials for 16-bit rows, so blocks stay small and many fit on an SM, at the cost of
    # a second exp per element (for the output, after the sum).  Values are scaled by log2(e).
    T, THREADS, LANES, VEC, PT = dtype, schedule.threads, schedule.lanes, schedule.vec, schedule.per_thread
    ROWS, OFFSETS, BLOCK = schedule.rows_per_block, schedule.shuffle_offsets, schedule.block_combine

    @ts.kernel(target="cuda", name=f"softmax_{T.short}_{schedule}")
    def softmax_cached_raw(x: T["R", "C"], y: T["R", "C"]):
        R = x.shape[0]
        C = x.shape[1]
        ts.attrs.grid = ts.ceil_div(R, ROWS)
        ts.attrs.block = THREADS
        row = ts.block_idx.x * ROWS + ts.thread_idx.x // LANES
        lane = ts.thread_idx.x % LANES
        active = row < R
        loads = C // VEC
        v = ts.register_tensor(T, [PT, VEC])
        for k in ts.unroll(PT):
            i = lane + k * LANES
            if active and i < loads:
                if VEC == 1:
                    v[k, 0] = x[row, i]
                else:
                    ts.copy_vector(v[k, 0], x[row, i * VEC], VECTOR_BYTES)
        m = -float("inf")
        for k in ts.unroll(PT):
            if active and lane + k * LANES < loads:
                for j in ts.unroll(VEC):
                    m = max(m, ts.cast(v[k, j], f32))
        row_max = m
        if BLOCK:
            row_max = ts.block_reduce(m, "max")
        for d in OFFSETS:
            row_max = max(row_max, ts.shfl_xor(row_max, ts.cast(d, i32)))
        # exp(x - max) = exp2(x * log2(e) - max * log2(e)): one FMA feeds each exp2.  A row of
        # -inf has max -inf; its scaled max is then -inf too and every term is NaN, as in torch.
        shift = row_max * LOG2E
        s = 0.0
        for k in ts.unroll(PT):
            if active and lane + k * LANES < loads:
                for j in ts.unroll(VEC):
                    s += ts.exp2(ts.cast(v[k, j], f32) * LOG2E - shift)
        total = s
        if BLOCK:
            total = ts.block_reduce(s, "sum")
        for d in OFFSETS:
            total = total + ts.shfl_xor(total, ts.cast(d, i32))
        inv = 1.0 / total
        o = ts.register_tensor(T, [PT, VEC])
        for k in ts.unroll(PT):
            i = lane + k * LANES
            if active and i < loads:
                for j in ts.unroll(VEC):
                    o[k, j] = ts.exp2(ts.cast(v[k, j], f32) * LOG2E - shift) * inv
                if VEC == 1:
                    y[row, i] = o[k, 0]
                else:
                    ts.copy_vector(y[row, i * VEC], o[k, 0], VECTOR_BYTES)

    return softmax_cached_raw


def _make_softmax_streaming(dtype: DataType, schedule: RowSchedule) -> ts.Kernel:
    # Two reads of x.  Pass 1 keeps a running max m and a sum s of exp(x - m) per thread,
    # rescaling s once per step of per_thread loads (not once per element); threads then
    # agree on the row max and rescale their sums to it.  Pass 2 writes exp(x - max) / sum.
    # m and row_max are in the log2(e)-scaled domain (see LOG2E).
    T, THREADS, LANES, VEC, PT = dtype, schedule.threads, schedule.lanes, schedule.vec, schedule.per_thread
    ROWS, STEP, OFFSETS, BLOCK = schedule.rows_per_block, LANES * PT, schedule.shuffle_offsets, schedule.block_combine

    @ts.kernel(target="cuda", name=f"softmax_{T.short}_{schedule}")
    def softmax_streaming(x: T["R", "C"], y: T["R", "C"]):
        R = x.shape[0]
        C = x.shape[1]
        ts.attrs.grid = ts.ceil_div(R, ROWS)
        ts.attrs.block = THREADS
        row = ts.block_idx.x * ROWS + ts.thread_idx.x // LANES
        lane = ts.thread_idx.x % LANES
        active = row < R
        loads = C // VEC
        m = -float("inf")
        s = 0.0
        for base in range(lane, loads, STEP):
            v = ts.register_tensor(T, [PT, VEC])
            for k in ts.unroll(PT):
                i = base + k * LANES
                if active and i < loads:
                    if VEC == 1:
                        v[k, 0] = x[row, i]
                    else:
                        ts.copy_vector(v[k, 0], x[row, i * VEC], VECTOR_BYTES)
            step_max = -float("inf")
            for k in ts.unroll(PT):
                if active and base + k * LANES < loads:
                    for j in ts.unroll(VEC):
                        step_max = max(step_max, ts.cast(v[k, j], f32) * LOG2E)
            m_new = max(m, step_max)
            # While everything seen is -inf there is nothing to add (and -inf - -inf is NaN);
            # a NaN m_new passes the test, so NaN inputs propagate.
            if m_new != -float("inf"):
                s = s * ts.exp2(m - m_new)
                for k in ts.unroll(PT):
                    if active and base + k * LANES < loads:
                        for j in ts.unroll(VEC):
                            s += ts.exp2(ts.cast(v[k, j], f32) * LOG2E - m_new)
                m = m_new
        row_max = m
        if BLOCK:
            row_max = ts.block_reduce(m, "max")
        for d in OFFSETS:
            row_max = max(row_max, ts.shfl_xor(row_max, ts.cast(d, i32)))
        total = ts.select(m == row_max, s, s * ts.exp2(m - row_max))  # m == row_max covers -inf
        if BLOCK:
            total = ts.block_reduce(total, "sum")
        for d in OFFSETS:
            total = total + ts.shfl_xor(total, ts.cast(d, i32))
        inv = 1.0 / total
        for base in range(lane, loads, STEP):
            v = ts.register_tensor(T, [PT, VEC])
            for k in ts.unroll(PT):
                i = base + k * LANES
                if active and i < loads:
                    if VEC == 1:
                        v[k, 0] = x[row, i]
                    else:
                        ts.copy_vector(v[k, 0], x[row, i * VEC], VECTOR_BYTES)
            o = ts.register_tensor(T, [PT, VEC])
            for k in ts.unroll(PT):
                i = base + k * LANES
                if active and i < loads:
                    for j in ts.unroll(VEC):
                        o[k, j] = ts.exp2(ts.cast(v[k, j], f32) * LOG2E - row_max) * inv
                    if VEC == 1:
                        y[row, i] = o[k, 0]
                    else:
                        ts.copy_vector(y[row, i * VEC], o[k, 0], VECTOR_BYTES)

    return softmax_streaming
