"""Lowering rules for the injective and source operators: reshapes, permutes, slices, concat,
split, expand, squeeze/unsqueeze, tile, flip, pad, tril/triu, gathers, full and arange.

Attribute entries may be symbolic sizes (a reshape to [batch, seq, 4, 12], a slice ending at
seq); they become expressions over the sizes the inputs bind (see core.Ctx.attr_dim).
"""

from __future__ import annotations

import math
from typing import Any

from tessera import ops
from tessera.graph.lowering.core import Ctx, LoweringError, cast, copy, i32, python_value, view
from tessera.graph.lowering.elementwise import full_like_value
from tessera.graph.opdefs._common import norm_axes, norm_axis
from tessera.graph.opdefs.shape import slice_window
from tessera.graph.operator import Operator
from tessera.graph.symbolic import Sym, contains_sym
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.compute import TensorNode, compute, fresh_name
from tessera.ops.common import mul_dims, numel_equal, static
from tessera.ops.transform import add_dims


def narrow(x: TensorNode, axis: int, first: E.Expr, length: E.Expr, step: int = 1) -> TensorNode:
    """x[..., first : first + length * step : step, ...] along axis, bounds already in range."""
    shape = list(x.shape)
    shape[axis] = length

    def fn(*i: E.Var) -> E.Expr:
        idx = list(i)
        pos = i[axis] * step if step != 1 else i[axis]
        idx[axis] = pos if static(first) == 0 else first + pos
        return x[tuple(idx)]

    return compute(shape, fn, fresh_name("slice"), x.dtype, tag="slice")


# ---- reshapes and axes ------------------------------------------------------------------------------------------
def reshape(ctx: Ctx) -> list[TensorNode]:
    x = ctx.x()
    # The graph's output shape (its -1 inferred by the graph's rule), not the attribute: the same
    # sizes, and the run-time shape check confirms that the element counts agree.
    try:
        target: list[Any] = [ctx.attr_dim(d) for d in ctx.op.outputs[0].shape]
    except LoweringError:  # a size no input binds (data-dependent): infer it from the attribute's -1
        target = [-1 if isinstance(d, int) and d == -1 else ctx.attr_dim(d) for d in ctx.attrs["shape"]]
    if -1 not in target and not numel_equal(target, x.shape):
        # The sizes agree at run time but not as expressions (concrete input shapes against a
        # symbolic target): let the one symbolic entry be inferred from the element count.
        symbolic = [k for k, d in enumerate(target) if static(d) is None]
        if len(symbolic) == 1:
            target[symbolic[0]] = -1
    return ctx.finish([ops.reshape(x, target, counts_checked=True)])


def split_heads(ctx: Ctx) -> list[TensorNode]:
    x = ctx.x()
    h, d, off = (int(ctx.attrs[k]) for k in ("heads", "head_dim", "offset"))

    def fn(b: E.Var, head: E.Var, s: E.Var, col: E.Var) -> E.Expr:
        return x[b, s, i32(off) + head * i32(d) + col]

    return ctx.finish([compute([x.shape[0], i32(h), x.shape[1], i32(d)], fn, fresh_name("split_heads"), x.dtype)])


def merge_heads(ctx: Ctx) -> list[TensorNode]:
    x = ctx.x()
    d = x.shape[3]

    def fn(b: E.Var, s: E.Var, col: E.Var) -> E.Expr:
        return x[b, col // d, s, col % d]

    return ctx.finish([compute([x.shape[0], x.shape[2], mul_dims([x.shape[1], d])], fn, fresh_name("merge_heads"), x.dtype)])


def flatten(ctx: Ctx) -> list[TensorNode]:
    x = ctx.x()
    if x.rank == 0:
        return ctx.finish([ops.reshape(x, [1])])
    return ctx.finish([ops.flatten(x, ctx.attrs["start"], ctx.attrs["end"])])


def permute(ctx: Ctx) -> list[TensorNode]:
    return ctx.finish([ops.permute(ctx.x(), list(ctx.attrs["perm"]))])


def squeeze(ctx: Ctx) -> list[TensorNode]:
    t = ctx.op.inputs[0]
    axes = ctx.attrs["axes"]
    candidates = range(t.ndim) if axes is None else norm_axes(axes, t.ndim)
    drop = [k for k in candidates if t.shape[k] == 1]  # like torch, axes of other sizes stay
    return ctx.finish([ops.squeeze(ctx.x(), drop) if drop else copy(ctx.x())])


def unsqueeze(ctx: Ctx) -> list[TensorNode]:
    x = ctx.x()
    for a in norm_axes(ctx.attrs["axes"], x.rank + len(ctx.attrs["axes"])):
        x = ops.unsqueeze(x, a)
    return ctx.finish([x])


def expand(ctx: Ctx) -> list[TensorNode]:
    x = ctx.x()
    shape = list(ctx.attrs["shape"])
    off = len(shape) - x.rank
    target = [x.shape[k - off] if isinstance(d, int) and d == -1 and k >= off else ctx.attr_dim(d)
              for k, d in enumerate(shape)]  # fmt: skip
    out = ctx.out_shape(0, target)
    (x,) = ctx.broadcast([x], out)
    return ctx.finish([ops.expand(x, out)])


def tile(ctx: Ctx) -> list[TensorNode]:
    return ctx.finish([ops.tile(ctx.x(), [int(r) for r in ctx.attrs["repeats"]])])


def flip(ctx: Ctx) -> list[TensorNode]:
    x = ctx.x()
    return ctx.finish([ops.flip(x, [norm_axis(a, x.rank) for a in ctx.attrs["axes"]])])


def tri(ctx: Ctx) -> list[TensorNode]:
    fn = ops.tril if ctx.kind == "tril" else ops.triu
    d = ctx.attrs["diagonal"]
    return ctx.finish([fn(ctx.x(), ctx.attr_dim(d) if isinstance(d, Sym) else int(d))])


def check_static_attrs(*names: str):
    """A check that rejects symbolic values in the named attributes."""

    def check(op: Operator) -> str | None:
        attrs = op.opdef.normalize_attrs(op.attrs)
        bad = [n for n in names if contains_sym(attrs[n])]
        return f"{op.kind} with symbolic {', '.join(bad)} is not lowered" if bad else None

    return check


# ---- slicing and joining -----------------------------------------------------------------------------------------
def slice_op(ctx: Ctx) -> list[TensorNode]:
    x = ctx.x()
    a = ctx.attrs
    steps = a["steps"] or [1] * len(a["axes"])
    for axis, start, end, step in zip(a["axes"], a["starts"], a["ends"], steps):
        ax, step = norm_axis(axis, x.rank), int(step)
        n = x.shape[ax]
        if static(n) is not None and not contains_sym([start, end]):
            first, last, st = slice(int(start), int(end), step).indices(static(n))
            length = len(range(first, last, st))
            if length == 0:
                raise LoweringError("slice: empty results are not supported by tessera.ops")
            x = narrow(x, ax, i32(first), i32(length), st)
            continue
        if step < 0:
            raise LoweringError("slice with a negative step over a symbolic size is not lowered")
        first, length = slice_window(ctx.op.inputs[0].shape[ax], start, end, step)  # the graph's own rule
        x = narrow(x, ax, ctx.attr_dim(first), ctx.attr_dim(length), step)
    return ctx.finish([x])


def check_slice(op: Operator) -> str | None:
    a = op.opdef.normalize_attrs(op.attrs)
    x = op.inputs[0]
    steps = a["steps"] or [1] * len(a["axes"])
    for axis, start, end, step in zip(a["axes"], a["starts"], a["ends"], steps):
        if isinstance(step, Sym):
            return "slice with a symbolic step is not lowered"
        static_axis = isinstance(x.shape[axis % max(x.ndim, 1)], int)
        if step < 0 and not (static_axis and not contains_sym([start, end])):
            return "slice with a negative step over a symbolic size or bound is not lowered"
    return None


def concat(ctx: Ctx) -> list[TensorNode]:
    dt = ctx.out_dtype
    xs = [cast(x, dt) for x in ctx.inputs]
    ax = norm_axis(ctx.attrs["axis"], xs[0].rank)
    if len(xs) == 1:
        return ctx.finish([copy(xs[0])])
    out = ctx.out_shape(0, list(xs[0].shape))
    xs = [view(x, [x.shape[k] if k == ax else out[k] for k in range(x.rank)]) for x in xs]
    return ctx.finish([ops.concat(xs, ax)])


def split(ctx: Ctx) -> list[TensorNode]:
    x = ctx.x()
    ax = norm_axis(ctx.attrs["axis"], x.rank)
    pieces, offset = [], i32(0)
    for s in ctx.attrs["sizes"]:
        size = ctx.attr_dim(s)
        pieces.append(narrow(x, ax, offset, size))
        offset = add_dims([offset, size])
    return ctx.finish(pieces)


def pad(ctx: Ctx) -> list[TensorNode]:
    x = ctx.x()
    p = [int(v) for v in ctx.attrs["pads"]]
    for k in range(x.rank):  # negative pads crop first
        before, after = min(p[2 * k], 0), min(p[2 * k + 1], 0)
        if before or after:
            length = add_dims([x.shape[k], i32(before + after)])
            x = narrow(x, k, i32(-before), length)
    widths = [(max(p[2 * k], 0), max(p[2 * k + 1], 0)) for k in range(x.rank)]
    if any(b or a for b, a in widths):
        x = ops.pad(x, widths, value=python_value(ctx.attrs["value"], x.dtype))
    return ctx.finish([x])


# ---- gathers -------------------------------------------------------------------------------------------------------
def _index(node: TensorNode) -> TensorNode:
    return node if node.dtype in (dtypes.int32, dtypes.int64) else cast(node, dtypes.int64)


def take(ctx: Ctx) -> list[TensorNode]:
    x = ctx.x(0)
    return ctx.finish([ops.take(x, _index(ctx.x(1)), norm_axis(ctx.attrs["axis"], x.rank))])


def gather_elements(ctx: Ctx) -> list[TensorNode]:
    x = ctx.x(0)
    return ctx.finish([ops.gather(x, norm_axis(ctx.attrs["axis"], x.rank), _index(ctx.x(1)))])


# ---- sources -------------------------------------------------------------------------------------------------------
def full(ctx: Ctx) -> list[TensorNode]:
    dt = ctx.out_dtype
    shape = [ctx.attr_dim(d) for d in ctx.attrs["shape"]]
    value = ctx.attrs["value"]
    if isinstance(value, Sym):
        e = full_like_value(value, dt, ctx)
        return ctx.finish([compute(shape, lambda *i: e, fresh_name("full"), dt)])
    return ctx.finish([ops.full(shape, python_value(value, dt), dt)])


def arange(ctx: Ctx) -> list[TensorNode]:
    dt = ctx.out_dtype
    start, end, step = ctx.attrs["start"], ctx.attrs["end"], ctx.attrs["step"]
    if not contains_sym([start, end]):
        count = max(0, math.ceil((end - start) / step))
        if count == 0:
            raise LoweringError("arange: empty results are not supported by tessera.ops")
        n: E.Expr = i32(count)
    else:
        if not all(isinstance(v, (int, Sym)) for v in (start, end, step)):
            raise LoweringError("arange over symbolic bounds needs integer start and step")
        s, e = ctx.attr_dim(start) if isinstance(start, Sym) else i32(start), ctx.attr_dim(end) if isinstance(end, Sym) else i32(end)
        span = (e if static(s) == 0 else e - s) if step > 0 else s - e
        n = span if abs(step) == 1 else (span + (abs(step) - 1)) // abs(step)
    first = ctx.attr_dim(start) if isinstance(start, Sym) else start
    first_e = E.Cast(first, dt) if isinstance(first, E.Expr) else E.Const(python_value(first, dt) if not dt.is_float else first, dt)
    out = compute([n], lambda i: first_e + E.Cast(i, dt) * E.Const(step, dt), fresh_name("arange"), dt)
    return ctx.finish([out])


def check_arange(op: Operator) -> str | None:
    a = op.opdef.normalize_attrs(op.attrs)
    if isinstance(a["step"], Sym):
        return "arange with a symbolic step is not lowered"
    if contains_sym([a["start"], a["end"]]) and not all(isinstance(v, (int, Sym)) for v in (a["start"], a["end"], a["step"])):
        return "arange over symbolic bounds needs integer start and step"
    return None
