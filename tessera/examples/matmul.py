"""Tiled fp32 matmul C = A @ B written with composed task mappings.

CUDA: a block computes a BM x BN tile of C with 256 threads.  The tile is assigned by
`warps * thread_tile * lanes` = spatial(2, 4) * repeat(4, 4) * spatial(8, 4): 8 warps in a
2 x 4 grid, each thread owning a 4 x 4 sub-tile whose rows and columns are strided by the
lane grid so a warp reads contiguous shared-memory words.  A and B tiles are staged through
shared memory, loaded by their own mappings.

CPU: the outer tile loop runs in parallel (OpenMP); inside a tile, the micro-tile mapping
repeat(BM // 4, BN // 16) * repeat(4, 16) keeps a 4 x 16 block of C in registers.
"""

from __future__ import annotations

import tessera as ts
from tessera import f32, repeat, spatial


def make_matmul(target: str = "cpu") -> ts.Kernel:
    return _matmul_cuda() if target == "cuda" else _matmul_cpu()


def _matmul_cuda(BM: int = 64, BN: int = 64, BK: int = 16) -> ts.Kernel:
    threads = 256
    c_map = spatial(2, 4) * repeat(4, 4) * spatial(8, 4)  # (64, 64) tile over 256 threads
    a_map = repeat(BM * BK // threads, 1) * spatial(threads // BK, BK)  # (64, 16)
    b_map = repeat(BK * BN // threads, 1) * spatial(threads // BN, BN)  # (16, 64)
    assert c_map.task_shape == (BM, BN) and a_map.task_shape == (BM, BK) and b_map.task_shape == (BK, BN)
    per_thread = c_map.tasks_per_worker

    @ts.kernel(target="cuda")
    def matmul_cuda(a: f32["M", "K"], b: f32["K", "N"], c: f32["M", "N"]):
        M, K, N = a.shape[0], a.shape[1], b.shape[1]
        ts.attrs.grid = (ts.ceil_div(N, BN), ts.ceil_div(M, BM))
        ts.attrs.block = threads
        sa = ts.shared_tensor(f32, [BM, BK])
        sb = ts.shared_tensor(f32, [BK, BN])
        acc = ts.register_tensor(f32, [per_thread])
        for t in ts.unroll(per_thread):
            acc[t] = 0.0
        m0 = ts.block_idx.y * BM
        n0 = ts.block_idx.x * BN
        tid = ts.thread_idx.x
        for k0 in range(0, K, BK):
            for i, k in a_map.on(tid):
                sa[i, k] = a[m0 + i, k0 + k] if m0 + i < M and k0 + k < K else 0.0
            for k, j in b_map.on(tid):
                sb[k, j] = b[k0 + k, n0 + j] if k0 + k < K and n0 + j < N else 0.0
            ts.syncthreads()
            for k in ts.unroll(BK):
                for t, (i, j) in enumerate(c_map.on(tid)):
                    acc[t] += sa[i, k] * sb[k, j]
            ts.syncthreads()
        for t, (i, j) in enumerate(c_map.on(tid)):
            if m0 + i < M and n0 + j < N:
                c[m0 + i, n0 + j] = acc[t]

    return matmul_cuda


def _matmul_cpu(BM: int = 32, BN: int = 64) -> ts.Kernel:
    micro = repeat(BM // 4, BN // 16) * repeat(4, 16)

    @ts.kernel(target="cpu")
    def matmul_cpu(a: f32["M", "K"], b: f32["K", "N"], c: f32["M", "N"]):
        M, K, N = a.shape[0], a.shape[1], b.shape[1]
        tiles_n = ts.ceil_div(N, BN)
        for tile in ts.parallel(ts.ceil_div(M, BM) * tiles_n):
            m0 = (tile // tiles_n) * BM
            n0 = (tile % tiles_n) * BN
            acc = ts.register_tensor(f32, [BM, BN])
            for i, j in micro.on(0):
                acc[i, j] = 0.0
            for k in range(K):
                for i, j in micro.on(0):
                    if m0 + i < M and n0 + j < N:
                        acc[i, j] += a[m0 + i, k] * b[k, n0 + j]
            for i, j in micro.on(0):
                if m0 + i < M and n0 + j < N:
                    c[m0 + i, n0 + j] = acc[i, j]

    return matmul_cpu
