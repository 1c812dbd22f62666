"""Neural-network operators: conv2d, pooling, normalizations and softmax."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tessera.graph.opdefs._common import norm_axis, pads, pair, require_float, upcast
from tessera.graph.registry import REQUIRED, register
from tessera.graph.symbolic import Dim, ShapeError
from tessera.ir import dtypes
from tessera.ops.geometry import check_window, window_output


def _window_out(size: Dim, k: int, s: int, p0: int, p1: int, d: int, ceil_mode: bool = False) -> Dim:
    """tessera.ops.geometry.window_output (torch's rule), a static window larger than the padded
    input a ShapeError."""
    check_window(size, k, p0, p1, d, "", error=ShapeError)
    return window_output(size, k, s, p0, p1, d, ceil_mode)


def _windows(x: np.ndarray, k, s, d, pads, fill, out_hw) -> np.ndarray:
    """All windows of x [N, C, H, W] as [N, C, OH, OW, kh, kw] (a view where possible)."""
    (kh, kw), (sh, sw), (dh, dw) = k, s, d
    pt, pl, pb, pr = pads
    oh, ow = out_hw
    # Extra right/bottom padding so that ceil-mode windows stay in bounds; they never count.
    need_h = (oh - 1) * sh + dh * (kh - 1) + 1
    need_w = (ow - 1) * sw + dw * (kw - 1) + 1
    eb = max(0, need_h - (x.shape[2] + pt + pb))
    er = max(0, need_w - (x.shape[3] + pl + pr))
    if pt or pl or pb or pr or eb or er:
        x = np.pad(x, ((0, 0), (0, 0), (pt, pb + eb), (pl, pr + er)), constant_values=fill)
    win = sliding_window_view(x, (dh * (kh - 1) + 1, dw * (kw - 1) + 1), axis=(2, 3))
    return win[:, :, : (oh - 1) * sh + 1 : sh, : (ow - 1) * sw + 1 : sw, ::dh, ::dw]


# ---- conv2d -------------------------------------------------------------------------------
# layout "NCHW": x [N, C, H, W], weight [O, C/groups, kh, kw] (OIHW), out [N, O, OH, OW];
# layout "NHWC": x [N, H, W, C], weight [O, kh, kw, C/groups] (OHWI), out [N, OH, OW, O] — the
# channels-last form the GPU layout pass gives convolutions (rows of the GEMM are pixels).
CONV_LAYOUTS = ("NCHW", "NHWC")
_TO_NCHW, _TO_NHWC = (0, 3, 1, 2), (0, 2, 3, 1)


def _conv_layout(a) -> str:
    layout = a.get("layout", "NCHW")
    if layout not in CONV_LAYOUTS:
        raise ShapeError(f"conv2d layout must be one of {CONV_LAYOUTS}, got {layout!r}")
    return layout


def _conv_infer(xs, a):
    x, w = xs[0], xs[1]
    nhwc = _conv_layout(a) == "NHWC"
    if x.ndim != 4 or w.ndim != 4:
        what = "NHWC input and OHWI weight" if nhwc else "NCHW input and OIHW weight"
        raise ShapeError(f"conv2d takes {what}, got {x.shape} and {w.shape}")
    xs_shape = tuple(x.shape[i] for i in _TO_NCHW) if nhwc else tuple(x.shape)
    ws_shape = tuple(w.shape[i] for i in _TO_NCHW) if nhwc else tuple(w.shape)
    g = a["groups"]
    if isinstance(xs_shape[1], int) and xs_shape[1] != ws_shape[1] * g:
        raise ShapeError(f"input has {xs_shape[1]} channels, weight expects {ws_shape[1]} x {g} groups")
    if isinstance(ws_shape[0], int) and ws_shape[0] % g:
        raise ShapeError(f"{ws_shape[0]} output channels do not split into {g} groups")
    if len(xs) == 3 and xs[2].shape != (ws_shape[0],):
        raise ShapeError(f"bias shape {xs[2].shape} does not match {ws_shape[0]} output channels")
    (sh, sw), (dh, dw), (pt, pl, pb, pr) = pair(a["stride"], "stride"), pair(a["dilation"], "dilation"), pads(a["padding"])
    oh = _window_out(xs_shape[2], ws_shape[2], sh, pt, pb, dh)
    ow = _window_out(xs_shape[3], ws_shape[3], sw, pl, pr, dw)
    out = (xs_shape[0], oh, ow, ws_shape[0]) if nhwc else (xs_shape[0], ws_shape[0], oh, ow)
    return [(out, x.dtype)]


def _conv_ref(xs, a):
    if _conv_layout(a) == "NHWC":  # the NCHW reference on transposed operands
        nchw = [xs[0].transpose(_TO_NCHW), xs[1].transpose(_TO_NCHW), *xs[2:]]
        return [_conv_ref(nchw, {**a, "layout": "NCHW"})[0].transpose(_TO_NHWC)]
    x, w = upcast(xs[0]), upcast(xs[1])
    n, g = x.shape[0], a["groups"]
    o, cg, kh, kw = w.shape
    s, d, pad = pair(a["stride"], "stride"), pair(a["dilation"], "dilation"), pads(a["padding"])
    oh = _window_out(x.shape[2], kh, s[0], pad[0], pad[2], d[0])
    ow = _window_out(x.shape[3], kw, s[1], pad[1], pad[3], d[1])
    win = _windows(x, (kh, kw), s, d, pad, 0, (oh, ow))  # [N, C, OH, OW, kh, kw]
    og = o // g
    out = np.empty((n, o, oh, ow), dtype=np.result_type(x, w))
    for gi in range(g):
        cols = win[:, gi * cg : (gi + 1) * cg].transpose(0, 2, 3, 1, 4, 5).reshape(n * oh * ow, cg * kh * kw)
        res = cols @ w[gi * og : (gi + 1) * og].reshape(og, -1).T  # [N*OH*OW, og]
        out[:, gi * og : (gi + 1) * og] = res.reshape(n, oh, ow, og).transpose(0, 3, 1, 2)
    if len(xs) == 3:
        out += upcast(xs[2]).reshape(1, -1, 1, 1)
    return [out]


register("conv2d", infer=_conv_infer, reference=_conv_ref, category="anchor", num_inputs=(2, 3),
         attrs={"stride": [1, 1], "padding": [0, 0, 0, 0], "dilation": [1, 1], "groups": 1, "layout": "NCHW"},
         doc="inputs: x [N,C,H,W], weight [O,C/groups,kh,kw], optional bias [O]; padding (top, left, bottom, right); "
             "layout 'NHWC': x [N,H,W,C], weight [O,kh,kw,C/groups], out [N,OH,OW,O]")  # fmt: skip


# ---- pooling ------------------------------------------------------------------------------
def _pool_geometry(a):
    """A pooling's ((kh, kw), (sh, sw), (dh, dw), (top, left, bottom, right)); stride None is the kernel."""
    k = pair(a["kernel"], "kernel")
    return k, pair(a["stride"] or k, "stride"), pair(a.get("dilation", 1), "dilation"), pads(a["padding"])


def _pool_out_hw(shape, a):
    (kh, kw), (sh, sw), (dh, dw), (pt, pl, pb, pr) = _pool_geometry(a)
    oh = _window_out(shape[2], kh, sh, pt, pb, dh, a["ceil_mode"])
    ow = _window_out(shape[3], kw, sw, pl, pr, dw, a["ceil_mode"])
    return oh, ow


def _nchw_shape(shape, a):
    """A pooling input's shape as NCHW (attribute layout 'NHWC': x is [N, H, W, C])."""
    return (shape[0], shape[3], shape[1], shape[2]) if a.get("layout", "NCHW") == "NHWC" else tuple(shape)


def _in_layout(shape, a):
    """An NCHW output shape in the operator's layout."""
    return (shape[0], shape[2], shape[3], shape[1]) if a.get("layout", "NCHW") == "NHWC" else tuple(shape)


def _layout_ref(ref):
    """The NCHW reference `ref` run on NHWC operands when the operator's layout is 'NHWC'."""

    def run(xs, a):
        if a.get("layout", "NCHW") != "NHWC":
            return ref(xs, a)
        (y,) = ref([np.ascontiguousarray(xs[0].transpose(0, 3, 1, 2))], a)
        return [np.ascontiguousarray(y.transpose(0, 2, 3, 1))]

    return run


def _check_layout(a, op):
    if a.get("layout", "NCHW") not in ("NCHW", "NHWC"):
        raise ShapeError(f"{op}: layout must be 'NCHW' or 'NHWC', got {a['layout']!r}")


def _pool_infer(xs, a):
    x = xs[0]
    if x.ndim != 4:
        raise ShapeError(f"2-D pooling takes NCHW (or NHWC) input, got {x.shape}")
    _check_layout(a, "pooling")
    shape = _nchw_shape(x.shape, a)
    return [(_in_layout((shape[0], shape[1], *_pool_out_hw(shape, a)), a), x.dtype)]


def _max_pool_ref(xs, a):
    x = xs[0]
    oh, ow = _pool_out_hw(x.shape, a)
    fill = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
    win = _windows(x, *_pool_geometry(a), fill, (oh, ow))
    return [win.max(axis=(4, 5))]


def _avg_pool_ref(xs, a):
    x = upcast(xs[0])
    oh, ow = _pool_out_hw(x.shape, a)
    k, s, d, pad = _pool_geometry(a)
    total = _windows(x, k, s, d, pad, 0, (oh, ow)).sum(axis=(4, 5))
    # The divisor counts window cells inside the input (plus its padding when
    # count_include_pad); cells added only for ceil mode never count, as in torch.
    h, w = x.shape[2], x.shape[3]
    inside = np.zeros((1, 1, h + pad[0] + pad[2], w + pad[1] + pad[3]), dtype=x.dtype)
    if a["count_include_pad"]:
        inside[:] = 1
    else:
        inside[:, :, pad[0] : pad[0] + h, pad[1] : pad[1] + w] = 1
    count = _windows(inside, k, s, d, (0, 0, 0, 0), 0, (oh, ow)).sum(axis=(4, 5))
    return [total / count]


register("max_pool2d", infer=_pool_infer, reference=_layout_ref(_max_pool_ref), category="reduce",
         attrs={"kernel": [1, 1], "stride": None, "padding": [0, 0, 0, 0], "dilation": [1, 1], "ceil_mode": False,
                "layout": "NCHW"},
         doc="stride None means stride = kernel; padding (top, left, bottom, right) is -inf; layout 'NHWC': x and "
             "the output channels-last")  # fmt: skip
register("avg_pool2d", infer=_pool_infer, reference=_layout_ref(_avg_pool_ref), category="reduce",
         attrs={"kernel": [1, 1], "stride": None, "padding": [0, 0, 0, 0], "dilation": [1, 1], "ceil_mode": False,
                "count_include_pad": True, "layout": "NCHW"})  # fmt: skip


def _adaptive_infer(xs, a):
    x = xs[0]
    if x.ndim != 4:
        raise ShapeError(f"adaptive_avg_pool2d takes NCHW (or NHWC) input, got {x.shape}")
    _check_layout(a, "adaptive_avg_pool2d")
    shape = _nchw_shape(x.shape, a)
    return [(_in_layout((shape[0], shape[1], *pair(a["output_size"], "output_size")), a), x.dtype)]


def _adaptive_ref(xs, a):
    x = upcast(xs[0])
    oh, ow = pair(a["output_size"], "output_size")
    h, w = x.shape[2], x.shape[3]
    out = np.empty((*x.shape[:2], oh, ow), dtype=x.dtype)
    for i in range(oh):
        h0, h1 = (i * h) // oh, -(-((i + 1) * h) // oh)
        for j in range(ow):
            w0, w1 = (j * w) // ow, -(-((j + 1) * w) // ow)
            out[:, :, i, j] = x[:, :, h0:h1, w0:w1].mean(axis=(2, 3))
    return [out]


register("adaptive_avg_pool2d", infer=_adaptive_infer, reference=_layout_ref(_adaptive_ref), category="reduce",
         attrs={"output_size": [1, 1], "layout": "NCHW"})  # fmt: skip


# ---- normalizations -----------------------------------------------------------------------
def _bn_infer(xs, a):
    x = xs[0]
    require_float(x.dtype, "batch_norm")
    if x.ndim < 2:
        raise ShapeError(f"batch_norm needs a channel axis, got shape {x.shape}")
    for t in xs[1:]:
        if t.shape != (x.shape[1],):
            raise ShapeError(f"batch_norm parameter of shape {t.shape}, expected ({x.shape[1]},)")
    return [(x.shape, x.dtype)]


def _bn_ref(xs, a):
    x, mean, var, weight, bias = (upcast(t) for t in xs)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    scale = weight / np.sqrt(var + a["eps"])
    return [x * scale.reshape(shape) + (bias - mean * scale).reshape(shape)]


register("batch_norm", infer=_bn_infer, reference=_bn_ref, category="elementwise", num_inputs=5,
         attrs={"eps": 1e-5}, doc="inference form: inputs x, running_mean, running_var, weight, bias; channels on axis 1")  # fmt: skip


def _norm_infer(xs, a):
    x = xs[0]
    require_float(x.dtype, "normalization")
    k = a["num_axes"]
    if not 1 <= k <= x.ndim:
        raise ShapeError(f"cannot normalize over the last {k} axes of rank {x.ndim}")
    for t in xs[1:]:
        if t.shape != x.shape[x.ndim - k :]:
            raise ShapeError(f"norm parameter of shape {t.shape}, expected {x.shape[x.ndim - k:]}")
    return [(x.shape, x.dtype)]


def _layer_norm_ref(xs, a):
    x = upcast(xs[0])
    axes = tuple(range(x.ndim - a["num_axes"], x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    y = (x - mean) / np.sqrt(var + a["eps"])
    if len(xs) > 1:
        y = y * upcast(xs[1])
    if len(xs) > 2:
        y = y + upcast(xs[2])
    return [y]


def _rms_norm_ref(xs, a):
    x = upcast(xs[0])
    axes = tuple(range(x.ndim - a["num_axes"], x.ndim))
    y = x / np.sqrt((x * x).mean(axis=axes, keepdims=True) + a["eps"])
    if len(xs) > 1:
        y = y * upcast(xs[1])
    return [y]


register("layer_norm", infer=_norm_infer, reference=_layer_norm_ref, category="reduce", num_inputs=(1, 3),
         attrs={"num_axes": 1, "eps": 1e-5}, doc="normalizes over the last num_axes axes; optional weight, bias")  # fmt: skip
register("rms_norm", infer=_norm_infer, reference=_rms_norm_ref, category="reduce", num_inputs=(1, 2),
         attrs={"num_axes": 1, "eps": 1e-6}, doc="x / sqrt(mean(x^2) + eps) * weight over the last num_axes axes")  # fmt: skip


# ---- softmax ------------------------------------------------------------------------------
def _softmax_infer(xs, a):
    require_float(xs[0].dtype, "softmax")
    norm_axis(a["axis"], xs[0].ndim)
    return [(xs[0].shape, xs[0].dtype)]


def _softmax_ref(xs, a):
    x = upcast(xs[0])
    m = np.max(x, axis=a["axis"], keepdims=True)
    e = np.exp(x - np.where(np.isfinite(m), m, 0))
    return [e / e.sum(axis=a["axis"], keepdims=True)]


def _log_softmax_ref(xs, a):
    x = upcast(xs[0])
    m = np.max(x, axis=a["axis"], keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    return [x - m - np.log(np.exp(x - m).sum(axis=a["axis"], keepdims=True))]


register("softmax", infer=_softmax_infer, reference=_softmax_ref, category="reduce", attrs={"axis": -1})
register("log_softmax", infer=_softmax_infer, reference=_log_softmax_ref, category="reduce", attrs={"axis": -1})



# ---- max pooling with indices (N-d) -------------------------------------------------------
def _nd_pool_geometry(shape, a):
    n = len(a["kernel"])
    k, s, d, p = a["kernel"], a["stride"], a["dilation"], a["pads"]
    outs = [_window_out(shape[2 + i], k[i], s[i], p[i], p[n + i], d[i], a["ceil_mode"]) for i in range(n)]
    return n, k, s, d, p, outs


def _max_pool_indices_infer(xs, a):
    x = xs[0]
    n, *_, outs = _nd_pool_geometry(x.shape, a)
    if x.ndim != n + 2:
        raise ShapeError(f"{n}-D max pooling takes [N, C, {n} spatial] input, got {x.shape}")
    shape = (x.shape[0], x.shape[1], *outs)
    return [(shape, x.dtype), (shape, dtypes.int64)]


def _max_pool_indices_ref(xs, a):
    x = xs[0]
    n, k, s, d, p, outs = _nd_pool_geometry(x.shape, a)
    spatial = x.shape[2:]
    values = np.empty((*x.shape[:2], *outs), x.dtype)
    index = np.empty(values.shape, np.int64)
    # flat positions of the input (row-major, or column-major over the spatial axes with storage_order 1)
    strides_rm = np.cumprod([1, *spatial[::-1]])[:-1][::-1]
    strides_cm = np.cumprod([1, *spatial])[:-1]
    pos_strides = strides_cm if a["storage_order"] else strides_rm
    fill = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
    for out in np.ndindex(*outs):
        starts = [out[i] * s[i] - p[i] for i in range(n)]
        cells = [np.arange(starts[i], starts[i] + d[i] * (k[i] - 1) + 1, d[i]) for i in range(n)]
        grid = np.stack(np.meshgrid(*cells, indexing="ij"), -1).reshape(-1, n)
        ok = np.all((grid >= 0) & (grid < np.array(spatial)), axis=1)
        grid = grid[ok]
        flat = x.reshape(*x.shape[:2], -1)[:, :, (grid * strides_rm).sum(1)]
        flat = np.where(np.isnan(flat), fill, flat) if x.dtype.kind == "f" else flat
        best = np.argmax(flat, axis=2)
        sel = (slice(None), slice(None), *out)
        values[sel] = np.take_along_axis(flat, best[..., None], 2)[..., 0]
        plane = np.arange(x.shape[0] * x.shape[1]).reshape(x.shape[:2]) * int(np.prod(spatial))
        index[sel] = plane + (grid[best] * pos_strides).sum(-1)
    return [values, index]


register("max_pool_with_indices", infer=_max_pool_indices_infer, reference=_max_pool_indices_ref, category="opaque",
         attrs={"kernel": REQUIRED, "stride": REQUIRED, "pads": REQUIRED, "dilation": REQUIRED, "ceil_mode": False,
                "storage_order": 0},
         doc="N-d max pooling and the flat index of each maximum (ONNX MaxPool's Indices; pads: begins then ends)")  # fmt: skip
