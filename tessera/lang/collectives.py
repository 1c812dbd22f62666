"""Warp and block reductions, expanded by the front end into shuffles, shared memory and barriers.

`warp_reduce(v, "sum")` combines v over the 32 lanes of a warp with a butterfly of
shfl_xor; every lane gets the result.  `block_reduce(v, "max")` reduces within each warp,
passes one partial per warp through shared memory and combines them, so every thread of a
(1-D) block gets the result.  Every thread must reach the call: these are collectives.
"""

from __future__ import annotations

from collections.abc import Callable

from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.types import SHARED, TensorType

OPS = ("sum", "max", "min")
WARP = 32


def combiner(op: str, t: dtypes.DataType) -> Callable[[E.Expr, E.Expr], E.Expr]:
    if op == "sum":
        return lambda a, b: E.Binary("+", a, b)
    return lambda a, b: E.Call(op, (a, b), t)


def warp_reduce(acc: E.Var, op: str) -> list[S.Stmt]:
    """Statements that leave the warp-wide reduction of `acc` in `acc` on every lane."""
    combine = combiner(op, acc.dtype)
    out: list[S.Stmt] = []
    offset = WARP // 2
    while offset:
        # The shuffle goes into its own variable: integer max/min compile to `a > b ? a : b`,
        # which would run a shuffle twice, once under divergent control flow.
        other = E.Var("lane_value", acc.dtype)
        out.append(S.DeclareVar(other, E.Call("shfl_xor", (acc, E.Const(offset, dtypes.int32)), acc.dtype)))
        out.append(S.Assign(acc, combine(acc, other)))
        offset //= 2
    return out


def block_reduce(acc: E.Var, op: str, threads: int, name: str) -> list[S.Stmt]:
    """Statements that leave the block-wide reduction of `acc` in `acc` on every thread."""
    warps = threads // WARP
    out = warp_reduce(acc, op)
    if warps == 1:
        return out
    partials = E.Var(name, TensorType(acc.dtype, (E.Const(warps, dtypes.int32),), SHARED))
    tid = E.HardwareIndex("threadIdx.x")
    lane = E.Binary("%", tid, E.Const(WARP, dtypes.int32))
    warp = E.Binary("//", tid, E.Const(WARP, dtypes.int32))
    combine = combiner(op, acc.dtype)
    out += [
        S.DeclareBuffer(partials),
        S.If(E.Binary("==", lane, E.Const(0, dtypes.int32)), S.Store(partials, (warp,), acc)),
        S.Barrier(),
        S.Assign(acc, E.Load(partials, (E.Const(0, dtypes.int32),))),
    ]
    for w in range(1, warps):
        out.append(S.Assign(acc, combine(acc, E.Load(partials, (E.Const(w, dtypes.int32),)))))
    out.append(S.Barrier())  # the partials may be reused by the next reduction
    return out
