"""Lowering rules for ATen's elementwise ops, reductions, casts and tensor creation.

Arithmetic follows torch's type promotion by construction: operands are cast to the dtype
`torch.result_type` gives for the node's own arguments (FakeTensors and Python scalars), and
the converter casts every result to the dtype in the node's metadata.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tessera.frontend.torch.convert import Converter, dtype_of, lowers
from tessera.frontend.torch.symbols import dim_from_sym
from tessera.graph import Tensor
from tessera.graph.symbolic import Sym


def _meta_scalar(v: Any) -> Any:
    if isinstance(v, torch.SymInt):
        return 1
    if isinstance(v, torch.SymFloat):
        return 1.0
    if isinstance(v, torch.SymBool):
        return True
    return v


def compute_dtype(cv: Converter, *names: str) -> torch.dtype:
    """torch's promoted dtype of the current node's arguments `names` (tensors and scalars)."""
    metas = [_meta_scalar(cv.arg_meta(n)) for n in names]
    dt = torch.result_type(metas[0], metas[1])
    for m in metas[2:]:
        dt = torch.result_type(torch.empty((), dtype=dt), m) if not isinstance(m, torch.Tensor) else \
            torch.promote_types(dt, m.dtype)  # fmt: skip
    return dt


def _promoted(cv: Converter, a: dict, *names: str) -> list[Tensor]:
    dt = compute_dtype(cv, *names)
    return [cv.tensor(a[n], dt) for n in names]


# ---- unary -----------------------------------------------------------------------------
_UNARY = ["abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "ceil", "cos", "cosh", "erf", "exp", "expm1",
          "floor", "log", "log1p", "neg", "reciprocal", "relu", "round", "rsqrt", "sigmoid", "sign", "sin", "sinh",
          "sqrt", "tan", "tanh", "logical_not", "isnan", "silu", "mish", "hardswish", "hardsigmoid"]  # fmt: skip
_FLOAT_ONLY = {"acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "erf", "exp", "expm1", "log", "log1p",
               "reciprocal", "rsqrt", "sigmoid", "sin", "sinh", "sqrt", "tan", "tanh", "silu", "mish", "hardswish",
               "hardsigmoid"}  # fmt: skip


def _unary(kind: str):
    def rule(cv: Converter, a: dict) -> Tensor:
        x = a["self"]
        if kind in _FLOAT_ONLY and not x.dtype.is_float:
            x = cv.cast(x, cv.meta.dtype)  # torch computes integer inputs in the default float dtype
        if kind == "round" and a.get("decimals"):
            scale = cv.tensor(10.0 ** a["decimals"], x.dtype)
            return cv.op("div", cv.op("round", cv.op("mul", x, scale)), scale)
        return cv.op(kind, x)

    return rule


for _k in _UNARY:
    lowers(f"aten.{_k}")(_unary(_k))


@lowers("aten.log2", "aten.log10")
def _log_base(cv, a):
    x = cv.cast(a["self"], cv.meta.dtype)
    base = 2.0 if "log2" in str(cv.node.target) else 10.0
    return cv.op("mul", cv.op("log", x), cv.tensor(1 / math.log(base), x.dtype))


@lowers("aten.trunc")
def _trunc(cv, a):
    x = a["self"]
    if not x.dtype.is_float:
        return x
    return cv.op("where", cv.op("lt", x, cv.tensor(0.0, x.dtype)), cv.op("ceil", x), cv.op("floor", x))


@lowers("aten.isinf")
def _isinf(cv, a):
    x = a["self"]
    if not x.dtype.is_float:
        return cv.op("full", shape=list(x.shape), value=False, dtype="bool")
    return cv.op("eq", cv.op("abs", x), cv.tensor(math.inf, x.dtype))


@lowers("aten.bitwise_not")
def _bitwise_not(cv, a):
    x = a["self"]
    if x.dtype.is_bool:
        return cv.op("logical_not", x)
    return cv.op("bitwise_xor", x, cv.tensor(-1, x.dtype))


@lowers("aten.gelu")
def _gelu(cv, a):
    return cv.op("gelu", a["self"], approximate=a["approximate"])


@lowers("aten.leaky_relu")
def _leaky(cv, a):
    return cv.op("leaky_relu", a["self"], negative_slope=float(a["negative_slope"]))


@lowers("aten.elu")
def _elu(cv, a):
    # torch: scale * (x if x > 0 else alpha * (exp(input_scale * x) - 1))
    x = a["self"]
    if a["input_scale"] == 1:
        y = cv.op("elu", x, alpha=float(a["alpha"]))
    else:
        neg = cv.op("expm1", cv.op("mul", x, cv.tensor(float(a["input_scale"]), x.dtype)))
        neg = cv.op("mul", neg, cv.tensor(float(a["alpha"]), x.dtype))
        y = cv.op("where", cv.op("gt", x, cv.tensor(0.0, x.dtype)), x, neg)
    return y if a["scale"] == 1 else cv.op("mul", y, cv.tensor(float(a["scale"]), x.dtype))


@lowers("aten.hardtanh")
def _hardtanh(cv, a):
    return cv.op("clamp", a["self"], min=float(a["min_val"]), max=float(a["max_val"]))


@lowers("aten.softplus")
def _softplus(cv, a):
    x, beta, threshold = a["self"], float(a["beta"]), float(a["threshold"])
    bx = x if beta == 1 else cv.op("mul", x, cv.tensor(beta, x.dtype))
    y = cv.op("softplus", bx)
    if beta != 1:
        y = cv.op("div", y, cv.tensor(beta, x.dtype))
    return cv.op("where", cv.op("gt", bx, cv.tensor(threshold, x.dtype)), x, y)  # torch's linear region


# ---- binary ----------------------------------------------------------------------------
_BINARY = {"mul": "mul", "maximum": "maximum", "minimum": "minimum", "eq": "eq", "ne": "ne", "lt": "lt",
           "le": "le", "gt": "gt", "ge": "ge", "logical_and": "logical_and", "logical_or": "logical_or",
           "logical_xor": "logical_xor", "bitwise_and": "bitwise_and", "bitwise_or": "bitwise_or",
           "bitwise_xor": "bitwise_xor", "remainder": "remainder", "fmod": "fmod", "pow": "pow"}  # fmt: skip


def _binary(kind: str):
    def rule(cv: Converter, a: dict) -> Tensor:
        if kind.startswith("logical"):
            x, y = (cv.cast(cv.tensor(a[n]), "bool") for n in ("self", "other"))
            return cv.op(kind, x, y)
        x, y = _promoted(cv, a, "self", "other" if "other" in a else "exponent")
        return cv.op(kind, x, y)

    return rule


for _k, _kind in _BINARY.items():
    lowers(f"aten.{_k}")(_binary(_kind))


@lowers("aten.pow.Scalar")
def _pow_scalar(cv, a):
    x, y = _promoted(cv, a, "self", "exponent")
    return cv.op("pow", x, y)


def _add_sub(kind: str):
    def rule(cv: Converter, a: dict) -> Tensor:
        x, y = _promoted(cv, a, "self", "other")
        if a["alpha"] != 1:
            y = cv.op("mul", y, cv.tensor(a["alpha"], y.dtype))
        return cv.op(kind, x, y)

    return rule


lowers("aten.add")(_add_sub("add"))
lowers("aten.sub")(_add_sub("sub"))


@lowers("aten.rsub")
def _rsub(cv, a):
    x, y = _promoted(cv, a, "self", "other")
    if a["alpha"] != 1:
        x = cv.op("mul", x, cv.tensor(a["alpha"], x.dtype))
    return cv.op("sub", y, x)


@lowers("aten.div", "aten.true_divide", "aten.floor_divide")  # true_divide: dynamic=True passes Python floats as 0-d tensors
def _div(cv, a):
    mode = "floor" if "floor_divide" in str(cv.node.target) else a.get("rounding_mode")
    dt = compute_dtype(cv, "self", "other")
    if mode is None and not dt.is_floating_point:
        dt = cv.meta.dtype  # true division of integers gives the default float dtype
    x, y = cv.tensor(a["self"], dt), cv.tensor(a["other"], dt)
    return cv.op("div", x, y, rounding=mode)


@lowers("aten.atan2")
def _atan2(cv, a):
    dt = cv.meta.dtype
    y, x = cv.tensor(a["self"], dt), cv.tensor(a["other"], dt)
    zero, pi = cv.tensor(0.0, y.dtype), cv.tensor(math.pi, y.dtype)
    base = cv.op("atan", cv.op("div", y, x))
    half = cv.tensor(math.pi / 2, y.dtype)
    neg_x = cv.op("add", base, cv.op("where", cv.op("ge", y, zero), pi, cv.op("neg", pi)))
    zero_x = cv.op("where", cv.op("gt", y, zero), half, cv.op("where", cv.op("lt", y, zero), cv.op("neg", half), zero))
    return cv.op("where", cv.op("gt", x, zero), base, cv.op("where", cv.op("lt", x, zero), neg_x, zero_x))


@lowers("aten.where.self", "aten.where.ScalarSelf", "aten.where.ScalarOther", "aten.where.Scalar")
def _where(cv, a):
    x, y = _promoted(cv, a, "self", "other")
    return cv.op("where", cv.cast(cv.tensor(a["condition"]), "bool"), x, y)


@lowers("aten.clamp", "aten.clamp_min", "aten.clamp_max")
def _clamp(cv, a):
    x = a["self"]
    lo = a.get("min")
    hi = a.get("max")
    if isinstance(lo, Tensor) or isinstance(hi, Tensor) or not x.dtype.is_float and any(
            isinstance(v, float) for v in (lo, hi)):
        dt = cv.meta.dtype
        x = cv.cast(x, dt)
        if lo is not None:
            x = cv.op("maximum", x, cv.tensor(lo, dt))
        if hi is not None:
            x = cv.op("minimum", x, cv.tensor(hi, dt))
        return x
    return cv.op("clamp", x, min=lo, max=hi)


# ---- casts, copies, creation -------------------------------------------------------------
@lowers("aten._to_copy", "aten.clone", "aten.alias", "aten.lift_fresh_copy", "aten.detach", "aten.contiguous",
        "aten._assert_tensor_metadata")  # fmt: skip
def _copy_like(cv, a):
    # A device change (a CPU constant moved to the GPU) needs nothing: the compiled graph runs
    # every operator on its target and keeps its constants there.
    return cv.cast(a["self"], cv.meta.dtype) if isinstance(cv.meta, torch.Tensor) else None


@lowers("prims.convert_element_type")
def _convert(cv, a):
    return cv.cast(a["a"], a["dtype"])


@lowers("aten.copy", "aten.copy_")
def _copy(cv, a):
    src = cv.cast(a["src"], cv.meta.dtype)
    shape = list(a["self"].shape)
    return src if tuple(src.shape) == tuple(shape) else cv.op("expand", src, shape=shape)


def _shape(cv: Converter) -> list:
    return [dim_from_sym(d) for d in cv.meta.shape]


def _fill_value(v: Any) -> Any:
    return v if isinstance(v, (bool, int, float, Sym)) else float(v)


@lowers("aten.full", "aten.full_like", "aten.scalar_tensor", "aten.zeros", "aten.ones", "aten.zeros_like",
        "aten.ones_like", "aten.new_zeros", "aten.new_ones", "aten.new_full", "aten.empty", "aten.empty_like",
        "aten.empty_strided", "aten.new_empty", "aten.fill")  # fmt: skip
def _full(cv, a):
    name = str(cv.node.target)
    value = a.get("fill_value", a.get("value", a.get("s", 0)))
    if "ones" in name:
        value = 1
    elif "zeros" in name or "empty" in name:
        value = 0  # uninitialised memory in torch; every later read is defined by its writes
    if isinstance(value, Tensor):
        return cv.op("expand", cv.cast(value, cv.meta.dtype), shape=_shape(cv))
    dt = dtype_of(cv.meta.dtype)
    if dt.is_bool:
        value = bool(value)
    elif not dt.is_float and not isinstance(value, Sym):
        value = int(value)
    elif dt.is_float and not isinstance(value, Sym):
        value = float(value)
    return cv.op("full", shape=_shape(cv), value=_fill_value(value), dtype=dt.name)


@lowers("aten.arange")
def _arange(cv, a):
    start, end, step = a.get("start", 0), a["end"], a.get("step", 1)
    dt = dtype_of(cv.meta.dtype)
    if dt.is_float:
        start, end, step = (v if isinstance(v, Sym) else float(v) for v in (start, end, step))
    return cv.op("arange", start=start, end=end, step=step, dtype=dt.name)


# ---- reductions --------------------------------------------------------------------------
def _axes(dim: Any) -> list | None:
    if dim is None or dim == [] or dim == ():
        return None
    return [int(d) for d in (dim if isinstance(dim, (list, tuple)) else [dim])]


def _reduce(kind: str):
    def rule(cv: Converter, a: dict) -> Tensor:
        x = a["self"]
        if a.get("dtype") is not None:
            x = cv.cast(x, a["dtype"])
        elif kind in ("reduce_sum", "reduce_prod") and (x.dtype.is_bool or x.dtype.is_integer):
            x = cv.cast(x, cv.meta.dtype)  # torch sums integers and bools in int64
        elif kind == "reduce_mean":
            x = cv.cast(x, cv.meta.dtype)
        return cv.op(kind, x, axes=_axes(a.get("dim")), keepdim=bool(a.get("keepdim", False)))

    return rule


for _k, _kind in {"sum": "reduce_sum", "mean": "reduce_mean", "amax": "reduce_max", "amin": "reduce_min",
                  "prod": "reduce_prod"}.items():  # fmt: skip
    lowers(f"aten.{_k}")(_reduce(_kind))


@lowers("aten.any", "aten.all")
def _any_all(cv, a):
    x = a["self"]
    flag = cv.op("ne", x, cv.tensor(0, x.dtype)) if not x.dtype.is_bool else x
    as_int = cv.cast(flag, "int32")
    kind = "reduce_max" if "any" in str(cv.node.target) else "reduce_min"
    dims = a.get("dim", a.get("dims"))
    r = cv.op(kind, as_int, axes=_axes(dims), keepdim=bool(a.get("keepdim", False)))
    return cv.cast(r, "bool")


@lowers("aten.max.dim", "aten.min.dim")
def _max_min_dim(cv, a):
    kind = "max" if "max" in str(cv.node.target) else "min"
    x, d, k = a["self"], int(a["dim"]), bool(a["keepdim"])
    return (cv.op(f"reduce_{kind}", x, axes=[d], keepdim=k), cv.op(f"arg{kind}", x, axis=d, keepdim=k))


@lowers("aten.max.other", "aten.min.other")
def _max_min_other(cv, a):
    x, y = _promoted(cv, a, "self", "other")
    return cv.op("maximum" if "max" in str(cv.node.target) else "minimum", x, y)


@lowers("aten.max.default", "aten.min.default")
def _max_min_all(cv, a):
    kind = "reduce_max" if "max" in str(cv.node.target) else "reduce_min"
    return cv.op(kind, a["self"], axes=None, keepdim=False)


@lowers("aten.argmax", "aten.argmin")
def _argmax(cv, a):
    kind = "argmax" if "argmax" in str(cv.node.target) else "argmin"
    x = a["self"]
    if a["dim"] is None:
        flat = cv.op("reshape", x, shape=[-1])
        r = cv.op(kind, flat, axis=0, keepdim=False)
        return cv.op("reshape", r, shape=[1] * x.ndim) if a["keepdim"] else r
    return cv.op(kind, x, axis=int(a["dim"]), keepdim=bool(a["keepdim"]))


@lowers("aten.var", "aten.std")
def _var(cv, a):
    x = cv.cast(a["self"], cv.meta.dtype)
    axes = _axes(a.get("dim"))
    correction = a.get("correction")
    if correction is None:
        correction = 1 if a.get("unbiased", True) else 0
    keep = bool(a.get("keepdim", False))
    mean = cv.op("reduce_mean", x, axes=axes, keepdim=True)
    d = cv.op("sub", x, mean)
    ss = cv.op("reduce_sum", cv.op("mul", d, d), axes=axes, keepdim=keep)
    n = 1
    for ax in axes if axes is not None else range(x.ndim):
        n = x.shape[ax] * n if isinstance(x.shape[ax], Sym) else n * x.shape[ax]
    denom = cv.op("sub", cv.cast(cv.tensor(n), x.dtype), cv.tensor(float(correction), x.dtype))
    var = cv.op("div", ss, cv.op("maximum", denom, cv.tensor(0.0, x.dtype)))
    return cv.op("sqrt", var) if "std" in str(cv.node.target) else var


@lowers("aten.cumsum")
def _cumsum(cv, a):
    x = cv.cast(a["self"], a["dtype"] if a["dtype"] is not None else cv.meta.dtype)
    return cv.op("cumsum", x, axis=int(a["dim"]))


@lowers("aten._softmax", "aten._log_softmax", "aten._safe_softmax")
def _softmax(cv, a):
    kind = "log_softmax" if "log" in str(cv.node.target) else "softmax"
    x = cv.cast(a["self"], cv.meta.dtype)
    y = cv.op(kind, x, axis=int(a["dim"]))
    if "safe" in str(cv.node.target):  # rows that are all -inf give 0, not nan
        ninf = cv.tensor(-math.inf, x.dtype)
        empty = cv.op("reduce_min", cv.cast(cv.op("eq", x, ninf), "int32"), axes=[int(a["dim"])], keepdim=True)
        y = cv.op("where", cv.cast(empty, "bool"), cv.tensor(0.0, x.dtype), y)
    return y
