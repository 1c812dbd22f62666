"""Anchor operators of the transformer models: matmul, linear and scaled-dot-product attention."""

from __future__ import annotations

import math

import numpy as np

from tessera.graph.opdefs._common import upcast
from tessera.graph.registry import register
from tessera.graph.symbolic import ShapeError, broadcast_shapes
from tessera.ir.dtypes import promote


def _check_eq(a, b, what: str) -> None:
    if isinstance(a, int) and isinstance(b, int) and a != b:
        raise ShapeError(f"{what}: {a} != {b}")


def _matmul_infer(xs, a):
    x, y = xs
    if x.ndim == 0 or y.ndim == 0:
        raise ShapeError("matmul does not take scalars")
    xs_, ys_ = list(x.shape), list(y.shape)
    if x.ndim == 1:
        xs_ = [1] + xs_
    if y.ndim == 1:
        ys_ = ys_ + [1]
    _check_eq(xs_[-1], ys_[-2], f"matmul contraction of {x.shape} and {y.shape}")
    batch = broadcast_shapes(xs_[:-2], ys_[:-2])
    out = list(batch) + ([xs_[-2]] if x.ndim > 1 else []) + ([ys_[-1]] if y.ndim > 1 else [])
    return [(tuple(out), promote(x.dtype, y.dtype))]


register("matmul", infer=_matmul_infer, category="anchor", num_inputs=2,
         reference=lambda xs, a: [np.matmul(upcast(xs[0]), upcast(xs[1]))],
         doc="numpy matmul semantics: batched, broadcast batch dims, 1-D operands promoted")  # fmt: skip


def _linear_infer(xs, a):
    x, w = xs[0], xs[1]
    if w.ndim != 2:
        raise ShapeError(f"linear weight must be [out, in], got {w.shape}")
    _check_eq(x.shape[-1], w.shape[1], f"linear input {x.shape} against weight {w.shape}")
    if len(xs) == 3 and xs[2].shape != (w.shape[0],):
        raise ShapeError(f"linear bias {xs[2].shape} does not match weight {w.shape}")
    return [((*x.shape[:-1], w.shape[0]), promote(x.dtype, w.dtype))]


def _linear_ref(xs, a):
    y = upcast(xs[0]) @ upcast(xs[1]).T
    if len(xs) == 3:
        y = y + upcast(xs[2])
    return [y]


register("linear", infer=_linear_infer, reference=_linear_ref, category="anchor", num_inputs=(2, 3),
         doc="y = x @ weight.T + bias, weight [out, in] (torch.nn.functional.linear)")  # fmt: skip


def _sdpa_infer(xs, a):
    q, k, v = xs[:3]
    if q.ndim < 2 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ShapeError(f"attention takes q, k, v of equal rank >= 2, got {q.shape}, {k.shape}, {v.shape}")
    _check_eq(q.shape[-1], k.shape[-1], "attention q/k head size")
    _check_eq(k.shape[-2], v.shape[-2], "attention k/v length")
    batch = list(broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])) if q.ndim > 3 else []
    if q.ndim >= 3:
        hq, hk = q.shape[-3], k.shape[-3]
        _check_eq(hk, v.shape[-3], "attention k/v heads")
        if isinstance(hq, int) and isinstance(hk, int) and hq % hk:
            raise ShapeError(f"{hq} query heads are not a multiple of {hk} key/value heads")
        if hq != hk and not (isinstance(hq, int) and isinstance(hk, int)):
            raise ShapeError("grouped key/value heads need static head counts")
        batch.append(hq)
    if len(xs) == 4:
        broadcast_shapes(xs[3].shape, (*batch, q.shape[-2], k.shape[-2]))
    return [((*batch, q.shape[-2], v.shape[-1]), q.dtype)]


def _sdpa_ref(xs, a):
    q, k, v = (upcast(t) for t in xs[:3])
    if q.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]  # query head h reads key/value head h // rep
        k, v = np.repeat(k, rep, axis=-3), np.repeat(v, rep, axis=-3)
    scale = a["scale"] if a["scale"] is not None else 1 / math.sqrt(q.shape[-1])
    s = (q @ np.swapaxes(k, -1, -2)) * np.asarray(scale, dtype=q.dtype)
    if a["causal"]:
        L, S = q.shape[-2], k.shape[-2]
        s = np.where(np.tril(np.ones((L, S), dtype=bool)), s, -np.inf)
    if len(xs) == 4:
        mask = xs[3]
        s = np.where(mask, s, -np.inf) if mask.dtype == np.bool_ else s + upcast(mask)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    p = e / e.sum(axis=-1, keepdims=True)
    return [p @ v]


register("scaled_dot_product_attention", infer=_sdpa_infer, reference=_sdpa_ref, category="anchor",
         num_inputs=(3, 4), attrs={"causal": False, "scale": None},
         doc="softmax(q k^T * scale + mask) v over [..., heads, len, dim]; k/v may have fewer heads "
             "(grouped: query head h uses kv head h // (Hq/Hkv)); a bool mask keeps True entries, a "
             "float mask is added; causal keeps the lower triangle aligned at the top left, like torch")  # fmt: skip



def _det_infer(xs, a):
    x = xs[0]
    if x.ndim < 2 or (isinstance(x.shape[-1], int) and x.shape[-1] != x.shape[-2]):
        raise ShapeError(f"det needs square matrices [..., n, n], got {x.shape}")
    return [(x.shape[:-2], x.dtype)]


register("det", infer=_det_infer, reference=lambda xs, a: [np.linalg.det(upcast(xs[0]))], category="opaque",
         doc="determinants of the trailing square matrices")  # fmt: skip
