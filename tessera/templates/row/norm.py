"""LayerNorm and RMSNorm over the last axis of x[R, C] (CUDA), on the row schedules of reduce.py.

Statistics are computed in float32.  With a `cached` schedule the row is read once into
registers: LayerNorm then takes the variance as the mean of (x - mean)^2 over the cached
values (two passes over registers, no cancellation).  Streaming schedules read x twice; their
variance is E[(x - k)^2] - E[x - k]^2 with k = x[row, 0], a shift that keeps the
cancellation small when |mean| >> std.  The weight and bias are loaded with the same vector
width as x (C % vec == 0 makes their chunks aligned too).
"""

from __future__ import annotations

import functools

import tessera as ts
from tessera import f32, i32
from tessera.errors import UnsupportedError
from tessera.ir.dtypes import DataType
from tessera.templates.row.schedule import SCALAR_BLOCK, VECTOR_BYTES, RowSchedule, check_schedule


def _check_norm_schedule(dtype: DataType, schedule: RowSchedule) -> None:
    check_schedule(dtype, schedule)
    if schedule.raw:
        raise UnsupportedError(f"row schedule {schedule}: raw caching is a softmax schedule; the norms cache float32")


@functools.cache
def make_layernorm(dtype: DataType, schedule: RowSchedule = SCALAR_BLOCK) -> ts.Kernel:
    """kernel(x, w, b, y, eps): y = (x - mean) / sqrt(var + eps) * w + b, biased variance."""
    _check_norm_schedule(dtype, schedule)
    return (_make_layernorm_cached if schedule.cached else _make_layernorm_streaming)(dtype, schedule)


@functools.cache
def make_rmsnorm(dtype: DataType, schedule: RowSchedule = SCALAR_BLOCK) -> ts.Kernel:
    """kernel(x, w, y, eps): y = x / sqrt(mean(x^2) + eps) * w."""
    _check_norm_schedule(dtype, schedule)
    return (_make_rmsnorm_cached if schedule.cached else _make_rmsnorm_streaming)(dtype, schedule)


def _make_layernorm_cached(dtype: DataType, schedule: RowSchedule) -> ts.Kernel:
    T, THREADS, LANES, VEC, PT = dtype, schedule.threads, schedule.lanes, schedule.vec, schedule.per_thread
    ROWS, OFFSETS, BLOCK = schedule.rows_per_block, schedule.shuffle_offsets, schedule.block_combine

    @ts.kernel(target="cuda", name=f"layernorm_{T.short}_{schedule}")
    def layernorm_cached(x: T["R", "C"], w: T["C"], b: T["C"], y: T["R", "C"], eps: f32):
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
        s = 0.0
        for k in ts.unroll(PT):
            if active and lane + k * LANES < loads:
                for j in ts.unroll(VEC):
                    f[k, j] = ts.cast(v[k, j], f32)
                    s += f[k, j]
        total = s
        if BLOCK:
            total = ts.block_reduce(s, "sum")
        for d in OFFSETS:
            total = total + ts.shfl_xor(total, ts.cast(d, i32))
        inv_c = 1.0 / ts.cast(C, f32)
        mean = total * inv_c
        q = 0.0
        for k in ts.unroll(PT):
            if active and lane + k * LANES < loads:
                for j in ts.unroll(VEC):
                    f[k, j] = f[k, j] - mean
                    q += f[k, j] * f[k, j]
        sq = q
        if BLOCK:
            sq = ts.block_reduce(q, "sum")
        for d in OFFSETS:
            sq = sq + ts.shfl_xor(sq, ts.cast(d, i32))
        rstd = ts.rsqrt(sq * inv_c + eps)
        # Weight and bias are read only now, one chunk at a time: loaded earlier they would
        # hold registers through both combine steps and cost occupancy (they hit in L2).
        wv = ts.register_tensor(T, [PT, VEC])
        bv = ts.register_tensor(T, [PT, VEC])
        o = ts.register_tensor(T, [PT, VEC])
        for k in ts.unroll(PT):
            i = lane + k * LANES
            if active and i < loads:
                if VEC == 1:
                    wv[k, 0] = w[i]
                    bv[k, 0] = b[i]
                else:
                    ts.copy_vector(wv[k, 0], w[i * VEC], VECTOR_BYTES)
                    ts.copy_vector(bv[k, 0], b[i * VEC], VECTOR_BYTES)
                for j in ts.unroll(VEC):
                    o[k, j] = f[k, j] * rstd * ts.cast(wv[k, j], f32) + ts.cast(bv[k, j], f32)
                if VEC == 1:
                    y[row, i] = o[k, 0]
                else:
                    ts.copy_vector(y[row, i * VEC], o[k, 0], VECTOR_BYTES)

    return layernorm_cached


def _make_layernorm_streaming(dtype: DataType, schedule: RowSchedule) -> ts.Kernel:
    T, THREADS, LANES, VEC, PT = dtype, schedule.threads, schedule.lanes, schedule.vec, schedule.per_thread
    ROWS, STEP, OFFSETS, BLOCK = schedule.rows_per_block, LANES * PT, schedule.shuffle_offsets, schedule.block_combine

    @ts.kernel(target="cuda", name=f"layernorm_{T.short}_{schedule}")
    def layernorm_streaming(x: T["R", "C"], w: T["C"], b: T["C"], y: T["R", "C"], eps: f32):
        R = x.shape[0]
        C = x.shape[1]
        ts.attrs.grid = ts.ceil_div(R, ROWS)
        ts.attrs.block = THREADS
        row = ts.block_idx.x * ROWS + ts.thread_idx.x // LANES
        lane = ts.thread_idx.x % LANES
        active = row < R
        loads = C // VEC
        shift = 0.0
        if active:
            shift = ts.cast(x[row, 0], f32)
        s = 0.0
        q = 0.0
        for base in range(lane, loads, STEP):
            v = ts.register_tensor(T, [PT, VEC])
            for k in ts.unroll(PT):
                i = base + k * LANES
                if active and i < loads:
                    if VEC == 1:
                        v[k, 0] = x[row, i]
                    else:
                        ts.copy_vector(v[k, 0], x[row, i * VEC], VECTOR_BYTES)
            for k in ts.unroll(PT):
                if active and base + k * LANES < loads:
                    for j in ts.unroll(VEC):
                        dv = ts.cast(v[k, j], f32) - shift
                        s += dv
                        q += dv * dv
        total = s
        if BLOCK:
            total = ts.block_reduce(s, "sum")
        for d in OFFSETS:
            total = total + ts.shfl_xor(total, ts.cast(d, i32))
        sq = q
        if BLOCK:
            sq = ts.block_reduce(q, "sum")
        for d in OFFSETS:
            sq = sq + ts.shfl_xor(sq, ts.cast(d, i32))
        inv_c = 1.0 / ts.cast(C, f32)
        mean_shifted = total * inv_c
        mean = shift + mean_shifted
        rstd = ts.rsqrt(max(sq * inv_c - mean_shifted * mean_shifted, 0.0) + eps)
        for base in range(lane, loads, STEP):
            v = ts.register_tensor(T, [PT, VEC])
            wv = ts.register_tensor(T, [PT, VEC])
            bv = ts.register_tensor(T, [PT, VEC])
            for k in ts.unroll(PT):
                i = base + k * LANES
                if active and i < loads:
                    if VEC == 1:
                        v[k, 0] = x[row, i]
                        wv[k, 0] = w[i]
                        bv[k, 0] = b[i]
                    else:
                        ts.copy_vector(v[k, 0], x[row, i * VEC], VECTOR_BYTES)
                        ts.copy_vector(wv[k, 0], w[i * VEC], VECTOR_BYTES)
                        ts.copy_vector(bv[k, 0], b[i * VEC], VECTOR_BYTES)
            o = ts.register_tensor(T, [PT, VEC])
            for k in ts.unroll(PT):
                i = base + k * LANES
                if active and i < loads:
                    for j in ts.unroll(VEC):
                        xn = (ts.cast(v[k, j], f32) - mean) * rstd
                        o[k, j] = xn * ts.cast(wv[k, j], f32) + ts.cast(bv[k, j], f32)
                    if VEC == 1:
                        y[row, i] = o[k, 0]
                    else:
                        ts.copy_vector(y[row, i * VEC], o[k, 0], VECTOR_BYTES)

    return layernorm_streaming


def _make_rmsnorm_cached(dtype: DataType, schedule: RowSchedule) -> ts.Kernel:
    T, THREADS, LANES, VEC, PT = dtype, schedule.threads, schedule.lanes, schedule.vec, schedule.per_thread
    ROWS, OFFSETS, BLOCK = schedule.rows_per_block, schedule.shuffle_offsets, schedule.block_combine

    @ts.kernel(target="cuda", name=f"rmsnorm_{T.short}_{schedule}")
    def rmsnorm_cached(x: T["R", "C"], w: T["C"], y: T["R", "C"], eps: f32):
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
        q = 0.0
        for k in ts.unroll(PT):
            if active and lane + k * LANES < loads:
                for j in ts.unroll(VEC):
                    f[k, j] = ts.cast(v[k, j], f32)
                    q += f[k, j] * f[k, j]
        sq = q
        if BLOCK:
            sq = ts.block_reduce(q, "sum")
        for d in OFFSETS:
            sq = sq + ts.shfl_xor(sq, ts.cast(d, i32))
        rstd = ts.rsqrt(sq / ts.cast(C, f32) + eps)
        wv = ts.register_tensor(T, [PT, VEC])
        o = ts.register_tensor(T, [PT, VEC])
        for k in ts.unroll(PT):  # the weight is read only now (see layernorm_cached)
            i = lane + k * LANES
            if active and i < loads:
                if VEC == 1:
                    wv[k, 0] = w[i]
                else:
                    ts.copy_vector(wv[k, 0], w[i * VEC], VECTOR_BYTES)
                for j in ts.unroll(VEC):
                    o[k, j] = f[k, j] * rstd * ts.cast(wv[k, j], f32)
                if VEC == 1:
                    y[row, i] = o[k, 0]
                else:
                    ts.copy_vector(y[row, i * VEC], o[k, 0], VECTOR_BYTES)

    return rmsnorm_cached


def _make_rmsnorm_streaming(dtype: DataType, schedule: RowSchedule) -> ts.Kernel:
    T, THREADS, LANES, VEC, PT = dtype, schedule.threads, schedule.lanes, schedule.vec, schedule.per_thread
    ROWS, STEP, OFFSETS, BLOCK = schedule.rows_per_block, LANES * PT, schedule.shuffle_offsets, schedule.block_combine

    @ts.kernel(target="cuda", name=f"rmsnorm_{T.short}_{schedule}")
    def rmsnorm_streaming(x: T["R", "C"], w: T["C"], y: T["R", "C"], eps: f32):
        R = x.shape[0]
        C = x.shape[1]
        ts.attrs.grid = ts.ceil_div(R, ROWS)
        ts.attrs.block = THREADS
        row = ts.block_idx.x * ROWS + ts.thread_idx.x // LANES
        lane = ts.thread_idx.x % LANES
        active = row < R
        loads = C // VEC
        q = 0.0
        for base in range(lane, loads, STEP):
            v = ts.register_tensor(T, [PT, VEC])
            for k in ts.unroll(PT):
                i = base + k * LANES
                if active and i < loads:
                    if VEC == 1:
                        v[k, 0] = x[row, i]
                    else:
                        ts.copy_vector(v[k, 0], x[row, i * VEC], VECTOR_BYTES)
            for k in ts.unroll(PT):
                if active and base + k * LANES < loads:
                    for j in ts.unroll(VEC):
                        xv = ts.cast(v[k, j], f32)
                        q += xv * xv
        sq = q
        if BLOCK:
            sq = ts.block_reduce(q, "sum")
        for d in OFFSETS:
            sq = sq + ts.shfl_xor(sq, ts.cast(d, i32))
        rstd = ts.rsqrt(sq / ts.cast(C, f32) + eps)
        for base in range(lane, loads, STEP):
            v = ts.register_tensor(T, [PT, VEC])
            wv = ts.register_tensor(T, [PT, VEC])
            for k in ts.unroll(PT):
                i = base + k * LANES
                if active and i < loads:
                    if VEC == 1:
                        v[k, 0] = x[row, i]
                        wv[k, 0] = w[i]
                    else:
                        ts.copy_vector(v[k, 0], x[row, i * VEC], VECTOR_BYTES)
                        ts.copy_vector(wv[k, 0], w[i * VEC], VECTOR_BYTES)
            o = ts.register_tensor(T, [PT, VEC])
            for k in ts.unroll(PT):
                i = base + k * LANES
                if active and i < loads:
                    for j in ts.unroll(VEC):
                        o[k, j] = ts.cast(v[k, j], f32) * rstd * ts.cast(wv[k, j], f32)
                    if VEC == 1:
                        y[row, i] = o[k, 0]
                    else:
                        ts.copy_vector(y[row, i * VEC], o[k, 0], VECTOR_BYTES)

    return rmsnorm_streaming
