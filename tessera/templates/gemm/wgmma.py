"""fp16/bf16 GEMM on SM90 warpgroup tensor cores (wgmma.mma_async), written in tessera.

C[b] = A[b] @ B[b]^T with A [batch, M, K] and B [batch, N, K] (both K-major, as a linear
layer's input and weight).  Per thread block: BM / 64 warpgroups, each owning 64 rows x BN
columns in registers; a `stages`-deep ring of 64-column K tiles filled by cp.async and laid
out with the 128-byte swizzle that wgmma's shared-memory descriptors describe; per k-tile,
four m64n{BN}k16 wgmmas read both operands straight from shared memory.  Split-k as in
tessera.templates.gemm.mma.  Not yet: TMA loads, warp specialisation, thread-block clusters.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import tessera as ts
from tessera import f32
from tessera.errors import UnsupportedError
from tessera.ir import dtypes
from tessera.ir.dtypes import DataType
from tessera.ir.fragments import wgmma_m64_c
from tessera.ir.types import Swizzle
from tessera.target import SM90, Architecture, Target
from tessera.templates.gemm.mma import _copy_map

BLOCK_K = 64  # one 128-byte swizzled row of 16-bit elements
SWIZZLE_128B = Swizzle(3, 3, 3)


@dataclass(frozen=True)
class WgmmaConfig:
    """Block tile (block_m rows = block_m / 64 warpgroups, block_n columns), stages, split-k."""

    block_m: int
    block_n: int
    stages: int
    split_k: int = 1

    @property
    def threads(self) -> int:
        return 128 * (self.block_m // 64)

    def smem_bytes(self) -> int:
        return self.stages * (self.block_m + self.block_n) * BLOCK_K * 2

    def problems(self, target: Target | Architecture = SM90) -> list[str]:
        out = []
        if self.block_m not in (64, 128, 192, 256):
            out.append("block_m must be 64, 128, 192 or 256 (whole warpgroups)")
        if self.block_n not in (64, 128, 192, 256):
            out.append("block_n must be 64, 128, 192 or 256")
        if self.stages < 2:
            out.append("a pipeline needs at least 2 stages")
        if self.smem_bytes() > target.smem_per_block:
            out.append(f"{self.smem_bytes()} bytes of shared memory ({target.smem_per_block // 1024} KiB max)")
        if self.split_k < 1:
            out.append("split_k must be >= 1")
        return out

    def __str__(self) -> str:
        return f"wgmma_{self.block_m}x{self.block_n}x{BLOCK_K}_s{self.stages}_k{self.split_k}"


def make_gemm_wgmma(dtype: DataType, config: WgmmaConfig, vector: bool = True) -> ts.Kernel:
    """kernel(A, B, C, split_k); see make_gemm for the output convention."""
    if not vector:
        raise UnsupportedError("the wgmma GEMM needs 16-byte aligned rows (K % 8 == 0); use the mma.sync GEMM")
    return _make(dtype, replace(config, split_k=1), config.split_k > 1)


@functools.cache
def _make(dtype: DataType, config: WgmmaConfig, partial: bool) -> ts.Kernel:
    if dtype not in (dtypes.float16, dtypes.bfloat16):
        raise UnsupportedError(f"the tensor-core GEMM takes float16 or bfloat16, not {dtype}")
    problems = config.problems()
    if problems:
        raise UnsupportedError(f"GEMM config {config}: {'; '.join(problems)}")
    T = dtype
    BM, BN, BK, STAGES = config.block_m, config.block_n, BLOCK_K, config.stages
    THREADS = config.threads
    OUT = f32 if partial else T
    A_LOAD = _copy_map(BM, BK, THREADS, 8)
    B_LOAD = _copy_map(BN, BK, THREADS, 8)
    C_FRAG = wgmma_m64_c(BN)
    name = f"gemm_{T.short}_nk_{str(config).rsplit('_k', 1)[0]}{'_partial' if partial else ''}"

    @ts.kernel(target="cuda", name=name)
    def gemm(A: T["batch", "M", "K"], B: T["batch", "N", "K"], C: OUT["zdim", "M", "N"], split: ts.int32):
        ts.attrs.grid = (ts.ceil_div(N, BN), ts.ceil_div(M, BM), batch * split)
        ts.attrs.block = THREADS
        As = ts.shared_tensor(T, [STAGES, BM, BK], swizzle=SWIZZLE_128B)
        Bs = ts.shared_tensor(T, [STAGES, BN, BK], swizzle=SWIZZLE_128B)
        acc = ts.register_tensor(f32, [BN // 2])
        tid = ts.thread_idx.x
        wg = tid // 128
        z = ts.block_idx.z
        bi = z // split
        m0 = ts.block_idx.y * BM
        n0 = ts.block_idx.x * BN
        k_tiles = ts.ceil_div(K, BK)
        per_split = ts.ceil_div(k_tiles, split)
        kt0 = (z % split) * per_split
        num_k = max(min(per_split, k_tiles - kt0), 0)
        for e in ts.unroll(BN // 2):
            acc[e] = 0.0
        for it in range(1 - STAGES, num_k):
            if it >= 0:
                ts.copy_async_wait(STAGES - 2)
                ts.fence_proxy_async()  # this thread's cp.async writes, visible to wgmma's async proxy
                ts.syncthreads()
            lt = it + STAGES - 1
            if lt < num_k:
                ls = lt % STAGES
                k0 = (kt0 + lt) * BK
                for r, c in A_LOAD.on(tid):
                    ok = m0 + r < M and k0 + c * 8 < K
                    ts.copy_async(As[ls, r, c * 8], A[bi, ts.select(ok, m0 + r, 0), ts.select(ok, k0 + c * 8, 0)], 16, ok)
                for r, c in B_LOAD.on(tid):
                    ok = n0 + r < N and k0 + c * 8 < K
                    ts.copy_async(Bs[ls, r, c * 8], B[bi, ts.select(ok, n0 + r, 0), ts.select(ok, k0 + c * 8, 0)], 16, ok)
            ts.copy_async_commit()
            if it >= 0:
                cs = it % STAGES
                ts.wgmma_fence()
                for kk in ts.unroll(BK // 16):
                    ts.wgmma(acc[0], As[cs, wg * 64, kk * 16], Bs[cs, 0, kk * 16], n=BN)
                ts.wgmma_commit()
                ts.wgmma_wait(0)  # the stage is overwritten next iteration
        ts.copy_async_wait(0)
        for e, (r, c) in enumerate(C_FRAG.on(tid % 128)):
            gm = m0 + wg * 64 + r
            gn = n0 + c
            if gm < M and gn < N:
                C[z, gm, gn] = acc[e]

    return gemm
