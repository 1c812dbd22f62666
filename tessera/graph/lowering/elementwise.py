"""Lowering rules for the elementwise operators: unary math and activations, binary arithmetic,
comparisons and logic, where, clamp and cast.

Binary operators first cast their tensor operands to the graph's result dtype (the graph
promotes C-like, ops numpy-like, and the graph's dtype is the semantics), then conform them to
the broadcast output shape, then call the ops function, which does the arithmetic in float32
for float16/bfloat16 values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tessera import ops
from tessera.graph.lowering.core import Ctx, cast, copy, python_value
from tessera.graph.operator import Operator
from tessera.graph.symbolic import Sym, contains_sym
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.compute import TensorNode, compute, fresh_name
from tessera.ops.common import compute_type

# ---- unary -----------------------------------------------------------------------------------------------------
UNARY: dict[str, Callable[[TensorNode], TensorNode]] = {
    "exp": ops.exp, "log": ops.log, "sqrt": ops.sqrt, "rsqrt": ops.rsqrt, "sin": ops.sin, "cos": ops.cos,
    "tan": ops.tan, "tanh": ops.tanh, "sigmoid": ops.sigmoid, "silu": ops.silu, "erf": ops.erf,
    "reciprocal": ops.reciprocal, "softplus": ops.softplus, "log1p": ops.log1p, "expm1": ops.expm1,
    "mish": ops.mish, "hardsigmoid": ops.hardsigmoid, "hardswish": ops.hardswish,
    "neg": ops.neg, "abs": ops.abs, "relu": ops.relu, "sign": ops.sign, "floor": ops.floor, "ceil": ops.ceil,
    "round": ops.round, "logical_not": ops.logical_not, "isnan": ops.isnan, "identity": copy,
}  # fmt: skip
_BOOL_IDENTITY = ("abs", "relu", "sign")  # of bools (numpy's and torch's semantics); neg of a bool does not infer


def unary(ctx: Ctx) -> list[TensorNode]:
    if ctx.kind in _BOOL_IDENTITY and ctx.x().dtype.is_bool:
        return ctx.finish([copy(ctx.x())])
    return ctx.finish([UNARY[ctx.kind](ctx.x())])


def gelu(ctx: Ctx) -> list[TensorNode]:
    return ctx.finish([ops.gelu(ctx.x(), ctx.attrs["approximate"])])


def check_gelu(op: Operator) -> str | None:
    a = op.opdef.normalize_attrs(op.attrs)["approximate"]
    return None if a in ("none", "tanh") else f"gelu approximate={a!r} is not lowered"


def leaky_relu(ctx: Ctx) -> list[TensorNode]:
    return ctx.finish([ops.leaky_relu(ctx.x(), float(ctx.attrs["negative_slope"]))])


def elu(ctx: Ctx) -> list[TensorNode]:
    return ctx.finish([ops.elu(ctx.x(), float(ctx.attrs["alpha"]))])


def check_float_input(op: Operator) -> str | None:
    if not op.inputs[0].dtype.is_float:
        return f"{op.kind} of {op.inputs[0].dtype} is not lowered (its reference keeps the integer dtype)"
    return None


def cast_op(ctx: Ctx) -> list[TensorNode]:
    return ctx.finish([ops.cast(ctx.x(), ctx.out_dtype)])


def clamp(ctx: Ctx) -> list[TensorNode]:
    x = ctx.x()
    lo, hi = ctx.attrs["min"], ctx.attrs["max"]
    if lo is None and hi is None:
        return ctx.finish([copy(x)])
    # The reference converts the bounds to x's dtype first (2.7 clamps an integer tensor at 2).
    lo = None if lo is None else python_value(lo, x.dtype)
    hi = None if hi is None else python_value(hi, x.dtype)
    return ctx.finish([ops.clamp(x, lo, hi)])


def check_clamp(op: Operator) -> str | None:
    attrs = op.opdef.normalize_attrs(op.attrs)
    if contains_sym([attrs["min"], attrs["max"]]):
        return "clamp with symbolic bounds is not lowered"
    if op.inputs[0].dtype.is_bool:
        return "clamp of a bool tensor is not lowered"
    return None


# ---- binary ----------------------------------------------------------------------------------------------------
def _operands(ctx: Ctx, dt: dtypes.DataType | None, n: int = 2) -> list[Any]:
    """The first n inputs (Python numbers where scalars are inlined), tensors cast to dt and
    conformed to the output shape."""
    args = [ctx.arg(k) for k in range(n)]
    if not any(isinstance(a, TensorNode) for a in args):
        args[0] = ctx.x(0)
    if dt is not None:
        args = [cast(a, dt) if isinstance(a, TensorNode) else a for a in args]
    return ctx.broadcast(args, ctx.out_shape())


ARITH: dict[str, Callable[[Any, Any], TensorNode]] = {
    "add": ops.add, "sub": ops.sub, "mul": ops.mul, "maximum": ops.maximum, "minimum": ops.minimum,
    "pow": ops.pow, "remainder": ops.remainder, "bitwise_and": ops.bitwise_and, "bitwise_or": ops.bitwise_or,
}  # fmt: skip
COMPARE: dict[str, Callable[[Any, Any], TensorNode]] = {
    "eq": ops.eq, "ne": ops.ne, "lt": ops.lt, "le": ops.le, "gt": ops.gt, "ge": ops.ge,
    "logical_and": ops.logical_and, "logical_or": ops.logical_or, "logical_xor": ops.logical_xor,
}  # fmt: skip


def arith(ctx: Ctx) -> list[TensorNode]:
    a, b = _operands(ctx, ctx.out_dtype)
    return ctx.finish([ARITH[ctx.kind](a, b)])


def check_arith(op: Operator) -> str | None:
    dt = op.outputs[0].dtype
    if op.kind == "pow" and dt.is_bool:
        return "pow of bool tensors is not lowered"
    if op.kind == "remainder" and dt.is_bool:
        return "remainder of bool tensors is not lowered"
    return None


def compare(ctx: Ctx) -> list[TensorNode]:
    # Comparisons take both operands in their promoted dtype (the graph's C-like promotion, as
    # the reference does); logical ops take each operand's truth value as it is.
    ins = ctx.op.inputs
    dt = None if ctx.kind.startswith("logical") else dtypes.promote_graph(ins[0].dtype, ins[1].dtype)
    a, b = _operands(ctx, dt)
    return ctx.finish([COMPARE[ctx.kind](a, b)])


def _trunc_div(x: E.Expr, y: E.Expr) -> E.Expr:
    if x.dtype.is_float:
        q = E.Binary("/", x, y)
        return E.Select(q < E.Const(0, q.dtype), E.Call("ceil", (q,), q.dtype), E.Call("floor", (q,), q.dtype))
    # Floor division, then negative inexact quotients rounded up.  A zero divisor follows the
    # kernels' integer division (DivisionByZeroError on the CPU, 0 on CUDA), like torch.
    q = E.Binary("//", x, y)
    return E.Select(E.Binary("&&", q < E.Const(0, q.dtype), E.Binary("!=", q * y, x)), q + E.Const(1, q.dtype), q)


def div(ctx: Ctx) -> list[TensorNode]:
    dt, rounding = ctx.out_dtype, ctx.attrs["rounding"]
    a, b = _operands(ctx, dt)
    if rounding is None:
        return ctx.finish([ops.div(a, b)])
    if rounding == "floor":
        return ctx.finish([ops.floor_divide(a, b)])
    return ctx.finish([ops.elementwise("div_trunc", [a, b], dt, compute_type(dt), _trunc_div)])


def check_div(op: Operator) -> str | None:
    rounding = op.opdef.normalize_attrs(op.attrs)["rounding"]
    if rounding not in (None, "floor", "trunc"):
        return f"div rounding={rounding!r} is not lowered"
    if op.outputs[0].dtype.is_bool:
        return "div of bool tensors is not lowered"
    return None


def where(ctx: Ctx) -> list[TensorNode]:
    cond = ctx.x(0)
    if not cond.dtype.is_bool:
        cond = ops.ne(cond, 0)  # the reference's astype(bool): nonzero (and NaN) is True
    args = [cond, ctx.arg(1), ctx.arg(2)]
    dt = ctx.out_dtype
    args = [args[0]] + [cast(a, dt) if isinstance(a, TensorNode) else python_value(a, dt) for a in args[1:]]
    if not any(isinstance(a, TensorNode) for a in args[1:]):
        args[1] = cast(ctx.x(1), dt)
    cond, a, b = ctx.broadcast(args, ctx.out_shape())
    return ctx.finish([ops.where(cond, a, b)])


def full_like_value(value: Any, dt: dtypes.DataType, ctx: Ctx) -> E.Expr:
    """A fill value (a number or a symbolic size) as an expression of dtype dt."""
    if isinstance(value, Sym):
        return E.Cast(ctx.attr_dim(value), dt)
    return E.Const(python_value(value, dt), dt)


def scalar_node(value: Any, dt: dtypes.DataType, ctx: Ctx) -> TensorNode:
    """A rank-0 tensor holding value (possibly a symbolic size)."""
    e = full_like_value(value, dt, ctx)
    return compute([], lambda: e, fresh_name("scalar"), dt)
