"""Reductions over axes (with keepdim), argmax/argmin and cumulative sums."""

from __future__ import annotations

import numpy as np

from tessera.graph.opdefs._common import norm_axes, norm_axis, upcast
from tessera.graph.registry import register
from tessera.graph.symbolic import ShapeError
from tessera.ir import dtypes


def _reduce_shape(shape, axes, keepdim):
    axes = norm_axes(axes, len(shape))
    if keepdim:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _reduce_infer(kind):
    def infer(xs, a):
        dt = xs[0].dtype
        if kind in ("sum", "prod") and (dt.is_bool or (dt.is_integer and dt.nbits < 64)):
            dt = dtypes.int64  # like torch: integer sums accumulate in int64
        if kind == "mean" and not dt.is_float:
            dt = dtypes.float32
        return [(_reduce_shape(xs[0].shape, a["axes"], a["keepdim"]), dt)]

    return infer


_FNS = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}


def _reduce_ref(fn):
    def ref(xs, a):
        axes = norm_axes(a["axes"], xs[0].ndim)
        return [fn(upcast(xs[0]), axis=axes, keepdims=a["keepdim"])]

    return ref


for _k, _f in _FNS.items():
    register(f"reduce_{_k}", infer=_reduce_infer(_k), reference=_reduce_ref(_f), category="reduce",
             attrs={"axes": None, "keepdim": False}, doc="axes None reduces everything")  # fmt: skip


def _arg_infer(xs, a):
    norm_axis(a["axis"], xs[0].ndim)
    return [(_reduce_shape(xs[0].shape, [a["axis"]], a["keepdim"]), dtypes.int64)]


def _arg_ref(fn):
    return lambda xs, a: [np.expand_dims(fn(xs[0], axis=a["axis"]), a["axis"]) if a["keepdim"]
                          else fn(xs[0], axis=a["axis"])]  # fmt: skip


register("argmax", infer=_arg_infer, reference=_arg_ref(np.argmax), category="reduce",
         attrs={"axis": -1, "keepdim": False}, doc="first index of the maximum")  # fmt: skip
register("argmin", infer=_arg_infer, reference=_arg_ref(np.argmin), category="reduce",
         attrs={"axis": -1, "keepdim": False})  # fmt: skip


def _cumsum_infer(xs, a):
    norm_axis(a["axis"], xs[0].ndim)
    dt = xs[0].dtype
    return [(xs[0].shape, dtypes.int64 if dt.is_bool or (dt.is_integer and dt.nbits < 64) else dt)]


def _cumsum_ref(xs, a):
    x, axis = upcast(xs[0]), a["axis"]
    if a["reverse"]:
        x = np.flip(x, axis)
    if a["exclusive"]:
        # Sums of the elements before each one: a shifted inclusive sum (not cumsum - x, which
        # cancels badly and turns a NaN or inf into NaN where the sum of nothing is 0).
        first = np.zeros_like(np.take(x, [0], axis=axis))
        x = np.concatenate([first, np.delete(x, -1, axis=axis)], axis=axis)
    y = np.cumsum(x, axis=axis)
    return [np.flip(y, axis) if a["reverse"] else y]


register("cumsum", infer=_cumsum_infer, reference=_cumsum_ref, category="reduce",
         attrs={"axis": 0, "exclusive": False, "reverse": False})  # fmt: skip


def _cumprod_ref(xs, a):
    x, ax = upcast(xs[0]), a["axis"]
    if a["reverse"]:
        x = np.flip(x, ax)
    if a["exclusive"]:  # shift by one: the first product is 1
        ones = np.ones_like(np.take(x, [0], axis=ax))
        x = np.concatenate([ones, np.take(x, range(x.shape[ax] - 1), axis=ax)], axis=ax)
    y = np.cumprod(x, axis=ax)
    return [np.flip(y, ax) if a["reverse"] else y]


register("cumprod", infer=_cumsum_infer, reference=_cumprod_ref, category="reduce",
         attrs={"axis": 0, "exclusive": False, "reverse": False})  # fmt: skip


def _topk_infer(xs, a):
    x = xs[0]
    ax = norm_axis(a["axis"], x.ndim)
    if isinstance(x.shape[ax], int) and not 0 <= a["k"] <= x.shape[ax]:
        raise ShapeError(f"topk k={a['k']} is out of range for an axis of size {x.shape[ax]}")
    shape = tuple(a["k"] if i == ax else d for i, d in enumerate(x.shape))
    return [(shape, x.dtype), (shape, dtypes.int64)]


def _topk_ref(xs, a):
    x, ax, k = xs[0], a["axis"], a["k"]
    if a["largest"]:  # descending, ties by the lower index: a stable sort of the negated order
        key = -x.astype(np.float64) if x.dtype.kind != "u" else np.iinfo(x.dtype).max - x
    else:
        key = x
    order = np.argsort(key, axis=ax, kind="stable")
    idx = np.take(order, range(k), axis=ax)
    return [np.take_along_axis(x, idx, axis=ax), idx.astype(np.int64)]


register("topk", infer=_topk_infer, reference=_topk_ref, category="opaque", attrs={"k": 1, "axis": -1, "largest": True},
         doc="the k largest (or smallest) values along axis, sorted, and their indices; ties keep the lower index")  # fmt: skip
