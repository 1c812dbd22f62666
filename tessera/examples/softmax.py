"""Row softmax y[r, :] = exp(x[r, :] - max) / sum(exp(x[r, :] - max)).

CUDA: one block per row; each thread strides over the row, then a shared-memory tree
reduction (unrolled at compile time over the halving strides) combines the partials.
CPU: rows in parallel, three passes over each row.
"""

from __future__ import annotations

import tessera as ts
from tessera import f32


def make_softmax(target: str = "cpu") -> ts.Kernel:
    return _softmax_cuda() if target == "cuda" else _softmax_cpu()


def _softmax_cuda(threads: int = 256) -> ts.Kernel:
    strides = []
    s = threads // 2
    while s > 0:
        strides.append(s)
        s //= 2

    @ts.kernel(target="cuda")
    def softmax_cuda(x: f32["R", "C"], y: f32["R", "C"]):
        C = x.shape[1]
        ts.attrs.grid = x.shape[0]
        ts.attrs.block = threads
        red = ts.shared_tensor(f32, [threads])
        row = ts.block_idx.x
        tid = ts.thread_idx.x
        m = -float("inf")
        for c in range(tid, C, threads):
            m = max(m, x[row, c])
        red[tid] = m
        ts.syncthreads()
        for s in strides:
            if tid < s:
                red[tid] = max(red[tid], red[tid + s])
            ts.syncthreads()
        m = red[0]
        ts.syncthreads()
        total = 0.0
        for c in range(tid, C, threads):
            total += ts.exp(x[row, c] - m)
        red[tid] = total
        ts.syncthreads()
        for s in strides:
            if tid < s:
                red[tid] = red[tid] + red[tid + s]
            ts.syncthreads()
        inv = 1.0 / red[0]
        for c in range(tid, C, threads):
            y[row, c] = ts.exp(x[row, c] - m) * inv

    return softmax_cuda


def _softmax_cpu() -> ts.Kernel:
    @ts.kernel(target="cpu")
    def softmax_cpu(x: f32["R", "C"], y: f32["R", "C"]):
        C = x.shape[1]
        for row in ts.parallel(x.shape[0]):
            m = -float("inf")
            for c in range(C):
                m = max(m, x[row, c])
            total = 0.0
            for c in range(C):
                e = ts.exp(x[row, c] - m)
                y[row, c] = e
                total += e
            inv = 1.0 / total
            for c in range(C):
                y[row, c] = y[row, c] * inv

    return softmax_cpu
