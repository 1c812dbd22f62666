"""Rules for ONNX's matrix products (MatMul, Gemm, Einsum) and the quantization ops
(QuantizeLinear, DequantizeLinear, MatMulInteger, ConvInteger, QLinearMatMul, QLinearConv),
which decompose into casts, integer or float products and rounding."""

from __future__ import annotations

import numpy as np

from tessera.errors import UnsupportedError
from tessera.frontend.onnx.importer import ONNX_DTYPES, rule
from tessera.frontend.onnx.rules_nn import conv_nd, spatial_pads
from tessera.graph import Tensor


@rule("MatMul")
def _matmul(im, node, args, attrs):
    return im.op("matmul", args[0], args[1])


@rule("Gemm", attrs=("alpha", "beta", "transA", "transB"))
def _gemm(im, node, args, attrs):
    a, b = im.tensor(args[0]), im.tensor(args[1])
    c = args[2] if len(args) > 2 and args[2] is not None else None
    if attrs.get("transA", 0):
        a = im.op("permute", a, perm=[1, 0])
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    if attrs.get("transB", 0) and alpha == 1.0 and beta == 1.0 and (c is None or c.ndim == 1) and \
            (c is None or c.shape[0] == b.shape[0]):  # fmt: skip
        return im.op("linear", a, b, *([c] if c is not None else []))
    if attrs.get("transB", 0):
        b = im.op("permute", b, perm=[1, 0])
    y = im.op("matmul", a, b)
    if alpha != 1.0:
        y = im.op("mul", y, im.scalar(alpha, y))
    if c is not None:
        c = im.tensor(c)
        y = im.op("add", y, c if beta == 1.0 else im.op("mul", c, im.scalar(beta, c)))
    return y


# ---- einsum ----------------------------------------------------------------------------------------------------------
@rule("Einsum", attrs=("equation",))
def _einsum(im, node, args, attrs):
    ops = [im.tensor(a) for a in args]
    terms, out = _parse_einsum(attrs["equation"].decode(), ops)
    cur, cur_t = ops[0], terms[0]
    cur, cur_t = _einsum_single(im, cur, cur_t, keep=set(out) | {c for t in terms[1:] for c in t})
    for k in range(1, len(ops)):
        later = {c for t in terms[k + 1 :] for c in t}
        nxt, nxt_t = _einsum_single(im, ops[k], terms[k], keep=set(out) | set(cur_t) | later)
        cur, cur_t = _einsum_pair(im, cur, cur_t, nxt, nxt_t, keep=set(out) | later)
    cur, cur_t = _einsum_single(im, cur, cur_t, keep=set(out))
    return im.op("permute", cur, perm=[cur_t.index(c) for c in out]) if cur_t != out else cur


def _parse_einsum(eq: str, ops: list[Tensor]) -> tuple[list[str], str]:
    """Terms with '...' replaced by upper-case letters (one per broadcast dim, right-aligned)."""
    eq = eq.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ops):
        raise UnsupportedError(f"einsum equation {eq!r} has {len(terms)} operands, the node {len(ops)}")
    ell = max((t.ndim - len(term.replace("...", "")) for t, term in zip(ops, terms) if "..." in term), default=0)
    fill = "".join(chr(ord("A") + i) for i in range(ell))
    out_terms = []
    for t, term in zip(ops, terms):
        if "..." in term:
            n = t.ndim - len(term.replace("...", ""))
            term = term.replace("...", fill[ell - n :])
        if len(term) != t.ndim:
            raise UnsupportedError(f"einsum term {term!r} does not match an operand of rank {t.ndim}")
        out_terms.append(term)
    if arrow:
        out = rhs.replace("...", fill)
    else:  # implicit output: the broadcast dims, then the letters used once, in alphabetical order
        counts = {c: sum(term.count(c) for term in out_terms) for c in set("".join(out_terms))}
        out = fill + "".join(sorted(c for c, n in counts.items() if n == 1 and c.islower()))
    return out_terms, out


def _einsum_single(im, x: Tensor, term: str, keep: set[str]) -> tuple[Tensor, str]:
    """Diagonals of repeated letters, then sums over letters needed nowhere else."""
    while len(set(term)) < len(term):
        c = next(ch for ch in term if term.count(ch) > 1)
        i, j = term.index(c), term.index(c, term.index(c) + 1)
        rest = [k for k in range(len(term)) if k not in (i, j)]
        n = x.shape[i]
        y = im.op("permute", x, perm=[*rest, i, j])
        y = im.op("reshape", y, shape=[*[x.shape[k] for k in rest], -1])
        x = im.op("slice", y, axes=[len(rest)], starts=[0], ends=[n * n], steps=[n + 1])  # the diagonal
        term = "".join(term[k] for k in rest) + c
    drop = [k for k, ch in enumerate(term) if ch not in keep]
    if drop:
        x = im.op("reduce_sum", x, axes=drop, keepdim=False)
        term = "".join(ch for k, ch in enumerate(term) if k not in drop)
    return x, term


def _einsum_pair(im, a: Tensor, ta: str, b: Tensor, tb: str, keep: set[str]) -> tuple[Tensor, str]:
    """a and b contracted over the letters they share that are not kept: a batched matmul."""
    batch = [c for c in ta if c in tb and c in keep]
    contract = [c for c in ta if c in tb and c not in keep]
    left = [c for c in ta if c not in tb]
    right = [c for c in tb if c not in ta]
    dim = {c: a.shape[ta.index(c)] for c in ta}
    dim.update({c: b.shape[tb.index(c)] for c in tb if c not in dim or dim[c] == 1})

    def group(x, t, first, second):
        x = im.op("permute", x, perm=[t.index(c) for c in batch + first + second])
        sizes = [x.shape[k] for k in range(len(batch))]
        return im.op("reshape", x, shape=[*sizes, _prod([dim[c] for c in first]), _prod([dim[c] for c in second])])

    am = group(a, ta, left, contract)
    bm = group(b, tb, contract, right)
    y = im.op("matmul", am, bm)  # batch dims broadcast
    y = im.op("reshape", y, shape=[*y.shape[: len(batch)], *[dim[c] for c in left], *[dim[c] for c in right]])
    return y, "".join(batch + left + right)


def _prod(dims):
    n = 1
    for d in dims:
        n = n * d
    return n


# ---- quantization --------------------------------------------------------------------------------------------------
def _per_axis(im, param: Tensor, x: Tensor, axis: int, block: int) -> Tensor:
    """A scale or zero point shaped to broadcast against x: a scalar, one value per entry of
    axis, or (blocked quantization) one per block of `block` entries along axis."""
    if param.ndim == 0 or (param.ndim == 1 and param.shape[0] == 1):
        return im.op("reshape", param, shape=[])
    axis %= x.ndim
    if block:
        idx = Tensor.constant(np.arange(x.shape[axis], dtype=np.int64) // block)
        return im.op("take", param, idx, axis=axis)
    return im.op("reshape", param, shape=[x.shape[axis] if i == axis else 1 for i in range(x.ndim)])


def dequantize(im, x: Tensor, scale: Tensor, zp: Tensor | None, axis: int = 1, block: int = 0,
               out: str | None = None) -> Tensor:  # fmt: skip
    """(x - zero_point) * scale, in float32, as the scale's dtype (or out)."""
    dx = im.op("cast", x, dtype="float32")
    if zp is not None:
        dx = im.op("sub", dx, im.op("cast", _per_axis(im, zp, x, axis, block), dtype="float32"))
    y = im.op("mul", dx, im.op("cast", _per_axis(im, scale, x, axis, block), dtype="float32"))
    return im.op("cast", y, dtype=out or scale.dtype.name)


def quantize(im, x: Tensor, scale: Tensor, zp: Tensor | None, dtype: str, axis: int = 1, block: int = 0) -> Tensor:
    """clip(round_half_even(x / scale) + zero_point) in dtype."""
    if dtype not in ("uint8", "int8", "uint16", "int16"):
        raise UnsupportedError(f"quantizing to {dtype} is not supported")
    ct = "float32" if x.dtype.name in ("float16", "bfloat16") or scale.dtype.name in ("float16", "bfloat16") \
        else x.dtype.name  # fmt: skip
    q = im.op("div", im.op("cast", x, dtype=ct), im.op("cast", _per_axis(im, scale, x, axis, block), dtype=ct))
    q = im.op("cast", im.op("round", q), dtype="int32")
    if zp is not None:
        q = im.op("add", q, im.op("cast", _per_axis(im, zp, x, axis, block), dtype="int32"))
    info = np.iinfo(dtype)
    return im.op("cast", im.op("clamp", q, min=int(info.min), max=int(info.max)), dtype=dtype)


def _opt(args, k):
    return args[k] if len(args) > k and args[k] is not None else None


@rule("DequantizeLinear", attrs=("axis", "block_size", "output_dtype"))
def _dequantize(im, node, args, attrs):
    x, scale, zp = im.tensor(args[0]), im.tensor(args[1]), _opt(args, 2)
    out = ONNX_DTYPES.get(attrs["output_dtype"]) if attrs.get("output_dtype") else None
    return dequantize(im, x, scale, zp, int(attrs.get("axis", 1)), int(attrs.get("block_size", 0)), out)


@rule("QuantizeLinear", attrs=("axis", "block_size", "output_dtype", "saturate", "precision"))
def _quantize(im, node, args, attrs):
    # saturate only concerns float8 outputs (refused); integer outputs always saturate
    x, scale, zp = im.tensor(args[0]), im.tensor(args[1]), _opt(args, 2)
    dtype = zp.dtype.name if zp is not None else ONNX_DTYPES.get(attrs.get("output_dtype") or 2)
    if attrs.get("precision"):
        x = im.op("cast", x, dtype=ONNX_DTYPES[attrs["precision"]])
    return quantize(im, x, scale, zp, dtype, int(attrs.get("axis", 1)), int(attrs.get("block_size", 0)))


def _centered(im, x: Tensor, zp: Tensor | None) -> Tensor:
    y = im.op("cast", x, dtype="int32")
    return y if zp is None else im.op("sub", y, im.op("cast", zp, dtype="int32"))


@rule("MatMulInteger")
def _matmul_integer(im, node, args, attrs):
    a, b = im.tensor(args[0]), im.tensor(args[1])
    a_zp, b_zp = _opt(args, 2), _opt(args, 3)
    if a_zp is not None and a_zp.ndim == 1 and a.ndim >= 2 and a_zp.shape[0] != 1:  # per row of a
        a_zp = im.op("reshape", a_zp, shape=[-1, 1])
    return im.op("matmul", _centered(im, a, a_zp), _centered(im, b, b_zp))


@rule("QLinearMatMul")
def _qlinear_matmul(im, node, args, attrs):
    a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp = args
    acc = im.op("matmul", _centered(im, im.tensor(a), a_zp), _centered(im, im.tensor(b), b_zp))
    # ONNX's reference: acc * (a_scale * b_scale / y_scale) + y_zero_point, rounded half to even
    # (an int32 times a float16 or float32 is a float64 in numpy)
    mult = im.op("div", im.op("mul", a_scale, b_scale), y_scale)
    d = im.op("mul", im.op("cast", acc, dtype="float64"), im.op("cast", mult, dtype="float64"))
    if y_zp is not None:
        d = im.op("add", d, im.op("cast", y_zp, dtype="float64"))
    dtype = (y_zp if y_zp is not None else im.tensor(a)).dtype.name
    info = np.iinfo(dtype)
    return im.op("cast", im.op("clamp", im.op("round", d), min=float(info.min), max=float(info.max)), dtype=dtype)


def _conv_args(x, w, attrs):
    n = w.ndim - 2
    k = [int(d) for d in w.shape[2:]]
    strides = list(attrs.get("strides", [1] * n))
    dil = list(attrs.get("dilations", [1] * n))
    begins, ends = spatial_pads(x, attrs, k, strides, dil)
    return strides, begins, ends, dil, int(attrs.get("group", 1))


_CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


@rule("ConvInteger", attrs=_CONV_ATTRS)
def _conv_integer(im, node, args, attrs):
    x, w = im.tensor(args[0]), im.tensor(args[1])
    w_zp = _opt(args, 3)
    if w_zp is not None and im.tensor(w_zp).ndim == 1:  # one zero point per output channel
        w_zp = im.op("reshape", w_zp, shape=[-1] + [1] * (w.ndim - 1))
    xc, wc = _centered(im, x, _opt(args, 2)), _centered(im, w, w_zp)
    # the products of 8-bit values summed in float64 are exact; the result is int32
    y = conv_nd(im, im.op("cast", xc, dtype="float64"), im.op("cast", wc, dtype="float64"), None,
                *_conv_args(x, w, attrs))  # fmt: skip
    return im.op("cast", y, dtype="int32")


@rule("QLinearConv", attrs=_CONV_ATTRS)
def _qlinear_conv(im, node, args, attrs):
    x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp = args[:8]
    bias = _opt(args, 8)
    x, w = im.tensor(x), im.tensor(w)
    xf = dequantize(im, x, x_scale, x_zp, out="float32")
    wf = dequantize(im, w, w_scale, w_zp, axis=0, out="float32")
    if bias is not None:  # int32, scaled by x_scale * w_scale
        scale = im.op("mul", im.op("cast", x_scale, dtype="float32"), im.op("cast", w_scale, dtype="float32"))
        bias = im.op("mul", im.op("cast", bias, dtype="float32"), scale)
    y = conv_nd(im, xf, wf, bias, *_conv_args(x, w, attrs))
    return quantize(im, y, y_scale, y_zp, (y_zp if y_zp is not None else x).dtype.name)


@rule("Det")
def _det(im, node, args, attrs):
    return im.op("det", args[0])
