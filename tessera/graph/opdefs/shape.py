"""Injective operators: reshapes, transposes, slices, concatenation, splits, broadcasts and
gathers.  Shapes may hold symbolic sizes; attribute entries may be symbolic too and are
evaluated from the input shapes at run time."""

from __future__ import annotations

import numpy as np

from tessera.graph.opdefs._common import norm_axes, norm_axis
from tessera.graph.registry import REQUIRED, register
from tessera.graph.symbolic import (
    Dim,
    ShapeError,
    broadcast_shapes,
    dim_add,
    dim_div,
    fresh_dim,
    numel,
)  # fmt: skip
from tessera.ir import dtypes
from tessera.ir.symbolic import floordiv, nonneg, sym_max, sym_min

BIG = 2**62  # "to the end" in slice bounds


def _same(xs, a):
    return [(xs[0].shape, xs[0].dtype)]


# ---- reshape ------------------------------------------------------------------------------
def _reshape_infer(xs, a):
    x, target = xs[0], list(a["shape"])
    if sum(1 for d in target if d == -1) > 1:
        raise ShapeError(f"reshape target {target} has more than one -1")
    known = numel([d for d in target if d != -1])
    total = numel(x.shape)
    if -1 in target:
        rest = dim_div(total, known) if known != 0 else 0
        target[target.index(-1)] = rest
    elif isinstance(total, int) and isinstance(known, int) and total != known:
        raise ShapeError(f"cannot reshape {x.shape} ({total} elements) to {a['shape']} ({known})")
    return [(tuple(target), x.dtype)]


register("reshape", infer=_reshape_infer, category="injective", attrs={"shape": REQUIRED},
         reference=lambda xs, a: [np.reshape(xs[0], a["shape"])],
         doc="row-major reshape; one entry may be -1; entries may be symbolic sizes")  # fmt: skip


def _flatten_infer(xs, a):
    x = xs[0]
    if x.ndim == 0:
        return [((1,), x.dtype)]
    s, e = norm_axis(a["start"], x.ndim), norm_axis(a["end"], x.ndim)
    return [((*x.shape[:s], numel(x.shape[s : e + 1]), *x.shape[e + 1 :]), x.dtype)]


def _flatten_ref(xs, a):
    x = xs[0]
    if x.ndim == 0:
        return [x.reshape(1)]
    s, e = norm_axis(a["start"], x.ndim), norm_axis(a["end"], x.ndim)
    return [x.reshape(*x.shape[:s], -1, *x.shape[e + 1 :])]


register("flatten", infer=_flatten_infer, reference=_flatten_ref, category="injective",
         attrs={"start": 0, "end": -1})  # fmt: skip


def _permute_infer(xs, a):
    perm = [norm_axis(p, xs[0].ndim) for p in a["perm"]]
    if sorted(perm) != list(range(xs[0].ndim)):
        raise ShapeError(f"{a['perm']} is not a permutation of rank {xs[0].ndim}")
    return [(tuple(xs[0].shape[p] for p in perm), xs[0].dtype)]


register("permute", infer=_permute_infer, category="injective", attrs={"perm": REQUIRED},
         reference=lambda xs, a: [np.transpose(xs[0], a["perm"])])  # fmt: skip


# ---- attention heads ----------------------------------------------------------------------
# The head split of a projection's output and the merge back, one operator each (the
# head_views pass writes them for reshape/permute chains), so the GPU attention anchor can read
# and write them in place: its kernels address [B, S, W] memory through strides, no copy.
def _split_heads_infer(xs, a):
    x = xs[0]
    h, d, off = a["heads"], a["head_dim"], a["offset"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (h, d, off)) or h < 1 or d < 1 or off < 0:
        raise ShapeError(f"split_heads: heads and head_dim must be positive ints, offset a non-negative int; got {h}, {d}, {off}")
    if x.ndim != 3:
        raise ShapeError(f"split_heads takes a [batch, seq, width] tensor, got shape {list(x.shape)}")
    if isinstance(x.shape[2], int) and off + h * d > x.shape[2]:
        raise ShapeError(f"split_heads: columns {off}..{off + h * d} exceed the width {x.shape[2]}")
    return [((x.shape[0], h, x.shape[1], d), x.dtype)]


def _split_heads_ref(xs, a):
    x, h, d, off = xs[0], a["heads"], a["head_dim"], a["offset"]
    part = x[:, :, off : off + h * d].reshape(x.shape[0], x.shape[1], h, d)
    return [np.ascontiguousarray(part.transpose(0, 2, 1, 3))]


register("split_heads", infer=_split_heads_infer, reference=_split_heads_ref, category="injective",
         attrs={"heads": REQUIRED, "head_dim": REQUIRED, "offset": 0},
         doc="x [B, S, W] -> [B, heads, S, head_dim]: y[b, h, s, d] = x[b, s, offset + h * head_dim + d]")  # fmt: skip


def _merge_heads_infer(xs, a):
    x = xs[0]
    if x.ndim != 4:
        raise ShapeError(f"merge_heads takes a [batch, heads, seq, head_dim] tensor, got shape {list(x.shape)}")
    return [((x.shape[0], x.shape[2], x.shape[1] * x.shape[3]), x.dtype)]


register("merge_heads", infer=_merge_heads_infer, category="injective",
         reference=lambda xs, a: [np.ascontiguousarray(xs[0].transpose(0, 2, 1, 3)).reshape(
             xs[0].shape[0], xs[0].shape[2], xs[0].shape[1] * xs[0].shape[3])],
         doc="x [B, H, S, D] -> [B, S, H * D]: y[b, s, h * D + d] = x[b, h, s, d]")  # fmt: skip


# ---- slicing ------------------------------------------------------------------------------
def slice_window(dim: Dim, start, end, step: int) -> tuple[Dim, Dim]:
    """(first index, length) of Python's slice start:end:step (step > 0) on an axis of size dim,
    symbolically and exactly: negative bounds count from the end (a symbolic bound is negative
    when all its coefficients are), bounds clamp to [0, dim], an empty slice has length 0; the
    size algebra drops the clamps it can decide (`x[:, :1]` on a symbolic length is 1).  The
    one rule for shape inference and lowering."""

    def clamp(b: Dim) -> Dim:
        b = b + dim if (b < 0 if isinstance(b, int) else nonneg(-b)) else b
        return sym_min(sym_max(b, 0), dim)

    first = clamp(start)
    stop = dim if isinstance(end, int) and end >= BIG else clamp(end)
    return first, sym_max(0, floordiv(stop - first + step - 1, step))


def _slice_len(dim: Dim, start, end, step) -> Dim:
    if isinstance(dim, int) and isinstance(start, int) and isinstance(end, int):
        return len(range(*slice(start, end, step).indices(dim)))
    if step == 1 and start == 0 and (end == dim or (isinstance(end, int) and end >= BIG)):
        return dim
    if not isinstance(step, int) or step < 0:
        return fresh_dim("l")  # reversing a symbolic axis
    return slice_window(dim, start, end, step)[1]


def _slice_infer(xs, a):
    x = xs[0]
    shape = list(x.shape)
    n = len(a["axes"])
    if not (len(a["starts"]) == len(a["ends"]) == n and len(a["steps"] or [1] * n) == n):
        raise ShapeError("slice axes, starts, ends and steps differ in length")
    for ax, s, e, st in zip(a["axes"], a["starts"], a["ends"], a["steps"] or [1] * n):
        if st == 0:
            raise ShapeError("slice step cannot be 0")
        ax = norm_axis(ax, x.ndim)
        shape[ax] = _slice_len(shape[ax], s, e, st)
    return [(tuple(shape), x.dtype)]


def _slice_ref(xs, a):
    x = xs[0]
    index = [slice(None)] * x.ndim
    n = len(a["axes"])
    for ax, s, e, st in zip(a["axes"], a["starts"], a["ends"], a["steps"] or [1] * n):
        index[ax % x.ndim] = slice(s, e, st)
    return [x[tuple(index)]]


register("slice", infer=_slice_infer, reference=_slice_ref, category="injective",
         attrs={"axes": REQUIRED, "starts": REQUIRED, "ends": REQUIRED, "steps": None},
         doc="Python slicing per axis: negative bounds count from the end, bounds are clamped, steps may be negative")  # fmt: skip


def _concat_infer(xs, a):
    rank = xs[0].ndim
    ax = norm_axis(a["axis"], rank)
    shape = list(xs[0].shape)
    for t in xs[1:]:
        if t.ndim != rank:
            raise ShapeError(f"concat of ranks {rank} and {t.ndim}")
        for i, (d0, d1) in enumerate(zip(shape, t.shape)):
            if i != ax and isinstance(d0, int) and isinstance(d1, int) and d0 != d1:
                raise ShapeError(f"concat along {ax}: shapes {xs[0].shape} and {t.shape} differ on axis {i}")
        shape[ax] = dim_add(shape[ax], t.shape[ax])
    dt = xs[0].dtype
    for t in xs[1:]:
        dt = dtypes.promote(dt, t.dtype) if t.dtype != dt else dt
    return [(tuple(shape), dt)]


register("concat", infer=_concat_infer, category="injective", attrs={"axis": 0}, num_inputs=(1, 1 << 16),
         reference=lambda xs, a: [np.concatenate(xs, axis=a["axis"])])  # fmt: skip


def _split_infer(xs, a):
    x = xs[0]
    ax = norm_axis(a["axis"], x.ndim)
    sizes = a["sizes"]
    if isinstance(x.shape[ax], int) and all(isinstance(s, int) for s in sizes) and sum(sizes) != x.shape[ax]:
        raise ShapeError(f"split sizes {sizes} do not add up to {x.shape[ax]}")
    return [(tuple(s if i == ax else d for i, d in enumerate(x.shape)), x.dtype) for s in sizes]


def _split_ref(xs, a):
    offsets = np.cumsum(a["sizes"])[:-1]
    return list(np.split(xs[0], offsets, axis=a["axis"]))


register("split", infer=_split_infer, reference=_split_ref, category="injective",
         attrs={"axis": 0, "sizes": REQUIRED}, doc="one output per entry of sizes")  # fmt: skip


# ---- broadcasting and axes ----------------------------------------------------------------
def _expand_target(in_shape, target):
    pad = len(target) - len(in_shape)
    if pad < 0:
        raise ShapeError(f"cannot expand {in_shape} to fewer dimensions {target}")
    out = []
    for i, t in enumerate(target):
        src = in_shape[i - pad] if i >= pad else 1
        out.append(src if t == -1 else t)
    return broadcast_shapes(in_shape, out)


register("expand", infer=lambda xs, a: [(_expand_target(xs[0].shape, list(a["shape"])), xs[0].dtype)],
         category="injective", attrs={"shape": REQUIRED},
         reference=lambda xs, a: [np.broadcast_to(xs[0], _expand_target(xs[0].shape, list(a["shape"])))],
         doc="broadcast to shape (torch.expand: -1 keeps a size; ONNX Expand maps here after broadcasting)")  # fmt: skip


def _squeeze_axes(shape, axes):
    if axes is None:
        return tuple(i for i, d in enumerate(shape) if d == 1)
    axes = norm_axes(axes, len(shape))
    # torch silently keeps an axis whose size is not 1; so do we.
    return tuple(i for i in axes if shape[i] == 1)


def _squeeze_infer(xs, a):
    drop = _squeeze_axes(xs[0].shape, a["axes"])
    return [(tuple(d for i, d in enumerate(xs[0].shape) if i not in drop), xs[0].dtype)]


register("squeeze", infer=_squeeze_infer, category="injective", attrs={"axes": None},
         reference=lambda xs, a: [np.squeeze(xs[0], axis=_squeeze_axes(xs[0].shape, a["axes"]))])  # fmt: skip


def _unsqueeze_infer(xs, a):
    rank = xs[0].ndim + len(a["axes"])
    axes = norm_axes(a["axes"], rank)
    it = iter(xs[0].shape)
    return [(tuple(1 if i in axes else next(it) for i in range(rank)), xs[0].dtype)]


register("unsqueeze", infer=_unsqueeze_infer, category="injective", attrs={"axes": REQUIRED},
         reference=lambda xs, a: [np.expand_dims(xs[0], norm_axes(a["axes"], xs[0].ndim + len(a["axes"])))],
         doc="axes index the output")  # fmt: skip


def _tile_infer(xs, a):
    reps = list(a["repeats"])
    shape = [1] * (len(reps) - xs[0].ndim) + list(xs[0].shape)
    reps = [1] * (len(shape) - len(reps)) + reps
    return [(tuple(d if r == 1 else (d * r if isinstance(d, int) else d * r) for d, r in zip(shape, reps)), xs[0].dtype)]


register("tile", infer=_tile_infer, category="injective", attrs={"repeats": REQUIRED},
         reference=lambda xs, a: [np.tile(xs[0], a["repeats"])], doc="torch.Tensor.repeat / numpy.tile")  # fmt: skip

register("flip", infer=_same, category="injective", attrs={"axes": REQUIRED},
         reference=lambda xs, a: [np.flip(xs[0], axis=tuple(a["axes"]))])  # fmt: skip


def _pad_infer(xs, a):
    pads = a["pads"]
    x = xs[0]
    if len(pads) != 2 * x.ndim:
        raise ShapeError(f"pad needs (before, after) for each of {x.ndim} axes, got {pads}")
    shape = [dim_add(dim_add(d, pads[2 * i]), pads[2 * i + 1]) for i, d in enumerate(x.shape)]
    return [(tuple(shape), x.dtype)]


def _pad_ref(xs, a):
    x, p = xs[0], a["pads"]
    widths = [(max(p[2 * i], 0), max(p[2 * i + 1], 0)) for i in range(x.ndim)]
    y = np.pad(x, widths, constant_values=np.asarray(a["value"]).astype(x.dtype))
    crop = tuple(slice(-min(p[2 * i], 0), y.shape[i] + min(p[2 * i + 1], 0)) for i in range(x.ndim))
    return [y[crop]]


register("pad", infer=_pad_infer, reference=_pad_ref, category="injective", attrs={"pads": REQUIRED, "value": 0.0},
         doc="constant padding; pads = [before0, after0, before1, after1, ...]; negative values crop")  # fmt: skip


def _tri_infer(xs, a):
    if xs[0].ndim < 2:
        raise ShapeError("tril/triu need rank >= 2")
    return _same(xs, a)


register("tril", infer=_tri_infer, category="injective", attrs={"diagonal": 0},
         reference=lambda xs, a: [np.tril(xs[0], a["diagonal"])])  # fmt: skip
register("triu", infer=_tri_infer, category="injective", attrs={"diagonal": 0},
         reference=lambda xs, a: [np.triu(xs[0], a["diagonal"])])  # fmt: skip


# ---- gathers ------------------------------------------------------------------------------
def _take_infer(xs, a):
    data, idx = xs
    if not idx.dtype.is_integer:
        raise ShapeError(f"indices must be integers, got {idx.dtype}")
    ax = norm_axis(a["axis"], data.ndim)
    return [((*data.shape[:ax], *idx.shape, *data.shape[ax + 1 :]), data.dtype)]


def _take_ref(xs, a):
    data, idx = xs
    n = data.shape[a["axis"]]
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise IndexError(f"index out of range for axis of size {n}")
    return [np.take(data, idx, axis=a["axis"])]


register("take", infer=_take_infer, reference=_take_ref, category="injective", attrs={"axis": 0}, num_inputs=2,
         doc="inputs data, indices: numpy.take (embedding, index_select, ONNX Gather); negative indices wrap")  # fmt: skip


def _gather_elements_infer(xs, a):
    if xs[0].ndim != xs[1].ndim:
        raise ShapeError("gather_elements needs index of the same rank as data")
    return [(xs[1].shape, xs[0].dtype)]


register("gather_elements", infer=_gather_elements_infer, category="injective", attrs={"axis": 0}, num_inputs=2,
         reference=lambda xs, a: [np.take_along_axis(xs[0], xs[1], axis=a["axis"])],
         doc="torch.gather / ONNX GatherElements")  # fmt: skip


def _gather_nd_infer(xs, a):
    data, idx = xs
    b = a["batch_dims"]
    k = idx.shape[-1]
    if not isinstance(k, int) or not idx.dtype.is_integer:
        raise ShapeError("gather_nd needs integer indices with a static last dimension")
    if b + k > data.ndim:
        raise ShapeError(f"gather_nd: {b} batch dims + index depth {k} exceed the data rank {data.ndim}")
    return [((*idx.shape[:-1], *data.shape[b + k :]), data.dtype)]


def _gather_nd_ref(xs, a):
    data, idx = xs
    b = a["batch_dims"]
    batch = data.shape[:b]
    nb = int(np.prod(batch, dtype=np.int64))
    d = data.reshape(nb, *data.shape[b:])
    i = idx.reshape(nb, -1, idx.shape[-1])
    out = np.stack([d[j][tuple(i[j].T)] for j in range(nb)]) if nb else np.empty((0,), data.dtype)
    return [out.reshape(*idx.shape[:-1], *data.shape[b + idx.shape[-1] :])]


register("gather_nd", infer=_gather_nd_infer, reference=_gather_nd_ref, category="injective", num_inputs=2,
         attrs={"batch_dims": 0}, doc="ONNX GatherND: index tuples into data after batch_dims leading batch axes")  # fmt: skip

_SCATTER_REDUCE = {"none": None, "add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _scatter_infer(xs, a):
    if a["reduction"] not in _SCATTER_REDUCE:
        raise ShapeError(f"scatter reduction must be one of {sorted(_SCATTER_REDUCE)}, got {a['reduction']!r}")
    if not xs[1].dtype.is_integer:
        raise ShapeError(f"scatter indices must be integers, got {xs[1].dtype}")
    return [(xs[0].shape, xs[0].dtype)]


def _scatter_elements_ref(xs, a):
    data, idx, upd = xs
    out = np.array(data, copy=True)
    ax = a["axis"]
    idx = np.where(idx < 0, idx + data.shape[ax], idx)
    full = list(np.indices(idx.shape, sparse=True))
    full[ax] = idx
    where = tuple(np.broadcast_arrays(*full))
    fn = _SCATTER_REDUCE[a["reduction"]]
    if fn is None:
        out[where] = upd  # with repeated indices the last update wins, as in ONNX's reference
    else:
        fn.at(out, where, upd)
    return [out]


def _scatter_nd_ref(xs, a):
    data, idx, upd = xs
    out = np.array(data, copy=True)
    fn = _SCATTER_REDUCE[a["reduction"]]
    flat_idx = idx.reshape(-1, idx.shape[-1])
    flat_upd = upd.reshape(flat_idx.shape[0], *upd.shape[idx.ndim - 1 :])
    for i, u in zip(flat_idx, flat_upd):
        key = tuple(i)
        out[key] = u if fn is None else fn(out[key], u)
    return [out]


register("scatter_elements", infer=_scatter_infer, reference=_scatter_elements_ref, category="opaque", num_inputs=3,
         attrs={"axis": 0, "reduction": "none"},
         doc="inputs data, indices, updates: data with updates written (or reduced) at indices along axis")  # fmt: skip
register("scatter_nd", infer=_scatter_infer, reference=_scatter_nd_ref, category="opaque", num_inputs=3,
         attrs={"reduction": "none"}, doc="ONNX ScatterND: updates written (or reduced) at index tuples")  # fmt: skip


def _index_copy_infer(xs, a):
    data, idx, src = xs
    if not idx.dtype.is_integer or idx.ndim != 1:
        raise ShapeError(f"index_copy: the index must be a 1-D integer tensor, got {idx.dtype} of rank {idx.ndim}")
    ax = norm_axis(a["axis"], data.ndim)
    want = (*data.shape[:ax], idx.shape[0], *data.shape[ax + 1 :])
    if src.ndim != data.ndim or any(isinstance(x, int) and isinstance(y, int) and x != y for x, y in zip(src.shape, want)):
        raise ShapeError(f"index_copy: source of shape {list(src.shape)} must have shape {list(want)} (data's with "
                         f"dim {ax} the index's length)")  # fmt: skip
    if src.dtype != data.dtype:
        raise ShapeError(f"index_copy: source ({src.dtype}) must have data's dtype ({data.dtype})")
    return [(data.shape, data.dtype)]


def _index_copy_ref(xs, a):
    data, idx, src = xs
    ax = norm_axis(a["axis"], data.ndim)
    n = data.shape[ax]
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise IndexError(f"index_copy: index out of range for axis of size {n}")
    out = np.array(data, copy=True)
    where = [slice(None)] * data.ndim
    for j, i in enumerate(idx.tolist()):  # in order: with repeated indices the last wins
        where[ax] = i
        out[tuple(where)] = np.take(src, j, axis=ax)
    return [out]


register("index_copy", infer=_index_copy_infer, reference=_index_copy_ref, category="opaque", num_inputs=3,
         attrs={"axis": 0, "in_place": False},
         doc="inputs data, index (1-D), source: torch's index_copy, data with source's slices written at index along "
             "axis (a KV-cache update). in_place: set by compile_graph when data is a graph input updated in place "
             "(the output lives in data's memory; the kernel writes the indexed slices alone)")  # fmt: skip
