"""Reductions (sum, mean, max, min, prod over axes, with keepdims), softmax and log_softmax.

Accumulators: float32 for float16/bfloat16/float32 values, float64 for float64, int64 for
integer and bool sums and products (whose results are int64, as in torch).  max/min keep the
input dtype; on bool they are any/all.  Softmax is three stages (row max, sum of exponentials,
normalisation) that the scheduler fuses into one kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

from tessera.errors import UnsupportedError
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.compute import Compute, ReduceCompute, TensorNode, compute, fresh_name, reduce
from tessera.ir.dtypes import DataType
from tessera.ops.common import check_float, check_tensor, compute_type, mul_dims, normalize_axes, normalize_axis


def split_index(rank: int, axes: Sequence[int], kept: Sequence[E.Expr], reduced: Sequence[E.Expr]) -> tuple[E.Expr, ...]:
    """A full index of a rank-`rank` tensor from the kept axes' and the reduced axes' indices."""
    out: list[E.Expr] = []
    k = r = 0
    for d in range(rank):
        if d in axes:
            out.append(reduced[r])
            r += 1
        else:
            out.append(kept[k])
            k += 1
    return tuple(out)


def _types(op: str, t: DataType) -> tuple[DataType, DataType]:
    """(accumulator dtype, result dtype) of reduction `op` over values of type t."""
    if op in ("sum", "prod"):
        if t.is_float:
            return compute_type(t), t
        return dtypes.int64, dtypes.int64
    if op == "mean":
        return compute_type(t), t
    return (dtypes.int32 if t.is_bool else compute_type(t)), t  # max/min; bool shuffles as int32


def reduce_axes(op: str, x: TensorNode, axes: int | Sequence[int] | None = None, keepdims: bool = False,
                dtype: DataType | str | None = None) -> TensorNode:  # fmt: skip
    """Reduce x with `op` over `axes` (None: all); `dtype` overrides the result dtype."""
    check_tensor(x, op)
    if op == "mean" and not x.dtype.is_float:
        raise UnsupportedError(f"mean: needs a floating-point input, got '{x.name}' of dtype {x.dtype}; cast it first")
    ax = normalize_axes(axes, x.rank, op)
    acc, out = _types(op, x.dtype)
    if dtype is not None:
        out = dtypes.dtype(dtype)
        if out.is_float and not acc.is_float:
            acc = compute_type(out)
    kept_shape = [d for k, d in enumerate(x.shape) if k not in ax]
    extents = [x.shape[k] for k in ax]
    red = reduce(kept_shape, extents, lambda kept, r: E.Cast(x[split_index(x.rank, ax, kept, r)], acc), op,
                 fresh_name(op), out, acc)  # fmt: skip
    if not keepdims:
        return red
    shape = [E.Const(1, dtypes.int32) if k in ax else d for k, d in enumerate(x.shape)]
    return compute(shape, lambda *i: red[tuple(v for k, v in enumerate(i) if k not in ax)], fresh_name(op + "_keepdims"))


def sum(x: TensorNode, axes: int | Sequence[int] | None = None, keepdims: bool = False,  # noqa: A001
        dtype: DataType | str | None = None) -> TensorNode:  # fmt: skip
    return reduce_axes("sum", x, axes, keepdims, dtype)


def mean(x: TensorNode, axes: int | Sequence[int] | None = None, keepdims: bool = False) -> TensorNode:
    return reduce_axes("mean", x, axes, keepdims)


def max(x: TensorNode, axes: int | Sequence[int] | None = None, keepdims: bool = False) -> TensorNode:  # noqa: A001
    return reduce_axes("max", x, axes, keepdims)


def min(x: TensorNode, axes: int | Sequence[int] | None = None, keepdims: bool = False) -> TensorNode:  # noqa: A001
    return reduce_axes("min", x, axes, keepdims)


def prod(x: TensorNode, axes: int | Sequence[int] | None = None, keepdims: bool = False) -> TensorNode:
    return reduce_axes("prod", x, axes, keepdims)


def _arg(op: str, x: TensorNode, axis: int, keepdims: bool) -> TensorNode:
    check_tensor(x, op)
    a = normalize_axis(axis, x.rank, op)
    acc = dtypes.int32 if x.dtype.is_bool else compute_type(x.dtype)
    kept = [d for k, d in enumerate(x.shape) if k != a]
    n = x.shape[a]

    def at(i: Sequence[E.Expr], r: E.Expr) -> E.Expr:
        return E.Cast(x[split_index(x.rank, (a,), i, (r,))], acc)

    best = reduce(kept, [n], lambda i, r: at(i, r[0]), "max" if op == "argmax" else "min", fresh_name(op + "_value"),
                  acc, acc)  # fmt: skip
    last = E.Cast(n, dtypes.int64) - E.Const(1, dtypes.int64)

    def first(i: Sequence[E.Expr], r: Sequence[E.Expr]) -> E.Expr:
        v = at(i, r[0])
        # The first index holding the extreme value; max/min propagate NaN, and like numpy the
        # first NaN then wins (v != v).  Non-matching positions give n - 1, the largest index.
        hit = E.Binary("==", v, best[tuple(i)])
        if acc.is_float:
            hit = E.Binary("||", hit, E.Binary("!=", v, v))
        return E.Select(hit, E.Cast(r[0], dtypes.int64), last)

    idx = reduce(kept, [n], first, "min", fresh_name(op), dtypes.int64, dtypes.int64)
    if not keepdims:
        return idx
    shape = [E.Const(1, dtypes.int32) if k == a else d for k, d in enumerate(x.shape)]
    return compute(shape, lambda *i: idx[tuple(v for k, v in enumerate(i) if k != a)], fresh_name(op + "_keepdims"))


def argmax(x: TensorNode, axis: int = -1, keepdims: bool = False) -> TensorNode:
    """Index (int64) of the first maximum along `axis`; a NaN counts as the maximum, as in numpy."""
    return _arg("argmax", x, axis, keepdims)


def argmin(x: TensorNode, axis: int = -1, keepdims: bool = False) -> TensorNode:
    """Index (int64) of the first minimum along `axis`; a NaN counts as the minimum, as in numpy."""
    return _arg("argmin", x, axis, keepdims)


def cumsum(x: TensorNode, axis: int = 0, exclusive: bool = False, reverse: bool = False) -> TensorNode:
    """Running sums along `axis` (int64 for integer and bool inputs, as torch).  `exclusive` leaves
    out each element itself; `reverse` sums from the end.

    Each output element is a masked sum over the whole axis (O(n^2) work): fine for the short
    axes of position ids and masks, not for long scans."""
    check_tensor(x, "cumsum")
    a = normalize_axis(axis, x.rank, "cumsum")
    acc, out = _types("sum", x.dtype)

    def fn(i: Sequence[E.Expr], r: Sequence[E.Expr]) -> E.Expr:
        k, j = i[a], r[0]
        cmp = {(False, False): "<=", (True, False): "<", (False, True): ">=", (True, True): ">"}[(exclusive, reverse)]
        idx = tuple(j if d == a else v for d, v in enumerate(i))
        return E.Select(E.Binary(cmp, j, k), E.Cast(x[idx], acc), E.Const(0, acc))

    return reduce(x.shape, [x.shape[a]], fn, "sum", fresh_name("cumsum"), out, acc, tag="contraction")


def _row_stats(x: TensorNode, axis: int, op: str) -> tuple[ReduceCompute, ReduceCompute, DataType]:
    """The row max and the sum of exp(x - max) along `axis`, in float32 (float64 for float64)."""
    check_tensor(x, op)
    check_float(x, op)
    a = normalize_axis(axis, x.rank, op)
    ct = compute_type(x.dtype)
    kept = [d for k, d in enumerate(x.shape) if k != a]

    def at(i: Sequence[E.Expr], r: E.Expr) -> E.Expr:
        return E.Cast(x[split_index(x.rank, (a,), i, (r,))], ct)

    m = reduce(kept, [x.shape[a]], lambda i, r: at(i, r[0]), "max", fresh_name(op + "_max"), ct, ct)
    s = reduce(kept, [x.shape[a]], lambda i, r: E.Call("exp", (at(i, r[0]) - m[tuple(i)],), ct), "sum",
               fresh_name(op + "_sum"), ct, ct)  # fmt: skip
    return m, s, ct


def softmax(x: TensorNode, axis: int = -1) -> Compute:
    """exp(x - max) / sum(exp(x - max)) along `axis` (one fused kernel)."""
    m, s, ct = _row_stats(x, axis, "softmax")
    a = normalize_axis(axis, x.rank, "softmax")

    def fn(*i: E.Var) -> E.Expr:
        kept = tuple(v for k, v in enumerate(i) if k != a)
        return E.Binary("/", E.Call("exp", (E.Cast(x[i], ct) - m[kept],), ct), s[kept])

    return compute(x.shape, fn, fresh_name("softmax"), x.dtype)


def log_softmax(x: TensorNode, axis: int = -1) -> Compute:
    """x - max - log(sum(exp(x - max))) along `axis` (one fused kernel)."""
    m, s, ct = _row_stats(x, axis, "log_softmax")
    a = normalize_axis(axis, x.rank, "log_softmax")

    def fn(*i: E.Var) -> E.Expr:
        kept = tuple(v for k, v in enumerate(i) if k != a)
        return E.Cast(x[i], ct) - m[kept] - E.Call("log", (s[kept],), ct)

    return compute(x.shape, fn, fresh_name("log_softmax"), x.dtype)


def var(x: TensorNode, axes: int | Sequence[int] | None = None, correction: int = 1, keepdims: bool = False) -> TensorNode:
    """Variance over `axes`, sum((x - mean)^2) / (n - correction) (torch's default correction=1)."""
    check_tensor(x, "var")
    check_float(x, "var")
    ax = normalize_axes(axes, x.rank, "var")
    ct = compute_type(x.dtype)
    kept = [d for k, d in enumerate(x.shape) if k not in ax]
    extents = [x.shape[k] for k in ax]
    mu = reduce(kept, extents, lambda o, r: E.Cast(x[split_index(x.rank, ax, o, r)], ct), "mean", fresh_name("var_mean"), ct, ct)

    def dev(o, r) -> E.Expr:
        d = E.Cast(x[split_index(x.rank, ax, o, r)], ct) - mu[tuple(o)]
        return d * d

    ss = reduce(kept, extents, dev, "sum", fresh_name("var_ss"), ct, ct)
    n = E.Cast(mul_dims(extents), ct)

    def fn(*i: E.Var) -> E.Expr:
        o = tuple(v for k, v in enumerate(i) if k not in ax) if keepdims else i
        return E.Binary("/", ss[o], n - E.Const(correction, ct))

    shape = [E.Const(1, dtypes.int32) if k in ax else d for k, d in enumerate(x.shape)] if keepdims else kept
    return compute(shape, fn, fresh_name("var"), x.dtype)


def std(x: TensorNode, axes: int | Sequence[int] | None = None, correction: int = 1, keepdims: bool = False) -> TensorNode:
    """Standard deviation: sqrt(var)."""
    v = var(x, axes, correction, keepdims)
    return compute(v.shape, lambda *i: E.Call("sqrt", (E.Cast(v[i], compute_type(x.dtype)),), compute_type(x.dtype)),
                   fresh_name("std"), x.dtype)  # fmt: skip


def logsumexp(x: TensorNode, axis: int = -1, keepdims: bool = False) -> TensorNode:
    """log(sum(exp(x))) along `axis`, computed stably as max + log(sum(exp(x - max)))."""
    m, s, ct = _row_stats(x, axis, "logsumexp")
    a = normalize_axis(axis, x.rank, "logsumexp")
    shape = [E.Const(1, dtypes.int32) if k == a else d for k, d in enumerate(x.shape)] if keepdims else m.shape

    def fn(*i: E.Var) -> E.Expr:
        o = tuple(v for k, v in enumerate(i) if k != a) if keepdims else i
        return m[o] + E.Call("log", (s[o],), ct)

    return compute(shape, fn, fresh_name("logsumexp"), x.dtype)
