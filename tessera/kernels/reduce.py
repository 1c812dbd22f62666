"""Row reductions, softmax, LayerNorm and RMSNorm over the last axis of x[R, C] (CUDA).

Schedule: one block of `threads` threads per row.  Each thread strides over the row with
`unroll` independent loads in flight per step, accumulating in float32; `block_reduce`
combines the per-thread partials (warp shuffles, then shared memory).  Softmax uses the
online form (running max and rescaled sum) so the row is read twice, not three times.
"""

from __future__ import annotations

import functools

import tessera as ts
from tessera import f32
from tessera.ir.dtypes import DataType

_INIT = {"sum": 0.0, "mean": 0.0, "max": -float("inf"), "min": float("inf")}


@functools.cache
def make_row_reduce(op: str, dtype: DataType, threads: int = 256, unroll: int = 4) -> ts.Kernel:
    """y[r] = op(x[r, :]) for op in sum, mean, max, min; y has x's dtype."""
    if op not in _INIT:
        raise ValueError(f"unknown reduction {op!r}; choose one of {sorted(_INIT)}")
    init = _INIT[op]
    block_op = "sum" if op == "mean" else op
    step = threads * unroll

    @ts.kernel(target="cuda", name=f"row_{op}_{dtype.short}")
    def row_reduce(x: dtype["R", "C"], y: dtype["R"]):
        C = x.shape[1]
        ts.attrs.grid = x.shape[0]
        ts.attrs.block = threads
        row = ts.block_idx.x
        acc = init
        for c0 in range(ts.thread_idx.x, C, step):
            for u in ts.unroll(unroll):
                c = c0 + u * threads
                if c < C:
                    v = ts.cast(x[row, c], f32)
                    if block_op == "sum":
                        acc += v
                    elif block_op == "max":
                        acc = max(acc, v)
                    else:
                        acc = min(acc, v)
        total = ts.block_reduce(acc, block_op)
        if ts.thread_idx.x == 0:
            if op == "mean":
                y[row] = total / ts.cast(C, f32)
            else:
                y[row] = total

    return row_reduce


@functools.cache
def make_softmax(dtype: DataType, threads: int = 256, unroll: int = 4) -> ts.Kernel:
    """y = softmax(x) over the last axis."""
    step = threads * unroll

    @ts.kernel(target="cuda", name=f"softmax_{dtype.short}")
    def softmax(x: dtype["R", "C"], y: dtype["R", "C"]):
        C = x.shape[1]
        ts.attrs.grid = x.shape[0]
        ts.attrs.block = threads
        row = ts.block_idx.x
        m = -float("inf")
        s = 0.0
        for c0 in range(ts.thread_idx.x, C, step):
            for u in ts.unroll(unroll):
                c = c0 + u * threads
                if c < C:
                    v = ts.cast(x[row, c], f32)
                    m_new = max(m, v)
                    s = s * ts.exp(m - m_new) + ts.exp(v - m_new)
                    m = m_new
        row_max = ts.block_reduce(m, "max")
        s = s * ts.exp(m - row_max) if m > -float("inf") else 0.0
        inv = 1.0 / ts.block_reduce(s, "sum")
        for c0 in range(ts.thread_idx.x, C, step):
            for u in ts.unroll(unroll):
                c = c0 + u * threads
                if c < C:
                    y[row, c] = ts.exp(ts.cast(x[row, c], f32) - row_max) * inv

    return softmax


@functools.cache
def make_layernorm(dtype: DataType, threads: int = 256, unroll: int = 4) -> ts.Kernel:
    """y = (x - mean) / sqrt(var + eps) * w + b over the last axis (biased variance)."""
    step = threads * unroll

    @ts.kernel(target="cuda", name=f"layernorm_{dtype.short}")
    def layernorm(x: dtype["R", "C"], w: dtype["C"], b: dtype["C"], y: dtype["R", "C"], eps: f32):
        C = x.shape[1]
        ts.attrs.grid = x.shape[0]
        ts.attrs.block = threads
        row = ts.block_idx.x
        s = 0.0
        ss = 0.0
        for c0 in range(ts.thread_idx.x, C, step):
            for u in ts.unroll(unroll):
                c = c0 + u * threads
                if c < C:
                    v = ts.cast(x[row, c], f32)
                    s += v
                    ss += v * v
        inv_c = 1.0 / ts.cast(C, f32)
        mean = ts.block_reduce(s, "sum") * inv_c
        var = max(ts.block_reduce(ss, "sum") * inv_c - mean * mean, 0.0)
        rstd = ts.rsqrt(var + eps)
        for c0 in range(ts.thread_idx.x, C, step):
            for u in ts.unroll(unroll):
                c = c0 + u * threads
                if c < C:
                    v = (ts.cast(x[row, c], f32) - mean) * rstd
                    y[row, c] = v * ts.cast(w[c], f32) + ts.cast(b[c], f32)

    return layernorm


@functools.cache
def make_rmsnorm(dtype: DataType, threads: int = 256, unroll: int = 4) -> ts.Kernel:
    """y = x / sqrt(mean(x^2) + eps) * w over the last axis."""
    step = threads * unroll

    @ts.kernel(target="cuda", name=f"rmsnorm_{dtype.short}")
    def rmsnorm(x: dtype["R", "C"], w: dtype["C"], y: dtype["R", "C"], eps: f32):
        C = x.shape[1]
        ts.attrs.grid = x.shape[0]
        ts.attrs.block = threads
        row = ts.block_idx.x
        ss = 0.0
        for c0 in range(ts.thread_idx.x, C, step):
            for u in ts.unroll(unroll):
                c = c0 + u * threads
                if c < C:
                    v = ts.cast(x[row, c], f32)
                    ss += v * v
        rstd = ts.rsqrt(ts.block_reduce(ss, "sum") / ts.cast(C, f32) + eps)
        for c0 in range(ts.thread_idx.x, C, step):
            for u in ts.unroll(unroll):
                c = c0 + u * threads
                if c < C:
                    y[row, c] = ts.cast(x[row, c], f32) * rstd * ts.cast(w[c], f32)

    return rmsnorm
