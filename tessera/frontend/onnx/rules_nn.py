"""Rules for ONNX's convolutions, pooling, normalizations and softmax.

The graph has 2-D convolution and pooling; other ranks are reshaped onto them: 1-D ops get
a unit height, 3-D convolution gathers the depth window into the channels (an im2col along
depth) and 3-D pooling pools height/width, then depth (max and average pooling are
separable: the average's divisor is the product of the per-axis counts).  ConvTranspose is
a convolution of the zero-upsampled input with the flipped, transposed kernel.
"""

from __future__ import annotations

import numpy as np

from tessera.errors import UnsupportedError
from tessera.frontend.onnx import functions
from tessera.frontend.onnx.importer import rule
from tessera.graph import Operator, Tensor
from tessera.graph.lowering import lowering_error
from tessera.ops.geometry import window_output


# ---- padding and window arithmetic --------------------------------------------------------------------------------
def spatial_pads(x: Tensor, attrs: dict, kernel: list[int], strides: list[int], dilations: list[int],
                 ceil_mode: bool = False) -> tuple[list[int], list[int]]:  # fmt: skip
    """(begins, ends) of the spatial padding from pads or auto_pad."""
    n = len(kernel)
    auto = attrs.get("auto_pad", b"NOTSET").decode()
    if auto == "NOTSET":
        p = list(attrs.get("pads", [0] * 2 * n))
        return p[:n], p[n:]
    if auto == "VALID":
        return [0] * n, [0] * n
    if auto not in ("SAME_UPPER", "SAME_LOWER"):
        raise UnsupportedError(f"attribute auto_pad={auto!r} is not supported")
    begins, ends = [], []
    for i in range(n):
        size = x.shape[2 + i]
        if not isinstance(size, int):
            raise UnsupportedError(f"attribute auto_pad={auto!r} over a symbolic spatial size")
        out = -(-size // strides[i])
        total = max(0, (out - 1) * strides[i] + dilations[i] * (kernel[i] - 1) + 1 - size)
        small, big = total // 2, total - total // 2
        begins.append(small if auto == "SAME_UPPER" else big)
        ends.append(big if auto == "SAME_UPPER" else small)
    return begins, ends


def _ints(attrs, name, n, default):
    v = list(attrs.get(name, [default] * n))
    if len(v) != n:
        raise UnsupportedError(f"attribute {name}={v} has {len(v)} entries for {n} spatial axes")
    return [int(a) for a in v]


# ---- convolution --------------------------------------------------------------------------------------------------
@rule("Conv", attrs=("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"))
def _conv(im, node, args, attrs):
    x, w = im.tensor(args[0]), im.tensor(args[1])
    n = w.ndim - 2
    k = [int(d) for d in w.shape[2:]]
    strides, dil = _ints(attrs, "strides", n, 1), _ints(attrs, "dilations", n, 1)
    begins, ends = spatial_pads(x, attrs, k, strides, dil)
    bias = args[2] if len(args) > 2 and args[2] is not None else None
    return conv_nd(im, x, w, bias, strides, begins, ends, dil, int(attrs.get("group", 1)))


def conv_nd(im, x: Tensor, w: Tensor, bias, strides, begins, ends, dil, groups: int) -> Tensor:
    """An N-d convolution (N = 1, 2, 3) on the graph's conv2d."""
    n = w.ndim - 2
    if n == 2:
        ins = [x, w] + ([bias] if bias is not None else [])
        return im.op("conv2d", *ins, stride=strides, padding=[begins[0], begins[1], ends[0], ends[1]], dilation=dil,
                     groups=groups)  # fmt: skip
    if n == 1:
        y = conv_nd(im, im.op("unsqueeze", x, axes=[2]), im.op("unsqueeze", w, axes=[2]), bias, [1, strides[0]],
                    [0, begins[0]], [0, ends[0]], [1, dil[0]], groups)  # fmt: skip
        return im.op("squeeze", y, axes=[2])
    if n != 3:
        raise UnsupportedError(f"{n}-D convolution is not supported (1-D, 2-D and 3-D are)")
    # 3-D: pad depth, gather each output depth's window of input depths into the channels, 2-D conv.
    nb, c, d = x.shape[0], x.shape[1], x.shape[2]
    o, cg, kd = w.shape[0], w.shape[1], int(w.shape[2])
    if not all(isinstance(v, int) for v in (c, d)):
        raise UnsupportedError("3-D convolution over a symbolic channel or depth size")
    if begins[0] or ends[0]:
        x = im.op("pad", x, pads=[0, 0, 0, 0, begins[0], ends[0], 0, 0, 0, 0], value=0.0)
    od = window_output(d, kd, strides[0], begins[0], ends[0], dil[0])
    if od <= 0:
        raise UnsupportedError("the 3-D convolution window does not fit the padded depth")
    index = np.arange(od)[:, None] * strides[0] + np.arange(kd)[None, :] * dil[0]  # [od, kd]
    g = im.op("take", x, Tensor.constant(index.astype(np.int64)), axis=2)  # [N, C, od, kd, H, W]
    g = im.op("permute", g, perm=[0, 2, 1, 3, 4, 5])  # [N, od, C, kd, H, W]
    g = im.op("reshape", g, shape=[-1, c * kd, *g.shape[4:]])
    w2 = im.op("reshape", w, shape=[o, cg * kd, *w.shape[3:]])
    y = conv_nd(im, g, w2, bias, strides[1:], begins[1:], ends[1:], dil[1:], groups)  # [N*od, O, OH, OW]
    y = im.op("reshape", y, shape=[nb, od, o, *y.shape[2:]])
    return im.op("permute", y, perm=[0, 2, 1, 3, 4])


@rule("ConvTranspose", attrs=("auto_pad", "dilations", "group", "kernel_shape", "output_padding", "output_shape",
                              "pads", "strides"))  # fmt: skip
def _conv_transpose(im, node, args, attrs):
    x, w = im.tensor(args[0]), im.tensor(args[1])
    n, g = w.ndim - 2, int(attrs.get("group", 1))
    k = [int(d) for d in w.shape[2:]]
    strides, dil = _ints(attrs, "strides", n, 1), _ints(attrs, "dilations", n, 1)
    out_pad = _ints(attrs, "output_padding", n, 0)
    sizes = list(x.shape[2:])
    if not all(isinstance(s, int) for s in sizes) or not all(isinstance(d, int) for d in w.shape):
        raise UnsupportedError("ConvTranspose over symbolic sizes is not supported")
    full = [strides[i] * (sizes[i] - 1) + out_pad[i] + (k[i] - 1) * dil[i] + 1 for i in range(n)]
    auto = attrs.get("auto_pad", b"NOTSET").decode()
    out_shape = list(attrs["output_shape"])[-n:] if "output_shape" in attrs else None
    if auto in ("SAME_UPPER", "SAME_LOWER") and "pads" not in attrs:
        out_shape = out_shape or [sizes[i] * strides[i] for i in range(n)]
        total = [full[i] - out_shape[i] for i in range(n)]
        begins = [t // 2 if auto == "SAME_UPPER" else t - t // 2 for t in total]
    else:
        p = list(attrs.get("pads", [0] * 2 * n))
        begins = p[:n]
        out_shape = out_shape or [full[i] - p[i] - p[n + i] for i in range(n)]
    bias = args[2] if len(args) > 2 and args[2] is not None else None
    return conv_transpose_nd(im, x, w, bias, strides, dil, begins, out_shape, g)


def conv_transpose_nd(im, x: Tensor, w: Tensor, bias, strides, dil, begins, out_shape, groups: int) -> Tensor:
    """The transposed convolution of x [N, Cin, ...] by w [Cin, Cout/groups, k...] whose output
    starts `begins` into the full result and has out_shape spatial sizes: a convolution of the
    input upsampled by the strides (zeros between), padded by d*(k-1) - begin before and up to
    the output length after, with the kernel flipped and its channel axes swapped per group."""
    n = w.ndim - 2
    k = [int(d) for d in w.shape[2:]]
    cin, cout_g = int(w.shape[0]), int(w.shape[1])
    wt = im.op("reshape", w, shape=[groups, cin // groups, cout_g, *k])
    wt = im.op("permute", wt, perm=[0, 2, 1, *range(3, 3 + n)])
    wt = im.op("reshape", wt, shape=[groups * cout_g, cin // groups, *k])
    wt = im.op("flip", wt, axes=list(range(2, 2 + n)))
    up = _upsample_zeros(im, x, strides)
    pads = [0, 0, 0, 0]
    for i in range(n):
        before = dil[i] * (k[i] - 1) - begins[i]
        up_len = (x.shape[2 + i] - 1) * strides[i] + 1
        after = out_shape[i] + dil[i] * (k[i] - 1) - before - up_len
        pads += [before, after]
    if any(pads):
        up = im.op("pad", up, pads=pads, value=0.0)
    return conv_nd(im, up, wt, bias, [1] * n, [0] * n, [0] * n, dil, groups)


def _upsample_zeros(im, x: Tensor, strides: list[int]) -> Tensor:
    """x with strides[i] - 1 zeros between neighbours along spatial axis i."""
    if all(s == 1 for s in strides):
        return x
    n = len(strides)
    shape = list(x.shape[:2])
    expanded = list(x.shape[:2])
    for i, s in enumerate(strides):
        shape += [x.shape[2 + i], 1]
        expanded += [x.shape[2 + i] * s]
    y = im.op("reshape", x, shape=shape)
    pads = [0, 0, 0, 0]
    for s in strides:
        pads += [0, 0, 0, s - 1]
    y = im.op("pad", y, pads=pads, value=0.0)
    y = im.op("reshape", y, shape=expanded)
    return im.op("slice", y, axes=list(range(2, 2 + n)), starts=[0] * n,
                 ends=[(x.shape[2 + i] - 1) * s + 1 for i, s in enumerate(strides)], steps=[1] * n)  # fmt: skip


# ---- pooling ------------------------------------------------------------------------------------------------------
_POOL_ATTRS = ("auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads", "strides")


def _pool_window(x, attrs):
    """(kernel, strides, dilations, ceil_mode, begin pads, end pads) of a pooling node."""
    k = [int(v) for v in attrs["kernel_shape"]]
    n = len(k)
    strides, dil = _ints(attrs, "strides", n, 1), _ints(attrs, "dilations", n, 1)
    ceil = bool(attrs.get("ceil_mode", 0))
    return (k, strides, dil, ceil, *spatial_pads(x, attrs, k, strides, dil, ceil))


@rule("MaxPool", attrs=(*_POOL_ATTRS, "storage_order"))
def _max_pool(im, node, args, attrs):
    x = im.tensor(args[0])
    k, strides, dil, ceil, begins, ends = _pool_window(x, attrs)
    if len(node.output) > 1 and node.output[1]:
        return im.op_multi("max_pool_with_indices", x, kernel=k, stride=strides, pads=begins + ends, dilation=dil,
                           ceil_mode=ceil, storage_order=int(attrs.get("storage_order", 0)))  # fmt: skip
    if attrs.get("storage_order", 0):
        raise UnsupportedError("attribute storage_order=1 without the Indices output has no effect; refusing it")
    return pool_nd(im, "max", x, k, strides, begins, ends, dil, ceil, True)


@rule("AveragePool", attrs=(*_POOL_ATTRS, "count_include_pad"))
def _avg_pool(im, node, args, attrs):
    x = im.tensor(args[0])
    k, strides, dil, ceil, begins, ends = _pool_window(x, attrs)
    return pool_nd(im, "avg", x, k, strides, begins, ends, dil, ceil, bool(attrs.get("count_include_pad", 0)))


@rule("LpPool", attrs=(*_POOL_ATTRS, "p"))
def _lp_pool(im, node, args, attrs):
    """(sum over the window of |x|^p)^(1/p): an average pool counting the padding, times the window size."""
    x = im.tensor(args[0])
    k, strides, dil, ceil, begins, ends = _pool_window(x, attrs)
    p = int(attrs.get("p", 2))
    powered = im.op("pow", im.op("abs", x), im.scalar(p, x))
    total = im.op("mul", pool_nd(im, "avg", powered, k, strides, begins, ends, dil, ceil, True),
                  im.scalar(int(np.prod(k)), x))  # fmt: skip
    return im.op("pow", total, im.scalar(1.0 / p, x))


def pool_nd(im, kind: str, x: Tensor, k, strides, begins, ends, dil, ceil: bool, count_pad: bool) -> Tensor:
    """Max or average pooling over 1, 2 or 3 spatial axes on the graph's 2-D pooling."""
    n = len(k)
    if n == 2:
        if kind == "max" or count_pad:
            x, begins, ends = _explicit_pad(im, kind, x, begins, ends, ceil)
        pads = [begins[0], begins[1], ends[0], ends[1]]
        if kind == "max":
            attrs = dict(kernel=k, stride=strides, padding=pads, dilation=dil, ceil_mode=ceil)
        else:
            attrs = dict(kernel=k, stride=strides, padding=pads, dilation=dil, ceil_mode=ceil, count_include_pad=count_pad)
        kind2d = "max_pool2d" if kind == "max" else "avg_pool2d"
        if x.is_static and lowering_error(Operator.create(kind2d, [x], attrs)) is not None:
            return _pool_by_slices(im, kind, x, k, strides, pads, dil, ceil, count_pad)
        return im.op(kind2d, x, **attrs)
    if n == 1:
        y = pool_nd(im, kind, im.op("unsqueeze", x, axes=[2]), [1, k[0]], [1, strides[0]], [0, begins[0]],
                    [0, ends[0]], [1, dil[0]], ceil, count_pad)  # fmt: skip
        return im.op("squeeze", y, axes=[2])
    if n != 3:
        raise UnsupportedError(f"{n}-D pooling is not supported (1-D, 2-D and 3-D are)")
    nb, c, d = x.shape[:3]
    hw = pool_nd(im, kind, im.op("reshape", x, shape=[nb, -1, *x.shape[3:]]), k[1:], strides[1:], begins[1:],
                 ends[1:], dil[1:], ceil, count_pad)  # [N, C*D, OH, OW]  # fmt: skip
    oh, ow = hw.shape[2], hw.shape[3]
    y = im.op("reshape", hw, shape=[nb, c, d, -1])
    y = pool_nd(im, kind, y, [k[0], 1], [strides[0], 1], [begins[0], 0], [ends[0], 0], [dil[0], 1], ceil, count_pad)
    return im.op("reshape", y, shape=[nb, c, y.shape[2], oh, ow])


def _pool_by_slices(im, kind: str, x: Tensor, k, s, pads, d, ceil: bool, count_pad: bool) -> Tensor:
    """2-D pooling the compiled pooling does not cover (dilation, padding wider than half the
    window, integers): the max or sum of the kh*kw strided slices of the padded input, an
    average dividing by each window's count of counted cells (a constant)."""
    h, w = x.shape[2], x.shape[3]
    pt, pl, pb, pr = pads
    oh, ow = (window_output(size, k[i], s[i], (pt, pl)[i], (pb, pr)[i], d[i], ceil) for i, size in enumerate((h, w)))
    need = [(o - 1) * s[i] + d[i] * (k[i] - 1) + 1 for i, o in enumerate((oh, ow))]
    after = [need[0] - h - pt, need[1] - w - pl]  # the padding the windows reach (ceil mode: more)
    if kind == "max":
        fill = float("-inf") if x.dtype.is_float else int(np.iinfo(x.dtype.name).min)
    else:
        fill = 0.0
    xp = im.op("pad", x, pads=[0, 0, 0, 0, pt, after[0], pl, after[1]], value=fill)
    parts = [im.op("slice", xp, axes=[2, 3], starts=[a * d[0], b * d[1]],
                   ends=[a * d[0] + (oh - 1) * s[0] + 1, b * d[1] + (ow - 1) * s[1] + 1], steps=list(s))
             for a in range(k[0]) for b in range(k[1])]  # fmt: skip
    while len(parts) > 1:  # a balanced tree: an integer max repeats its operands in C, a chain would blow up
        pairs = [im.op("maximum" if kind == "max" else "add", parts[i], parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
        parts = pairs + parts[len(pairs) * 2 :]
    y = parts[0]
    if kind == "max":
        return y
    counted = np.zeros((pt + h + max(after[0], pb), pl + w + max(after[1], pr)))
    if count_pad:  # the input and its padding count; cells only ceil mode adds do not
        counted[: pt + h + pb, : pl + w + pr] = 1
    else:
        counted[pt : pt + h, pl : pl + w] = 1
    count = sum(counted[a * d[0] : a * d[0] + (oh - 1) * s[0] + 1 : s[0], b * d[1] : b * d[1] + (ow - 1) * s[1] + 1 : s[1]]
                for a in range(k[0]) for b in range(k[1]))  # fmt: skip
    return im.op("div", y, Tensor.constant(count, x.dtype.name))


def _explicit_pad(im, kind, x, begins, ends, ceil):
    """Asymmetric padding, which the compiled pooling does not take, as a pad op (-inf for max,
    zeros for an average that counts the padding); symmetric padding stays in the pooling."""
    if begins == ends or ceil:
        return x, begins, ends
    fill = float("-inf") if x.dtype.is_float else int(np.iinfo(x.dtype.name).min)
    pads = [0, 0, 0, 0, begins[0], ends[0], begins[1], ends[1]]
    return im.op("pad", x, pads=pads, value=fill if kind == "max" else 0.0), [0, 0], [0, 0]


@rule("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(im, node, args, attrs):
    x = im.tensor(args[0])
    kind = "reduce_mean" if node.op_type == "GlobalAveragePool" else "reduce_max"
    if kind == "reduce_mean" and x.ndim == 4:
        return im.op("adaptive_avg_pool2d", x, output_size=[1, 1])
    return im.op(kind, x, axes=list(range(2, x.ndim)), keepdim=True)


@rule("GlobalLpPool", attrs=("p",))
def _global_lp_pool(im, node, args, attrs):
    x = im.tensor(args[0])
    p = int(attrs.get("p", 2))
    s = im.op("reduce_sum", im.op("pow", im.op("abs", x), im.scalar(p, x)), axes=list(range(2, x.ndim)), keepdim=True)
    return im.op("pow", s, im.scalar(1.0 / p, x))


# ---- normalizations and softmax -------------------------------------------------------------------------------------
@rule("BatchNormalization", attrs=("epsilon", "momentum", "training_mode"))
def _bn(im, node, args, attrs):
    # momentum only updates running statistics in training mode, which is refused
    if attrs.get("training_mode", 0) or len([o for o in node.output if o]) > 1:
        raise UnsupportedError("batch normalization in training mode is not supported (inference only)")
    x, scale, bias, mean, var = args
    return im.op("batch_norm", x, mean, var, scale, bias, eps=float(attrs.get("epsilon", 1e-5)))


@rule("InstanceNormalization", attrs=("epsilon",))
def _instance_norm(im, node, args, attrs):
    """LayerNorm over each (sample, channel)'s spatial values, then the per-channel scale and bias."""
    x, scale, bias = im.tensor(args[0]), im.tensor(args[1]), im.tensor(args[2])
    y = im.op("layer_norm", im.op("reshape", x, shape=[x.shape[0], x.shape[1], -1]), num_axes=1,
              eps=float(attrs.get("epsilon", 1e-5)))  # fmt: skip
    y = im.op("reshape", y, shape=list(x.shape))
    per_channel = [-1] + [1] * (x.ndim - 2)
    return im.op("add", im.op("mul", y, im.op("reshape", scale, shape=per_channel)),
                 im.op("reshape", bias, shape=per_channel))  # fmt: skip


@rule("LayerNormalization", attrs=("axis", "epsilon", "stash_type"))
def _ln(im, node, args, attrs):
    # stash_type: the statistics' precision; tessera computes them in float32 at least (float64 in float64)
    if len([o for o in node.output if o]) > 1:
        if functions.expand(im, node, im.node_opset):  # Mean and InvStdDev from the op's definition
            return [im.values[o] for o in node.output if o]
    x = im.tensor(args[0])
    axis = attrs.get("axis", -1) % x.ndim
    ins = [x] + [_to_shape(im, a, x.shape[axis:]) for a in args[1:] if a is not None]
    return im.op("layer_norm", *ins, num_axes=x.ndim - axis, eps=float(attrs.get("epsilon", 1e-5)))


def _to_shape(im, t, shape) -> Tensor:
    """A scale or bias broadcast to the normalized shape (ONNX allows broadcastable ones)."""
    t = im.tensor(t)
    return t if tuple(t.shape) == tuple(shape) else im.op("expand", t, shape=list(shape))


@rule("RMSNormalization", attrs=("axis", "epsilon", "stash_type"))
def _rms(im, node, args, attrs):
    x = im.tensor(args[0])
    axis = attrs.get("axis", -1) % x.ndim
    scale = [_to_shape(im, a, x.shape[axis:]) for a in args[1:2] if a is not None]
    return im.op("rms_norm", x, *scale, num_axes=x.ndim - axis, eps=float(attrs.get("epsilon", 1e-5)))


@rule("LRN", attrs=("alpha", "beta", "bias", "size"))
def _lrn(im, node, args, attrs):
    """x / (bias + alpha/size * sum of x^2 over `size` neighbouring channels)^beta."""
    x = im.tensor(args[0])
    size = int(attrs["size"])
    alpha, beta, bias = float(attrs.get("alpha", 1e-4)), float(attrs.get("beta", 0.75)), float(attrs.get("bias", 1.0))
    sq = im.op("mul", x, x)
    flat = im.op("reshape", sq, shape=[x.shape[0], 1, x.shape[1], -1])  # channels as the pooled height
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    flat = im.op("pad", flat, pads=[0, 0, 0, 0, lo, hi, 0, 0], value=0.0)
    mean = im.op("avg_pool2d", flat, kernel=[size, 1], stride=[1, 1], padding=[0, 0, 0, 0], count_include_pad=True)
    mean = im.op("reshape", mean, shape=list(x.shape))
    denom = im.op("pow", im.op("add", im.op("mul", mean, im.scalar(alpha, x)), im.scalar(bias, x)), im.scalar(beta, x))
    return im.op("div", x, denom)


@rule("Softmax", "LogSoftmax", attrs=("axis",))
def _softmax(im, node, args, attrs):
    kind = "softmax" if node.op_type == "Softmax" else "log_softmax"
    return im.op(kind, args[0], axis=int(attrs.get("axis", -1)))


@rule("TopK", attrs=("axis", "largest", "sorted"))
def _topk(im, node, args, attrs):
    x = im.tensor(args[0])
    (k,) = im.static_ints(args[1], "TopK k")[:1]
    return im.op_multi("topk", x, k=int(k), axis=int(attrs.get("axis", -1)) % x.ndim,
                       largest=bool(attrs.get("largest", 1)))  # sorted=0 leaves the order open: sorted is one  # fmt: skip
