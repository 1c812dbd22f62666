"""Low-bit linear layers on the CPU, written in tessera.

* `make_linear_cpu(wtype, has_zeros)`: Y[m, n] = sum_k X[m, k] * (W[n, k] - Z[n, g]) * S[n, g]
  in float32 from packed-tensor loads (any type: the generated code extracts each field,
  tessera.quant.codecs); the CPU path of the quantized-linear op and the reference for the GPU
  kernels;
* `make_linear_rows(...)`: the same from the row layout (`row_segments`), decoded per tile of rows
  into float32 and summed with SIMD vectors (the graph operator's CPU kernel beyond 4 rows of x);
* `make_linear_decode(...)`: the same for a decode step (up to 4 rows of x), the codes decoded
  in integer vector registers and multiplied in at once.

(The CUDA prefill path dequantises the tensor-core words: tessera.templates.lowbit.dequant.)
"""

from __future__ import annotations

import functools

import numpy as np

import tessera as ts
from tessera import f16, f32, i32, u32
from tessera.ir import lowbit
from tessera.ir.dtypes import DataType
from tessera.ir.vector import vector_type
from tessera.quant.layout import ROW_BLOCK, row_segments


@functools.cache
def make_linear_cpu(wtype: DataType, has_zeros: bool) -> ts.Kernel:
    T = wtype

    @ts.kernel(target="cpu", name=f"lowbit_linear_{T.name}{'_z' if has_zeros else ''}")
    def linear(X: f32["M", "K"], W: T["N", "K"], S: f16["N", "G"], Z: i32["NZ", "GZ"], Y: f32["M", "N"],
               group: ts.int32):  # fmt: skip
        for n in ts.parallel(N):
            for m in range(M):
                total = 0.0
                for g in range(G):
                    part = 0.0
                    for k in range(g * group, min(g * group + group, K)):
                        if has_zeros:
                            part += X[m, k] * ts.cast(W[n, k] - Z[n, g], f32)
                        else:
                            part += X[m, k] * ts.cast(W[n, k], f32)
                    total += part * ts.cast(S[n, g], f32)
                Y[m, n] = total

    return linear


def kernel_group(group: int, k: int) -> int | None:
    """The group size the row-layout kernels take for groups of `group` k over K = k: a divisor
    of 256 from 8 up or a multiple of 256 as it is, per channel (group >= k) as the multiple of 256
    that covers K (one group either way); None for the other sizes: groups starting at a different
    place in each 256-k block (the kernels cut their segments once for every block), and groups
    under 8 codes (a segment per group: 256 a block would make a kernel gcc takes minutes over,
    for weights that store more scale than code)."""
    if group >= k:
        return -(-k // ROW_BLOCK) * ROW_BLOCK
    return group if group >= 8 and (ROW_BLOCK % group == 0 or group % ROW_BLOCK == 0) else None


def decode_segments(bits: int, group: int) -> tuple[tuple[int, ...], ...]:
    """row_segments cut where a group of k starts (a segment's codes share one scale), as the
    kernel walks them: (k0, first j, end j, then word, shift, mask, low of 3 pieces, unused
    ones with mask 0), per 256-k block; `group` divides 256 or is a multiple of it (kernel_group)."""
    if ROW_BLOCK % group and group % ROW_BLOCK:
        raise ValueError(f"group {group}: the row layout's kernels take divisors of {ROW_BLOCK} or multiples of it")
    cut = min(group, ROW_BLOCK)
    out = []
    for k0, length, pieces in row_segments(bits):
        flat = tuple(v for w, sh, q, low in pieces for v in (w, sh, (1 << q) - 1, low)) + (0, 0, 0, 0) * (3 - len(pieces))
        j = 0
        while j < length:
            end = min(length, (k0 + j) // cut * cut + cut - k0)
            out.append((k0, j, end, *flat))
            j = end
    return tuple(out)


@functools.cache
def make_linear_rows(wtype: DataType, group: int, has_bias: bool, lanes: int, threads: int, mr: int = 4,
                     nr: int = 4) -> ts.Kernel:  # fmt: skip
    """Y[m, n] = sum_k X[m, k] * W[n, k] on the CPU, W[n, k] = (L(u) - bias[n, g]) * S[n, g], from
    codes u in the row layout (`row_segments`: Wr [N, KB * 8 * bits] uint32, KB = ceil(K / 256)).

    L(u) is u for the integers and decode(u) * 2**-float_shift for the small floats (the scales
    carry the power, as in the tensor-core layout), computed from the code's fields (no table
    gather); without `has_bias` the integers subtract the signed types' offset.  Workers take
    tiles of `nr` rows of W: each row is decoded straight into the worker's float32 buffer Wf,
    segment by segment (`decode_segments`: a run of k at one shift of one run of words per piece,
    within one group, whose scale is converted from fp16 once), then `mr` x `nr` float32 vector
    sums run over K (vload/vfma, the tail masked).  Wf is a [threads, nr * KB * 256] workspace."""
    BITS, GS, NR, MR, LANES, IS_FLOAT = wtype.nbits, group, nr, mr, lanes, wtype.is_float
    offset = float(lowbit.code_offset(wtype))
    SEGS = decode_segments(BITS, group)
    # small floats: the code's exponent and mantissa shifted into a float32's, its exponent bias
    # replaced by float32's (FBITS), read as float32 (ts.bitcast): the value itself where the
    # exponent field e > 0; where e = 0 (subnormal: 2**(1 - bias) * m / 2**mbits) that read is
    # 2**-bias * (1 + m / 2**mbits), so 2v - 2**(1 - bias) (exact); the sign last, the layout's
    # 2**-float_shift in the scale (NaN and inf codes, never made by quantisation, read finite)
    FM = wtype.mantissa_bits if IS_FLOAT else 0
    FBIAS = (1 << (wtype.exponent_bits - 1)) - 1 if IS_FLOAT else 0
    FMM, FSIGN, FBITS = (1 << FM) - 1, 1 << (BITS - 1), (127 - FBIAS) << 23
    FMAG, FSUB = FSIGN - 1, 2.0 ** (1 - FBIAS)
    FSCALE = 2.0 ** -lowbit.float_shift(wtype) if IS_FLOAT else 1.0
    rows, cols = tuple(range(mr)), tuple(range(nr))

    vt = vector_type(f32, lanes)
    name = f"lowbit_rows_{wtype.name}_g{group}{'_b' if has_bias else ''}_{mr}x{nr}_l{lanes}_t{threads}"

    @ts.kernel(target="cpu", name=name)
    def linear(X: f32["M", "K"], Wr: u32["N", "RW"], S: f16["N", "G"], B: f16["NB", "GB"], Y: f32["M", "N"],
               Wf: f32["WT", "KF"]):  # fmt: skip
        tiles = ts.ceil_div(N, NR)
        per = ts.ceil_div(tiles, threads)
        kp = ts.ceil_div(K, 256) * 256
        for w in ts.parallel(threads):
            for tile in range(w * per, min(tiles, w * per + per)):
                for c in cols:
                    n = min(tile * NR + c, N - 1)
                    last = -1  # the group whose scale (and bias) s (and b) hold: converted once a group
                    s = 0.0
                    b = offset  # (the integers without a bias subtract the signed types' offset)
                    for kb in range(kp // 256):
                        src = kb * 8 * BITS
                        for ko, j0, j1, w0, s0, m0, l0, w1, s1, m1, l1, w2, s2, m2, l2 in SEGS:
                            g = min((kb * 256 + ko + j0) // GS, G - 1)  # (codes past K are never read)
                            if g != last:
                                s = ts.cast(S[n, g], f32) * FSCALE
                                if has_bias:
                                    b = ts.cast(B[n, g], f32)
                                last = g
                            for j in range(j0, j1):  # (a piece with mask 0 is none: the C compiler drops it)
                                u = (((Wr[n, src + w0 + j] >> s0) & m0) << l0) | (((Wr[n, src + w1 + j] >> s1) & m1) << l1)
                                u = u | (((Wr[n, src + w2 + j] >> s2) & m2) << l2)
                                if IS_FLOAT:
                                    mag = u & FMAG
                                    v = ts.bitcast((mag << (23 - FM)) + FBITS, f32)
                                    # e = 0: 2v - 2**(1 - bias), by k = 1.0 from the borrow of mag - 2**mbits (a
                                    # select with float math in an arm kept gcc from vectorising the loop)
                                    k = ts.cast((mag - (FMM + 1)) >> 31, f32)
                                    v = (v + k * (v - FSUB)) * s
                                    Wf[w, c * kp + kb * 256 + ko + j] = ts.select((u & FSIGN) != 0, -v, v)
                                else:
                                    Wf[w, c * kp + kb * 256 + ko + j] = (ts.cast(ts.cast(u, i32), f32) - b) * s
                for mt in range(ts.ceil_div(M, MR)):
                    m0 = mt * MR
                    acc = ts.register_tensor(vt, [MR, NR])
                    wv = ts.register_tensor(vt, [NR])
                    for r in rows:
                        for c in cols:
                            acc[r, c] = ts.vbroadcast(0.0, LANES)
                    for kv in range(K // LANES):
                        for c in cols:
                            wv[c] = ts.vload(Wf[w, c * kp + kv * LANES], LANES)
                        for r in rows:
                            xv = ts.vload(X[min(m0 + r, M - 1), kv * LANES], LANES)
                            for c in cols:
                                acc[r, c] = ts.vfma(xv, wv[c], acc[r, c])
                    k0 = K // LANES * LANES
                    if k0 < K:
                        for c in cols:
                            wv[c] = ts.vload(Wf[w, c * kp + k0], LANES, K - k0)
                        for r in rows:
                            xv = ts.vload(X[min(m0 + r, M - 1), k0], LANES, K - k0)
                            for c in cols:
                                acc[r, c] = ts.vfma(xv, wv[c], acc[r, c])
                    for r in rows:
                        for c in cols:
                            if m0 + r < M and tile * NR + c < N:
                                Y[m0 + r, tile * NR + c] = ts.vsum(acc[r, c])

    return linear


FUSED_LANES = 8  # the decode-as-you-go kernel's vectors: every segment is a multiple of 8 codes (AVX2 and AVX-512)


def float_lanes_table(wtype: DataType) -> tuple[float, ...] | None:
    """The small float's magnitudes (codes without the sign) as float32, when they fit one
    FUSED_LANES-entry lookup (e2m1: 8 magnitudes); None for the wider floats.  Computed with the
    arithmetic decode of make_linear_rows (exponent and mantissa moved into a float32's, the
    subnormals corrected), so both kernels read every code alike."""
    if not wtype.is_float or 1 << (wtype.nbits - 1) > FUSED_LANES:
        return None
    fm, fbias = wtype.mantissa_bits, (1 << (wtype.exponent_bits - 1)) - 1
    mag = np.arange(FUSED_LANES, dtype=np.uint32) % (1 << (wtype.nbits - 1))
    v = ((mag << (23 - fm)) + ((127 - fbias) << 23)).astype(np.uint32).view(np.float32).astype(np.float64)
    v = np.where(mag <= (1 << fm) - 1, 2 * v - 2.0 ** (1 - fbias), v)
    return tuple(float(x) for x in v)


@functools.cache
def make_linear_decode(wtype: DataType, group: int, has_bias: bool, threads: int, mr: int) -> ts.Kernel:
    """Y[m, n] = sum_k X[m, k] * W[n, k] for the few rows of a decode step (M <= mr), from the
    row layout as make_linear_rows reads it, with no float32 copy of W: each run of 8 codes is
    decoded in vector registers (uint32 words shifted and masked, the pieces OR-ed, converted) and
    multiplied into every row's sum at once; the segments of one group share one sum, which meets
    the group's scale once.  Per 8 codes the integers cost a shift, a mask, a conversion, a
    subtraction and one multiply-add a row, where make_linear_rows stores the float32 code,
    reloads it and scales it.  e2m1 reads its magnitude from a lookup of 8 lanes; the wider floats
    move their fields into float16 bits and convert those (vfloat16: exact, subnormal codes
    included, whatever the denormal mode).  Workers take contiguous runs of W's rows; `group` is a
    kernel_group size."""

    BITS, GS, MR, L = wtype.nbits, group, mr, FUSED_LANES
    SEGS = decode_segments(BITS, group)
    if any((ko + j0) % L or (j1 - j0) % L for ko, j0, j1, *_ in SEGS):
        raise ValueError(f"{wtype.name} at group {group}: the row layout's segments are not runs of {L} codes")
    cut = min(group, ROW_BLOCK)
    RUNS = tuple((ka, tuple(sg for sg in SEGS if (sg[0] + sg[1]) // cut == ka // cut))
                 for ka in sorted({(ko + j0) // cut * cut for ko, j0, *_ in SEGS}))  # fmt: skip
    LOOKUP = float_lanes_table(wtype) is not None
    HALF = wtype.is_float and not LOOKUP
    TABLE = tuple(enumerate(float_lanes_table(wtype) or (0.0,) * L))
    offset = float(lowbit.code_offset(wtype))
    # the wider floats as float16 (vfloat16): the code's exponent field is the half's (as on the
    # GPU), so the half is the value * 2**-float_shift, which the layout's scales carry already
    FM = wtype.mantissa_bits if wtype.is_float else 0
    FMAG, HM, HS = (1 << (BITS - 1)) - 1, 10 - FM, 16 - BITS  # where the magnitude and the sign go
    FSCALE = 2.0 ** -lowbit.float_shift(wtype) if LOOKUP else 1.0
    rows = tuple(range(mr))
    vt = vector_type(f32, L)
    name = f"lowbit_decode_{wtype.name}_g{group}{'_b' if has_bias else ''}_m{mr}_t{threads}"

    @ts.kernel(target="cpu", name=name)
    def linear(X: f32["M", "K"], Wr: u32["N", "RW"], S: f16["N", "G"], B: f16["NB", "GB"], Y: f32["M", "N"]):
        per = ts.ceil_div(N, threads)
        full = K // 256  # blocks without codes past K; the last one's rows of X are read masked
        for w in ts.parallel(threads):
            acc = ts.register_tensor(vt, [MR])
            part = ts.register_tensor(vt, [MR])
            tab = ts.register_tensor(f32, [L])
            for i, value in TABLE:
                tab[i] = value
            table = ts.vload(tab[0], L)  # (unused but by e2m1)
            for n in range(w * per, min(N, w * per + per)):
                for r in rows:
                    acc[r] = ts.vbroadcast(0.0, L)
                last = -1
                s = 0.0
                b = offset
                for tail in (False, True):  # (two copies of the block: only the last block masks X)
                    for kb in range(full if tail else 0, ts.ceil_div(K, 256) if tail else full):
                        src = kb * 8 * BITS
                        for ka, run in RUNS:  # segments of one group: one scale, one sum
                            g = min((kb * 256 + ka) // GS, G - 1)
                            if g != last:
                                s = ts.cast(S[n, g], f32) * FSCALE
                                if has_bias:
                                    b = ts.cast(B[n, g], f32)
                                last = g
                            for r in rows:
                                part[r] = ts.vbroadcast(0.0, L)
                            for ko, j0, j1, w0, s0, m0, l0, w1, s1, m1, l1, w2, s2, m2, l2 in run:
                                for j in range(j0, j1, L):
                                    v = ts.vbroadcast(0.0, L)  # (assigned below: names of a branch stay in it)
                                    if HALF and not m1:  # a whole field: its float16 bits straight from the word
                                        word = ts.vload(Wr[n, src + w0 + j], L)
                                        hm = ts.vshl(word, HM - s0) if HM >= s0 else ts.vshr(word, s0 - HM)
                                        hs = ts.vshl(word, HS - s0) if HS >= s0 else ts.vshr(word, s0 - HS)
                                        v = ts.vfloat16(ts.vor(ts.vand(hm, ts.vbroadcast(FMAG << HM, L, u32)),
                                                               ts.vand(hs, ts.vbroadcast(0x8000, L, u32))))
                                    else:
                                        u = ts.vbroadcast(0, L, u32)
                                        for wo, sh, m, low in ((w0, s0, m0, l0), (w1, s1, m1, l1), (w2, s2, m2, l2)):
                                            if m:
                                                piece = ts.vshr(ts.vload(Wr[n, src + wo + j], L), sh)
                                                if sh + m.bit_length() < 32:
                                                    piece = ts.vand(piece, ts.vbroadcast(m, L, u32))
                                                u = ts.vor(u, ts.vshl(piece, low)) if low else ts.vor(u, piece)
                                        if LOOKUP:  # the magnitude from the table, the sign moved to float32's
                                            sign = ts.vand(ts.vshl(u, 32 - BITS), ts.vbroadcast(0x80000000, L, u32))
                                            v = ts.vbitcast(ts.vxor(ts.vbitcast(ts.vlookup(table, u), u32), sign), f32)
                                        elif HALF:
                                            v = ts.vfloat16(ts.vor(ts.vshl(ts.vand(u, ts.vbroadcast(FMAG, L, u32)), HM),
                                                                   ts.vand(ts.vshl(u, HS), ts.vbroadcast(0x8000, L, u32))))
                                        else:
                                            v = ts.vsub(ts.vfloat(ts.vbitcast(u, ts.int32)), ts.vbroadcast(b, L))
                                    k = kb * 256 + ko + j
                                    for r in rows:
                                        xv = (ts.vload(X[min(r, M - 1), k], L, max(0, min(L, K - k))) if tail
                                              else ts.vload(X[min(r, M - 1), k], L))  # fmt: skip
                                        part[r] = ts.vfma(xv, v, part[r])
                            sv = ts.vbroadcast(s, L)
                            for r in rows:
                                acc[r] = ts.vfma(part[r], sv, acc[r])
                for r in rows:
                    if r < M:
                        Y[r, n] = ts.vsum(acc[r])

    return linear
