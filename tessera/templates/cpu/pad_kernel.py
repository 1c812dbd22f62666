"""Zero padding of an NCHW float32 tensor for the CPU convolution, in tessera's kernel language.

P[n, c, y, x] = X[n, c, y - top, x - left] inside, 0 in the border.  One output row at a time:
a row of the border is zeroed, an inner row is a zeroed left margin, a contiguous copy of the
input row (no condition in the loop: gcc vectorises it) and a zeroed right margin.  Workers
take contiguous ranges of rows (the convolution's own thread count).
"""

from __future__ import annotations

import functools

import tessera as ts
from tessera import f32
from tessera.errors import ArgumentError


@functools.cache
def make_pad2d(top: int, left: int, threads: int):  # -> tessera.Kernel
    """The padding kernel: parameters X [NC, H, W] and P [NC, HP, WP] (an NCHW tensor's images and
    channels as one axis; HP >= H + top, WP >= W + left: the bottom and right margins are what
    is left)."""

    if top < 0 or left < 0 or threads < 1:
        raise ArgumentError(f"make_pad2d: top and left must be >= 0 and threads >= 1, got {top}, {left}, {threads}")
    T = threads

    @ts.kernel(target="cpu", name=f"pad2d_{top}_{left}_t{threads}")
    def pad2d(X: f32["NC", "H", "W"], P: f32["NC", "HP", "WP"]):
        rows = NC * HP
        per = ts.ceil_div(rows, T)
        for w in ts.parallel(T):
            for r in range(w * per, min(rows, w * per + per)):
                nc = r // HP
                y = r % HP
                yi = y - top
                if yi >= 0 and yi < H:
                    for x in range(left):
                        P[nc, y, x] = 0.0
                    for x in range(W):
                        P[nc, y, left + x] = X[nc, yi, x]
                    for x in range(left + W, WP):
                        P[nc, y, x] = 0.0
                else:
                    for x in range(WP):
                        P[nc, y, x] = 0.0

    return pad2d
