"""2-D max pooling of NCHW float32 on the CPU, in tessera's kernel language.

One output row at a time, in two passes over a row buffer in registers/L1:
1. vertical: the max of the window's KH input rows, over the whole input width (contiguous
   loads, no condition: gcc vectorises it);
2. horizontal: the max of KW neighbours of that row per output column, where the columns
   whose window lies inside the row run without a bounds clamp (an affine, strided read gcc
   vectorises) and the few at the edges clamp.
A tap in the padding reads the nearest input element instead, which lies in the same window
(padding is at most half the kernel, and every window starts inside the input or its left
padding), so the max is the same as with -inf padding.  Workers take contiguous row ranges.
"""

from __future__ import annotations

import functools

import tessera as ts
from tessera import f32
from tessera.errors import ArgumentError


def interior_columns(w: int, ow: int, kw: int, sw: int, pw: int) -> tuple[int, int]:
    """[lo, hi): the output columns whose KW taps all read inside the input row."""
    lo = min(ow, -(-pw // sw))
    hi = max(lo, min(ow, (w - kw + pw) // sw + 1))
    return lo, hi


@functools.cache
def make_max_pool2d(kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int], width: int,
                    out_width: int, threads: int):  # -> tessera.Kernel  # fmt: skip
    """The kernel for one window geometry and row width: parameters X [NC, H, W] (W = `width`)
    and C [NC, OH, OW] (OW = `out_width`), an NCHW tensor's images and channels as one axis."""

    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    if min(kh, kw, sh, sw, width, out_width, threads) < 1 or not (0 <= 2 * ph <= kh and 0 <= 2 * pw <= kw):
        raise ArgumentError(f"make_max_pool2d: kernel {kernel}, stride {stride}, sizes ({width}, {out_width}) and "
                            f"threads {threads} must be positive and padding {padding} at most half the kernel")  # fmt: skip
    T = threads
    lo, hi = interior_columns(width, out_width, kw, sw, pw)
    taps = tuple(range(1, kh))
    cols = tuple(range(1, kw))

    @ts.kernel(target="cpu", name=f"max_pool2d_{kh}x{kw}_s{sh}x{sw}_p{ph}x{pw}_w{width}_t{T}")
    def max_pool2d(X: f32["NC", "H", "W"], C: f32["NC", "OH", "OW"]):
        rows = NC * OH
        per = ts.ceil_div(rows, T)
        for t in ts.parallel(T):
            row = ts.register_tensor(f32, [width])
            for r in range(t * per, min(rows, t * per + per)):
                nc = r // OH
                y0 = r % OH * sh - ph
                yc = min(max(y0, 0), H - 1)
                for x in range(W):
                    row[x] = X[nc, yc, x]
                for u in taps:
                    yu = min(max(y0 + u, 0), H - 1)
                    for x in range(W):
                        row[x] = max(row[x], X[nc, yu, x])
                for ox in range(lo):
                    m = row[min(max(ox * sw - pw, 0), W - 1)]
                    for v in cols:
                        m = max(m, row[min(max(ox * sw + v - pw, 0), W - 1)])
                    C[nc, r % OH, ox] = m
                for ox in range(lo, hi):
                    m = row[ox * sw - pw]
                    for v in cols:
                        m = max(m, row[ox * sw + v - pw])
                    C[nc, r % OH, ox] = m
                for ox in range(hi, OW):
                    m = row[min(max(ox * sw - pw, 0), W - 1)]
                    for v in cols:
                        m = max(m, row[min(max(ox * sw + v - pw, 0), W - 1)])
                    C[nc, r % OH, ox] = m

    return max_pool2d
