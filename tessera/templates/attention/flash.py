"""Flash attention for SM90 written in tessera: TMA loads, wgmma, warp specialisation, online softmax.

out = softmax(q @ k^T * scale [causal] [mask]) @ v for q [B, H, Sq, D], k and v [B, Hk, Sk, D]
(H a multiple of Hk: query head h reads key/value head h // (H / Hk)), fp16 or bf16, head
dims 64, 80, 96 and 128.  The scores never reach global memory.

Rows: the H / Hk query heads that share a key/value head are packed with their Sq queries
into R = (H / Hk) * Sq rows of one (batch, kv head) problem g (FlashAttention's "pack GQA"):
[B, H, Sq, D] read as [B * Hk, R, D] is the same memory, so one TMA box covers them, and a
decode step (Sq = 1) of a grouped model fills the rows of a tile with its heads.

Per thread block (grid: row tiles x B * Hk x KV splits):
* warpgroup 0 is the producer: one thread TMA-loads the block's Q tile once and then K and V
  blocks of `block_n` keys into a `stages`-deep ring, with one `full` mbarrier each for K and V
  (the scores can start before V has landed) and an `empty` one per stage;
* warpgroups 1..consumers own 64 rows each: S = Q K^T with m64n{block_n}k16 wgmmas from shared
  memory, masks (key tail, causal, the mask operand) only on the blocks that need them, the
  online softmax in base 2 (one FMA feeds each exp2), P converted to 16 bits in registers and
  fed to O += P V as the A operand of register-sourced wgmmas (the accumulator's m64n16 slices
  are exactly wgmma's A fragments), V read MN-major through the descriptor's transpose bit;
* with two consumer warpgroups one's softmax overlaps the other's matmuls.
Head dims 80 and 96 are read as two 64-column chunks (TMA fills the columns past D with
zeros); Q K^T runs only over D's 16-column steps, P V over the 128 padded columns.

Causal is top-left aligned (key j visible to query i when j <= i, torch's is_causal); blocks
past a tile's last visible key are skipped.  A bool mask keeps True entries, a float mask is
added to the scaled scores; both broadcast from any of [B, H, Sq, Sk]'s dimensions.  A fully
masked row is 0/0 = NaN, as the reference (and torch's math backend) gives.

Split-KV (`partial`): the blocks of keys of a problem are shared among grid.z thread blocks,
each writing its rows' float32 output, normalised by its own sum, and the base-2 log-sum-exp
(-inf where it saw no visible key); `make_attention_combine` merges them.  This is the decode
variant: a few rows against a long cache fill the machine only when the cache is split.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import tessera as ts
from tessera import f32, i32, u64
from tessera.errors import UnsupportedError
from tessera.ir import dtypes
from tessera.ir.dtypes import DataType
from tessera.ir.types import Swizzle
from tessera.target import SM90, Architecture, Target

SWIZZLE_128B = Swizzle(3, 3, 3)
HEAD_DIMS = (64, 80, 96, 128)
LOG2E = math.log2(math.e)
MASK_DTYPES = (dtypes.boolean, dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64)


@dataclass(frozen=True)
class FlashConfig:
    """Rows per block (64 x consumers), keys per block, pipeline stages."""

    consumers: int = 2
    block_n: int = 128
    stages: int = 2
    # Issue block j's Q K^T and block j-1's P V together, and run j's softmax while P V runs
    # (FlashAttention-3's intra-warpgroup overlap).
    overlap: bool = True
    # Two consumer warpgroups take turns issuing their matmuls (named barriers), so one's
    # softmax runs while the other's matmuls do (FlashAttention-3's ping-pong); it applies only
    # with two consumers and overlap (`turns`).
    pingpong: bool = True

    @property
    def turns(self) -> bool:
        return self.pingpong and self.overlap and self.consumers == 2

    @property
    def block_m(self) -> int:
        return 64 * self.consumers

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    def smem_bytes(self, head_dim: int) -> int:
        chunks = padded_dim(head_dim) // 64
        q = self.block_m * 64 * 2 * chunks
        kv = 2 * self.stages * self.block_n * 64 * 2 * chunks
        return q + kv + 5 * 1024  # + the five barrier arrays, 1 KiB aligned each

    def problems(self, head_dim: int = 128, target: Target | Architecture = SM90) -> list[str]:
        """Why this configuration cannot be built (empty when it can)."""
        out = []
        if self.consumers not in (1, 2):
            out.append("consumers must be 1 or 2 warpgroups")
        if self.block_n not in (64, 128):  # (the sizes checked on the GPU; wgmma would take 176, 192)
            out.append("block_n must be 64 or 128 keys")
        if self.stages < 2:
            out.append("a pipeline needs at least 2 stages")
        if head_dim in HEAD_DIMS and self.smem_bytes(head_dim) > target.smem_per_block:
            out.append(f"{self.smem_bytes(head_dim)} bytes of shared memory ({target.smem_per_block // 1024} KiB max)")
        if head_dim in HEAD_DIMS and self.block_n // 2 + padded_dim(head_dim) // 2 > 160:
            out.append("more than 160 accumulator registers per consumer thread")
        return out

    def __str__(self) -> str:
        return f"fa_{self.block_m}x{self.block_n}_s{self.stages}{'_o' if self.overlap else ''}{'_pp' if self.turns else ''}"


@dataclass(frozen=True)
class MaskSpec:
    """The mask operand: its dtype and which of [B, H, Sq, Sk] it spans (right-aligned rank)."""

    dtype: DataType
    full: tuple[bool, ...]  # one per mask dimension: True where it has the full size, False where 1

    @property
    def rank(self) -> int:
        return len(self.full)


def padded_dim(head_dim: int) -> int:
    """Columns of the shared tiles and of P V: D rounded up to whole 64-column chunks."""
    return -(-head_dim // 64) * 64


def tensor_map_box(config: FlashConfig, which: str) -> tuple[int, int, int]:
    """The TMA box over [B * H(k), rows, D] for "q" or for "k" / "v"."""
    return (1, config.block_m if which == "q" else config.block_n, 64)


def check_problem(dtype: DataType, head_dim: int, config: FlashConfig, mask: MaskSpec | None) -> None:
    if dtype not in (dtypes.float16, dtypes.bfloat16):
        raise UnsupportedError(f"flash attention takes float16 or bfloat16, not {dtype}")
    if head_dim not in HEAD_DIMS:
        raise UnsupportedError(f"flash attention takes head dims {HEAD_DIMS}, not {head_dim}")
    problems = config.problems(head_dim)
    if problems:
        raise UnsupportedError(f"flash attention config {config}: {'; '.join(problems)}")
    if mask is not None and (mask.dtype not in MASK_DTYPES or not 1 <= mask.rank <= 4):
        raise UnsupportedError(f"flash attention masks are bool or float of rank 1..4, got {mask}")


def make_flash_attention(dtype: DataType, head_dim: int, config: FlashConfig = FlashConfig(), *, causal: bool = False,
                         mask: MaskSpec | None = None, partial: bool = False, fold_scale: bool = False,
                         heads_last: bool = False) -> ts.Kernel:  # fmt: skip
    """kernel(Q, K, V, [M,] O or (O_part, LSE), tma_q, tma_k, tma_v, scale_log2, splits).

    Q [B, H, Sq, D], K and V [B, Hk, Sk, D]; the tensor maps view them as [B * H(k), rows, D]
    with the boxes of `tensor_map_box`.  Not partial: O [B, H, Sq, D] in `dtype`, grid.z = 1.
    Partial: O_part float32 [splits * B * Hk, R, D] and LSE float32 [splits * B * Hk, R]
    (R = H / Hk * Sq), combined by `make_attention_combine`.  scale_log2 = scale * log2(e).

    `fold_scale` (only for scale > 0 and no float mask) folds the scale into the exponent's
    FMA instead of scaling every score first: the row maximum of the raw scores times a
    positive scale is the maximum of the scaled ones.

    `heads_last` (not partial) writes O as [B, Sq, H, D] instead: the layout the heads merge
    into before the output projection ([B, Sq, H * D]), so no transpose copy follows."""
    check_problem(dtype, head_dim, config, mask)
    if heads_last and partial:
        raise UnsupportedError("heads_last applies to the output O; a partial kernel writes O_part (the combine takes it)")
    if fold_scale and mask is not None and mask.dtype != dtypes.boolean:
        raise UnsupportedError("fold_scale needs the scores unscaled: it does not combine with a float mask")
    return _make(dtype, head_dim, config, causal, mask, partial, fold_scale, heads_last)


@functools.cache
def _make(dtype: DataType, head_dim: int, config: FlashConfig, causal: bool, mask: MaskSpec | None,
          partial: bool, fold: bool, heads_last: bool = False) -> ts.Kernel:  # fmt: skip
    T, D, DP = dtype, head_dim, padded_dim(head_dim)
    NCH = DP // 64  # 64-column chunks of the Q, K and V tiles
    KSTEPS = D // 16  # k16 steps of Q K^T
    BM, BN, STAGES, CONSUMERS = config.block_m, config.block_n, config.stages, config.consumers
    Q_BYTES, KV_BYTES = BM * 64 * 2 * NCH, BN * 64 * 2 * NCH
    REGS = (40, 232) if CONSUMERS == 2 else (0, 0)
    OVERLAP, PINGPONG = config.overlap, config.turns
    CAUSAL, HAS_MASK = causal, mask is not None
    MT = mask.dtype if HAS_MASK else dtypes.boolean
    BOOL_MASK = HAS_MASK and MT == dtypes.boolean
    MRANK = mask.rank if HAS_MASK else 4
    # The mask's index of (b, h, q, key): a dimension of size 1 is indexed by 0 (x * 0).
    MFULL = tuple(int(f) for f in ((False,) * (4 - MRANK) + mask.full)) if HAS_MASK else (1, 1, 1, 1)
    M_SHAPE = tuple(s if f else 1 for s, f in zip(("B", "H", "SQ", "SK"), MFULL))[4 - MRANK:] if HAS_MASK else (1,)
    NEG_INF = float("-inf")
    OUT_T = f32 if partial else T
    O_SHAPE = ("Z", "RP", D) if partial else ("B", "SQ", "H", D) if heads_last else ("B", "H", "SQ", D)  # RP = R
    L_SHAPE = ("Z", "RP") if partial else (1,)
    TQ = ts.tensor_map(T, tensor_map_box(config, "q"))
    TK = ts.tensor_map(T, tensor_map_box(config, "k"))
    mname = "" if not HAS_MASK else f"_m{'b' if BOOL_MASK else MT.short}{''.join(str(f) for f in MFULL[4 - MRANK:])}"
    name = f"flash_attention_{T.short}_d{D}_{config}{'_causal' if causal else ''}{mname}{'_split' if partial else ''}{'_fs' if fold else ''}{'_bshd' if heads_last else ''}"

    @ts.kernel(target="cuda", name=name)
    def flash(Q: T["B", "H", "SQ", D], K: T["B", "HK", "SK", D], V: T["B", "HK", "SK", D], M: MT[M_SHAPE],
              Out: OUT_T[O_SHAPE], L: f32[L_SHAPE], tma_q: TQ, tma_k: TK, tma_v: TK, scale_log2: f32,
              splits: i32):  # fmt: skip
        ts.attrs.grid = (ts.ceil_div(H // HK * SQ, BM), B * HK, splits)
        GRP = H // HK
        R = GRP * SQ
        ts.attrs.block = 128 * (CONSUMERS + 1)
        ts.attrs.min_blocks = 1
        Qs = ts.shared_tensor(T, [NCH, BM, 64], swizzle=SWIZZLE_128B)
        Ks = ts.shared_tensor(T, [STAGES, NCH, BN, 64], swizzle=SWIZZLE_128B)
        Vs = ts.shared_tensor(T, [STAGES, NCH, BN, 64], swizzle=SWIZZLE_128B)
        qbar = ts.shared_tensor(u64, [1])
        kfull = ts.shared_tensor(u64, [STAGES])
        vfull = ts.shared_tensor(u64, [STAGES])
        kempty = ts.shared_tensor(u64, [STAGES])  # K and V are released apart: K once Q K^T is done
        vempty = ts.shared_tensor(u64, [STAGES])
        tid = ts.thread_idx.x
        wg = tid // 128
        if tid == 0:
            ts.mbarrier_init(qbar[0], 1)
            for s in range(STAGES):
                ts.mbarrier_init(kfull[s], 1)
                ts.mbarrier_init(vfull[s], 1)
                ts.mbarrier_init(kempty[s], CONSUMERS)
                ts.mbarrier_init(vempty[s], CONSUMERS)
            ts.fence_mbarrier_init()
        ts.syncthreads()
        g = ts.block_idx.y  # (batch, kv head)
        # Causal tiles further down see more keys: launch them first (the long ones start early).
        rt0 = (ts.grid_dim.x - 1 - ts.block_idx.x) * BM if CAUSAL else ts.block_idx.x * BM
        # The tile's queries: with rows of two heads (or a whole head) in one tile, all of 0..Sq-1.
        r_last = min(rt0 + BM, R) - 1
        cross = rt0 // SQ != r_last // SQ
        q_max = SQ - 1 if cross else r_last % SQ
        q_min = 0 if cross else rt0 % SQ
        n_blocks = ts.ceil_div(SK, BN)
        if CAUSAL:
            n_blocks = min(n_blocks, q_max // BN + 1)
        per_split = ts.ceil_div(n_blocks, splits)
        j0 = ts.block_idx.z * per_split
        j1 = min(n_blocks, j0 + per_split)
        stage = 0
        phase = 0
        if wg == 0:
            if REGS[0]:
                ts.setmaxnreg(REGS[0], False)
            if tid == 0:
                ts.mbarrier_arrive_expect_tx(qbar[0], Q_BYTES)
                for c in range(NCH):
                    ts.tma_load(Qs[c, 0, 0], tma_q, qbar[0], g, rt0, c * 64)
                for j in range(j0, j1):
                    ts.mbarrier_wait(kempty[stage], phase ^ 1)
                    ts.mbarrier_arrive_expect_tx(kfull[stage], KV_BYTES)
                    for c in range(NCH):
                        ts.tma_load(Ks[stage, c, 0, 0], tma_k, kfull[stage], g, j * BN, c * 64)
                    ts.mbarrier_wait(vempty[stage], phase ^ 1)
                    ts.mbarrier_arrive_expect_tx(vfull[stage], KV_BYTES)
                    for c in range(NCH):
                        ts.tma_load(Vs[stage, c, 0, 0], tma_v, vfull[stage], g, j * BN, c * 64)
                    stage += 1
                    if stage == STAGES:
                        stage = 0
                        phase ^= 1
        else:
            if REGS[1]:
                ts.setmaxnreg(REGS[1], True)
            lane = tid % 128
            row0 = (wg - 1) * 64
            quad = lane % 4
            # This thread's two rows (of its warp's 16): r_a and r_a + 8, as packed rows, their
            # query index and query head (clamped into range for the mask's reads).
            ra = rt0 + row0 + (lane // 32) * 16 + (lane % 32) // 4
            rb = ra + 8
            rca = min(ra, R - 1)
            rcb = min(rb, R - 1)
            qa = rca % SQ
            qb = rcb % SQ
            bat = g // HK
            ha = (g % HK) * GRP + rca // SQ
            hb = (g % HK) * GRP + rcb // SQ
            acc_s = ts.register_tensor(f32, [BN // 2])
            acc_o = ts.register_tensor(f32, [DP // 2])
            p = ts.register_tensor(T, [BN // 2])
            for e in ts.unroll(DP // 2):
                acc_o[e] = 0.0
            m_a = NEG_INF
            m_b = NEG_INF
            l_a = 0.0
            l_b = 0.0
            ts.mbarrier_wait(qbar[0], 0)
            pstage = 0  # the previous block's stage and phase (its V feeds the overlapped P V)
            pphase = 0
            if PINGPONG and wg == 2:
                ts.named_barrier_arrive(1, 256)  # the first consumer takes the first turn
            # The first block is peeled off (FIRST): in the main loop every iteration issues
            # Q K^T of block j and P V of block j - 1 unconditionally, which keeps the wgmma
            # pipeline analysable for ptxas (no serialisation).
            for FIRST in (True, False):
                for j in range(j0 if FIRST else j0 + 1, min(j0 + 1, j1) if FIRST else j1):
                    n0 = j * BN
                    ts.mbarrier_wait(kfull[stage], phase)
                    if PINGPONG:
                        ts.named_barrier_sync(wg, 256)  # this warpgroup's turn to issue
                    for e in ts.unroll(BN // 2):
                        acc_s[e] = 0.0
                    ts.wgmma_fence()
                    for ks in ts.unroll(KSTEPS):
                        ts.wgmma(acc_s[0], Qs[ks // 4, row0, (ks % 4) * 16], Ks[stage, ks // 4, 0, (ks % 4) * 16], n=BN)
                    ts.wgmma_commit()
                    if OVERLAP and not FIRST:
                        ts.mbarrier_wait(vfull[pstage], pphase)
                        for kk in ts.unroll(BN // 16):
                            ts.wgmma(acc_o[0], p[kk * 8], Vs[pstage, 0, kk * 16, 0], n=DP, trans_b=True)
                        ts.wgmma_commit()
                    if PINGPONG:
                        ts.named_barrier_arrive(3 - wg, 256)  # the other warpgroup's turn
                    if OVERLAP and not FIRST:
                        ts.wgmma_wait(1)  # Q K^T is done; P V may still run
                    else:
                        ts.wgmma_wait(0)
                    if lane == 0:
                        ts.mbarrier_arrive(kempty[stage])
                    if not fold:
                        for e in ts.unroll(BN // 2):
                            acc_s[e] = acc_s[e] * scale_log2
                    if HAS_MASK or n0 + BN > SK or (CAUSAL and n0 + BN - 1 > q_min):
                        for e in ts.unroll(BN // 2):
                            col = n0 + (e // 4) * 8 + quad * 2 + e % 2
                            lower = (e % 4) < 2  # row a, else row b
                            q = qa if lower else qb
                            keep = col < SK
                            if CAUSAL:
                                keep = keep and col <= q
                            v = acc_s[e]
                            if HAS_MASK:
                                hh = ha if lower else hb
                                cc = min(col, SK - 1)
                                i0 = bat * MFULL[0]
                                i1 = hh * MFULL[1]
                                i2 = q * MFULL[2]
                                i3 = cc * MFULL[3]
                                mv = (M[i0, i1, i2, i3] if MRANK == 4 else M[i1, i2, i3] if MRANK == 3
                                      else M[i2, i3] if MRANK == 2 else M[i3])  # fmt: skip
                                if BOOL_MASK:
                                    keep = keep and mv
                                else:
                                    v = v + ts.cast(mv, f32) * LOG2E
                            acc_s[e] = ts.select(keep, v, NEG_INF)
                    # Online softmax: the quad of threads that share a row agree on its maximum.
                    # (fmax drops a NaN score from the maximum; its exp2 still poisons the row.)
                    mx_a = NEG_INF
                    mx_b = NEG_INF
                    for jj in ts.unroll(BN // 8):
                        mx_a = ts.fmax(mx_a, ts.fmax(acc_s[jj * 4], acc_s[jj * 4 + 1]))
                        mx_b = ts.fmax(mx_b, ts.fmax(acc_s[jj * 4 + 2], acc_s[jj * 4 + 3]))
                    mx_a = ts.fmax(mx_a, ts.shfl_xor(mx_a, ts.cast(1, i32)))
                    mx_a = ts.fmax(mx_a, ts.shfl_xor(mx_a, ts.cast(2, i32)))
                    mx_b = ts.fmax(mx_b, ts.shfl_xor(mx_b, ts.cast(1, i32)))
                    mx_b = ts.fmax(mx_b, ts.shfl_xor(mx_b, ts.cast(2, i32)))
                    if fold:  # the raw maximum, scaled (a positive scale keeps the order)
                        mx_a = mx_a * scale_log2
                        mx_b = mx_b * scale_log2
                    mx_a = ts.fmax(mx_a, m_a)
                    mx_b = ts.fmax(mx_b, m_b)
                    # A row with no visible key yet keeps max -inf; shift by 0 so exp2 gives 0, not NaN.
                    sh_a = ts.select(mx_a == NEG_INF, 0.0, mx_a)
                    sh_b = ts.select(mx_b == NEG_INF, 0.0, mx_b)
                    alpha_a = ts.fast_exp2(m_a - sh_a)
                    alpha_b = ts.fast_exp2(m_b - sh_b)
                    m_a = mx_a
                    m_b = mx_b
                    sum_a = 0.0
                    sum_b = 0.0
                    for jj in ts.unroll(BN // 8):
                        for k in ts.unroll(2):
                            if fold:  # one FMA feeds each exp2
                                acc_s[jj * 4 + k] = ts.fast_exp2(acc_s[jj * 4 + k] * scale_log2 - sh_a)
                                acc_s[jj * 4 + 2 + k] = ts.fast_exp2(acc_s[jj * 4 + 2 + k] * scale_log2 - sh_b)
                            else:
                                acc_s[jj * 4 + k] = ts.fast_exp2(acc_s[jj * 4 + k] - sh_a)
                                acc_s[jj * 4 + 2 + k] = ts.fast_exp2(acc_s[jj * 4 + 2 + k] - sh_b)
                            sum_a += acc_s[jj * 4 + k]
                            sum_b += acc_s[jj * 4 + 2 + k]
                    l_a = l_a * alpha_a + sum_a
                    l_b = l_b * alpha_b + sum_b
                    if OVERLAP and not FIRST:
                        ts.wgmma_wait(0)  # the previous block's P V: O and P are free again
                        if lane == 0:
                            ts.mbarrier_arrive(vempty[pstage])
                    for jj in ts.unroll(DP // 8):
                        for k in ts.unroll(2):
                            acc_o[jj * 4 + k] = acc_o[jj * 4 + k] * alpha_a
                            acc_o[jj * 4 + 2 + k] = acc_o[jj * 4 + 2 + k] * alpha_b
                    for e in ts.unroll(BN // 2):
                        p[e] = acc_s[e]
                    if not OVERLAP:
                        ts.mbarrier_wait(vfull[stage], phase)
                        ts.wgmma_fence()
                        for kk in ts.unroll(BN // 16):
                            ts.wgmma(acc_o[0], p[kk * 8], Vs[stage, 0, kk * 16, 0], n=DP, trans_b=True)
                        ts.wgmma_commit()
                        ts.wgmma_wait(0)
                        if lane == 0:
                            ts.mbarrier_arrive(vempty[stage])
                    pstage = stage
                    pphase = phase
                    stage += 1
                    if stage == STAGES:
                        stage = 0
                        phase ^= 1
            if OVERLAP:
                if j1 > j0:  # the last block's P V
                    ts.mbarrier_wait(vfull[pstage], pphase)
                    ts.wgmma_fence()
                    for kk in ts.unroll(BN // 16):
                        ts.wgmma(acc_o[0], p[kk * 8], Vs[pstage, 0, kk * 16, 0], n=DP, trans_b=True)
                    ts.wgmma_commit()
                    ts.wgmma_wait(0)
                    if lane == 0:
                        ts.mbarrier_arrive(vempty[pstage])
            l_a = l_a + ts.shfl_xor(l_a, ts.cast(1, i32))
            l_a = l_a + ts.shfl_xor(l_a, ts.cast(2, i32))
            l_b = l_b + ts.shfl_xor(l_b, ts.cast(1, i32))
            l_b = l_b + ts.shfl_xor(l_b, ts.cast(2, i32))
            inv_a = 0.0
            inv_b = 0.0
            if partial:
                # Normalised by this split's own sum (0 where it saw no visible key), and the
                # split's base-2 log-sum-exp for the combine.
                inv_a = ts.select(l_a > 0.0, 1.0 / l_a, 0.0)  # 0 where the split saw no visible key
                inv_b = ts.select(l_b > 0.0, 1.0 / l_b, 0.0)
                z = ts.block_idx.z * (B * HK) + g
                if quad == 0:
                    if ra < R:
                        L[z, ra] = ts.select(l_a > 0.0, ts.select(m_a == NEG_INF, 0.0, m_a) + ts.log2(l_a), NEG_INF)
                    if rb < R:
                        L[z, rb] = ts.select(l_b > 0.0, ts.select(m_b == NEG_INF, 0.0, m_b) + ts.log2(l_b), NEG_INF)
            else:
                inv_a = 1.0 / l_a  # 0 / 0 = NaN for a fully masked row, as the reference
                inv_b = 1.0 / l_b
            pair = ts.register_tensor(OUT_T, [2])
            for jj in ts.unroll(DP // 8):
                col = jj * 8 + quad * 2
                if col < D:
                    for half in ts.unroll(2):
                        r = ra + half * 8
                        if r < R:
                            inv = inv_a if half == 0 else inv_b
                            pair[0] = acc_o[jj * 4 + half * 2] * inv
                            pair[1] = acc_o[jj * 4 + half * 2 + 1] * inv
                            if partial:
                                ts.copy_vector(Out[ts.block_idx.z * (B * HK) + g, r, col], pair[0], 8)
                            elif heads_last:
                                ts.copy_vector(Out[bat, r % SQ, (g % HK) * GRP + r // SQ, col], pair[0], 4)
                            else:
                                ts.copy_vector(Out[bat, (g % HK) * GRP + r // SQ, r % SQ, col], pair[0], 4)

    return flash


@functools.cache
def make_attention_combine(dtype: DataType, head_dim: int, heads_last: bool = False) -> ts.Kernel:
    """kernel(O_part, LSE, O, splits): O [B, H, Sq, D] ([B, Sq, H, D] when heads_last) from the
    split-KV partials of make_flash_attention(partial=True): sum_s 2^(lse_s - max) O_s / sum_s 2^(lse_s - max)."""
    T, D = dtype, head_dim
    NEG_INF = float("-inf")
    O_SHAPE = ("B", "SQ", "H", D) if heads_last else ("B", "H", "SQ", D)

    @ts.kernel(target="cuda", name=f"flash_attention_combine_{T.short}_d{D}{'_bshd' if heads_last else ''}")
    def combine(P: f32["Z", "R", D], L: f32["Z", "R"], Out: T[O_SHAPE], splits: i32):
        ts.attrs.grid = ts.ceil_div(Z // splits * R * D, 128)
        G = Z // splits
        HK = G // B
        GRP = H // HK
        ts.attrs.block = 128
        i = ts.block_idx.x * 128 + ts.thread_idx.x
        if i < G * R * D:
            d = i % D
            r = (i // D) % R
            g = i // (D * R)
            mx = NEG_INF
            for s in range(splits):
                mx = max(mx, L[s * G + g, r])
            sh = ts.select(mx == NEG_INF, 0.0, mx)
            num = 0.0
            den = 0.0
            for s in range(splits):
                w = ts.exp2(L[s * G + g, r] - sh)
                num += w * P[s * G + g, r, d]
                den += w
            if heads_last:
                Out[g // HK, r % SQ, (g % HK) * GRP + r // SQ, d] = num / den
            else:
                Out[g // HK, (g % HK) * GRP + r // SQ, r % SQ, d] = num / den  # 0 / 0 = NaN: no visible key

    return combine
