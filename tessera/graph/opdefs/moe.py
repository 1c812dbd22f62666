"""fused_moe: a mixture-of-experts block (router, top-k, experts, combine, shared expert) as one operator.

Inputs: x [..., H]; router [E, H] (the router's linear weight); gate_up [E, 2I, H] (each expert's
gate rows then its up rows, transformers' fused layout); down [E, H, I]; optionally a shared
expert: shared_gate_up [2S, H] and shared_down [H, S], and with `shared_gated` a last input
shared_gate [1, H].  All float32 or all float64; the output is [..., H] of x's dtype.

Per token t (x_t a row of x):
- scores = softmax(router @ x_t) (`scoring` "softmax") or sigmoid(router @ x_t) ("sigmoid");
- the experts are chosen by scores + `choice_bias` (E floats, or None: zeros; DeepSeek-V3's
  correction bias), within the `topk_group` of `groups` equal groups of experts whose two best
  choice scores sum highest (groups 1: all experts);
- the `top_k` largest choice scores win (ties: the lower index first), their weights w the
  unbiased scores, divided by their sum when `normalize`, then multiplied by `scale`;
- y_t = sum_j w_j * down[e_j] @ (silu(g) * u), (g, u) = the halves of gate_up[e_j] @ x_t;
- plus the shared expert's output, times sigmoid(shared_gate @ x_t) when `shared_gated`.

It is an anchor with no generic lowering (tessera.templates.moe runs it: only the chosen
experts' weights are read); the reference below is the semantics the kernels are tested against.
"""

from __future__ import annotations

import numpy as np

from tessera.graph.registry import REQUIRED, register
from tessera.graph.symbolic import ShapeError
from tessera.ir import dtypes

SCORINGS = ("softmax", "sigmoid")
DTYPES = (dtypes.float32, dtypes.float64)


def _infer(xs, a):
    x, router, gate_up, down = xs[:4]
    if x.ndim < 1:
        raise ShapeError("fused_moe takes x [..., H], got a scalar")
    if any(t.dtype != x.dtype for t in xs) or x.dtype not in DTYPES:
        raise ShapeError(f"fused_moe takes float32 or float64 tensors of one dtype, got {[t.dtype.name for t in xs]}")
    if router.ndim != 2 or gate_up.ndim != 3 or down.ndim != 3:
        raise ShapeError("fused_moe takes router [E, H], gate_up [E, 2I, H] and down [E, H, I]")
    e, h = router.shape
    two_i = gate_up.shape[1]
    if isinstance(two_i, int) and two_i % 2:
        raise ShapeError(f"fused_moe: gate_up has {two_i} rows per expert, not gate and up halves")
    want = {"gate_up": (e, two_i, h), "down": (e, h, two_i // 2 if isinstance(two_i, int) else down.shape[2])}
    for name, t in (("gate_up", gate_up), ("down", down)):
        if tuple(t.shape) != want[name]:
            raise ShapeError(f"fused_moe: {name} is {list(t.shape)}, the router and x make it {list(want[name])}")
    if x.shape[-1] != h:
        raise ShapeError(f"fused_moe: x has {x.shape[-1]} features, the router {h}")
    if not 1 <= a["top_k"] <= e:
        raise ShapeError(f"fused_moe: top_k {a['top_k']} must be in [1, {e}] experts")
    groups, bias = a["groups"], a["choice_bias"]
    if isinstance(e, int) and (groups < 1 or e % groups or (groups > 1 and e // groups < 2)):
        raise ShapeError(f"fused_moe: {e} experts do not make {groups} groups of 2 or more")
    if not 1 <= a["topk_group"] <= groups or (isinstance(e, int) and a["top_k"] > a["topk_group"] * (e // groups)):
        raise ShapeError(f"fused_moe: topk_group {a['topk_group']} of {groups} groups cannot hold top_k {a['top_k']}")
    if bias is not None and (not isinstance(bias, (list, tuple)) or len(bias) != e):
        raise ShapeError(f"fused_moe: choice_bias must be {e} floats or None")
    if a["scoring"] not in SCORINGS:
        raise ShapeError(f"fused_moe: scoring must be one of {SCORINGS}, got {a['scoring']!r}")
    shared = xs[4:]
    if len(shared) not in (0, 2, 3) or (len(shared) == 3) != bool(a["shared_gated"]):
        raise ShapeError("fused_moe takes a shared expert as shared_gate_up and shared_down, plus shared_gate when "
                         "shared_gated")  # fmt: skip
    if shared:
        sgu, sd = shared[:2]
        s2 = sgu.shape[0]
        if sgu.ndim != 2 or sgu.shape[1] != h or sd.ndim != 2 or sd.shape[0] != h or 2 * sd.shape[1] != s2:
            raise ShapeError(f"fused_moe: the shared expert's weights {list(sgu.shape)} and {list(sd.shape)} are "
                             f"not [2S, {h}] and [{h}, S]")  # fmt: skip
        if len(shared) == 3 and tuple(shared[2].shape) != (1, h):
            raise ShapeError(f"fused_moe: shared_gate is {list(shared[2].shape)}, not [1, {h}]")
    return [(tuple(x.shape), x.dtype)]


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def route(x: np.ndarray, router: np.ndarray, a: dict) -> tuple[np.ndarray, np.ndarray]:
    """(experts [T, k] int64, weights [T, k] float64) of rows x [T, H]: the operator's routing."""
    logits = x @ router.T
    if a["scoring"] == "softmax":
        z = np.exp(logits - logits.max(axis=-1, keepdims=True))
        scores = z / z.sum(axis=-1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
    bias = a.get("choice_bias")  # (attributes a caller passes directly may leave out the defaults)
    choice = scores + (np.asarray(bias, np.float64) if bias is not None else 0.0)
    groups = a.get("groups", 1)
    if groups > 1:
        per = choice.reshape(len(choice), groups, -1)
        best2 = -np.sort(-per, axis=-1)[..., :2].sum(-1)
        keep = np.argsort(-best2, axis=-1, kind="stable")[:, : a.get("topk_group", 1)]
        masked = np.full(per.shape, -np.inf)
        np.put_along_axis(masked, keep[..., None], np.take_along_axis(per, keep[..., None], axis=1), axis=1)
        choice = masked.reshape(choice.shape)
    idx = np.argsort(-choice, axis=-1, kind="stable")[:, : a["top_k"]]  # stable: ties by the lower index
    w = np.take_along_axis(scores, idx, axis=-1)
    if a["normalize"]:
        w = w / w.sum(axis=-1, keepdims=True)
    return idx, w * a["scale"]


def _reference(xs, a):
    x = xs[0]
    rows = x.reshape(-1, x.shape[-1]).astype(np.float64)
    router, gate_up, down = (t.astype(np.float64) for t in xs[1:4])
    idx, w = route(rows, router, a)
    n = gate_up.shape[1] // 2
    y = np.zeros_like(rows)
    for t in range(rows.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            gu = gate_up[e] @ rows[t]
            y[t] += w[t, j] * (down[e] @ (_silu(gu[:n]) * gu[n:]))
    if len(xs) > 4:
        sgu, sd = (t.astype(np.float64) for t in xs[4:6])
        s = sgu.shape[0] // 2
        gu = rows @ sgu.T
        shared = (_silu(gu[:, :s]) * gu[:, s:]) @ sd.T
        if a["shared_gated"]:
            shared = shared / (1.0 + np.exp(-(rows @ xs[6].astype(np.float64).T)))
        y += shared
    return [y.reshape(x.shape).astype(x.dtype)]


register("fused_moe", infer=_infer, reference=_reference, category="anchor", num_inputs=(4, 7),
         attrs={"top_k": REQUIRED, "scoring": "softmax", "normalize": False, "scale": 1.0, "shared_gated": False,
                "groups": 1, "topk_group": 1, "choice_bias": None},
         doc="a mixture-of-experts block: router top-k, SiLU-gated experts, weighted combine, shared expert")  # fmt: skip
