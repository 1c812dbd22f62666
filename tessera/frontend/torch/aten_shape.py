"""Lowering rules for ATen's views, slicing, indexing and functional scatters.

Functionalization turns every in-place update (a KV cache's `index_copy_`, `x[:, i] = v`,
`copy_`) into functional ops -- `index_put`, `slice_scatter`, `select_scatter`, `copy` --
whose result replaces the updated tensor.  They lower to compiled gathers and selects:
position p along the updated axis takes the source element that writes it (found by
comparing p with the index), or keeps the old value.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tessera.errors import UnsupportedError
from tessera.frontend.torch.aten_nn import reshape
from tessera.frontend.torch.convert import Converter, lowers
from tessera.frontend.torch.symbols import dim_from_sym
from tessera.graph import Tensor
from tessera.graph.opdefs.shape import BIG, slice_window
from tessera.graph.symbolic import Sym, dim_mul
from tessera.ir.symbolic import nonneg


def _axis(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


# ---- views ---------------------------------------------------------------------------------
@lowers("aten.view.default", "aten._unsafe_view", "aten.reshape", "aten.view_copy.default")
def _view(cv, a):
    return reshape(cv, a["self"], list(a.get("size", a.get("shape"))))


@lowers("aten.permute")
def _permute(cv, a):
    perm = [_axis(int(d), a["self"].ndim) for d in a["dims"]]
    return a["self"] if perm == sorted(perm) else cv.op("permute", a["self"], perm=perm)


@lowers("aten.t", "aten.transpose.int")
def _transpose(cv, a):
    x = a["self"]
    if x.ndim < 2:
        return x
    d0, d1 = (_axis(int(a.get(k, d)), x.ndim) for k, d in (("dim0", 0), ("dim1", 1)))
    perm = list(range(x.ndim))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return cv.op("permute", x, perm=perm)


@lowers("aten.expand")
def _expand(cv, a):
    x, size = a["self"], list(a["size"])
    pad = len(size) - x.ndim
    size = [x.shape[i - pad] if s == -1 else s for i, s in enumerate(size)]
    return x if tuple(size) == tuple(x.shape) else cv.op("expand", x, shape=size)


@lowers("aten.unsqueeze")
def _unsqueeze(cv, a):
    return cv.op("unsqueeze", a["self"], axes=[_axis(int(a["dim"]), a["self"].ndim + 1)])


@lowers("aten.squeeze")
def _squeeze(cv, a):
    x = a["self"]
    dims = a.get("dim", a.get("dims"))
    if dims is None:
        axes = [i for i, d in enumerate(x.shape) if d == 1]
    else:
        axes = [_axis(int(d), max(x.ndim, 1)) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
        axes = [ax for ax in axes if x.ndim and x.shape[ax] == 1]  # torch ignores dims that are not 1
    return cv.op("squeeze", x, axes=axes) if axes else x


@lowers("aten.cat")
def _cat(cv, a):
    dim = int(a["dim"])
    # torch skips legacy empty tensors ([0]); parts empty along the axis add nothing
    parts = [t for t in a["tensors"] if not (t.ndim == 1 and t.shape[0] == 0) and t.shape[_axis(dim, t.ndim)] != 0]
    if not parts:
        raise UnsupportedError("concatenation of empty tensors")
    dt = cv.meta.dtype
    parts = [cv.cast(t, dt) for t in parts]
    if len(parts) == 1:
        return parts[0]
    return cv.op("concat", *parts, axis=_axis(dim, parts[0].ndim))


@lowers("aten.split_with_sizes", "aten.split.Tensor", "aten.split_with_sizes_copy")
def _split(cv, a):
    x = a["self"]
    dim = _axis(int(a["dim"]), x.ndim)
    if "split_sizes" in a:
        sizes = list(a["split_sizes"])
    else:
        total, n = x.shape[dim], a["split_size"]
        if not isinstance(total, int) or not isinstance(n, int):
            raise UnsupportedError("split of a symbolic size into fixed chunks")
        sizes = [min(n, total - i) for i in range(0, total, n)] or [0]
    return tuple(cv.op_multi("split", x, axis=dim, sizes=sizes)) if len(sizes) > 1 else (x,)


@lowers("aten.unbind")
def _unbind(cv, a):
    x = a["self"]
    dim = _axis(int(a["dim"]), x.ndim)
    if not isinstance(x.shape[dim], int):
        raise UnsupportedError("unbind of a symbolic size")
    parts = cv.op_multi("split", x, axis=dim, sizes=[1] * x.shape[dim]) if x.shape[dim] > 1 else [x]
    return tuple(cv.op("squeeze", p, axes=[dim]) for p in parts)


def _slice(cv: Converter, x: Tensor, dim: int, start: Any, end: Any, step: Any = 1) -> Tensor:
    start = 0 if start is None else start
    end = BIG if end is None or (isinstance(end, int) and end >= BIG) else end
    if start == 0 and step == 1 and (end == BIG or end == x.shape[dim]):
        return x
    return cv.op("slice", x, axes=[dim], starts=[start], ends=[end], steps=[step])


@lowers("aten.slice.Tensor", "aten.slice_copy.Tensor")
def _slice_rule(cv, a):
    x = a["self"]
    return _slice(cv, x, _axis(int(a["dim"]), x.ndim), a["start"], a["end"], a["step"])


@lowers("aten.select.int", "aten.select_copy.int")
def _select(cv, a):
    x = a["self"]
    dim, i = _axis(int(a["dim"]), x.ndim), a["index"]
    if not isinstance(x.shape[dim], int) or not isinstance(i, int):
        # a gather of one position: its shape needs no slice length of a symbolic size
        return cv.op("take", x, cv.const(i, "int64"), axis=dim)
    end = i + 1 if i != -1 else BIG
    return cv.op("squeeze", _slice(cv, x, dim, i, end), axes=[dim])


@lowers("aten.narrow")
def _narrow(cv, a):
    x = a["self"]
    return _slice(cv, x, _axis(int(a["dim"]), x.ndim), a["start"], a["start"] + a["length"])


@lowers("aten.flip")
def _flip(cv, a):
    return cv.op("flip", a["self"], axes=[_axis(int(d), a["self"].ndim) for d in a["dims"]])


@lowers("aten.repeat")
def _repeat(cv, a):
    x, reps = a["self"], [int(r) for r in a["repeats"]]
    if len(reps) > x.ndim:
        x = reshape(cv, x, [1] * (len(reps) - x.ndim) + list(x.shape))
    return cv.op("tile", x, repeats=reps)


@lowers("aten.tril", "aten.triu")
def _tri(cv, a):
    kind = "tril" if "tril" in str(cv.node.target) else "triu"
    d = a["diagonal"]  # symbolic under dynamic shapes (a causal mask over `past + seq` keys)
    return cv.op(kind, a["self"], diagonal=d if isinstance(d, Sym) else int(d))


@lowers("aten.constant_pad_nd")
def _pad(cv, a):
    x, p = a["self"], list(a["pad"])
    pads = [0] * (2 * x.ndim)
    for i in range(len(p) // 2):  # torch lists (before, after) pairs from the last axis backwards
        ax = x.ndim - 1 - i
        pads[2 * ax], pads[2 * ax + 1] = p[2 * i], p[2 * i + 1]
    value = a["value"]
    return cv.op("pad", x, pads=pads, value=float(value) if x.dtype.is_float else int(value))


# ---- gathers ---------------------------------------------------------------------------------
@lowers("aten.index_select")
def _index_select(cv, a):
    return cv.op("take", a["self"], a["index"], axis=_axis(int(a["dim"]), a["self"].ndim))


@lowers("aten.gather")
def _gather(cv, a):
    return cv.op("gather_elements", a["self"], a["index"], axis=_axis(int(a["dim"]), a["self"].ndim))


def _linear_index(cv: Converter, x: Tensor, indices: list) -> tuple[int, Tensor, int]:
    """Adjacent integer index tensors as one index into their flattened axes:
    (first axis, index tensor, number of axes); negative indices wrap."""
    used = [i for i, t in enumerate(indices) if t is not None]
    if not used:
        raise UnsupportedError("indexing without an index tensor")
    first, count = used[0], len(used)
    if used != list(range(first, first + count)):
        raise UnsupportedError("advanced indexing with index tensors on non-adjacent axes")
    idx = None
    for ax in used:
        t = indices[ax]
        if t.dtype.is_bool:
            raise UnsupportedError("boolean-mask indexing (its output shape depends on the data)")
        t = cv.cast(t, "int64")
        n = x.shape[ax]
        t = cv.op("where", cv.op("lt", t, cv.tensor(0, t.dtype)), cv.op("add", t, cv.tensor(n, t.dtype)), t)
        idx = t if idx is None else cv.op("add", cv.op("mul", idx, cv.tensor(n, t.dtype)), t)
    return first, idx, count


def _merge_axes(cv: Converter, x: Tensor, first: int, count: int) -> Tensor:
    if count == 1:
        return x
    merged: Any = 1
    for d in x.shape[first : first + count]:
        merged = dim_mul(merged, d)
    return reshape(cv, x, [*x.shape[:first], merged, *x.shape[first + count :]])


@lowers("aten.index.Tensor", "aten._unsafe_index.Tensor")
def _index(cv, a):
    x = a["self"]
    first, idx, count = _linear_index(cv, x, list(a["indices"]) + [None] * (x.ndim - len(a["indices"])))
    return cv.op("take", _merge_axes(cv, x, first, count), idx, axis=first)


# ---- functional scatters (what in-place updates become) ----------------------------------------
def _scatter_axis(cv: Converter, x: Tensor, axis: int, index: Tensor, values: Tensor, accumulate: bool) -> Tensor:
    """x with x[..., index[j], ...] (at `axis`) replaced by (or, accumulating, increased by)
    values[..., j, ...]; index is 1-D and in range [0, n)."""
    n = x.shape[axis]
    positions = cv.op("arange", start=0, end=n, step=1, dtype="int64")
    match = cv.op("eq", cv.op("unsqueeze", index, axes=[1]), cv.op("unsqueeze", positions, axes=[0]))  # [L, n]
    if accumulate:
        moved = cv.op("permute", values, perm=[*(i for i in range(x.ndim) if i != axis), axis])
        added = cv.op("matmul", moved, cv.cast(match, values.dtype))  # [..., n]: sum of the writes per position
        back = list(range(x.ndim - 1))
        back.insert(axis, x.ndim - 1)
        return cv.op("add", x, cv.op("permute", added, perm=back))
    hit = cv.op("cast", cv.op("reduce_max", cv.cast(match, "int32"), axes=[0]), dtype="bool")  # [n]
    writer = cv.op("argmax", cv.cast(match, "int32"), axis=0)  # [n]: the index entry that writes position p
    taken = cv.op("take", values, writer, axis=axis)
    hit = reshape(cv, hit, [n] + [1] * (x.ndim - axis - 1))
    return cv.op("where", hit, taken, x)


@lowers("aten.index_put", "aten._unsafe_index_put")
def _index_put(cv, a):
    x, values, accumulate = a["self"], cv.cast(a["values"], cv.meta.dtype), bool(a["accumulate"])
    indices = list(a["indices"]) + [None] * (x.ndim - len(a["indices"]))
    if len([t for t in indices if t is not None]) == 1 and indices[0] is not None and indices[0].dtype.is_bool \
            and tuple(indices[0].shape) == tuple(x.shape[: indices[0].ndim]) and values.ndim == 0 and not accumulate:
        mask = reshape(cv, indices[0], list(indices[0].shape) + [1] * (x.ndim - indices[0].ndim))
        return cv.op("where", mask, values, x)  # x[mask] = scalar: no data-dependent shape  # fmt: skip
    first, idx, count = _linear_index(cv, x, indices)
    merged = _merge_axes(cv, x, first, count)
    # values broadcast to x's shape with the indexed axes replaced by the index's shape
    target = [*x.shape[:first], *idx.shape, *x.shape[first + count :]]
    values = cv.op("expand", values, shape=target) if tuple(values.shape) != tuple(target) else values
    flat: Any = 1
    for d in idx.shape:
        flat = dim_mul(flat, d)
    values = reshape(cv, values, [*x.shape[:first], flat, *x.shape[first + count :]])
    idx = reshape(cv, idx, [flat])
    out = _scatter_axis(cv, merged, first, idx, values, accumulate)
    return reshape(cv, out, list(x.shape))


@lowers("aten.index_copy")
def _index_copy(cv, a):
    x = a["self"]
    axis = _axis(int(a["dim"]), x.ndim)
    src = cv.cast(a["source"], x.dtype)
    if src.ndim == x.ndim - 1:  # a 0-d index copies one slice without its axis
        src = cv.op("unsqueeze", src, axes=[axis])
    return cv.op("index_copy", x, reshape(cv, a["index"], [-1]), src, axis=axis)


@lowers("aten.slice_scatter")
def _slice_scatter(cv, a):
    x, src = a["self"], cv.cast(a["src"], cv.meta.dtype)
    dim = _axis(int(a["dim"]), x.ndim)
    step, n = a["step"], x.shape[dim]
    # the graph's slice rule: negative and out-of-range bounds, symbolic sizes (`r[-4:-2] = v` on a
    # dynamic length) alike
    start, length = slice_window(n, 0 if a["start"] is None else a["start"], BIG if a["end"] is None else a["end"],
                                 step)  # fmt: skip
    if start == 0 and length == n and step == 1 and tuple(src.shape) == tuple(x.shape):
        return src
    positions = cv.op("arange", start=0, end=n, step=1, dtype="int64")
    offset = cv.op("sub", positions, cv.tensor(start, "int64"))
    inside = cv.op("logical_and", cv.op("ge", offset, cv.tensor(0, "int64")),
                   cv.op("lt", offset, cv.tensor(length * step, "int64")))  # fmt: skip
    if step != 1:
        inside = cv.op("logical_and", inside,
                       cv.op("eq", cv.op("remainder", offset, cv.tensor(step, "int64")), cv.tensor(0, "int64")))
        offset = cv.op("div", offset, cv.tensor(step, "int64"), rounding="floor")
    m = src.shape[dim]
    limit = (m - 1) if isinstance(m, int) else cv.op("sub", cv.tensor(m, "int64"), cv.tensor(1, "int64"))
    src_index = cv.op("minimum", cv.op("maximum", offset, cv.tensor(0, "int64")), cv.tensor(limit, "int64"))
    taken = cv.op("take", src, src_index, axis=dim)
    inside = reshape(cv, inside, [n] + [1] * (x.ndim - dim - 1))
    return cv.op("where", inside, taken, x)


@lowers("aten.select_scatter")
def _select_scatter(cv, a):
    x = a["self"]
    dim = _axis(int(a["dim"]), x.ndim)
    i = a["index"]
    if i < 0 if isinstance(i, int) else nonneg(-i):  # from the end, also of a symbolic size
        i = i + x.shape[dim]
    src = cv.op("unsqueeze", cv.cast(a["src"], cv.meta.dtype), axes=[dim])
    positions = cv.op("arange", start=0, end=x.shape[dim], step=1, dtype="int64")
    hit = reshape(cv, cv.op("eq", positions, cv.tensor(i, "int64")), [x.shape[dim]] + [1] * (x.ndim - dim - 1))
    return cv.op("where", hit, src, x)


def _src_like_index(cv: Converter, src: Tensor, index: Tensor) -> Tensor:
    """src cut to index's shape: torch reads only src[i] for the positions i of index."""
    if tuple(src.shape) == tuple(index.shape):
        return src
    axes = [ax for ax in range(src.ndim) if src.shape[ax] != index.shape[ax]]
    return cv.op("slice", src, axes=axes, starts=[0] * len(axes), ends=[index.shape[ax] for ax in axes],
                 steps=[1] * len(axes))  # fmt: skip


_SCATTER_REDUCTIONS = {"sum": "add", "prod": "mul", "amax": "max", "amin": "min"}


@lowers("aten.scatter.src", "aten.scatter.value", "aten.scatter_add", "aten.scatter_reduce.two")
def _scatter(cv, a):
    x, index = a["self"], cv.cast(a["index"], "int64")
    src = a.get("src")
    if src is None:
        src = cv.op("full", shape=list(index.shape), value=a["value"], dtype=x.dtype.name)
    reduction = "add" if "scatter_add" in str(cv.node.target) else "none"
    if "reduce" in a and a["reduce"] is not None:
        if a["reduce"] not in _SCATTER_REDUCTIONS or not a["include_self"]:
            raise UnsupportedError(f"scatter_reduce {a['reduce']!r} with include_self={a['include_self']}")
        reduction = _SCATTER_REDUCTIONS[a["reduce"]]
    return cv.op("scatter_elements", x, index, _src_like_index(cv, cv.cast(src, x.dtype), index),
                 axis=_axis(int(a["dim"]), x.ndim), reduction=reduction)  # fmt: skip


@lowers("aten.masked_scatter")
def _masked_scatter(cv, a):
    x, mask, source = a["self"], cv.cast(a["mask"], "bool"), cv.cast(a["source"], cv.meta.dtype)
    shape = list(cv.meta.shape)

    shape = [dim_from_sym(d) for d in shape]
    mask = cv.op("expand", mask, shape=shape) if tuple(mask.shape) != tuple(shape) else mask
    x = cv.op("expand", x, shape=shape) if tuple(x.shape) != tuple(shape) else x
    # the k-th True position (row-major) takes source's k-th element
    order = cv.op("cumsum", cv.cast(reshape(cv, mask, [-1]), "int64"), axis=0)
    flat_source = reshape(cv, source, [-1])
    n = flat_source.shape[0]
    last = (n - 1) if isinstance(n, int) else cv.op("sub", cv.tensor(n, "int64"), cv.tensor(1, "int64"))
    pick = cv.op("minimum", cv.op("maximum", cv.op("sub", order, cv.tensor(1, "int64")), cv.tensor(0, "int64")),
                 cv.tensor(last, "int64"))  # fmt: skip
    taken = reshape(cv, cv.op("take", flat_source, pick, axis=0), shape)
    return cv.op("where", mask, taken, x)


@lowers("aten.diagonal")
def _diagonal(cv, a):
    x, offset = a["self"], int(a["offset"])
    d1, d2 = _axis(int(a["dim1"]), x.ndim), _axis(int(a["dim2"]), x.ndim)
    n1, n2 = x.shape[d1], x.shape[d2]
    if not isinstance(n1, int) or not isinstance(n2, int):
        raise UnsupportedError("diagonal of symbolic sizes")
    rest = [i for i in range(x.ndim) if i not in (d1, d2)]
    moved = cv.op("permute", x, perm=[*rest, d1, d2])
    flat = reshape(cv, moved, [*(x.shape[i] for i in rest), n1 * n2])
    rows = range(max(0, -offset), min(n1, n2 - offset)) if n2 - offset > 0 else range(0)
    index = Tensor.constant(np.asarray([r * n2 + r + offset for r in rows], dtype=np.int64).reshape(-1))
    return cv.op("take", flat, index, axis=len(rest))


@lowers("aten.masked_fill")
def _masked_fill(cv, a):
    x = a["self"]
    return cv.op("where", cv.cast(a["mask"], "bool"), cv.tensor(a["value"], x.dtype), x)


def _dense_order(size: list[int], stride: list[int]) -> list[int] | None:
    """The axes from outermost to innermost when (size, stride) lays its elements out densely
    (each stride the product of the sizes inside it, size-1 axes anywhere), else None."""
    order = sorted(range(len(size)), key=lambda i: (-stride[i], -i))
    expect = 1
    for i in reversed(order):
        if size[i] != 1 and stride[i] != expect:
            return None
        expect *= size[i]
    return order


def _storage(cv: Converter, x: Tensor, meta: Any) -> Tensor:
    """x's elements as a flat vector in the order its storage holds them (a permuted, dense x
    -- a channels-last conv output, a transposed view -- is permuted back first)."""
    size, stride = list(meta.shape), list(meta.stride())
    order = _dense_order(size, stride)
    if order is None:
        raise UnsupportedError("as_strided of a tensor that overlaps itself or has gaps")
    if order != sorted(order):
        x = cv.op("permute", x, perm=order)
    return reshape(cv, x, [int(np.prod(size))])


@lowers("aten.as_strided")
def _as_strided(cv, a):
    """A view of `self`'s storage: offsets are counted from the storage `self` views, so the
    storage is rebuilt from self's strides; a dense result is a slice + reshape + permute of
    it, any other (overlapping windows, gaps) a gather with a constant index."""
    x = a["self"]
    meta = cv.arg_meta("self")
    size, stride = list(a["size"]), list(a["stride"])
    if not all(isinstance(v, int) for v in (*size, *stride, *meta.shape, *meta.stride())):
        raise UnsupportedError("as_strided with symbolic sizes or strides")
    offset = int(a.get("storage_offset") or 0) - int(meta.storage_offset())
    if offset < 0:
        raise UnsupportedError("as_strided reaching before the storage its input views")
    flat = _storage(cv, x, meta)
    numel = int(np.prod(size))
    if numel == 0:
        raise UnsupportedError("as_strided to an empty tensor")
    order = _dense_order(size, stride)
    if order is not None:
        if offset + numel > int(flat.shape[0]):
            raise UnsupportedError("as_strided reaching past the end of its input's storage")
        dense = _slice(cv, flat, 0, offset, offset + numel)
        moved = reshape(cv, dense, [size[i] for i in order])
        inverse = [order.index(i) for i in range(len(size))]
        return moved if inverse == sorted(inverse) else cv.op("permute", moved, perm=inverse)
    index = offset + sum(np.arange(n, dtype=np.int64).reshape([-1 if j == i else 1 for j in range(len(size))]) * st
                         for i, (n, st) in enumerate(zip(size, stride)))  # fmt: skip
    index = np.broadcast_to(index, size).reshape(-1)
    if int(index.max()) >= int(flat.shape[0]):
        raise UnsupportedError("as_strided reaching past the end of its input's storage")
    return reshape(cv, cv.op("take", flat, Tensor.constant(np.ascontiguousarray(index)), axis=0), size)
