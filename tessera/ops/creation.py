"""Tensors made from indices rather than inputs: full, arange, and the tril/triu masks.

They have no tensor inputs, so they inline into whatever reads them: a causal mask or the
position ids of a transformer cost no memory traffic.
"""

from __future__ import annotations

from collections.abc import Sequence

from tessera.errors import ArgumentError
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.compute import Compute, TensorNode, as_dim, compute, fresh_name
from tessera.ir.dtypes import DataType
from tessera.ops.common import SUPPORTED, check_tensor


def _dtype(dtype: DataType | str, op: str) -> DataType:
    dt = dtypes.dtype(dtype)
    if dt not in SUPPORTED:
        raise ArgumentError(f"{op}: cannot create tensors of dtype {dt}")
    return dt


def _shape(shape: Sequence[int | E.Expr], op: str) -> list[E.Expr]:
    try:
        return [as_dim(d) for d in shape]
    except TypeError as exc:
        raise ArgumentError(f"{op}: {exc}") from None


def full(shape: Sequence[int | E.Expr], value: float | int | bool, dtype: DataType | str = "float32") -> Compute:
    """A tensor of `shape` filled with `value`."""
    dt = _dtype(dtype, "full")
    return compute(_shape(shape, "full"), lambda *i: E.Const(value, dt), fresh_name("full"), dt)


def arange(n: int | E.Expr, dtype: DataType | str = "int64", start: int | float = 0, step: int | float = 1) -> Compute:
    """start, start + step, ... (n values): position ids, rotary frequencies."""
    dt = _dtype(dtype, "arange")
    return compute(_shape([n], "arange"), lambda i: E.Const(start, dt) + E.Cast(i, dt) * E.Const(step, dt),
                   fresh_name("arange"), dt)  # fmt: skip


def _band(x: TensorNode, diagonal: int | E.Expr, lower: bool, op: str) -> Compute:
    check_tensor(x, op)
    if isinstance(diagonal, bool) or not isinstance(diagonal, (int, E.Expr)):
        raise ArgumentError(f"{op}: diagonal must be an int or an int32 size expression, got {diagonal!r}")
    if x.rank < 2:
        raise ArgumentError(f"{op}: needs at least 2 dimensions, got '{x.name}' of rank {x.rank}")

    def fn(*i: E.Var) -> E.Expr:
        r, c = i[-2], i[-1]
        keep = (c - r <= diagonal) if lower else (c - r >= diagonal)
        return E.Select(keep, x[i], E.Const(0, x.dtype))

    return compute(x.shape, fn, fresh_name(op), x.dtype)


def tril(x: TensorNode, diagonal: int | E.Expr = 0) -> Compute:
    """x with the elements above the `diagonal`-th diagonal set to zero (torch.tril)."""
    return _band(x, diagonal, True, "tril")


def triu(x: TensorNode, diagonal: int | E.Expr = 0) -> Compute:
    """x with the elements below the `diagonal`-th diagonal set to zero (torch.triu)."""
    return _band(x, diagonal, False, "triu")


def causal_mask(rows: int | E.Expr, cols: int | E.Expr, dtype: DataType | str = "float32") -> Compute:
    """0 where column <= row + (cols - rows) (visible), -inf above: the additive mask of causal attention."""
    dt = _dtype(dtype, "causal_mask")
    r, c = as_dim(rows), as_dim(cols)
    return compute([r, c], lambda i, j: E.Select(j - i <= c - r, E.Const(0, dt), E.Const(float("-inf"), dt)),
                   fresh_name("causal_mask"), dt)  # fmt: skip
