"""Channels-last im2col for the GPU, written in tessera: 16-byte stores of dense rows.

Col[p, (u * KW + v) * C + c] = X[n, oh * SH + u * DH - PT, ow * SW + v * DW - PL, c] for the
output pixel p = (n, oh, ow) (zero outside X and in the columns past K = KH * KW * C; Col's
row is K rounded up to a multiple of 8, so rows stay 16-byte aligned for the GEMM and the
OHWI weight, [O, K] in memory, is the matching B).  One thread writes 8 columns of one row
with one 16-byte store: with C a multiple of 8 they are 8 channels of one tap, read with one
16-byte load; otherwise (an RGB stem) 8 consecutive (tap, channel) columns read element by
element, so no column is spent on padding channels.  An element per thread (the generic
compute) is instruction-bound; this runs at memory speed.
"""

from __future__ import annotations

import functools

import tessera as ts
from tessera.ir.dtypes import DataType

VEC = 8  # 16-bit elements per 16-byte copy


def col_width(c: int, taps: int) -> int:
    """Kp: Col's row length for `taps` taps of C channels (a multiple of 8)."""
    return -(-taps * c // VEC) * VEC


@functools.cache
def make_im2col_nhwc(dtype: DataType, channels: int, kernel: tuple[int, int], stride: tuple[int, int],
                     dilation: tuple[int, int], pad: tuple[int, int], out_hw: tuple[int, int],
                     threads: int = 256) -> ts.Kernel:  # fmt: skip
    """The im2col of a (kh, kw) window (stride, dilation, top/left padding, output size) for X
    [N, H, W, C] with C = `channels` and Col [N * OH * OW, col_width(C, kh * kw)] of a 16-bit dtype."""
    (KH, KW), (SH, SW), (DH, DW), (PT, PL), (OH, OW) = kernel, stride, dilation, pad, out_hw
    RUNS = channels % VEC == 0  # 8 columns are 8 channels of one tap
    K = KH * KW * channels
    name = f"im2col_nhwc_{dtype.short}_c{channels}_{KH}x{KW}_s{SH}x{SW}_d{DH}x{DW}_p{PT}x{PL}_o{OH}x{OW}"

    @ts.kernel(target="cuda", name=name)
    def im2col(X: dtype["N", "H", "W", "C"], Col: dtype["P", "KP"]):
        ts.attrs.grid = ts.ceil_div(P * (KP // VEC), threads)
        ts.attrs.block = threads
        i = ts.block_idx.x * threads + ts.thread_idx.x
        if i < P * (KP // VEC):
            q = (i % (KP // VEC)) * VEC
            p = i // (KP // VEC)
            ow = p % OW
            oh = (p // OW) % OH
            n = p // (OW * OH)
            v = ts.register_tensor(dtype, [VEC])
            for j in ts.unroll(VEC):
                v[j] = 0.0
            if RUNS:
                tap = q // C
                hi = oh * SH + (tap // KW) * DH - PT
                wi = ow * SW + (tap % KW) * DW - PL
                if hi >= 0:
                    if hi < H:
                        if wi >= 0:
                            if wi < W:
                                ts.copy_vector(v[0], X[n, hi, wi, q % C], VEC * 2)
            else:
                for j in ts.unroll(VEC):
                    tap2 = (q + j) // C
                    h2 = oh * SH + (tap2 // KW) * DH - PT
                    w2 = ow * SW + (tap2 % KW) * DW - PL
                    if q + j < K:
                        if h2 >= 0:
                            if h2 < H:
                                if w2 >= 0:
                                    if w2 < W:
                                        v[j] = X[n, h2, w2, (q + j) % C]
            ts.copy_vector(Col[p, q], v[0], VEC * 2)

    return im2col
