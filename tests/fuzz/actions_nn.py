"""The fuzzer's contractions and neural-network operators: matmul/linear (and parallel
projections that merge_qkv fuses), conv2d, the poolings, batch_norm and attention."""

from __future__ import annotations

import math
from typing import Any

from .generate import EPS, Gen, TInfo, _convert_err, _round, sym_name


def _numeric(t: TInfo) -> bool:
    return t.dtype != "bool"


def matmul(g: Gen) -> None:
    a = g.operand(lambda t: t.tensor.ndim >= 1 and _numeric(t))
    if a is None:
        return
    k_dim = a.tensor.shape[-1]
    k = k_dim if isinstance(k_dim, int) else sym_name(k_dim)
    if k is None:
        return
    kind = "linear" if g.chance(25) else "matmul"
    dtype = a.dtype if g.chance(80) else g.input_dtype("fi")
    n = g.pick([3, 1, 4, 2])
    if kind == "linear":
        w = g.fresh([n, k], dtype)
        bias = g.fresh([n], dtype) if w is not None and g.chance(50) else None
        operands = [a, w] + ([bias] if bias is not None else [])
    else:
        shape: list[Any] = [k] if g.chance(20) else [k, n]
        if len(shape) == 2 and g.chance(30):
            shape.insert(0, g.pick([1, 2]))
        w = g.fresh(shape, dtype)
        operands = [a, w]
    if any(t is None for t in operands):
        return
    kk = max(s[-1] for s in a.shapes)

    def values(o: TInfo):
        x, y = operands[0], operands[1]
        ex, ey = _convert_err(x.err, x.mag, x.dtype, o.dtype), _convert_err(y.err, y.mag, y.dtype, o.dtype)
        m = kk * x.mag * y.mag + (operands[2].mag if len(operands) > 2 else 0)
        if not o.is_float:
            return -m, m, 0, 0
        acc = EPS["float32"]
        err = kk * (y.mag * ex + x.mag * ey) + 2 * kk * kk * acc * x.mag * y.mag + _round(o.dtype, m, 2)
        return -m, m, 0.0, err

    g.apply(kind, operands, {}, values)


def projections(g: Gen) -> None:
    """Two or three linear (or matmul) layers of one input with constant weights: the
    merge_qkv pass turns them into one wide GEMM and a split."""
    a = g.operand(lambda t: t.is_float and t.tensor.ndim >= 2 and isinstance(t.tensor.shape[-1], int))
    if a is None:
        return
    k = a.tensor.shape[-1]
    kind = g.pick(["linear", "matmul"])
    bias = kind == "linear" and g.chance(50)
    for _ in range(g.int(2, 3)):
        n = g.pick([2, 3, 4])
        w = g.new_input([n, k] if kind == "linear" else [k, n], a.dtype, "signed", constant=True)
        b = g.new_input([n], a.dtype, "signed", constant=True) if bias else None
        if w is None:
            return
        operands = [a, w] + ([b] if b is not None else [])

        def values(o: TInfo, w: TInfo = w, b: TInfo | None = b):
            m = k * a.mag * w.mag + (b.mag if b is not None else 0.0)
            err = k * w.mag * a.err + 2 * k * k * EPS["float32"] * a.mag * w.mag + _round(o.dtype, m, 2)
            return -m, m, 0.0, err

        g.apply(kind, operands, {}, values)


def _image(g: Gen) -> TInfo | None:
    """A float NCHW tensor from the pool, or a fresh one."""
    a = g.operand(lambda t: t.is_float and t.tensor.ndim == 4 and all(isinstance(d, int) for d in t.tensor.shape[1:]))
    if a is not None and g.chance(70):
        return a
    n = g.pick([1, 2, *g.symbols])
    return g.fresh([n, g.pick([1, 2, 3, 4]), g.pick([4, 5, 6, 7]), g.pick([4, 5, 6, 7])], g.pick(["float32", "float16"]))


def conv_pool(g: Gen) -> None:
    """conv2d, the poolings and batch_norm over NCHW tensors."""
    x = _image(g)
    if x is None:
        return
    _, c, h, w = x.tensor.shape
    kind = g.pick(["conv2d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "batch_norm"])
    k = (g.int(1, min(3, h)), g.int(1, min(3, w)))
    if kind == "conv2d":
        groups = g.pick([1] + [d for d in (2, c) if d > 1 and c % d == 0])
        o = groups * g.pick([1, 2])
        weight = g.fresh([o, c // groups, *k], x.dtype)
        bias = g.fresh([o], x.dtype) if weight is not None and g.chance(50) else None
        if weight is None:
            return
        attrs = {"stride": [g.int(1, 2), g.int(1, 2)], "dilation": [g.int(1, 2), 1], "groups": groups,
                 "padding": [g.int(0, 1) for _ in range(4)]}  # fmt: skip
        operands = [x, weight] + ([bias] if bias is not None else [])
        kk = (c // groups) * k[0] * k[1]

        def conv_values(o: TInfo):
            m = kk * x.mag * weight.mag + (bias.mag if bias is not None else 0.0)
            ex = _convert_err(x.err, x.mag, x.dtype, o.dtype)
            err = kk * weight.mag * ex + 2 * kk * kk * EPS["float32"] * x.mag * weight.mag + _round(o.dtype, m, 2)
            return -m, m, 0.0, err

        g.apply("conv2d", operands, attrs, conv_values)
    elif kind in ("max_pool2d", "avg_pool2d"):
        pad = [g.int(0, k[0] // 2), g.int(0, k[1] // 2)]
        attrs = {"kernel": list(k), "stride": g.pick([None, [1, 1], [2, 1]]), "padding": pad + pad,
                 "ceil_mode": g.chance(30)}  # fmt: skip
        if kind == "avg_pool2d":
            attrs["count_include_pad"] = g.chance(50)
            n = k[0] * k[1]
            g.apply(kind, [x], attrs, lambda o: (min(x.lo, 0), max(x.hi, 0), 0.0,
                                                 x.err + 2 * n * EPS["float32"] * x.mag + _round(o.dtype, x.mag, 2)))
        else:
            g.apply(kind, [x], attrs, lambda o: (x.lo, x.hi, 0.0, x.err))
    elif kind == "adaptive_avg_pool2d":
        size = [g.int(1, 3), g.int(1, 3)]
        n = h * w
        g.apply(kind, [x], {"output_size": size},
                lambda o: (x.lo, x.hi, 0.0, x.err + 2 * n * EPS["float32"] * x.mag + _round(o.dtype, x.mag, 2)))
    else:
        params = [g.fresh([c], x.dtype, d) for d in ("signed", "positive", "signed", "signed")]
        if any(p is None for p in params):
            return
        mean, var, weight, bias = params
        eps = g.pick([1e-5, 0.1])
        amp = 1 / math.sqrt(var.lo + eps)

        def bn_values(o: TInfo):
            m = (x.mag + mean.mag) * amp * weight.mag + bias.mag
            return -m, m, 0.0, amp * weight.mag * x.err + _round(o.dtype, m, 6)

        g.apply("batch_norm", [x, mean, var, weight, bias], {"eps": eps}, bn_values)


def attention(g: Gen) -> None:
    """scaled_dot_product_attention on fresh [B, H, S, D] q, k, v (grouped heads, masks, causal)."""
    dtype = g.pick(["float32", "float16"])
    b, hq, s, d = g.pick([1, 2, *g.symbols]), g.pick([1, 2, 4]), g.pick([1, 3, 5, *g.symbols]), g.pick([2, 4, 8])
    hk = g.pick([h for h in (1, 2, hq) if hq % h == 0])
    sk = g.pick([s, 4])
    q, k, v = g.fresh([b, hq, s, d], dtype), g.fresh([b, hk, sk, d], dtype), g.fresh([b, hk, sk, d], dtype)
    if q is None or k is None or v is None:
        return
    operands = [q, k, v]
    if g.chance(40):
        mask = g.fresh(g.pick([[s, sk], [b, 1, s, sk], [1, sk]]), g.pick([dtype, "float32"]))
        if mask is None:
            return
        operands.append(mask)
    attrs = {"causal": g.chance(30) and sk == s, "scale": g.pick([None, 0.5])}
    scale = attrs["scale"] or 1 / math.sqrt(d)

    def values(o: TInfo):
        err_s = d * scale * (k.mag * q.err + q.mag * k.err) + 4 * d * EPS["float32"] * scale * q.mag * k.mag
        if len(operands) == 4:
            err_s += operands[3].err
        n = max(sh[2] for sh in k.shapes)
        err = 2 * err_s * v.mag + v.err + 4 * n * EPS["float32"] * v.mag + _round(o.dtype, v.mag, 4)
        return v.lo, v.hi, 0.0, err

    g.apply("scaled_dot_product_attention", operands, attrs, values)




def refused(g: Gen) -> None:
    """Operators the lowering declines, each for a documented reason: they run in their numpy
    reference (logged), and the fuzzer checks that path and counts them as refusals."""
    case = g.pick(["int_activation", "bool_clamp", "int_pow", "pool_padding", "negative_step", "int_conv"])
    if case == "int_activation":
        a = g.operand(lambda t: t.dtype in ("int32", "int64") and t.mag < 1e6)
        if a is not None:
            kind = g.pick(["leaky_relu", "elu"])
            attrs = {"negative_slope": 0.5} if kind == "leaky_relu" else {"alpha": 2.0}
            g.apply(kind, [a], attrs, lambda o: (min(a.lo, -3), max(a.hi, 0), 0, 0))
    elif case == "bool_clamp":
        a = g.operand(lambda t: t.dtype == "bool")
        if a is not None:
            g.apply("clamp", [a], {"min": None, "max": 0}, lambda o: (0, 1, 0, 0))
    elif case == "int_pow":
        a = g.operand(lambda t: t.dtype in ("int32", "int64") and t.exact and t.mag <= 9)
        if a is not None:
            e = g.fresh([d if isinstance(d, int) else sym_name(d) or 1 for d in a.tensor.shape], a.dtype, "exp_small")
            if e is not None:
                g.apply("pow", [a, e], {}, lambda o: (-(a.mag**3), a.mag**3, 0, 0))
    elif case == "pool_padding":
        x = _image(g)
        if x is not None:
            kind = g.pick(["max_pool2d", "avg_pool2d"])
            attrs = {"kernel": [3, 3], "padding": [0, 1, 1, 0]}  # asymmetric
            g.apply(kind, [x], attrs, lambda o: (min(x.lo, 0), max(x.hi, 0), 0.0, x.err + _round(o.dtype, x.mag, 20)))
    elif case == "negative_step":
        a = g.operand(lambda t: any(sym_name(d) for d in t.tensor.shape))
        if a is not None:
            axis = next(k for k, d in enumerate(a.tensor.shape) if sym_name(d))
            attrs = {"axes": [axis], "starts": [-1], "ends": [-(2**62)], "steps": [-1]}
            g.apply("slice", [a], attrs, lambda o: (a.lo, a.hi, a.small, a.err))
    else:
        x = g.fresh([1, 2, 4, 4], "int32")
        w = g.fresh([2, 2, 2, 2], "int32")
        if x is not None and w is not None:
            m = 8 * x.mag * w.mag
            g.apply("conv2d", [x, w], {}, lambda o: (-m, m, 0, 0))
