"""Conversion rules from torch functions, Tensor methods and operators to graph operators.

Each rule receives the already-translated arguments (graph tensors, Python scalars or
symbolic sizes) and returns the value of the node.  A rule raises UnsupportedError for an
argument pattern it does not handle, which makes the node run in torch instead.
"""

from __future__ import annotations

import ast
import functools
from typing import Any

import numpy as np
import torch

from tessera.errors import UnsupportedError
from tessera.frontend.torch.convert import Converter, dtype_of, handles
from tessera.graph import Tensor
from tessera.ir import dtypes

_MISSING = object()


@functools.cache
def _parse(spec: str) -> tuple[tuple[str, ...], dict[str, Any]]:
    names, defaults = [], {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        name, eq, default = part.partition("=")
        names.append(name.strip())
        if eq:
            defaults[name.strip()] = ast.literal_eval(default.strip())
    return tuple(names), defaults


def bind(args: list, kwargs: dict, spec: str) -> dict[str, Any]:
    """Bind torch-style arguments to the parameter list spec ("input, dim=None, keepdim=False")."""
    names, defaults = _parse(spec)
    if len(args) > len(names):
        raise UnsupportedError(f"too many arguments for ({spec})")
    out: dict[str, Any] = dict(defaults)
    out.update(zip(names, args))
    for k, v in kwargs.items():
        if k not in names:
            raise UnsupportedError(f"unsupported keyword argument {k!r}")
        out[k] = v
    for n in names:
        if n not in out:
            raise UnsupportedError(f"missing argument {n!r}")
    return out


def _ints(v: Any) -> list:
    if isinstance(v, (list, tuple, torch.Size)):
        if len(v) == 1 and isinstance(v[0], (list, tuple)):
            return list(v[0])
        return list(v)
    return [v]


def _varargs(args: list) -> list:
    """Sizes given as f(x, 2, 3) or f(x, (2, 3))."""
    rest = args[1:]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple, torch.Size)):
        return list(rest[0])
    return list(rest)


# ---- elementwise ---------------------------------------------------------------------------
_UNARY = {
    "relu": "relu", "sigmoid": "sigmoid", "tanh": "tanh", "exp": "exp", "log": "log", "sqrt": "sqrt",
    "rsqrt": "rsqrt", "sin": "sin", "cos": "cos", "erf": "erf", "neg": "neg", "abs": "abs",
    "reciprocal": "reciprocal", "floor": "floor", "ceil": "ceil", "silu": "silu", "softplus": "softplus",
    "mish": "mish", "hardswish": "hardswish", "hardsigmoid": "hardsigmoid", "logical_not": "logical_not",
    "sign": "sign", "log1p": "log1p", "expm1": "expm1", "isnan": "isnan", "negative": "neg",
}  # fmt: skip


def _unary(kind: str):
    def rule(cv: Converter, args: list, kwargs: dict) -> Tensor:
        kwargs.pop("inplace", None)
        if kwargs or len(args) != 1 and not (len(args) == 2 and args[1] is False):
            raise UnsupportedError(f"{kind} with extra arguments {args[1:]} {kwargs}")
        return cv.op(kind, cv.tensor(args[0]))

    return rule


for _name, _kind in _UNARY.items():
    handles(f"torch.{_name}", f"method.{_name}", f"F.{_name}", f"torch.special.{_name}")(_unary(_kind))
handles("op.neg")(_unary("neg"))


@handles("op.invert", "method.bitwise_not", "torch.bitwise_not")
def _invert(cv, args, kwargs):
    x = cv.tensor(args[0])
    if not x.dtype.is_bool:
        raise UnsupportedError("bitwise not of integers")
    return cv.op("logical_not", x)


@handles("F.gelu")
def _gelu(cv, args, kwargs):
    a = bind(args, kwargs, "input, approximate='none'")
    return cv.op("gelu", a["input"], approximate=a["approximate"])


@handles("F.leaky_relu")
def _leaky(cv, args, kwargs):
    a = bind(args, kwargs, "input, negative_slope=0.01, inplace=False")
    return cv.op("leaky_relu", a["input"], negative_slope=float(a["negative_slope"]))


@handles("F.elu")
def _elu(cv, args, kwargs):
    a = bind(args, kwargs, "input, alpha=1.0, inplace=False")
    return cv.op("elu", a["input"], alpha=float(a["alpha"]))


@handles("F.dropout", "F.dropout1d", "F.dropout2d", "F.alpha_dropout", "method.contiguous", "method.clone",
         "torch.clone", "method.detach", "torch.detach")  # fmt: skip
def _identity(cv, args, kwargs):
    if kwargs.get("training", args[2] if len(args) > 2 else False) is True:
        raise UnsupportedError("dropout in training mode")
    return args[0]


@handles("torch._C._set_grad_enabled")
def _grad_mode(cv, args, kwargs):
    return None


def _cast(cv, x: Tensor, dt) -> Tensor:
    dt = dtype_of(dt) if isinstance(dt, torch.dtype) else dt
    return x if x.dtype == dt else cv.op("cast", x, dtype=dt.name)


for _m, _dt in {"float": torch.float32, "half": torch.float16, "double": torch.float64, "int": torch.int32,
                "long": torch.int64, "bool": torch.bool, "bfloat16": torch.bfloat16}.items():  # fmt: skip
    handles(f"method.{_m}")(lambda cv, args, kwargs, _dt=_dt: _cast(cv, cv.tensor(args[0]), _dt))


@handles("method.to", "method.type")
def _to(cv, args, kwargs):
    x = cv.tensor(args[0])
    dt = kwargs.pop("dtype", None)
    kwargs.pop("non_blocking", None), kwargs.pop("copy", None), kwargs.pop("device", None)
    for a in args[1:]:
        if isinstance(a, torch.dtype):
            dt = a
        elif isinstance(a, Tensor):
            dt = a.dtype
        elif not isinstance(a, (torch.device, str)):
            raise UnsupportedError(f"Tensor.to({a!r})")
    if kwargs:
        raise UnsupportedError(f"Tensor.to with {kwargs}")
    return x if dt is None else _cast(cv, x, dt)


@handles("method.type_as")
def _type_as(cv, args, kwargs):
    return _cast(cv, cv.tensor(args[0]), cv.tensor(args[1]).dtype)


# ---- binary --------------------------------------------------------------------------------
def _operands(cv: Converter, a: Any, b: Any) -> tuple[Tensor, Tensor]:
    if not isinstance(a, Tensor) and not isinstance(b, Tensor):
        raise UnsupportedError("binary op on two scalars")
    ta = a if isinstance(a, Tensor) else cv.tensor(a, like=b)
    tb = b if isinstance(b, Tensor) else cv.tensor(b, like=ta)
    # A 0-d tensor does not raise the precision of a higher-rank one of the same kind (torch rule).
    for x, y in ((ta, tb), (tb, ta)):
        if x.ndim == 0 and y.ndim > 0 and x.dtype != y.dtype and x.dtype.kind == y.dtype.kind:
            x2 = _cast(cv, x, y.dtype)
            ta, tb = (x2, tb) if x is ta else (ta, x2)
    return ta, tb


def _binary(kind: str, swap: bool = False):
    def rule(cv: Converter, args: list, kwargs: dict) -> Tensor:
        alpha = kwargs.pop("alpha", 1)
        if "other" in kwargs:
            args = [args[0], kwargs.pop("other")]
        if kwargs or len(args) != 2:
            raise UnsupportedError(f"{kind} with arguments {kwargs}")
        a, b = (args[1], args[0]) if swap else (args[0], args[1])
        if alpha != 1:
            b = cv.op("mul", *_operands(cv, b, alpha))
        return cv.op(kind, *_operands(cv, a, b))

    return rule


for _k, _kind in {"add": "add", "sub": "sub", "mul": "mul", "pow": "pow", "maximum": "maximum",
                  "minimum": "minimum", "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
                  "logical_and": "logical_and", "logical_or": "logical_or", "remainder": "remainder",
                  "subtract": "sub", "multiply": "mul", "fmod": None}.items():  # fmt: skip
    if _kind:
        handles(f"torch.{_k}", f"method.{_k}", f"op.{_k}")(_binary(_kind))
handles("op.truediv", "method.truediv")(_binary("div"))
handles("method.rsub", "torch.rsub")(_binary("sub", swap=True))
handles("op.and_")(_binary("logical_and"))
handles("op.or_")(_binary("logical_or"))
handles("method.__rpow__")(_binary("pow", swap=True))


@handles("torch.div", "method.div", "torch.true_divide", "method.true_divide")
def _div(cv, args, kwargs):
    a = bind(args, kwargs, "input, other, rounding_mode=None")
    return cv.op("div", *_operands(cv, a["input"], a["other"]), rounding=a["rounding_mode"])


@handles("op.floordiv", "torch.floor_divide", "method.floor_divide")
def _floordiv(cv, args, kwargs):
    return cv.op("div", *_operands(cv, args[0], args[1]), rounding="floor")


@handles("torch.where", "method.where")
def _where(cv, args, kwargs):
    a = bind(args, kwargs, "condition, input, other")
    x, y = _operands(cv, a["input"], a["other"])
    return cv.op("where", cv.tensor(a["condition"]), x, y)


@handles("method.masked_fill", "torch.masked_fill")
def _masked_fill(cv, args, kwargs):
    a = bind(args, kwargs, "input, mask, value")
    x = cv.tensor(a["input"])
    return cv.op("where", cv.tensor(a["mask"]), cv.tensor(a["value"], like=x) if not isinstance(a["value"], Tensor)
                 else _cast(cv, a["value"], x.dtype), x)  # fmt: skip


@handles("torch.clamp", "method.clamp", "torch.clip", "method.clip")
def _clamp(cv, args, kwargs):
    a = bind(args, kwargs, "input, min=None, max=None")
    x = a["input"]
    if isinstance(a["min"], Tensor) or isinstance(a["max"], Tensor):
        if a["min"] is not None:
            x = cv.op("maximum", *_operands(cv, x, a["min"]))
        if a["max"] is not None:
            x = cv.op("minimum", *_operands(cv, x, a["max"]))
        return x
    return cv.op("clamp", x, min=a["min"], max=a["max"])


# ---- matrix products -----------------------------------------------------------------------
@handles("op.matmul", "torch.matmul", "method.matmul", "torch.bmm", "method.bmm", "torch.mm", "method.mm")
def _matmul(cv, args, kwargs):
    if kwargs:
        raise UnsupportedError("matmul with out=")
    return cv.op("matmul", cv.tensor(args[0]), cv.tensor(args[1]))


@handles("F.linear")
def _linear(cv, args, kwargs):
    a = bind(args, kwargs, "input, weight, bias=None")
    ins = [a["input"], a["weight"]] + ([a["bias"]] if a["bias"] is not None else [])
    return cv.op("linear", *ins)


@handles("torch._ops.tessera.lowbit_linear.default")
def _lowbit_linear(cv, args, kwargs):
    """tessera.quantize's layers: float16 activations become the lowbit_linear anchor (the CUDA
    low-bit kernel); others run in torch, where the op calls tessera's CPU kernel."""
    from tessera.quant.torch_quantize import layer_of

    x, handle = bind(args, kwargs, "x, handle").values()
    x = cv.tensor(x)
    if x.dtype != dtypes.float16:
        raise UnsupportedError(f"lowbit_linear on {x.dtype} activations runs in torch (tessera's CPU kernel)")
    consts, attrs = layer_of(handle).graph_operands()
    return cv.op("lowbit_linear", x, *(cv.const(c, dtype=d) for c, d in zip(consts, ("uint32", "float16", "float16"))),
                 **attrs)  # fmt: skip


@handles("torch.addmm", "torch.baddbmm")
def _addmm(cv, args, kwargs):
    a = bind(args, kwargs, "input, mat1, mat2, beta=1, alpha=1")
    prod = cv.op("matmul", a["mat1"], a["mat2"])
    if a["alpha"] != 1:
        prod = cv.op("mul", *_operands(cv, prod, a["alpha"]))
    bias = a["input"] if a["beta"] == 1 else cv.op("mul", *_operands(cv, a["input"], a["beta"]))
    return cv.op("add", *_operands(cv, prod, bias))


@handles("F.scaled_dot_product_attention")
def _sdpa(cv, args, kwargs):
    a = bind(args, kwargs, "query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False")
    if a["dropout_p"]:
        raise UnsupportedError("attention dropout")
    q, k, v = a["query"], a["key"], a["value"]
    if q.ndim >= 3 and q.shape[-3] != k.shape[-3] and not a["enable_gqa"]:
        raise UnsupportedError("attention heads differ without enable_gqa")
    ins = [q, k, v] + ([cv.tensor(a["attn_mask"])] if a["attn_mask"] is not None else [])
    if len(ins) == 4 and a["is_causal"]:
        raise UnsupportedError("attention with both a mask and is_causal")  # torch rejects it too
    return cv.op("scaled_dot_product_attention", *ins, causal=bool(a["is_causal"]), scale=a["scale"])


# ---- convolution, pooling, normalization ----------------------------------------------------
def _pair(v):
    v = _ints(v)
    return [int(v[0]), int(v[0])] if len(v) == 1 else [int(v[0]), int(v[1])]


@handles("F.conv2d", "torch.conv2d")
def _conv2d(cv, args, kwargs):
    a = bind(args, kwargs, "input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1")
    w = a["weight"]
    dil = _pair(a["dilation"])
    if isinstance(a["padding"], str):
        if a["padding"] == "valid":
            pad = [0, 0, 0, 0]
        else:  # "same" (stride 1): extra padding goes to the end, as torch does
            th, tw = dil[0] * (w.shape[2] - 1), dil[1] * (w.shape[3] - 1)
            pad = [th // 2, tw // 2, th - th // 2, tw - tw // 2]
    else:
        ph, pw = _pair(a["padding"])
        pad = [ph, pw, ph, pw]
    ins = [a["input"], w] + ([a["bias"]] if a["bias"] is not None else [])
    return cv.op("conv2d", *ins, stride=_pair(a["stride"]), padding=pad, dilation=dil, groups=int(a["groups"]))


@handles("F.max_pool2d", "torch.max_pool2d", "F.max_pool2d_with_indices")
def _max_pool(cv, args, kwargs):
    a = bind(args, kwargs, "input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False")
    if a["return_indices"]:
        raise UnsupportedError("max_pool2d with return_indices")
    ph, pw = _pair(a["padding"])
    stride = _pair(a["stride"]) if a["stride"] not in (None, [], ()) else None
    return cv.op("max_pool2d", a["input"], kernel=_pair(a["kernel_size"]), stride=stride, padding=[ph, pw, ph, pw],
                 dilation=_pair(a["dilation"]), ceil_mode=bool(a["ceil_mode"]))  # fmt: skip


@handles("F.avg_pool2d", "torch._C._nn.avg_pool2d")
def _avg_pool(cv, args, kwargs):
    a = bind(args, kwargs, "input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None")
    if a["divisor_override"] is not None:
        raise UnsupportedError("avg_pool2d with divisor_override")
    ph, pw = _pair(a["padding"])
    stride = _pair(a["stride"]) if a["stride"] not in (None, [], ()) else None
    return cv.op("avg_pool2d", a["input"], kernel=_pair(a["kernel_size"]), stride=stride, padding=[ph, pw, ph, pw],
                 ceil_mode=bool(a["ceil_mode"]), count_include_pad=bool(a["count_include_pad"]))  # fmt: skip


@handles("F.adaptive_avg_pool2d")
def _adaptive(cv, args, kwargs):
    a = bind(args, kwargs, "input, output_size")
    x = a["input"]
    size = _pair(a["output_size"]) if None not in _ints(a["output_size"]) else None
    if size is None:
        o = _ints(a["output_size"]) * (2 // len(_ints(a["output_size"])))
        size = [x.shape[2] if o[0] is None else o[0], x.shape[3] if o[1] is None else o[1]]
    return cv.op("adaptive_avg_pool2d", x, output_size=size)


@handles("F.batch_norm")
def _batch_norm(cv, args, kwargs):
    a = bind(args, kwargs, "input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-05")
    if a["training"] or a["running_mean"] is None:
        raise UnsupportedError("batch_norm in training mode (batch statistics)")
    x, mean = a["input"], a["running_mean"]
    w = a["weight"] if a["weight"] is not None else Tensor.constant(np.ones(mean.shape, np.float32), x.dtype)
    b = a["bias"] if a["bias"] is not None else Tensor.constant(np.zeros(mean.shape, np.float32), x.dtype)
    return cv.op("batch_norm", x, mean, a["running_var"], w, b, eps=float(a["eps"]))


@handles("F.layer_norm")
def _layer_norm(cv, args, kwargs):
    a = bind(args, kwargs, "input, normalized_shape, weight=None, bias=None, eps=1e-05")
    ins = [a["input"]]
    if a["weight"] is not None or a["bias"] is not None:
        ins.append(a["weight"] if a["weight"] is not None else cv.op("full", shape=list(_ints(a["normalized_shape"])),
                                                                     value=1.0, dtype=a["input"].dtype.name))  # fmt: skip
    if a["bias"] is not None:
        ins.append(a["bias"])
    return cv.op("layer_norm", *ins, num_axes=len(_ints(a["normalized_shape"])), eps=float(a["eps"]))


@handles("F.rms_norm", "torch.rms_norm")
def _rms_norm(cv, args, kwargs):
    a = bind(args, kwargs, "input, normalized_shape, weight=None, eps=None")
    x = a["input"]
    eps = a["eps"] if a["eps"] is not None else float(torch.finfo(getattr(torch, x.dtype.name)).eps)
    ins = [x] + ([a["weight"]] if a["weight"] is not None else [])
    return cv.op("rms_norm", *ins, num_axes=len(_ints(a["normalized_shape"])), eps=float(eps))


def _softmax_like(kind: str):
    def rule(cv, args, kwargs):
        a = bind(args, kwargs, "input, dim=None, _stacklevel=3, dtype=None")
        x = a["input"]
        if a["dtype"] is not None:
            x = _cast(cv, x, a["dtype"])
        if a["dim"] is None:
            raise UnsupportedError(f"{kind} without dim")
        return cv.op(kind, x, axis=int(a["dim"]))

    return rule


for _k in ("softmax", "log_softmax"):
    handles(f"F.{_k}", f"torch.{_k}", f"method.{_k}", f"torch.special.{_k}")(_softmax_like(_k))


@handles("F.embedding")
def _embedding(cv, args, kwargs):
    a = bind(args, kwargs, "input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False")
    if a["max_norm"] is not None:
        raise UnsupportedError("embedding with max_norm (it renormalizes the weight in place)")
    return cv.op("take", a["weight"], a["input"], axis=0)



# ---- in-place arithmetic on intermediates (torchvision's `out += identity`) ----------------
def _inplace(kind: str):
    """`a op= b` as a functional op, when nothing can observe the mutation of `a`: it is an
    intermediate (not a graph input or module state) and no later node reads it."""
    functional = _binary(kind)

    def rule(cv: Converter, args: list, kwargs: dict) -> Tensor:
        node = cv.node
        target = node.args[0]
        if not isinstance(target, torch.fx.Node) or target.op != "call_function" and target.op != "call_method":
            raise UnsupportedError("in-place update of a graph input or module state")
        order = {n: i for i, n in enumerate(node.graph.nodes)}
        if any(order[u] > order[node] for u in target.users if u is not node):
            raise UnsupportedError("in-place update of a tensor that later nodes read")
        return functional(cv, args, kwargs)

    return rule


for _k, _kind in {"iadd": "add", "isub": "sub", "imul": "mul", "itruediv": "div"}.items():
    handles(f"op.{_k}")(_inplace(_kind))
for _k, _kind in {"add_": "add", "sub_": "sub", "mul_": "mul", "div_": "div"}.items():
    handles(f"method.{_k}")(_inplace(_kind))
