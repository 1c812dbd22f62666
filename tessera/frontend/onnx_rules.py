"""Translation rules from ONNX ops (opset 13+) to graph operators, used by `tessera.frontend.onnx`."""

from __future__ import annotations

import math

import numpy as np

from tessera.errors import UnsupportedError
from tessera.frontend.onnx import _ONNX_DTYPES, Known, rule
from tessera.graph import Tensor
from tessera.graph.opdefs.shape import BIG
from tessera.graph.symbolic import Sym, dim_add, dim_div, dim_mul

# ---- elementwise ---------------------------------------------------------------------------------
_UNARY = {"Relu": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh", "Exp": "exp", "Log": "log", "Sqrt": "sqrt",
          "Erf": "erf", "Neg": "neg", "Abs": "abs", "Reciprocal": "reciprocal", "Floor": "floor", "Ceil": "ceil",
          "Sin": "sin", "Cos": "cos", "Tan": "tan", "Not": "logical_not", "Softplus": "softplus", "Sign": "sign",
          "Round": "round", "HardSwish": "hardswish", "Mish": "mish", "IsNaN": "isnan"}  # fmt: skip
for _t, _k in _UNARY.items():
    rule(_t)(lambda im, node, args, attrs, _k=_k: im.op(_k, args[0]))


@rule("Identity", "Dropout")
def _identity(im, node, args, attrs):
    if node.op_type == "Dropout" and len(args) > 2 and args[2] is not None:
        if not (isinstance(args[2], Tensor) and args[2].is_constant and not args[2].data.item()):
            raise UnsupportedError("dropout in training mode")
    return args[0]


@rule("Gelu")
def _gelu(im, node, args, attrs):
    return im.op("gelu", args[0], approximate=attrs.get("approximate", b"none").decode())


@rule("LeakyRelu")
def _leaky(im, node, args, attrs):
    return im.op("leaky_relu", args[0], negative_slope=float(attrs.get("alpha", 0.01)))


@rule("Elu")
def _elu(im, node, args, attrs):
    return im.op("elu", args[0], alpha=float(attrs.get("alpha", 1.0)))


@rule("HardSigmoid")
def _hardsigmoid(im, node, args, attrs):
    alpha, beta = attrs.get("alpha", 0.2), attrs.get("beta", 0.5)
    x = im.op("add", im.op("mul", args[0], _scalar(alpha, args[0])), _scalar(beta, args[0]))
    return im.op("clamp", x, min=0.0, max=1.0)


def _scalar(v: float, like: Tensor) -> Tensor:
    return Tensor.constant(np.asarray(v), like.dtype)


_BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Pow": "pow", "Equal": "eq", "Less": "lt",
           "LessOrEqual": "le", "Greater": "gt", "GreaterOrEqual": "ge", "And": "logical_and",
           "Or": "logical_or", "Xor": "logical_xor"}  # fmt: skip
_KNOWN_BINARY = {"Add": dim_add, "Mul": dim_mul, "Sub": lambda a, b: dim_add(a, dim_mul(b, -1)), "Div": None}


def _known_binary(im, op_type, a, b):
    """Shape arithmetic on known integers (Mul of a size by a constant, ...); None if not applicable."""
    ka, kb = im.known(a), im.known(b)
    if ka is None or kb is None or op_type not in _KNOWN_BINARY:
        return None
    va, vb = ka.values, kb.values
    n = max(len(va), len(vb))
    if len(va) not in (1, n) or len(vb) not in (1, n):
        return None
    out = []
    for i in range(n):
        x, y = va[i if len(va) > 1 else 0], vb[i if len(vb) > 1 else 0]
        if op_type == "Div":
            if isinstance(x, int) and isinstance(y, int):
                out.append(int(x / y))
            else:
                out.append(dim_div(x, y))
        else:
            out.append(_KNOWN_BINARY[op_type](x, y))
    return Known(out, scalar=ka.scalar and kb.scalar)


def _known_equal(im, a, b):
    """Equal on shape values: a size is never equal to a number <= 0; otherwise decide only ints."""
    ka, kb = im.known(a), im.known(b)
    if ka is None or kb is None:
        return None
    va, vb = ka.values, kb.values
    n = max(len(va), len(vb))
    out = []
    for i in range(n):
        x, y = va[i if len(va) > 1 else 0], vb[i if len(vb) > 1 else 0]
        if isinstance(x, int) and isinstance(y, int):
            out.append(int(x == y))
        elif (isinstance(x, int) and x <= 0) or (isinstance(y, int) and y <= 0):
            out.append(0)
        elif x == y:
            out.append(1)
        else:
            return None
    return Known(out, scalar=ka.scalar and kb.scalar)


@rule("Equal")
def _equal(im, node, args, attrs):
    k = _known_equal(im, args[0], args[1])
    return k if k is not None else im.op("eq", args[0], args[1])


@rule("Where")
def _where(im, node, args, attrs):
    ks = [im.known(a) for a in args]
    if all(k is not None for k in ks):
        n = max(len(k.values) for k in ks)
        pick = [k.values if len(k.values) == n else k.values * n for k in ks]
        return Known([x if c else y for c, x, y in zip(*pick)], scalar=all(k.scalar for k in ks))
    return im.op("where", *args)


for _t, _k in _BINARY.items():
    if _t == "Equal":
        continue

    def _bin(im, node, args, attrs, _k=_k):
        k = _known_binary(im, node.op_type, args[0], args[1])
        return k if k is not None else im.op(_k, args[0], args[1])

    rule(_t)(_bin)


@rule("Div")
def _div(im, node, args, attrs):
    k = _known_binary(im, "Div", args[0], args[1])
    if k is not None:
        return k
    a, b = im.tensor(args[0]), im.tensor(args[1])
    return im.op("div", a, b, rounding=None if a.dtype.is_float else "trunc")


@rule("Mod")
def _mod(im, node, args, attrs):
    if attrs.get("fmod", 0):
        raise UnsupportedError("Mod with fmod=1")
    return im.op("remainder", args[0], args[1])


@rule("Max", "Min")
def _maxmin(im, node, args, attrs):
    kind = "maximum" if node.op_type == "Max" else "minimum"
    y = args[0]
    for a in args[1:]:
        y = im.op(kind, y, a)
    return y


@rule("Cast")
def _cast(im, node, args, attrs):
    to = _ONNX_DTYPES.get(attrs["to"])
    if to is None:
        raise UnsupportedError(f"cast to ONNX type {attrs['to']}")
    if isinstance(args[0], Known) and to in ("int64", "int32"):
        return args[0]
    x = im.tensor(args[0])
    return x if x.dtype.name == to else im.op("cast", x, dtype=to)


@rule("CastLike")
def _cast_like(im, node, args, attrs):
    x, like = im.tensor(args[0]), im.tensor(args[1])
    return x if x.dtype == like.dtype else im.op("cast", x, dtype=like.dtype.name)


@rule("Clip")
def _clip(im, node, args, attrs):
    lo = im.const_array(args[1], "Clip min").item() if len(args) > 1 and args[1] is not None else None
    hi = im.const_array(args[2], "Clip max").item() if len(args) > 2 and args[2] is not None else None
    return im.op("clamp", args[0], min=lo, max=hi)


# ---- anchors -------------------------------------------------------------------------------------
@rule("MatMul")
def _matmul(im, node, args, attrs):
    return im.op("matmul", args[0], args[1])


@rule("Gemm")
def _gemm(im, node, args, attrs):
    a, b = im.tensor(args[0]), im.tensor(args[1])
    if attrs.get("transA", 0):
        a = im.op("permute", a, perm=[1, 0])
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    if attrs.get("transB", 0) and alpha == 1.0 and beta == 1.0 and (len(args) < 3 or args[2] is None or args[2].ndim == 1):
        return im.op("linear", a, b, *([args[2]] if len(args) > 2 and args[2] is not None else []))
    if attrs.get("transB", 0):
        b = im.op("permute", b, perm=[1, 0])
    y = im.op("matmul", a, b)
    if alpha != 1.0:
        y = im.op("mul", y, _scalar(alpha, y))
    if len(args) > 2 and args[2] is not None:
        c = args[2] if beta == 1.0 else im.op("mul", args[2], _scalar(beta, args[2]))
        y = im.op("add", y, c)
    return y


def _pads2d(im, x, attrs, kernel, strides, dilations):
    auto = attrs.get("auto_pad", b"NOTSET").decode()
    if auto in ("NOTSET", "VALID"):
        p = list(attrs.get("pads", [0, 0, 0, 0])) if auto == "NOTSET" else [0, 0, 0, 0]
        if len(p) != 4:
            raise UnsupportedError("only 2-D pooling and convolution are supported")
        return [p[0], p[1], p[2], p[3]]  # ONNX: (top, left, bottom, right) = (h_begin, w_begin, h_end, w_end)
    pads = [0, 0, 0, 0]
    for i in range(2):
        size = x.shape[2 + i]
        if not isinstance(size, int):
            raise UnsupportedError("SAME padding of a symbolic spatial size")
        out = -(-size // strides[i])
        total = max(0, (out - 1) * strides[i] + dilations[i] * (kernel[i] - 1) + 1 - size)
        small, big = total // 2, total - total // 2
        pads[i], pads[i + 2] = (small, big) if auto == "SAME_UPPER" else (big, small)
    return pads


@rule("Conv")
def _conv(im, node, args, attrs):
    x, w = im.tensor(args[0]), im.tensor(args[1])
    if w.ndim != 4:
        raise UnsupportedError(f"{w.ndim - 2}-D convolution (only 2-D is supported)")
    strides, dil = list(attrs.get("strides", [1, 1])), list(attrs.get("dilations", [1, 1]))
    pads = _pads2d(im, x, attrs, [w.shape[2], w.shape[3]], strides, dil)
    ins = [x, w] + ([args[2]] if len(args) > 2 and args[2] is not None else [])
    return im.op("conv2d", *ins, stride=strides, padding=pads, dilation=dil, groups=int(attrs.get("group", 1)))


@rule("MaxPool", "AveragePool")
def _pool(im, node, args, attrs):
    x = im.tensor(args[0])
    k = list(attrs["kernel_shape"])
    if len(k) != 2:
        raise UnsupportedError(f"{len(k)}-D pooling (only 2-D is supported)")
    strides, dil = list(attrs.get("strides", [1, 1])), list(attrs.get("dilations", [1, 1]))
    pads = _pads2d(im, x, attrs, k, strides, dil)
    ceil = bool(attrs.get("ceil_mode", 0))
    if node.op_type == "MaxPool":
        if len(node.output) > 1 and node.output[1]:
            raise UnsupportedError("MaxPool with indices output")
        return im.op("max_pool2d", x, kernel=k, stride=strides, padding=pads, dilation=dil, ceil_mode=ceil)
    return im.op("avg_pool2d", x, kernel=k, stride=strides, padding=pads, ceil_mode=ceil,
                 count_include_pad=bool(attrs.get("count_include_pad", 0)))  # fmt: skip


@rule("GlobalAveragePool")
def _gap(im, node, args, attrs):
    if args[0].ndim != 4:
        raise UnsupportedError("GlobalAveragePool of a non-4-D tensor")
    return im.op("adaptive_avg_pool2d", args[0], output_size=[1, 1])


@rule("GlobalMaxPool")
def _gmp(im, node, args, attrs):
    return im.op("reduce_max", args[0], axes=list(range(2, args[0].ndim)), keepdim=True)


@rule("BatchNormalization")
def _bn(im, node, args, attrs):
    if attrs.get("training_mode", 0) or len([o for o in node.output if o]) > 1:
        raise UnsupportedError("batch normalization in training mode")
    x, scale, bias, mean, var = args
    return im.op("batch_norm", x, mean, var, scale, bias, eps=float(attrs.get("epsilon", 1e-5)))


@rule("LayerNormalization")
def _ln(im, node, args, attrs):
    if len([o for o in node.output if o]) > 1:
        raise UnsupportedError("LayerNormalization with mean/inv-std outputs")
    x = im.tensor(args[0])
    axis = attrs.get("axis", -1) % x.ndim
    ins = [x] + [a for a in args[1:] if a is not None]
    return im.op("layer_norm", *ins, num_axes=x.ndim - axis, eps=float(attrs.get("epsilon", 1e-5)))


@rule("RMSNormalization")
def _rms(im, node, args, attrs):
    x = im.tensor(args[0])
    axis = attrs.get("axis", -1) % x.ndim
    return im.op("rms_norm", x, *[a for a in args[1:2] if a is not None], num_axes=x.ndim - axis,
                 eps=float(attrs.get("epsilon", 1e-5)))  # fmt: skip


@rule("Softmax", "LogSoftmax")
def _softmax(im, node, args, attrs):
    kind = "softmax" if node.op_type == "Softmax" else "log_softmax"
    return im.op(kind, args[0], axis=int(attrs.get("axis", -1)))


# ---- reductions ---------------------------------------------------------------------------------
@rule("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd")
def _reduce(im, node, args, attrs):
    kind = {"ReduceMean": "reduce_mean", "ReduceSum": "reduce_sum", "ReduceMax": "reduce_max",
            "ReduceMin": "reduce_min", "ReduceProd": "reduce_prod"}[node.op_type]  # fmt: skip
    axes = attrs.get("axes")
    if len(args) > 1 and args[1] is not None:
        axes = im.ints(args[1], "reduction axes")
    if not axes:
        if attrs.get("noop_with_empty_axes", 0):
            return args[0]
        axes = None
    return im.op(kind, args[0], axes=None if axes is None else [int(a) for a in axes],
                 keepdim=bool(attrs.get("keepdims", 1)))  # fmt: skip


@rule("ArgMax", "ArgMin")
def _argmax(im, node, args, attrs):
    if attrs.get("select_last_index", 0):
        raise UnsupportedError("select_last_index=1")
    return im.op(node.op_type.lower(), args[0], axis=int(attrs.get("axis", 0)), keepdim=bool(attrs.get("keepdims", 1)))


@rule("CumSum")
def _cumsum(im, node, args, attrs):
    (axis,) = im.ints(args[1], "CumSum axis")
    return im.op("cumsum", args[0], axis=int(axis), exclusive=bool(attrs.get("exclusive", 0)),
                 reverse=bool(attrs.get("reverse", 0)))  # fmt: skip


# ---- shapes --------------------------------------------------------------------------------------
@rule("Constant")
def _constant(im, node, args, attrs):
    if "value" in attrs:
        return Tensor.constant(im.numpy_helper.to_array(attrs["value"]), name=node.output[0])
    for key, dt in (("value_float", np.float32), ("value_int", np.int64), ("value_floats", np.float32),
                    ("value_ints", np.int64)):  # fmt: skip
        if key in attrs:
            return Tensor.constant(np.asarray(attrs[key], dt), name=node.output[0])
    raise UnsupportedError(f"Constant with attributes {sorted(attrs)}")


@rule("Shape")
def _shape(im, node, args, attrs):
    if isinstance(args[0], Known):  # the shape of a shape vector
        return Known([] if args[0].scalar else [len(args[0].values)])
    shape = list(im.tensor(args[0]).shape)
    start, end = attrs.get("start", 0), attrs.get("end", None)
    return Known(shape[start:end])


@rule("Size")
def _size(im, node, args, attrs):
    total = 1
    for d in im.tensor(args[0]).shape:
        total = dim_mul(total, d)
    return Known([total], scalar=True)


@rule("Reshape")
def _reshape(im, node, args, attrs):
    target = im.ints(args[1], "Reshape shape")
    if isinstance(args[0], Known) and target in ([-1], [len(args[0].values)]):
        return Known(args[0].values)
    x = im.tensor(args[0])
    if not attrs.get("allowzero", 0):
        target = [x.shape[i] if d == 0 else d for i, d in enumerate(target)]
    syms = [i for i, d in enumerate(target) if isinstance(d, Sym)]
    if len(syms) == 1 and -1 not in target:
        target[syms[0]] = -1  # inferred at run time: no symbol needs binding
    return im.op("reshape", x, shape=target)


@rule("Flatten")
def _flatten(im, node, args, attrs):
    x = im.tensor(args[0])
    axis = attrs.get("axis", 1) % (x.ndim + 1) if x.ndim else 0
    if axis == 0:
        return im.op("reshape", x, shape=[1, -1])
    return im.op("flatten", im.op("flatten", x, start=axis, end=-1), start=0, end=axis - 1) if axis < x.ndim else \
        im.op("unsqueeze", im.op("flatten", x, start=0, end=-1), axes=[1])  # fmt: skip


@rule("Transpose")
def _transpose(im, node, args, attrs):
    x = im.tensor(args[0])
    return im.op("permute", x, perm=list(attrs.get("perm", range(x.ndim - 1, -1, -1))))


@rule("Squeeze", "Unsqueeze")
def _squeeze(im, node, args, attrs):
    axes = attrs.get("axes")
    if len(args) > 1 and args[1] is not None:
        axes = im.ints(args[1], "axes")
    k = args[0] if isinstance(args[0], Known) else None
    if k is not None and axes is not None and list(axes) in ([0], [-1]):
        if node.op_type == "Unsqueeze" and k.scalar:
            return Known(k.values)
        if node.op_type == "Squeeze" and not k.scalar and len(k.values) == 1:
            return Known(k.values, scalar=True)
    if node.op_type == "Unsqueeze":
        return im.op("unsqueeze", args[0], axes=[int(a) for a in axes])
    return im.op("squeeze", args[0], axes=None if axes is None else [int(a) for a in axes])


@rule("Concat")
def _concat(im, node, args, attrs):
    if all(im.known(a) is not None for a in args) and any(isinstance(a, Known) for a in args):
        return Known([v for a in args for v in im.known(a).values])
    return im.op("concat", *args, axis=int(attrs["axis"]))


@rule("Gather")
def _gather(im, node, args, attrs):
    data, idx = args
    axis = int(attrs.get("axis", 0))
    if isinstance(data, Known) and im.known(idx) is not None and axis == 0:
        ki = im.known(idx)
        picked = [data.values[int(i)] for i in ki.values]
        return Known(picked, scalar=ki.scalar)
    return im.op("take", data, idx, axis=axis)


@rule("GatherElements")
def _gather_elements(im, node, args, attrs):
    return im.op("gather_elements", args[0], args[1], axis=int(attrs.get("axis", 0)))


@rule("Slice")
def _slice(im, node, args, attrs):
    x = args[0]
    starts, ends = im.ints(args[1], "Slice starts"), im.ints(args[2], "Slice ends")
    rank = len(x.values) if isinstance(x, Known) else im.tensor(x).ndim
    axes = im.ints(args[3], "Slice axes") if len(args) > 3 and args[3] is not None else list(range(len(starts)))
    steps = im.ints(args[4], "Slice steps") if len(args) > 4 and args[4] is not None else [1] * len(starts)
    ends = [min(e, BIG) if isinstance(e, int) else e for e in ends]
    ends = [max(e, -BIG) if isinstance(e, int) else e for e in ends]
    if isinstance(x, Known) and not x.scalar and all(isinstance(v, int) for v in starts + ends + steps):
        return Known(x.values[slice(starts[0], ends[0], steps[0])])
    return im.op("slice", x, axes=[int(a) % rank for a in axes], starts=starts, ends=ends, steps=steps)


@rule("Split")
def _split(im, node, args, attrs):
    x = im.tensor(args[0])
    axis = int(attrs.get("axis", 0))
    n = len(node.output)
    if len(args) > 1 and args[1] is not None:
        sizes = im.ints(args[1], "Split sizes")
    elif "split" in attrs:
        sizes = list(attrs["split"])
    else:
        total = x.shape[axis]
        if not isinstance(total, int):
            raise UnsupportedError("even split of a symbolic size")
        per = -(-total // n)
        sizes = [min(per, total - i * per) for i in range(n)]
    return im.op_multi("split", x, axis=axis, sizes=sizes)


@rule("Expand")
def _expand(im, node, args, attrs):
    x = im.tensor(args[0])
    shape = im.ints(args[1], "Expand shape")
    # ONNX Expand broadcasts both ways: a 1 in shape keeps the input's size.
    rank = max(len(shape), x.ndim)
    full = [1] * (rank - len(shape)) + list(shape)
    xs = [1] * (rank - x.ndim) + list(x.shape)
    target = [xd if d == 1 else d for d, xd in zip(full, xs)]
    return im.op("expand", x, shape=target)


@rule("Tile")
def _tile(im, node, args, attrs):
    return im.op("tile", args[0], repeats=[int(r) for r in im.ints(args[1], "Tile repeats")])


@rule("ConstantOfShape")
def _constant_of_shape(im, node, args, attrs):
    shape = im.ints(args[0], "ConstantOfShape shape")
    value = im.numpy_helper.to_array(attrs["value"]) if "value" in attrs else np.zeros(1, np.float32)
    if all(isinstance(d, int) for d in shape) and np.prod(shape) <= 64:
        return Tensor.constant(np.full(shape, value.reshape(-1)[0], value.dtype))  # small: shape arithmetic reads it
    return im.op("full", shape=shape, value=value.reshape(-1)[0].item(), dtype=Tensor.constant(value).dtype.name)


@rule("Range")
def _range(im, node, args, attrs):
    vals = []
    for a, what in zip(args, ("start", "limit", "delta")):
        k = im.known(a)
        if k is not None:
            vals.append(k.values[0])
        else:
            vals.append(im.const_array(a, f"Range {what}").item())
    dtype = (im.tensor(args[0]) if isinstance(args[0], Tensor) else Tensor.constant(np.int64(0))).dtype.name
    start, limit, delta = vals
    if isinstance(limit, Sym) or isinstance(start, Sym):
        return im.op("arange", start=start, end=limit, step=delta, dtype=dtype)
    n = max(0, math.ceil((limit - start) / delta))
    return im.op("arange", start=start, end=start + n * delta, step=delta, dtype=dtype)


@rule("Trilu")
def _trilu(im, node, args, attrs):
    k = im.ints(args[1], "Trilu k")[0] if len(args) > 1 and args[1] is not None else 0
    return im.op("triu" if attrs.get("upper", 1) else "tril", args[0], diagonal=int(k))


@rule("Pad")
def _pad(im, node, args, attrs):
    if attrs.get("mode", b"constant").decode() != "constant":
        raise UnsupportedError(f"Pad mode {attrs['mode']!r}")
    x = im.tensor(args[0])
    p = im.ints(args[1], "Pad pads")
    value = im.const_array(args[2], "Pad value").item() if len(args) > 2 and args[2] is not None else 0.0
    axes = im.ints(args[3], "Pad axes") if len(args) > 3 and args[3] is not None else list(range(x.ndim))
    pads = [0] * (2 * x.ndim)
    n = len(axes)
    for i, ax in enumerate(axes):  # ONNX lists all begins, then all ends
        pads[2 * (ax % x.ndim)], pads[2 * (ax % x.ndim) + 1] = p[i], p[n + i]
    return im.op("pad", x, pads=pads, value=float(value))


