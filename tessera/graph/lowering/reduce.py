"""Lowering rules for reductions and the operators built around one: reduce_* over axes,
argmax/argmin, cumsum, softmax/log_softmax and the normalizations (layer, RMS, batch).

Statistics are computed in float32 for float16/bfloat16 inputs (ops' accumulators), which is
what the references do (they upcast before reducing).
"""

from __future__ import annotations

from tessera import ops
from tessera.graph.lowering.core import Ctx, cast, copy, view
from tessera.graph.opdefs._common import norm_axes, norm_axis
from tessera.graph.operator import Operator
from tessera.ir.compute import TensorNode

_REDUCE = {"reduce_sum": "sum", "reduce_mean": "mean", "reduce_max": "max", "reduce_min": "min", "reduce_prod": "prod"}


def reduce_axes(ctx: Ctx) -> list[TensorNode]:
    x = ctx.x()
    axes = norm_axes(ctx.attrs["axes"], x.rank)
    op = _REDUCE[ctx.kind]
    if not axes:  # numpy reduces over no axis: the values themselves
        return ctx.finish([copy(cast(x, ctx.out_dtype))])
    if (op == "mean" and not x.dtype.is_float) or (op == "prod" and x.dtype.is_bool):
        x = cast(x, ctx.out_dtype)  # the result dtype (float32, int64) is the accumulator
    return ctx.finish([ops.reduce_axes(op, x, axes, ctx.attrs["keepdim"])])


def arg_reduce(ctx: Ctx) -> list[TensorNode]:
    fn = ops.argmax if ctx.kind == "argmax" else ops.argmin
    return ctx.finish([fn(ctx.x(), norm_axis(ctx.attrs["axis"], ctx.x().rank), ctx.attrs["keepdim"])])


def cumsum(ctx: Ctx) -> list[TensorNode]:
    a = ctx.attrs
    return ctx.finish([ops.cumsum(ctx.x(), a["axis"], bool(a["exclusive"]), bool(a["reverse"]))])


def softmax(ctx: Ctx) -> list[TensorNode]:
    fn = ops.softmax if ctx.kind == "softmax" else ops.log_softmax
    return ctx.finish([fn(ctx.x(), norm_axis(ctx.attrs["axis"], ctx.x().rank))])


def _params(ctx: Ctx, shape: list) -> list[TensorNode | None]:
    """The optional parameter inputs (1..), conformed to `shape`."""
    return [view(p, shape) for p in ctx.inputs[1:]]


def layer_norm(ctx: Ctx) -> list[TensorNode]:
    x, k = ctx.x(), ctx.attrs["num_axes"]
    inner = list(x.shape[x.rank - k :])
    params = _params(ctx, inner) + [None, None]
    return ctx.finish([ops.layer_norm(x, params[0], params[1], float(ctx.attrs["eps"]), normalized_shape=inner)])


def rms_norm(ctx: Ctx) -> list[TensorNode]:
    x, k = ctx.x(), ctx.attrs["num_axes"]
    params = _params(ctx, list(x.shape[x.rank - k :])) + [None]
    return ctx.finish([ops.rms_norm(x, params[0], float(ctx.attrs["eps"]), ndim=k)])


def batch_norm(ctx: Ctx) -> list[TensorNode]:
    x = ctx.x()
    mean, var, weight, bias = _params(ctx, [x.shape[1]])
    return ctx.finish([ops.batch_norm(x, mean, var, weight, bias, float(ctx.attrs["eps"]), axis=1)])


def check_float_input(op: Operator) -> str | None:
    if not op.inputs[0].dtype.is_float:
        return f"{op.kind} of {op.inputs[0].dtype} is not lowered"
    return None


def check_cumsum(op: Operator) -> str | None:
    if op.outputs[0].dtype.is_bool:
        return "cumsum to bool is not lowered"
    return None

