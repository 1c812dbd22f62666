"""Channels-last im2col for the GPU, written in tessera: vector copies of channel runs.

Col[p, tap * CP + c] = X[n, oh * SH + u * DH - PT, ow * SW + v * DW - PL, c] for the output
pixel p = (n, oh, ow) and tap = u * KW + v (zero outside X, for channels c >= C and for the
columns past the last tap).  CP, the channels a tap takes in a Col row, is C itself when C is
a multiple of 8, else C rounded up to a power of two (below 8) or to a multiple of 8, so that
every store is an aligned 2- to 16-byte vector and Col rows stay 16-byte aligned for the
GEMM.  One thread moves min(CP, 8) channels of one tap of one pixel: one vector load when the
run is whole (C == CP), element loads otherwise (an RGB stem), then one vector store.  An
element per thread (the generic compute) is instruction-bound; this runs at memory speed.
"""

from __future__ import annotations

import functools

import tessera as ts
from tessera.ir.dtypes import DataType

MAX_VEC = 8  # 16-bit elements per 16-byte copy


def channels_per_tap(c: int) -> int:
    """CP: the channels one tap takes in a Col row."""
    if c % MAX_VEC == 0:
        return c
    if c < MAX_VEC:
        return 1 << (c - 1).bit_length()
    return -(-c // MAX_VEC) * MAX_VEC


def col_width(c: int, taps: int) -> int:
    """Kp: Col's row length for `taps` taps of C channels (a multiple of 8)."""
    return -(-taps * channels_per_tap(c) // MAX_VEC) * MAX_VEC


@functools.cache
def make_im2col_nhwc(dtype: DataType, channels: int, kernel: tuple[int, int], stride: tuple[int, int],
                     dilation: tuple[int, int], pad: tuple[int, int], out_hw: tuple[int, int],
                     threads: int = 256) -> ts.Kernel:  # fmt: skip
    """The im2col of a (kh, kw) window (stride, dilation, top/left padding, output size) for X
    [N, H, W, C] with C = `channels` and Col [N * OH * OW, col_width(C, kh * kw)] of a 16-bit dtype."""
    (KH, KW), (SH, SW), (DH, DW), (PT, PL), (OH, OW) = kernel, stride, dilation, pad, out_hw
    CP = channels_per_tap(channels)
    VEC = min(CP, MAX_VEC)
    WHOLE = CP == channels
    name = f"im2col_nhwc_{dtype.short}_c{channels}_{KH}x{KW}_s{SH}x{SW}_d{DH}x{DW}_p{PT}x{PL}_o{OH}x{OW}"

    @ts.kernel(target="cuda", name=name)
    def im2col(X: dtype["N", "H", "W", "C"], Col: dtype["P", "KP"]):
        ts.attrs.grid = ts.ceil_div(P * (KP // VEC), threads)
        ts.attrs.block = threads
        i = ts.block_idx.x * threads + ts.thread_idx.x
        if i < P * (KP // VEC):
            q = (i % (KP // VEC)) * VEC
            p = i // (KP // VEC)
            tap = q // CP
            c = q % CP
            ow = p % OW
            oh = (p // OW) % OH
            n = p // (OW * OH)
            hi = oh * SH + (tap // KW) * DH - PT
            wi = ow * SW + (tap % KW) * DW - PL
            v = ts.register_tensor(dtype, [VEC])
            for j in ts.unroll(VEC):
                v[j] = 0.0
            if tap < KH * KW:
                if hi >= 0:
                    if hi < H:
                        if wi >= 0:
                            if wi < W:
                                if WHOLE:
                                    ts.copy_vector(v[0], X[n, hi, wi, c], VEC * 2)
                                else:
                                    for j in ts.unroll(VEC):
                                        if c + j < C:
                                            v[j] = X[n, hi, wi, c + j]
            ts.copy_vector(Col[p, q], v[0], VEC * 2)

    return im2col
