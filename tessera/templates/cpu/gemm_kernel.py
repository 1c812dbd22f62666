"""float32 GEMM for x86 CPUs in tessera's kernel language: a register-tiled FMA micro-kernel.

C[b, m, n] = sum_k A[b, m, k] * B[b, k, n], written with the SIMD vector intrinsics
(tessera.ir.vector), compiled to AVX-512 or AVX2 by the C backend.

* Work is split into MR x NR output tiles (NR = NV vectors of `lanes` floats); the tiles of one
  batch are ordered column panel by column panel, and OpenMP hands each thread a contiguous
  range of them, so a thread walks down one panel of B while it stays in its L2 cache
  (`panel_major`: all batches of one panel come first, for a B shared by the batches).
* The micro-kernel keeps the MR x NV accumulator vectors in registers for the whole K
  loop: per k it loads NV vectors of B, broadcasts MR scalars of A and issues MR x NV FMAs.
  The whole K extent stays in registers, so the result leaves the registers once, and the
  store is the only place an epilogue has to go (tessera.templates.cpu.gemm fuses it there).
* B is either read in place ([batch, K, N], row k of the tile is NR contiguous floats; the
  last column tile reads only its valid columns, with masked loads) or from packed panels
  ([batch, ceil(N/NR), K, NR], zero padded: `make_pack_b`), which are contiguous for the
  whole K loop (no cache-set conflicts between rows, no masks).  Packing pays when each
  panel is reused by many row tiles, and once and for all for constant weights.
* Rows past M (the last row tile) read row M-1 again and are never stored: the hot loop
  has no bounds test.  The store loop runs over the valid rows and columns only.  With
  `full_rows` (M >= MR, which the caller guarantees) the last row tile is shifted back to end
  at row M instead and stores only the rows the tile before it did not: the rows of A a tile
  reads are then i0 + r, without a clamp, so an operand whose row address is linear in the row
  (a convolution's pixels along one output row) is one base register plus constant offsets
  rather than MR registers (which spill on x86-64's 16).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import tessera as ts
from tessera import f32
from tessera.errors import ArgumentError
from tessera.ir.vector import vector_type


@dataclass(frozen=True)
class CpuGemmConfig:
    """One point of the CPU GEMM schedule space."""

    mr: int  # rows of the register tile
    nv: int  # vectors per row of the register tile (NR = nv * lanes columns)
    lanes: int  # float32 lanes of a vector: 16 (AVX-512) or 8 (AVX2)
    threads: int  # OpenMP workers

    def __post_init__(self) -> None:
        if self.lanes not in (8, 16):
            raise ArgumentError(f"CpuGemmConfig: lanes must be 8 or 16, got {self.lanes}")
        regs = 32 if self.lanes == 16 else 16
        if not 1 <= self.mr or not 1 <= self.nv or self.mr * self.nv + self.nv + 1 > regs:
            raise ArgumentError(f"CpuGemmConfig: a {self.mr} x {self.nv} register tile needs "
                                f"{self.mr * self.nv + self.nv + 1} vector registers, more than the {regs} there are")  # fmt: skip
        if not 1 <= self.threads <= 1024:
            raise ArgumentError(f"CpuGemmConfig: threads must be in 1..1024, got {self.threads}")

    @property
    def nr(self) -> int:
        return self.nv * self.lanes

    def __str__(self) -> str:
        return f"{self.mr}x{self.nr}_t{self.threads}"


B_SOURCES = ("kn", "nk", "packed")


@functools.cache
def make_gemm(cfg: CpuGemmConfig, b_source: str = "kn", full_rows: bool = False,
              panel_major: bool = False):  # -> tessera.Kernel  # fmt: skip
    """The GEMM kernel of one configuration (`full_rows`: M >= MR, see the module's docstring).
    Work units are (batch, column panel, row chunk) in that order, so workers split the batches;
    `panel_major` orders them (column panel, batch, row chunk) instead, so workers split the
    columns: each then reads half of a B that every batch shares rather than all of it.

    Parameters: A [batch, M, K]; B as `b_source` says: "kn" [batch, K, N], "nk" [batch, N, K]
    (a linear layer's weight), or "packed" [batch, NP, K, NR] panels from `make_pack_b`
    (NP = ceil(N / NR)); C [batch, M, N]; then, unless B is packed, a workspace
    W [threads, K * NR] where each worker packs the panel it works on; and RC, the number of
    row chunks each panel's rows are split into (more work units than workers for small N).
    """

    if b_source not in B_SOURCES:
        raise ArgumentError(f"make_gemm: b_source must be one of {B_SOURCES}, got {b_source!r}")
    mr, nv, lanes, nr, T = cfg.mr, cfg.nv, cfg.lanes, cfg.nr, cfg.threads
    vt = vector_type(f32, lanes)
    rows, vecs = tuple(range(mr)), tuple(range(nv))
    suffix = ("_full" if full_rows else "") + ("_pm" if panel_major else "")

    if b_source == "packed":

        @ts.kernel(target="cpu", name=f"gemm_f32_{cfg}_packed{suffix}")
        def gemm_packed(A: f32["batch", "M", "K"], B: f32["batch", "NP", "K", "NR"], C: f32["batch", "M", "N"], RC: ts.int32):
            tiles_m = ts.ceil_div(M, mr)
            chunk = ts.ceil_div(tiles_m, RC)
            units = batch * NP * RC
            per = ts.ceil_div(units, T)
            for w in ts.parallel(T):
                for u in range(w * per, min(units, w * per + per)):
                    bi = u // RC % batch if panel_major else u // (NP * RC)
                    jt = u // (batch * RC) if panel_major else u // RC % NP
                    j0 = jt * nr
                    for it in range(u % RC * chunk, min(tiles_m, u % RC * chunk + chunk)):
                        i0 = it * mr
                        if full_rows:
                            i0 = min(i0, M - mr)
                        acc = ts.register_tensor(vt, [mr, nv])
                        bv = ts.register_tensor(vt, [nv])
                        for r in rows:
                            for c in vecs:
                                acc[r, c] = ts.vbroadcast(0.0, lanes)
                        for k in range(K):
                            for c in vecs:
                                bv[c] = ts.vload(B[bi, jt, k, c * lanes], lanes)
                            for r in rows:
                                a = ts.vbroadcast(A[bi, i0 + r if full_rows else min(i0 + r, M - 1), k], lanes)
                                for c in vecs:
                                    acc[r, c] = ts.vfma(a, bv[c], acc[r, c])
                        tile = ts.register_tensor(f32, [mr, nr])
                        for r in rows:
                            for c in vecs:
                                ts.vstore(tile[r, c * lanes], acc[r, c])
                        for r in range(it * mr - i0, min(mr, M - i0)):
                            for j in range(min(nr, N - j0)):
                                C[bi, i0 + r, j0 + j] = tile[r, j]

        return gemm_packed

    nk = b_source == "nk"

    @ts.kernel(target="cpu", name=f"gemm_f32_{cfg}_{b_source}{suffix}")
    def gemm(A: f32["batch", "M", "K"], B: f32["batch", "BR", "BC"], C: f32["batch", "M", "N"], W: f32["WT", "KNR"],
             RC: ts.int32):
        tiles_m = ts.ceil_div(M, mr)
        tiles_n = ts.ceil_div(N, nr)
        chunk = ts.ceil_div(tiles_m, RC)
        units = batch * tiles_n * RC
        per = ts.ceil_div(units, T)
        for w in ts.parallel(T):
            for u in range(w * per, min(units, w * per + per)):
                bi = u // RC % batch if panel_major else u // (tiles_n * RC)
                j0 = (u // (batch * RC) if panel_major else u // RC % tiles_n) * nr
                cols = min(nr, N - j0)
                # Pack this unit's NR-wide panel of B into the worker's slot: contiguous for the K loop.
                if nk:
                    for j in range(cols):
                        for k in range(K):
                            W[w, k * nr + j] = B[bi, j0 + j, k]
                else:
                    for k in range(K):
                        for j in range(cols):
                            W[w, k * nr + j] = B[bi, k, j0 + j]
                for k in range(K):
                    for j in range(cols, nr):
                        W[w, k * nr + j] = 0.0
                for it in range(u % RC * chunk, min(tiles_m, u % RC * chunk + chunk)):
                    i0 = it * mr
                    if full_rows:
                        i0 = min(i0, M - mr)
                    acc = ts.register_tensor(vt, [mr, nv])
                    bv = ts.register_tensor(vt, [nv])
                    for r in rows:
                        for c in vecs:
                            acc[r, c] = ts.vbroadcast(0.0, lanes)
                    for k in range(K):
                        for c in vecs:
                            bv[c] = ts.vload(W[w, k * nr + c * lanes], lanes)
                        for r in rows:
                            a = ts.vbroadcast(A[bi, i0 + r if full_rows else min(i0 + r, M - 1), k], lanes)
                            for c in vecs:
                                acc[r, c] = ts.vfma(a, bv[c], acc[r, c])
                    tile = ts.register_tensor(f32, [mr, nr])
                    for r in rows:
                        for c in vecs:
                            ts.vstore(tile[r, c * lanes], acc[r, c])
                    for r in range(it * mr - i0, min(mr, M - i0)):
                        for j in range(cols):
                            C[bi, i0 + r, j0 + j] = tile[r, j]

    return gemm


@functools.cache
def make_pack_b(nr: int, layout: str):
    """Pack B into zero-padded NR-wide panels: P[b, p, k, j] = B[b, k, p*NR + j] ("kn") or
    B[b, p*NR + j, k] ("nk"), 0 past N.  Parameters: B, P [batch, NP, K, NR]."""

    if layout not in ("kn", "nk"):
        raise ArgumentError(f"make_pack_b: layout must be 'kn' or 'nk', got {layout!r}")
    if layout == "kn":

        @ts.kernel(target="cpu", name=f"pack_b_kn_{nr}")
        def pack_kn(B: f32["batch", "K", "N"], P: f32["batch", "NP", "K", "NR"]):
            for t in ts.parallel(batch * NP):
                bi = t // NP
                j0 = t % NP * nr
                cols = min(nr, N - j0)
                for k in range(K):
                    for j in range(cols):
                        P[bi, t % NP, k, j] = B[bi, k, j0 + j]
                    for j in range(cols, nr):
                        P[bi, t % NP, k, j] = 0.0

        return pack_kn

    @ts.kernel(target="cpu", name=f"pack_b_nk_{nr}")
    def pack_nk(B: f32["batch", "N", "K"], P: f32["batch", "NP", "K", "NR"]):
        for t in ts.parallel(batch * NP):
            bi = t // NP
            j0 = t % NP * nr
            cols = min(nr, N - j0)
            for j in range(cols):
                for k in range(K):
                    P[bi, t % NP, k, j] = B[bi, j0 + j, k]
            for j in range(cols, nr):
                for k in range(K):
                    P[bi, t % NP, k, j] = 0.0

    return pack_nk
