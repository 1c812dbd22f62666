"""Sampling at computed coordinates: GridSample, DeformConv and RoiAlign, decomposed into
gathers and elementwise arithmetic.

`sample` reads x [N, C, spatial...] at fractional coordinates given per spatial axis (tensors
[N, points]): per axis it makes the taps (1 nearest, 2 linear, 4 cubic) with their weights,
maps out-of-range taps by the padding mode (zeros masks them, border clamps, reflection
mirrors at the borders), then combines one tap per axis into a flat index, gathers every
channel at once (`gather_elements`) and sums the weighted values.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from tessera.errors import UnsupportedError
from tessera.frontend.onnx.importer import rule
from tessera.graph import Tensor

CUBIC_A = -0.75


def _reflect(im, v: Tensor, lo: float, hi: float) -> Tensor:
    """v mirrored at lo and hi until it lies between them (ONNX GridSample's reflection)."""
    rng = hi - lo
    if rng <= 0:
        return im.op("full", shape=list(v.shape), value=lo, dtype=v.dtype.name)
    s = lambda c: im.scalar(c, v)  # noqa: E731
    below, above = im.op("lt", v, s(lo)), im.op("gt", v, s(hi))
    dx = im.op("where", below, im.op("sub", s(lo), v), im.op("sub", v, s(hi)))
    n = im.op("floor", im.op("div", dx, s(rng)))
    r = im.op("sub", dx, im.op("mul", n, s(rng)))
    even = im.op("eq", im.op("remainder", n, s(2.0)), s(0.0))
    from_lo, from_hi = im.op("add", s(lo), r), im.op("sub", s(hi), r)
    low_side = im.op("where", even, from_lo, from_hi)
    high_side = im.op("where", even, from_hi, from_lo)
    return im.op("where", below, low_side, im.op("where", above, high_side, v))


def _cubic_weights(im, t: Tensor) -> list[Tensor]:
    """Keys' cubic convolution weights of the 4 taps around a point at fraction t."""
    a = CUBIC_A
    s = lambda c: im.scalar(c, t)  # noqa: E731

    def near(x):  # |x| <= 1
        return im.op("add", im.op("mul", im.op("mul", im.op("sub", im.op("mul", s(a + 2), x), s(a + 3)), x), x), s(1.0))

    def far(x):  # 1 < |x| < 2
        inner = im.op("add", im.op("mul", im.op("sub", im.op("mul", s(a), x), s(5 * a)), x), s(8 * a))
        return im.op("sub", im.op("mul", inner, x), s(4 * a))

    one_minus = im.op("sub", s(1.0), t)
    return [far(im.op("add", t, s(1.0))), near(t), near(one_minus), far(im.op("add", one_minus, s(1.0)))]


def sample(im, x: Tensor, coords: list[Tensor], mode: str, padding: str, borders: list[tuple[float, float]],
           combine: str = "add") -> Tensor:  # fmt: skip
    """x [N, C, d_0..d_k] at the points coords[i] [N, P] (axis i's fractional index): [N, C, P].
    combine="maximum" takes the largest weighted tap instead of their sum (RoiAlign's max mode)."""
    dims = list(x.shape[2:])
    if not all(isinstance(d, int) for d in dims):
        raise UnsupportedError("sampling a tensor of symbolic spatial sizes")
    axes_taps = []
    for c, d, (lo, hi) in zip(coords, dims, borders):
        if padding == "border":
            outside = im.op("logical_or", im.op("lt", c, im.scalar(lo, c)), im.op("gt", c, im.scalar(hi, c)))
            c = im.op("where", outside, im.op("clamp", c, min=0.0, max=float(d - 1)), c)
        elif padding == "reflection":
            c = _reflect(im, c, lo, hi)
        if mode == "nearest":
            taps = [(im.op("round", c), None)]
        else:
            base = im.op("floor", c)
            t = im.op("sub", c, base)
            if mode == "linear":
                weights = [im.op("sub", im.scalar(1.0, t), t), t]
                offsets = [0, 1]
            else:
                weights = _cubic_weights(im, t)
                offsets = [-1, 0, 1, 2]
            taps = [(im.op("add", base, im.scalar(o, base)), w) for o, w in zip(offsets, weights)]
        axis_taps = []
        for pos, w in taps:
            if padding == "reflection":
                pos = im.op("floor", _reflect(im, pos, lo, hi))  # as ONNX: the tap index mirrored, then truncated
            valid = im.op("logical_and", im.op("ge", pos, im.scalar(0, pos)), im.op("le", pos, im.scalar(d - 1, pos)))
            idx = im.op("cast", im.op("clamp", pos, min=0.0, max=float(d - 1)), dtype="int64")
            axis_taps.append((idx, w, valid if padding == "zeros" else None))
        axes_taps.append(axis_taps)
    n, ch = x.shape[0], x.shape[1]
    points = coords[0].shape[1]
    flat = im.op("reshape", x, shape=[n, ch, int(np.prod(dims))])
    ct = "float64" if x.dtype.name == "float64" else "float32"
    if flat.dtype.name != ct:
        flat = im.op("cast", flat, dtype=ct)
    total = None
    strides = [int(np.prod(dims[i + 1 :])) for i in range(len(dims))]
    for combo in itertools.product(*axes_taps):
        index, weight, valid = None, None, None
        for (idx, w, ok), stride in zip(combo, strides):
            term = im.op("mul", idx, im.scalar(stride, idx)) if stride != 1 else idx
            index = term if index is None else im.op("add", index, term)
            if w is not None:
                weight = w if weight is None else im.op("mul", weight, w)
            if ok is not None:
                valid = ok if valid is None else im.op("logical_and", valid, ok)
        gathered = im.op("gather_elements", flat, im.op("expand", im.op("unsqueeze", index, axes=[1]),
                                                        shape=[n, ch, points]), axis=2)  # fmt: skip
        if weight is not None:
            gathered = im.op("mul", gathered, im.op("unsqueeze", im.op("cast", weight, dtype=ct), axes=[1]))
        if valid is not None:
            gathered = im.op("where", im.op("unsqueeze", valid, axes=[1]), gathered, im.scalar(0.0, gathered))
        total = gathered if total is None else im.op(combine, total, gathered)
    return total


@rule("GridSample", attrs=("align_corners", "mode", "padding_mode"))
def _grid_sample(im, node, args, attrs):
    x, grid = im.tensor(args[0]), im.tensor(args[1])
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(attrs.get("mode", b"linear").decode(),
                                                          attrs.get("mode", b"linear").decode())  # fmt: skip
    if mode not in ("nearest", "linear", "cubic"):
        raise UnsupportedError(f"attribute mode={mode!r} is not supported")
    padding = attrs.get("padding_mode", b"zeros").decode()
    if padding not in ("zeros", "border", "reflection"):
        raise UnsupportedError(f"attribute padding_mode={padding!r} is not supported")
    align = bool(attrs.get("align_corners", 0))
    k = x.ndim - 2
    out = list(grid.shape[1:-1])
    g = grid if grid.dtype.name in ("float32", "float64") else im.op("cast", grid, dtype="float32")
    g = im.op("reshape", g, shape=[grid.shape[0], -1, k])
    coords, borders = [], []
    for i, d in enumerate(x.shape[2:]):
        # the grid lists coordinates innermost axis first: (x, y) for an image
        c = im.op("squeeze", im.op("slice", g, axes=[2], starts=[k - 1 - i], ends=[k - i], steps=[1]), axes=[2])
        one = im.scalar(1.0, c)
        if align:
            c = im.op("mul", im.op("div", im.op("add", c, one), im.scalar(2.0, c)), im.scalar(d - 1, c))
            borders.append((0.0, float(d - 1)))
        else:
            c = im.op("div", im.op("sub", im.op("mul", im.op("add", c, one), im.scalar(d, c)), one), im.scalar(2.0, c))
            borders.append((-0.5, d - 0.5))
        coords.append(c)
    y = sample(im, x, coords, mode, padding, borders)
    y = im.op("reshape", y, shape=[x.shape[0], x.shape[1], *out])
    return y if y.dtype == x.dtype else im.op("cast", y, dtype=x.dtype.name)


@rule("DeformConv", attrs=("dilations", "group", "kernel_shape", "offset_group", "pads", "strides"))
def _deform_conv(im, node, args, attrs):
    """Convolution whose kernel taps are moved by per-position offsets (bilinear, zeros outside):
    the sampled columns [N, C*k, L] times the grouped weights."""
    x, w, offset = im.tensor(args[0]), im.tensor(args[1]), im.tensor(args[2])
    bias = args[3] if len(args) > 3 and args[3] is not None else None
    mask = args[4] if len(args) > 4 and args[4] is not None else None
    if x.ndim != 4:
        raise UnsupportedError(f"{x.ndim - 2}-D DeformConv (2-D is supported)")
    n, c, ih, iw = x.shape
    o = w.shape[0]
    kh, kw = [int(v) for v in w.shape[2:]]
    groups, og = int(attrs.get("group", 1)), int(attrs.get("offset_group", 1))
    sh, sw = attrs.get("strides", [1, 1])
    dh, dw = attrs.get("dilations", [1, 1])
    pads = list(attrs.get("pads", [0, 0, 0, 0]))
    oh, ow = offset.shape[2], offset.shape[3]
    taps, points = kh * kw, oh * ow
    # base positions [kh, kw, oh, ow] per axis, plus the offsets [N, og, kh, kw, 2, oh, ow]
    ky, kx = np.meshgrid(np.arange(kh) * dh, np.arange(kw) * dw, indexing="ij")
    oy, ox = np.meshgrid(np.arange(oh) * sh - pads[0], np.arange(ow) * sw - pads[1], indexing="ij")
    base_y = (ky[:, :, None, None] + oy[None, None]).astype(np.float32)
    base_x = (kx[:, :, None, None] + ox[None, None]).astype(np.float32)
    off = im.op("reshape", im.op("cast", offset, dtype="float32"), shape=[n, og, kh, kw, 2, oh, ow])

    def coord(axis: int, base: np.ndarray) -> Tensor:
        part = im.op("squeeze", im.op("slice", off, axes=[4], starts=[axis], ends=[axis + 1], steps=[1]), axes=[4])
        return im.op("reshape", im.op("add", part, Tensor.constant(base)), shape=[n * og, taps * points])

    grouped = im.op("reshape", x, shape=[n * og, c // og, ih, iw])
    cols = sample(im, grouped, [coord(0, base_y), coord(1, base_x)], "linear", "zeros",
                  [(0.0, float(ih - 1)), (0.0, float(iw - 1))])  # [N*og, C/og, taps*points]  # fmt: skip
    cols = im.op("reshape", cols, shape=[n, og, c // og, taps, points])
    if mask is not None:
        m = im.op("reshape", im.op("cast", mask, dtype=cols.dtype.name), shape=[n, og, 1, taps, points])
        cols = im.op("mul", cols, m)
    cols = im.op("reshape", cols, shape=[n, groups, (c // groups) * taps, points])
    wg = im.op("reshape", im.op("cast", w, dtype=cols.dtype.name), shape=[groups, o // groups, (c // groups) * taps])
    y = im.op("reshape", im.op("matmul", wg, cols), shape=[n, o, oh, ow])
    if bias is not None:
        y = im.op("add", y, im.op("reshape", im.op("cast", bias, dtype=y.dtype.name), shape=[1, -1, 1, 1]))
    return y if y.dtype == x.dtype else im.op("cast", y, dtype=x.dtype.name)


@rule("RoiAlign", attrs=("coordinate_transformation_mode", "mode", "output_height", "output_width",
                         "sampling_ratio", "spatial_scale"))  # fmt: skip
def _roi_align(im, node, args, attrs):
    """Average (or max) of bilinear samples on a grid inside each bin of each region.  With
    sampling_ratio 0 the grid adapts to each region's size: the regions must then be known."""
    x, rois, batch_idx = im.tensor(args[0]), args[1], im.tensor(args[2])
    oh, ow = int(attrs.get("output_height", 1)), int(attrs.get("output_width", 1))
    scale = float(attrs.get("spatial_scale", 1.0))
    ratio = int(attrs.get("sampling_ratio", 0))
    half = 0.5 if attrs.get("coordinate_transformation_mode", b"half_pixel") == b"half_pixel" else 0.0
    mode = attrs.get("mode", b"avg").decode()
    if ratio <= 0:
        r = im.const_array(rois, "RoiAlign rois (sampling_ratio 0 adapts the samples to each region)")
        sizes = np.maximum((r[:, 2:] - r[:, :2]) * scale, 0.0 if half else 1.0)
        ry = int(np.max(np.ceil(sizes[:, 1] / oh))) if len(r) else 1
        rx = int(np.max(np.ceil(sizes[:, 0] / ow))) if len(r) else 1
        if not (np.all(np.ceil(sizes[:, 1] / oh) == ry) and np.all(np.ceil(sizes[:, 0] / ow) == rx)):
            raise UnsupportedError("RoiAlign with sampling_ratio 0 over regions that need different sample counts")
    else:
        ry = rx = ratio
    rois = im.tensor(rois)
    k = rois.shape[0]
    ct = "float32" if x.dtype.name != "float64" else "float64"
    r = im.op("cast", rois, dtype=ct) if rois.dtype.name != ct else rois
    parts = [im.op("squeeze", im.op("slice", r, axes=[1], starts=[i], ends=[i + 1], steps=[1]), axes=[1]) for i in range(4)]
    x0, y0, x1, y1 = [im.op("sub", im.op("mul", p, im.scalar(scale, p)), im.scalar(half, p)) for p in parts]
    w_roi, h_roi = im.op("sub", x1, x0), im.op("sub", y1, y0)
    if not half:  # legacy mode: regions at least one pixel
        w_roi, h_roi = im.op("clamp", w_roi, min=1.0), im.op("clamp", h_roi, min=1.0)
    # sample positions: bin b, sample s -> start + (b + (s + 0.5) / ratio) * size / out
    fy = ((np.arange(oh)[:, None] + (np.arange(ry)[None, :] + 0.5) / ry) / oh).reshape(-1).astype(ct)
    fx = ((np.arange(ow)[:, None] + (np.arange(rx)[None, :] + 0.5) / rx) / ow).reshape(-1).astype(ct)
    ys = im.op("add", im.op("unsqueeze", y0, axes=[1]), im.op("mul", im.op("unsqueeze", h_roi, axes=[1]), Tensor.constant(fy)))
    xs = im.op("add", im.op("unsqueeze", x0, axes=[1]), im.op("mul", im.op("unsqueeze", w_roi, axes=[1]), Tensor.constant(fx)))
    yy = im.op("reshape", im.op("expand", im.op("unsqueeze", ys, axes=[2]), shape=[k, oh * ry, ow * rx]), shape=[k, -1])
    xx = im.op("reshape", im.op("expand", im.op("unsqueeze", xs, axes=[1]), shape=[k, oh * ry, ow * rx]), shape=[k, -1])
    per_roi = im.op("take", x, im.op("cast", batch_idx, dtype="int64"), axis=0)  # [K, C, H, W]
    vals = _roi_bilinear(im, per_roi, yy, xx, "maximum" if mode == "max" else "add")  # [K, C, oh*ry*ow*rx]
    vals = im.op("reshape", vals, shape=[k, x.shape[1], oh, ry, ow, rx])
    if mode == "avg":
        y = im.op("reduce_mean", vals, axes=[3, 5], keepdim=False)
    elif mode == "max":
        y = im.op("reduce_max", vals, axes=[3, 5], keepdim=False)
    else:
        raise UnsupportedError(f"attribute mode={mode!r} is not supported")
    return y if y.dtype == x.dtype else im.op("cast", y, dtype=x.dtype.name)


def _roi_bilinear(im, x: Tensor, ys: Tensor, xs: Tensor, combine: str) -> Tensor:
    """RoiAlign's bilinear sample: points more than one pixel outside give 0, coordinates below 0
    read row/column 0, and past the last row/column read the last one."""
    h, w = x.shape[2], x.shape[3]
    outside = im.op("logical_or", im.op("logical_or", im.op("lt", ys, im.scalar(-1.0, ys)), im.op("gt", ys, im.scalar(float(h), ys))),
                    im.op("logical_or", im.op("lt", xs, im.scalar(-1.0, xs)), im.op("gt", xs, im.scalar(float(w), xs))))  # fmt: skip
    yc = im.op("clamp", ys, min=0.0, max=float(h - 1))
    xc = im.op("clamp", xs, min=0.0, max=float(w - 1))
    y = sample(im, x, [yc, xc], "linear", "border", [(-math.inf, math.inf), (-math.inf, math.inf)], combine)
    return im.op("where", im.op("unsqueeze", outside, axes=[1]), im.scalar(0.0, y), y)
