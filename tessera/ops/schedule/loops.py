"""Index arithmetic and loop nests shared by the CPU and CUDA schedules."""

from __future__ import annotations

from collections.abc import Sequence

from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ops.common import mul_dims, static


def i32(v: int) -> E.Const:
    return E.Const(v, dtypes.int32)


def index_var(name: str) -> E.Var:
    return E.Var(name, dtypes.int32)


def ceil_div(a: E.Expr, b: int) -> E.Expr:
    if static(a) is not None:
        return i32(-(-static(a) // b))
    return (a + (b - 1)) // b


def numel(extents: Sequence[E.Expr]) -> E.Expr:
    return mul_dims(list(extents)) if extents else i32(1)


def unravel(flat: E.Expr, extents: Sequence[E.Expr]) -> list[E.Expr]:
    """Row-major coordinates of `flat` in `extents` (the first needs no modulo)."""
    coords: list[E.Expr] = []
    rest = flat
    for k in range(len(extents) - 1, -1, -1):
        if k == 0:
            coords.append(rest)
        elif static(extents[k]) == 1:
            coords.append(i32(0))
        else:
            coords.append(rest % extents[k])
            rest = rest // extents[k]
    return coords[::-1]


def declare_coords(vars_: Sequence[E.Var], flat: E.Expr, extents: Sequence[E.Expr]) -> list[S.Stmt]:
    """Declare `vars_` as the coordinates of `flat`."""
    return [S.DeclareVar(v, c) for v, c in zip(vars_, unravel(flat, extents))]


def serial_nest(vars_: Sequence[E.Var], extents: Sequence[E.Expr], body: S.Stmt) -> S.Stmt:
    """for v0 in range(e0): for v1 in range(e1): ... body (the last variable innermost)."""
    for v, e in reversed(list(zip(vars_, extents))):
        if static(e) == 1:
            body = S.seq(S.DeclareVar(v, i32(0)), body)
        else:
            body = S.For(v, i32(0), e, i32(1), body)
    return body


def strided(vars_: Sequence[E.Var], extents: Sequence[E.Expr], lane: E.Expr, stride: int, body: S.Stmt,
            name: str) -> S.Stmt:  # fmt: skip
    """Workers `lane` = 0..stride-1 share the domain: each takes every stride-th flat index."""
    if not vars_:
        return S.If(E.Binary("==", lane, i32(0)), body)
    flat = index_var(name)
    loop_body = S.seq(*declare_coords(vars_, flat, extents), body)
    return S.For(flat, lane, numel(extents), i32(stride), loop_body)
