"""Lowering rules for the graph operators the ONNX front end added: inverse trigonometric and
hyperbolic functions, C's fmod, bitwise xor and bit shifts (each one `ops.elementwise` over
an IR expression), bitcast (the same bits as another type), gather_nd (a gather whose index tuples are read from a tensor) and cumprod
(a masked product over the axis, like ops.cumsum)."""

from __future__ import annotations

from collections.abc import Sequence

from tessera import ops
from tessera.graph.lowering.core import Ctx, cast
from tessera.graph.lowering.elementwise import _operands
from tessera.graph.operator import Operator
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.compute import TensorNode, compute, fresh_name, reduce
from tessera.ops.common import compute_type, float_type
from tessera.ops.transform import safe_index

MATH_UNARY = ("asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh")


def math_unary(ctx: Ctx) -> list[TensorNode]:
    x = ctx.x()
    out = float_type(x.dtype)
    ct = compute_type(out)
    return ctx.finish([ops.elementwise(ctx.kind, [x], out, ct, lambda v: E.Call(ctx.kind, (v,), ct))])


def _trunc_rem(x: E.Expr, y: E.Expr) -> E.Expr:
    """Integer x % y with C's sign (the dividend's), from the kernels' floored `%`: a zero
    divisor follows the kernels' rule (DivisionByZeroError on the CPU, 0 on CUDA)."""
    m = E.Binary("%", x, y)  # the divisor's sign
    zero = E.Const(0, m.dtype)
    flip = E.Binary("&&", E.Binary("!=", m, zero), E.Binary("!=", m < zero, x < E.Const(0, x.dtype)))
    return E.Select(flip, m - y, m)


def fmod(ctx: Ctx) -> list[TensorNode]:
    dt = ctx.out_dtype
    a, b = _operands(ctx, dt)
    ct = compute_type(dt)
    fn = (lambda x, y: E.Call("fmod", (x, y), ct)) if dt.is_float else _trunc_rem
    return ctx.finish([ops.elementwise("fmod", [a, b], dt, ct, fn)])


def bitwise_xor(ctx: Ctx) -> list[TensorNode]:
    dt = ctx.out_dtype
    a, b = _operands(ctx, dt)
    fn = (lambda x, y: E.Binary("!=", x, y)) if dt.is_bool else (lambda x, y: E.Binary("^", x, y))
    return ctx.finish([ops.elementwise("bitwise_xor", [a, b], dt, dt, fn)])


def bitshift(ctx: Ctx) -> list[TensorNode]:
    dt = ctx.out_dtype
    a, b = _operands(ctx, dt)
    sym = "<<" if ctx.attrs["left"] else ">>"
    bits = dt.nbits
    # numpy gives 0 for shifts of the width or more; C leaves them undefined
    fn = lambda x, y: E.Select(y < E.Const(bits, dt), E.Binary(sym, x, y), E.Const(0, dt))  # noqa: E731
    return ctx.finish([ops.elementwise("bitshift", [a, b], dt, dt, fn)])


def check_integer(op: Operator) -> str | None:
    if op.outputs[0].dtype.is_float:
        return f"{op.kind} of floating-point tensors is not defined"
    return None


def check_unsigned(op: Operator) -> str | None:
    dt = op.outputs[0].dtype
    if dt.is_float or dt.is_bool or dt.is_signed:
        return f"{op.kind} of {dt} is not lowered (ONNX BitShift takes unsigned integers)"
    return None


def check_fmod(op: Operator) -> str | None:
    if op.outputs[0].dtype.is_bool:
        return "fmod of bool tensors is not lowered"
    return None


def bitcast(ctx: Ctx) -> list[TensorNode]:
    return ctx.finish([ops.bitcast(ctx.x(), ctx.out_dtype)])


def gather_nd(ctx: Ctx) -> list[TensorNode]:
    """out[i..., j...] = data[i[:b]..., idx[i..., 0], ..., idx[i..., k-1], j...] (negative indices wrap)."""
    data, idx = ctx.x(0), ctx.x(1)
    if idx.dtype not in (dtypes.int32, dtypes.int64):
        idx = cast(idx, dtypes.int64)
    b, k = ctx.attrs["batch_dims"], ctx.op.inputs[1].shape[-1]
    lead = idx.rank - 1
    shape = [*idx.shape[:-1], *data.shape[b + k :]]

    def fn(*i: E.Var) -> E.Expr:
        picks = [safe_index(idx[(*i[:lead], E.Const(t, dtypes.int32))], data.shape[b + t]) for t in range(k)]
        return data[(*i[:b], *picks, *i[lead:])]

    return ctx.finish([compute(shape, fn, fresh_name("gather_nd"), data.dtype, tag="gather")])


def cumprod(ctx: Ctx) -> list[TensorNode]:
    x = ctx.x()
    a = ctx.attrs["axis"] % x.rank
    exclusive, reverse = bool(ctx.attrs["exclusive"]), bool(ctx.attrs["reverse"])
    out = ctx.out_dtype
    acc = compute_type(out)
    cmp = {(False, False): "<=", (True, False): "<", (False, True): ">=", (True, True): ">"}[(exclusive, reverse)]

    def fn(i: Sequence[E.Expr], r: Sequence[E.Expr]) -> E.Expr:
        src = tuple(r[0] if d == a else v for d, v in enumerate(i))
        return E.Select(E.Binary(cmp, r[0], i[a]), E.Cast(x[src], acc), E.Const(1, acc))

    return ctx.finish([reduce(x.shape, [x.shape[a]], fn, "prod", fresh_name("cumprod"), out, acc, tag="contraction")])


def check_cumprod(op: Operator) -> str | None:
    if op.outputs[0].dtype.is_bool:
        return "cumprod to bool is not lowered"
    return None
