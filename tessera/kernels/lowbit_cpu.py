"""Low-bit linear layers on the CPU, written in tessera.

* `make_linear_cpu(wtype, has_zeros)`: Y[m, n] = sum_k X[m, k] * (W[n, k] - Z[n, g]) * S[n, g]
  in float32 from packed-tensor loads (any type: the generated code extracts each field,
  tessera.quant.codecs); the CPU path of the quantized-linear op and the reference for the GPU
  kernels;
* `make_linear_rows(...)`: the same from the row layout (`row_planes`), decoded per tile of rows
  into float32 and summed with SIMD vectors (the graph operator's CPU kernel).

(The CUDA prefill path dequantises the tensor-core words: tessera.kernels.lowbit_dequant.)
"""

from __future__ import annotations

import functools

import tessera as ts
from tessera import f16, f32, i32, u32
from tessera.ir import lowbit
from tessera.ir.dtypes import DataType


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


ROW_BLOCK = 256  # k per block of the row layout (the tensor-core layout's padded K is a multiple of it)


def row_planes(bits: int) -> list[tuple[int, int, int]]:
    """(width p, first word in a block, lowest code bit) of each plane of the row layout: a block
    of 256 codes is 8 * bits words, plane p taking 8p of them (tessera.ir.lowbit.planes: 8, 4,
    2, 1 bits, the high code bits in the widest); field i of word j of a plane holds k = i*8p + j."""
    out, word, low = [], 0, bits
    for p in lowbit.planes(bits):
        low -= p
        out.append((p, word, low))
        word += 8 * p
    return out


@functools.cache
def make_linear_rows(wtype: DataType, group: int, has_bias: bool, lanes: int, threads: int, mr: int = 4,
                     nr: int = 4) -> ts.Kernel:  # fmt: skip
    """Y[m, n] = sum_k X[m, k] * W[n, k] on the CPU, W[n, k] = (L(u) - bias[n, g]) * S[n, g], from
    codes u in the row layout (`row_planes`: Wr [N, KB * 8 * bits] uint32, KB = ceil(K / 256)).

    L(u) is u for the integers and decode(u) * 2**-float_shift for the small floats (the scales
    carry the power, as in the tensor-core layout), computed from the code's fields (no table
    gather); without `has_bias` the integers subtract the signed types' offset.  Workers take tiles of `nr` rows of W: each row is
    decoded into the worker's float32 buffer Wf, a run of k that lies in one field of every plane
    at a time (RUNS; 3 bits and runs crossing a group go through the code buffer U, plane by
    plane, then group by group), then `mr` x `nr` float32 vector sums run over K (vload/vfma,
    the tail masked).  U and Wf are [threads, nr * KB * 256] workspaces."""
    BITS, GS, NR, MR, LANES, IS_FLOAT = wtype.nbits, group, nr, mr, lanes, wtype.is_float
    offset = float(lowbit.code_offset(wtype))
    planes = row_planes(BITS)
    (p0, base0, low0), rest = planes[0], planes[1:]
    W0, MASK0 = 8 * p0, (1 << p0) - 1
    FIRST = tuple((i * W0, i * p0) for i in range(32 // p0))  # (k offset, shift) of each field
    REST = tuple((i * 8 * p, 8 * p, base, i * p, (1 << p) - 1, low) for p, base, low in rest for i in range(32 // p))
    # A run of RUN k (8 times the narrowest plane) lies in one field of one run of words in every
    # plane: (k offset, then each plane's first word in the block and shift), padded to 3 planes.
    # Decoded straight to float32 where a run never crosses a group, but for 3 bits (planes of 2
    # and 1), whose U pass measured faster: one thread, N = K = 4096, M = 1, against the U pass
    # int5 3.8 / 8.6 ms, int6 3.2 / 8.6, int7 7.1 / 21, e2m3 6.7 / 10.4, int3 5.7 / 3.9
    # (bench/results/2026-11-28-cpu-lowbit-rows.md).
    NP, RUN = len(planes), 8 * min(p for p, _, _ in planes)
    (M1, L1), (M2, L2) = [((1 << p) - 1, low) for p, _, low in planes[1:]] + [(0, 0)] * (3 - NP)
    RUNS = tuple((k0, *(v for p, base, _ in planes for v in (base + k0 % (8 * p), k0 // (8 * p) * p)),
                  *((0, 0) * (3 - NP))) for k0 in range(0, ROW_BLOCK, RUN))  # fmt: skip
    FUSED = group % RUN == 0 and BITS != 3
    # small floats: sign, exponent e and mantissa from the code, value (hidden bit | mantissa) *
    # 2**(max(e, 1) - bias - mbits) (e = 0: subnormal), the constant power folded into the scale
    # with the layout's 2**-float_shift (NaN and inf codes, which quantisation never makes, read finite)
    FM = wtype.mantissa_bits if IS_FLOAT else 0
    FMM, FHID, FSIGN = (1 << FM) - 1, 1 << FM, 1 << (BITS - 1)
    FMAG = FSIGN - 1
    FSCALE = 2.0 ** -((1 << (wtype.exponent_bits - 1)) - 1 + FM + lowbit.float_shift(wtype)) if IS_FLOAT else 1.0
    rows, cols = tuple(range(mr)), tuple(range(nr))
    from tessera.ir.vector import vector_type

    vt = vector_type(f32, lanes)
    name = f"lowbit_rows_{wtype.name}_g{group}{'_b' if has_bias else ''}_{mr}x{nr}_l{lanes}_t{threads}"

    @ts.kernel(target="cpu", name=name)
    def linear(X: f32["M", "K"], Wr: u32["N", "RW"], S: f16["N", "G"], B: f16["NB", "GB"], Y: f32["M", "N"],
               U: u32["WT", "KU"], Wf: f32["WT", "KF"]):  # fmt: skip
        tiles = ts.ceil_div(N, NR)
        per = ts.ceil_div(tiles, threads)
        kp = ts.ceil_div(K, 256) * 256
        for w in ts.parallel(threads):
            for tile in range(w * per, min(tiles, w * per + per)):
                for c in cols:
                    n = min(tile * NR + c, N - 1)
                    if FUSED:  # each run of k in one group: decode straight to float32
                        last = -1  # the group whose scale (and bias) s (and b) hold: converted once a group
                        s = 0.0
                        b = offset  # (the integers without a bias subtract the signed types' offset)
                        for kb in range(kp // 256):
                            src = kb * 8 * BITS
                            for ko, w0, s0, w1, s1, w2, s2 in RUNS:
                                g = min((kb * 256 + ko) // GS, G - 1)  # (runs past K are never read)
                                if g != last:
                                    s = ts.cast(S[n, g], f32) * FSCALE
                                    if has_bias:
                                        b = ts.cast(B[n, g], f32)
                                    last = g
                                for j in range(RUN):
                                    u = ((Wr[n, src + w0 + j] >> s0) & MASK0) << low0
                                    if NP > 1:
                                        u = u | (((Wr[n, src + w1 + j] >> s1) & M1) << L1)
                                    if NP > 2:
                                        u = u | (((Wr[n, src + w2 + j] >> s2) & M2) << L2)
                                    if IS_FLOAT:
                                        mag = u & FMAG
                                        e = mag >> FM
                                        mf = ts.select(e == 0, mag & FMM, (mag & FMM) | FHID)
                                        p2 = ts.cast(1, u32) << max(e, ts.cast(1, u32))
                                        v = ts.cast(mf, f32) * ts.cast(p2, f32) * s
                                        Wf[w, c * kp + kb * 256 + ko + j] = ts.select((u & FSIGN) != 0, -v, v)
                                    else:
                                        Wf[w, c * kp + kb * 256 + ko + j] = (ts.cast(ts.cast(u, i32), f32) - b) * s
                    else:
                        for kb in range(kp // 256):
                            src = kb * 8 * BITS
                            dst = c * kp + kb * 256
                            for ko, sh in FIRST:
                                for j in range(W0):
                                    U[w, dst + ko + j] = ((Wr[n, src + base0 + j] >> sh) & MASK0) << low0
                            for ko, wp, base, sh, mask, low in REST:
                                for j in range(wp):
                                    field = ((Wr[n, src + base + j] >> sh) & mask) << low
                                    U[w, dst + ko + j] = U[w, dst + ko + j] | field
                        for g in range(G):
                            s = ts.cast(S[n, g], f32) * FSCALE
                            if IS_FLOAT:
                                for k in range(g * GS, min(g * GS + GS, K)):
                                    u = U[w, c * kp + k]
                                    mag = u & FMAG
                                    e = mag >> FM
                                    mf = ts.select(e == 0, mag & FMM, (mag & FMM) | FHID)
                                    p2 = ts.cast(1, u32) << max(e, ts.cast(1, u32))
                                    v = ts.cast(mf, f32) * ts.cast(p2, f32) * s
                                    Wf[w, c * kp + k] = ts.select((u & FSIGN) != 0, -v, v)
                            elif has_bias:
                                b = ts.cast(B[n, g], f32)
                                for k in range(g * GS, min(g * GS + GS, K)):
                                    Wf[w, c * kp + k] = (ts.cast(U[w, c * kp + k], f32) - b) * s
                            else:
                                for k in range(g * GS, min(g * GS + GS, K)):
                                    Wf[w, c * kp + k] = (ts.cast(U[w, c * kp + k], f32) - offset) * s
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
