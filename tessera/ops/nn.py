"""Neural-network operators as compute definitions: conv2d, max/avg pooling (incl. adaptive average
pooling) in NCHW, and the rotary position embedding pieces.

conv2d and pooling are correct, direct definitions (each output element loops over its window);
they are scheduled as contractions and are slow next to a tuned template.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tessera.errors import ArgumentError, UnsupportedError
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.compute import Compute, TensorNode, compute, fresh_name, reduce
from tessera.ops.common import (
    check_float,
    check_tensor,
    compute_type,
    dim_str,
    promote_types,
    same_dim,
    size_expr,
    size_of,
    static,
)
from tessera.ops.creation import causal_mask
from tessera.ops.elementwise import add, mul, neg, where
from tessera.ops.geometry import check_window, pair, window_output
from tessera.ops.linalg import matmul
from tessera.ops.reductions import softmax
from tessera.ops.transform import concat, slice, transpose


def _out_size(n: E.Expr, k: int, s: int, p: int, d: int, op: str, ceil_mode: bool = False) -> E.Expr:
    """Output length of a window of k taps (dilation d) sliding with stride s over n + 2p
    (tessera.ops.geometry.window_output, as a dimension expression)."""
    size = size_of(n)
    if size is None:
        raise ArgumentError(f"{op}: input size {n} is not a size expression")
    check_window(size, k, p, p, d, op)
    out = window_output(size, k, s, p, p, d, ceil_mode)
    return E.Const(out, dtypes.int32) if isinstance(out, int) else size_expr(out, [n])


def _check_nchw(x: TensorNode, op: str) -> None:
    check_tensor(x, op)
    if x.rank != 4:
        raise ArgumentError(f"{op}: expects a 4-D NCHW input, got '{x.name}' of shape {dim_str(x.shape)}")


def conv2d(x: TensorNode, weight: TensorNode, bias: TensorNode | None = None, stride: int | Sequence[int] = 1,
           padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, groups: int = 1) -> TensorNode:  # fmt: skip
    """2-D convolution, NCHW input and OIHW weight (cross-correlation, as torch), zero padding."""
    _check_nchw(x, "conv2d")
    check_tensor(weight, "conv2d", "weight")
    if weight.rank != 4:
        raise ArgumentError(f"conv2d: weight must be 4-D [out_channels, in_channels/groups, kh, kw], got {dim_str(weight.shape)}")
    sh, sw = pair(stride, "stride", "conv2d")
    ph, pw = pair(padding, "padding", "conv2d")
    dh, dw = pair(dilation, "dilation", "conv2d")
    kh, kw = static(weight.shape[2]), static(weight.shape[3])
    cin_g, cout = static(weight.shape[1]), static(weight.shape[0])
    if None in (kh, kw, cin_g, cout):
        raise UnsupportedError("conv2d: the weight's shape must be static")
    if groups < 1 or cout % groups:
        raise ArgumentError(f"conv2d: out_channels {cout} must be a multiple of groups={groups}")
    cin = static(x.shape[1])
    if cin is None or cin != cin_g * groups:
        raise ArgumentError(f"conv2d: input has {x.shape[1]} channels but weight expects {cin_g} x groups={groups}")
    t = promote_types(x.dtype, weight.dtype, "conv2d")
    if not t.is_float:
        raise UnsupportedError(f"conv2d: needs floating-point operands, got {t}")
    acc = compute_type(t)
    oh = _out_size(x.shape[2], kh, sh, ph, dh, "conv2d")
    ow = _out_size(x.shape[3], kw, sw, pw, dw, "conv2d")
    cout_g = cout // groups

    def fn(i, r) -> E.Expr:
        n, o, y, xx = i
        c, u, v = r
        ci = (o // cout_g) * cin_g + c if groups > 1 else c
        h = y * sh + u * dh - ph
        w = xx * sw + v * dw - pw
        inside = E.Binary("&&", E.Binary("&&", h >= 0, h < x.shape[2]), E.Binary("&&", w >= 0, w < x.shape[3]))
        xv = E.Cast(x[(n, ci, h, w)], acc)
        if ph or pw:
            xv = E.Select(inside, xv, E.Const(0, acc))
        return xv * E.Cast(weight[(o, c, u, v)], acc)

    out = reduce([x.shape[0], cout, oh, ow], [cin_g, kh, kw], fn, "sum", fresh_name("conv2d"),
                 t if bias is None else acc, acc, tag="contraction")  # fmt: skip
    if bias is None:
        return out
    check_tensor(bias, "conv2d", "bias")
    if bias.rank != 1 or static(bias.shape[0]) != cout:
        raise ArgumentError(f"conv2d: bias must have shape ({cout},), got {dim_str(bias.shape)}")
    return compute(out.shape, lambda *i: out[i] + E.Cast(bias[(i[1],)], acc), fresh_name("conv2d_bias"), t)


class _Image:
    """A 4-D image in NCHW or NHWC: its sizes, element access and output shapes in NCHW terms."""

    def __init__(self, x: TensorNode, layout: str, op: str):
        _check_nchw(x, op)
        if layout not in ("NCHW", "NHWC"):
            raise ArgumentError(f"{op}: layout must be 'NCHW' or 'NHWC', got {layout!r}")
        self.x, self.nhwc = x, layout == "NHWC"
        n, a, b, c = x.shape
        self.n, self.c, self.h, self.w = (n, c, a, b) if self.nhwc else (n, a, b, c)

    def at(self, n: E.Expr, c: E.Expr, h: E.Expr, w: E.Expr) -> E.Expr:
        return self.x[(n, h, w, c)] if self.nhwc else self.x[(n, c, h, w)]

    def shape(self, oh: Any, ow: Any) -> list[Any]:
        return [self.n, oh, ow, self.c] if self.nhwc else [self.n, self.c, oh, ow]

    def nchw(self, i: Sequence[E.Expr]) -> tuple[E.Expr, ...]:
        """An output index as (n, c, y, x)."""
        return (i[0], i[3], i[1], i[2]) if self.nhwc else tuple(i)


def _pool(op: str, x: TensorNode, kernel_size, stride, padding, ceil_mode: bool, count_include_pad: bool,
          layout: str = "NCHW") -> TensorNode:  # fmt: skip
    img = _Image(x, layout, op)
    check_float(x, op)
    kh, kw = pair(kernel_size, "kernel_size", op)
    sh, sw = pair(stride if stride is not None else kernel_size, "stride", op)
    ph, pw = pair(padding, "padding", op)
    if ph * 2 > kh or pw * 2 > kw:
        raise ArgumentError(f"{op}: padding ({ph}, {pw}) must be at most half the kernel size ({kh}, {kw})")
    H, W = img.h, img.w
    oh = _out_size(H, kh, sh, ph, 1, op, ceil_mode)
    ow = _out_size(W, kw, sw, pw, 1, op, ceil_mode)
    acc = compute_type(x.dtype)

    def window(i, r):
        n, c, y, xx = img.nchw(i)
        u, v = r
        h, w = y * sh + u - ph, xx * sw + v - pw
        inside = E.Binary("&&", E.Binary("&&", h >= 0, h < H), E.Binary("&&", w >= 0, w < W))
        return inside, E.Cast(img.at(n, c, h, w), acc)

    shape = img.shape(oh, ow)
    if op == "max_pool2d":
        # A tap in the padding reads the nearest input element instead: that element is in the
        # same window (padding is at most half the kernel, and every window starts inside the
        # input or its left padding), so the max is the same, and with no condition on the
        # load the CPU loop vectorises (a conditional load stays scalar: 4.6x on ResNet's pool).
        def clamp(v: E.Expr, n: E.Expr) -> E.Expr:
            return E.Call("min", (E.Call("max", (v, E.Const(0, dtypes.int32)), dtypes.int32), n - 1), dtypes.int32)

        def fmax(i, r):
            n, c, y, xx = img.nchw(i)
            u, v = r
            return E.Cast(img.at(n, c, clamp(y * sh + u - ph, H), clamp(xx * sw + v - pw, W)), acc)

        return reduce(shape, [kh, kw], fmax, "max", fresh_name(op), x.dtype, acc, tag="pool")

    def fsum(i, r):
        inside, v = window(i, r)
        return E.Select(inside, v, E.Const(0, acc))

    total = reduce(shape, [kh, kw], fsum, "sum", fresh_name(op + "_sum"), acc, acc, tag="pool")

    def divisor(y: E.Expr, w: E.Expr) -> E.Expr:
        # torch: windows are clipped to the padded input; padding counts unless count_include_pad=False.
        def count(o: E.Expr, s: int, p: int, k: int, n: E.Expr) -> E.Expr:
            lo = o * s - p
            hi = E.Call("min", (lo + k, n + p if count_include_pad else n), dtypes.int32)
            lo = lo if count_include_pad else E.Call("max", (lo, E.Const(0, dtypes.int32)), dtypes.int32)
            return hi - lo

        return E.Cast(count(y, sh, ph, kh, H) * count(w, sw, pw, kw, W), acc)

    return compute(shape, lambda *i: E.Binary("/", total[i], divisor(*img.nchw(i)[2:])), fresh_name(op), x.dtype)


def max_pool2d(x: TensorNode, kernel_size: int | Sequence[int], stride: int | Sequence[int] | None = None,
               padding: int | Sequence[int] = 0, ceil_mode: bool = False, layout: str = "NCHW") -> TensorNode:  # fmt: skip
    """Max over windows (padding never wins: it is -inf); NCHW, or NHWC in and out."""
    return _pool("max_pool2d", x, kernel_size, stride, padding, ceil_mode, True, layout)


def avg_pool2d(x: TensorNode, kernel_size: int | Sequence[int], stride: int | Sequence[int] | None = None,
               padding: int | Sequence[int] = 0, ceil_mode: bool = False, count_include_pad: bool = True,
               layout: str = "NCHW") -> TensorNode:  # fmt: skip
    """Average over windows with torch's divisor rules; NCHW, or NHWC in and out."""
    return _pool("avg_pool2d", x, kernel_size, stride, padding, ceil_mode, count_include_pad, layout)


def adaptive_avg_pool2d(x: TensorNode, output_size: int | Sequence[int], layout: str = "NCHW") -> TensorNode:
    """torch's adaptive average pooling: window [floor(i*H/OH), ceil((i+1)*H/OH)) per output index;
    NCHW, or NHWC in and out."""
    img = _Image(x, layout, "adaptive_avg_pool2d")
    check_float(x, "adaptive_avg_pool2d")
    oh, ow = pair(output_size, "output_size", "adaptive_avg_pool2d")
    H, W = static(img.h), static(img.w)
    if H is None or W is None:
        raise UnsupportedError("adaptive_avg_pool2d: needs static spatial sizes")
    kh = max(-(-((i + 1) * H) // oh) - (i * H) // oh for i in range(oh))
    kw = max(-(-((i + 1) * W) // ow) - (i * W) // ow for i in range(ow))
    acc = compute_type(x.dtype)

    def bounds(o: E.Expr, n: int, out: int) -> tuple[E.Expr, E.Expr]:
        return (o * n) // out, ((o + 1) * n + (out - 1)) // out

    def fn(i, r):
        nb, c, y, xx = img.nchw(i)
        u, v = r
        h0, h1 = bounds(y, H, oh)
        w0, w1 = bounds(xx, W, ow)
        inside = E.Binary("&&", h0 + u < h1, w0 + v < w1)
        return E.Select(inside, E.Cast(img.at(nb, c, h0 + u, w0 + v), acc), E.Const(0, acc))

    shape = img.shape(oh, ow)
    total = reduce(shape, [kh, kw], fn, "sum", fresh_name("adaptive_avg_pool2d_sum"), acc, acc, tag="pool")

    def avg(*i: E.Var) -> E.Expr:
        _, _, y, xx = img.nchw(i)
        h0, h1 = bounds(y, H, oh)
        w0, w1 = bounds(xx, W, ow)
        return E.Binary("/", total[i], E.Cast((h1 - h0) * (w1 - w0), acc))

    return compute(shape, avg, fresh_name("adaptive_avg_pool2d"), x.dtype)


# ---- rotary position embedding ------------------------------------------------------------------------------------
def rotate_half(x: TensorNode) -> Compute:
    """cat(-x2, x1) of the two halves of the last axis (the Llama/GPT-NeoX convention)."""
    check_tensor(x, "rotate_half")
    d = static(x.shape[-1])
    if d is None or d % 2:
        raise ArgumentError(f"rotate_half: the last dimension must be static and even, got {x.shape[-1]}")
    x1 = slice(x, -1, 0, d // 2)
    x2 = slice(x, -1, d // 2, d)
    return concat([neg(x2), x1], -1)


def apply_rotary(x: TensorNode, cos: TensorNode, sin: TensorNode) -> Compute:
    """x * cos + rotate_half(x) * sin, with cos/sin broadcast against x (e.g. [seq, head_dim])."""
    for t, what in ((cos, "cos"), (sin, "sin")):
        check_tensor(t, "apply_rotary", what)
        if not same_dim(t.shape[-1], x.shape[-1]):
            raise ArgumentError(f"apply_rotary: {what} has last dimension {t.shape[-1]}, x has {x.shape[-1]}")
    return add(mul(x, cos), mul(rotate_half(x), sin))


# ---- attention ----------------------------------------------------------------------------------------------------------
def attention(q: TensorNode, k: TensorNode, v: TensorNode, mask: TensorNode | None = None, causal: bool = False,
              scale: float | None = None) -> TensorNode:  # fmt: skip
    """softmax(q @ k^T * scale + mask) @ v over [..., L, D] operands (torch's scaled_dot_product_attention).

    `mask` is additive (0 / -inf, broadcast against the scores) or bool (True keeps); `causal`
    adds the bottom-right aligned causal mask.  A plain composition of matmul and softmax: a
    fused attention template replaces it for speed.
    """
    for t, what in ((q, "q"), (k, "k"), (v, "v")):
        check_tensor(t, "attention", what)
        check_float(t, "attention")
        if t.rank < 2:
            raise ArgumentError(f"attention: {what} must be [..., L, D], got shape {dim_str(t.shape)}")
    d = static(q.shape[-1])
    if scale is None:
        if d is None:
            raise UnsupportedError("attention: give `scale` when the head dimension is symbolic")
        scale = d**-0.5
    scores = mul(matmul(q, transpose(k)), scale)
    if causal:
        scores = add(scores, causal_mask(q.shape[-2], k.shape[-2], scores.dtype))
    if mask is not None:
        check_tensor(mask, "attention", "mask")
        scores = where(mask, scores, float("-inf")) if mask.dtype.is_bool else add(scores, mask)
    return matmul(softmax(scores, -1), v)
