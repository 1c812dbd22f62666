"""Lowering rules for the anchor operators (matmul, linear, conv2d, scaled-dot-product attention)
and pooling.

These produce ops' plain contraction definitions; on the GPU the graph compiler hands anchors
to tuned templates instead, and uses these definitions for the CPU, for checking and for
anchors that no template covers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tessera import ops
from tessera.graph.lowering.core import Ctx, LoweringError, cast, i32, view
from tessera.graph.opdefs._common import pads, pair
from tessera.graph.operator import Operator
from tessera.ir import expr as E
from tessera.ir.compute import TensorNode, compute, fresh_name
from tessera.ops.common import compute_type, same_dim, static


def _batch_view(x: TensorNode, batch: Sequence[E.Expr], tail: int) -> TensorNode:
    """x with its leading (batch) dims, all but the last `tail`, conformed to `batch` (right-aligned)."""
    dims = list(x.shape[: x.rank - tail])
    off = len(batch) - len(dims)
    new = [d if static(d) == 1 and static(batch[j + off]) != 1 else batch[j + off] for j, d in enumerate(dims)]
    return view(x, [*new, *x.shape[x.rank - tail :]])


def _broadcast_fallback(shapes: Sequence[Sequence[E.Expr]], rank: int) -> list[E.Expr]:
    out = []
    for j in range(rank):
        pick: E.Expr = i32(1)
        for s in shapes:
            jj = j - (rank - len(s))
            if jj >= 0 and static(s[jj]) != 1:
                pick = s[jj]
                break
        out.append(pick)
    return out


# ---- matmul / linear ----------------------------------------------------------------------------------------------
def matmul(ctx: Ctx) -> list[TensorNode]:
    a, b = ctx.x(0), ctx.x(1)
    k = a.shape[-1]
    b = view(b, [k]) if b.rank == 1 else view(b, [*b.shape[:-2], k, b.shape[-1]])
    a_batch, b_batch = list(a.shape[:-2]), list(b.shape[:-2])
    nb = max(len(a_batch), len(b_batch))
    rows = [a.shape[-2]] if a.rank > 1 else []
    cols = [b.shape[-1]] if b.rank > 1 else []
    out = ctx.out_shape(0, _broadcast_fallback([a_batch, b_batch], nb) + rows + cols)
    batch = out[:nb]
    if a.rank > 1:
        a = _batch_view(a, batch, 2)
    if b.rank > 1:
        b = _batch_view(b, batch, 2)
    return ctx.finish([ops.matmul(a, b)])


def check_matmul(op: Operator) -> str | None:
    if op.outputs[0].dtype.is_bool:
        return f"{op.kind} of bool tensors is not lowered"
    return None


def linear(ctx: Ctx) -> list[TensorNode]:
    x, w = ctx.x(0), ctx.x(1)
    w = view(w, [w.shape[0], x.shape[-1]])
    b = view(ctx.x(2), [w.shape[0]]) if len(ctx.inputs) == 3 else None
    return ctx.finish([ops.linear(x, w, b)])


# ---- conv2d and pooling ---------------------------------------------------------------------------------------------
def conv2d(ctx: Ctx) -> list[TensorNode]:
    x, w = ctx.x(0), ctx.x(1)
    a = ctx.attrs
    nhwc = a.get("layout", "NCHW") == "NHWC"
    if nhwc:  # the NCHW computation over permuted views: the permutes inline into its loads and store
        x, w = ops.permute(x, (0, 3, 1, 2)), ops.permute(w, (0, 3, 1, 2))
    pt, pl, pb, pr = pads(a["padding"])
    padding = (pt, pl)
    if (pt, pl) != (pb, pr):  # ops pads symmetrically: pad explicitly (the pad inlines into the conv)
        x = ops.pad(x, [(0, 0), (0, 0), (pt, pb), (pl, pr)])
        padding = (0, 0)
    b = view(ctx.x(2), [w.shape[0]]) if len(ctx.inputs) == 3 else None
    y = ops.conv2d(x, w, b, stride=pair(a["stride"], "stride"), padding=padding, dilation=pair(a["dilation"], "dilation"),
                   groups=int(a["groups"]))  # fmt: skip
    return ctx.finish([ops.permute(y, (0, 2, 3, 1)) if nhwc else y])


def check_conv2d(op: Operator) -> str | None:
    x, w = op.inputs[0], op.inputs[1]
    channel_axis = 3 if op.attrs.get("layout", "NCHW") == "NHWC" else 1
    if not isinstance(x.shape[channel_axis], int) or not all(isinstance(d, int) for d in w.shape):
        return "conv2d with symbolic channel or kernel sizes is not lowered"
    if not op.outputs[0].dtype.is_float:
        return "conv2d of integer tensors is not lowered"
    if min(pads(op.opdef.normalize_attrs(op.attrs)["padding"])) < 0:
        return "conv2d with negative padding is not lowered"
    return None


def _pool_args(ctx: Ctx) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    a = ctx.attrs
    kernel = pair(a["kernel"], "kernel")
    stride = pair(a["stride"] or a["kernel"], "stride")
    pt, pl, _, _ = pads(a["padding"])
    return kernel, stride, (pt, pl)


def max_pool2d(ctx: Ctx) -> list[TensorNode]:
    kernel, stride, padding = _pool_args(ctx)
    a = ctx.attrs
    return ctx.finish([ops.max_pool2d(ctx.x(), kernel, stride, padding, bool(a["ceil_mode"]), a["layout"])])


def avg_pool2d(ctx: Ctx) -> list[TensorNode]:
    kernel, stride, padding = _pool_args(ctx)
    a = ctx.attrs
    return ctx.finish([ops.avg_pool2d(ctx.x(), kernel, stride, padding, bool(a["ceil_mode"]), bool(a["count_include_pad"]),
                                      a["layout"])])  # fmt: skip


def check_pool(op: Operator) -> str | None:
    a = op.opdef.normalize_attrs(op.attrs)
    x = op.inputs[0]
    if not x.dtype.is_float:
        return f"{op.kind} of {x.dtype} is not lowered"
    pt, pl, pb, pr = pads(a["padding"])
    if (pt, pl) != (pb, pr):
        return f"{op.kind} with asymmetric padding {[pt, pl, pb, pr]} is not lowered"
    kh, kw = pair(a["kernel"], "kernel")
    if 2 * pt > kh or 2 * pl > kw or pt < 0 or pl < 0:
        return f"{op.kind} padding {[pt, pl]} must be between 0 and half the kernel {[kh, kw]}"
    if pair(a.get("dilation", 1), "dilation") != (1, 1):
        return f"{op.kind} with dilation {a['dilation']} is not lowered"
    return None


def adaptive_avg_pool2d(ctx: Ctx) -> list[TensorNode]:
    x = ctx.x()
    size = pair(ctx.attrs["output_size"], "output_size")
    layout = ctx.attrs["layout"]
    spatial = (1, 2) if layout == "NHWC" else (2, 3)
    if all(static(x.shape[d]) is not None for d in spatial):
        return ctx.finish([ops.adaptive_avg_pool2d(x, size, layout)])
    if size == (1, 1):  # the global average pool: a mean over any (symbolic) image size
        return ctx.finish([ops.mean(x, spatial, keepdims=True)])
    raise LoweringError(f"adaptive_avg_pool2d to {size} over symbolic spatial sizes is not lowered")


def check_adaptive(op: Operator) -> str | None:
    x = op.inputs[0]
    if not x.dtype.is_float:
        return f"adaptive_avg_pool2d of {x.dtype} is not lowered"
    a = op.opdef.normalize_attrs(op.attrs)
    size = pair(a["output_size"], "output_size")
    spatial = x.shape[1:3] if a["layout"] == "NHWC" else x.shape[2:]
    if size != (1, 1) and not all(isinstance(d, int) for d in spatial):
        return f"adaptive_avg_pool2d to {list(size)} over symbolic spatial sizes is not lowered"
    return None


# ---- attention ---------------------------------------------------------------------------------------------------
def _repeat_heads(x: TensorNode, heads: E.Expr, rep: int) -> TensorNode:
    """Grouped key/value heads: query head h reads x's head h // rep."""
    shape = [*x.shape[:-3], heads, x.shape[-2], x.shape[-1]]
    return compute(shape, lambda *i: x[(*i[:-3], i[-3] // rep, i[-2], i[-1])], fresh_name("repeat_kv"), x.dtype)


def attention(ctx: Ctx) -> list[TensorNode]:
    """softmax(q k^T * scale (+ mask), causal top-left) v, in float32 for 16-bit inputs like the reference."""
    q, k, v = ctx.inputs[:3]
    ct = compute_type(q.dtype)
    q, k, v = cast(q, ct), cast(k, ct), cast(v, ct)
    k = view(k, [*k.shape[:-1], q.shape[-1]])
    v = view(v, [*v.shape[:-2], k.shape[-2], v.shape[-1]])
    if q.rank >= 3 and not same_dim(q.shape[-3], k.shape[-3]):
        hq, hk = static(q.shape[-3]), static(k.shape[-3])
        if hq is None or hk is None or hq % hk:
            raise LoweringError(f"attention with {q.shape[-3]} query heads over {k.shape[-3]} key/value heads")
        k, v = _repeat_heads(k, q.shape[-3], hq // hk), _repeat_heads(v, q.shape[-3], hq // hk)
    out = ctx.out_shape(0, [*q.shape[:-1], v.shape[-1]])
    batch = out[:-2]
    q, k, v = (_batch_view(t, batch, 2) for t in (q, k, v))
    scores = ops.matmul(q, ops.transpose(k))
    scale = ctx.attrs["scale"]
    if scale is None:
        d = static(q.shape[-1])
        if d is None:
            raise LoweringError("attention over a symbolic head size needs an explicit scale")
        scale = 1 / math.sqrt(d)
    scores = ops.mul(scores, float(scale))
    if ctx.attrs["causal"]:
        s = scores
        neg = E.Const(float("-inf"), ct)
        scores = compute(s.shape, lambda *i: E.Select(i[-1] <= i[-2], s[i], neg), fresh_name("causal"), ct)
    if len(ctx.inputs) == 4:
        (mask,) = ctx.broadcast([ctx.x(3)], scores.shape)
        scores = ops.where(mask, scores, float("-inf")) if mask.dtype.is_bool else ops.add(scores, cast(mask, ct))
    return ctx.finish([ops.matmul(ops.softmax(scores, -1), v)])


def check_attention(op: Operator) -> str | None:
    q = op.inputs[0]
    if not all(t.dtype.is_float for t in op.inputs[:3]):
        return "attention of non-float tensors is not lowered"
    a = op.opdef.normalize_attrs(op.attrs)
    if a["scale"] is None and not isinstance(q.shape[-1], int):
        return "attention over a symbolic head size without an explicit scale is not lowered"
    if not isinstance(a["scale"], (int, float, type(None))):
        return "attention with a symbolic scale is not lowered"
    return None

