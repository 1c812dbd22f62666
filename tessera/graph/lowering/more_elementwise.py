"""Lowering rules for the elementwise operators the ONNX front end added: inverse
trigonometric and hyperbolic functions, C's fmod, bitwise xor and bit shifts.  Each is one
`ops.elementwise` over an IR expression (math library calls for the functions)."""

from __future__ import annotations

from tessera import ops
from tessera.graph.lowering.core import Ctx
from tessera.graph.lowering.elementwise import _operands
from tessera.graph.operator import Operator
from tessera.ir import expr as E
from tessera.ir.compute import TensorNode
from tessera.ops.common import compute_type, float_type

MATH_UNARY = ("asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh")


def math_unary(ctx: Ctx) -> list[TensorNode]:
    x = ctx.x()
    out = float_type(x.dtype)
    ct = compute_type(out)
    return ctx.finish([ops.elementwise(ctx.kind, [x], out, ct, lambda v: E.Call(ctx.kind, (v,), ct))])


def _trunc_rem(x: E.Expr, y: E.Expr) -> E.Expr:
    """Integer x % y with C's sign (of the dividend); 0 for a zero divisor (numpy's fmod gives 0)."""
    zero = E.Const(0, y.dtype)
    safe = E.Select(E.Binary("==", y, zero), E.Const(1, y.dtype), y)
    q = E.Binary("//", x, safe)  # floor division
    q = E.Select(E.Binary("&&", q < E.Const(0, q.dtype), E.Binary("!=", q * safe, x)), q + E.Const(1, q.dtype), q)
    return E.Select(E.Binary("==", y, zero), E.Const(0, x.dtype), x - q * safe)


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
