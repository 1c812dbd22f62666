"""Channels-last im2col for the GPU, written in tessera: 16-byte copies of channel runs.

Col[p, (u * KW + v) * C + c] = X[n, oh * SH + u * DH - PT, ow * SW + v * DW - PL, c] for the
output pixel p = (n, oh, ow) (zero outside X).  One thread moves 8 channels (16 bytes) of one
tap of one pixel: a vector load into registers (skipped in the padding) and a vector store,
so the copy runs at memory speed where an element per thread is instruction-bound.  C must
be a multiple of 8 (the caller's other path handles the rest, e.g. an RGB stem).
"""

from __future__ import annotations

import functools

import tessera as ts
from tessera.ir.dtypes import DataType

VEC = 8  # 16-bit elements per 16-byte copy


@functools.cache
def make_im2col_nhwc(dtype: DataType, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int],
                     pad: tuple[int, int], out_hw: tuple[int, int], threads: int = 256) -> ts.Kernel:  # fmt: skip
    """The im2col of a (kh, kw) window with the given stride, dilation, top/left padding and
    output size, for X [N, H, W, C] and Col [N * OH * OW, KH * KW * C] of a 16-bit `dtype`."""
    (KH, KW), (SH, SW), (DH, DW), (PT, PL), (OH, OW) = kernel, stride, dilation, pad, out_hw
    name = f"im2col_nhwc_{dtype.short}_{KH}x{KW}_s{SH}x{SW}_d{DH}x{DW}_p{PT}x{PL}_o{OH}x{OW}"

    @ts.kernel(target="cuda", name=name)
    def im2col(X: dtype["N", "H", "W", "C"], Col: dtype["P", "KP"]):
        ts.attrs.grid = ts.ceil_div(P * (KH * KW) * (C // VEC), threads)
        ts.attrs.block = threads
        i = ts.block_idx.x * threads + ts.thread_idx.x
        if i < P * (KH * KW) * (C // VEC):
            c = (i % (C // VEC)) * VEC
            tap = (i // (C // VEC)) % (KH * KW)
            p = i // ((C // VEC) * (KH * KW))
            ow = p % OW
            oh = (p // OW) % OH
            n = p // (OW * OH)
            hi = oh * SH + (tap // KW) * DH - PT
            wi = ow * SW + (tap % KW) * DW - PL
            v = ts.register_tensor(dtype, [VEC])
            for j in ts.unroll(VEC):
                v[j] = 0.0
            if hi >= 0:
                if hi < H:
                    if wi >= 0:
                        if wi < W:
                            ts.copy_vector(v[0], X[n, hi, wi, c], 16)
            ts.copy_vector(Col[p, tap * C + c], v[0], 16)

    return im2col
