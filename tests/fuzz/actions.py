"""The operators the fuzzer draws: one action per family, each picking operands from the pool
(or fresh inputs), attributes, and the value rule of its results (see generate.py)."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

from tessera.graph.symbolic import parse_dim

from .actions_nn import attention, conv_pool, matmul, projections, refused
from .generate import (
    ARITH,
    BIG,
    COMPARE,
    EPS,
    LOGICAL,
    REDUCE,
    UNARY_FLOAT,
    Gen,
    TInfo,
    _convert_err,
    _round,
    arith_values,
    as_attr_dim,
    reduce_values,
    sym_name,
    unary_values,
)


def _numeric(t: TInfo) -> bool:
    return t.dtype != "bool"


def _n_over(t: TInfo, axes: list[int]) -> int:
    """The largest number of elements a reduction over axes folds, over the runs."""
    return max(math.prod(s[a] for a in axes) if axes else 1 for s in t.shapes)


# ---- elementwise ---------------------------------------------------------------------------------------------------
def unary_float(g: Gen) -> None:
    kind = g.pick(list(UNARY_FLOAT) + ["reciprocal", "gelu", "leaky_relu", "elu"])
    float_only = kind in ("gelu", "leaky_relu", "elu")
    a = g.operand(lambda t: t.is_float or (not float_only and g.chance(20)))
    if a is None:
        return
    attrs: dict[str, Any] = {}
    if kind == "gelu":
        attrs["approximate"] = g.pick(["none", "tanh"])
    elif kind == "leaky_relu":
        attrs["negative_slope"] = g.pick([0.01, 0.2])
    elif kind == "elu":
        attrs["alpha"] = g.pick([1.0, 0.5])
    g.apply(kind, [a], attrs, lambda o: unary_values(kind, a, o, attrs))


def unary_same(g: Gen) -> None:
    kind = g.pick(["neg", "abs", "relu", "sign", "floor", "ceil", "round", "identity", "logical_not", "isnan"])
    a = g.operand(lambda t: t.exact if kind in ("sign", "floor", "ceil", "round", "logical_not", "isnan") else True)
    if a is None or (a.dtype == "bool" and kind in ("neg", "abs", "relu", "sign") and not g.chance(10)):
        return

    def values(o: TInfo):
        if kind == "neg":
            return -a.hi, -a.lo, a.small, a.err
        if kind == "abs":
            return (a.small if a.lo >= 0 or a.hi <= 0 or a.small else 0.0), a.mag, a.small, a.err
        if kind == "relu":
            return max(a.lo, 0), max(a.hi, 0), (a.small if a.lo > 0 else 0), a.err
        if kind == "sign":
            return -1, 1, (1 if a.small > 0 else 0), 0
        if kind in ("floor", "ceil", "round"):
            return math.floor(a.lo) - 1, math.ceil(a.hi) + 1, 0, 0
        if kind in ("logical_not", "isnan"):
            return 0, 1, 0, 0
        return a.lo, a.hi, a.small, a.err

    g.apply(kind, [a], {}, values)


def clamp(g: Gen) -> None:
    a = g.operand(_numeric)
    if a is None:
        return
    big = a.dtype == "int64"  # bounds out of the dtype's range are another matter (not fuzzed)
    lo = g.pick([None, -1, 0.5, -0.25, 0.1] if a.is_float else [None, -3, 2] + [-(2**35)] * big)
    hi = g.pick([None, 1.5, 0.75, 1 / 3] if a.is_float else [None, 4, 7] + [2**36] * big)
    if a.dtype == "uint8":
        lo, hi = (None if lo is None else abs(lo)), (None if hi is None else abs(hi))
    attrs = {"min": lo, "max": hi}

    def values(o: TInfo):
        vl = a.lo if lo is None else max(a.lo, lo)
        vh = a.hi if hi is None else min(a.hi, hi)
        vl, vh = min(vl, vh), max(vl, vh)
        return vl, vh, 0.0, a.err

    g.apply("clamp", [a], attrs, values)


def cast(g: Gen) -> None:
    a = g.operand()
    if a is None:
        return
    dst = g.input_dtype()
    if dst == a.dtype:
        return
    to_exact = dst not in EPS
    if to_exact and a.is_float and (not a.exact or (a.nan and dst != "bool")):
        return  # a value near an integer (or 0) could convert differently; NaN to an integer is undefined

    def values(o: TInfo):
        if dst == "bool":
            return 0, 1, 0, 0
        if to_exact and a.is_float:
            return math.floor(a.lo) - 1, math.ceil(a.hi) + 1, 0, 0
        return a.lo, a.hi, a.small, _convert_err(a.err, a.mag, a.dtype, dst)

    g.apply("cast", [a], {"dtype": dst}, values)


def arith(g: Gen) -> None:
    kind = g.pick(ARITH)
    rounding = g.pick([None, "floor", "trunc"]) if kind == "div" else None
    if kind in ("bitwise_and", "bitwise_or"):
        a = g.operand(lambda t: not t.is_float)
    elif kind == "pow":
        a = g.operand(lambda t: t.is_float and t.lo >= 0.2)
    elif kind in ("remainder",) or rounding:
        a = g.operand(lambda t: t.exact and _numeric(t))
    else:
        a = g.operand(_numeric)
    if a is None:
        return
    dtype = a.dtype if g.chance(75) else g.input_dtype("f" if a.is_float else "fi")
    domain = None
    if kind in ("div", "remainder"):
        domain = g.domain(dtype, g.pick(["any", "positive"]))
        if domain == "int_large":
            domain = "int"
    elif kind == "pow":
        dtype, domain = "float32" if a.dtype == "float32" else a.dtype, "signed"
    elif kind.startswith("bitwise"):
        dtype = a.dtype
    b = g.binary_partner(a, dtype, domain)
    if b is None:
        return
    attrs = {"rounding": rounding} if kind == "div" else {}
    operands = [a, b] if g.chance(75) or kind in ("div", "pow", "remainder", "sub") else [b, a]
    g.apply(kind, operands, attrs, lambda o: arith_values(kind, operands[0], operands[1], o, rounding))


def compare(g: Gen) -> None:
    kind = g.pick(COMPARE + LOGICAL)
    a = g.operand(lambda t: t.exact)
    if a is None:
        return
    dtype = a.dtype if g.chance(70) else g.input_dtype()
    b = g.binary_partner(a, dtype, None)
    if b is None or not b.exact:
        return
    g.apply(kind, [a, b], {}, lambda o: (0, 1, 0, 0))


def where(g: Gen) -> None:
    c = g.operand(lambda t: t.exact and (t.dtype == "bool" or g.chance(20)))
    if c is None:
        return
    a = g.operand(lambda t: t is not c)
    if a is None:
        return
    b = g.binary_partner(a, a.dtype if g.chance(70) else g.input_dtype(), None)
    if b is None:
        return
    order = [c, a, b] if g.chance(50) else [c, b, a]
    g.apply("where", order, {}, lambda o: _select_values(order[1], order[2], o))


def _select_values(x: TInfo, y: TInfo, o: TInfo):
    err = max(_convert_err(x.err, x.mag, x.dtype, o.dtype), _convert_err(y.err, y.mag, y.dtype, o.dtype))
    return min(x.lo, y.lo), max(x.hi, y.hi), min(x.small, y.small), err


def select_over_compare(g: Gen) -> None:
    """A select over a fresh comparison, as models write masks: `where(x < c, x * s, x)`, masked
    fills (one arm a scalar constant), integer conditions.  gcc 12 once miscompiled these
    (docs/cpu_codegen.md)."""
    if g.chance(60):  # short odd inner loops under an outer one: where gcc went wrong
        shape = [g.pick([2, 3, 4, 6]) for _ in range(g.int(0, 2))] + [g.pick([3, 5, 7, 9, 13])]
        dtype = g.input_dtype("fi")
        x = g.fresh(shape, dtype, g.domain(dtype))
    else:
        x = g.operand(lambda t: t.exact and _numeric(t))
    if x is None:
        return
    scalar = g.chance(50)
    c = g.new_input([], x.dtype, g.domain(x.dtype), constant=True) if scalar else g.binary_partner(x, x.dtype, None)
    if c is None or not c.exact:
        return
    cond = g.apply(g.pick(COMPARE), [x, c] if g.chance(70) else [c, x], {}, lambda o: (0, 1, 0, 0))
    if not cond:
        return
    # An arm read from another tensor than the condition's (`where(x > c, s, c)`), or the product
    # `x * s` (`where(x < 0, x * s, x)`): gcc masked the reads only one arm makes.
    arm = g.binary_partner(x, x.dtype, None) if g.chance(75) else x
    if arm is None:
        return
    if x.is_float and arm is not x and g.chance(40):
        s = arm
        product = g.apply("mul", [x, s], {}, lambda o: arith_values("mul", x, s, o, None))
        if not product:
            return
        arm = product[0]
    other = x if g.chance(50) else g.new_input([], x.dtype, g.domain(x.dtype), constant=True)
    if other is None:
        return
    order = [cond[0], arm, other] if g.chance(50) else [cond[0], other, arm]
    g.apply("where", order, {}, lambda o: _select_values(order[1], order[2], o))


# ---- reductions ------------------------------------------------------------------------------------------------------
def _axes(g: Gen, rank: int) -> list[int] | None:
    if rank == 0 or g.chance(15):
        return None
    axes = sorted({g.int(0, rank - 1) for _ in range(g.int(1, rank))})
    return [a - rank if g.chance(30) else a for a in axes]


def reduce(g: Gen) -> None:
    kind = g.pick(REDUCE)
    a = g.operand(lambda t: kind in ("reduce_max", "reduce_min") or _numeric(t) or g.chance(20))
    if a is None:
        return
    axes = _axes(g, a.tensor.ndim)
    attrs = {"axes": axes, "keepdim": g.chance(40)}
    folded = list(range(a.tensor.ndim)) if axes is None else [x % a.tensor.ndim for x in axes]
    n = _n_over(a, folded)
    g.apply(kind, [a], attrs, lambda o: reduce_values(kind, a, o, n))


def arg_reduce(g: Gen) -> None:
    a = g.operand(lambda t: t.exact and t.tensor.ndim > 0 and _numeric(t))
    if a is None:
        return
    rank = a.tensor.ndim
    axis = g.int(-rank, rank - 1)
    attrs = {"axis": axis, "keepdim": g.chance(40)}
    g.apply(g.pick(["argmax", "argmin"]), [a], attrs, lambda o: (0, a.max_dim(axis), 0, 0))


def cumsum(g: Gen) -> None:
    a = g.operand(lambda t: t.tensor.ndim > 0 and _numeric(t))
    if a is None:
        return
    rank = a.tensor.ndim
    axis = g.int(-rank, rank - 1)
    attrs = {"axis": axis, "exclusive": g.chance(30), "reverse": g.chance(30)}
    n = a.max_dim(axis)
    g.apply("cumsum", [a], attrs, lambda o: reduce_values("cumsum", a, o, n))


def softmax(g: Gen) -> None:
    a = g.operand(lambda t: t.is_float and t.tensor.ndim > 0)
    if a is None:
        return
    rank = a.tensor.ndim
    axis = g.int(-rank, rank - 1)
    kind = g.pick(["softmax", "log_softmax"])
    n = a.max_dim(axis)
    width = a.hi - a.lo

    def values(o: TInfo):
        acc = 4 * n * EPS["float32"]
        if kind == "softmax":
            return 0.0, 1.0, 0.0, 2 * a.err + acc + _round(o.dtype, 1.0, 4)
        lo = -width - math.log(n) - 1
        return lo, 0.0, 0.0, 2 * a.err + acc * (1 + abs(lo)) + _round(o.dtype, abs(lo), 4)

    g.apply(kind, [a], {"axis": axis}, values)


def norm(g: Gen) -> None:
    a = g.operand(lambda t: t.is_float and t.tensor.ndim > 0)
    if a is None:
        return
    kind = g.pick(["layer_norm", "rms_norm"])
    k = 1 if a.tensor.ndim == 1 or g.chance(70) else 2
    eps = g.pick([0.1, 0.5])
    inner = list(a.tensor.shape[-k:])
    params: list[TInfo] = []
    for _ in range(g.int(0, 2 if kind == "layer_norm" else 1)):
        dims = [d if isinstance(d, int) else sym_name(d) for d in inner]
        if any(d is None for d in dims):
            break
        p = g.fresh(dims, a.dtype, "signed")
        if p is None:
            return
        params.append(p)
    n = max(math.prod(s[-k:]) for s in a.shapes)
    wmag = params[0].mag if params else 1.0
    bmag = params[1].mag if len(params) > 1 else 0.0

    def values(o: TInfo):
        amp = 1 / math.sqrt(eps)  # 1/sqrt(var + eps) <= this
        dev = 2 * a.mag  # |x - mean|
        stat_err = 2 * a.err + 4 * n * EPS["float32"] * a.mag  # error of x - mean and of the statistics
        err = wmag * (amp * stat_err + dev * 0.5 * amp**3 * (2 * dev * stat_err + 2 * n * EPS["float32"] * dev**2))
        m = min(math.sqrt(n), dev * amp) * wmag + bmag
        return -m, m, 0.0, err + _round(o.dtype, m, 8)

    g.apply(kind, [a, *params], {"num_axes": k, "eps": eps}, values)


# ---- data movement ---------------------------------------------------------------------------------------------------
def _same(a: TInfo):
    return lambda o: (a.lo, a.hi, a.small, a.err)


def reshape(g: Gen) -> None:
    a = g.operand(lambda t: all(as_attr_dim(d) is not None for d in t.tensor.shape))
    if a is None:
        return
    target: list[Any] = []
    rest = math.prod(d for d in a.tensor.shape if isinstance(d, int))
    while rest > 1 and g.chance(60):
        divisors = [p for p in (2, 3, 4, 5, 6) if rest % p == 0 and p < rest]
        if not divisors:
            break
        target.append(g.pick(divisors))
        rest //= target[-1]
    if rest > 1:
        target.append(rest)
    for d in a.tensor.shape:
        if not isinstance(d, int):
            target.insert(g.int(0, len(target)), as_attr_dim(d))
    if g.chance(30):
        target.insert(g.int(0, len(target)), 1)
    if target and g.chance(30):
        target[g.int(0, len(target) - 1)] = -1
    g.apply("reshape", [a], {"shape": target}, _same(a))


def flatten(g: Gen) -> None:
    a = g.operand()
    if a is None:
        return
    rank = max(a.tensor.ndim, 1)
    s = g.int(-rank, rank - 1)
    e = g.int(s % rank, rank - 1)
    g.apply("flatten", [a], {"start": s, "end": e if g.chance(60) else e - rank}, _same(a))


def permute(g: Gen) -> None:
    a = g.operand(lambda t: t.tensor.ndim >= 2)
    if a is None:
        return
    perm = list(g.draw(st.permutations(list(range(a.tensor.ndim)))))
    g.apply("permute", [a], {"perm": perm}, _same(a))


def squeeze_unsqueeze(g: Gen) -> None:
    a = g.operand()
    if a is None:
        return
    rank = a.tensor.ndim
    if g.chance(50) and rank > 0:
        static = [k for k, d in enumerate(a.tensor.shape) if isinstance(d, int)]
        if not static:
            return
        if len(static) == rank and g.chance(30):
            axes = None  # every size-1 axis
        else:
            axes = sorted({g.pick(static) for _ in range(g.int(1, len(static)))})
        g.apply("squeeze", [a], {"axes": axes}, _same(a))
    else:
        n = g.int(1, 2)
        axes = sorted({g.int(0, rank + n - 1) for _ in range(n)})
        g.apply("unsqueeze", [a], {"axes": [x - (rank + len(axes)) if g.chance(30) else x for x in axes]}, _same(a))


def expand(g: Gen) -> None:
    a = g.operand()
    if a is None:
        return
    target: list[Any] = []
    for d in a.tensor.shape:
        if d == 1 and g.chance(70):
            target.append(g.pick([3, 2, *g.bound_symbols]))
        else:
            target.append(-1 if g.chance(50) else as_attr_dim(d))
    if any(d is None for d in target):
        return
    if g.chance(40):
        target.insert(0, g.pick([2, 3]))
    target = [parse_dim(d) if isinstance(d, str) else d for d in target]
    g.apply("expand", [a], {"shape": target}, _same(a))


def tile_flip_tri(g: Gen) -> None:
    a = g.operand(lambda t: t.tensor.ndim >= 1)
    if a is None:
        return
    rank = a.tensor.ndim
    kind = g.pick(["tile", "flip", "tril", "triu"])
    if kind == "tile":
        attrs: dict[str, Any] = {"repeats": [g.pick([1, 2, 3]) for _ in range(g.int(1, rank + 1))]}
    elif kind == "flip":
        attrs = {"axes": sorted({g.int(-rank, rank - 1) % rank for _ in range(g.int(1, rank))})}
    else:
        if rank < 2:
            return
        attrs = {"diagonal": g.int(-2, 2)}

    def values(o: TInfo):
        if kind in ("tril", "triu"):
            return min(a.lo, 0), max(a.hi, 0), 0, a.err
        return a.lo, a.hi, a.small, a.err

    g.apply(kind, [a], attrs, values)


def slice_(g: Gen) -> None:
    a = g.operand(lambda t: t.tensor.ndim >= 1)
    if a is None:
        return
    rank = a.tensor.ndim
    axes = sorted({g.int(0, rank - 1) for _ in range(g.int(1, rank))})
    starts, ends, steps = [], [], []
    for ax in axes:
        symbolic = not isinstance(a.tensor.shape[ax], int)
        step = g.pick([1, 2, 3] if symbolic else [1, 2, -1, 3, -2])
        starts.append(g.pick([0, 1, -1, -2, 2] if step > 0 else [-1, BIG, 2, -2]))
        ends.append(g.pick([BIG, -1, 2, 3, -BIG] if step > 0 else [-BIG, 0, -3, 1]))
        steps.append(step)
    ax_out = [x - rank if g.chance(30) else x for x in axes]
    attrs = {"axes": ax_out, "starts": starts, "ends": ends, "steps": steps if any(s != 1 for s in steps) or g.chance(50) else None}
    g.apply("slice", [a], attrs, lambda o: (min(a.lo, a.hi), a.hi, a.small, a.err))


def concat(g: Gen) -> None:
    a = g.operand(lambda t: t.tensor.ndim >= 1)
    if a is None:
        return
    rank = a.tensor.ndim
    axis = g.int(-rank, rank - 1)
    parts = [a]
    for _ in range(g.int(1, 2)):
        same = [t for t in g.pool if t is not a and t.tensor.ndim == rank and all(
            k == axis % rank or t.tensor.shape[k] == a.tensor.shape[k] for k in range(rank))]  # fmt: skip
        if same and g.chance(40):
            parts.append(g.pick(same[-4:]))
            continue
        shape = [d if isinstance(d, int) else sym_name(d) for d in a.tensor.shape]
        if any(d is None for d in shape):
            return
        shape[axis % rank] = g.pick([1, 2, 3] + list(g.symbols))
        p = g.fresh(shape, a.dtype if g.chance(80) else g.input_dtype())
        if p is None:
            return
        parts.append(p)

    def values(o: TInfo):
        return (min(p.lo for p in parts), max(p.hi for p in parts), min(p.small for p in parts),
                max(_convert_err(p.err, p.mag, p.dtype, o.dtype) for p in parts))  # fmt: skip

    g.apply("concat", parts, {"axis": axis}, values)


def split(g: Gen) -> None:
    a = g.operand(lambda t: any(isinstance(d, int) and d >= 2 for d in t.tensor.shape))
    if a is None:
        return
    axis = g.pick([k for k, d in enumerate(a.tensor.shape) if isinstance(d, int) and d >= 2])
    n = a.tensor.shape[axis]
    cut = g.int(1, n - 1)
    sizes = [cut, n - cut] if g.chance(60) or n - cut < 2 else [cut, 1, n - cut - 1]
    g.apply("split", [a], {"axis": axis, "sizes": sizes}, _same(a))


def pad(g: Gen) -> None:
    a = g.operand(lambda t: t.tensor.ndim >= 1)
    if a is None:
        return
    pads = []
    for d in a.tensor.shape:
        lo_crop = -1 if isinstance(d, int) and d >= 3 else 0
        pads += [g.int(lo_crop, 2), g.int(lo_crop, 2)]
    value = g.pick([0.0, 1.5, -1.0, 0.1]) if a.is_float else g.pick([0, 3] + [2**33] * (a.dtype == "int64"))
    g.apply("pad", [a], {"pads": pads, "value": value},
            lambda o: (min(a.lo, value), max(a.hi, value), 0.0, a.err))  # fmt: skip


def gather(g: Gen) -> None:
    a = g.operand(lambda t: t.tensor.ndim >= 1)
    if a is None:
        return
    rank = a.tensor.ndim
    axis = g.int(-rank, rank - 1)
    size = a.tensor.shape[axis % rank]
    size_text = str(size) if isinstance(size, int) else sym_name(size)
    if size_text is None:
        return
    dtype = g.pick(["int64", "int32"])
    if g.chance(60):
        idx = g.new_input(g.random_shape(g.int(0, 2)), dtype, f"index:{size_text}")
        kind = "take"
    else:
        shape = [d if isinstance(d, int) else sym_name(d) for d in a.tensor.shape]
        if any(d is None for d in shape):
            return
        shape[axis % rank] = g.pick([1, 2, 3])
        idx = g.new_input(shape, dtype, f"index:{size_text}")
        kind = "gather_elements"
    if idx is None:
        return
    g.apply(kind, [a, idx], {"axis": axis}, _same(a))


def source(g: Gen) -> None:
    if g.chance(50):
        n = g.pick([3, 5, *g.bound_symbols])
        end = parse_dim(n) if isinstance(n, str) else n
        dtype = g.pick(["int64", "float32", "int32"])
        g.apply("arange", [], {"end": end, "dtype": dtype}, lambda o: (0, 8, 0, 0))
    else:
        shape = [g.pick([2, 3, 1]) for _ in range(g.int(0, 2))]
        dtype = g.input_dtype()
        value = {"bool": True, "int64": g.pick([-2, 2**40])}.get(dtype, 3 if dtype not in EPS else g.pick([1.25, 0.1]))
        g.apply("full", [], {"shape": shape, "value": value, "dtype": dtype}, lambda o: (value, value, abs(value), 0))


ACTIONS = {
    "unary_float": unary_float, "unary_same": unary_same, "clamp": clamp, "cast": cast, "arith": arith,
    "compare": compare, "where": where, "select_over_compare": select_over_compare, "reduce": reduce, "arg_reduce": arg_reduce,
    "cumsum": cumsum, "softmax": softmax, "norm": norm, "reshape": reshape, "flatten": flatten,
    "permute": permute, "squeeze_unsqueeze": squeeze_unsqueeze, "expand": expand, "tile_flip_tri": tile_flip_tri,
    "slice": slice_, "concat": concat, "split": split, "pad": pad, "gather": gather, "matmul": matmul,
    "projections": projections, "conv_pool": conv_pool, "attention": attention, "source": source,
    "refused": refused,
}  # fmt: skip

# How often each family is drawn: binary arithmetic (where broadcasting happens) most.
_WEIGHTS = {"refused": 2, "arith": 5, "unary_float": 2, "reduce": 2, "matmul": 2, "slice": 2, "concat": 2, "where": 2, "compare": 2,
            "select_over_compare": 3}
ACTION_CHOICES = [name for name in ACTIONS for _ in range(_WEIGHTS.get(name, 1))]
