"""Reduction arithmetic: identities, combiners, finalisation and cooperative (warp/block) all-reduce.

The warp and block all-reduce build the same shuffle butterfly and shared-memory exchange as
tessera.lang.collectives, for any combiner (collectives offers sum, max and min; reductions
here also need prod).
"""

from __future__ import annotations

from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.compute import ReduceCompute
from tessera.ir.dtypes import DataType
from tessera.ir.types import SHARED, TensorType
from tessera.ops.schedule.loops import i32, numel

WARP = 32


def identity(op: str, t: DataType) -> E.Const:
    """The value a reduction starts from."""
    if op in ("sum", "mean"):
        return E.Const(0, t)
    if op == "prod":
        return E.Const(1, t)
    if t.is_float:
        return E.Const(float("-inf") if op == "max" else float("inf"), t)
    return E.Const(t.min_value if op == "max" else t.max_value, t)


def combine(op: str, acc: E.Expr, v: E.Expr) -> E.Expr:
    if op in ("sum", "mean"):
        return E.Binary("+", acc, v)
    if op == "prod":
        return E.Binary("*", acc, v)
    return E.Call(op, (acc, v), acc.dtype)  # max/min propagate NaN (see the backends' ts_max)


def finalize(red: ReduceCompute, acc: E.Expr) -> E.Expr:
    """The reduction's result from its accumulator: the mean divides, then cast to the dtype."""
    if red.op == "mean":
        acc = E.Binary("/", acc, E.Cast(numel(red.reduce_extents), red.acc_dtype))
    return acc if acc.dtype == red.dtype else E.Cast(acc, red.dtype)


def warp_allreduce(acc: E.Var, op: str, width: int = WARP) -> list[S.Stmt]:
    """Leave the reduction of `acc` over `width` consecutive lanes in every one of them."""
    out: list[S.Stmt] = []
    offset = width // 2
    while offset:
        # Shuffle into a variable first: an integer max/min prints as `a > b ? a : b`, which
        # would evaluate the shuffle twice, once under a divergent branch (undefined result).
        other = E.Var(f"{acc.name}_from{offset}", acc.dtype)
        out.append(S.DeclareVar(other, E.Call("shfl_xor", (acc, i32(offset)), acc.dtype)))
        out.append(S.Assign(acc, combine(op, acc, other)))
        offset //= 2
    return out


def block_allreduce(acc: E.Var, op: str, threads: int, name: str) -> list[S.Stmt]:
    """Leave the reduction of `acc` over a 1-D block of `threads` threads in every thread."""
    out = warp_allreduce(acc, op)
    warps = threads // WARP
    if warps == 1:
        return out
    partials = E.Var(name, TensorType(acc.dtype, (i32(warps),), SHARED))
    tid = E.HardwareIndex("threadIdx.x")
    lane, warp = tid % i32(WARP), tid // i32(WARP)
    out += [
        S.DeclareBuffer(partials),
        S.If(E.Binary("==", lane, i32(0)), S.Store(partials, (warp,), acc)),
        S.Barrier(),
        S.Assign(acc, E.Load(partials, (i32(0),))),
    ]
    for w in range(1, warps):
        out.append(S.Assign(acc, combine(op, acc, E.Load(partials, (i32(w),)))))
    out.append(S.Barrier())  # the next reduction may reuse shared memory
    return out
