"""Conversion rules for shape manipulation, indexing, reductions and tensor creation."""

from __future__ import annotations

from typing import Any

import torch

from tessera.errors import UnsupportedError
from tessera.frontend.torch.convert import Converter, dtype_of, handles
from tessera.frontend.torch.handlers import _cast, _ints, _varargs, bind
from tessera.graph import Tensor
from tessera.graph.opdefs.shape import BIG
from tessera.graph.symbolic import Sym


def _reshape(cv: Converter, x: Tensor, sizes: list) -> Tensor:
    sizes = list(sizes)
    syms = [i for i, d in enumerate(sizes) if isinstance(d, Sym)]
    # One symbolic entry becomes -1: inferred at run time without needing its symbols bound.
    if len(syms) == 1 and -1 not in sizes:
        sizes[syms[0]] = -1
    if x.shape == tuple(sizes):
        return x
    return cv.op("reshape", x, shape=sizes)


@handles("method.view", "method.reshape")
def _view(cv, args, kwargs):
    if kwargs or (len(args) == 2 and isinstance(args[1], torch.dtype)):
        raise UnsupportedError("view as another dtype")
    return _reshape(cv, cv.tensor(args[0]), _varargs(args))


@handles("torch.reshape")
def _torch_reshape(cv, args, kwargs):
    a = bind(args, kwargs, "input, shape")
    return _reshape(cv, a["input"], _ints(a["shape"]))


@handles("torch.flatten", "method.flatten")
def _flatten(cv, args, kwargs):
    a = bind(args, kwargs, "input, start_dim=0, end_dim=-1")
    return cv.op("flatten", a["input"], start=int(a["start_dim"]), end=int(a["end_dim"]))


@handles("torch.transpose", "method.transpose", "torch.swapaxes", "method.swapaxes")
def _transpose(cv, args, kwargs):
    a = bind(args, kwargs, "input, dim0, dim1")
    x = a["input"]
    perm = list(range(x.ndim))
    d0, d1 = a["dim0"] % x.ndim, a["dim1"] % x.ndim
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return cv.op("permute", x, perm=perm)


@handles("method.t", "torch.t")
def _t(cv, args, kwargs):
    x = args[0]
    return x if x.ndim < 2 else cv.op("permute", x, perm=[1, 0])


@handles("method.permute", "torch.permute")
def _permute(cv, args, kwargs):
    dims = _ints(kwargs["dims"]) if "dims" in kwargs else _varargs(args)
    return cv.op("permute", args[0], perm=[int(d) for d in dims])


@handles("method.unsqueeze", "torch.unsqueeze")
def _unsqueeze(cv, args, kwargs):
    a = bind(args, kwargs, "input, dim")
    return cv.op("unsqueeze", a["input"], axes=[int(a["dim"])])


@handles("method.squeeze", "torch.squeeze")
def _squeeze(cv, args, kwargs):
    a = bind(args, kwargs, "input, dim=None")
    axes = None if a["dim"] is None else [int(d) for d in _ints(a["dim"])]
    return cv.op("squeeze", a["input"], axes=axes)


@handles("method.expand")
def _expand(cv, args, kwargs):
    x = cv.tensor(args[0])
    sizes = _varargs(args)
    if tuple(sizes) == x.shape:
        return x
    return cv.op("expand", x, shape=sizes)


@handles("method.expand_as")
def _expand_as(cv, args, kwargs):
    return cv.op("expand", cv.tensor(args[0]), shape=list(args[1].shape))


@handles("method.repeat")
def _repeat(cv, args, kwargs):
    return cv.op("tile", cv.tensor(args[0]), repeats=[int(r) for r in _varargs(args)])


@handles("torch.cat", "torch.concat", "torch.concatenate")
def _cat(cv, args, kwargs):
    a = bind(args, kwargs, "tensors, dim=0")
    ts = [cv.tensor(t) for t in a["tensors"]]
    dt = ts[0].dtype
    ts = [_cast(cv, t, dt) for t in ts]
    return cv.op("concat", *ts, axis=int(a["dim"])) if len(ts) > 1 else ts[0]


@handles("torch.stack")
def _stack(cv, args, kwargs):
    a = bind(args, kwargs, "tensors, dim=0")
    ts = [cv.op("unsqueeze", cv.tensor(t), axes=[int(a["dim"])]) for t in a["tensors"]]
    return cv.op("concat", *ts, axis=int(a["dim"])) if len(ts) > 1 else ts[0]


def _split_sizes(total, size_or_sections) -> list:
    if isinstance(size_or_sections, (list, tuple)):
        return list(size_or_sections)
    if not isinstance(total, int):
        raise UnsupportedError("split of a symbolic size into fixed chunks")
    n = int(size_or_sections)
    return [min(n, total - i) for i in range(0, total, n)]


@handles("torch.split", "method.split")
def _split(cv, args, kwargs):
    a = bind(args, kwargs, "input, split_size_or_sections, dim=0")
    x, dim = a["input"], int(a["dim"])
    sizes = _split_sizes(x.shape[dim], a["split_size_or_sections"])
    return tuple(cv.op_multi("split", x, axis=dim, sizes=sizes))


@handles("torch.chunk", "method.chunk")
def _chunk(cv, args, kwargs):
    a = bind(args, kwargs, "input, chunks, dim=0")
    x, dim = a["input"], int(a["dim"])
    total = x.shape[dim]
    if not isinstance(total, int):
        raise UnsupportedError("chunk of a symbolic size")
    per = -(-total // int(a["chunks"]))
    return tuple(cv.op_multi("split", x, axis=dim, sizes=_split_sizes(total, per)))


@handles("torch.unbind", "method.unbind")
def _unbind(cv, args, kwargs):
    a = bind(args, kwargs, "input, dim=0")
    x, dim = a["input"], int(a["dim"])
    if not isinstance(x.shape[dim], int):
        raise UnsupportedError("unbind of a symbolic size")
    parts = cv.op_multi("split", x, axis=dim, sizes=[1] * x.shape[dim])
    return tuple(cv.op("squeeze", p, axes=[dim]) for p in parts)


@handles("method.narrow", "torch.narrow")
def _narrow(cv, args, kwargs):
    a = bind(args, kwargs, "input, dim, start, length")
    s = a["start"]
    return cv.op("slice", a["input"], axes=[int(a["dim"])], starts=[s], ends=[s + a["length"]], steps=[1])


@handles("torch.tril", "method.tril", "torch.triu", "method.triu")
def _tri(cv, args, kwargs):
    a = bind(args, kwargs, "input, diagonal=0")
    kind = "tril" if cv.node.target in (torch.tril, "tril") else "triu"
    return cv.op(kind, a["input"], diagonal=int(a["diagonal"]))


@handles("torch.flip", "method.flip")
def _flip(cv, args, kwargs):
    a = bind(args, kwargs, "input, dims")
    return cv.op("flip", a["input"], axes=[int(d) for d in _ints(a["dims"])])


@handles("F.pad")
def _pad(cv, args, kwargs):
    a = bind(args, kwargs, "input, pad, mode='constant', value=None")
    if a["mode"] != "constant":
        raise UnsupportedError(f"pad mode {a['mode']!r}")
    x, p = a["input"], _ints(a["pad"])
    pads = [0] * (2 * x.ndim)
    for i in range(len(p) // 2):  # torch lists (before, after) pairs from the last axis backwards
        ax = x.ndim - 1 - i
        pads[2 * ax], pads[2 * ax + 1] = p[2 * i], p[2 * i + 1]
    return cv.op("pad", x, pads=pads, value=float(a["value"] or 0.0))


@handles("torch.index_select", "method.index_select")
def _index_select(cv, args, kwargs):
    a = bind(args, kwargs, "input, dim, index")
    return cv.op("take", a["input"], a["index"], axis=int(a["dim"]))


@handles("torch.gather", "method.gather")
def _gather(cv, args, kwargs):
    a = bind(args, kwargs, "input, dim, index, sparse_grad=False")
    return cv.op("gather_elements", a["input"], a["index"], axis=int(a["dim"]))


# ---- indexing --------------------------------------------------------------------------------
@handles("op.getitem")
def _getitem(cv, args, kwargs):
    base, index = args
    if isinstance(base, (tuple, list)):
        return base[index]
    x = cv.tensor(base)
    items = list(index) if isinstance(index, tuple) else [index]
    if sum(1 for i in items if i is Ellipsis) > 1:
        raise UnsupportedError("more than one Ellipsis")
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    if Ellipsis in items:
        e = items.index(Ellipsis)
        items[e : e + 1] = [slice(None)] * (x.ndim - consumed)
    items += [slice(None)] * (x.ndim - sum(1 for i in items if i is not None))
    tensors = [i for i in items if isinstance(i, Tensor)]
    if tensors:
        dims = [k for k, i in enumerate([i for i in items if i is not None]) if isinstance(i, Tensor)]
        plain = all(isinstance(i, slice) and i == slice(None) for i in items if not isinstance(i, Tensor))
        if len(tensors) == 1 and plain and None not in items and tensors[0].dtype.is_integer:
            return cv.op("take", x, tensors[0], axis=dims[0])
        raise UnsupportedError("advanced indexing with boolean masks or several index tensors")
    axes, starts, ends, steps, squeeze, unsq = [], [], [], [], [], []
    dim = out = 0
    for i in items:
        if i is None:
            unsq.append(out)
            out += 1
            continue
        if isinstance(i, slice):
            if i != slice(None):
                step = 1 if i.step is None else i.step
                if not isinstance(step, int) or step <= 0:
                    raise UnsupportedError("tensor slice with a non-positive step")
                axes.append(dim), starts.append(0 if i.start is None else i.start)
                ends.append(BIG if i.stop is None else i.stop), steps.append(step)
            out += 1
        elif isinstance(i, (int, Sym)):
            end = i + 1 if isinstance(i, int) and i != -1 else BIG
            axes.append(dim), starts.append(i), ends.append(end), steps.append(1)
            squeeze.append(dim)
        else:
            raise UnsupportedError(f"index of type {type(i).__name__}")
        dim += 1
    y = cv.op("slice", x, axes=axes, starts=starts, ends=ends, steps=steps) if axes else x
    if squeeze:
        y = cv.op("squeeze", y, axes=squeeze)
    if unsq:
        y = cv.op("unsqueeze", y, axes=unsq)
    return y


# ---- reductions -------------------------------------------------------------------------------
def _reduce(kind: str):
    def rule(cv, args, kwargs):
        a = bind(args, kwargs, "input, dim=None, keepdim=False, dtype=None")
        x = a["input"]
        if a["dtype"] is not None:
            x = _cast(cv, x, a["dtype"])
        axes = None if a["dim"] is None or a["dim"] == [] else [int(d) for d in _ints(a["dim"])]
        return cv.op(kind, x, axes=axes, keepdim=bool(a["keepdim"]))

    return rule


for _k, _kind in {"sum": "reduce_sum", "mean": "reduce_mean", "amax": "reduce_max", "amin": "reduce_min",
                  "prod": "reduce_prod"}.items():  # fmt: skip
    handles(f"torch.{_k}", f"method.{_k}")(_reduce(_kind))


def _max_min(kind: str):
    def rule(cv, args, kwargs):
        if len(args) >= 2 and isinstance(args[1], Tensor):
            return cv.op("maximum" if kind == "max" else "minimum", args[0], args[1])
        a = bind(args, kwargs, "input, dim=None, keepdim=False")
        x = a["input"]
        if a["dim"] is None:
            return cv.op(f"reduce_{kind}", x, axes=None, keepdim=False)
        d, k = int(a["dim"]), bool(a["keepdim"])
        values = cv.op(f"reduce_{kind}", x, axes=[d], keepdim=k)
        return (values, cv.op(f"arg{kind}", x, axis=d, keepdim=k))

    return rule


handles("torch.max", "method.max")(_max_min("max"))
handles("torch.min", "method.min")(_max_min("min"))


@handles("torch.argmax", "method.argmax", "torch.argmin", "method.argmin")
def _argmax(cv, args, kwargs):
    a = bind(args, kwargs, "input, dim=None, keepdim=False")
    kind = "argmax" if "max" in str(cv.node.target) else "argmin"
    x = a["input"]
    if a["dim"] is None:
        x = cv.op("reshape", x, shape=[-1])
        return cv.op(kind, x, axis=0, keepdim=False)
    return cv.op(kind, x, axis=int(a["dim"]), keepdim=bool(a["keepdim"]))


@handles("torch.cumsum", "method.cumsum")
def _cumsum(cv, args, kwargs):
    a = bind(args, kwargs, "input, dim, dtype=None")
    x = a["input"] if a["dtype"] is None else _cast(cv, a["input"], a["dtype"])
    return cv.op("cumsum", x, axis=int(a["dim"]))


# ---- creation ---------------------------------------------------------------------------------
def _dtype_name(dt: Any, default: str) -> str:
    return default if dt is None else dtype_of(dt).name


_CREATE_KW = ("dtype", "device", "layout", "requires_grad", "pin_memory", "memory_format")


def _creation_kwargs(kwargs: dict) -> Any:
    extra = set(kwargs) - set(_CREATE_KW)
    if extra:
        raise UnsupportedError(f"unsupported keyword arguments {sorted(extra)}")
    return kwargs.get("dtype")


@handles("torch.arange")
def _arange(cv, args, kwargs):
    dt = _creation_kwargs(kwargs)
    nums = list(args)
    start, end, step = (0, nums[0], 1) if len(nums) == 1 else (nums + [1])[:3]
    floating = any(isinstance(v, float) for v in (start, end, step))
    return cv.op("arange", start=start, end=end, step=step,
                 dtype=_dtype_name(dt, "float32" if floating else "int64"))  # fmt: skip


def _full(value_default):
    def rule(cv, args, kwargs):
        kwargs = dict(kwargs)
        if value_default is None:  # torch.full(size, fill_value)
            size = _ints(args[0] if args else kwargs.pop("size"))
            value = args[1] if len(args) > 1 else kwargs.pop("fill_value")
        else:  # torch.ones(*size) or torch.ones(size)
            size, value = _ints(list(args)) if args else _ints(kwargs.pop("size")), value_default
        dt = _creation_kwargs(kwargs)
        default = "bool" if isinstance(value, bool) else "float32" if isinstance(value, float) else "int64"
        return cv.op("full", shape=list(size), value=value, dtype=_dtype_name(dt, default))

    return rule


handles("torch.ones")(_full(1.0))
handles("torch.zeros")(_full(0.0))
handles("torch.full")(_full(None))


def _full_like(value_default):
    def rule(cv, args, kwargs):
        x = args[0]
        value = value_default if value_default is not None else (args[1] if len(args) > 1 else kwargs.pop("fill_value"))
        dt = _creation_kwargs(kwargs)
        return cv.op("full", shape=list(x.shape), value=value, dtype=_dtype_name(dt, x.dtype.name))

    return rule


handles("torch.ones_like")(_full_like(1.0))
handles("torch.zeros_like")(_full_like(0.0))
handles("torch.full_like")(_full_like(None))
