"""Rules for ONNX's elementwise math, logic, casts and reductions."""

from __future__ import annotations

import numpy as np

from tessera.errors import UnsupportedError
from tessera.frontend.onnx.importer import ONNX_DTYPES, Known, rule
from tessera.graph import Tensor
from tessera.graph.symbolic import dim_add, dim_mul
from tessera.ir.symbolic import floordiv, mod, nonneg, sym_max, sym_min

# ---- unary ---------------------------------------------------------------------------------------------------------
_UNARY = {"Relu": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh", "Exp": "exp", "Log": "log", "Sqrt": "sqrt",
          "Erf": "erf", "Abs": "abs", "Reciprocal": "reciprocal", "Floor": "floor", "Ceil": "ceil",
          "Sin": "sin", "Cos": "cos", "Tan": "tan", "Not": "logical_not", "Softplus": "softplus", "Sign": "sign",
          "Round": "round", "HardSwish": "hardswish", "Mish": "mish", "IsNaN": "isnan", "Asin": "asin",
          "Acos": "acos", "Atan": "atan", "Sinh": "sinh", "Cosh": "cosh", "Asinh": "asinh", "Acosh": "acosh",
          "Atanh": "atanh"}  # fmt: skip
for _t, _k in _UNARY.items():
    rule(_t)(lambda im, node, args, attrs, _k=_k: im.op(_k, args[0]))


@rule("Neg")
def _neg(im, node, args, attrs):
    k = im.known(args[0])
    if isinstance(args[0], Known) and k is not None:
        return Known([dim_mul(v, -1) for v in k.values], k.scalar)
    return im.op("neg", args[0])


@rule("IsInf", attrs=("detect_negative", "detect_positive"))
def _isinf(im, node, args, attrs):
    x = im.tensor(args[0])
    pos, neg = attrs.get("detect_positive", 1), attrs.get("detect_negative", 1)
    if not x.dtype.is_float:
        return im.op("full", shape=list(x.shape), value=False, dtype="bool")
    inf = im.scalar(np.inf, x)
    if pos and neg:
        return im.op("eq", im.op("abs", x), inf)
    if pos:
        return im.op("eq", x, inf)
    if neg:
        return im.op("eq", x, im.op("neg", inf))
    return im.op("full", shape=list(x.shape), value=False, dtype="bool")


@rule("Gelu", attrs=("approximate",))
def _gelu(im, node, args, attrs):
    return im.op("gelu", args[0], approximate=attrs.get("approximate", b"none").decode())


@rule("LeakyRelu", attrs=("alpha",))
def _leaky(im, node, args, attrs):
    return im.op("leaky_relu", args[0], negative_slope=float(attrs.get("alpha", 0.01)))


@rule("Elu", attrs=("alpha",))
def _elu(im, node, args, attrs):
    return im.op("elu", args[0], alpha=float(attrs.get("alpha", 1.0)))


@rule("HardSigmoid", attrs=("alpha", "beta"))
def _hardsigmoid(im, node, args, attrs):
    x = im.tensor(args[0])
    alpha, beta = attrs.get("alpha", 0.2), attrs.get("beta", 0.5)
    y = im.op("add", im.op("mul", x, im.scalar(alpha, x)), im.scalar(beta, x))
    return im.op("clamp", y, min=0.0, max=1.0)


# ---- binary --------------------------------------------------------------------------------------------------------
_BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Less": "lt", "LessOrEqual": "le", "Greater": "gt",
           "GreaterOrEqual": "ge", "And": "logical_and", "Or": "logical_or", "Xor": "logical_xor",
           "BitwiseAnd": "bitwise_and", "BitwiseOr": "bitwise_or", "BitwiseXor": "bitwise_xor"}  # fmt: skip
_KNOWN_BINARY = {"Add": dim_add, "Mul": dim_mul, "Sub": lambda a, b: dim_add(a, dim_mul(b, -1)), "Div": None,
                 "Mod": mod, "Max": sym_max, "Min": sym_min}  # fmt: skip


def _known_binary(im, op_type, a, b):
    """Shape arithmetic on known integers with symbolic entries (a size times a constant, ...);
    None if not applicable (static values fold through the ops' references instead)."""
    ka, kb = im.known(a), im.known(b)
    if ka is None or kb is None or op_type not in _KNOWN_BINARY or (ka.is_static and kb.is_static):
        return None
    va, vb = ka.values, kb.values
    n = max(len(va), len(vb))
    if len(va) not in (1, n) or len(vb) not in (1, n):
        return None
    out = []
    for i in range(n):
        x, y = va[i if len(va) > 1 else 0], vb[i if len(vb) > 1 else 0]
        if op_type == "Div":  # integer Div truncates: the floor division of sizes where both are >= 0
            if isinstance(x, int) and isinstance(y, int):
                if y == 0:
                    return None
                out.append(int(x / y))
            elif nonneg(x) and nonneg(y) and y != 0:
                out.append(floordiv(x, y))
            else:
                return None
        elif op_type == "Mod" and y == 0:
            return None
        else:
            out.append(_KNOWN_BINARY[op_type](x, y))
    return Known(out, scalar=ka.scalar and kb.scalar)


def _known_equal(im, a, b):
    """Equal on shape values: a size is never equal to a number <= 0; otherwise decide only ints."""
    ka, kb = im.known(a), im.known(b)
    if ka is None or kb is None or (ka.is_static and kb.is_static):
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
    if k is not None:
        return Tensor.constant(np.array(k.values[0] if k.scalar else k.values, bool))
    return im.op("eq", args[0], args[1])


@rule("Where")
def _where(im, node, args, attrs):
    ks = [im.known(a) for a in args]
    if all(k is not None for k in ks) and not all(k.is_static for k in ks):
        n = max(len(k.values) for k in ks)
        pick = [k.values if len(k.values) == n else k.values * n for k in ks]
        return Known([x if c else y for c, x, y in zip(*pick)], scalar=all(k.scalar for k in ks))
    return im.op("where", *args)


for _t, _k in _BINARY.items():

    def _bin(im, node, args, attrs, _k=_k):
        k = _known_binary(im, node.op_type, args[0], args[1])
        return k if k is not None else im.op(_k, args[0], args[1])

    rule(_t)(_bin)


@rule("BitwiseNot")
def _bitwise_not(im, node, args, attrs):
    x = im.tensor(args[0])
    return im.op("bitwise_xor", x, im.scalar(-1 if x.dtype.is_signed else np.iinfo(x.dtype.name).max, x))


@rule("BitShift", attrs=("direction",))
def _bitshift(im, node, args, attrs):
    return im.op("bitshift", args[0], args[1], left=attrs["direction"] == b"LEFT")


@rule("Div")
def _div(im, node, args, attrs):
    k = _known_binary(im, "Div", args[0], args[1])
    if k is not None:
        return k
    a, b = im.tensor(args[0]), im.tensor(args[1])
    return im.op("div", a, b, rounding=None if a.dtype.is_float else "trunc")


@rule("Pow")
def _pow(im, node, args, attrs):
    """ONNX: the result has the base's dtype (numpy.power(a, b).astype(a.dtype))."""
    a, b = im.tensor(args[0]), im.tensor(args[1])
    if a.dtype.is_float:
        return im.op("pow", a, b if b.dtype == a.dtype else im.op("cast", b, dtype=a.dtype.name))
    if b.dtype.is_float:  # an integer base with a float exponent: computed in float64, truncated
        y = im.op("pow", im.op("cast", a, dtype="float64"), im.op("cast", b, dtype="float64"))
        return im.op("cast", y, dtype=a.dtype.name)
    y = im.op("pow", a, b)
    return y if y.dtype == a.dtype else im.op("cast", y, dtype=a.dtype.name)


@rule("Mod", attrs=("fmod",))
def _mod(im, node, args, attrs):
    if not attrs.get("fmod", 0):
        k = _known_binary(im, "Mod", args[0], args[1])
        if k is not None:
            return k
    if attrs.get("fmod", 0):
        return im.op("fmod", args[0], args[1])  # C's fmod: the sign of the dividend
    return im.op("remainder", args[0], args[1])  # Python's %: the sign of the divisor


@rule("Max", "Min", "Sum", "Mean")
def _variadic(im, node, args, attrs):
    kind = {"Max": "maximum", "Min": "minimum", "Sum": "add", "Mean": "add"}[node.op_type]
    if node.op_type in ("Max", "Min") and len(args) == 2:  # of shape values: min(seq, 512)
        k = _known_binary(im, node.op_type, args[0], args[1])
        if k is not None:
            return k
    y = im.tensor(args[0])
    for a in args[1:]:
        y = im.op(kind, y, a)
    if node.op_type == "Mean" and len(args) > 1:
        y = im.op("div", y, im.scalar(len(args), y), rounding=None if y.dtype.is_float else "trunc")
    return y


@rule("Cast", attrs=("to", "saturate", "round_mode"))
def _cast(im, node, args, attrs):
    # saturate and round_mode concern float8 and float4 targets only, which tessera refuses.
    to = ONNX_DTYPES.get(attrs["to"])
    if to is None:
        raise UnsupportedError(f"attribute to={attrs['to']} (cast to ONNX type {_onnx_type(attrs['to'])}) is not supported")
    if isinstance(args[0], Known) and not args[0].is_static and to in ("int64", "int32"):
        return args[0]
    x = im.tensor(args[0])
    return x if x.dtype.name == to else im.op("cast", x, dtype=to)


@rule("CastLike", attrs=("saturate", "round_mode"))
def _cast_like(im, node, args, attrs):
    x, like = im.tensor(args[0]), im.tensor(args[1])
    return x if x.dtype == like.dtype else im.op("cast", x, dtype=like.dtype.name)


def _onnx_type(code: int) -> str:
    import onnx

    try:
        return onnx.TensorProto.DataType.Name(code)
    except ValueError:
        return str(code)


@rule("Clip")
def _clip(im, node, args, attrs):
    """min/max inputs (opset 11+); constants become clamp's bounds, tensors maximum/minimum."""
    x = im.tensor(args[0])
    lo = args[1] if len(args) > 1 else None
    hi = args[2] if len(args) > 2 else None
    if all(b is None or (isinstance(b, Tensor) and b.is_constant and b.data.size == 1) for b in (lo, hi)):
        return im.op("clamp", x, min=None if lo is None else lo.data.item(), max=None if hi is None else hi.data.item())
    y = x
    if lo is not None:
        y = im.op("maximum", y, lo)
    if hi is not None:
        y = im.op("minimum", y, hi)
    return y


# ---- reductions ----------------------------------------------------------------------------------------------------
_REDUCE = {"ReduceMean": "reduce_mean", "ReduceSum": "reduce_sum", "ReduceMax": "reduce_max",
           "ReduceMin": "reduce_min", "ReduceProd": "reduce_prod"}  # fmt: skip


def reduce_axes(im, node, args, attrs) -> list[int] | None:
    """The reduced axes from the attribute (opset < 13/18) or the input; None means all axes,
    [] with noop_with_empty_axes means none."""
    axes = attrs.get("axes")
    if len(args) > 1 and args[1] is not None:
        axes = im.static_ints(args[1], "reduction axes")
    if not axes:
        return [] if attrs.get("noop_with_empty_axes", 0) else None
    return [int(a) for a in axes]


@rule(*_REDUCE, attrs=("axes", "keepdims", "noop_with_empty_axes"))
def _reduce(im, node, args, attrs):
    x = im.tensor(args[0])
    axes = reduce_axes(im, node, args, attrs)
    if axes == []:
        return x
    keep = bool(attrs.get("keepdims", 1))
    norm = sorted({a % x.ndim for a in axes}) if axes is not None else list(range(x.ndim))
    if any(x.shape[a] == 0 for a in norm):  # over an empty set: the reduction's identity
        return _empty_reduction(im, node.op_type, x, norm, keep)
    return im.op(_REDUCE[node.op_type], x, axes=axes, keepdim=keep)


def _empty_reduction(im, op_type, x, axes, keep):
    shape = [1 if i in axes else d for i, d in enumerate(x.shape) if keep or i not in axes]
    dt = x.dtype.name
    if op_type in ("ReduceSum", "ReduceMean"):
        value = 0 if op_type == "ReduceSum" else float("nan")
    elif op_type == "ReduceProd":
        value = 1
    else:
        big = float("inf") if x.dtype.is_float else int(np.iinfo(dt).max)
        small = float("-inf") if x.dtype.is_float else int(np.iinfo(dt).min)
        value = small if op_type == "ReduceMax" else big
    return im.op("full", shape=shape, value=value, dtype=dt)


@rule("ArgMax", "ArgMin", attrs=("axis", "keepdims", "select_last_index"))
def _argmax(im, node, args, attrs):
    x = im.tensor(args[0])
    axis = int(attrs.get("axis", 0)) % max(x.ndim, 1)
    keep = bool(attrs.get("keepdims", 1))
    kind = node.op_type.lower()
    if not attrs.get("select_last_index", 0):
        return im.op(kind, x, axis=axis, keepdim=keep)
    # the last index of the extreme value: the first one of the flipped tensor, counted from the end
    n = x.shape[axis]
    first = im.op(kind, im.op("flip", x, axes=[axis]), axis=axis, keepdim=keep)
    return im.op("sub", im.tensor(Known([dim_add(n, -1)], scalar=True)), first)


@rule("CumSum", attrs=("exclusive", "reverse"))
def _cumsum(im, node, args, attrs):
    (axis,) = im.static_ints(args[1], "CumSum axis")
    x = im.tensor(args[0])
    y = im.op("cumsum", x, axis=int(axis), exclusive=bool(attrs.get("exclusive", 0)), reverse=bool(attrs.get("reverse", 0)))
    return y if y.dtype == x.dtype else im.op("cast", y, dtype=x.dtype.name)  # ONNX keeps the input's dtype


@rule("CumProd", attrs=("exclusive", "reverse"))
def _cumprod(im, node, args, attrs):
    (axis,) = im.static_ints(args[1], "CumProd axis")
    x = im.tensor(args[0])
    y = im.op("cumprod", x, axis=int(axis), exclusive=bool(attrs.get("exclusive", 0)), reverse=bool(attrs.get("reverse", 0)))
    return y if y.dtype == x.dtype else im.op("cast", y, dtype=x.dtype.name)


@rule("Hardmax", attrs=("axis",))
def _hardmax(im, node, args, attrs):
    """1 at the first maximum along axis, 0 elsewhere."""
    x = im.tensor(args[0])
    axis = int(attrs.get("axis", -1)) % x.ndim
    first = im.op("argmax", x, axis=axis, keepdim=True)
    pos = _iota(im, x, axis)
    return im.op("cast", im.op("eq", pos, first), dtype=x.dtype.name)


def _iota(im, x: Tensor, axis: int) -> Tensor:
    """0..n-1 along axis of x, shaped to broadcast against it."""
    n = x.shape[axis]
    r = im.op("arange", start=0, end=n, step=1, dtype="int64")
    return im.op("reshape", r, shape=[n if i == axis else 1 for i in range(x.ndim)])


@rule("LpNormalization", attrs=("axis", "p"))
def _lp_norm(im, node, args, attrs):
    x = im.tensor(args[0])
    axis, p = int(attrs.get("axis", -1)), int(attrs.get("p", 2))
    if p == 1:
        norm = im.op("reduce_sum", im.op("abs", x), axes=[axis], keepdim=True)
    elif p == 2:
        norm = im.op("sqrt", im.op("reduce_sum", im.op("mul", x, x), axes=[axis], keepdim=True))
    else:
        raise UnsupportedError(f"attribute p={p} is not supported (ONNX defines 1 and 2)")
    zero = im.scalar(0, x)
    return im.op("where", im.op("eq", norm, zero), zero, im.op("div", x, norm))  # a zero vector stays zero
