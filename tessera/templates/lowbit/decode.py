"""Low-bit weight x fp16 activation GEMM for decode sizes (M <= 16 per tile), written in tessera.

Y[m, n] = sum_k X[m, k] * W[n, k], W given as codes of any low-bit type (tessera.quant) with a
scale per (row, group) and optionally a bias (zero point) per (row, group):
    W[n, k] = (u[n, k] - bias[n, g]) * scale[n, g],   g = k // group_size
(u: the layout's code, offset binary for signed ints; tessera.ir.lowbit).  The weights are laid
out at pack time (tessera.quant.layout) so that each warp streams its 16-row tile with 16-byte
loads, 512 contiguous bytes per warp instruction, and `ts.dequant` turns the words straight
into m16n8k16 A fragments; the activations are the B operand (8 tokens per mma; the k order
is permuted so that each lane's activations are 16-byte loads too).  Blocks of a thread-block
cluster split K and add their partial tiles through distributed shared memory, so one launch
does everything (no workspace, no second kernel).  Tokens beyond 16 take more tiles in grid.y.
"""

from __future__ import annotations

import functools
import math

import numpy as np

import tessera as ts
from tessera import f16, f32, u32
from tessera.errors import UnsupportedError
from tessera.ir import lowbit
from tessera.ir.dtypes import DataType
from tessera.ir.instructions import DEQUANT_TYPES
from tessera.templates.lowbit.decode_config import DecodeConfig, group_ok, x_smem_bytes  # noqa: F401  (re-exported)


def scale_slots(span: int, group_size: int) -> tuple[int, int, tuple[int, ...]]:
    """(SPQ, NQ, QK): a unit's steps fall in NQ runs of SPQ steps whose k lie in one group for
    every lane; run q starts at k QK[q] + 4 * span * t of lane t (t = lane % 4)."""
    if span == 16:
        spq = min(16, math.gcd(group_size, 64) // 4)
    else:
        spq = min(16, math.gcd(group_size, 256) // 16) if group_size % 32 == 0 else (2 if group_size in (8, 16) else 1)
    nq = 16 // spq
    return spq, nq, tuple(16 * span * (q * spq // span) + 4 * (q * spq % span) for q in range(nq))


def unit_scales(values: np.ndarray, group_size: int, k_tiles: int) -> np.ndarray:
    """Per-group values [N, G] (scales or biases) in the order the span-2 kernel reads them with
    `unit_scales`: float16 [ceil(N / 16) * k_tiles * 8, 2 * NQ], row (tile * k_tiles + u) * 8 + g,
    column 2q + h the value of row tile * 16 + g + 8h for run q of unit u (the same group for the
    four lanes of g: span 2, groups of 32 and more); rows past N are 0.  One load per unit."""
    if group_size % 32:
        raise UnsupportedError(f"unit scales need span-2 groups of 32 or more, got {group_size}")
    _, nq, qk = scale_slots(2, group_size)
    n, g_count = values.shape
    nt = -(-n // 16)
    grp = np.minimum((np.arange(k_tiles)[:, None] * 256 + np.array(qk)[None, :]) // group_size, g_count - 1)  # [KT, NQ]
    rows = np.arange(nt)[:, None, None] * 16 + np.arange(8)[None, :, None] + 8 * np.arange(2)[None, None, :]  # [NT, 8, 2]
    padded = np.zeros((nt * 16, g_count), np.float16)
    padded[:n] = values
    out = padded[rows[:, None, :, None, :], grp[None, :, None, :, None]]  # [NT, KT, 8, NQ, 2]
    return np.ascontiguousarray(out.reshape(nt * k_tiles * 8, 2 * nq))


@functools.cache
def make_decode(wtype: DataType, group_size: int, has_bias: bool, config: DecodeConfig,
                k_whole: bool = False, unit_scaled: bool = False) -> ts.Kernel:  # fmt: skip
    """kernel(X [M, K] f16, Wq [words] u32, S [N, G] f16, B [N, G] f16, Y [M, N] f16, N, KT).

    KT = padded K / 256 (the packed k tiles); B is read only when `has_bias`.  `k_whole`: the
    caller promises K % 256 == 0, so no activation load needs a bound check (the kernel reads
    past the row otherwise).  `unit_scaled`: S and B come as `unit_scales` lays them out (span 2,
    groups of 32 on), one vector load per unit and row tile."""
    if wtype.name not in DEQUANT_TYPES:
        raise UnsupportedError(f"the low-bit decode kernel takes {', '.join(DEQUANT_TYPES)}, not {wtype}")
    if not group_ok(group_size):
        raise UnsupportedError(f"group size {group_size}: the decode kernel takes multiples of 64 or 4, 8, 16, 32")
    problems = config.problems()
    if config.smem_bytes(wtype.nbits) > 220 * 1024:
        problems.append(f"its shared memory ({config.smem_bytes(wtype.nbits)} bytes for {wtype}) exceeds 220 KiB")
    if problems:
        raise UnsupportedError(f"decode config {config}: {'; '.join(problems)}")
    T, BITS, GS, HAS_BIAS = wtype, wtype.nbits, group_size, has_bias
    WARPS, SPLIT, UNROLL, MT, R = config.warps, config.split, config.unroll, config.m_tiles, config.rows
    XU, P = config.staged_units, config.stages  # (interleaved: rounded up to whole batches)
    IL = config.interleave
    PF = config.prefetch
    MIN_BLOCKS = config.min_blocks
    SLOTS = P if P else UNROLL * (2 if PF else 1)  # register slots of weights and scales: one per unit in flight
    HALVES = (0, 1) if PF else (0,)  # prefetch: two register sets, loaded and computed in turn
    LOAD_SET = tuple(h * UNROLL if PF else 0 for h in HALVES)
    COMP_SET = tuple((1 - h) * UNROLL if PF else 0 for h in HALVES)
    XPF = PF and XU == 0  # prefetch the activations from global memory with the weights
    # shared activations [8 * MT tokens, XU units x 4 lanes' 64 k + 8 halves of padding each]; the
    # row length keeps a row 64 bytes off the next modulo 128: a warp's 16-byte reads hit no bank twice
    XROW = XU * 288 + (32 if XU % 2 == 0 else 0)
    THREADS = 32 * WARPS
    WORDS = 4 * BITS  # one lane's words of one unit
    SPAN = config.span
    SPQ, NQ, QK = scale_slots(SPAN, GS)  # scale slots: runs of SPQ steps whose k lie in one group for every lane
    AFTER = SPAN != 16 and GS % 32 == 0  # every step's 16 k in one group: scale the fp32 sums
    if unit_scaled and not AFTER:
        raise UnsupportedError(f"unit scales need span 2 and groups of 32 or more (config {config}, group {GS})")
    SC_BYTES = min(16, 4 * NQ)  # unit scales: one row of 2 * NQ halves per unit and row tile, in 16-byte pieces
    SC_Q = SC_BYTES // 4
    SC_COPIES = NQ // SC_Q
    # (a float's zero point would need the raw unit too: floats with zero points subtract in the dequant)
    FOLD = config.fold and AFTER and not (T.is_float and HAS_BIAS)
    # raw halves of the small floats are value * 2**-raw_shift, the scales carry 2**float_shift
    RAW_UNIT = 2.0 ** (lowbit.raw_shift(T) - lowbit.float_shift(T)) if FOLD and T.is_float else 1.0
    # FOLD: register r of step s holds raw_magic + u; the second mma adds -(raw_magic + bias) x
    MAGIC = tuple(lowbit.raw_magic(T, reg) + (0 if HAS_BIAS else lowbit.code_offset(T)) for reg in range(64))
    CORRECT = FOLD and (HAS_BIAS or any(MAGIC))  # floats without zero points need no second mma
    # the correction fragment changes at step s (new magics, or a new group's zero points)
    # one constant fragment for every step (no zero points, the same magics): set once, before the loop
    AC_ONCE = CORRECT and not HAS_BIAS and all(MAGIC[4 * s:4 * s + 4] == MAGIC[:4] for s in range(16))
    REFILL = tuple(not AC_ONCE and (s == 0 or MAGIC[4 * s:4 * s + 4] != MAGIC[4 * s - 4:4 * s]
                                    or (HAS_BIAS and s % SPQ == 0)) for s in range(16))  # fmt: skip

    # k within a unit of step s's value 0 in lane t: 16 SPAN (s // SPAN) + 4 (s % SPAN) + KT_LANE t
    KT_LANE = 4 * SPAN
    UG = 256 // GS if 256 % GS == 0 else 0  # groups per unit: the group index is u * UG + lg[q]
    STEPS, EIGHT, QS = tuple(range(16)), tuple(range(8)), tuple(range(NQ))
    name = (f"lowbit_decode_{T.name}_g{GS}{'_z' if HAS_BIAS else ''}_{config}{'_kw' if k_whole else ''}"
            f"{'_us' if unit_scaled else ''}")

    @ts.kernel(target="cuda", name=name)
    def decode(X: f16["M", "K"], Wq: u32["W"], S: f16["NS", "G"], B: f16["NB", "GB"], Y: f16["M", "N"],
               KT: ts.int32):  # fmt: skip
        ts.attrs.grid = (ts.ceil_div(ts.ceil_div(N, 16), WARPS * R) * SPLIT, ts.ceil_div(M, 8 * MT))
        ts.attrs.block = THREADS
        if MIN_BLOCKS:
            ts.attrs.min_blocks = MIN_BLOCKS
        if SPLIT > 1:
            ts.attrs.cluster = (SPLIT, 1, 1)
        wr = ts.register_tensor(u32, [1 if P else SLOTS, R, WORDS])
        xr = ts.register_tensor(f16, [SLOTS if XPF else (UNROLL if IL else 1), MT, 64])
        accu = ts.register_tensor(f32, [UNROLL if IL else 1, 2, R, MT, 4])  # interleaved: each unit's sums
        acu = ts.register_tensor(f16, [UNROLL if IL else 1, R, 8])  # interleaved: each unit's correction fragment
        sc = ts.register_tensor(f16, [SLOTS, R, NQ, 2])
        bz = ts.register_tensor(f16, [SLOTS, R, NQ, 2])
        # one group's unscaled sums (AFTER): even and odd steps, or (CORRECT) the weights' and the corrections' mmas
        accg = ts.register_tensor(f32, [2, R, MT, 4])
        a = ts.register_tensor(f16, [8])
        ac = ts.register_tensor(f16, [R, 8])  # FOLD: the correction fragment -(raw_magic + bias)
        acc = ts.register_tensor(f32, [2, R, MT, 4])  # two sets: even and odd steps' mmas overlap
        tid = ts.thread_idx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        bx = ts.block_idx.x
        rank = bx % SPLIT
        nt0 = ((bx // SPLIT) * WARPS + tid // 32) * R  # this warp's first 16-row tile
        m_base = ts.block_idx.y * (8 * MT)
        per_split = ts.ceil_div(KT, SPLIT)
        u_begin = rank * per_split
        u_end = min(u_begin + per_split, KT)
        xs = ts.shared_tensor(f16, [8 * MT, XROW if XU > 0 else 8])
        lg = ts.register_tensor(ts.int32, [NQ])  # the lane's group of scale slot q within a unit (UG)
        for q in QS:  # compile-time: indexes QK
            lg[q] = (KT_LANE * t + QK[q]) // GS
        for c in ts.unroll(2):
            for r in ts.unroll(R):
                for i in ts.unroll(MT):
                    for e in ts.unroll(4):
                        acc[c, r, i, e] = 0.0
        for c in ts.unroll(2):
            for r in ts.unroll(R):
                for i in ts.unroll(MT):
                    for e in ts.unroll(4):
                        accg[c, r, i, e] = 0.0
        if IL:
            for uu in ts.unroll(UNROLL):
                for c in ts.unroll(2):
                    for r in ts.unroll(R):
                        for i in ts.unroll(MT):
                            for e in ts.unroll(4):
                                accu[uu, c, r, i, e] = 0.0
        if AC_ONCE:
            for r in ts.unroll(R):
                for e in EIGHT:
                    ac[r, e] = -MAGIC[e // 2]
        n_units = u_end - u_begin
        if XU > 0:  # the activations, in the layout's k order (zero-filled outside M, K)
            for idx in range(tid, 8 * MT * XU * 32, THREADS):
                row = idx // (XU * 32)
                col = idx % (XU * 32)
                m = m_base + row
                k = (u_begin + col // 32) * 256 + (col % 32) * 8
                c16 = col % 32  # the chunk's lane t and 16-byte register j in the layout's k order
                xt = (c16 % (2 * SPAN)) // (SPAN // 2)
                xj = (c16 // (2 * SPAN)) * (SPAN // 2) + c16 % (SPAN // 2)
                dst = (col // 32) * 288 + xt * 72 + xj * 8
                ok = m < M and k < K and col // 32 < n_units
                # asynchronous (zero-filled where not ok): the ring's first group of copies, or the
                # register path's own group, awaited after its first weight loads are out
                ts.copy_async(xs[row, dst], X[ts.select(ok, m, 0), ts.select(ok, k, 0)], 16, ok)
            if P == 0:
                ts.copy_async_commit()
        if P > 0:
            warp = tid // 32
            wsm = ts.shared_tensor(u32, [WARPS, P, R, BITS, 128])  # each lane reads back only its own copies
            # Iteration `it` copies unit it + P - 1 into slot pp and computes unit it (slot (pp + 1) % P);
            # it0 = 1 - P (mod P), so both slots are compile-time and the scales stay in registers.
            for it0 in range(1 - P, n_units, P):
                for pp in ts.unroll(P):
                    it = it0 + pp
                    cs = (pp + 1) % P
                    if it < n_units:
                        if it >= 0:
                            ts.copy_async_wait(P - 2)  # this lane's copies of unit it have landed
                            if XU > 0 and it == 0:
                                ts.syncthreads()  # ... and every thread's activations
                            for r in ts.unroll(R):
                                for j in ts.unroll(BITS):
                                    ts.copy_vector(wr[0, r, 4 * j], wsm[warp, cs, r, j, lane * 4], 16)
                        lu = u_begin + it + P - 1
                        for r in ts.unroll(R):
                            ok = lu < u_end and (nt0 + r) * 16 < N
                            for j in ts.unroll(BITS):
                                src = ((((nt0 + r) * KT + lu) * BITS + j) * 32 + lane) * 4
                                ts.copy_async(wsm[warp, pp, r, j, lane * 4], Wq[ts.select(ok, src, 0)], 16, ok)
                            if unit_scaled:
                                srow = min(((nt0 + r) * KT + min(lu, KT - 1)) * 8 + g, NS - 1)
                                for c in ts.unroll(SC_COPIES):
                                    ts.copy_vector(sc[pp, r, c * SC_Q, 0], S[srow, c * 2 * SC_Q], SC_BYTES)
                                    if HAS_BIAS:
                                        ts.copy_vector(bz[pp, r, c * SC_Q, 0], B[srow, c * 2 * SC_Q], SC_BYTES)
                            else:
                                for q in QS:  # compile-time: indexes QK
                                    grp = min(min(lu, KT - 1) * UG + lg[q], G - 1) if UG else min(
                                        (min(lu, KT - 1) * 256 + KT_LANE * t + QK[q]) // GS, G - 1)
                                    for h in ts.unroll(2):
                                        row = min((nt0 + r) * 16 + g + 8 * h, NS - 1)
                                        sc[pp, r, q, h] = S[row, grp]
                                        if HAS_BIAS:
                                            bz[pp, r, q, h] = B[row, grp]
                        ts.copy_async_commit()
                        if it >= 0:
                            u = u_begin + it
                            for i in ts.unroll(MT):
                                m = m_base + i * 8 + g  # tokens past M read token M - 1: their columns are never stored
                                for j in ts.unroll(8):
                                    if XU > 0:
                                        ts.copy_vector(xr[0, i, j * 8], xs[i * 8 + g, it * 288 + t * 72 + j * 8], 16)
                                    else:
                                        k = u * 256 + KT_LANE * t + 16 * SPAN * (2 * j // SPAN) + 4 * (2 * j % SPAN)
                                        if k_whole:  # every unit is whole: no bound check, no zero fill
                                            ts.copy_vector(xr[0, i, j * 8], X[min(m, M - 1), k], 16)
                                        elif k < K:
                                            ts.copy_vector(xr[0, i, j * 8], X[min(m, M - 1), k], 16)
                                        else:
                                            for e in ts.unroll(8):
                                                xr[0, i, j * 8 + e] = 0.0
                            for s in STEPS:
                                q = s // SPQ
                                for r in ts.unroll(R):
                                    if FOLD:
                                        ts.dequant(a[0], wr[0, r, 0], wtype=T, start=8 * s, count=8, raw=True)
                                    elif AFTER and HAS_BIAS:
                                        ts.dequant(a[0], wr[0, r, 0], bias=bz[cs, r, q, 0], wtype=T, start=8 * s, count=8)
                                    elif AFTER:
                                        ts.dequant(a[0], wr[0, r, 0], wtype=T, start=8 * s, count=8)
                                    elif HAS_BIAS:
                                        ts.dequant(a[0], wr[0, r, 0], sc[cs, r, q, 0], bz[cs, r, q, 0], wtype=T,
                                                   start=8 * s, count=8)
                                    else:
                                        ts.dequant(a[0], wr[0, r, 0], sc[cs, r, q, 0], wtype=T, start=8 * s, count=8)
                                    for i in ts.unroll(MT):
                                        if AFTER:
                                            ts.mma(accg[0 if CORRECT else s % 2, r, i, 0], a[0], xr[0, i, 4 * s])
                                        else:
                                            ts.mma(acc[s % 2, r, i, 0], a[0], xr[0, i, 4 * s])
                                    if CORRECT:
                                        if REFILL[s]:
                                            for e in EIGHT:  # compile-time: indexes MAGIC
                                                if HAS_BIAS:
                                                    ac[r, e] = -(bz[cs, r, q, (e // 2) % 2] + MAGIC[4 * s + e // 2])
                                                else:
                                                    ac[r, e] = -MAGIC[4 * s + e // 2]
                                        for i in ts.unroll(MT):
                                            ts.mma(accg[1, r, i, 0], ac[r, 0], xr[0, i, 4 * s])
                                if AFTER and s % SPQ == SPQ - 1:  # the group's sums, scaled per row
                                    for r in ts.unroll(R):
                                        for i in ts.unroll(MT):
                                            for e in ts.unroll(4):
                                                if RAW_UNIT != 1.0:
                                                    acc[0, r, i, e] += ts.cast(sc[cs, r, q, e // 2], f32) * RAW_UNIT * (
                                                        accg[0, r, i, e] + accg[1, r, i, e])
                                                else:
                                                    acc[0, r, i, e] += ts.cast(sc[cs, r, q, e // 2], f32) * (
                                                        accg[0, r, i, e] + accg[1, r, i, e])
                                                for c in ts.unroll(2):
                                                    accg[c, r, i, e] = 0.0
            ts.copy_async_wait(0)  # the tail's (zero-filling) copies land before the block leaves
        elif XU > 0 or nt0 * 16 < N:  # staged activations: every warp meets the block barrier below
            # batches of UNROLL units: every load of a batch first (weights, scales), then its math;
            # with prefetch the loads of the next batch go out before the math of this one
            # (register sets alternate: the loop starts one batch early and takes two per pass)
            for u00 in range(u_begin - UNROLL if PF else u_begin, u_end, UNROLL * len(HALVES)):
                for hb in HALVES:  # compile-time: the register sets
                    ub = u00 + hb * UNROLL  # the batch computed in this half
                    for uu in ts.unroll(UNROLL):
                        # interleaved, every unit of the batch is computed: past the block's end, on its last unit's weights
                        u = min(ub + uu, u_end - 1) if IL else ub + (UNROLL if PF else 0) + uu
                        ls = LOAD_SET[hb] + uu
                        if IL or u < u_end:
                            for r in ts.unroll(R):
                                if (nt0 + r) * 16 < N:
                                    for j in ts.unroll(BITS):
                                        ts.copy_vector(wr[ls, r, 4 * j],
                                                       Wq[((((nt0 + r) * KT + u) * BITS + j) * 32 + lane) * 4], 16)
                                if unit_scaled:
                                    srow = min(((nt0 + r) * KT + u) * 8 + g, NS - 1)
                                    for c in ts.unroll(SC_COPIES):
                                        ts.copy_vector(sc[ls, r, c * SC_Q, 0], S[srow, c * 2 * SC_Q], SC_BYTES)
                                        if HAS_BIAS:
                                            ts.copy_vector(bz[ls, r, c * SC_Q, 0], B[srow, c * 2 * SC_Q], SC_BYTES)
                                else:
                                    for q in QS:  # compile-time: indexes QK
                                        grp = min(u * UG + lg[q], G - 1) if UG else min(
                                            (u * 256 + KT_LANE * t + QK[q]) // GS, G - 1)
                                        for h in ts.unroll(2):
                                            row = min((nt0 + r) * 16 + g + 8 * h, NS - 1)
                                            sc[ls, r, q, h] = S[row, grp]
                                            if HAS_BIAS:
                                                bz[ls, r, q, h] = B[row, grp]
                            if XPF:  # this unit's activations, with its weights
                                for i in ts.unroll(MT):
                                    m = m_base + i * 8 + g  # tokens past M read token M - 1: never stored
                                    for j in ts.unroll(8):
                                        k = u * 256 + KT_LANE * t + 16 * SPAN * (2 * j // SPAN) + 4 * (2 * j % SPAN)
                                        if k_whole:
                                            ts.copy_vector(xr[ls, i, j * 8], X[min(m, M - 1), k], 16)
                                        elif k < K:
                                            ts.copy_vector(xr[ls, i, j * 8], X[min(m, M - 1), k], 16)
                                        else:
                                            for e in ts.unroll(8):
                                                xr[ls, i, j * 8 + e] = 0.0
                    if XU > 0:
                        if ub == u_begin:  # the first batch's weights are in flight: now the activations
                            ts.copy_async_wait(0)
                            ts.syncthreads()
                    if IL:  # step by step across the batch's units, each into its own sums (no branches)
                        for s in STEPS:  # compile-time: dequant's start, the magics
                            q = s // SPQ
                            for uu in ts.unroll(UNROLL):
                                if s % 2 == 0:  # 16 bytes of this unit's staged activations per two steps
                                    for i in ts.unroll(MT):
                                        ts.copy_vector(xr[uu, i, 4 * s],
                                                       xs[i * 8 + g, (ub + uu - u_begin) * 288 + t * 72 + 4 * s], 16)
                                for r in ts.unroll(R):
                                    if FOLD:
                                        ts.dequant(a[0], wr[uu, r, 0], wtype=T, start=8 * s, count=8, raw=True)
                                    elif AFTER and HAS_BIAS:
                                        ts.dequant(a[0], wr[uu, r, 0], bias=bz[uu, r, q, 0], wtype=T, start=8 * s, count=8)
                                    elif AFTER:
                                        ts.dequant(a[0], wr[uu, r, 0], wtype=T, start=8 * s, count=8)
                                    elif HAS_BIAS:
                                        ts.dequant(a[0], wr[uu, r, 0], sc[uu, r, q, 0], bz[uu, r, q, 0], wtype=T,
                                                   start=8 * s, count=8)
                                    else:
                                        ts.dequant(a[0], wr[uu, r, 0], sc[uu, r, q, 0], wtype=T, start=8 * s, count=8)
                                    for i in ts.unroll(MT):
                                        ts.mma(accu[uu, 0 if CORRECT else s % 2, r, i, 0], a[0], xr[uu, i, 4 * s])
                                    if CORRECT:
                                        if AC_ONCE:
                                            for i in ts.unroll(MT):
                                                ts.mma(accu[uu, 1, r, i, 0], ac[r, 0], xr[uu, i, 4 * s])
                                        else:
                                            if REFILL[s]:
                                                for e in EIGHT:  # compile-time: indexes MAGIC
                                                    if HAS_BIAS:
                                                        acu[uu, r, e] = -(bz[uu, r, q, (e // 2) % 2] + MAGIC[4 * s + e // 2])
                                                    else:
                                                        acu[uu, r, e] = -MAGIC[4 * s + e // 2]
                                            for i in ts.unroll(MT):
                                                ts.mma(accu[uu, 1, r, i, 0], acu[uu, r, 0], xr[uu, i, 4 * s])
                            if AFTER and s % SPQ == SPQ - 1:  # the group's sums, scaled per unit and row
                                for uu in ts.unroll(UNROLL):
                                    for r in ts.unroll(R):
                                        for i in ts.unroll(MT):
                                            for e in ts.unroll(4):
                                                acc[s // SPQ % 2, r, i, e] += ts.cast(sc[uu, r, q, e // 2], f32) * RAW_UNIT * (
                                                    accu[uu, 0, r, i, e] + accu[uu, 1, r, i, e])
                                                for c in ts.unroll(2):
                                                    accu[uu, c, r, i, e] = 0.0
                        if not AFTER:  # scaled in the dequant: the batch's sums
                            for uu in ts.unroll(UNROLL):
                                for r in ts.unroll(R):
                                    for i in ts.unroll(MT):
                                        for e in ts.unroll(4):
                                            acc[0, r, i, e] += accu[uu, 0, r, i, e] + accu[uu, 1, r, i, e]
                                            for c in ts.unroll(2):
                                                accu[uu, c, r, i, e] = 0.0
                    else:
                        for uu in ts.unroll(UNROLL):
                            cs = COMP_SET[hb] + uu
                            if ub + uu < u_end and (ub >= u_begin if PF else True):
                                # activations per unit (L1/L2 hits: every warp of the block reads the same ones;
                                # with prefetch from global memory they came with the weights)
                                if XU == 0 and not XPF:
                                    for i in ts.unroll(MT):
                                        m = m_base + i * 8 + g  # tokens past M read token M - 1: their columns are never stored
                                        for j in ts.unroll(8):
                                            k = (ub + uu) * 256 + KT_LANE * t + 16 * SPAN * (2 * j // SPAN) + 4 * (2 * j % SPAN)
                                            if k_whole:  # every unit is whole: no bound check, no zero fill
                                                ts.copy_vector(xr[0, i, j * 8], X[min(m, M - 1), k], 16)
                                            elif k < K:
                                                ts.copy_vector(xr[0, i, j * 8], X[min(m, M - 1), k], 16)
                                            else:
                                                for e in ts.unroll(8):
                                                    xr[0, i, j * 8 + e] = 0.0
                                for s in STEPS:  # a compile-time list: dequant's start is a constant
                                    q = s // SPQ
                                    if XU > 0 and s % 2 == 0:  # staged activations: 16 bytes per two steps, as needed
                                        for i in ts.unroll(MT):
                                            ts.copy_vector(xr[0, i, 4 * s], xs[i * 8 + g, (ub + uu - u_begin) * 288 + t * 72 + 4 * s],
                                                           16)  # fmt: skip
                                    for r in ts.unroll(R):
                                        if FOLD:
                                            ts.dequant(a[0], wr[cs, r, 0], wtype=T, start=8 * s, count=8, raw=True)
                                        elif AFTER and HAS_BIAS:
                                            ts.dequant(a[0], wr[cs, r, 0], bias=bz[cs, r, q, 0], wtype=T, start=8 * s, count=8)
                                        elif AFTER:
                                            ts.dequant(a[0], wr[cs, r, 0], wtype=T, start=8 * s, count=8)
                                        elif HAS_BIAS:
                                            ts.dequant(a[0], wr[cs, r, 0], sc[cs, r, q, 0], bz[cs, r, q, 0], wtype=T,
                                                       start=8 * s, count=8)
                                        else:
                                            ts.dequant(a[0], wr[cs, r, 0], sc[cs, r, q, 0], wtype=T, start=8 * s, count=8)
                                        for i in ts.unroll(MT):
                                            if AFTER:
                                                ts.mma(accg[0 if CORRECT else s % 2, r, i, 0], a[0], xr[cs if XPF else 0, i, 4 * s])
                                            else:
                                                ts.mma(acc[s % 2, r, i, 0], a[0], xr[cs if XPF else 0, i, 4 * s])
                                        if CORRECT:
                                            if REFILL[s]:
                                                for e in EIGHT:  # compile-time: indexes MAGIC
                                                    if HAS_BIAS:
                                                        ac[r, e] = -(bz[cs, r, q, (e // 2) % 2] + MAGIC[4 * s + e // 2])
                                                    else:
                                                        ac[r, e] = -MAGIC[4 * s + e // 2]
                                            for i in ts.unroll(MT):
                                                ts.mma(accg[1, r, i, 0], ac[r, 0], xr[cs if XPF else 0, i, 4 * s])
                                    if AFTER and s % SPQ == SPQ - 1:  # the group's sums, scaled per row
                                        for r in ts.unroll(R):
                                            for i in ts.unroll(MT):
                                                for e in ts.unroll(4):
                                                    if RAW_UNIT != 1.0:
                                                        acc[0, r, i, e] += ts.cast(sc[cs, r, q, e // 2], f32) * RAW_UNIT * (
                                                            accg[0, r, i, e] + accg[1, r, i, e])
                                                    else:
                                                        acc[0, r, i, e] += ts.cast(sc[cs, r, q, e // 2], f32) * (
                                                            accg[0, r, i, e] + accg[1, r, i, e])
                                                    for c in ts.unroll(2):
                                                        accg[c, r, i, e] = 0.0
            if XU > 0:
                ts.copy_async_wait(0)  # a block without units still staged (zeros): they land before it leaves
        # acc[c, r, i, e]: token m_base + 8i + 2t + e % 2, row (nt0 + r) * 16 + g + 8 (e // 2)
        for r in ts.unroll(R):
            for i in ts.unroll(MT):
                for e in ts.unroll(4):
                    acc[0, r, i, e] += acc[1, r, i, e]
        if SPLIT == 1:
            for r in ts.unroll(R):
                for i in ts.unroll(MT):
                    for e in ts.unroll(4):
                        m = m_base + i * 8 + 2 * t + e % 2
                        n = (nt0 + r) * 16 + g + 8 * (e // 2)
                        if m < M and n < N:
                            Y[m, n] = acc[0, r, i, e]
        else:
            part = ts.shared_tensor(f32, [THREADS, R, MT, 4])
            for r in ts.unroll(R):
                for i in ts.unroll(MT):
                    for e in ts.unroll(4):
                        part[tid, r, i, e] = acc[0, r, i, e]
            ts.cluster_sync()
            if tid % SPLIT == rank:  # each block of the cluster adds and writes 1/SPLIT of the threads' results
                got = ts.register_tensor(f32, [4])
                for r in ts.unroll(R):
                    for i in ts.unroll(MT):
                        for e in ts.unroll(4):
                            acc[0, r, i, e] = 0.0
                        for c in ts.unroll(SPLIT):
                            ts.load_cluster(got[0], part[tid, r, i, 0], c, 16)
                            for e in ts.unroll(4):
                                acc[0, r, i, e] += got[e]
                        for e in ts.unroll(4):
                            m = m_base + i * 8 + 2 * t + e % 2
                            n = (nt0 + r) * 16 + g + 8 * (e // 2)
                            if m < M and n < N:
                                Y[m, n] = acc[0, r, i, e]
            ts.cluster_sync()  # no block leaves while the others read its partials

    return decode
