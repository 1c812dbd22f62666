"""Rules for ONNX's shape, data-movement and creation ops: constants, Shape/Size, Reshape,
Flatten, Transpose, Squeeze/Unsqueeze, Concat, Split, Slice, Expand, Tile, Pad, Gather*,
Scatter*, Range, ConstantOfShape, EyeLike, OneHot, Trilu, Identity/Dropout, and the ops
whose output shape depends on input values (NonZero, Unique, Compress), which are evaluated
at import time."""

from __future__ import annotations

import math

import numpy as np

from tessera.errors import UnsupportedError
from tessera.frontend.onnx.importer import ALL_ATTRS, ONNX_DTYPES, Known, rule
from tessera.graph import Tensor
from tessera.graph.opdefs.shape import BIG
from tessera.graph.symbolic import Sym, dim_mul
from tessera.ir.dtypes import numpy_dtype


@rule("Identity")
def _identity(im, node, args, attrs):
    return args[0]


@rule("Dropout", attrs=("seed", "ratio"))
def _dropout(im, node, args, attrs):
    """Inference: the input, and a mask of ones; training mode (a true training_mode input) is refused."""
    if len(args) > 2 and args[2] is not None:
        training = im.const_array(args[2], "Dropout training_mode")
        if training.item():
            raise UnsupportedError("training_mode=True (dropout in training mode) is not supported")
    x = im.tensor(args[0])
    if len(node.output) > 1 and node.output[1]:
        return x, im.op("full", shape=list(x.shape), value=True, dtype="bool")
    return x


# ---- constants and shapes -----------------------------------------------------------------------------------------
@rule("Constant", attrs=ALL_ATTRS)
def _constant(im, node, args, attrs):
    if "value" in attrs:
        return Tensor.constant(im.numpy_helper.to_array(attrs["value"]), name=node.output[0])
    for key, dt in (("value_float", np.float32), ("value_int", np.int64), ("value_floats", np.float32),
                    ("value_ints", np.int64)):  # fmt: skip
        if key in attrs:
            return Tensor.constant(np.asarray(attrs[key], dt), name=node.output[0])
    raise UnsupportedError(f"Constant with attribute(s) {sorted(attrs)} (strings or sparse tensors) is not supported")


@rule("Shape", attrs=("start", "end"))
def _shape(im, node, args, attrs):
    if isinstance(args[0], Known):  # the shape of a shape vector
        shape = [] if args[0].scalar else [len(args[0].values)]
    else:
        shape = list(im.tensor(args[0]).shape)
    start, end = attrs.get("start", 0), attrs.get("end", None)
    return Known(shape[start:end])


@rule("Size")
def _size(im, node, args, attrs):
    total = 1
    for d in im.tensor(args[0]).shape:
        total = dim_mul(total, d)
    return Known([total], scalar=True)


@rule("Reshape", attrs=("allowzero",))
def _reshape(im, node, args, attrs):
    target = im.ints(args[1], "Reshape shape")
    if isinstance(args[0], Known) and target in ([-1], [len(args[0].values)]):
        return Known(args[0].values)
    x = im.tensor(args[0])
    if not attrs.get("allowzero", 0):
        target = [x.shape[i] if isinstance(d, int) and d == 0 else d for i, d in enumerate(target)]
    syms = [i for i, d in enumerate(target) if isinstance(d, Sym)]
    if len(syms) == 1 and -1 not in target:
        target[syms[0]] = -1  # inferred at run time: no symbol needs binding
    return im.op("reshape", x, shape=target)


@rule("Flatten", attrs=("axis",))
def _flatten(im, node, args, attrs):
    x = im.tensor(args[0])
    axis = int(attrs.get("axis", 1))
    if not -x.ndim <= axis <= x.ndim:
        raise UnsupportedError(f"attribute axis={axis} is out of range for rank {x.ndim}")
    axis = axis + x.ndim if axis < 0 else axis
    if axis == 0:
        return im.op("reshape", x, shape=[1, -1])
    if axis == x.ndim:
        return im.op("unsqueeze", im.op("flatten", x, start=0, end=-1), axes=[1])
    return im.op("flatten", im.op("flatten", x, start=axis, end=-1), start=0, end=axis - 1)


@rule("Transpose", attrs=("perm",))
def _transpose(im, node, args, attrs):
    x = im.tensor(args[0])
    return im.op("permute", x, perm=list(attrs.get("perm", range(x.ndim - 1, -1, -1))))


@rule("Squeeze", "Unsqueeze", attrs=("axes",))
def _squeeze(im, node, args, attrs):
    axes = attrs.get("axes")
    if len(args) > 1 and args[1] is not None:
        axes = im.static_ints(args[1], "axes")
    k = args[0] if isinstance(args[0], Known) else None
    if k is not None and axes is not None and list(axes) in ([0], [-1]):
        if node.op_type == "Unsqueeze" and k.scalar:
            return Known(k.values)
        if node.op_type == "Squeeze" and not k.scalar and len(k.values) == 1:
            return Known(k.values, scalar=True)
    x = im.tensor(args[0])
    if node.op_type == "Unsqueeze":
        return im.op("unsqueeze", x, axes=[int(a) for a in axes])
    if axes is not None:
        bad = [a for a in axes if isinstance(x.shape[a % x.ndim], int) and x.shape[a % x.ndim] != 1]
        if bad:
            raise UnsupportedError(f"Squeeze of axes {bad} whose size is not 1 (shape {list(x.shape)})")
    return im.op("squeeze", x, axes=None if axes is None else [int(a) for a in axes])


@rule("Concat", attrs=("axis",))
def _concat(im, node, args, attrs):
    if all(im.known(a) is not None for a in args) and any(isinstance(a, Known) for a in args):
        return Known([v for a in args for v in im.known(a).values])
    ts = [im.tensor(a) for a in args]
    nonempty = [t for t in ts if not any(isinstance(d, int) and d == 0 for d in t.shape)]
    return im.op("concat", *(nonempty or ts[:1]), axis=int(attrs["axis"]))


@rule("Split", attrs=("axis", "split", "num_outputs"))
def _split(im, node, args, attrs):
    x = im.tensor(args[0])
    axis = int(attrs.get("axis", 0)) % x.ndim
    n = len(node.output)
    if len(args) > 1 and args[1] is not None:
        sizes = im.ints(args[1], "Split sizes")
    elif "split" in attrs:
        sizes = list(attrs["split"])
    else:
        total = x.shape[axis]
        if not isinstance(total, int):
            raise UnsupportedError("an even split of a symbolic size is not supported")
        parts = int(attrs.get("num_outputs", n))
        per = -(-total // parts)  # num_outputs (opset 18): the last chunk may be smaller
        sizes = [min(per, total - i * per) for i in range(parts)]
    if any(isinstance(v, int) and v == 0 for v in sizes):  # empty parts are constants: split the rest
        kept = [v for v in sizes if not (isinstance(v, int) and v == 0)]
        parts_out = iter(im.op_multi("split", x, axis=axis, sizes=kept) if len(kept) > 1 else [x] if kept else [])
        empty = np.empty([0 if i == axis else d for i, d in enumerate(x.shape)], numpy_dtype(x.dtype))
        return [Tensor.constant(empty) if isinstance(v, int) and v == 0 else next(parts_out) for v in sizes]
    return im.op_multi("split", x, axis=axis, sizes=sizes)


@rule("Slice")
def _slice(im, node, args, attrs):
    x = args[0]
    starts, ends = im.ints(args[1], "Slice starts"), im.ints(args[2], "Slice ends")
    rank = len(x.values) if isinstance(x, Known) else im.tensor(x).ndim
    axes = im.static_ints(args[3], "Slice axes") if len(args) > 3 and args[3] is not None else list(range(len(starts)))
    steps = im.static_ints(args[4], "Slice steps") if len(args) > 4 and args[4] is not None else [1] * len(starts)
    ends = [min(e, BIG) if isinstance(e, int) else e for e in ends]
    ends = [max(e, -BIG) if isinstance(e, int) else e for e in ends]
    starts = [min(max(s, -BIG), BIG) if isinstance(s, int) else s for s in starts]
    if isinstance(x, Known) and not x.scalar and all(isinstance(v, int) for v in starts + ends + steps):
        return Known(x.values[slice(starts[0], ends[0], steps[0])])
    return im.op("slice", x, axes=[int(a) % rank for a in axes], starts=starts, ends=ends, steps=steps)


@rule("Expand")
def _expand(im, node, args, attrs):
    x = im.tensor(args[0])
    shape = im.ints(args[1], "Expand shape")
    # ONNX Expand broadcasts both ways: a 1 in shape keeps the input's size.
    rank = max(len(shape), x.ndim)
    full = [1] * (rank - len(shape)) + list(shape)
    xs = [1] * (rank - x.ndim) + list(x.shape)
    target = [xd if isinstance(d, int) and d == 1 else d for d, xd in zip(full, xs)]
    return im.op("expand", x, shape=target)


@rule("Tile")
def _tile(im, node, args, attrs):
    return im.op("tile", args[0], repeats=im.static_ints(args[1], "Tile repeats"))


@rule("Pad", attrs=("mode", "pads", "value"))
def _pad(im, node, args, attrs):
    x = im.tensor(args[0])
    mode = attrs.get("mode", b"constant").decode()
    p = im.static_ints(args[1], "Pad pads") if len(args) > 1 and args[1] is not None else list(attrs.get("pads", []))
    if len(args) > 2 and args[2] is not None and im.tensor(args[2]).ndim <= 1 and im.tensor(args[2]).numel != 0:
        value = im.const_array(args[2], "Pad constant_value").reshape(-1)[0].item()
    else:
        value = attrs.get("value", 0.0)
    axes = im.static_ints(args[3], "Pad axes") if len(args) > 3 and args[3] is not None else list(range(x.ndim))
    pads = [0] * (2 * x.ndim)
    n = len(axes)
    for i, ax in enumerate(axes):  # ONNX lists all begins, then all ends
        pads[2 * (ax % x.ndim)], pads[2 * (ax % x.ndim) + 1] = p[i], p[n + i]
    if mode == "constant":
        return im.op("pad", x, pads=pads, value=float(value) if x.dtype.is_float else int(value))
    if mode not in ("edge", "reflect", "wrap"):
        raise UnsupportedError(f"attribute mode={mode!r} is not supported")
    for ax in range(x.ndim):
        x = _pad_axis(im, x, ax, pads[2 * ax], pads[2 * ax + 1], mode)
    return x


def _pad_axis(im, x: Tensor, axis: int, before: int, after: int, mode: str) -> Tensor:
    """Edge/reflect/wrap padding of one axis: a gather of source positions (negative pads crop)."""
    n = x.shape[axis]
    if not isinstance(n, int):
        raise UnsupportedError(f"{mode} padding of a symbolic size")
    if before == 0 and after == 0:
        return x
    if n == 0:
        raise UnsupportedError(f"{mode} padding of an empty axis")
    src = np.arange(-before, n + after, dtype=np.int64)
    if mode == "edge" or (mode == "reflect" and n == 1):
        src = np.clip(src, 0, n - 1)
    elif mode == "wrap":
        src = src % n
    else:  # reflect: mirrored without repeating the edge, period 2(n-1) (numpy.pad's rule)
        src = src % (2 * (n - 1))
        src = np.where(src < n, src, 2 * (n - 1) - src)
    return im.op("take", x, Tensor.constant(src), axis=axis)


# ---- gathers and scatters ----------------------------------------------------------------------------------------
@rule("Gather", attrs=("axis",))
def _gather(im, node, args, attrs):
    data, idx = args
    axis = int(attrs.get("axis", 0))
    ki = im.known(idx)
    if isinstance(data, Known) and ki is not None and axis == 0:
        picked = [data.values[int(i)] for i in ki.values]
        return Known(picked, scalar=ki.scalar)
    return im.op("take", data, idx, axis=axis)


@rule("GatherElements", attrs=("axis",))
def _gather_elements(im, node, args, attrs):
    data, idx = im.tensor(args[0]), im.tensor(args[1])
    axis = int(attrs.get("axis", 0)) % data.ndim
    # ONNX allows negative indices (counting from the end); the graph op reads them as numpy does.
    idx = im.op("where", im.op("lt", idx, im.scalar(0, idx)), im.op("add", idx, im.scalar(data.shape[axis], idx)), idx) \
        if isinstance(data.shape[axis], int) else idx  # fmt: skip
    return im.op("gather_elements", data, idx, axis=axis)


@rule("GatherND", attrs=("batch_dims",))
def _gather_nd(im, node, args, attrs):
    return im.op("gather_nd", args[0], args[1], batch_dims=int(attrs.get("batch_dims", 0)))


@rule("ScatterElements", "Scatter", attrs=("axis", "reduction"))
def _scatter_elements(im, node, args, attrs):
    data = im.tensor(args[0])
    return im.op("scatter_elements", data, args[1], args[2], axis=int(attrs.get("axis", 0)) % data.ndim,
                 reduction=attrs.get("reduction", b"none").decode())  # fmt: skip


@rule("ScatterND", attrs=("reduction",))
def _scatter_nd(im, node, args, attrs):
    return im.op("scatter_nd", args[0], args[1], args[2], reduction=attrs.get("reduction", b"none").decode())


# ---- creation -------------------------------------------------------------------------------------------------------
@rule("ConstantOfShape", attrs=("value",))
def _constant_of_shape(im, node, args, attrs):
    shape = im.ints(args[0], "ConstantOfShape shape")
    value = im.numpy_helper.to_array(attrs["value"]) if "value" in attrs else np.zeros(1, np.float32)
    return im.op("full", shape=shape, value=value.reshape(-1)[0].item(), dtype=Tensor.constant(value).dtype.name)


@rule("Range")
def _range(im, node, args, attrs):
    vals = []
    for a, what in zip(args, ("start", "limit", "delta")):
        k = im.known(a)
        vals.append(k.values[0] if k is not None else im.const_array(a, f"Range {what}").item())
    dtype = im.tensor(args[0]).dtype.name if isinstance(args[0], Tensor) else "int64"
    start, limit, delta = vals
    if isinstance(limit, Sym) or isinstance(start, Sym):
        return im.op("arange", start=start, end=limit, step=delta, dtype=dtype)
    n = max(0, math.ceil((limit - start) / delta))
    if dtype.startswith(("int", "uint")):  # integer ranges: exact
        return Tensor.constant(np.arange(n, dtype=np.int64) * delta + start, dtype) if n <= 1 << 16 else \
            im.op("arange", start=start, end=start + n * delta, step=delta, dtype=dtype)  # fmt: skip
    # floats: ONNX defines element i as start + i * delta (in the input type), not numpy's accumulation
    seq = im.op("arange", start=0, end=n, step=1, dtype=dtype)
    return im.op("add", im.op("mul", seq, im.tensor(args[2])), im.tensor(args[0]))


@rule("EyeLike", attrs=("dtype", "k"))
def _eye_like(im, node, args, attrs):
    x = im.tensor(args[0])
    dt = ONNX_DTYPES[attrs["dtype"]] if "dtype" in attrs else x.dtype.name
    if not x.is_static:
        raise UnsupportedError("EyeLike of a symbolic shape is not supported")
    return Tensor.constant(np.eye(x.shape[0], x.shape[1], k=int(attrs.get("k", 0))), dt)


@rule("OneHot", attrs=("axis",))
def _one_hot(im, node, args, attrs):
    idx, values = im.tensor(args[0]), im.tensor(args[2])
    (depth,) = [int(v) for v in im.const_array(args[1], "OneHot depth").reshape(-1)[:1]]
    axis = int(attrs.get("axis", -1))
    axis = axis + idx.ndim + 1 if axis < 0 else axis
    if not idx.dtype.is_integer:
        idx = im.op("cast", idx, dtype="int64")
    idx = im.op("cast", idx, dtype="int64")
    wrapped = im.op("where", im.op("lt", idx, im.scalar(0, idx)), im.op("add", idx, im.scalar(depth, idx)), idx)
    pos = im.op("reshape", im.op("arange", start=0, end=depth, step=1, dtype="int64"),
                shape=[depth if i == axis else 1 for i in range(idx.ndim + 1)])  # fmt: skip
    hit = im.op("eq", im.op("unsqueeze", wrapped, axes=[axis]), pos)
    off = im.op("slice", values, axes=[0], starts=[0], ends=[1], steps=[1])
    on = im.op("slice", values, axes=[0], starts=[1], ends=[2], steps=[1])
    return im.op("where", hit, im.op("reshape", on, shape=[]), im.op("reshape", off, shape=[]))


@rule("Trilu", attrs=("upper",))
def _trilu(im, node, args, attrs):
    k = im.static_ints(args[1], "Trilu k")[0] if len(args) > 1 and args[1] is not None else 0
    return im.op("triu" if attrs.get("upper", 1) else "tril", args[0], diagonal=int(k))


# ---- value-dependent shapes: evaluated at import time (the compiled model specialises on them) --------------------
@rule("NonZero")
def _nonzero(im, node, args, attrs):
    x = im.const_array(args[0], "NonZero's input (its output shape depends on its values)")
    return Tensor.constant(np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1))


@rule("Compress", attrs=("axis",))
def _compress(im, node, args, attrs):
    cond = im.const_array(args[1], "Compress condition (the output shape depends on its values)").astype(bool)
    x = im.tensor(args[0])
    axis = attrs.get("axis")
    if axis is None:
        x, axis = im.op("reshape", x, shape=[-1]), 0
    axis = int(axis) % x.ndim
    picked = np.nonzero(cond[: x.shape[axis]])[0].astype(np.int64)
    return im.op("take", x, Tensor.constant(picked), axis=axis)


@rule("Unique", attrs=("axis", "sorted"))
def _unique(im, node, args, attrs):
    x = im.const_array(args[0], "Unique's input (its output shape depends on its values)")
    axis = attrs.get("axis")
    _, first, inverse, counts = np.unique(x, return_index=True, return_inverse=True, return_counts=True, axis=axis)
    if not attrs.get("sorted", 1):  # in order of first occurrence
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        first, counts, inverse = first[order], counts[order], rank[inverse.reshape(-1)]
    y = np.take(x.reshape(-1) if axis is None else x, first, axis=0 if axis is None else axis)
    return [Tensor.constant(np.ascontiguousarray(y)), Tensor.constant(first.astype(np.int64)),
            Tensor.constant(inverse.reshape(-1).astype(np.int64)), Tensor.constant(counts.astype(np.int64))]  # fmt: skip


# ---- blocks between space and depth --------------------------------------------------------------------------------
@rule("DepthToSpace", attrs=("blocksize", "mode"))
def _depth_to_space(im, node, args, attrs):
    x = im.tensor(args[0])
    b = int(attrs["blocksize"])
    n, c, h, w = x.shape
    if attrs.get("mode", b"DCR") == b"CRD":
        y = im.op("reshape", x, shape=[n, c // (b * b), b, b, h, w])
        y = im.op("permute", y, perm=[0, 1, 4, 2, 5, 3])
    else:
        y = im.op("reshape", x, shape=[n, b, b, c // (b * b), h, w])
        y = im.op("permute", y, perm=[0, 3, 4, 1, 5, 2])
    return im.op("reshape", y, shape=[n, c // (b * b), h * b, w * b])


@rule("SpaceToDepth", attrs=("blocksize",))
def _space_to_depth(im, node, args, attrs):
    x = im.tensor(args[0])
    b = int(attrs["blocksize"])
    n, c, h, w = x.shape
    y = im.op("reshape", x, shape=[n, c, h // b, b, w // b, b])
    y = im.op("permute", y, perm=[0, 3, 5, 1, 2, 4])
    return im.op("reshape", y, shape=[n, c * b * b, h // b, w // b])


@rule("ReverseSequence", attrs=("batch_axis", "time_axis"))
def _reverse_sequence(im, node, args, attrs):
    """x[t, b] = x[lens[b] - 1 - t, b] for t < lens[b]: a gather along the time axis."""
    x, lens = im.tensor(args[0]), im.tensor(args[1])
    bax, tax = int(attrs.get("batch_axis", 1)), int(attrs.get("time_axis", 0))
    steps = x.shape[tax]
    t = im.op("reshape", im.op("arange", start=0, end=steps, step=1, dtype="int64"),
              shape=[steps if i == tax else 1 for i in range(x.ndim)])  # fmt: skip
    n = im.op("reshape", im.op("cast", lens, dtype="int64"), shape=[-1 if i == bax else 1 for i in range(x.ndim)])
    src = im.op("where", im.op("lt", t, n), im.op("sub", im.op("sub", n, im.scalar(1, n)), t), t)
    src = im.op("expand", src, shape=list(x.shape))
    return im.op("gather_elements", x, src, axis=tax)
