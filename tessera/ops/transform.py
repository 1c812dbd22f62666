"""Data movement as compute definitions: permute/transpose, reshape (with -1), squeeze/unsqueeze/
flatten, slice (with steps), concat, split, expand/broadcast_to, pad, and gathers (take,
index_select, embedding, gather).

All are injective: a consumer inlines them, so a transpose feeding an add costs no extra pass
over memory.  Gathers read an index tensor; indices are wrapped once if negative (numpy); one outside
[-n, n) raises IndexOutOfRangeError on the CPU and is clamped on CUDA (see `safe_index`), so a
bad index never reads outside the tensor.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence

from tessera.errors import ArgumentError, UnsupportedError
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.compute import Compute, TensorNode, as_dim, compute, fresh_name
from tessera.ir.symbolic import exact_div
from tessera.ops.common import (
    check_tensor,
    dim_str,
    mul_dims,
    normalize_axes,
    normalize_axis,
    numel_of,
    promote_types,
    same_dim,
    size_expr,
    static,
)


def _i32(v: int) -> E.Const:
    return E.Const(v, dtypes.int32)


def _min(a: E.Expr, b: E.Expr) -> E.Expr:
    return E.Call("min", (a, b), dtypes.int32)


def _max(a: E.Expr, b: E.Expr) -> E.Expr:
    return E.Call("max", (a, b), dtypes.int32)


def add_dims(dims: Sequence[E.Expr]) -> E.Expr:
    """The sum of dimensions, constants folded."""
    total, rest = 0, []
    for d in dims:
        if static(d) is not None:
            total += static(d)
        else:
            rest.append(d)
    out: E.Expr | None = None
    for d in rest:
        out = d if out is None else out + d
    if out is None:
        return _i32(total)
    return out + total if total else out


# ---- axes permutations ------------------------------------------------------------------------------------------------
def permute(x: TensorNode, dims: Sequence[int]) -> Compute:
    """out[i_0, ..., i_n] = x[...] with out's axis k being x's axis dims[k]."""
    check_tensor(x, "permute")
    perm = [normalize_axis(d, x.rank, "permute") for d in dims]
    if sorted(perm) != list(range(x.rank)):
        raise ArgumentError(f"permute: dims {tuple(dims)} is not a permutation of the {x.rank} axes of '{x.name}'")
    shape = [x.shape[p] for p in perm]

    def fn(*i: E.Var) -> E.Expr:
        idx: list[E.Expr] = [_i32(0)] * x.rank
        for k, p in enumerate(perm):
            idx[p] = i[k]
        return x[tuple(idx)]

    return compute(shape, fn, fresh_name("permute"), tag="transpose")


def transpose(x: TensorNode, dim0: int = -2, dim1: int = -1) -> Compute:
    """Swap two axes (the last two by default)."""
    check_tensor(x, "transpose")
    a, b = normalize_axis(dim0, x.rank, "transpose"), normalize_axis(dim1, x.rank, "transpose")
    perm = list(range(x.rank))
    perm[a], perm[b] = perm[b], perm[a]
    return permute(x, perm)


# ---- reshapes --------------------------------------------------------------------------------------------------------
def _infer_missing(x: TensorNode, dims: list[E.Expr | None]) -> list[E.Expr]:
    """Fill the one -1 entry so that the element counts match (symbolic factors cancel exactly)."""
    known = [d for d in dims if d is not None]
    missing = exact_div(numel_of(x.shape), numel_of(known))
    if missing is None:
        raise ArgumentError(f"reshape: cannot infer -1: {dim_str(x.shape)} is not a multiple of the other dims {dim_str(known)}")
    filled = size_expr(missing, [*x.shape, *known])
    return [filled if d is None else d for d in dims]


def reshape(x: TensorNode, shape: Sequence[int | E.Expr], counts_checked: bool = False) -> Compute:
    """x with a new shape of the same element count, row-major; one entry may be -1.

    The counts must be equal in the size algebra.  `counts_checked=True` is for callers that
    check at run time that they agree (the graph compiler's shape check does): counts that are
    not provably equal (`6*n` against `(n//2) * (6*n // (n//2))`) are then accepted."""
    check_tensor(x, "reshape")
    dims: list[E.Expr | None] = []
    for d in shape:
        if isinstance(d, int) and not isinstance(d, bool) and d == -1:
            dims.append(None)
        else:
            try:
                dims.append(as_dim(d))
            except TypeError as exc:
                raise ArgumentError(f"reshape: {exc}") from None
    if dims.count(None) > 1:
        raise ArgumentError(f"reshape: at most one dimension may be -1, got {tuple(shape)}")
    out = _infer_missing(x, dims) if None in dims else [d for d in dims if d is not None]
    if numel_of(out) != numel_of(x.shape) and not (counts_checked and not isinstance(numel_of(out) - numel_of(x.shape), int)):
        raise ArgumentError(f"reshape: cannot reshape '{x.name}' of shape {dim_str(x.shape)} ({numel_of(x.shape)} "
                            f"elements) into {dim_str(out)} ({numel_of(out)}): the element counts differ")  # fmt: skip
    # Dimensions shared at the front and back map directly; only the middle needs div/mod.
    lead = 0
    while lead < builtins.min(len(out), x.rank) and same_dim(out[lead], x.shape[lead]):
        lead += 1
    tail = 0
    while tail < builtins.min(len(out), x.rank) - lead and same_dim(out[-1 - tail], x.shape[-1 - tail]):
        tail += 1
    in_mid = list(x.shape[lead:x.rank - tail])
    out_mid = out[lead:len(out) - tail]

    def fn(*i: E.Var) -> E.Expr:
        mid = i[lead:len(i) - tail]
        flat: E.Expr = _i32(0)
        for k, (v, d) in enumerate(zip(mid, out_mid)):
            flat = v if k == 0 else flat * d + v
        coords: list[E.Expr] = []
        rest = flat
        for k in range(len(in_mid) - 1, -1, -1):
            if k == 0:
                coords.append(rest)
            elif static(in_mid[k]) == 1:
                coords.append(_i32(0))
            else:
                coords.append(rest % in_mid[k])
                rest = rest // in_mid[k]
        return x[(*i[:lead], *coords[::-1], *i[len(i) - tail:])]

    return compute(out, fn, fresh_name("reshape"), tag="reshape")


def squeeze(x: TensorNode, axes: int | Sequence[int] | None = None) -> Compute:
    """Drop size-1 axes (all of them, or the given ones, which must have size 1)."""
    check_tensor(x, "squeeze")
    if axes is None:
        drop = [k for k, d in enumerate(x.shape) if static(d) == 1]
    else:
        drop = list(normalize_axes(axes, x.rank, "squeeze"))
        for k in drop:
            if static(x.shape[k]) != 1:
                raise ArgumentError(f"squeeze: axis {k} of '{x.name}' has size {x.shape[k]}, not 1")
    return reshape(x, [d for k, d in enumerate(x.shape) if k not in drop])


def unsqueeze(x: TensorNode, axis: int) -> Compute:
    """Insert a size-1 axis at `axis` (in the result's numbering)."""
    check_tensor(x, "unsqueeze")
    a = normalize_axis(axis, x.rank + 1, "unsqueeze")
    shape = list(x.shape)
    shape.insert(a, _i32(1))
    return reshape(x, shape)


def flatten(x: TensorNode, start: int = 0, end: int = -1) -> Compute:
    """Merge axes start..end (inclusive) into one."""
    check_tensor(x, "flatten")
    if x.rank == 0:
        return reshape(x, [1])
    s, e = normalize_axis(start, x.rank, "flatten"), normalize_axis(end, x.rank, "flatten")
    if s > e:
        raise ArgumentError(f"flatten: start axis {start} comes after end axis {end}")
    return reshape(x, [*x.shape[:s], mul_dims(x.shape[s:e + 1]), *x.shape[e + 1:]])


def expand(x: TensorNode, shape: Sequence[int | E.Expr]) -> Compute:
    """Broadcast x to `shape` (size-1 axes stretch; -1 keeps x's size; new axes go in front)."""
    check_tensor(x, "expand")
    if len(shape) < x.rank:
        raise ArgumentError(f"expand: target {tuple(shape)} has fewer dims than '{x.name}' {dim_str(x.shape)}")
    offset = len(shape) - x.rank
    target: list[E.Expr] = []
    for k, d in enumerate(shape):
        if isinstance(d, int) and d == -1:
            if k < offset:
                raise ArgumentError(f"expand: -1 is not allowed for the new leading dimension {k}")
            target.append(x.shape[k - offset])
        else:
            target.append(as_dim(d))
    for j, d in enumerate(x.shape):
        t = target[j + offset]
        if not (same_dim(d, t) or static(d) == 1):
            raise ArgumentError(f"expand: dimension {j} of '{x.name}' has size {d}, which cannot expand to {t} (only size 1 can)")

    def fn(*i: E.Var) -> E.Expr:
        return x[tuple(_i32(0) if static(d) == 1 and static(target[j + offset]) != 1 else i[j + offset]
                       for j, d in enumerate(x.shape))]  # fmt: skip

    return compute(target, fn, fresh_name("expand"), tag="broadcast")


broadcast_to = expand


# ---- slicing and joining ----------------------------------------------------------------------------------------------
def _slice_bounds(n: E.Expr, start: int | None, stop: int | None, step: int) -> tuple[E.Expr, E.Expr]:
    """(first index, length) of x[start:stop:step] along a dimension of size n."""
    if static(n) is not None:
        first, last, st = builtins.slice(start, stop, step).indices(static(n))
        return _i32(first), _i32(len(range(first, last, st)))
    if step < 0:
        raise UnsupportedError("slice: negative steps need a static dimension size")

    def bound(v: int | None, default: E.Expr) -> E.Expr:
        if v is None:
            return default
        return _max(_i32(0), n + v) if v < 0 else _min(_i32(v), n)

    first, last = bound(start, _i32(0)), bound(stop, n)
    length = _max(_i32(0), (last - first + (step - 1)) // step)
    return first, length


def slice(x: TensorNode, axis: int, start: int | None = None, stop: int | None = None, step: int = 1) -> Compute:  # noqa: A001
    """x[..., start:stop:step, ...] along `axis`, with Python's rules for negative and out-of-range bounds."""
    check_tensor(x, "slice")
    a = normalize_axis(axis, x.rank, "slice")
    for v, what in ((start, "start"), (stop, "stop")):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ArgumentError(f"slice: {what} must be an int or None, got {v!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step == 0:
        raise ArgumentError(f"slice: step must be a nonzero int, got {step!r}")
    first, length = _slice_bounds(x.shape[a], start, stop, step)
    if static(length) == 0:
        raise ArgumentError(f"slice: [{start}:{stop}:{step}] of axis {a} (size {x.shape[a]}) is empty; empty tensors are not supported")
    shape = list(x.shape)
    shape[a] = length

    def fn(*i: E.Var) -> E.Expr:
        idx = list(i)
        idx[a] = first + i[a] * step if step != 1 else first + i[a]
        return x[tuple(idx)]

    return compute(shape, fn, fresh_name("slice"), tag="slice")


def narrow(x: TensorNode, axis: int, start: int, length: int) -> Compute:
    """x[..., start:start+length, ...] along `axis` (torch.narrow)."""
    return slice(x, axis, start, start + length)


def concat(xs: Sequence[TensorNode], axis: int = 0) -> Compute:
    """Join tensors along `axis`; the other dimensions must match.  dtypes promote."""
    xs = list(xs)
    if not xs:
        raise ArgumentError("concat: needs at least one tensor")
    for k, t in enumerate(xs):
        check_tensor(t, "concat", f"tensor {k}")
    rank = xs[0].rank
    a = normalize_axis(axis, rank, "concat")
    for t in xs[1:]:
        if t.rank != rank or not all(same_dim(p, q) for k, (p, q) in enumerate(zip(t.shape, xs[0].shape)) if k != a):
            raise ArgumentError(f"concat: '{t.name}' has shape {dim_str(t.shape)}, which does not match "
                                f"{dim_str(xs[0].shape)} outside axis {a}")  # fmt: skip
    dt = xs[0].dtype
    for t in xs[1:]:
        dt = promote_types(dt, t.dtype, "concat")
    offsets = [_i32(0)]
    for t in xs:
        offsets.append(add_dims([offsets[-1], t.shape[a]]))
    shape = list(xs[0].shape)
    shape[a] = offsets[-1]

    def fn(*i: E.Var) -> E.Expr:
        def part(k: int) -> E.Expr:
            idx = list(i)
            idx[a] = i[a] - offsets[k] if static(offsets[k]) != 0 else i[a]
            v = xs[k][tuple(idx)]
            return v if v.dtype == dt else E.Cast(v, dt)

        out = part(len(xs) - 1)
        for k in range(len(xs) - 2, -1, -1):  # Select evaluates only the chosen side
            out = E.Select(i[a] < offsets[k + 1], part(k), out)
        return out

    return compute(shape, fn, fresh_name("concat"), dt, tag="concat")


def split(x: TensorNode, sizes: int | Sequence[int], axis: int = 0) -> list[Compute]:
    """Split along `axis` into pieces of the given sizes, or into pieces of `sizes` elements each
    (the last one shorter), like torch.split."""
    check_tensor(x, "split")
    a = normalize_axis(axis, x.rank, "split")
    n = static(x.shape[a])
    if isinstance(sizes, int):
        if n is None:
            raise UnsupportedError("split: splitting a symbolic dimension needs explicit sizes")
        if sizes <= 0:
            raise ArgumentError(f"split: the piece size must be positive, got {sizes}")
        sizes = [builtins.min(sizes, n - s) for s in range(0, n, sizes)]
    sizes = list(sizes)
    if any(s <= 0 for s in sizes):
        raise ArgumentError(f"split: sizes must be positive, got {sizes}")
    if n is not None and builtins.sum(sizes) != n:
        raise ArgumentError(f"split: sizes {sizes} add up to {builtins.sum(sizes)}, but axis {a} of '{x.name}' has size {n}")
    if n is None:
        raise UnsupportedError("split: splitting a symbolic dimension is not supported; slice it instead")
    out, start = [], 0
    for s in sizes:
        out.append(slice(x, a, start, start + s))
        start += s
    return out


def chunk(x: TensorNode, chunks: int, axis: int = 0) -> list[Compute]:
    """torch.chunk: `chunks` pieces of ceil(n / chunks) elements (fewer if they run out)."""
    n = static(x.shape[normalize_axis(axis, x.rank, "chunk")])
    if n is None:
        raise UnsupportedError("chunk: the axis must have a static size")
    return split(x, -(-n // chunks), axis)


def tile(x: TensorNode, repeats: Sequence[int]) -> Compute:
    """numpy.tile / torch.Tensor.repeat: x repeated `repeats[k]` times along axis k (leading
    axes are added when `repeats` is longer than x's rank)."""
    check_tensor(x, "tile")
    reps = [int(r) for r in repeats]
    if any(r < 1 for r in reps):
        raise ArgumentError(f"tile: repeats must be positive ints, got {list(repeats)}")
    rank = builtins.max(len(reps), x.rank)
    reps = [1] * (rank - len(reps)) + reps
    off = rank - x.rank
    src = [_i32(1)] * off + list(x.shape)
    shape = [d if r == 1 else mul_dims([d, _i32(r)]) for d, r in zip(src, reps)]

    def fn(*i: E.Var) -> E.Expr:
        return x[tuple(i[k + off] if reps[k + off] == 1 else i[k + off] % d for k, d in enumerate(x.shape))]

    return compute(shape, fn, fresh_name("tile"), x.dtype, tag="tile")


def flip(x: TensorNode, axes: int | Sequence[int]) -> Compute:
    """Reverse the order of elements along `axes`."""
    check_tensor(x, "flip")
    ax = normalize_axes(axes, x.rank, "flip")

    def fn(*i: E.Var) -> E.Expr:
        return x[tuple(x.shape[k] - 1 - v if k in ax else v for k, v in enumerate(i))]

    return compute(x.shape, fn, fresh_name("flip"), x.dtype, tag="flip")


def pad(x: TensorNode, pad_width: Sequence[tuple[int, int]], mode: str = "constant", value: float = 0.0) -> Compute:
    """Pad each dimension by (before, after) elements (numpy's pad_width, one pair per dimension).

    mode "constant" fills with `value`; "reflect" mirrors without repeating the edge;
    "replicate" (numpy "edge") repeats the edge element.
    """
    check_tensor(x, "pad")
    widths = [tuple(p) for p in pad_width]
    if len(widths) != x.rank or any(len(p) != 2 for p in widths):
        raise ArgumentError(f"pad: pad_width needs one (before, after) pair for each of the {x.rank} dims, got {list(pad_width)}")
    if any(not isinstance(v, int) or v < 0 for p in widths for v in p):
        raise ArgumentError(f"pad: widths must be non-negative ints, got {widths}")
    if mode not in ("constant", "reflect", "replicate", "edge"):
        raise ArgumentError(f"pad: mode must be 'constant', 'reflect' or 'replicate', got {mode!r}")
    if mode == "reflect":
        for d, (b, e) in zip(x.shape, widths):
            if static(d) is None and (b or e):
                raise UnsupportedError("pad: reflect padding needs static sizes on padded dims")
            if (b or e) and builtins.max(b, e) >= static(d):
                raise ArgumentError(f"pad: reflect padding {(b, e)} must be smaller than the dimension {static(d)}")
    shape = [add_dims([d, _i32(b + e)]) for d, (b, e) in zip(x.shape, widths)]
    fill = E.Const(value, x.dtype) if x.dtype.is_float or not isinstance(value, float) or value.is_integer() else None
    if mode == "constant" and fill is None:
        raise ArgumentError(f"pad: value {value} does not fit the integer dtype {x.dtype}")

    def fn(*i: E.Var) -> E.Expr:
        idx: list[E.Expr] = []
        inside: E.Expr | None = None
        for v, d, (b, _e) in zip(i, x.shape, widths):
            j = v - b if b else v
            if mode == "constant":
                if b or _e:
                    ok = E.Binary("&&", j >= 0, j < d)
                    inside = ok if inside is None else E.Binary("&&", inside, ok)
            elif mode == "reflect":
                j = E.Select(j < 0, -j, E.Select(j >= d, d * 2 - 2 - j, j))
            else:
                j = _min(_max(j, _i32(0)), d - 1)
            idx.append(j)
        if inside is None:
            return x[tuple(idx)]
        return E.Select(inside, x[tuple(idx)], fill)

    return compute(shape, fn, fresh_name("pad"), x.dtype, tag="pad")


# ---- gathers ------------------------------------------------------------------------------------------------------------
def _check_index(index: TensorNode, op: str) -> None:
    check_tensor(index, op, "index")
    if index.dtype not in (dtypes.int32, dtypes.int64):
        raise ArgumentError(f"{op}: index '{index.name}' must be int32 or int64, got {index.dtype}")


def safe_index(i: E.Expr, n: E.Expr) -> E.Expr:
    """An index value checked against a size n: negative ones count from the end; one outside
    [-n, n) makes a CPU kernel raise IndexOutOfRangeError after the call (as numpy and torch
    refuse it), while CUDA kernels, which cannot report, clamp it into [0, n) so that no read
    leaves the tensor."""
    i64 = i if i.dtype == dtypes.int64 else E.Cast(i, dtypes.int64)
    n64 = n if n.dtype == dtypes.int64 else E.Cast(n, dtypes.int64)
    return E.Cast(E.Call("checked_index", (i64, n64), dtypes.int64), dtypes.int32)


def take(x: TensorNode, indices: TensorNode, axis: int = 0) -> Compute:
    """numpy.take: out[a..., j..., b...] = x[a..., indices[j...], b...]."""
    check_tensor(x, "take")
    _check_index(indices, "take")
    a = normalize_axis(axis, x.rank, "take")
    shape = [*x.shape[:a], *indices.shape, *x.shape[a + 1:]]
    r = indices.rank

    def fn(*i: E.Var) -> E.Expr:
        j = safe_index(indices[tuple(i[a:a + r])], x.shape[a])
        return x[(*i[:a], j, *i[a + r:])]

    return compute(shape, fn, fresh_name("take"), tag="gather")


def index_select(x: TensorNode, axis: int, index: TensorNode) -> Compute:
    """torch.index_select: pick entries of a 1-D index along `axis`."""
    _check_index(index, "index_select")
    if index.rank != 1:
        raise ArgumentError(f"index_select: index must be 1-D, got shape {dim_str(index.shape)}")
    return take(x, index, axis)


def embedding(weight: TensorNode, ids: TensorNode) -> Compute:
    """Rows of `weight` [vocab, dim] for the token ids of any shape: result ids.shape + [dim]."""
    check_tensor(weight, "embedding", "weight")
    if weight.rank != 2:
        raise ArgumentError(f"embedding: weight must be 2-D [vocab, dim], got shape {dim_str(weight.shape)}")
    return take(weight, ids, 0)


def gather(x: TensorNode, axis: int, index: TensorNode) -> Compute:
    """torch.gather: out[i...] = x[i... with axis replaced by index[i...]]; out has index's shape."""
    check_tensor(x, "gather")
    _check_index(index, "gather")
    a = normalize_axis(axis, x.rank, "gather")
    if index.rank != x.rank:
        raise ArgumentError(f"gather: index must have the rank of x ({x.rank}), got {index.rank}")
    for k, (di, dx) in enumerate(zip(index.shape, x.shape)):
        if k != a and not same_dim(di, dx) and not (static(di) is not None and static(dx) is not None and static(di) <= static(dx)):
            raise ArgumentError(f"gather: index dimension {k} ({di}) must not exceed x's ({dx})")

    def fn(*i: E.Var) -> E.Expr:
        idx = list(i)
        idx[a] = safe_index(index[i], x.shape[a])
        return x[tuple(idx)]

    return compute(index.shape, fn, fresh_name("gather"), x.dtype, tag="gather")
