"""fp16/bf16 GEMM on tensor cores (mma.sync m16n8k16, float32 accumulate), written in tessera.

C[b] = A[b] @ B[b] with A [batch, M, K] and B [batch, K, N] ("kn", torch.matmul's layout) or
[batch, N, K] ("nk", a linear layer's weight).  Schedule, per thread block:

* a BM x BN output tile; warps in a (BM/WM) x (BN/WN) grid, each owning a WM x WN sub-tile
  of (WM/16) x (WN/8) mma tiles accumulated in registers;
* a `stages`-deep ring of shared-memory tiles filled by cp.async (16-byte chunks, zero-filled
  past the matrix edges), one barrier per k-step; shared tiles are XOR-swizzled so the
  ldmatrix row reads are bank-conflict free;
* split-k over gridDim.z: each split writes float32 partial sums that a second kernel adds.

Shapes whose rows are not 16-byte aligned (K or N not a multiple of 8) use the same schedule
with element-wise loads instead of cp.async (`vector=False`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import tessera as ts
from tessera import f32
from tessera.errors import UnsupportedError
from tessera.ir import dtypes
from tessera.ir.dtypes import DataType
from tessera.ir.fragments import LDMATRIX_X4, LDMATRIX_X4_NK, MMA_M16N8K16_C
from tessera.ir.mapping import repeat, spatial
from tessera.ir.types import Swizzle
from tessera.target import SM90, Architecture, Target

LAYOUTS = ("kn", "nk")


@dataclass(frozen=True)
class GemmConfig:
    """One point of the schedule space: tiles, pipeline depth and split-k."""

    block_m: int
    block_n: int
    block_k: int
    warp_m: int
    warp_n: int
    stages: int
    split_k: int = 1

    @property
    def warps(self) -> int:
        return (self.block_m // self.warp_m) * (self.block_n // self.warp_n)

    @property
    def threads(self) -> int:
        return self.warps * 32

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        return self.stages * (self.block_m + self.block_n) * self.block_k * elem_bytes

    def problems(self, target: Target | Architecture = SM90) -> list[str]:
        """Why this configuration cannot be built for `target` (empty when it can)."""
        out = []
        bm, bn, bk, wm, wn = self.block_m, self.block_n, self.block_k, self.warp_m, self.warp_n
        if wm % 16 or wn % 16 or bm % wm or bn % wn:
            out.append("warp tiles must be multiples of 16 that divide the block tile")
        if bk % 16 or bk < 16:
            out.append("block_k must be a multiple of 16")
        if not 1 <= self.warps <= 16:
            out.append(f"{self.warps} warps per block (1..16 allowed)")
        if self.stages < 2:
            out.append("a pipeline needs at least 2 stages")
        if self.split_k < 1:
            out.append("split_k must be >= 1")
        if self.smem_bytes() > target.smem_per_block:
            out.append(f"{self.smem_bytes()} bytes of shared memory ({target.smem_per_block // 1024} KiB max)")
        for rows, cols in ((bm, bk), (bk, bn), (bn, bk)):  # every tile splits evenly into 16 B chunks
            try:
                _copy_map(rows, cols, self.threads, 8)
            except ValueError as exc:
                out.append(str(exc))
                break
        if (wm // 16) * (wn // 8) * 4 > 128:
            out.append("more than 128 accumulator registers per thread")
        return out

    def __str__(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}_w{self.warp_m}x{self.warp_n}"
                f"_s{self.stages}_k{self.split_k}")  # fmt: skip


def _swizzle_for(cols: int) -> Swizzle:
    """XOR swizzle of 16-byte chunks for a shared tile whose rows hold `cols` 16-bit elements.

    Eight consecutive rows read at the same column then fall in eight different 16-byte bank
    groups (ldmatrix reads 8 rows of 16 bytes per matrix).
    """
    chunks = cols // 8
    log_chunks = chunks.bit_length() - 1
    return Swizzle(bits=min(3, log_chunks), base=3, shift=max(3, log_chunks))


def _copy_map(rows: int, cols: int, threads: int, elems: int) -> ts.TaskMapping:
    """(row, column group) tasks of a rows x cols tile, `elems` columns per task, over threads."""
    per_row = cols // elems
    lanes = min(per_row, threads)
    spatial_rows = threads // lanes
    if per_row % lanes or threads % lanes or rows % spatial_rows:
        raise ValueError(f"a {rows}x{cols} tile does not split evenly over {threads} threads")
    return repeat(rows // spatial_rows, per_row // lanes) * spatial(spatial_rows, lanes)


def make_gemm(dtype: DataType, config: GemmConfig, b_layout: str = "kn", vector: bool = True) -> ts.Kernel:
    """The kernel for one configuration; call it as kernel(A, B, C, split_k).

    With split_k == 1 it writes `dtype` results into C [batch, M, N]; otherwise float32
    partials into C [batch * split_k, M, N] (see make_split_k_reduce).  split_k is a run-time
    argument, so one compiled kernel serves every split factor of a tile configuration.
    """
    return _make_gemm(dtype, replace(config, split_k=1), b_layout, vector, config.split_k > 1)


@functools.cache
def _make_gemm(dtype: DataType, config: GemmConfig, b_layout: str, vector: bool, partial: bool) -> ts.Kernel:
    if dtype not in (dtypes.float16, dtypes.bfloat16):
        raise UnsupportedError(f"the tensor-core GEMM takes float16 or bfloat16, not {dtype}")
    if b_layout not in LAYOUTS:
        raise UnsupportedError(f"b_layout must be one of {LAYOUTS}, got {b_layout!r}")
    problems = config.problems()
    if problems:
        raise UnsupportedError(f"GEMM config {config}: {'; '.join(problems)}")
    T = dtype
    BM, BN, BK, WM, WN, STAGES = (config.block_m, config.block_n, config.block_k, config.warp_m,
                                  config.warp_n, config.stages)  # fmt: skip
    WARPS_N = BN // WN
    THREADS = config.threads
    MI, NI, KI = WM // 16, WN // 8, BK // 16
    KN = b_layout == "kn"
    OUT = f32 if partial else T
    V = 8 if vector else 1  # elements per copy task
    A_LOAD = _copy_map(BM, BK, THREADS, V)
    B_ROWS, B_COLS = (BK, BN) if KN else (BN, BK)
    B_LOAD = _copy_map(B_ROWS, B_COLS, THREADS, V)
    SWZ_A, SWZ_B = _swizzle_for(BK), _swizzle_for(B_COLS)
    B_SHAPE = ("batch", "K", "N") if KN else ("batch", "N", "K")
    tile = str(config).rsplit("_k", 1)[0]
    name = f"gemm_{T.short}_{b_layout}_{tile}{'_partial' if partial else ''}{'' if vector else '_scalar'}"

    @ts.kernel(target="cuda", name=name)
    def gemm(A: T["batch", "M", "K"], B: T[B_SHAPE], C: OUT["zdim", "M", "N"], split: ts.int32):
        ts.attrs.grid = (ts.ceil_div(N, BN), ts.ceil_div(M, BM), batch * split)
        ts.attrs.block = THREADS
        As = ts.shared_tensor(T, [STAGES, BM, BK], swizzle=SWZ_A)
        Bs = ts.shared_tensor(T, [STAGES, B_ROWS, B_COLS], swizzle=SWZ_B)
        acc = ts.register_tensor(f32, [MI, NI, 4])
        af = ts.register_tensor(T, [MI, 8])
        bf = ts.register_tensor(T, [NI, 4])
        tid = ts.thread_idx.x
        lane = tid % 32
        wm = (tid // 32) // WARPS_N
        wn = (tid // 32) % WARPS_N
        z = ts.block_idx.z
        bi = z // split
        m0 = ts.block_idx.y * BM
        n0 = ts.block_idx.x * BN
        k_tiles = ts.ceil_div(K, BK)
        per_split = ts.ceil_div(k_tiles, split)
        kt0 = (z % split) * per_split
        num_k = max(min(per_split, k_tiles - kt0), 0)
        for mi in ts.unroll(MI):
            for ni in ts.unroll(NI):
                for e in ts.unroll(4):
                    acc[mi, ni, e] = 0.0
        # Iteration `it` loads k-tile it + STAGES - 1 and multiplies k-tile it; the first
        # STAGES - 1 iterations (it < 0) only fill the pipeline.
        for it in range(1 - STAGES, num_k):
            if it >= 0:
                ts.copy_async_wait(STAGES - 2)  # k-tile `it` has landed
                ts.syncthreads()  # ... for every thread, and everyone is done with k-tile it - 1
            lt = it + STAGES - 1
            if lt < num_k:
                ls = lt % STAGES
                k0 = (kt0 + lt) * BK
                for r, c in A_LOAD.on(tid):
                    gm = m0 + r
                    gk = k0 + c * V
                    ok = gm < M and gk < K
                    if vector:
                        ts.copy_async(As[ls, r, c * V], A[bi, ts.select(ok, gm, 0), ts.select(ok, gk, 0)], 16, ok)
                    else:
                        As[ls, r, c] = ts.select(ok, A[bi, ts.select(ok, gm, 0), ts.select(ok, gk, 0)], 0.0)
                for r, c in B_LOAD.on(tid):
                    gr = (k0 if KN else n0) + r
                    gc = (n0 if KN else k0) + c * V
                    ok = gr < (K if KN else N) and gc < (N if KN else K)
                    if vector:
                        ts.copy_async(Bs[ls, r, c * V], B[bi, ts.select(ok, gr, 0), ts.select(ok, gc, 0)], 16, ok)
                    else:
                        Bs[ls, r, c] = ts.select(ok, B[bi, ts.select(ok, gr, 0), ts.select(ok, gc, 0)], 0.0)
            ts.copy_async_commit()
            if it >= 0:
                cs = it % STAGES
                for kk in ts.unroll(KI):
                    for mi in ts.unroll(MI):
                        for r, c in LDMATRIX_X4.on(lane):
                            ts.ldmatrix(af[mi, 0], As[cs, wm * WM + mi * 16 + r, kk * 16 + c * 8])
                    for nj in ts.unroll(NI // 2):
                        if KN:
                            for r, c in LDMATRIX_X4.on(lane):
                                ts.ldmatrix(bf[nj * 2, 0], Bs[cs, kk * 16 + r, wn * WN + nj * 16 + c * 8], trans=True)
                        else:
                            for r, c in LDMATRIX_X4_NK.on(lane):
                                ts.ldmatrix(bf[nj * 2, 0], Bs[cs, wn * WN + nj * 16 + r, kk * 16 + c * 8])
                    for mi in ts.unroll(MI):
                        for ni in ts.unroll(NI):
                            ts.mma(acc[mi, ni, 0], af[mi, 0], bf[ni, 0])
        ts.copy_async_wait(0)
        for mi in ts.unroll(MI):
            for ni in ts.unroll(NI):
                for e, (r, c) in enumerate(MMA_M16N8K16_C.on(lane)):
                    gm = m0 + wm * WM + mi * 16 + r
                    gn = n0 + wn * WN + ni * 8 + c
                    if gm < M and gn < N:
                        C[z, gm, gn] = acc[mi, ni, e]

    return gemm


@functools.cache
def make_split_k_reduce(dtype: DataType, split_k: int, threads: int = 256) -> ts.Kernel:
    """C[b, m, n] = sum over s of W[b * split_k + s, m, n], rounded to `dtype` once."""

    @ts.kernel(target="cuda", name=f"split_k_reduce_{dtype.short}_{split_k}")
    def split_k_reduce(W: f32["zdim", "M", "N"], C: dtype["batch", "M", "N"]):
        ts.attrs.grid = ts.ceil_div(batch * M * N, threads)
        ts.attrs.block = threads
        i = ts.block_idx.x * threads + ts.thread_idx.x
        if i < batch * M * N:
            b = i // (M * N)
            m = (i // N) % M
            n = i % N
            total = 0.0
            for s in ts.unroll(split_k):
                total += W[b * split_k + s, m, n]
            C[b, m, n] = total

    return split_k_reduce
