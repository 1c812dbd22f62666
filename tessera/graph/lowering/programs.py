"""Lowering rules for the operators written as statements (tessera.ops.programs: scatters, topk,
det) and for N-d max pooling with indices (two fused reductions: the window's maximum, then
the first position holding it)."""

from __future__ import annotations

import math

from tessera import ops
from tessera.graph.lowering.core import Ctx, cast
from tessera.graph.operator import Operator
from tessera.graph.symbolic import contains_sym
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.compute import TensorNode, compute, fresh_name, reduce
from tessera.ops.common import compute_type
from tessera.ops.programs import MAX_DET_SIZE

I64 = dtypes.int64


def _indices(node: TensorNode) -> TensorNode:
    return node if node.dtype in (dtypes.int32, I64) else cast(node, I64)


def scatter_elements(ctx: Ctx) -> list[TensorNode]:
    data, idx, upd = ctx.x(0), _indices(ctx.x(1)), ctx.x(2)
    return ctx.finish([ops.scatter_elements(data, idx, upd, ctx.attrs["axis"], ctx.attrs["reduction"])])


def scatter_nd(ctx: Ctx) -> list[TensorNode]:
    data, idx, upd = ctx.x(0), _indices(ctx.x(1)), ctx.x(2)
    return ctx.finish([ops.scatter_nd(data, idx, upd, ctx.attrs["reduction"])])


def index_copy(ctx: Ctx) -> list[TensorNode]:
    data, idx, src = ctx.x(0), _indices(ctx.x(1)), ctx.x(2)
    return ctx.finish([ops.index_copy(data, idx, src, ctx.attrs["axis"], bool(ctx.attrs["in_place"]))])


def check_scatter(op: Operator) -> str | None:
    data, idx, upd = op.inputs
    if upd.dtype != data.dtype:
        return f"{op.kind} with updates of {upd.dtype} into {data.dtype} is not lowered"
    if data.dtype.is_bool and op.attrs.get("reduction", "none") != "none":
        return f"{op.kind} reduction {op.attrs['reduction']!r} of bool tensors is not lowered"
    if op.kind == "scatter_nd" and (idx.ndim == 0 or not isinstance(idx.shape[-1], int)):
        return "scatter_nd with a symbolic index tuple length is not lowered"
    return None


def topk(ctx: Ctx) -> list[TensorNode]:
    a = ctx.attrs
    values, indices = ops.topk(ctx.x(), int(a["k"]), a["axis"], bool(a["largest"]))
    return ctx.finish([values, indices])


def check_topk(op: Operator) -> str | None:
    if contains_sym(op.attrs.get("k")):
        return "topk with a symbolic k is not lowered"
    return None


def det(ctx: Ctx) -> list[TensorNode]:
    return ctx.finish([ops.det(ctx.x())])


def check_det(op: Operator) -> str | None:
    x = op.inputs[0]
    n = x.shape[-1]
    if not x.dtype.is_float:
        return f"det of {x.dtype} is not lowered"
    if not isinstance(n, int) or n != x.shape[-2]:
        return "det of matrices with a symbolic size is not lowered"
    if n > MAX_DET_SIZE:
        return f"det of {n}x{n} matrices is not lowered (at most {MAX_DET_SIZE}x{MAX_DET_SIZE}: one LU per thread)"
    return None


def max_pool_with_indices(ctx: Ctx) -> list[TensorNode]:
    """Values and ONNX's flat indices: over [N, C, spatial...], the position of each window's
    maximum (NaN never wins; the first of equal maxima in row-major order), flattened over the
    whole input -- row-major, or column-major over the spatial axes with storage_order 1."""
    x = ctx.x()
    a = ctx.attrs
    k, s, d, p = a["kernel"], a["stride"], a["dilation"], a["pads"]
    n = len(k)
    spatial = [int(v) for v in ctx.op.inputs[0].shape[2:]]
    out_shape = ctx.out_shape(0)
    ct = compute_type(x.dtype)
    fill = E.Const(-math.inf, ct) if ct.is_float else E.Const(ct.min_value, ct)

    def cell(i, r):
        pos = [i[2 + t] * s[t] + (r[t] * d[t] - p[t]) for t in range(n)]
        valid: E.Expr | None = None
        for t in range(n):
            for c in (E.Binary(">=", pos[t], E.Const(0, dtypes.int32)), E.Binary("<", pos[t], E.Const(spatial[t], dtypes.int32))):
                valid = c if valid is None else E.Binary("&&", valid, c)
        return valid, pos

    def key(i, r):
        valid, pos = cell(i, r)
        v = E.Cast(x[(i[0], i[1], *pos)], ct)
        if ct.is_float:
            v = E.Select(E.Binary("!=", v, v), fill, v)
        return E.Select(valid, v, fill)

    best = reduce(out_shape, k, key, "max", fresh_name("pool_max"), ct, ct)
    rm_strides = [math.prod(spatial[t + 1:]) for t in range(n)]
    big = E.Const(math.prod(spatial), I64)

    def first(i, r):
        valid, pos = cell(i, r)
        flat = sum((E.Cast(pos[t], I64) * E.Const(rm_strides[t], I64) for t in range(n - 1)), E.Cast(pos[-1], I64))
        return E.Select(E.Binary("&&", valid, E.Binary("==", key(i, r), best[i])), flat, big)

    where = reduce(out_shape, k, first, "min", fresh_name("pool_argmax"), I64, I64)
    plane = E.Const(math.prod(spatial), I64)
    cm_strides = [math.prod(spatial[:t]) for t in range(n)]

    def index(*i):
        at = where[i]
        base = (E.Cast(i[0], I64) * E.Cast(x.shape[1], I64) + E.Cast(i[1], I64)) * plane
        if not a["storage_order"]:
            return base + at
        coords = [(at // E.Const(rm_strides[t], I64)) % E.Const(spatial[t], I64) for t in range(n)]
        return base + sum((c * E.Const(cm_strides[t], I64) for t, c in enumerate(coords[1:], 1)), coords[0])

    values = compute(out_shape, lambda *i: best[i], fresh_name("pool_values"), x.dtype)
    return ctx.finish([values, compute(out_shape, index, fresh_name("pool_indices"), I64)])


def check_max_pool_with_indices(op: Operator) -> str | None:
    x = op.inputs[0]
    if not all(isinstance(v, int) for v in x.shape[2:]):
        return "max pooling with indices over symbolic spatial sizes is not lowered"
    if x.dtype.is_bool:
        return "max pooling of bool tensors is not lowered"
    return None
